"""The operator at rack scale, on a real API server, scheduler and kwok trays.

For 1 cell on 1 rack (18 trays) and for 20 cells on 20 racks (360 trays), each on a fresh
control plane (``rigs/devcluster.py``): one ``baton controller`` process, one
ModelDeployment with the default cell (DEP32 decode, one spare tray, DEP2 prefill as many as
fit: 26 pods per cell). Measured:

- seconds from the ModelDeployment's creation to every pod Running (a pod watch sees it), and
  to the status saying Ready;
- the controller's API writes (its ``baton_controller_api_requests`` counter) and reconciles,
  and writes per reconcile;
- the controller's CPU seconds over the run (from /proc).

Targets (the issue's): 1 cell <= 5 s, 20 cells <= 60 s from apply to every pod Running.
"""

from __future__ import annotations

import tempfile
import threading
import time
from pathlib import Path

import httpx
from kubernetes import client, config, watch
from prometheus_client.parser import text_string_to_metric_families

from baton.core.labels import DEPLOYMENT_LABEL
from bench.procstat import cpu_seconds
from rigs.devcluster import (
    add_trays,
    binaries_dir,
    create_model_deployment,
    install_crd,
    read_model_deployment,
    start_control_plane,
    start_controller,
)
from rigs.processes import eventually, free_port, stop_process

__all__ = ["run"]

TARGETS_S = {1: 5.0, 20: 60.0}
PODS_PER_CELL = 8 + 18  # DEP32 over 8 trays; 9 trays left after the spare, 2 DEP2 each


def _counters(url: str) -> dict[str, float]:
    text = httpx.get(url, timeout=5).text
    totals = {"api_writes": 0.0, "reconciles": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "baton_controller_api_requests_total":
                totals["api_writes"] += sample.value
            elif sample.name == "baton_controller_reconciles_total":
                totals["reconciles"] += sample.value
    return totals


def _watch_running(
    api: client.ApiClient,
    namespace: str,
    since: str,
    wanted: int,
    done: threading.Event,
    ready: dict[str, float],
) -> None:
    """Record when ``wanted`` pods of the namespace are Running: one watch from resourceVersion
    ``since`` (taken before the apply, so no event is missed), no polling."""
    running: set[str] = set()
    stream = watch.Watch().stream(
        client.CoreV1Api(api).list_namespaced_pod,
        namespace,
        label_selector=DEPLOYMENT_LABEL,
        resource_version=since,
        timeout_seconds=180,
    )
    for event in stream:
        pod = event["object"]
        if pod.status.phase == "Running" and event["type"] != "DELETED":
            running.add(pod.metadata.name)
        if len(running) >= wanted:
            ready["running"] = time.monotonic()
            break
    done.set()


def _scenario(cells: int, directory: Path) -> dict[str, object]:
    plane = start_control_plane(directory, binaries_dir())
    controller = None
    try:
        api = config.new_client_from_config(config_file=str(plane.kubeconfig))
        install_crd(api)
        add_trays(api, cells, timeout=300)
        namespace = "bench"
        core = client.CoreV1Api(api)
        core.create_namespace(client.V1Namespace(metadata=client.V1ObjectMeta(name=namespace)))
        port = free_port()
        controller = start_controller(plane, "controller", "baton-controller", metrics_port=port)
        metrics = f"http://127.0.0.1:{port}/metrics"
        eventually(lambda: httpx.get(metrics, timeout=1).status_code == 200, timeout=30)
        eventually(
            lambda: client.CoordinationV1Api(api).read_namespaced_lease(
                "baton-controller", "default"
            ),
            timeout=30,
        )
        before = _counters(metrics)
        cpu_before = cpu_seconds(controller.pid)
        marks: dict[str, float] = {}
        done = threading.Event()
        wanted = cells * PODS_PER_CELL
        listing = core.list_namespaced_pod(namespace, limit=1)
        # The API server answers every list with its metadata and resourceVersion.
        assert listing.metadata is not None and listing.metadata.resource_version is not None
        since = listing.metadata.resource_version
        watcher = threading.Thread(
            target=_watch_running,
            args=(api, namespace, since, wanted, done, marks),
            daemon=True,
        )
        watcher.start()
        started = time.monotonic()
        create_model_deployment(
            api, namespace, "dsv4", {"model": "deepseek-ai/DeepSeek-V4.1-Flash", "cells": cells}
        )

        def ready() -> bool:
            obj = read_model_deployment(api, namespace, "dsv4")
            conditions = obj.get("status", {}).get("conditions", [])
            return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

        eventually(ready, timeout=240, interval=0.2)
        status_ready = time.monotonic() - started
        done.wait(timeout=60)
        after = _counters(metrics)
        cpu = cpu_seconds(controller.pid) - cpu_before
        writes = after["api_writes"] - before["api_writes"]
        reconciles = after["reconciles"] - before["reconciles"]
        running_s = marks["running"] - started if "running" in marks else None
        return {
            "cells": cells,
            "trays": cells * 18,
            "pods": wanted,
            "all_running_s": running_s,
            "status_ready_s": status_ready,
            "target_s": TARGETS_S[cells],
            "met": running_s is not None and running_s <= TARGETS_S[cells],
            "api_writes": writes,
            "reconciles": reconciles,
            "writes_per_reconcile": writes / reconciles if reconciles else None,
            "controller_cpu_s": cpu,
        }
    finally:
        if controller is not None:
            stop_process(controller)
        plane.stop()


def run(quick: bool = False) -> dict[str, object]:
    sizes = [1] if quick else [1, 20]
    with tempfile.TemporaryDirectory(prefix="baton-bench-controller-") as tmp:
        rows = [_scenario(cells, Path(tmp) / f"cells-{cells}") for cells in sizes]
    print(
        f"{'cells':>5} {'trays':>5} {'pods':>5} {'all running':>12} {'target':>7} "
        f"{'status Ready':>12} {'writes':>7} {'reconciles':>10} {'w/rec':>6} {'ctrl CPU':>9}"
    )
    for row in rows:
        running = row["all_running_s"]
        per = row["writes_per_reconcile"]
        print(
            f"{row['cells']:>5} {row['trays']:>5} {row['pods']:>5} "
            f"{(f'{running:.2f} s' if running is not None else 'never'):>12} "
            f"{row['target_s']:>5.0f} s {row['status_ready_s']:>10.2f} s "
            f"{row['api_writes']:>7.0f} {row['reconciles']:>10.0f} "
            f"{(f'{per:.1f}' if per is not None else '-'):>6} {row['controller_cpu_s']:>7.2f} s"
        )
    return {"benchmark": "controller", "rows": rows}
