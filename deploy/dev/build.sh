#!/usr/bin/env bash
# Builds the operator tests' binaries from Go modules into a cache keyed by their versions:
# kube-apiserver, kube-scheduler, kube-controller-manager, kubectl (k8s/), etcd (etcd/), kwok
# (kwok/), helm (helm/), prometheus and promtool (prometheus/). Built once per machine; progress
# goes to stderr, the cache directory to stdout. `build.sh --where` prints the directory without building anything.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# This script is part of the key: a change to how the binaries are built rebuilds them.
key="$(cat "$here/build.sh" "$here"/*/go.mod "$here"/*/go.sum 2>/dev/null | sha256sum | cut -c1-12)"
out="${BATON_DEV_BIN:-$HOME/.cache/baton/dev-$key}"
if [ "${1:-}" = "--where" ]; then
  echo "$out"
  exit 0
fi
# .complete is written last: a directory without it (an interrupted build) is built again.
if [ ! -e "$out/.complete" ]; then
  started=$SECONDS
  step() { echo "deploy/dev: $* ($((SECONDS - started)) s so far)" >&2; }
  step "building the Kubernetes test binaries into $out; 10-20 minutes with no Go cache"
  mkdir -p "$out"
  flags=(-trimpath -ldflags "-s -w")
  step "kube-apiserver, kube-scheduler, kube-controller-manager, kubectl (k8s.io/kubernetes)"
  # Kubernetes' own build stamps its version in with -X; a plain `go build` leaves
  # v0.0.0-master, which `kubectl version` and version-gated clients reject. The module records
  # no commit, so gitCommit stays empty; buildDate is the release's publication time, so two
  # builds of the same module are identical.
  k8s="$(cd "$here/k8s" && go list -m -f '{{.Version}} {{.Time.UTC.Format "2006-01-02T15:04:05Z"}}' \
    k8s.io/kubernetes)"
  read -r k8s_version k8s_date <<<"$k8s"
  IFS=. read -r k8s_major k8s_minor _ <<<"${k8s_version#v}"
  k8s_ldflags="-s -w"
  for package in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    k8s_ldflags+=" -X $package.gitVersion=$k8s_version -X $package.gitMajor=$k8s_major"
    k8s_ldflags+=" -X $package.gitMinor=$k8s_minor -X $package.gitTreeState=clean"
    k8s_ldflags+=" -X $package.gitCommit= -X $package.buildDate=$k8s_date"
  done
  (cd "$here/k8s" && go build -trimpath -ldflags "$k8s_ldflags" -o "$out/" \
    k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-scheduler \
    k8s.io/kubernetes/cmd/kube-controller-manager k8s.io/kubernetes/cmd/kubectl)
  step "etcd"
  (cd "$here/etcd" && go build "${flags[@]}" -o "$out/etcd" .)
  step "kwok"
  (cd "$here/kwok" && go build "${flags[@]}" -o "$out/" sigs.k8s.io/kwok/cmd/kwok)
  # kwok's own stages (in its module): nodes become Ready and heartbeat, pods run and end
  stages="$(cd "$here/kwok" && go list -m -f '{{.Dir}}' sigs.k8s.io/kwok)/kustomize/stage"
  mkdir -p "$out/kwok-stages"
  cp "$stages/node/fast/node-initialize.yaml" \
     "$stages/node/heartbeat-with-lease/node-heartbeat-with-lease.yaml" \
     "$stages/pod/fast/pod-ready.yaml" "$stages/pod/fast/pod-complete.yaml" \
     "$stages/pod/fast/pod-delete.yaml" "$out/kwok-stages/"
  # kwok's Logs and PortForward CRDs: the dev cluster's kubelet (rigs/kubelet.py) names each
  # pod's log file and address in them, so `kubectl logs` and `kubectl port-forward` work
  mkdir -p "$out/kwok-crds"
  cp "$stages/../crd/bases/kwok.x-k8s.io_logs.yaml" \
     "$stages/../crd/bases/kwok.x-k8s.io_portforwards.yaml" "$out/kwok-crds/"
  step "helm"
  (cd "$here/helm" && go build "${flags[@]}" -o "$out/" helm.sh/helm/v3/cmd/helm)
  # Not a binary: KubeRay's RayService CRD, from its module (kuberay/), for the chart's Ray
  # Serve mode (tests/k8s/test_helm.py applies the RayService it renders).
  step "KubeRay's RayService CRD"
  (cd "$here/kuberay" && go mod download github.com/ray-project/kuberay/ray-operator)
  kuberay="$(cd "$here/kuberay" && go list -m -f '{{.Dir}}' github.com/ray-project/kuberay/ray-operator)"
  cp "$kuberay/config/crd/bases/ray.io_rayservices.yaml" "$out/"
  # remove_all_sd leaves static and file targets, all the tests use, out of Prometheus' forty
  # service discoveries (cloud SDKs, most of its build); without builtinassets the web UI is
  # absent and the HTTP API the tests query is whole.
  step "prometheus, promtool"
  (cd "$here/prometheus" && go build "${flags[@]}" -tags remove_all_sd -o "$out/" \
    github.com/prometheus/prometheus/cmd/prometheus github.com/prometheus/prometheus/cmd/promtool)
  # Not binaries: the Prometheus Operator's monitoring.coreos.com CRDs, from its module, for
  # the chart's ServiceMonitor, PodMonitor and PrometheusRule (tests/k8s/test_helm.py).
  step "the Prometheus Operator's CRDs"
  (cd "$here/prometheus-operator" && go mod download github.com/prometheus-operator/prometheus-operator)
  operator="$(cd "$here/prometheus-operator" && go list -m -f '{{.Dir}}' \
    github.com/prometheus-operator/prometheus-operator)"
  mkdir -p "$out/monitoring-crds"
  for kind in servicemonitors podmonitors prometheusrules; do
    cp "$operator/example/prometheus-operator-crd/monitoring.coreos.com_$kind.yaml" \
      "$out/monitoring-crds/"
  done
  touch "$out/.complete"
  step "done"
fi
echo "$out"
