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

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from baton.core.api import (
    CellEndpoints,
    CellStatus,
    Condition,
    ConditionType,
    DecodeStatus,
    ModelDeploymentStatus,
    Reason,
    prefill_record,
)
from controller.cell import CellActions
from controller.names import decode_pod_name, leader_host, prefill_pod_name
from controller.observe import (
    DeploymentView,
    gated,
    parse_time,
    planned_tray,
    ready,
    revision_of,
    rfc3339,
)
from controller.placement import CellPlacement, Plan
from controller.podspec import API_PORT, EPLB_AGENT_PORT, revision
from controller.topology import Topology

__all__ = [
    "ConditionStamp",
    "cell_status",
    "deployment_conditions",
    "invalid_spec_conditions",
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


def invalid_spec_conditions(message: str, stamp: ConditionStamp) -> list[Condition]:
    """Placed=False and Ready=False, InvalidSpec: a spec the controller cannot act on, and why.
    Ready too, so that `kubectl get mdep` and `kubectl wait --for=condition=Ready` never show a
    refused spec as ready, though cells of an earlier spec may still serve."""
    return [
        stamp.condition(ConditionType.PLACED, False, Reason.INVALID_SPEC, message),
        stamp.condition(ConditionType.READY, False, Reason.INVALID_SPEC, message),
    ]


def cell_status(
    cell: CellPlacement, view: DeploymentView, actions: CellActions
) -> tuple[CellStatus, CellEndpoints]:
    """Where ``cell`` runs and how it is doing, and the endpoints of its ready pods."""
    gpus_per_pod = view.model.spec.cell.decode.gpus_per_pod
    eplb = view.model.spec.eplb
    agents = eplb.enabled and eplb.mode == "agent"  # plugin mode: the engines report instead
    pods = view.pods
    decode_names = [decode_pod_name(cell.name, i) for i in range(len(cell.decode_trays))]
    group = pods.get(decode_names[0]) if decode_names else None
    serving = revision_of(group) if group is not None else None
    endpoints = CellEndpoints(name=cell.name)
    for instance in cell.prefill:
        pod = pods.get(prefill_pod_name(cell.name, instance.index))
        # only beside a decode group of its own revision: P/D pairs never cross revisions
        if (
            pod is not None
            and ready(pod)
            and pod.get("status", {}).get("podIP")
            and revision_of(pod) == serving
        ):
            endpoints.prefill.append(f"http://{pod['status']['podIP']}:{API_PORT}")
    if not actions.in_rotation:  # drained for its update: the gateway sends it nothing new
        endpoints = CellEndpoints(name=cell.name)
    elif actions.decode.ready:
        for pod_name in decode_names:
            ip = pods[pod_name].get("status", {}).get("podIP")
            if ip:
                endpoints.decode.append(f"http://{ip}:{API_PORT}")
                if agents:
                    endpoints.eplb_agents.append(f"{ip}:{EPLB_AGENT_PORT}")
    status = CellStatus(
        name=cell.name,
        domain=cell.domain,
        decode=DecodeStatus(
            trays=list(cell.decode_trays),
            leader=leader_host(cell.name) if decode_names else None,
            ready_ranks=actions.decode.ready_pods * gpus_per_pod,
        ),
        prefill=[prefill_record(i.index, i.tray, i.gpus) for i in cell.prefill],
        spare_trays=list(cell.spare_trays),
        restarts=list(actions.decode.restarts),
        revision=serving,
        draining_since=rfc3339(actions.draining_since) if actions.draining_since else None,
        surge=True if actions.surge else None,
    )
    return status, endpoints


def _created(pods: Iterable[Mapping[str, Any]]) -> datetime | None:
    """When the first of ``pods`` was created (None: none says)."""
    times = [
        parse_time(stamp)
        for pod in pods
        if (stamp := pod.get("metadata", {}).get("creationTimestamp"))
    ]
    return min(times, default=None)


def _pod_state(pod: Mapping[str, Any] | None) -> str:
    """Where one planned pod is on its way to serving, in the words a cause is told in."""
    if pod is None or gated(pod):
        return "waiting"  # not created yet, or held until the whole cell exists
    if ready(pod):
        return "ready"
    phase = pod.get("status", {}).get("phase", "Pending")
    if phase == "Running":
        return "starting"  # containers run; the engine is not serving yet
    if phase == "Pending":
        for condition in pod.get("status", {}).get("conditions") or []:
            if condition.get("type") != "PodScheduled":
                continue
            if condition.get("reason") == "Unschedulable":
                return "unschedulable"
            if condition.get("reason") == "SchedulingGated":
                # gates lifted (checked above) but the scheduler says otherwise: it has not
                # seen the update yet, or missed it
                return "gates_unseen"
    return "waiting"


def _scheduler_says(pod: Mapping[str, Any]) -> str:
    for condition in pod.get("status", {}).get("conditions") or []:
        if condition.get("type") == "PodScheduled":
            return str(condition.get("message", ""))
    return ""


def _some(names: Sequence[str], shown: int = 3) -> str:
    more = len(names) - shown
    return ", ".join(names[:shown]) + (f" and {more} more" if more > 0 else "")


@dataclass(frozen=True, slots=True)
class _Cause:
    """Why the deployment is not Ready; ``moving``: the controller or the pods are on it."""

    reason: Reason
    message: str
    moving: bool


def _tell(
    causes: list[_Cause],
    reason: Reason,
    names: Sequence[str],
    template: str,
    *,
    moving: bool,
    shown: int = 3,
) -> None:
    """Add the cause ``template`` tells of ``names``, if there are any. The template's fields:
    ``{names}`` all of them, ``{some}`` the first ``shown`` of them, ``{count}`` how many."""
    if names:
        message = template.format(
            names=", ".join(names), some=_some(names, shown), count=len(names)
        )
        causes.append(_Cause(reason, message, moving))


# The causes told of planned pods by their state (``_pod_state``'s words, and "moving" for a pod
# on another tray than planned), in the order they are told: after the cells' own, unschedulable
# pods' and short prefill's.
_POD_CAUSES: tuple[tuple[str, Reason, str, bool], ...] = (
    (
        "gates_unseen",
        Reason.SCHEDULER_BEHIND,
        "{count} pods have their scheduling gates lifted but kube-scheduler still holds them as "
        "gated: {some}. If this lasts, the scheduler missed the update (seen after an API "
        "server restart during a group restart): restart kube-scheduler",
        True,
    ),
    (
        "waiting",
        Reason.PODS_PENDING,
        "{count} pods not running yet (created with their cell, then scheduled): {some}",
        True,
    ),
    ("moving", Reason.PODS_PENDING, "{count} pods being replaced on their new trays: {some}", True),
    (
        "starting",
        Reason.ENGINES_STARTING,
        "{count} engines running but not ready yet: {some}",
        True,
    ),
)


@dataclass(frozen=True, slots=True)
class _Cells:
    """One deployment's placed cells, summed for its conditions."""

    wanted: int
    ready: int  # cells whose decode group and every wanted prefill instance serve
    updated: int  # of those, the cells on the current revision
    prefill_wanted: int
    prefill_ready: int
    causes: tuple[_Cause, ...]  # most telling first
    restarting: tuple[str, ...]
    backoff: tuple[str, ...]
    exhausted: tuple[str, ...]
    short: tuple[str, ...]  # "cell: n of m prefill instances fit ..."
    down: tuple[str, ...]  # "cell: decode group not serving since its restart: ..."

    @property
    def all_ready(self) -> bool:
        return self.ready == self.wanted and not self.causes


def _rolling(
    placed: Sequence[CellPlacement],
    actions: Sequence[CellActions],
    current: str,
    max_unavailable: int,
    surge: Mapping[str, CellActions],
) -> str:
    """What the rollout of revision ``current`` is doing, or "" when every cell runs it (and
    its surge cells have gone)."""
    draining = [
        c.name for c, a in zip(placed, actions, strict=True) if a.stale and a.draining_since
    ]
    restarting = [
        c.name for c, a in zip(placed, actions, strict=True) if not a.stale and a.draining_since
    ]
    waiting = [
        c.name for c, a in zip(placed, actions, strict=True) if a.stale and not a.draining_since
    ]
    if not (draining or restarting or waiting or surge):
        return ""
    parts = [
        f"{label}: {', '.join(names)}"
        for label, names in (
            ("draining", draining),
            ("starting on it", restarting),
            ("waiting", waiting),
        )
        if names
    ]
    for name, cell in surge.items():
        if cell.draining_since is not None:
            doing = "drains, then goes"
        elif cell.in_rotation and cell.settled:
            doing = "serves it"
        else:
            doing = "starting on it"
        parts.append(f"surge cell {name} {doing}")
    done = len(placed) - len(draining) - len(restarting) - len(waiting)
    return (
        f"rolling out revision {current}, {max_unavailable} cell(s) at a time: {done} of "
        f"{len(placed)} cells on it; " + "; ".join(parts)
    )


def _summarize(
    plan: Plan,
    view: DeploymentView,
    cells: Mapping[str, CellActions],
    prefill_wanted: int,
    trays: Topology,
    now: datetime,
) -> _Cells:
    name = view.name
    # A surge cell helps a rollout along; the deployment's state is its own cells'.
    placed = [c for c in plan.cells if c.deployment == name and not cells[c.name].surge]
    surge = {
        c.name: cells[c.name] for c in plan.cells if c.deployment == name and cells[c.name].surge
    }
    unplaced = [c for c in plan.unplaced if c.deployment == name]
    per_cell = view.model.spec.cell.prefill.instances
    causes: list[_Cause] = []
    if unplaced:
        causes.append(
            _Cause(
                Reason.INSUFFICIENT_CAPACITY,
                f"{len(placed)} of {view.model.spec.cells} cells placed; "
                + "; ".join(c.message for c in unplaced),
                moving=False,
            )
        )
    actions = [cells[c.name] for c in placed]
    restarting = tuple(c.name for c, a in zip(placed, actions, strict=True) if a.decode.restarting)
    backoff = tuple(c.name for c, a in zip(placed, actions, strict=True) if a.decode.backoff)
    exhausted = tuple(c.name for c, a in zip(placed, actions, strict=True) if a.decode.exhausted)
    rollout = view.model.spec.rollout
    deadline = timedelta(seconds=rollout.drain_seconds + rollout.progress_deadline_seconds)
    stuck = [
        f"{c.name} (out of the rotation since {rfc3339(a.draining_since)})"
        for c, a in zip(placed, actions, strict=True)
        if a.draining_since is not None and now - a.draining_since > deadline
    ]
    stuck += [
        f"surge cell {cell} (created {rfc3339(created)})"
        for cell, a in surge.items()
        if not (a.in_rotation and a.settled)
        and (created := _created(view.cell_pods(cell).values())) is not None
        and now - created > timedelta(seconds=rollout.progress_deadline_seconds)
    ]
    # The cells' own causes, told before their pods': the first cause is what Ready says.
    for reason, names, template, moving in (
        (
            Reason.RESTART_BUDGET_EXHAUSTED,
            exhausted,
            "{names}: restart budget spent; waiting for old restarts to age out",
            False,
        ),
        (Reason.RESTART_BACKOFF, backoff, "{names}: restart backing off", True),
        (Reason.GROUP_RESTARTING, restarting, "{names}: decode group restarting", True),
        (
            Reason.ROLLOUT_STUCK,
            stuck,
            "the rollout stopped: {names} not serving the updated spec within "
            f"{rollout.progress_deadline_seconds} s of its drain (a surge cell: of its "
            "creation); fix the spec (the pods' events say why) and the rollout goes on",
            False,
        ),
    ):
        _tell(causes, reason, names, template, moving=moving)
    rolling = _rolling(placed, actions, revision(view.model.spec), rollout.max_unavailable, surge)
    if rolling and not stuck:
        causes.append(_Cause(Reason.ROLLING_UPDATE, rolling, moving=True))
    states: dict[str, list[str]] = {}
    unschedulable: list[str] = []
    short: list[str] = []
    down: list[str] = []
    gpus_per_pod = view.model.spec.cell.decode.gpus_per_pod
    ready_cells = updated_cells = 0
    for cell, cell_actions in zip(placed, actions, strict=True):
        pods = {decode_pod_name(cell.name, i): t for i, t in enumerate(cell.decode_trays)}
        pods |= {prefill_pod_name(cell.name, i.index): i.tray for i in cell.prefill}
        for pod_name, tray in pods.items():
            pod = view.pods.get(pod_name)
            elsewhere = pod is not None and planned_tray(pod) != tray
            state = "moving" if elsewhere else _pod_state(pod)
            states.setdefault(state, []).append(pod_name)
            if state == "unschedulable" and pod is not None:
                unschedulable.append(f"{pod_name} ({_scheduler_says(pod)})")
        decode = cell_actions.decode
        if (
            decode.restarts
            and not decode.ready
            and cell.name not in restarting + backoff + exhausted
        ):
            # Restarted after a failure and not back yet: the cell serves nothing meanwhile,
            # which a first start (no restarts) is not.
            down.append(
                f"{cell.name}: decode group not serving since its restart at "
                f"{decode.restarts[-1]}: {decode.ready_pods * gpus_per_pod} of "
                f"{decode.pods * gpus_per_pod} ranks ready"
            )
        wanted_here = len(cell.prefill) if per_cell is None else per_cell
        if len(cell.prefill) < wanted_here:
            trouble = trays.troubles(cell.domain) or "every other tray is in use"
            short.append(
                f"{cell.name}: {len(cell.prefill)} of {wanted_here} prefill instances fit in "
                f"NVLink domain {cell.domain}: {trouble}"
            )
        if (
            cell_actions.decode.ready
            and cell_actions.prefill.ready == wanted_here
            and not cell_actions.pending
            and cell_actions.in_rotation
        ):
            ready_cells += 1
            updated_cells += not cell_actions.stale
    _tell(
        causes,
        Reason.PODS_UNSCHEDULABLE,
        unschedulable,
        "{count} pods cannot be scheduled: {some}",
        moving=False,
        shown=2,  # each comes with the scheduler's reason, which is long
    )
    if short:
        causes.append(_Cause(Reason.PREFILL_SHORT, "; ".join(short), moving=False))
    for state, reason, template, moving in _POD_CAUSES:
        _tell(causes, reason, states.get(state, []), template, moving=moving)
    if ready_cells < view.model.spec.cells and not causes:
        causes.append(
            _Cause(
                Reason.PODS_PENDING,
                f"{ready_cells} of {view.model.spec.cells} cells ready",
                moving=True,
            )
        )
    return _Cells(
        wanted=view.model.spec.cells,
        ready=ready_cells,
        updated=updated_cells,
        prefill_wanted=prefill_wanted,
        prefill_ready=sum(a.prefill.ready for a in actions),
        causes=tuple(causes),
        restarting=restarting,
        backoff=backoff,
        exhausted=exhausted,
        short=tuple(short),
        down=tuple(down),
    )


def deployment_conditions(
    status: ModelDeploymentStatus,
    plan: Plan,
    view: DeploymentView,
    cells: Mapping[str, CellActions],
    prefill_wanted: int,
    trays: Topology,
    stamp: ConditionStamp,
) -> None:
    """Set Placed, Ready, Progressing and Degraded and the printer columns' summaries, all
    from one summary of the cells, so that the columns and the conditions agree."""
    name = view.name
    for condition in placement_conditions(plan, name, stamp):
        set_condition(status.conditions, condition)
    summary = _summarize(plan, view, cells, prefill_wanted, trays, parse_time(stamp.now))
    # Quarantined trays in this deployment's domains: the ones that cost it a spare.
    domains = {c.domain for c in plan.cells if c.deployment == name}
    quarantined = sorted(t.name for t in trays.trays if t.quarantined and t.domain in domains)
    # Degraded trays its cells still run on: the ones that slow it (moved off, they do not).
    running = {
        tray
        for c in plan.cells
        if c.deployment == name
        for tray in (*c.decode_trays, *(i.tray for i in c.prefill))
    }
    slow = sorted(
        f"{t.name} ({t.degraded.why})" for t in trays.trays if t.degraded and t.name in running
    )
    degraded = _degraded(summary, quarantined, slow, stamp)
    set_condition(status.conditions, _ready(summary, degraded, stamp))
    if not any(c.deployment == name for c in plan.unplaced):
        set_condition(status.conditions, _progressing(summary, stamp))
    set_condition(status.conditions, degraded)
    status.ready = f"{summary.ready}/{summary.wanted}"
    status.updated = f"{summary.updated}/{summary.wanted}"
    status.placed_cells = sum(1 for c in plan.cells if c.deployment == name)
    status.prefill_ready = f"{summary.prefill_ready}/{prefill_wanted}"


def _ready(summary: _Cells, degraded: Condition, stamp: ConditionStamp) -> Condition:
    """True only when every wanted cell serves and nothing degrades them: a deployment that
    serves while degraded (a tray quarantined, its cell without a spare) is not shown ready,
    or nothing a user watches (`kubectl get`, `kubectl wait`) would show the trouble."""
    if not summary.all_ready:
        cause = summary.causes[0]
        return stamp.condition(ConditionType.READY, False, cause.reason, cause.message)
    if degraded.status == "True":
        return stamp.condition(
            ConditionType.READY,
            False,
            Reason(degraded.reason),
            f"{summary.ready} of {summary.wanted} cells serve, degraded: {degraded.message}",
        )
    return stamp.condition(
        ConditionType.READY, True, Reason.ALL_READY, f"{summary.wanted} cells ready"
    )


def _progressing(summary: _Cells, stamp: ConditionStamp) -> Condition:
    if summary.all_ready:
        return stamp.condition(
            ConditionType.PROGRESSING, False, Reason.ALL_READY, "every pod is ready"
        )
    # a stopped rollout outranks pods on their way: those pods are the ones not getting there
    stopped = next((c for c in summary.causes if c.reason == Reason.ROLLOUT_STUCK), None)
    moving = next((c for c in summary.causes if c.moving), None)
    if moving is not None and stopped is None:
        return stamp.condition(ConditionType.PROGRESSING, True, moving.reason, moving.message)
    stuck = stopped or summary.causes[0]
    return stamp.condition(
        ConditionType.PROGRESSING, False, stuck.reason, f"stuck: {stuck.message}"
    )


# Serving with less than wanted, as opposed to not serving yet. A pod the scheduler refuses is
# stuck, not on its way: a decode group missing one is down whatever its other ranks say.
_DEGRADING = (
    Reason.RESTART_BUDGET_EXHAUSTED,
    Reason.RESTART_BACKOFF,
    Reason.GROUP_RESTARTING,
    Reason.PODS_UNSCHEDULABLE,
    Reason.PREFILL_SHORT,
    Reason.ROLLOUT_STUCK,
)


def _degraded(
    summary: _Cells, quarantined: Sequence[str], slow: Sequence[str], stamp: ConditionStamp
) -> Condition:
    problems = [(c.reason, c.message) for c in summary.causes if c.reason in _DEGRADING]
    problems += [(Reason.GROUP_RESTARTING, down) for down in summary.down]
    if quarantined:
        problems.append((Reason.TRAY_QUARANTINED, f"quarantined trays: {', '.join(quarantined)}"))
    if slow:
        problems.append((Reason.TRAY_DEGRADED, f"degraded trays: {'; '.join(slow)}"))
    if problems:
        message = "; ".join(m for _, m in problems)
        return stamp.condition(ConditionType.DEGRADED, True, problems[0][0], message)
    return stamp.condition(ConditionType.DEGRADED, False, Reason.HEALTHY, "")
