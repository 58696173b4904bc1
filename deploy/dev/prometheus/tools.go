//go:build tools

// prometheus scrapes a running `baton up` in the observability tests, which query every
// dashboard panel and alert through its HTTP API; promtool checks and unit-tests the alerts.
package tools

import (
	_ "github.com/prometheus/prometheus/cmd/prometheus"
	_ "github.com/prometheus/prometheus/cmd/promtool"
)
