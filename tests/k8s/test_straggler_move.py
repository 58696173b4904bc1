"""The straggler loop on the dev cluster: ``baton controller --prometheus-url`` reads a real
Prometheus scraping a simulated DEP32 group's dcgm-exporters whose trays are the kwok trays its
ModelDeployment was placed on; one GPU throttled to 70% gets its tray marked degraded (Node
annotations and an Event), and the decode group moves to the spare tray through a drained
restart."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from baton.core.labels import (
    DEGRADED_ANNOTATION,
    DEGRADED_SINCE_ANNOTATION,
    DEGRADED_SLOWDOWN_ANNOTATION,
)
from rigs.devcluster import ControlPlane, condition, install_crd, start_controller
from rigs.processes import eventually, free_port, stop_process
from rigs.stragglers import SimulatedGroup, simulated_group
from tests.k8s.helpers import apply, controller_log, read, wait_ready


@pytest.fixture
def watched(
    control_plane: ControlPlane,
    api: client.ApiClient,
    namespace: str,
    rack: list[dict[str, Any]],
    tmp_path: Path,
) -> Iterator[SimulatedGroup]:
    """The simulated group's exporters under the rack's first 8 trays' names (where the
    decode group is placed), and a controller whose straggler watch judges 4 s windows."""
    install_crd(api)
    metrics = free_port()
    first_tray = rack[0]["metadata"]["name"]
    name = first_tray.rsplit("-tray-", 1)[0]  # <namespace>-rack-0: trays <name>-tray-<i>
    with simulated_group(tmp_path, name, controller=f"127.0.0.1:{metrics}") as group:
        identity = f"straggler-{namespace}"
        process = start_controller(
            control_plane,
            identity,
            f"baton-controller-{namespace}",
            metrics_port=metrics,
            extra=(
                f"--prometheus-url={group.prometheus.url}",
                "--straggler-window-seconds=4",
                "--straggler-windows=3",
            ),
        )
        try:
            yield group
        finally:
            stop_process(process)
            assert "Traceback" not in controller_log(control_plane, identity)


def node_annotations(api: client.ApiClient, name: str) -> dict[str, str]:
    meta = client.CoreV1Api(api).read_node(name).metadata
    return dict((meta.annotations if meta else None) or {})


def test_a_gpu_at_70_percent_gets_its_tray_marked_and_its_group_moved_to_the_spare(
    api: client.ApiClient, namespace: str, watched: SimulatedGroup
) -> None:
    group = watched
    apply(
        api,
        namespace,
        "dsv4",
        {"cell": {"prefill": {"instances": 2}}, "rollout": {"drainSeconds": 2}},
    )
    obj = wait_ready(api, namespace, "dsv4")
    [cell] = obj["status"]["cells"]
    assert cell["decode"]["trays"] == group.trays
    [spare] = cell["spareTrays"]
    slow = group.trays[3]
    # healthy windows first: nothing is marked
    eventually(
        lambda: group.prometheus.query("count(DCGM_FI_DEV_SM_CLOCK > 1000)") != [], timeout=60
    )
    # rank 13: the second GPU of the fourth tray
    group.faults.inject(group.servers[3], action="throttle", rank=13, share=0.7, seconds=3600)
    eventually(lambda: DEGRADED_ANNOTATION in node_annotations(api, slow), timeout=120)
    marks = node_annotations(api, slow)
    assert marks[DEGRADED_ANNOTATION].startswith("GPU 1 runs at 7")
    assert "hw_thermal_slowdown" in marks[DEGRADED_ANNOTATION]
    assert 1.3 < float(marks[DEGRADED_SLOWDOWN_ANNOTATION]) < 1.5
    assert marks[DEGRADED_SINCE_ANNOTATION].endswith("Z")
    marked = [t for t in group.trays if t != slow]
    assert not any(DEGRADED_ANNOTATION in node_annotations(api, t) for t in marked)
    events = client.CoreV1Api(api).list_namespaced_event(
        "default", field_selector=f"involvedObject.name={slow}"
    )
    [event] = [e for e in events.items if e.reason == "TrayDegraded"]
    assert event.type == "Warning" and event.involved_object.kind == "Node"
    assert f"holds back decode group {namespace}/dsv4 dsv4-cell-0" in str(event.message)
    # the kwok group started in seconds: the move pays at once, drained first
    moved = eventually(
        lambda: (
            (c := read(api, namespace, "dsv4")["status"]["cells"][0])["decode"]["trays"][3] == spare
            and c
        ),
        timeout=180,
    )
    assert slow not in moved["decode"]["trays"]
    obj = wait_ready(api, namespace, "dsv4")
    assert condition(obj, "Degraded")["status"] == "False"
    assert obj["status"]["cells"][0]["restarts"] == []  # a planned move, not a failure
    reasons = [
        e.reason
        for e in client.CoreV1Api(api)
        .list_namespaced_event(namespace, field_selector="involvedObject.name=dsv4")
        .items
    ]
    assert {"TrayDegraded", "CellDraining", "GroupMoving"} <= set(reasons)
    # the alert's series, from the controller's /metrics through Prometheus' rule
    eventually(
        lambda: (
            [s["metric"]["tray"] for s in group.prometheus.query("baton:tray_degraded:max")]
            == [slow]
        ),
        timeout=60,
    )
