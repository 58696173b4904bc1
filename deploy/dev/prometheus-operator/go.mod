// The Prometheus Operator's module, for its monitoring.coreos.com CRDs
// (example/prometheus-operator-crd), which build.sh copies into the cache so the chart's
// ServiceMonitor, PodMonitor and PrometheusRule are created on the tests' API server: nothing is
// built from it, and no package imports it (`go mod tidy` would drop the require).
module baton.dev/devtools/prometheus-operator

go 1.26.0

require github.com/prometheus-operator/prometheus-operator v0.85.0
