"""`baton controller` against the real API server, scheduler and kwok trays: placement of a
whole cell, capacity problems, gang recovery of the decode group, prefill scaling."""

from __future__ import annotations

import json
import subprocess
from typing import Any, cast

import pytest
from kubernetes import client

from baton.core.api import parse_prefill_record
from rigs.devcluster import (
    ControlPlane,
    binaries_dir,
    condition,
    fail_pod,
    mark_tray_not_ready,
    patch_model_deployment_spec,
    pods,
    record_tray_failures,
)
from rigs.processes import eventually
from tests.k8s.helpers import apply, read, wait_ready

pytestmark = pytest.mark.usefixtures("controller")


def annotations_of(node: client.V1Node) -> dict[str, str]:
    return (node.metadata.annotations if node.metadata else None) or {}


def test_deployment_runs_whole_cell_in_one_nvlink_domain_and_reports_ready(
    api: client.ApiClient, namespace: str, rack: list[dict[str, Any]]
) -> None:
    apply(api, namespace, "dsv4", {"cell": {"prefill": {"instances": 4}}})
    obj = wait_ready(api, namespace, "dsv4")
    status = obj["status"]
    running = pods(api, namespace)
    assert len(running) == 8 + 4
    assert all(p.status.phase == "Running" for p in running.values())
    [cell] = status["cells"]
    planned = {f"dsv4-cell-0-decode-{i}": tray for i, tray in enumerate(cell["decode"]["trays"])}
    for line in cell["prefill"]:
        index, tray, gpus = parse_prefill_record(line)
        planned[f"dsv4-cell-0-prefill-{index}"] = tray
        assert len(gpus) == 2
    assert {name: p.spec.node_name for name, p in running.items()} == planned
    domains = {
        n["metadata"]["labels"]["nvidia.com/gpu.clique"]
        for n in rack
        if n["metadata"]["name"] in planned.values()
    }
    assert domains == {cell["domain"]}
    assert len(cell["spareTrays"]) == 1 and cell["spareTrays"][0] not in planned.values()
    assert (status["ready"], status["prefillReady"], status["decodeRanks"]) == ("1/1", "4/4", 32)
    assert {c["type"]: c["status"] for c in status["conditions"]} == {
        "Placed": "True",
        "Ready": "True",
        "Progressing": "False",
        "Degraded": "False",
    }
    [endpoints] = status["endpoints"]["cells"]
    assert len(endpoints["prefill"]) == 4 and len(endpoints["decode"]) == 8
    assert all(url.endswith(":8000") for url in endpoints["decode"])

    # The printer columns, as kubectl get mdep asks the API server for them.
    method, url, headers, _, _ = api.param_serialize(
        "GET",
        f"/apis/baton.dev/v1alpha1/namespaces/{namespace}/modeldeployments",
        header_params={"Accept": "application/json;as=Table;v=v1;g=meta.k8s.io"},
        auth_settings=["BearerToken"],
    )
    response = api.call_api(method, url, headers)
    table = json.loads(response.read())
    columns = [c["name"] for c in table["columnDefinitions"]]
    row = dict(zip(columns, table["rows"][0]["cells"], strict=True))
    assert (row["Ready"], row["Reason"], row["Cells"], row["Prefill"], row["Decode Ranks"]) == (
        "True",
        "AllReady",
        "1/1",
        "4/4",
        32,
    )
    assert "Age" in row
    reasons = {
        e.reason
        for e in client.CoreV1Api(api).list_namespaced_event(namespace).items
        if e.involved_object.name == "dsv4"
    }
    assert "Placed" in reasons


def test_kubectl_describe_of_a_full_cell_stays_short_and_ends_in_its_events(
    api: client.ApiClient, namespace: str, rack: list[dict[str, Any]], control_plane: ControlPlane
) -> None:
    # As many prefill instances as fit: 18 DEP2 instances beside the 8 decode trays and spare.
    apply(api, namespace, "dsv4", {})
    # The cell may turn Ready before the controller has seen every tray (a busy host delays its
    # watch); a running cell grows its prefill onto trays that appear, so wait for all 18.
    eventually(
        lambda: read(api, namespace, "dsv4").get("status", {}).get("prefillReady") == "18/18",
        timeout=180,
        interval=0.25,
    )
    wait_ready(api, namespace, "dsv4", timeout=120)
    shown = subprocess.run(
        [
            str(binaries_dir() / "kubectl"),
            f"--kubeconfig={control_plane.kubeconfig}",
            f"--namespace={namespace}",
            "describe",
            "mdep",
            "dsv4",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.splitlines()
    # Was 258 lines, the events below a screenful of per-instance objects and endpoints.
    assert len(shown) <= 130, f"{len(shown)} lines:\n" + "\n".join(shown)
    events = shown.index("Events:")
    assert any("Placed" in line for line in shown[events:])


def test_too_little_capacity_places_no_partial_cell(
    api: client.ApiClient, namespace: str, rack: list[dict[str, Any]]
) -> None:
    apply(api, namespace, "dsv4", {"cells": 2, "cell": {"prefill": {"instances": 2}}})

    def judged() -> bool:
        return condition(read(api, namespace, "dsv4"), "Placed").get("status") == "False"

    eventually(judged, timeout=30, interval=0.25)
    placed = condition(read(api, namespace, "dsv4"), "Placed")
    assert placed["reason"] == "InsufficientCapacity"
    assert "dsv4-cell-1" in placed["message"]
    wait_for = {f"dsv4-cell-0-decode-{i}" for i in range(8)}
    eventually(lambda: wait_for <= set(pods(api, namespace)), timeout=30)
    assert not [name for name in pods(api, namespace) if name.startswith("dsv4-cell-1")]


def test_deleted_decode_pod_restarts_the_whole_group(
    api: client.ApiClient, namespace: str, rack: list[dict[str, Any]]
) -> None:
    apply(api, namespace, "dsv4", {"cell": {"prefill": {"instances": 2}}})
    wait_ready(api, namespace, "dsv4")
    before = {name: p.metadata.uid for name, p in pods(api, namespace).items()}
    client.CoreV1Api(api).delete_namespaced_pod("dsv4-cell-0-decode-5", namespace)

    def group_recreated() -> bool:
        decode = pods(api, namespace, "decode")
        return len(decode) == 8 and all(
            p.metadata.uid != before[name] and p.status.phase == "Running"
            for name, p in decode.items()
        )

    eventually(group_recreated, timeout=60, interval=0.25)
    obj = wait_ready(api, namespace, "dsv4")
    prefill = pods(api, namespace, "prefill")
    assert {name: p.metadata.uid for name, p in prefill.items()} == {
        name: uid for name, uid in before.items() if "prefill" in name
    }
    assert len(obj["status"]["cells"][0]["restarts"]) == 1
    reasons = [e.reason for e in client.CoreV1Api(api).list_namespaced_event(namespace).items]
    assert "GroupRestarting" in reasons

    # The same deletion again is the same event: counted on the first, not dropped.
    before = {name: p.metadata.uid for name, p in pods(api, namespace).items()}
    client.CoreV1Api(api).delete_namespaced_pod("dsv4-cell-0-decode-5", namespace)
    eventually(group_recreated, timeout=60, interval=0.25)
    [restarts] = [
        e
        for e in client.CoreV1Api(api).list_namespaced_event(namespace).items
        if e.reason == "GroupRestarting"
    ]
    first, last = restarts.first_timestamp, restarts.last_timestamp
    assert restarts.count == 2 and first is not None and last is not None and last > first
    assert restarts.involved_object.name == "dsv4"


def test_tray_not_ready_moves_the_group_to_the_spare(
    api: client.ApiClient, namespace: str, rack: list[dict[str, Any]]
) -> None:
    apply(api, namespace, "dsv4", {"cell": {"prefill": {"instances": 2}}})
    cell = wait_ready(api, namespace, "dsv4")["status"]["cells"][0]
    failing, spare = cell["decode"]["trays"][3], cell["spareTrays"][0]
    mark_tray_not_ready(api, failing)

    def moved() -> bool:
        decode = pods(api, namespace, "decode")
        return (
            len(decode) == 8
            and decode["dsv4-cell-0-decode-3"].spec.node_name == spare
            and all(p.status.phase == "Running" for p in decode.values())
        )

    eventually(moved, timeout=60, interval=0.25)
    cell = wait_ready(api, namespace, "dsv4")["status"]["cells"][0]
    assert cell["decode"]["trays"][3] == spare
    assert failing not in cell["decode"]["trays"] + cell["spareTrays"]


def test_a_restart_while_a_decode_tray_is_cordoned_puts_its_rank_on_the_spare(
    api: client.ApiClient, namespace: str, rack: list[dict[str, Any]]
) -> None:
    apply(api, namespace, "dsv4", {"cell": {"prefill": {"instances": 2}}})
    cell = wait_ready(api, namespace, "dsv4")["status"]["cells"][0]
    cordoned, spare = cell["decode"]["trays"][6], cell["spareTrays"][0]
    core = client.CoreV1Api(api)
    core.patch_node(cordoned, {"spec": {"unschedulable": True}})
    core.delete_namespaced_pod("dsv4-cell-0-decode-1", namespace)

    def on_the_spare() -> bool:
        decode = pods(api, namespace, "decode")
        return (
            len(decode) == 8
            and decode["dsv4-cell-0-decode-6"].spec.node_name == spare
            and all(p.status.phase == "Running" for p in decode.values())
        )

    eventually(on_the_spare, timeout=60, interval=0.25)
    obj = wait_ready(api, namespace, "dsv4")
    assert obj["status"]["decodeRanks"] == 32
    assert cordoned not in obj["status"]["cells"][0]["decode"]["trays"]
    assert condition(obj, "Degraded")["status"] == "False"


def test_prefill_scales_up_and_down_without_touching_decode(
    api: client.ApiClient, namespace: str, rack: list[dict[str, Any]]
) -> None:
    apply(api, namespace, "dsv4", {"cell": {"prefill": {"instances": 2}}})
    wait_ready(api, namespace, "dsv4")
    decode = {name: p.metadata.uid for name, p in pods(api, namespace, "decode").items()}
    for instances in (6, 1):
        patch_model_deployment_spec(
            api, namespace, "dsv4", {"cell": {"prefill": {"instances": instances}}}
        )
        wanted = {f"dsv4-cell-0-prefill-{i}" for i in range(instances)}

        def prefill_is_wanted(w: set[str] = wanted) -> bool:
            return set(pods(api, namespace, "prefill")) == w

        eventually(prefill_is_wanted, timeout=60)
        obj = wait_ready(api, namespace, "dsv4")
        assert obj["status"]["prefillReady"] == f"{instances}/{instances}"
        now = {name: p.metadata.uid for name, p in pods(api, namespace, "decode").items()}
        assert now == decode


def test_a_changed_engine_spec_rolls_out_to_every_pod_after_its_cell_drains(
    api: client.ApiClient, namespace: str, rack: list[dict[str, Any]]
) -> None:
    # kwok's pods run no engine that could serve a request: no wait for one (servedRequestSeconds
    # is pinned in test_decide and, with engines, in test_rollout_under_load)
    apply(
        api,
        namespace,
        "dsv4",
        {
            "cell": {"prefill": {"instances": 2}},
            "rollout": {"drainSeconds": 2, "servedRequestSeconds": 0},
        },
    )
    ready = wait_ready(api, namespace, "dsv4")["status"]
    old = ready["revision"]
    assert {p.metadata.labels["baton.dev/revision"] for p in pods(api, namespace).values()} == {old}
    before = {name: p.metadata.uid for name, p in pods(api, namespace).items()}
    patch_model_deployment_spec(
        api, namespace, "dsv4", {"engine": {"args": ["--max-num-seqs", "512"]}}
    )

    def draining() -> bool:
        status = read(api, namespace, "dsv4")["status"]
        cell = status["cells"][0]
        return bool(cell.get("drainingSince")) and status["endpoints"]["cells"][0] == {
            "name": "dsv4-cell-0",
            "prefill": [],
            "decode": [],
            "eplbAgents": [],
        }

    eventually(draining, timeout=30, interval=0.25)

    def rolled_out() -> bool:
        now = pods(api, namespace)
        return len(now) == 10 and all(
            "--max-num-seqs" in p.spec.containers[0].command
            and p.metadata.uid != before[name]
            and p.status.phase == "Running"
            for name, p in now.items()
        )

    eventually(rolled_out, timeout=90, interval=0.5)
    obj = wait_ready(api, namespace, "dsv4")
    status = obj["status"]
    assert status["revision"] != old and status["updated"] == "1/1"
    assert status["cells"][0]["revision"] == status["revision"]
    assert status["cells"][0]["restarts"] == []  # a planned restart, not a failure
    assert not status["cells"][0].get("drainingSince")
    revisions = {p.metadata.labels["baton.dev/revision"] for p in pods(api, namespace).values()}
    assert revisions == {status["revision"]}
    reasons = [e.reason for e in client.CoreV1Api(api).list_namespaced_event(namespace).items]
    assert {"CellDraining", "GroupUpdating", "PrefillUpdating"} <= set(reasons)


def test_a_tray_whose_pods_keep_failing_is_quarantined_and_its_group_moves(
    api: client.ApiClient, namespace: str, rack: list[dict[str, Any]]
) -> None:
    apply(api, namespace, "dsv4", {"cell": {"prefill": {"instances": 2}}})
    cell = wait_ready(api, namespace, "dsv4")["status"]["cells"][0]
    tray, spare = cell["decode"]["trays"][2], cell["spareTrays"][0]
    core = client.CoreV1Api(api)
    # Two earlier failures on record, within the last day; the engine on this tray now fails a
    # third time.
    earlier = record_tray_failures(api, tray, 2)
    fail_pod(api, namespace, "dsv4-cell-0-decode-2")

    def quarantined_and_moved() -> bool:
        annotations = annotations_of(core.read_node(tray))
        decode = pods(api, namespace, "decode")
        return (
            "baton.dev/quarantined" in annotations
            and len(decode) == 8
            and decode["dsv4-cell-0-decode-2"].spec.node_name == spare
            and all(p.status.phase == "Running" for p in decode.values())
        )

    eventually(quarantined_and_moved, timeout=60, interval=0.25)
    failures = annotations_of(core.read_node(tray))["baton.dev/tray-failures"].split(",")
    assert len(failures) == 3 and ",".join(failures[:2]) == earlier

    # The cell serves again on its spare, and the deployment says it is degraded, not ready:
    # the cell has no spare left (kubectl get mdep: Ready False, Reason TrayQuarantined).
    def serving_degraded() -> dict[str, Any] | None:
        obj = read(api, namespace, "dsv4")
        ready = condition(obj, "Ready")
        settled = obj["status"].get("observedGeneration") == obj["metadata"]["generation"]
        serving = settled and obj["status"].get("ready") == "1/1"
        return obj if serving and ready.get("reason") == "TrayQuarantined" else None

    obj = eventually(serving_degraded, timeout=60, interval=0.25)
    assert obj is not None
    assert condition(obj, "Ready")["status"] == "False"
    assert tray in condition(obj, "Ready")["message"]
    degraded = condition(obj, "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "TrayQuarantined")
    reasons = [e.reason for e in core.list_namespaced_event(namespace).items]
    assert "TrayQuarantined" in reasons and "GroupRestarting" in reasons


def test_kubectl_scale_sets_the_cells_and_reads_the_placed_ones(
    api: client.ApiClient, namespace: str, rack: list[dict[str, Any]]
) -> None:
    apply(api, namespace, "dsv4", {"cell": {"prefill": {"instances": 2}}})
    wait_ready(api, namespace, "dsv4")
    objects = client.CustomObjectsApi(api)
    where = ("baton.dev", "v1alpha1", namespace, "modeldeployments", "dsv4")

    def scale() -> tuple[int, int]:
        """The scale subresource: (wanted, placed) cells."""
        read_scale = cast(dict[str, Any], objects.get_namespaced_custom_object_scale(*where))
        # replicas 0 is left out of the JSON
        return read_scale["spec"].get("replicas", 0), read_scale["status"].get("replicas", 0)

    assert scale() == (1, 1)
    objects.patch_namespaced_custom_object_scale(*where, {"spec": {"replicas": 0}})
    assert read(api, namespace, "dsv4")["spec"]["cells"] == 0
    eventually(lambda: not pods(api, namespace), timeout=60)
    eventually(lambda: scale() == (0, 0), timeout=30)
    objects.patch_namespaced_custom_object_scale(*where, {"spec": {"replicas": 1}})
    wait_ready(api, namespace, "dsv4")
    assert scale() == (1, 1)
