//go:build tools

// helm lints and renders helm/baton in the tests.
package tools

import _ "helm.sh/helm/v3/cmd/helm"
