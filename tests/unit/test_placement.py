"""Placement of cells on NVL72 trays (controller.placement): cases, properties, brute force."""

from __future__ import annotations

import itertools
import random
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from baton.core.api import Reason, Toleration
from controller.names import cell_name, decode_pod_name, prefill_pod_name
from controller.placement import (
    CellPlacement,
    DecodeShape,
    DeploymentShape,
    Plan,
    PrefillShape,
    TraySelector,
    plan_placement,
)
from controller.topology import (
    Topology,
    Tray,
    TrayTaint,
    synthetic_topology,
    topology_from_trays,
    tray_name,
)

PROPERTY = settings(max_examples=300, deadline=None)


def flash(cells: int = 1, instances: int | None = None, spares: int = 1) -> DeploymentShape:
    """The study's cell: DEP32 decode, DEP2 prefill (as many as fit unless ``instances``)."""
    return DeploymentShape("flash", cells, DecodeShape(32, 4, spares), PrefillShape(2, instances))


FLASH = flash()


def rack(domain: str, trays: int, changed: dict[int, dict[str, Any]] | None = None) -> list[Tray]:
    """A domain of healthy 4-GPU trays named ``<domain>-<slot>``; ``changed`` edits some slots."""
    changed = changed or {}
    return [
        replace(Tray(f"{domain}-{slot}", domain, 4), **changed.get(slot, {}))
        for slot in range(trays)
    ]


def topology_of(*racks: list[Tray]) -> Topology:
    return topology_from_trays(tray for trays in racks for tray in trays)


def fail(topology: Topology, *names: str, **flags: Any) -> Topology:
    """The same trays, with the named ones changed (by default: no longer Ready)."""
    change = flags or {"ready": False}
    return topology_from_trays(
        replace(tray, **change) if tray.name in names else tray for tray in topology.trays
    )


def only(plan: Plan) -> CellPlacement:
    assert len(plan.cells) == 1, plan.unplaced
    return plan.cells[0]


def prefill_trays(cell: CellPlacement) -> list[str]:
    return [instance.tray for instance in cell.prefill]


# --- cases -------------------------------------------------------------------------------------


def test_full_rack_holds_one_dep32_group_18_dep2_instances_and_a_spare_tray() -> None:
    cell = only(plan_placement([FLASH], synthetic_topology(1)))
    assert cell.decode_trays == tuple(tray_name(0, slot) for slot in range(8))
    assert cell.spare_trays == (tray_name(0, 8),)
    assert len(cell.prefill) == 18 == cell.max_prefill_instances
    assert {instance.gpus for instance in cell.prefill} == {(0, 1), (2, 3)}


def test_full_rack_without_spares_holds_20_dep2_instances() -> None:
    cell = only(plan_placement([flash(spares=0)], synthetic_topology(1)))
    assert len(cell.prefill) == 20 and cell.spare_trays == ()


def test_cell_never_spans_two_nvlink_domains() -> None:
    # 12 healthy trays in all, but only 6 in each domain: a 9-tray cell fits in neither.
    topology = topology_of(rack("a.1", 6), rack("b.1", 6))
    plan = plan_placement([flash(instances=2)], topology)
    assert plan.cells == ()
    assert [cell.reason for cell in plan.unplaced] == [Reason.INSUFFICIENT_CAPACITY]


def test_unplaced_cell_says_what_each_domain_lacked() -> None:
    topology = synthetic_topology(1, failed=[tray_name(0, slot) for slot in range(10)])
    plan = plan_placement([flash(instances=4)], topology)
    (unplaced,) = plan.unplaced
    assert unplaced.message.startswith(
        "cell flash-cell-0 needs 9 whole trays (8 decode + 1 spare) and 4 DEP2 prefill slots"
    )
    domain = topology.domains[0].name
    assert unplaced.domains == (
        f"domain {domain}: 8 of 9 whole trays free (8 decode + 1 spare), 0 of 4 prefill slots",
    )


def test_cells_take_one_nvlink_domain_each() -> None:
    small = DeploymentShape("small", 2, DecodeShape(8, 4, 0), PrefillShape(2, 2))
    plan = plan_placement([small], topology_of(rack("a.1", 18), rack("b.1", 18)))
    assert sorted(cell.domain for cell in plan.cells) == ["a.1", "b.1"]


def test_a_surge_cell_takes_only_what_every_deployments_own_cells_leave_and_is_never_unplaced() -> (
    None
):
    older = replace(flash(), name="older", surge=1)
    newer = replace(flash(), name="newer")
    two_racks = synthetic_topology(2)
    plan = plan_placement([older, newer], two_racks)
    assert [cell.name for cell in plan.cells] == [cell_name("older", 0), cell_name("newer", 0)]
    assert plan.unplaced == ()  # the surge cell found no free domain: not a capacity shortfall
    three_racks = synthetic_topology(3)
    plan = plan_placement([older, newer], three_racks)
    assert [cell.name for cell in plan.cells] == [
        cell_name("older", 0),
        cell_name("newer", 0),
        cell_name("older", 1),  # after every deployment's own cells
    ]
    assert len({cell.domain for cell in plan.cells}) == 3
    # placed, it keeps its trays while it stays wanted; unwanted, it is gone
    again = plan_placement([older, newer], three_racks, plan)
    assert again.cells == plan.cells
    assert [
        c.name for c in plan_placement([replace(older, surge=0), newer], three_racks, plan).cells
    ] == [
        cell_name("older", 0),
        cell_name("newer", 0),
    ]


def test_decode_takes_whole_trays_and_leaves_half_used_ones_to_prefill() -> None:
    topology = topology_of(rack("a.1", 12, {0: {"used_by_others": 2}, 3: {"used_by_others": 2}}))
    cell = only(plan_placement([flash(instances=2, spares=0)], topology))
    assert "a.1-0" not in cell.decode_trays and "a.1-3" not in cell.decode_trays
    assert prefill_trays(cell) == ["a.1-0", "a.1-3"]


def test_prefill_fills_half_used_trays_before_whole_ones() -> None:
    topology = topology_of(rack("a.1", 12, {11: {"used_by_others": 2}}))
    cell = only(plan_placement([flash(instances=3, spares=0)], topology))
    assert prefill_trays(cell) == ["a.1-11", "a.1-8", "a.1-8"]


def test_prefill_never_takes_more_gpus_than_a_tray_has_left() -> None:
    topology = topology_of(rack("a.1", 9, {8: {"used_by_others": 3}}))
    plan = plan_placement([flash(instances=1, spares=0)], topology)
    assert plan.cells == () and "0 of 1 prefill slots" in plan.unplaced[0].domains[0]


def test_tray_with_a_withheld_gpu_serves_prefill_but_not_decode() -> None:
    topology = topology_of(rack("a.1", 9, {0: {"gpus": 3}}))
    cell = only(plan_placement([flash(instances=1, spares=0)], topology))
    assert "a.1-0" not in cell.decode_trays and prefill_trays(cell) == ["a.1-0"]


@pytest.mark.parametrize(
    "flags",
    [{"quarantined": True}, {"schedulable": False}, {"ready": False}, {"domain": None}],
    ids=["quarantined", "cordoned", "not-ready", "no-clique-label"],
)
def test_ineligible_tray_gets_no_new_pod(flags: dict[str, object]) -> None:
    topology = fail(synthetic_topology(1), tray_name(0, 0), **flags)
    cell = only(plan_placement([FLASH], topology))
    assert tray_name(0, 0) not in {*cell.decode_trays, *cell.spare_trays, *prefill_trays(cell)}
    assert len(cell.prefill) == 16


def test_failed_decode_tray_moves_only_that_rank_onto_the_spare_tray() -> None:
    topology = synthetic_topology(1)
    before = plan_placement([FLASH], topology)
    after = plan_placement([FLASH], fail(topology, tray_name(0, 3)), before)
    old, new = only(before), only(after)
    assert new.decode_trays == (*old.decode_trays[:3], tray_name(0, 8), *old.decode_trays[4:])
    assert new.prefill == old.prefill
    assert new.spare_trays == ()
    assert after.restarted == ("flash-cell-0",)
    assert [(m.pod, m.source, m.target) for m in after.moved] == [
        ("flash-cell-0-decode-3", tray_name(0, 3), tray_name(0, 8))
    ]


def test_failed_decode_tray_takes_the_spare_even_when_free_trays_exist() -> None:
    topology = synthetic_topology(1)
    before = plan_placement([flash(instances=4)], topology)
    after = only(plan_placement([flash(instances=4)], fail(topology, tray_name(0, 3)), before))
    assert after.decode_trays[3] == tray_name(0, 8)
    assert after.spare_trays == (tray_name(0, 11),)  # topped up from the free trays


def test_failed_decode_tray_without_a_spare_takes_a_free_whole_tray() -> None:
    topology = topology_of(rack("a.1", 12))
    before = plan_placement([flash(instances=2, spares=0)], topology)
    after = plan_placement([flash(instances=2, spares=0)], fail(topology, "a.1-0"), before)
    assert only(after).decode_trays[0] == "a.1-9"
    assert only(after).prefill == only(before).prefill


def test_lost_spare_is_replaced_from_free_trays_before_prefill_grows() -> None:
    topology = topology_of(rack("a.1", 12))
    before = plan_placement([flash(instances=2)], topology)
    assert only(before).spare_trays == ("a.1-8",)
    after = plan_placement([flash(instances=4)], fail(topology, "a.1-8"), before)
    assert only(after).spare_trays == ("a.1-10",)
    assert prefill_trays(only(after)) == ["a.1-9", "a.1-9", "a.1-11", "a.1-11"]


def test_decode_group_with_no_spare_or_free_tray_reclaims_a_prefill_tray() -> None:
    # 10 trays: 8 decode, a half-used tray and a whole prefill tray; a decode tray fails.
    topology = topology_of(rack("a.1", 10, {9: {"used_by_others": 2}}))
    shape = flash(instances=3, spares=0)
    before = only(plan_placement([shape], topology))
    assert prefill_trays(before) == ["a.1-9", "a.1-8", "a.1-8"]
    after = plan_placement([shape], fail(topology, "a.1-2"), Plan((before,)))
    cell = only(after)
    assert cell.decode_trays[2] == "a.1-8"
    assert prefill_trays(cell) == ["a.1-9"]  # instance 0 stays; 1 and 2 have nowhere to go
    assert cell.max_prefill_instances == 1


def test_cell_whose_decode_group_no_longer_fits_its_domain_moves_to_another() -> None:
    topology = topology_of(rack("a.1", 9), rack("b.1", 12))
    shape = flash(instances=0, spares=0)
    a_down = fail(topology, *(f"a.1-{slot}" for slot in range(9)))
    before = plan_placement([shape], a_down)
    assert only(before).domain == "b.1"
    b_down = fail(topology, *(f"b.1-{slot}" for slot in range(5)))
    after = plan_placement([shape], b_down, before)
    assert only(after).domain == "a.1"
    assert after.restarted == ("flash-cell-0",)


def test_failed_prefill_tray_moves_only_its_instances() -> None:
    topology = synthetic_topology(1, partly_used={tray_name(0, 17): 4})
    before = only(plan_placement([flash(instances=10)], topology))
    lost = {i.index for i in before.prefill if i.tray == tray_name(0, 9)}
    after = plan_placement([flash(instances=10)], fail(topology, tray_name(0, 9)), Plan((before,)))
    cell = only(after)
    assert cell.decode_trays == before.decode_trays and cell.spare_trays == before.spare_trays
    kept = [i for i in cell.prefill if i.index not in lost]
    assert kept == [i for i in before.prefill if i.index not in lost]
    assert {m.pod for m in after.moved} == {f"flash-cell-0-prefill-{i}" for i in lost}
    assert after.restarted == ()


def test_prefill_scale_up_never_consumes_the_spare_trays() -> None:
    topology = synthetic_topology(1)
    before = only(plan_placement([flash(instances=4)], topology))
    after = only(plan_placement([flash(instances=30)], topology, Plan((before,))))
    assert after.spare_trays == before.spare_trays and after.decode_trays == before.decode_trays
    assert after.prefill[:4] == before.prefill
    assert len(after.prefill) == 18 == after.max_prefill_instances


def test_prefill_scale_down_drops_the_highest_instances_in_dep2_steps() -> None:
    topology = synthetic_topology(1)
    before = only(plan_placement([flash(instances=18)], topology))
    after = only(plan_placement([flash(instances=13)], topology, Plan((before,))))
    assert after.prefill == before.prefill[:13]
    assert after.max_prefill_instances == 18


def test_plan_reports_the_largest_prefill_count_that_still_fits() -> None:
    topology = synthetic_topology(1, failed=[tray_name(0, 17)], partly_used={tray_name(0, 16): 2})
    cell = only(plan_placement([flash(instances=2)], topology))
    assert cell.max_prefill_instances == 15  # 7 whole trays + one half-used tray
    bigger = only(plan_placement([flash(instances=15)], topology, Plan((cell,))))
    assert len(bigger.prefill) == 15


def test_cordoned_tray_keeps_its_pods_but_its_spare_is_replaced() -> None:
    topology = topology_of(rack("a.1", 12))
    before = plan_placement([flash(instances=2)], topology)
    cordoned = fail(topology, "a.1-0", "a.1-8", "a.1-9", schedulable=False)
    after = plan_placement([flash(instances=2)], cordoned, before)
    assert only(after).decode_trays == only(before).decode_trays
    assert only(after).prefill == only(before).prefill
    assert only(after).spare_trays == ("a.1-10",)


def test_cells_no_longer_wanted_are_dropped_and_their_domain_freed() -> None:
    topology = synthetic_topology(2)
    before = plan_placement([flash(cells=2)], topology)
    after = plan_placement([flash(cells=1)], topology, before)
    assert after.cells == before.cells[:1]


def test_augmenting_path_moves_a_new_cell_to_make_room() -> None:
    # "any" wants the most prefill slots, so it takes a.1 first; "big" fits only a.1.
    any_shape = DeploymentShape("any", 1, DecodeShape(4, 4, 0), PrefillShape(2, None))
    big = DeploymentShape("big", 1, DecodeShape(16, 4, 0), PrefillShape(2, 4))
    plan = plan_placement([any_shape, big], topology_of(rack("a.1", 6), rack("b.1", 3)))
    assert {cell.name: cell.domain for cell in plan.cells} == {
        "any-cell-0": "b.1",
        "big-cell-0": "a.1",
    }


def test_a_cell_already_admitted_keeps_its_domain_when_no_path_frees_one() -> None:
    any_shape = DeploymentShape("any", 1, DecodeShape(4, 4, 0), PrefillShape(2, None))
    big = DeploymentShape("big", 1, DecodeShape(16, 4, 0), PrefillShape(2, 4))
    plan = plan_placement([any_shape, big], topology_of(rack("a.1", 6)))
    assert [cell.name for cell in plan.cells] == ["any-cell-0"]
    assert [cell.name for cell in plan.unplaced] == ["big-cell-0"]
    assert "the only NVLink domain hosts a cell" in plan.unplaced[0].message


def test_no_nvlink_domain_at_all_is_explained() -> None:
    topology = topology_of([Tray("t0", None, 4)])
    (unplaced,) = plan_placement([FLASH], topology).unplaced
    assert "there is no NVLink domain" in unplaced.message


GB300 = ("nvidia.com/gpu.product", "NVIDIA-GB300")
RESERVED = TrayTaint("example.com/reserved", "llm", "NoSchedule")


def test_a_node_selector_keeps_cells_on_the_trays_it_names() -> None:
    # rack a's trays lack the label; rack b's carry it: the cell goes to b though a comes first
    topology = topology_of(
        rack("a", 18), rack("b", 18, {i: {"labels": (GB300,)} for i in range(18)})
    )
    selected = replace(FLASH, trays=TraySelector(labels=(GB300,)))
    assert only(plan_placement([selected], topology)).domain == "b"
    assert only(plan_placement([FLASH], topology)).domain == "a"


def test_a_node_selector_no_tray_matches_is_named_in_the_explanation() -> None:
    selected = replace(FLASH, trays=TraySelector(labels=(GB300,)))
    (unplaced,) = plan_placement([selected], topology_of(rack("a", 18))).unplaced
    assert "18 healthy trays left out by engine.nodeSelector or untolerated taints" in str(
        unplaced.domains
    )


def test_tainted_trays_serve_only_deployments_that_tolerate_the_taint() -> None:
    tainted = {i: {"schedulable": False, "taints": (RESERVED,)} for i in range(18)}
    topology = topology_of(rack("a", 18, tainted))
    assert not plan_placement([FLASH], topology).cells
    exists = Toleration(key=RESERVED.key, operator="Exists")
    equal = Toleration(key=RESERVED.key, value="llm", effect="NoSchedule")
    wrong_value = Toleration(key=RESERVED.key, value="batch")
    for toleration, placed in ((exists, True), (equal, True), (wrong_value, False)):
        shape = replace(FLASH, trays=TraySelector(tolerations=(toleration,)))
        assert bool(plan_placement([shape], topology).cells) is placed, toleration


def test_a_cordoned_tray_stays_closed_whatever_the_tolerations() -> None:
    cordoned = {
        i: {"schedulable": False, "cordoned": True, "taints": (RESERVED,)} for i in range(18)
    }
    shape = replace(FLASH, trays=TraySelector(tolerations=(Toleration(operator="Exists"),)))
    assert not plan_placement([shape], topology_of(rack("a", 18, cordoned))).cells


def test_pods_on_a_tray_tainted_noexecute_stay_only_if_they_tolerate_it() -> None:
    evict = TrayTaint("example.com/maintenance", "", "NoExecute")
    tolerant = replace(
        FLASH, trays=TraySelector(tolerations=(Toleration(key=evict.key, operator="Exists"),))
    )
    for shape, stays in ((FLASH, False), (tolerant, True)):
        before = only(plan_placement([shape], synthetic_topology(1)))
        rank0 = before.decode_trays[0]
        later = fail(
            synthetic_topology(1), rank0, schedulable=False, evicts_pods=True, taints=(evict,)
        )
        after = only(plan_placement([shape], later, Plan((before,))))
        assert (after.decode_trays[0] == rank0) is stays


def test_shape_errors_say_why() -> None:
    with pytest.raises(ValueError, match="each decode pod takes a whole tray"):
        DecodeShape(30, 4)
    with pytest.raises(ValueError, match="listed twice"):
        plan_placement([FLASH, FLASH], synthetic_topology(1))


# --- properties on random topologies -----------------------------------------------------------


@dataclass(frozen=True)
class Cluster:
    """Trays of up to three small domains, and one or two deployments sized to them."""

    trays: tuple[Tray, ...]
    shapes: tuple[DeploymentShape, ...]

    @property
    def topology(self) -> Topology:
        return topology_from_trays(self.trays)


@st.composite
def trays_in(draw: st.DrawFn, domain: str | None, count: int, gpus: int) -> list[Tray]:
    trays = []
    for slot in range(count):
        tray = Tray(f"{domain or 'x'}-{slot}", domain, gpus)
        # Most trays are healthy: the interesting cases are the few that are not.
        trouble = draw(
            st.sampled_from(
                ["none"] * 6
                + ["not-ready", "quarantined", "cordoned", "evicting", "half", "full", "short"]
            )
        )
        if trouble == "not-ready":
            tray = replace(tray, ready=False)
        elif trouble == "quarantined":
            tray = replace(tray, quarantined=True)
        elif trouble == "cordoned":
            tray = replace(tray, schedulable=False)
        elif trouble == "evicting":
            tray = replace(tray, schedulable=False, evicts_pods=True)
        elif trouble == "half":
            tray = replace(tray, used_by_others=gpus // 2)
        elif trouble == "full":
            tray = replace(tray, used_by_others=gpus)
        elif trouble == "short":
            tray = replace(tray, gpus=gpus - 1)
        trays.append(tray)
    return trays


@st.composite
def shapes_for(
    draw: st.DrawFn, name: str, gpus: int, max_cells: int, sharing: bool = False
) -> DeploymentShape:
    return DeploymentShape(
        name,
        draw(st.integers(1, max_cells)),
        DecodeShape(gpus * draw(st.integers(1, 4)), gpus, draw(st.integers(0, 2))),
        PrefillShape(
            draw(st.sampled_from([dep for dep in (1, 2, 4) if dep <= gpus])),
            draw(st.none() | st.integers(0, 6)),
        ),
        shares_domain=sharing and draw(st.booleans()),
    )


@st.composite
def clusters(
    draw: st.DrawFn, max_domains: int = 3, max_trays: int = 10, sharing: bool = False
) -> Cluster:
    """``sharing``: deployments may share NVLink domains (each at random)."""
    gpus = draw(st.sampled_from([2, 4]))
    trays: list[Tray] = []
    for index in range(draw(st.integers(1, max_domains))):
        domain = f"rack{index}.{draw(st.sampled_from([1, 2]))}"
        trays += draw(trays_in(domain, draw(st.integers(1, max_trays)), gpus))
    trays += draw(trays_in(None, draw(st.integers(0, 2)), gpus))
    names = draw(st.sampled_from([("a",), ("a", "b")]))
    shapes = tuple(draw(shapes_for(name, gpus, 4 - len(names), sharing)) for name in names)
    return Cluster(tuple(trays), shapes)


@st.composite
def failures(draw: st.DrawFn, trays: Sequence[Tray]) -> tuple[Tray, ...]:
    """The same trays a while later: some failed, left, lost their label or recovered."""
    later = []
    for tray in trays:
        change = draw(
            st.sampled_from(
                ["same"] * 5
                + [
                    "not-ready",
                    "quarantined",
                    "cordoned",
                    "evicting",
                    "gone",
                    "unlabelled",
                    "recovered",
                ]
            )
        )
        if change == "gone":
            continue
        later.append(
            {
                "same": tray,
                "not-ready": replace(tray, ready=False),
                "quarantined": replace(tray, quarantined=True),
                "cordoned": replace(tray, schedulable=False),
                "evicting": replace(tray, schedulable=False, evicts_pods=True),
                "unlabelled": replace(tray, domain=None),
                "recovered": replace(
                    tray, ready=True, schedulable=True, quarantined=False, evicts_pods=False
                ),
            }[change]
        )
    return tuple(later)


def assert_sound(plan: Plan, topology: Topology, shapes: Sequence[DeploymentShape]) -> None:
    """Invariants of every plan, fresh or re-planned."""
    shape_of = {shape.name: shape for shape in shapes}
    held: dict[str, set[int]] = {}
    in_domain: dict[str, list[str]] = {}
    for cell in plan.cells:
        in_domain.setdefault(cell.domain, []).append(cell.deployment)
    for deployments in in_domain.values():
        if len(deployments) > 1:
            assert all(shape_of[d].shares_domain for d in deployments), "a domain shared unasked"
    cell_of: dict[str, str] = {}
    for cell in plan.cells:
        for name in (*cell.decode_trays, *cell.spare_trays, *(i.tray for i in cell.prefill)):
            assert cell_of.setdefault(name, cell.name) == cell.name, f"{name}: pods of two cells"
    for cell in plan.cells:
        shape = shape_of[cell.deployment]
        assert len(cell.decode_trays) == shape.decode.trays
        assert len(cell.spare_trays) <= shape.decode.spare_trays
        if shape.prefill.instances is not None:
            assert len(cell.prefill) <= shape.prefill.instances
        for name in (*cell.decode_trays, *cell.spare_trays):
            tray = topology.tray(name)
            assert tray is not None and tray.domain == cell.domain and tray.keeps_pods
            assert tray.gpus == shape.decode.gpus_per_pod and tray.used_by_others == 0
            assert name not in held, f"{name} is taken twice"
            held[name] = set(range(tray.gpus))
        for name in cell.spare_trays:
            spare = topology.tray(name)
            assert spare is not None and spare.eligible
        assert len({i.index for i in cell.prefill}) == len(cell.prefill)
        assert cell.max_prefill_instances >= len(cell.prefill)
        for instance in cell.prefill:
            tray = topology.tray(instance.tray)
            assert tray is not None and tray.domain == cell.domain and tray.keeps_pods
            assert len(instance.gpus) == shape.prefill.dep
            gpus = held.setdefault(instance.tray, set())
            assert not gpus & set(instance.gpus), f"GPU taken twice on {instance.tray}"
            assert all(0 <= gpu < tray.gpus for gpu in instance.gpus)
            gpus |= set(instance.gpus)
    for name, gpus in held.items():
        tray = topology.tray(name)
        assert tray is not None and len(gpus) + tray.used_by_others <= tray.gpus


def assert_admitted_whole(
    plan: Plan, topology: Topology, shapes: Sequence[DeploymentShape]
) -> None:
    """A fresh plan: every cell complete on eligible trays, or absent with a reason."""
    shape_of = {shape.name: shape for shape in shapes}
    for cell in plan.cells:
        shape = shape_of[cell.deployment]
        assert len(cell.spare_trays) == shape.decode.spare_trays
        wanted = shape.prefill.instances
        if wanted is None:
            assert len(cell.prefill) == cell.max_prefill_instances >= 1
        else:
            assert len(cell.prefill) == wanted
        for name in (*cell.decode_trays, *cell.spare_trays, *prefill_trays(cell)):
            tray = topology.tray(name)
            assert tray is not None and tray.eligible
    wanted_cells = {cell_name(s.name, i) for s in shapes for i in range(s.cells)}
    unplaced = {cell.name for cell in plan.unplaced}
    assert {cell.name for cell in plan.cells} | unplaced == wanted_cells
    assert not unplaced & {cell.name for cell in plan.cells}
    for left_out in plan.unplaced:
        assert left_out.reason is Reason.INSUFFICIENT_CAPACITY and left_out.message


@PROPERTY
@given(clusters(sharing=True))
def test_no_partial_cell_and_never_more_gpus_than_a_tray_has(cluster: Cluster) -> None:
    topology = cluster.topology
    plan = plan_placement(cluster.shapes, topology)
    assert_sound(plan, topology, cluster.shapes)
    assert_admitted_whole(plan, topology, cluster.shapes)


@PROPERTY
@given(clusters(sharing=True), st.randoms(use_true_random=False))
def test_same_inputs_give_the_same_plan_whatever_the_node_order(
    cluster: Cluster, rng: random.Random
) -> None:
    shuffled = list(cluster.trays)
    rng.shuffle(shuffled)
    plan = plan_placement(cluster.shapes, cluster.topology)
    assert plan_placement(cluster.shapes, topology_from_trays(shuffled)) == plan
    assert plan_placement(cluster.shapes, cluster.topology, plan) == plan


def healthy_for(tray: Tray | None, domain: str, bound: bool = True) -> bool:
    """A pod may stay: it runs on a tray that keeps pods, or is yet to be bound to an eligible
    one (a new pod never binds to a cordoned tray)."""
    return (
        tray is not None and tray.domain == domain and tray.keeps_pods and (bound or tray.eligible)
    )


def eligible_in(topology: Topology, name: str, domain: str) -> bool:
    tray = topology.tray(name)
    return tray is not None and tray.domain == domain and tray.eligible


@PROPERTY
@given(st.data())
def test_replanning_moves_nothing_healthy(data: st.DataObject) -> None:
    cluster = data.draw(clusters(sharing=True))
    before = plan_placement(cluster.shapes, cluster.topology)
    later = topology_from_trays(data.draw(failures(cluster.trays)))
    pods = sorted(
        name
        for cell in before.cells
        for name in [decode_pod_name(cell.name, r) for r in range(len(cell.decode_trays))]
        + [prefill_pod_name(cell.name, i.index) for i in cell.prefill]
    )
    unbound = set(data.draw(st.lists(st.sampled_from(pods), unique=True) if pods else st.just([])))
    after = plan_placement(cluster.shapes, later, before, unbound)
    assert_sound(after, later, cluster.shapes)
    shape_of = {shape.name: shape for shape in cluster.shapes}
    for old in before.cells:
        new = after.cell(old.name)
        shape = shape_of[old.deployment]
        decode_bound = [
            decode_pod_name(old.name, rank) not in unbound for rank in range(len(old.decode_trays))
        ]
        decode_ok = [
            healthy_for(later.tray(name), old.domain, bound)
            for name, bound in zip(old.decode_trays, decode_bound, strict=True)
        ]
        if new is None or new.domain != old.domain:
            # Released only when the domain cannot hold the decode group any more, on trays
            # no other cell there holds, before or after (a cell kept repairs first: a tray
            # both lost cells could take goes to one)
            domain = later.domain(old.domain)
            others = {
                name
                for cell in (*before.cells, *after.cells)
                if cell.name != old.name
                for name in (*cell.decode_trays, *cell.spare_trays, *(i.tray for i in cell.prefill))
            }
            usable = [
                tray
                for tray in (domain.trays if domain else ())
                if tray.name not in others
                and tray.gpus == shape.decode.gpus_per_pod
                and tray.used_by_others == 0
                and (
                    tray.eligible
                    or any(
                        name == tray.name and bound and tray.keeps_pods
                        for name, bound in zip(old.decode_trays, decode_bound, strict=True)
                    )
                )
            ]
            assert len(usable) < shape.decode.trays
            continue
        for rank, name in enumerate(old.decode_trays):
            if decode_ok[rank]:
                assert new.decode_trays[rank] == name
        lost = [rank for rank, ok in enumerate(decode_ok) if not ok]
        spares = [name for name in old.spare_trays if eligible_in(later, name, old.domain)]
        for rank, spare in zip(lost, spares, strict=False):
            assert new.decode_trays[rank] == spare, "a lost decode rank takes a spare first"
        assert (old.name in after.restarted) == (not all(decode_ok))
        for rank, name in enumerate(new.decode_trays):
            if decode_pod_name(new.name, rank) in unbound:
                assert eligible_in(later, name, new.domain), "an unbound pod on a cordoned tray"
        kept = {i.index: i for i in new.prefill}
        for instance in new.prefill:
            if prefill_pod_name(new.name, instance.index) in unbound:
                assert eligible_in(later, instance.tray, new.domain)
        for instance in old.prefill:
            bound = prefill_pod_name(old.name, instance.index) not in unbound
            if healthy_for(later.tray(instance.tray), old.domain, bound):
                if instance.tray in new.decode_trays:
                    continue  # reclaimed by its own decode group, which had nothing else
                assert kept.get(instance.index) == instance
        for name in spares:
            assert name in new.spare_trays or name in new.decode_trays


@PROPERTY
@given(clusters(sharing=True), st.integers(0, 8))
def test_prefill_scale_up_never_consumes_spare_trays(cluster: Cluster, more: int) -> None:
    before = plan_placement(cluster.shapes, cluster.topology)
    grown = tuple(
        s
        if s.prefill.instances is None
        else replace(s, prefill=replace(s.prefill, instances=s.prefill.instances + more))
        for s in cluster.shapes
    )
    after = plan_placement(grown, cluster.topology, before)
    assert_sound(after, cluster.topology, grown)
    asked = {shape.name: shape.prefill.instances for shape in grown}
    for old in before.cells:
        new = after.cell(old.name)
        assert new is not None
        assert (new.decode_trays, new.spare_trays) == (old.decode_trays, old.spare_trays)
        assert new.prefill[: len(old.prefill)] == old.prefill
        wanted = asked[old.deployment]
        alone = [cell.domain for cell in before.cells].count(old.domain) == 1
        if wanted is not None and alone:
            # The count reported as fitting is exactly what a scale-up gets (cells sharing a
            # domain share its free slots).
            assert len(new.prefill) == min(wanted, old.max_prefill_instances)
    assert after.moved == () and after.restarted == ()


# --- exhaustive: placement finds a fit whenever one exists ---------------------------------------


def domain_fits(trays: Sequence[Tray], shape: DeploymentShape) -> bool:
    """Brute force: some choice of decode and spare trays leaves enough prefill slots."""
    whole = shape.decode.trays + shape.decode.spare_trays
    wanted = 1 if shape.prefill.instances is None else shape.prefill.instances
    for chosen in itertools.combinations(range(len(trays)), whole):
        if not all(
            trays[i].eligible
            and trays[i].gpus == shape.decode.gpus_per_pod
            and trays[i].used_by_others == 0
            for i in chosen
        ):
            continue
        slots = sum(
            tray.free_gpus // shape.prefill.dep
            for i, tray in enumerate(trays)
            if i not in chosen and tray.eligible
        )
        if slots >= wanted:
            return True
    return False


def most_cells_that_fit(topology: Topology, shapes: Sequence[DeploymentShape]) -> int:
    cells = [shape for shape in shapes for _ in range(shape.cells)]
    fits = [[domain_fits(d.trays, shape) for d in topology.domains] for shape in cells]
    best = 0
    choices = [None, *range(len(topology.domains))]
    for assignment in itertools.product(choices, repeat=len(cells)):
        used = [domain for domain in assignment if domain is not None]
        if len(used) != len(set(used)):
            continue
        if all(domain is None or fits[cell][domain] for cell, domain in enumerate(assignment)):
            best = max(best, len(used))
    return best


@settings(max_examples=300, deadline=None)
@given(clusters(max_domains=3, max_trays=8))
def test_placement_finds_a_fit_whenever_one_exists(cluster: Cluster) -> None:
    topology = cluster.topology
    plan = plan_placement(cluster.shapes, topology)
    assert len(plan.cells) == most_cells_that_fit(topology, cluster.shapes)


SMALL_SHAPES = [
    (decode, spares, instances)
    for decode in (1, 2, 3)
    for spares in (0, 1)
    for instances in (None, 0, 2)
]


def small_domain(name: str, whole: int, half: int) -> list[Tray]:
    trays = [Tray(f"{name}-w{slot}", name, 4) for slot in range(whole)]
    return trays + [Tray(f"{name}-h{slot}", name, 4, used_by_others=2) for slot in range(half)]


def test_placement_finds_a_fit_whenever_one_exists_on_every_small_topology() -> None:
    # Every pair of small shapes (4-GPU trays, DEP2 prefill) on every pair of domains of up to
    # 5 whole and 1 half-used tray: the plan admits as many cells as brute force can.
    layouts = [(whole, half) for whole in range(6) for half in range(2)]
    checked = 0
    for first, second in itertools.combinations_with_replacement(layouts, 2):
        topology = topology_of(small_domain("a.1", *first), small_domain("b.1", *second))
        for one, two in itertools.product(SMALL_SHAPES, repeat=2):
            shapes = [
                DeploymentShape(name, 1, DecodeShape(4 * decode, 4, spares), PrefillShape(2, n))
                for name, (decode, spares, n) in (("a", one), ("b", two))
            ]
            plan = plan_placement(shapes, topology)
            assert len(plan.cells) == most_cells_that_fit(topology, shapes), (first, second, shapes)
            checked += 1
    assert checked == 78 * 18 * 18


def test_a_cell_refused_because_every_domain_hosts_one_says_what_the_free_trays_can_take() -> None:
    # two racks, three cells of 8 decode + 1 spare + 2 prefill trays: 7 trays of each rack free,
    # which a second cell in the domain could not use anyway (one cell per NVLink domain)
    plan = plan_placement([flash(cells=3, instances=4)], synthetic_topology(2))
    [unplaced] = plan.unplaced
    assert unplaced.message.endswith("all 2 NVLink domains host cells")
    assert len(unplaced.domains) == 2
    for line in unplaced.domains:
        assert line.endswith(
            "hosts a cell (one cell per NVLink domain unless every deployment in it sets "
            "topology.exclusiveDomain: false): 7 whole trays and 14 DEP2 prefill slots "
            "free there, for its cells' prefill only"
        )
    # Sharing would not help here: a third cell needs 11 trays in one domain, which says so.
    sharing = replace(flash(cells=3, instances=4), shares_domain=True)
    [unplaced] = plan_placement([sharing], synthetic_topology(2)).unplaced
    assert unplaced.domains == tuple(
        f"domain {domain}: 7 of 9 whole trays free (8 decode + 1 spare), 0 of 4 prefill "
        "slots, beside the cells it hosts"
        for domain in (d.name for d in synthetic_topology(2).domains)
    )


def dep16(name: str, cells: int, instances: int | None = 2, shares: bool = True) -> DeploymentShape:
    """A DEP16 cell: 4 decode trays and a spare, and its prefill."""
    return DeploymentShape(
        name, cells, DecodeShape(16, 4, 1), PrefillShape(2, instances), shares_domain=shares
    )


def test_cells_that_share_domains_fill_each_rack_on_trays_of_their_own() -> None:
    topology = synthetic_topology(2)
    shapes = [dep16("small", 6)]  # 6 trays a cell: three to a rack
    plan = plan_placement(shapes, topology)
    assert plan.feasible and len(plan.cells) == 6
    assert sorted(Counter(cell.domain for cell in plan.cells).values()) == [3, 3]
    assert_sound(plan, topology, shapes)
    assert plan_placement(shapes, topology, plan) == plan
    # Left exclusive, the same deployment gets a rack per cell and says why the rest wait.
    alone = plan_placement([dep16("small", 6, shares=False)], topology)
    assert len(alone.cells) == 2 and len(alone.unplaced) == 4
    assert all(
        "unless every deployment in it sets topology.exclusiveDomain: false" in line
        for line in alone.unplaced[0].domains
    )


def test_a_cell_that_shares_packs_and_leaves_the_free_domain_to_one_that_cannot() -> None:
    topology = synthetic_topology(2)
    first = plan_placement([dep16("a", 1)], topology)
    shapes = [dep16("a", 1), dep16("b", 1), dep16("c", 1, shares=False)]
    plan = plan_placement(shapes, topology, first)
    assert plan.feasible
    a, b, c = (plan.cell(cell_name(name, 0)) for name in "abc")
    assert a is not None and b is not None and c is not None
    assert b.domain == a.domain != c.domain
    trays = (first.cells[0].decode_trays, first.cells[0].spare_trays, first.cells[0].prefill)
    assert (a.decode_trays, a.spare_trays, a.prefill) == trays and plan.moved == ()
    assert_sound(plan, topology, shapes)


def test_a_sharing_cell_growing_its_prefill_never_takes_a_neighbours_trays() -> None:
    # b first with two instances, then a with as many as fit: a's prefill fills the rack's rest
    topology = synthetic_topology(1)
    shapes = [dep16("b", 1), dep16("a", 1, instances=None)]
    plan = plan_placement(shapes, topology)
    assert plan.feasible
    assert_sound(plan, topology, shapes)
    # a is repaired before b (name order) and may not grow into b's trays
    assert plan_placement(shapes, topology, plan) == plan
    grown = [dep16("b", 1, instances=6), dep16("a", 1, instances=None)]
    after = plan_placement(grown, topology, plan)
    assert after.cell(cell_name("a", 0)) == plan.cell(cell_name("a", 0))
    b = after.cell(cell_name("b", 0))
    assert b is not None and len(b.prefill) == 2 == b.max_prefill_instances
    assert after.moved == () and after.restarted == ()
