// KubeRay's ray-operator module, for its RayService CRD (config/crd/bases), which build.sh
// copies into the cache: nothing is built from it, and no package imports it (`go mod tidy`
// would drop the require).
module baton.dev/devtools/kuberay

go 1.26.0

require github.com/ray-project/kuberay/ray-operator v1.5.0
