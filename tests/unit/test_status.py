"""ModelDeployment conditions: transitions move only on a status flip; capacity is an outcome."""

from __future__ import annotations

from typing import Literal

from baton.core.api import Condition, ConditionType, Reason
from controller.placement import DeploymentShape, plan_placement
from controller.status import ConditionStamp, placement_conditions, set_condition
from controller.topology import synthetic_topology


def condition(
    status: Literal["True", "False", "Unknown"],
    reason: str = "Placed",
    time: str = "t0",
    message: str = "",
) -> Condition:
    return Condition(
        type=ConditionType.PLACED,
        status=status,
        reason=reason,
        message=message,
        last_transition_time=time,
        observed_generation=1,
    )


def test_a_new_condition_is_added() -> None:
    conditions: list[Condition] = []
    assert set_condition(conditions, condition("True"))
    assert [c.type for c in conditions] == [ConditionType.PLACED]


def test_the_same_condition_again_changes_nothing() -> None:
    conditions = [condition("True", time="t0")]
    assert not set_condition(conditions, condition("True", time="t1"))
    assert conditions[0].last_transition_time == "t0"


def test_a_new_message_keeps_the_transition_time() -> None:
    conditions = [condition("False", "InsufficientCapacity", "t0", "short by 2 trays")]
    assert set_condition(
        conditions, condition("False", "InsufficientCapacity", "t1", "short by 1 tray")
    )
    assert (conditions[0].message, conditions[0].last_transition_time) == ("short by 1 tray", "t0")


def test_a_status_flip_moves_the_transition_time() -> None:
    conditions = [condition("False", "InsufficientCapacity", "t0")]
    assert set_condition(conditions, condition("True", "Placed", "t1"))
    assert (conditions[0].status, conditions[0].last_transition_time) == ("True", "t1")


def test_missing_capacity_is_placed_false_with_insufficient_capacity() -> None:
    plan = plan_placement([DeploymentShape(name="dsv4", cells=2)], synthetic_topology(1))
    placed, progressing = placement_conditions(plan, "dsv4", ConditionStamp(generation=3, now="t0"))
    assert (placed.status, placed.reason) == ("False", Reason.INSUFFICIENT_CAPACITY)
    assert placed.message.startswith("1 of 2 cells cannot be placed: dsv4-cell-1")
    assert progressing.status == "False" and placed.observed_generation == 3


def test_a_placed_deployment_names_its_cells_domains() -> None:
    plan = plan_placement([DeploymentShape(name="dsv4", cells=1)], synthetic_topology(1))
    (placed,) = placement_conditions(plan, "dsv4", ConditionStamp(generation=1, now="t0"))
    assert placed.status == "True" and placed.message.startswith("dsv4-cell-0 in ")
