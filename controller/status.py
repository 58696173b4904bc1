"""ModelDeployment status, decided purely from a plan and each cell's actions.

``set_condition`` follows Kubernetes' convention (and LeaderWorkerSet's): a condition's
``lastTransitionTime`` moves only when its status flips; a change of reason, message or observed
generation rewrites it in place; the list is only reported as changed when something did, so the
reconciler writes status only on change. Capacity problems are an outcome (``Placed=False``,
``InsufficientCapacity``), not an error.

A deployment's status holds, per placed cell, where it runs and how it is doing
(``cell_status``), the endpoints of its ready pods (what the gateway routes to and the EPLB
service talks to), the Placed, Ready, Progressing and Degraded conditions
(``deployment_conditions``) and the printer columns' summaries. ``eplb`` and ``balance`` are
the EPLB service's to write.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from baton.core.api import (
    CellEndpoints,
    CellStatus,
    Condition,
    ConditionType,
    DecodeServerEndpoint,
    DecodeStatus,
    ModelDeploymentStatus,
    PrefillInstanceStatus,
    Reason,
)
from controller.cell import CellActions
from controller.names import decode_pod_name, leader_host, prefill_pod_name
from controller.observe import DeploymentView, ready
from controller.placement import CellPlacement, Plan
from controller.podspec import API_PORT, EPLB_AGENT_PORT

__all__ = [
    "ConditionStamp",
    "cell_status",
    "deployment_conditions",
    "invalid_spec_condition",
    "placement_conditions",
    "set_condition",
]


@dataclass(frozen=True, slots=True)
class ConditionStamp:
    """What every condition written by one reconcile of one deployment carries."""

    generation: int
    now: str  # RFC 3339

    def condition(self, kind: ConditionType, state: bool, reason: str, message: str) -> Condition:
        return Condition(
            type=kind,
            status="True" if state else "False",
            reason=reason,
            message=message,
            last_transition_time=self.now,
            observed_generation=self.generation,
        )


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


def placement_conditions(plan: Plan, deployment: str, stamp: ConditionStamp) -> list[Condition]:
    """Placed (and, when not placed, Progressing) for one deployment's cells in ``plan``."""
    unplaced = [cell for cell in plan.unplaced if cell.deployment == deployment]
    placed = [cell for cell in plan.cells if cell.deployment == deployment]
    if unplaced:
        message = "; ".join(f"{cell.name}: {cell.message}" for cell in unplaced)
        return [
            stamp.condition(
                ConditionType.PLACED,
                False,
                Reason.INSUFFICIENT_CAPACITY,
                f"{len(unplaced)} of {len(unplaced) + len(placed)} cells cannot be placed: "
                f"{message}",
            ),
            stamp.condition(
                ConditionType.PROGRESSING,
                False,
                Reason.INSUFFICIENT_CAPACITY,
                "waiting for capacity",
            ),
        ]
    domains = ", ".join(f"{cell.name} in {cell.domain}" for cell in placed) or "no cells wanted"
    return [stamp.condition(ConditionType.PLACED, True, Reason.PLACED, domains)]


def invalid_spec_condition(message: str, stamp: ConditionStamp) -> Condition:
    """Placed=False, InvalidSpec: a spec the controller cannot act on, and why."""
    return stamp.condition(ConditionType.PLACED, False, Reason.INVALID_SPEC, message)


def cell_status(
    cell: CellPlacement, view: DeploymentView, actions: CellActions
) -> tuple[CellStatus, CellEndpoints]:
    """Where ``cell`` runs and how it is doing, and the endpoints of its ready pods."""
    gpus_per_pod = view.model.spec.cell.decode.gpus_per_pod
    eplb = view.model.spec.eplb
    agents = eplb.enabled and eplb.mode == "agent"  # plugin mode: the engines report instead
    pods = view.pods
    decode_names = [decode_pod_name(cell.name, i) for i in range(len(cell.decode_trays))]
    prefill = []
    endpoints = CellEndpoints(name=cell.name)
    for instance in cell.prefill:
        pod_name = prefill_pod_name(cell.name, instance.index)
        pod = pods.get(pod_name)
        serving = pod is not None and ready(pod)
        prefill.append(
            PrefillInstanceStatus(
                pod=pod_name, tray=instance.tray, gpus=list(instance.gpus), ready=serving
            )
        )
        if serving and pod is not None and pod.get("status", {}).get("podIP"):
            endpoints.prefill.append(f"http://{pod['status']['podIP']}:{API_PORT}")
    if actions.decode.ready:
        for pod_name in decode_names:
            ip = pods[pod_name].get("status", {}).get("podIP")
            if ip:
                endpoints.decode.append(
                    DecodeServerEndpoint(
                        url=f"http://{ip}:{API_PORT}", ranks=list(range(gpus_per_pod))
                    )
                )
                if agents:
                    endpoints.eplb_agents.append(f"{ip}:{EPLB_AGENT_PORT}")
    status = CellStatus(
        name=cell.name,
        domain=cell.domain,
        decode=DecodeStatus(
            pods=decode_names,
            trays=list(cell.decode_trays),
            leader=leader_host(cell.name) if decode_names else None,
            ready_ranks=actions.decode.ready_pods * gpus_per_pod,
        ),
        prefill=prefill,
        spare_trays=list(cell.spare_trays),
        restarts=list(actions.decode.restarts),
    )
    return status, endpoints


@dataclass(frozen=True, slots=True)
class _Counts:
    """One deployment's cells, summed for its conditions."""

    wanted: int
    ready_cells: int
    prefill_wanted: int
    prefill_ready: int
    restarting: list[str]
    updating: list[str]
    backoff: list[str]
    exhausted: list[str]
    pending: list[str]

    @property
    def all_ready(self) -> bool:
        return (
            self.ready_cells == self.wanted
            and self.prefill_ready == self.prefill_wanted
            and not self.pending
            and not self.updating
        )


def deployment_conditions(
    status: ModelDeploymentStatus,
    plan: Plan,
    view: DeploymentView,
    cells: Mapping[str, CellActions],
    prefill_wanted: int,
    quarantined: Sequence[str],
    stamp: ConditionStamp,
) -> None:
    """Set Placed, Ready, Progressing and Degraded and the printer columns' summaries."""
    name = view.name
    for condition in placement_conditions(plan, name, stamp):
        set_condition(status.conditions, condition)
    placed = [c for c in plan.cells if c.deployment == name]
    counts = _Counts(
        wanted=view.model.spec.cells,
        ready_cells=sum(1 for c in placed if cells[c.name].decode.ready),
        prefill_wanted=prefill_wanted,
        prefill_ready=sum(a.prefill.ready for a in cells.values()),
        restarting=[c for c, a in cells.items() if a.decode.restarting],
        updating=[c for c, a in cells.items() if a.decode.updating or a.prefill.updating],
        backoff=[c for c, a in cells.items() if a.decode.backoff],
        exhausted=[c for c, a in cells.items() if a.decode.exhausted],
        pending=[c for c, a in cells.items() if a.pending or not a.decode.ready],
    )
    set_condition(status.conditions, _ready(counts, stamp))
    if not any(c.deployment == name for c in plan.unplaced):
        set_condition(status.conditions, _progressing(counts, stamp))
    short = bool(placed) and sum(len(c.prefill) for c in placed) < prefill_wanted
    set_condition(status.conditions, _degraded(counts, short, quarantined, stamp))
    status.ready = f"{counts.ready_cells}/{counts.wanted}"
    status.placed_cells = len(placed)
    status.prefill_ready = f"{counts.prefill_ready}/{prefill_wanted}"


def _ready(counts: _Counts, stamp: ConditionStamp) -> Condition:
    if counts.all_ready:
        return stamp.condition(
            ConditionType.READY, True, Reason.ALL_READY, f"{counts.wanted} cells ready"
        )
    return stamp.condition(
        ConditionType.READY,
        False,
        Reason.PODS_PENDING,
        f"{counts.ready_cells} of {counts.wanted} cells ready; {counts.prefill_ready} of "
        f"{counts.prefill_wanted} prefill instances ready",
    )


def _progressing(counts: _Counts, stamp: ConditionStamp) -> Condition:
    if counts.restarting or counts.backoff:
        cells = ", ".join(counts.restarting + counts.backoff)
        return stamp.condition(
            ConditionType.PROGRESSING,
            True,
            Reason.GROUP_RESTARTING,
            f"decode group restarting: {cells}",
        )
    if counts.updating:
        return stamp.condition(
            ConditionType.PROGRESSING,
            True,
            Reason.UPDATING,
            f"pods replaced on the updated spec: {', '.join(counts.updating)}",
        )
    if counts.all_ready:
        return stamp.condition(
            ConditionType.PROGRESSING, False, Reason.ALL_READY, "every pod is ready"
        )
    return stamp.condition(ConditionType.PROGRESSING, True, Reason.PODS_PENDING, "pods starting")


def _degraded(
    counts: _Counts, short: bool, quarantined: Sequence[str], stamp: ConditionStamp
) -> Condition:
    problems: list[tuple[str, str]] = []
    if counts.exhausted:
        problems.append(
            (
                Reason.RESTART_BUDGET_EXHAUSTED,
                f"{', '.join(counts.exhausted)}: restart budget spent; "
                "waiting for old restarts to age out",
            )
        )
    if counts.backoff:
        problems.append(
            (Reason.RESTART_BACKOFF, f"{', '.join(counts.backoff)}: restart backing off")
        )
    if counts.restarting:
        problems.append(
            (Reason.GROUP_RESTARTING, f"{', '.join(counts.restarting)}: decode group restarting")
        )
    if short:
        problems.append((Reason.PREFILL_SHORT, "fewer prefill instances fit than wanted"))
    if quarantined:
        problems.append((Reason.TRAY_QUARANTINED, f"quarantined trays: {', '.join(quarantined)}"))
    if problems:
        message = "; ".join(m for _, m in problems)
        return stamp.condition(ConditionType.DEGRADED, True, problems[0][0], message)
    return stamp.condition(ConditionType.DEGRADED, False, Reason.HEALTHY, "")
