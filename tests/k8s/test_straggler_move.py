"""The straggler loop on the dev cluster: ``baton controller --prometheus-url`` reads a real
Prometheus scraping a simulated DEP32 group's dcgm-exporters whose trays are the kwok trays its
ModelDeployment was placed on; one GPU throttled to 70% gets its tray marked degraded (Node
annotations and an Event), and the decode group moves to the spare tray through a drained
restart. A group whose steps are slow against the performance model's prediction with every
clock normal gets the tray of the GPU whose NVLinks fail marked and moved, or, with no GPU to
blame (a slow CPU), is reported slow with no tray marked."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from baton.core.labels import (
    DEGRADED_ANNOTATION,
    DEGRADED_SINCE_ANNOTATION,
    DEGRADED_SLOWDOWN_ANNOTATION,
)
from baton.core.model import SPECULATIVE_METHOD, SPECULATIVE_TOKENS
from rigs.devcluster import ControlPlane, condition, install_crd, start_controller
from rigs.processes import eventually, free_port, stop_process
from rigs.stragglers import SimulatedGroup, simulated_group
from tests.k8s.helpers import apply, controller_log, no_traceback, read, wait_ready


@contextmanager
def watching(
    control_plane: ControlPlane,
    api: client.ApiClient,
    namespace: str,
    rack: list[dict[str, Any]],
    directory: Path,
    eplb_steps: int | None = None,
) -> Iterator[SimulatedGroup]:
    """The simulated group's exporters under the rack's first 8 trays' names (where the
    decode group is placed), its engines labelled as the deployment ``dsv4``'s first cell, and
    a controller whose straggler watch judges 4 s windows."""
    install_crd(api)
    metrics = free_port()
    first_tray = rack[0]["metadata"]["name"]
    name = first_tray.rsplit("-tray-", 1)[0]  # <namespace>-rack-0: trays <name>-tray-<i>
    with simulated_group(
        directory,
        name,
        controller=f"127.0.0.1:{metrics}",
        eplb_steps=eplb_steps,
        deployment=f"{namespace}/dsv4",
        cell="dsv4-cell-0",
    ) as group:
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
            no_traceback(controller_log(control_plane, identity))


@pytest.fixture
def watched(
    control_plane: ControlPlane,
    api: client.ApiClient,
    namespace: str,
    rack: list[dict[str, Any]],
    tmp_path: Path,
) -> Iterator[SimulatedGroup]:
    with watching(control_plane, api, namespace, rack, tmp_path) as group:
        yield group


@pytest.fixture
def watched_with_eplb(
    control_plane: ControlPlane,
    api: client.ApiClient,
    namespace: str,
    rack: list[dict[str, Any]],
    tmp_path: Path,
) -> Iterator[SimulatedGroup]:
    """As ``watched``, with the group's EPLB agent followed by a ``baton eplb`` service: its
    per-step balance is what the watch predicts the group's step with."""
    with watching(control_plane, api, namespace, rack, tmp_path, eplb_steps=300) as group:
        yield group


def moved_to_spare(
    api: client.ApiClient, namespace: str, tray_index: int, spare: str
) -> dict[str, Any]:
    """``dsv4``'s cell once its decode group's ``tray_index``-th tray is the spare."""

    def cell() -> dict[str, Any]:  # empty until moved
        found: dict[str, Any] = read(api, namespace, "dsv4")["status"]["cells"][0]
        return found if found["decode"]["trays"][tray_index] == spare else {}

    return eventually(cell, timeout=180)


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

    def tray_events() -> list[client.CoreV1Event]:
        events = client.CoreV1Api(api).list_namespaced_event(
            "default", field_selector=f"involvedObject.name={slow}"
        )
        return [e for e in events.items if e.reason == "TrayDegraded"]

    [event] = eventually(tray_events, timeout=30)  # written just after the mark
    assert event.type == "Warning" and event.involved_object.kind == "Node"
    assert f"holds back decode group {namespace}/dsv4 dsv4-cell-0" in str(event.message)
    # the kwok group started in seconds: the move pays at once, drained first
    moved = moved_to_spare(api, namespace, 3, spare)
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


def apply_as_the_group_runs(api: client.ApiClient, namespace: str, **spec: Any) -> dict[str, Any]:
    """``dsv4`` with ``spec`` and the engines' speculative decoding as the simulator runs it by
    default (the study's), which the watch predicts their steps with; once Ready."""
    speculative = {"method": SPECULATIVE_METHOD, "numSpeculativeTokens": SPECULATIVE_TOKENS}
    apply(
        api,
        namespace,
        "dsv4",
        {"cell": {"prefill": {"instances": 2}}, "speculative": speculative, **spec},
    )
    return wait_ready(api, namespace, "dsv4")


def test_a_group_slowed_with_its_clocks_untouched_is_reported_slow_against_the_model(
    api: client.ApiClient, namespace: str, watched_with_eplb: SimulatedGroup
) -> None:
    group = watched_with_eplb
    apply_as_the_group_runs(api, namespace)
    series = f'{{modeldeployment="{namespace}/dsv4",cell="dsv4-cell-0"}}'

    def slowdown() -> float | None:
        found = group.prometheus.query(f"baton_decode_group_slowdown{series}")
        return float(found[0]["value"][1]) if found else None

    # healthy: the engines' steps are what the model predicts for the batch they run
    eventually(lambda: 0.85 < (slowdown() or 0.0) < 1.15, timeout=120)
    group.faults.inject(group.servers[0], action="slow", factor=1.6, seconds=3600)
    eventually(lambda: group.prometheus.query(f"baton_decode_group_slow{series} == 1"), timeout=180)
    assert 1.4 < (slowdown() or 0.0) < 1.8
    events = client.CoreV1Api(api).list_namespaced_event(
        namespace, field_selector="involvedObject.name=dsv4"
    )
    [event] = [e for e in events.items if e.reason == "DecodeGroupSlow"]
    assert event.type == "Warning"
    assert "no tray is marked" in str(event.message)
    # no GPU's clock stands out: no tray is marked, and the group stays where it is
    assert not any(DEGRADED_ANNOTATION in node_annotations(api, t) for t in group.trays)
    assert read(api, namespace, "dsv4")["status"]["cells"][0]["decode"]["trays"] == group.trays


def test_a_gpu_whose_nvlinks_fail_gets_its_tray_marked_by_the_groups_slowdown_and_moved(
    api: client.ApiClient, namespace: str, watched_with_eplb: SimulatedGroup
) -> None:
    group = watched_with_eplb
    obj = apply_as_the_group_runs(api, namespace, rollout={"drainSeconds": 2})
    [spare] = obj["status"]["cells"][0]["spareTrays"]
    series = f'{{modeldeployment="{namespace}/dsv4",cell="dsv4-cell-0"}}'
    eventually(
        lambda: group.prometheus.query(f"baton_decode_group_slowdown{series} < 1.15"), timeout=120
    )
    # rank 21: the second GPU of the sixth tray; its links fail, every step 1.4x as long
    failing = group.trays[5]
    group.faults.inject(
        group.servers[5], action="nvlink_errors", rank=21, rate=50, factor=1.4, seconds=3600
    )
    eventually(lambda: DEGRADED_ANNOTATION in node_annotations(api, failing), timeout=180)
    marks = node_annotations(api, failing)
    assert marks[DEGRADED_ANNOTATION].startswith("GPU 1's NVLinks logged ")
    assert 1.25 < float(marks[DEGRADED_SLOWDOWN_ANNOTATION]) < 1.6
    assert not any(DEGRADED_ANNOTATION in node_annotations(api, t) for t in group.trays[:5])
    # the mark explains the slow steps: no DecodeGroupSlow, and the group moves to the spare
    moved = moved_to_spare(api, namespace, 5, spare)
    assert failing not in moved["decode"]["trays"]
    reasons = [
        e.reason
        for e in client.CoreV1Api(api)
        .list_namespaced_event(namespace, field_selector="involvedObject.name=dsv4")
        .items
    ]
    assert {"TrayDegraded", "GroupMoving"} <= set(reasons)
    assert "DecodeGroupSlow" not in reasons
