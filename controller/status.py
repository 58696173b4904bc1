"""ModelDeployment status, decided purely from what the controller observed.

``set_condition`` follows Kubernetes' convention (and LeaderWorkerSet's): a condition's
``lastTransitionTime`` moves only when its status flips; a change of reason, message or observed
generation rewrites it in place; the list is only reported as changed when something did, so the
reconciler writes status only on change. ``placement_conditions`` turns a placement outcome into
the Placed and Progressing conditions; capacity problems are an outcome (``Placed=False``,
``InsufficientCapacity``), not an error.
"""

from __future__ import annotations

from collections.abc import Sequence

from baton.api import Condition, ConditionType, Reason
from controller.placement import Plan

__all__ = ["placement_conditions", "set_condition"]


def set_condition(conditions: list[Condition], new: Condition) -> bool:
    """Put ``new`` into ``conditions`` (by type); True when the list changed."""
    for index, old in enumerate(conditions):
        if old.type != new.type:
            continue
        if (old.status, old.reason, old.message, old.observed_generation) == (
            new.status,
            new.reason,
            new.message,
            new.observed_generation,
        ):
            return False
        moved = new.last_transition_time if old.status != new.status else old.last_transition_time
        conditions[index] = new.model_copy(update={"last_transition_time": moved})
        return True
    conditions.append(new)
    return True


def placement_conditions(
    plan: Plan, deployment: str, generation: int, now: str
) -> Sequence[Condition]:
    """Placed (and, when not placed, Progressing) for one deployment's cells in ``plan``."""
    unplaced = [cell for cell in plan.unplaced if cell.deployment == deployment]
    placed = [cell for cell in plan.cells if cell.deployment == deployment]
    if unplaced:
        message = "; ".join(f"{cell.name}: {cell.message}" for cell in unplaced)
        return (
            Condition(
                type=ConditionType.PLACED,
                status="False",
                reason=Reason.INSUFFICIENT_CAPACITY,
                message=f"{len(unplaced)} of {len(unplaced) + len(placed)} cells cannot "
                f"be placed: {message}",
                last_transition_time=now,
                observed_generation=generation,
            ),
            Condition(
                type=ConditionType.PROGRESSING,
                status="False",
                reason=Reason.INSUFFICIENT_CAPACITY,
                message="waiting for capacity",
                last_transition_time=now,
                observed_generation=generation,
            ),
        )
    domains = ", ".join(f"{cell.name} in {cell.domain}" for cell in placed) or "no cells wanted"
    return (
        Condition(
            type=ConditionType.PLACED,
            status="True",
            reason=Reason.PLACED,
            message=domains,
            last_transition_time=now,
            observed_generation=generation,
        ),
    )
