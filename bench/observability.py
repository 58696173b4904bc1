"""``baton bench observability``: the dashboards' panels drawn from a real run.

Grafana cannot run here, so this draws each dashboard's panels itself from what Prometheus
answers: a ``baton up`` (plugin mode) and a controller on the test cluster (``make dev-bin``)
go through the failure drills of ``rigs/observability.py`` while Prometheus scrapes them every
second; then every panel's queries, read from the dashboards' JSON as Grafana would import
it (``deploy/grafana/dashboards/``), are asked over the run (``query_range``, Grafana's
``$__rate_interval`` as 30 s, each text variable at its default, each deployment variable at
"All") and drawn, one PNG per dashboard
(``docs/figures/observability-<uid>.png``), from the data saved beside them
(``docs/figures/observability.json``). docs/observability.md shows them.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from kubernetes import client, config

from baton.core.model import MODEL
from rigs.devcluster import ROOT, add_trays, binaries_dir, install_crd, start_control_plane
from rigs.observability import baton_up, controller_drill, drill, start_prometheus
from rigs.processes import baton_command, eventually, free_port, stop_process

__all__ = ["axis_label", "run"]

FIGURES = ROOT / "docs" / "figures"
DASHBOARDS = ROOT / "deploy" / "grafana" / "dashboards"
RATE_INTERVAL = "30s"
STEP_S = 2.0


def _expr(expr: str, dashboard: dict[str, Any]) -> str:
    """``expr`` as Grafana sends it: its rate window filled in, each text variable at its
    default and each deployment variable at "All"."""
    expr = expr.replace("$__rate_interval", RATE_INTERVAL)
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "textbox":
            expr = expr.replace(f"${variable['name']}", variable["query"])
        elif variable["type"] == "query":
            expr = expr.replace(f"${variable['name']}", variable["allValue"])
    return expr


def _legend(template: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template).strip()


def _record(directory: Path, quick: bool) -> dict[str, Any]:
    """The drills under Prometheus, then every panel's queries over the run."""
    plane = start_control_plane(directory / "k8s", binaries_dir())
    controller = None
    try:
        api = config.new_client_from_config(config_file=str(plane.kubeconfig))
        install_crd(api)
        add_trays(api, 2)
        namespace = "serving"
        client.CoreV1Api(api).create_namespace(
            client.V1Namespace(metadata=client.V1ObjectMeta(name=namespace))
        )
        port = free_port()
        controller = subprocess.Popen(
            baton_command(
                "controller",
                f"--kubeconfig={plane.kubeconfig}",
                "--lease-namespace=default",
                f"--metrics-port={port}",
                "--metrics-host=127.0.0.1",
            ),
            stdout=(directory / "controller.log").open("wb"),
            stderr=subprocess.STDOUT,
        )
        metrics = f"http://127.0.0.1:{port}/metrics"
        eventually(lambda: httpx.get(metrics, timeout=1).status_code == 200, timeout=30)
        with (
            baton_up(directory) as stack,
            start_prometheus(
                binaries_dir(), directory, file_sd=stack.targets, controller=f"127.0.0.1:{port}"
            ) as prometheus,
        ):
            start = time.time()
            # the controller's counters at 0, the engines' and the gateway's series, before
            # anything happens: every first action is an increase
            for series in (
                "baton_controller_placements_total",
                "vllm:num_requests_running",
                "baton_gateway_requests_total",
            ):
                prometheus.wait_for(series)
            controller_drill(api, namespace, MODEL)
            statuses = drill(stack, rounds=1 if quick else 4)
            prometheus.wait_caught_up(stack.gateway)
            end = time.time()
            dashboards: dict[str, Any] = {}
            for path in sorted(DASHBOARDS.glob("*.json")):
                dashboard = json.loads(path.read_text())
                panels = []
                for panel in dashboard["panels"]:
                    queries = []
                    for target in panel["targets"]:
                        expr = _expr(target["expr"], dashboard)
                        result = prometheus.query_range(expr, start, end, STEP_S)
                        queries.append(
                            {
                                "expr": target["expr"],
                                "series": [
                                    {
                                        "legend": _legend(target["legendFormat"], series["metric"]),
                                        "values": [
                                            [round(t - start, 1), float(v)]
                                            for t, v in series["values"]
                                        ],
                                    }
                                    for series in result
                                ],
                            }
                        )
                    unit = panel["fieldConfig"]["defaults"].get("unit", "")
                    panels.append({"title": panel["title"], "unit": unit, "queries": queries})
                dashboards[dashboard["uid"]] = {"title": dashboard["title"], "panels": panels}
        return {
            "rate_interval": RATE_INTERVAL,
            "step_s": STEP_S,
            "duration_s": round(end - start, 1),
            "statuses": {str(k): v for k, v in sorted(statuses.items())},
            "dashboards": dashboards,
        }
    finally:
        if controller is not None:
            stop_process(controller)
        plane.stop()


# Grafana's unit ids, as a reader names them on an axis (Grafana formats the numbers itself).
_AXIS = {
    "Bps": "bytes/s",
    "bool": "0 or 1",
    "currencyUSD": "USD",
    "ops": "operations/s",
    "percentunit": "share (1 = 100%)",
    "reqps": "requests/s",
    "s": "seconds",
    "short": "",
}


def axis_label(unit: str) -> str:
    """The y axis label for a panel of Grafana unit ``unit`` (``suffix: X`` is X itself)."""
    if unit.startswith("suffix: "):
        return unit.removeprefix("suffix: ")
    return _AXIS.get(unit, unit)


def draw(data: dict[str, Any], directory: Path) -> list[Path]:
    """One PNG per dashboard: its panels in Grafana's two columns, each series a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for uid, dashboard in data["dashboards"].items():
        panels = dashboard["panels"]
        rows = (len(panels) + 1) // 2
        figure, axes = plt.subplots(rows, 2, figsize=(13, 3.2 * rows), squeeze=False)
        for ax, panel in zip(axes.flat, panels, strict=False):
            lines = 0
            for query in panel["queries"]:
                for series in query["series"]:
                    points = [(t, v) for t, v in series["values"] if v == v]  # NaN: no point
                    if points:
                        ts, vs = zip(*points, strict=True)
                        ax.plot(ts, vs, label=series["legend"] or "value", linewidth=1.2)
                        lines += 1
            ax.set_title(panel["title"], fontsize=10)
            ax.set_xlabel("seconds into the run", fontsize=8)
            ax.set_ylabel(axis_label(panel["unit"]), fontsize=8)
            ax.tick_params(labelsize=7)
            ax.grid(alpha=0.3)
            if 0 < lines <= 8:
                ax.legend(fontsize=6, loc="upper left")
        for ax in list(axes.flat)[len(panels) :]:
            ax.set_visible(False)
        figure.suptitle(f"{dashboard['title']} (baton up drill, rates over 30 s)", fontsize=12)
        figure.tight_layout()
        path = directory / f"observability-{uid}.png"
        figure.savefig(path, dpi=80)
        plt.close(figure)
        written.append(path)
    return written


def run(quick: bool = False) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="baton-bench-observability-") as tmp:
        data = _record(Path(tmp), quick)
    # The docs show a full run's pictures (baton bench saves the data beside them); a quick
    # run (make bench) draws its own apart.
    figures = Path("bench/results/observability") if quick else FIGURES
    figures.mkdir(parents=True, exist_ok=True)
    for path in draw(data, figures):
        print(f"wrote {path}", file=sys.stderr)
    return data
