//go:build tools

// kwok fakes the kubelets of GB300 NVL72 trays for the operator's tests.
package tools

import _ "sigs.k8s.io/kwok/cmd/kwok"
