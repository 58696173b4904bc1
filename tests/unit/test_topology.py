"""Trays and NVLink domains from Kubernetes Node objects (controller.topology)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from baton.core.labels import (
    CLIQUE_LABEL,
    GPU_RESOURCE,
    GPUS_USED_BY_OTHERS_ANNOTATION,
    QUARANTINED_ANNOTATION,
)
from controller.topology import (
    Topology,
    TopologyError,
    Tray,
    TrayTaint,
    parse_topology,
    synthetic_nodes,
    synthetic_topology,
    topology_from_trays,
    tray_name,
)

RACK = "7b968a6d-c8aa-45e1-9e07-e1e51be99c31"


def node(
    name: str,
    *,
    clique: str | None = f"{RACK}.1",
    gpus: str | int | None = "4",
    ready: str | None = "True",
    unschedulable: bool = False,
    taints: list[dict[str, str]] | None = None,
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A Node as kubectl prints it, with only what the test varies."""
    labels = {"kubernetes.io/hostname": name}
    if clique is not None:
        labels[CLIQUE_LABEL] = clique
    status: dict[str, object] = {"allocatable": {"cpu": "144", "memory": "900Gi"}}
    if gpus is not None:
        status["allocatable"] = {"cpu": "144", GPU_RESOURCE: gpus}
        status["capacity"] = {GPU_RESOURCE: "4"}
    if ready is not None:
        status["conditions"] = [
            {"type": "MemoryPressure", "status": "False"},
            {"type": "Ready", "status": ready, "reason": "KubeletReady"},
        ]
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "uid": "0b6d",
            "labels": labels,
            "annotations": annotations or {},
        },
        "spec": {"unschedulable": unschedulable, "taints": taints or []},
        "status": status,
    }


def only_tray(*nodes: dict[str, Any], **kwargs: Any) -> Tray:
    """The one tray of ``nodes``; ``kwargs`` go to parse_topology."""
    topology = parse_topology({"kind": "NodeList", "items": list(nodes)}, **kwargs)
    assert len(topology.trays) == 1
    return topology.trays[0]


def test_node_list_gives_trays_grouped_by_nvlink_domain() -> None:
    topology = parse_topology(
        {
            "apiVersion": "v1",
            "kind": "NodeList",
            "items": [
                node("b-1", clique="rackB.1"),
                node("a-1"),
                node("a-0"),
                node("b-0", clique="rackB.1"),
            ],
        }
    )
    assert [d.name for d in topology.domains] == [f"{RACK}.1", "rackB.1"]
    assert [t.name for t in topology.domains[0].trays] == ["a-0", "a-1"]
    assert [(t.name, t.rack, t.slot, t.gpus) for t in topology.trays] == [
        ("a-0", 0, 0, 4),
        ("a-1", 0, 1, 4),
        ("b-0", 1, 0, 4),
        ("b-1", 1, 1, 4),
    ]
    assert all(tray.eligible for tray in topology.trays)


def test_tray_without_clique_label_is_not_eligible() -> None:
    tray = only_tray(node("t0", clique=None))
    assert tray.domain is None and tray.rack == -1
    assert not tray.eligible and not tray.keeps_pods


def test_node_without_gpus_or_clique_label_is_not_a_tray() -> None:
    topology = parse_topology([node("control-plane", clique=None, gpus=None), node("t0")])
    assert [tray.name for tray in topology.trays] == ["t0"]


def test_gpus_come_from_allocatable_not_capacity() -> None:
    assert only_tray(node("t0", gpus="3")).gpus == 3
    assert only_tray(node("t0", gpus=4)).gpus == 4


@pytest.mark.parametrize("ready", ["False", "Unknown", None], ids=["false", "unknown", "missing"])
def test_tray_whose_ready_condition_is_not_true_is_not_eligible(ready: str | None) -> None:
    tray = only_tray(node("t0", ready=ready))
    assert not tray.ready and not tray.eligible and not tray.keeps_pods


def test_cordoned_tray_gets_no_new_pods_but_keeps_its_own() -> None:
    tray = only_tray(node("t0", unschedulable=True))
    assert not tray.schedulable and not tray.eligible
    assert tray.keeps_pods


@pytest.mark.parametrize(
    ("taint", "schedulable", "evicts"),
    [
        ({"key": "maintenance", "effect": "NoSchedule"}, False, False),
        ({"key": "node.kubernetes.io/unreachable", "effect": "NoExecute"}, False, True),
        ({"key": "nvidia.com/gpu", "effect": "NoSchedule", "value": "present"}, True, False),
        ({"key": "nvidia.com/gpu", "effect": "NoExecute"}, True, False),
        ({"key": "maintenance", "effect": "PreferNoSchedule"}, True, False),
    ],
    ids=["no-schedule", "no-execute", "gpu-no-schedule", "gpu-no-execute", "prefer-no-schedule"],
)
def test_only_untolerated_blocking_taints_make_a_tray_unschedulable(
    taint: dict[str, str], schedulable: bool, evicts: bool
) -> None:
    tray = only_tray(node("t0", taints=[taint]))
    assert tray.schedulable is schedulable
    assert tray.evicts_pods is evicts
    assert tray.keeps_pods is not evicts


def test_a_tray_keeps_its_blocking_taints_and_labels_for_deployments_that_name_them() -> None:
    taints = [
        {"key": "example.com/reserved", "value": "llm", "effect": "NoSchedule"},
        {"key": "nvidia.com/gpu", "effect": "NoSchedule"},
        {"key": "soft", "effect": "PreferNoSchedule"},
    ]
    tray = only_tray(node("t0", taints=taints))
    assert tray.taints == (TrayTaint("example.com/reserved", "llm", "NoSchedule"),)
    assert not tray.schedulable and not tray.cordoned
    assert ("kubernetes.io/hostname", "t0") in tray.labels
    assert only_tray(node("t1", unschedulable=True)).cordoned


@pytest.mark.parametrize(
    ("value", "quarantined"),
    [("true", True), ("Xid 149 three times", True), ("", True), ("false", False)],
    ids=["true", "reason", "empty", "false"],
)
def test_quarantine_annotation_takes_a_tray_out(value: str, quarantined: bool) -> None:
    tray = only_tray(node("t0", annotations={QUARANTINED_ANNOTATION: value}))
    assert tray.quarantined is quarantined
    assert tray.eligible is not quarantined


def test_gpus_used_by_others_come_from_the_annotation_or_the_callers_mapping() -> None:
    annotated = node("t0", annotations={GPUS_USED_BY_OTHERS_ANNOTATION: "2"})
    assert only_tray(annotated).used_by_others == 2
    assert only_tray(annotated).free_gpus == 2
    assert only_tray(annotated, used_by_others={"t0": 1}).used_by_others == 1
    assert only_tray(node("t0"), used_by_others={"t0": 9}).used_by_others == 4


def test_custom_domain_label_and_gpu_resource_are_honoured() -> None:
    item = node("t0", clique=None, gpus=None)
    item["metadata"]["labels"]["ds.coreweave.com/nvlink.domain"] = "nvl-7"
    item["status"]["allocatable"]["nvidia.com/gb300"] = "4"
    tray = only_tray(
        item, domain_label="ds.coreweave.com/nvlink.domain", gpu_resource="nvidia.com/gb300"
    )
    assert (tray.domain, tray.gpus) == ("nvl-7", 4)


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        (
            [node("t0", gpus="four")],
            "item 0 (node 't0'): field 'status.allocatable.nvidia.com/gpu'",
        ),
        (
            [node("t0", annotations={GPUS_USED_BY_OTHERS_ANNOTATION: "-1"})],
            f"annotation '{GPUS_USED_BY_OTHERS_ANNOTATION}'",
        ),
        ([{"kind": "Node", "metadata": {}}], "item 0: field 'metadata.name': Field required"),
        ({"kind": "Pod"}, "fix: kubectl get nodes -o yaml"),
        ({"trays": [{"name": "t0", "gpu": 4}]}, "field 'trays.0.gpu'"),
        ([node("t0"), node("t0")], "two trays are named 't0'"),
    ],
    ids=["allocatable", "annotation", "no-name", "not-nodes", "simple-typo", "duplicate"],
)
def test_bad_node_data_names_the_item_and_field(data: object, needle: str) -> None:
    with pytest.raises(TopologyError) as raised:
        parse_topology(data)
    assert needle in str(raised.value)


def test_a_list_a_single_node_and_a_node_list_parse_alike() -> None:
    nodes = [node("t0"), node("t1")]
    as_list = parse_topology(nodes)
    assert parse_topology({"kind": "List", "items": nodes}) == as_list
    assert parse_topology(nodes[0]).trays == as_list.trays[:1]


def test_simple_form_carries_the_same_facts() -> None:
    topology = parse_topology(
        {
            "trays": [
                {"name": "t0", "domain": "r.1"},
                {"name": "t1", "domain": "r.1", "usedByOthers": 2, "schedulable": False},
                {"name": "t2", "ready": False},
            ]
        }
    )
    t0, t1, t2 = (topology.tray(name) for name in ("t0", "t1", "t2"))
    assert t0 == Tray("t0", "r.1", 4, rack=0, slot=0)
    assert t1 is not None and t1.used_by_others == 2 and not t1.eligible
    assert t2 is not None and t2.domain is None and not t2.ready


def test_node_order_does_not_change_the_topology() -> None:
    nodes = synthetic_nodes(3, split_cliques=1)
    shuffled = list(nodes)
    random.Random(7).shuffle(shuffled)
    assert parse_topology(shuffled) == parse_topology(nodes)


def test_trays_are_numbered_in_natural_name_order() -> None:
    topology = topology_from_trays(
        [Tray("tray-10", "r.1", 4), Tray("tray-2", "r.1", 4), Tray("tray-1", "r.1", 4)]
    )
    assert [(tray.name, tray.slot) for tray in topology.trays] == [
        ("tray-1", 0),
        ("tray-2", 1),
        ("tray-10", 2),
    ]


def test_synthetic_rack_is_18_ready_trays_of_4_gpus_in_one_domain() -> None:
    topology = synthetic_topology(2)
    assert isinstance(topology, Topology)
    assert len(topology.trays) == 36 and len(topology.domains) == 2
    assert [len(domain.trays) for domain in topology.domains] == [18, 18]
    assert all(tray.gpus == 4 and tray.eligible for tray in topology.trays)
    assert topology.domains[1].trays[0].name == tray_name(1, 0)
    assert [domain.rack for domain in topology.domains] == [0, 1]


def test_synthetic_failures_usage_and_quarantine_show_on_the_trays() -> None:
    topology = synthetic_topology(
        1,
        failed=[tray_name(0, 1)],
        partly_used={tray_name(0, 2): 2},
        quarantined=[tray_name(0, 3)],
    )
    failed, used, quarantined = (topology.tray(tray_name(0, slot)) for slot in (1, 2, 3))
    assert failed is not None and not failed.ready
    assert used is not None and used.used_by_others == 2 and used.eligible
    assert quarantined is not None and quarantined.quarantined


def test_split_clique_gives_two_domains_in_one_rack() -> None:
    topology = synthetic_topology(2, split_cliques=1, seed=3)
    assert len(topology.domains) == 3
    racks = [domain.rack for domain in topology.domains]
    assert sorted(racks.count(rack) for rack in set(racks)) == [1, 2]
    assert sorted(len(domain.trays) for domain in topology.domains) == [9, 9, 18]


def test_synthetic_nodes_depend_on_the_seed_only() -> None:
    assert synthetic_nodes(2, seed=1) == synthetic_nodes(2, seed=1)
    assert synthetic_nodes(2, seed=1) != synthetic_nodes(2, seed=2)
    with pytest.raises(ValueError, match="split_cliques"):
        synthetic_nodes(2, split_cliques=3)
