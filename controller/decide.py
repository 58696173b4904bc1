"""One reconcile of a namespace's ModelDeployments, decided purely from what was observed.

``decide(observed) -> Actions``, in four steps, each another module's job:

1. Read (``controller.observe``): the valid deployments, oldest first, the trays with the GPUs
   others hold, and each deployment's current placement.
2. Place (``controller.placement``): repair or admit every wanted cell of the namespace jointly,
   so an older deployment keeps its trays.
3. Act per cell (``controller.cell``): objects and pods to create, decode groups to restart as a
   whole, prefill instances to replace alone, gates to lift; per deployment, the pods and
   per-cell objects of cells no longer placed (no partial cell stays); per tray, failure counts
   and quarantines (``controller.restarts``).
4. Report (``controller.status``): each deployment's status, written only when it changed, and
   Placed=False InvalidSpec on a spec the controller cannot act on.

``controller/reconciler.py`` performs the result; nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta

from baton.core.api import Endpoints, ModelDeploymentStatus, Reason
from baton.core.labels import DEPLOYMENT_LABEL
from controller.actions import Actions, Event
from controller.cell import CellActions, CellRollout, plan_cell, updating
from controller.names import cell_name, prefill_channel_claim_name
from controller.observe import (
    DeploymentView,
    InvalidDeployment,
    Manifest,
    Observed,
    cell_of,
    claims_of,
    current_cells,
    deployments,
    labels,
    left_behind,
    parse_time,
    recorded_status,
    rfc3339,
    terminating,
    topology,
    unbound_pods,
)
from controller.placement import CellPlacement, DeploymentShape, Plan, plan_placement
from controller.podspec import revision
from controller.restarts import RestartPolicy, TrayFailure, tray_marks
from controller.status import (
    ConditionStamp,
    cell_status,
    deployment_conditions,
    invalid_spec_conditions,
    set_condition,
)
from controller.topology import Topology

__all__ = ["decide"]

# eplb and balance belong to the EPLB service: a merge patch without them keeps them.
_NOT_OURS = frozenset({"eplb", "balance"})


@dataclass(frozen=True, slots=True)
class _DeploymentActions:
    """One deployment's share of the reconcile."""

    create: tuple[Manifest, ...]
    delete_pods: tuple[str, ...]
    delete_services: tuple[str, ...]
    delete_compute_domains: tuple[str, ...]
    delete_resource_claims: tuple[str, ...]
    ungate: tuple[str, ...]
    relabel: tuple[tuple[str, str], ...]
    events: tuple[Event, ...]
    failures: tuple[TrayFailure, ...]
    status: ModelDeploymentStatus | None  # None: unchanged
    wake_in: float | None


def decide(observed: Observed, policy: RestartPolicy | None = None) -> Actions:
    """Everything one reconcile of ``observed.namespace`` should do."""
    policy = policy or RestartPolicy()
    views, invalid = deployments(observed)
    invalid_events = tuple(
        Event(bad.name, "Warning", Reason.INVALID_SPEC, bad.message) for bad in invalid
    )
    status = _invalid_statuses(observed, invalid)
    if not views:
        return Actions(events=invalid_events, status=status)
    trays = topology(observed, views)
    per_view = [(view, current_cells(view, trays)) for view in views]
    current = Plan(tuple(cell for _, cells in per_view for cell in cells))
    # A pod created anew (a restarted decode group, a failed prefill instance) cannot go back
    # to a cordoned tray: placement gives it another one, as if that tray had failed.
    unbound = {pod for view, cells in per_view for pod in unbound_pods(view, cells)}
    rolling = {view.name: _rolling(view, cells, observed) for view, cells in per_view}
    shapes = [
        replace(
            DeploymentShape.of(view.model), surge=_surge(view, cells, rolling[view.name], observed)
        )
        for view, cells in per_view
    ]
    plan = plan_placement(shapes, trays, current, unbound)
    live_cells = {cell_of(pod) for view in views for pod in view.pods.values()}
    kept = {cell.name for cell in plan.cells} | live_cells  # cells whose objects stay
    shares = [
        _deployment_actions(view, plan, current, trays, observed, policy, kept, rolling[view.name])
        for view in views
    ]
    failures = tuple(failure for share in shares for failure in share.failures)
    marks, quarantines = tray_marks(failures, observed.nodes, policy, observed.now)
    for view, share in zip(views, shares, strict=True):
        if share.status is not None:
            status[view.name] = share.status.model_dump(
                by_alias=True, exclude_none=True, exclude=set(_NOT_OURS)
            )
    waits = [share.wake_in for share in shares if share.wake_in is not None]
    return Actions(
        create=tuple(m for share in shares for m in share.create),
        delete_pods=tuple(n for share in shares for n in share.delete_pods),
        delete_services=tuple(n for share in shares for n in share.delete_services),
        delete_compute_domains=tuple(n for share in shares for n in share.delete_compute_domains),
        delete_resource_claims=tuple(n for share in shares for n in share.delete_resource_claims),
        ungate=tuple(n for share in shares for n in share.ungate),
        relabel=tuple(r for share in shares for r in share.relabel),
        trays=tuple(marks),
        status=status,
        events=(*invalid_events, *(e for share in shares for e in share.events), *quarantines),
        requeue_after=min(waits, default=None),
    )


def _deployment_actions(
    view: DeploymentView,
    plan: Plan,
    current: Plan,
    trays: Topology,
    observed: Observed,
    policy: RestartPolicy,
    kept: set[str | None],
    rolling: bool,
) -> _DeploymentActions:
    name = view.name
    spec = view.model.spec
    current_names = {c.name for c in current.cells}
    placed = [cell for cell in plan.cells if cell.deployment == name]
    regular = {cell_name(name, index) for index in range(spec.cells)}
    # the deployment's own cells in their update: each waits on the ones before it serving
    updating_cells = {
        c.name for c in current.cells if c.name in regular and updating(view, c, observed)
    }
    events: list[Event] = []
    cells: dict[str, CellActions] = {}

    def act(cell: CellPlacement, rollout: CellRollout) -> CellActions:
        return plan_cell(
            view,
            cell,
            restarted=cell.name in plan.restarted,
            trays=trays,
            observed=observed,
            policy=policy,
            rollout=rollout,
        )

    for cell in placed:
        before = current.cell(cell.name)
        if before is not None and before.spare_trays != cell.spare_trays:
            events.append(_spare_moving(name, before, cell, trays))
        if cell.name not in current_names:
            surge = "" if cell.name in regular else " as the rollout's surge cell"
            events.append(
                Event(
                    name,
                    "Normal",
                    Reason.PLACED,
                    f"{cell.name} placed{surge} in NVLink domain {cell.domain}: decode on "
                    f"{', '.join(cell.decode_trays)}; {len(cell.prefill)} prefill instances; "
                    f"spare {', '.join(cell.spare_trays) or 'none'}",
                )
            )
        others_wait = bool(updating_cells - {cell.name})
        rollout = _rollout(view, cell.name, surge=cell.name not in regular, others_wait=others_wait)
        cells[cell.name] = act(cell, rollout)
    for turn in _turns(view, placed, cells, regular):
        cell = next(c for c in placed if c.name == turn)
        others_wait = bool(updating_cells - {turn})
        cells[turn] = act(cell, replace(_rollout(view, turn, others_wait=others_wait), turn=True))
    # A surge cell outlives its rollout only to drain and go: its turn comes once every other
    # cell serves.
    every_cell_serves = all(_serves(cells[c.name]) for c in placed if c.name in regular)
    for cell in placed:
        if cell.name not in regular and not rolling:
            rollout = _rollout(view, cell.name, surge=True)
            cells[cell.name] = act(cell, replace(rollout, retire=True, turn=every_cell_serves))
    events.extend(e for cell in placed for e in cells[cell.name].events)
    events += [
        Event(name, "Warning", Reason.INSUFFICIENT_CAPACITY, unplaced.message)
        for unplaced in plan.unplaced
        if unplaced.deployment == name
    ]
    planned = {cell.name for cell in plan.cells}
    # Pods of cells that are no longer placed: nothing partial stays.
    orphans = tuple(
        pod_name
        for pod_name, pod in sorted(view.pods.items())
        if cell_of(pod) not in planned and not terminating(pod)
    )
    surge_cells = {c.name for c in view.status.cells if c.surge}
    events += _cells_removed(
        name, spec.cells, {n: cell_of(view.pods[n]) for n in orphans}, surge_cells
    )
    if spec.cell.prefill.instances is None:  # as many as fit
        prefill_wanted = sum(len(cell.prefill) for cell in placed)
    else:
        prefill_wanted = spec.cell.prefill.instances * spec.cells
    return _DeploymentActions(
        create=tuple(m for actions in cells.values() for m in actions.create),
        delete_pods=(*(n for a in cells.values() for n in a.delete_pods), *orphans),
        delete_services=tuple(
            s["metadata"]["name"] for s in observed.services if left_behind(s, name, kept)
        ),
        delete_compute_domains=tuple(
            d["metadata"]["name"]
            for d in observed.compute_domains or ()
            if left_behind(d, name, kept)
        ),
        delete_resource_claims=_claims_left_behind(name, plan, view, observed),
        ungate=tuple(n for actions in cells.values() for n in actions.ungate),
        relabel=tuple(r for actions in cells.values() for r in actions.relabel),
        events=tuple(events),
        failures=tuple(f for actions in cells.values() for f in actions.failures),
        status=_status(view, plan, trays, cells, prefill_wanted, rfc3339(observed.now)),
        wake_in=min(
            (
                wake
                for a in cells.values()
                for wake in (a.decode.wake_in, a.wake_in)
                if wake is not None
            ),
            default=None,
        ),
    )


def _rollout(
    view: DeploymentView, cell: str, surge: bool = False, others_wait: bool = False
) -> CellRollout:
    """The cell's rollout state as its status recorded it: no turn yet."""
    record = next((c for c in view.status.cells if c.name == cell), None)
    since = record.draining_since if record is not None else None
    rollout = view.model.spec.rollout
    return CellRollout(
        draining_since=parse_time(since) if since else None,
        drain=timedelta(seconds=rollout.drain_seconds),
        min_ready=timedelta(seconds=rollout.min_ready_seconds),
        served_within=timedelta(seconds=rollout.served_request_seconds),
        others_wait=others_wait,
        surge=surge,
    )


def _rolling(view: DeploymentView, current: Sequence[CellPlacement], observed: Observed) -> bool:
    """Whether one of the deployment's own cells (not a surge cell) is in its update."""
    regular = {cell_name(view.name, index) for index in range(view.model.spec.cells)}
    return any(updating(view, cell, observed) for cell in current if cell.name in regular)


def _surge(
    view: DeploymentView, current: Sequence[CellPlacement], rolling: bool, observed: Observed
) -> int:
    """How many surge cells the deployment wants placed: ``maxSurge`` while it rolls out; after,
    the surge cells it has until each has drained (then they go)."""
    spec = view.model.spec
    if rolling:
        return spec.rollout.max_surge
    drain = timedelta(seconds=spec.rollout.drain_seconds)
    records = {c.name: c for c in view.status.cells}
    have = {cell.name for cell in current}
    wanted = 0
    for index in range(spec.rollout.max_surge):
        name = cell_name(view.name, spec.cells + index)
        record = records.get(name)
        if name not in have or record is None or not record.surge:
            continue
        since = parse_time(record.draining_since) if record.draining_since else None
        if since is None or observed.now < since + drain:
            wanted = index + 1
    return wanted


def _serves(actions: CellActions) -> bool:
    return actions.in_rotation and actions.settled


def _turns(
    view: DeploymentView,
    placed: Sequence[CellPlacement],
    cells: Mapping[str, CellActions],
    regular: Collection[str],
) -> list[str]:
    """The deployment's own cells (``regular``; the others are surge cells) due (stale, or
    moving off a degraded tray) that may leave the rotation now, in name order: while fewer
    than ``maxUnavailable`` of them are out (draining, updating, or not serving for any
    reason), never the last serving cell of several, and not while a surge cell is starting."""
    own = [c for c in placed if c.name in regular]
    surge = [c for c in placed if c.name not in regular]
    if any(not _serves(cells[c.name]) for c in surge):
        return []  # the surge cell serves first: that is what it is for
    out = [c.name for c in own if cells[c.name].draining_since or not _serves(cells[c.name])]
    budget = view.model.spec.rollout.max_unavailable - len(out)
    serving = [c.name for c in placed if c.name not in out]
    turns: list[str] = []
    for cell in sorted(own, key=lambda c: c.name):
        actions = cells[cell.name]
        if budget <= 0:
            break
        if not actions.due or actions.draining_since is not None or cell.name in out:
            continue
        if len(placed) > 1 and len(serving) <= 1:
            break
        turns.append(cell.name)
        serving.remove(cell.name)
        budget -= 1
    return turns


def _claims_left_behind(
    deployment: str, plan: Plan, view: DeploymentView, observed: Observed
) -> tuple[str, ...]:
    """The deployment's prefill channel claims that no planned prefill instance will use and no
    pod still names (a tray its prefill left, a cell removed)."""
    wanted = {
        prefill_channel_claim_name(cell.name, instance.tray)
        for cell in plan.cells
        if cell.deployment == deployment
        for instance in cell.prefill
    }
    named = {claim for pod in view.pods.values() for claim in claims_of(pod)}
    return tuple(
        c["metadata"]["name"]
        for c in observed.resource_claims
        if labels(c).get(DEPLOYMENT_LABEL) == deployment
        and c["metadata"]["name"] not in wanted | named
        and not c["metadata"].get("deletionTimestamp")
    )


def _spare_moving(
    deployment: str, before: CellPlacement, after: CellPlacement, trays: Topology
) -> Event:
    """The cell's spare trays changed: which left, why, and which took their place."""
    left = []
    for tray in before.spare_trays:
        if tray in after.spare_trays:
            continue
        why = "now runs decode" if tray in after.decode_trays else trays.trouble(tray)
        left.append(f"{tray} ({why})" if why else tray)
    joined = [t for t in after.spare_trays if t not in before.spare_trays]
    return Event(
        deployment,
        "Normal",
        Reason.SPARE_MOVING,
        f"spare tray of {after.name} moves from {', '.join(left) or 'none'} to "
        f"{', '.join(joined) or 'none (no free whole tray in the domain)'}",
    )


def _cells_removed(
    deployment: str,
    wanted: int,
    orphans: Mapping[str, str | None],
    surge: Collection[str | None] = (),
) -> list[Event]:
    """One event per cell whose pods go because the cell is no longer placed (``surge``: the
    rollout's surge cells, which go when it ends)."""
    by_cell: dict[str | None, int] = {}
    for cell in orphans.values():
        by_cell[cell] = by_cell.get(cell, 0) + 1
    kept = {cell_name(deployment, index) for index in range(wanted)}
    events = []
    for cell, count in sorted(by_cell.items(), key=lambda item: str(item[0])):
        pods = f"deleting its {count} pod{'' if count == 1 else 's'}"
        if cell in surge:
            events.append(
                Event(
                    deployment,
                    "Normal",
                    Reason.CELL_REMOVED,
                    f"{cell} (the rollout's surge cell) removed, drained: {pods}",
                )
            )
        elif cell in kept:  # still wanted: it lost its placement (see the Placed condition)
            events.append(
                Event(deployment, "Warning", Reason.CELL_REMOVED, f"{cell} unplaced: {pods}")
            )
        else:
            events.append(
                Event(
                    deployment,
                    "Normal",
                    Reason.CELL_REMOVED,
                    f"{cell} removed (spec.cells is {wanted}): {pods}",
                )
            )
    return events


def _status(
    view: DeploymentView,
    plan: Plan,
    trays: Topology,
    cells: dict[str, CellActions],
    prefill_wanted: int,
    now: str,
) -> ModelDeploymentStatus | None:
    """The deployment's new status, or None when it did not change."""
    status = view.status.model_copy(deep=True)
    status.cells = []
    status.endpoints = Endpoints()
    for cell in plan.cells:
        if cell.deployment == view.name:
            record, endpoints = cell_status(cell, view, cells[cell.name])
            status.cells.append(record)
            status.endpoints.cells.append(endpoints)
    status.decode_ranks = sum(c.decode.ready_ranks for c in status.cells)
    status.revision = revision(view.model.spec)
    stamp = ConditionStamp(view.generation, now)
    deployment_conditions(status, plan, view, cells, prefill_wanted, trays, stamp)
    status.observed_generation = view.generation
    return None if status == view.status else status


def _invalid_statuses(
    observed: Observed, invalid: list[InvalidDeployment]
) -> dict[str, dict[str, object]]:
    """Placed=False, InvalidSpec, on each deployment the controller cannot act on."""
    objects = {d.get("metadata", {}).get("name"): d for d in observed.deployments}
    statuses: dict[str, dict[str, object]] = {}
    for bad in invalid:
        obj = objects.get(bad.name) or {}
        status = recorded_status(obj)
        generation = int(obj.get("metadata", {}).get("generation", 0))
        stamp = ConditionStamp(generation, rfc3339(observed.now))
        changed = False
        for condition in invalid_spec_conditions(bad.message, stamp):
            changed = set_condition(status.conditions, condition) or changed
        if changed or status.observed_generation != generation:
            status.observed_generation = generation
            statuses[bad.name] = status.model_dump(
                by_alias=True, exclude_none=True, exclude=set(_NOT_OURS)
            )
    return statuses
