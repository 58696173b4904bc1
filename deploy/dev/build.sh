#!/usr/bin/env bash
# Builds the operator tests' binaries from Go modules into a cache keyed by their versions:
# kube-apiserver, kube-scheduler, kube-controller-manager (k8s/), etcd (etcd/), kwok (kwok/),
# helm (helm/). Built once per machine; progress goes to stderr, the cache directory to stdout.
# `build.sh --where` prints the directory without building anything.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
key="$(cat "$here"/*/go.mod "$here"/*/go.sum 2>/dev/null | sha256sum | cut -c1-12)"
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
  step "kube-apiserver, kube-scheduler, kube-controller-manager (k8s.io/kubernetes)"
  (cd "$here/k8s" && go build "${flags[@]}" -o "$out/" \
    k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-scheduler \
    k8s.io/kubernetes/cmd/kube-controller-manager)
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
  step "helm"
  (cd "$here/helm" && go build "${flags[@]}" -o "$out/" helm.sh/helm/v3/cmd/helm)
  # Not a binary: KubeRay's RayService CRD, from its module (kuberay/), for the chart's Ray
  # Serve mode (tests/k8s/test_helm.py applies the RayService it renders).
  step "KubeRay's RayService CRD"
  (cd "$here/kuberay" && go mod download github.com/ray-project/kuberay/ray-operator)
  kuberay="$(cd "$here/kuberay" && go list -m -f '{{.Dir}}' github.com/ray-project/kuberay/ray-operator)"
  cp "$kuberay/config/crd/bases/ray.io_rayservices.yaml" "$out/"
  touch "$out/.complete"
  step "done"
fi
echo "$out"
