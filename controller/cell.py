"""What one placed cell needs this reconcile: its objects, its decode group, its prefill
instances and its scheduling gates, each decided by a function that returns what to do.

- A cell's pods are created behind the ``baton.dev/cell`` gate; once every planned pod of the
  cell exists (and none is terminating) the gates still held are lifted together, so
  kube-scheduler binds the cell at once.
- A decode group restarts as a whole (a wide-EP group cannot lose a rank): when one of its pods
  failed, was deleted after launch or lost its tray, every live decode pod of the cell is
  deleted, and the group is created afresh once they are gone (on the spare tray for a rank
  whose tray failed or takes no new pods, e.g. cordoned). Restarts back off
  (``RestartPolicy``); past the budget the cell waits, Degraded, until old restarts age out of
  the window.
- A prefill instance restarts alone; changing the prefill count creates or deletes prefill pods
  and never touches the decode group.
- Every pod carries a hash of the spec it was rendered from and the deployment revision. When
  the spec changes what a pod would be (image, flags, env, model), a cell updates only on its
  turn (``CellRollout``; the deployment's rollout gives turns cell by cell): it leaves the
  gateway's rotation first (its endpoints go, ``drainSeconds`` for in-flight requests to finish),
  then its decode group restarts as a whole and its outdated prefill instances are replaced, all
  on the new spec (a planned restart: no backoff, no budget). A cell waiting for its turn keeps
  its pods; one that fails meanwhile comes back on the new revision, and the gateway's endpoints
  pair only pods of the decode group's revision.
- A decode group on a tray marked degraded (a GPU that holds the group back:
  ``controller.stragglers``) moves off it once the move pays (``move_decision``: the slowdown
  so far against a restart, measured from the group's last start): on its turn, as an update
  would, it leaves the rotation, drains, and restarts as a whole; placement gives the degraded
  rank the spare tray, since a degraded tray takes no new pods. No failure is counted against
  the tray, and no backoff applies: it is planned.
- Where the cluster serves NVIDIA's ComputeDomain API, each cell gets its ComputeDomain; its
  decode pods claim the domain's IMEX channel from its template, and once the domain has a UID
  each tray holding the cell's prefill gets the claim its prefill pods share
  (``controller/podspec.py``).

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from baton.core.api import Reason
from baton.core.labels import REVISION_LABEL, ROLE_LABEL
from controller.actions import Event
from controller.names import (
    compute_domain_name,
    decode_pod_name,
    prefill_channel_claim_name,
    prefill_index,
    prefill_pod_name,
)
from controller.observe import (
    DeploymentView,
    Manifest,
    Observed,
    ended_at,
    gated,
    is_terminal,
    labels,
    outdated,
    parse_time,
    planned_tray,
    ready,
    ready_since,
    revision_of,
    rfc3339,
    started_at,
    terminating,
    tray_keeps_pods,
)
from controller.placement import CellPlacement, DeploymentShape, TraySelector
from controller.podspec import compute_domain, prefill_channel_claim, render_cell
from controller.restarts import RestartPolicy, TrayFailure
from controller.stragglers import Move, move_decision
from controller.topology import Topology

__all__ = [
    "CellActions",
    "CellRollout",
    "DecodeGroupActions",
    "PrefillActions",
    "group_restart_seconds",
    "plan_cell",
]

Pods = Mapping[str, Mapping[str, Any]]

# A decode group's restart (the weights reload) where its pods never said how long theirs took.
DEFAULT_RESTART_S = 300.0


@dataclass(frozen=True, slots=True)
class DecodeGroupActions:
    pods: int  # the group's size in pods
    create: tuple[Manifest, ...] = ()
    delete: tuple[str, ...] = ()
    events: tuple[Event, ...] = ()
    failures: tuple[TrayFailure, ...] = ()
    restarts: tuple[str, ...] = ()  # RFC 3339 times of the restarts within the window
    restarting: bool = False
    backoff: bool = False
    exhausted: bool = False
    wake_in: float | None = None  # seconds until a backoff ends
    ready_pods: int = 0  # none while the group restarts or updates

    @property
    def ready(self) -> bool:
        return self.ready_pods == self.pods


@dataclass(frozen=True, slots=True)
class PrefillActions:
    create: tuple[Manifest, ...] = ()
    delete: tuple[str, ...] = ()
    events: tuple[Event, ...] = ()
    failures: tuple[TrayFailure, ...] = ()
    ready: int = 0


@dataclass(frozen=True, slots=True)
class CellRollout:
    """Where a cell stands in the rollout of the deployment's revision."""

    turn: bool = False  # the cell may leave the rotation and update now
    draining_since: datetime | None = None  # when it left the rotation (its status says)
    drain: timedelta = timedelta(0)  # how long in-flight requests may finish
    min_ready: timedelta = timedelta(0)  # how long its pods must be ready to count as serving
    # back from its update, how long past min_ready it may take to serve a request (0: no wait)
    served_within: timedelta = timedelta(0)
    # another of the deployment's cells waits for its own update: the one this check protects
    # (a move off a degraded tray, or the last cell of a rollout, has none to wait for)
    others_wait: bool = False
    # a surge cell (spec.rollout.maxSurge), and whether the rollout it served has ended: then it
    # leaves the rotation on its turn, and goes once drained
    surge: bool = False
    retire: bool = False


@dataclass(frozen=True, slots=True)
class CellActions:
    """Everything one cell needs, and what its status reports."""

    decode: DecodeGroupActions
    prefill: PrefillActions
    create: tuple[Manifest, ...]  # the cell's objects and pods, in creation order
    ungate: tuple[str, ...]
    pending: bool  # pods not yet created, or still gated
    stale: bool = False  # pods of an older revision run in the cell
    move: Move | None = None  # its decode group runs on a degraded tray
    draining_since: datetime | None = None  # out of the rotation for its update since
    in_rotation: bool = True  # the gateway may send it new requests
    settled: bool = False  # every planned pod ready for at least the rollout's minReadySeconds
    drain_events: tuple[Event, ...] = ()
    wake_in: float | None = None  # seconds until its drain ends
    # current pods whose revision label is missing (made before pods carried one) or stale
    relabel: tuple[tuple[str, str], ...] = ()
    surge: bool = False  # a rollout's surge cell

    @property
    def due(self) -> bool:
        """The cell needs its turn: to update, or to move its decode group now."""
        return self.stale or (self.move is not None and self.move.now)

    @property
    def delete_pods(self) -> tuple[str, ...]:
        return self.decode.delete + self.prefill.delete

    @property
    def events(self) -> tuple[Event, ...]:
        return self.drain_events + self.decode.events + self.prefill.events

    @property
    def failures(self) -> tuple[TrayFailure, ...]:
        return self.decode.failures + self.prefill.failures


def _rendered(
    view: DeploymentView, cell: CellPlacement, observed: Observed
) -> tuple[Manifest, dict[str, Manifest]]:
    """The cell's Service, and its pods by name, as the current spec renders them."""
    manifests = render_cell(
        view.model.spec,
        cell,
        deployment=view.name,
        uid=view.uid,
        namespace=observed.namespace,
        compute_domain=observed.compute_domains is not None,
    )
    return manifests[0], {m["metadata"]["name"]: m for m in manifests[1:]}


def updating(view: DeploymentView, cell: CellPlacement, observed: Observed) -> bool:
    """The cell is in its update: pods of an older revision run in it, or it left the rotation
    and does not serve the current revision yet (its status still says it drains)."""
    record = next((c for c in view.status.cells if c.name == cell.name), None)
    if record is not None and record.draining_since is not None and not record.surge:
        return True
    _, wanted = _rendered(view, cell, observed)
    return any(
        name in wanted and not terminating(pod) and outdated(pod, wanted[name])
        for name, pod in view.cell_pods(cell.name).items()
    )


def plan_cell(
    view: DeploymentView,
    cell: CellPlacement,
    *,
    restarted: bool,
    trays: Topology,
    observed: Observed,
    policy: RestartPolicy,
    rollout: CellRollout | None = None,
) -> CellActions:
    """The actions of one placed cell of ``view`` (``restarted``: placement moved a rank;
    ``rollout``: its turn in the rollout of a changed spec)."""
    rollout = rollout or CellRollout()
    imex = observed.compute_domains is not None
    service, wanted = _rendered(view, cell, observed)
    objects: list[Manifest] = []
    if service["metadata"]["name"] not in {s["metadata"]["name"] for s in observed.services}:
        objects.append(service)
    domains = {d["metadata"]["name"]: d for d in observed.compute_domains or ()}
    domain = domains.get(compute_domain_name(cell.name))
    if imex and domain is None:
        objects.append(
            compute_domain(
                cell.name, deployment=view.name, uid=view.uid, namespace=observed.namespace
            )
        )
    domain_uid = (domain or {}).get("metadata", {}).get("uid")
    if domain_uid:  # a claim names its domain by UID: made once the domain exists
        claims = {c["metadata"]["name"] for c in observed.resource_claims}
        objects.extend(
            prefill_channel_claim(
                cell.name,
                tray,
                domain_uid=domain_uid,
                deployment=view.name,
                uid=view.uid,
                namespace=observed.namespace,
            )
            for tray in sorted({instance.tray for instance in cell.prefill})
            if prefill_channel_claim_name(cell.name, tray) not in claims
        )
    pods = view.cell_pods(cell.name)
    live = {n: p for n, p in pods.items() if not terminating(p)}
    record = next((c for c in view.status.cells if c.name == cell.name), None)
    stale = any(n in wanted and outdated(p, wanted[n]) for n, p in live.items())
    move = _move(cell, live, trays, observed.now)
    due = stale or (move is not None and move.now) or rollout.retire
    if stale:
        why = "for its update"
    elif rollout.retire:
        why = "to be removed: it was the rollout's surge cell, and every cell runs the update"
    else:
        why = "to move its decode group off a degraded tray"
    drain = _drain(view.name, cell.name, due, why, rollout, observed.now)
    decode = decode_group_actions(
        view.name,
        cell,
        wanted,
        pods,
        live,
        restarted=restarted,
        trays=trays,
        restarts=record.restarts if record else (),
        now=observed.now,
        policy=policy,
        update=drain.update,
        selector=DeploymentShape.of(view.model).trays,
        move=move.why if move is not None and move.now else None,
    )
    prefill = prefill_actions(
        view.name,
        cell,
        wanted,
        pods,
        live,
        deleting=decode.delete,
        trays=trays,
        instances=view.model.spec.cell.prefill.instances,
        update=drain.update,
    )
    ungate, pending = gate_actions(wanted, live, deleting={*decode.delete, *prefill.delete})
    ready = decode.ready and prefill.ready == len(cell.prefill) and not pending
    # ready long enough: the gateway has had time to admit its engines (a Ready condition
    # without a time counts as long ago)
    since = [ready_since(live[n]) for n in wanted if n in live] if ready else []
    latest = max((t for t in since if t is not None), default=None)
    settle = (latest + rollout.min_ready - observed.now).total_seconds() if latest else 0.0
    settled = ready and settle <= 0
    served = _served(view.name, cell, rollout, observed, latest, due=due)
    settled = settled and served.done
    return CellActions(
        decode=decode,
        prefill=prefill,
        create=(*objects, *decode.create, *prefill.create),
        ungate=ungate,
        pending=pending,
        stale=stale,
        move=move,
        # out of the rotation from its drain until it serves the current revision again
        draining_since=None if not due and settled else drain.since,
        in_rotation=not (due and drain.since is not None),
        settled=settled,
        drain_events=(
            (Event(view.name, "Warning", Reason.TRAY_DEGRADED, f"{cell.name}: {move.why}"),)
            if move is not None and not decode.delete
            else ()
        )
        + drain.events
        + served.events,
        wake_in=min(
            (
                w
                for w in (
                    drain.wake_in,
                    settle if ready and settle > 0 else None,
                    served.wake_in if ready and settle <= 0 else None,
                    move.pays_in_s if move is not None else None,
                )
                if w is not None
            ),
            default=None,
        ),
        relabel=tuple(
            (n, label)
            for n, p in sorted(live.items())
            if n in wanted
            and not outdated(p, wanted[n])
            and revision_of(p) != (label := labels(wanted[n])[REVISION_LABEL])
        ),
        surge=rollout.surge,
    )


@dataclass(frozen=True, slots=True)
class _Served:
    done: bool = True  # it served a request, or need not, or waited long enough
    events: tuple[Event, ...] = ()
    wake_in: float | None = None  # when to ask its engines again


# How often the controller asks a cell back from its update whether it served a request yet.
SERVED_POLL_S = 2.0


def _served(
    deployment: str,
    cell: CellPlacement,
    rollout: CellRollout,
    observed: Observed,
    ready_at: datetime | None,
    *,
    due: bool,
) -> _Served:
    """A cell back from its update (its drain recorded, nothing left to update) while another
    cell waits for its own counts as serving once one of its decode engines has finished a
    request: Ready says the engine
    answers /health, not that the gateway's requests reach it and come back. Past
    ``served_within`` with none (no traffic), the rollout goes on, saying so."""
    if (
        rollout.draining_since is None
        or not rollout.others_wait
        or due
        or observed.served is None
        or rollout.served_within <= timedelta(0)
        or ready_at is None
    ):
        return _Served()
    pods = [decode_pod_name(cell.name, i) for i in range(len(cell.decode_trays))]
    if any(observed.served.get(pod, 0.0) > 0 for pod in pods):
        return _Served()
    left = (ready_at + rollout.min_ready + rollout.served_within - observed.now).total_seconds()
    if left > 0:
        return _Served(done=False, wake_in=min(left, SERVED_POLL_S))
    waited = (rollout.min_ready + rollout.served_within).total_seconds()
    if any(pod in observed.served for pod in pods):
        why = (
            "its decode engines finished no request within {:.0f} s of being ready on the "
            "update (no traffic reached them: none at all, or the gateway preferred cells whose "
            "prefix caches hold the prompts)"
        )
    else:
        why = (
            "none of its decode engines answered the controller on /metrics within {:.0f} s of "
            "being ready on the update, so whether they serve is unknown (a NetworkPolicy "
            "between the controller and the engines, or engines not listening on the API port)"
        )
    event = Event(
        deployment,
        "Normal",
        Reason.NO_REQUEST_SERVED,
        f"{cell.name}: {why.format(waited)}; the rollout goes on",
    )
    return _Served(events=(event,))


@dataclass(frozen=True, slots=True)
class _Drain:
    since: datetime | None = None
    update: bool = False  # drained: its outdated pods go now
    events: tuple[Event, ...] = ()
    wake_in: float | None = None


def _move(cell: CellPlacement, live: Pods, trays: Topology, now: datetime) -> Move | None:
    """Whether the cell's decode group moves off a degraded tray now (the first that pays, or
    the one that pays soonest), or None where it runs on none."""
    moves = [
        move_decision(name, tray.degraded, now, group_restart_seconds(cell, live))
        for name in dict.fromkeys(cell.decode_trays)
        if (tray := trays.tray(name)) is not None and tray.degraded is not None
    ]
    if not moves:
        return None
    return min(moves, key=lambda m: (not m.now, m.pays_in_s if m.pays_in_s is not None else 1e18))


def group_restart_seconds(cell: CellPlacement, live: Pods) -> float:
    """How long the decode group took to start last time (the slowest pod, from its start to
    Ready): what moving it costs. ``DEFAULT_RESTART_S`` where no pod says."""
    took = [
        (became - began).total_seconds()
        for index in range(len(cell.decode_trays))
        if (pod := live.get(decode_pod_name(cell.name, index))) is not None
        and (became := ready_since(pod)) is not None
        and (began := started_at(pod)) is not None
        and became >= began
    ]
    return max(took) if took else DEFAULT_RESTART_S


def _drain(
    deployment: str, cell: str, due: bool, why: str, rollout: CellRollout, now: datetime
) -> _Drain:
    """A cell due for its update or move leaves the rotation on its turn, waits out its drain,
    then acts; a cell whose drain began stays out until it serves the current revision on
    healthy trays (``plan_cell``)."""
    since = rollout.draining_since
    if not due:
        return _Drain(since)
    if since is None:
        if not rollout.turn:
            return _Drain()  # waits for its turn, serving on its revision
        since = now
        event = Event(
            deployment,
            "Normal",
            Reason.CELL_DRAINING,
            f"{cell} leaves the gateway's rotation {why}; its in-flight requests have "
            f"{rollout.drain.total_seconds():.0f} s to finish",
        )
        left = rollout.drain.total_seconds()
        return _Drain(since, update=left <= 0, events=(event,), wake_in=left or None)
    left = (since + rollout.drain - now).total_seconds()
    if left > 0:
        return _Drain(since, wake_in=left)
    return _Drain(since, update=True)


def decode_group_actions(
    deployment: str,
    cell: CellPlacement,
    wanted: Mapping[str, Manifest],
    pods: Pods,
    live: Pods,
    *,
    restarted: bool,
    trays: Topology,
    restarts: Sequence[str],
    now: datetime,
    policy: RestartPolicy,
    update: bool = True,
    selector: TraySelector | None = None,
    move: str | None = None,
) -> DecodeGroupActions:
    """The decode group: whole or nothing (see the module docstring); ``update``: an outdated
    group restarts on the current spec now, and one to ``move`` (why) off a degraded tray
    restarts (its cell is drained)."""
    recent = tuple(t for t in restarts if now - parse_time(t) < policy.window)
    names = [decode_pod_name(cell.name, i) for i in range(len(cell.decode_trays))]
    live_decode = {n: live[n] for n in names if n in live}
    failed = [n for n, p in live_decode.items() if is_terminal(p)]
    selector = selector or TraySelector()
    lost = [n for n, p in live_decode.items() if not tray_keeps_pods(trays, p, selector)]
    launched = any(not gated(p) for p in live_decode.values())
    missing = len(live_decode) < len(names)
    broken = bool(failed or lost or restarted or (launched and missing))
    ready_pods = sum(1 for n in names if n in live and ready(live[n]))
    if broken and live_decode:
        wait = policy.wait([parse_time(t) for t in recent], now)
        if wait is None:
            return DecodeGroupActions(
                len(names), restarts=recent, exhausted=True, ready_pods=ready_pods
            )
        if wait > timedelta(0):
            return DecodeGroupActions(
                len(names),
                restarts=recent,
                backoff=True,
                wake_in=wait.total_seconds(),
                ready_pods=ready_pods,
            )
        why = [
            f"{n} on {planned_tray(live_decode[n])} {'failed' if n in failed else 'lost its tray'}"
            for n in sorted(set(failed) | set(lost))
        ]
        if not why:
            why.append("a decode pod was deleted" if missing else "its placement changed")
        blamed, blame = _blame(live_decode, failed, lost)
        if blame:
            why.append(blame)
        failures = [TrayFailure(tray, deployment) for tray in blamed]
        event = Event(
            deployment,
            "Warning",
            Reason.GROUP_RESTARTING,
            f"decode group of {cell.name} restarts as a whole: {'; '.join(why)}; "
            f"trays {', '.join(cell.decode_trays)}",
        )
        return DecodeGroupActions(
            len(names),
            delete=tuple(sorted(live_decode)),
            events=(event,),
            failures=tuple(failures),
            restarts=(*recent, rfc3339(now)),
            restarting=True,
        )
    stale = any(outdated(p, wanted[n]) for n, p in live_decode.items())
    if live_decode and not broken and update and (stale or move is not None):
        # Planned, outside the failure backoff and budget: the spec changed (image, flags,
        # shape) and the group restarts on the new pods, or it leaves a degraded tray and
        # placement gives that rank the spare once these pods are gone.
        event = (
            Event(
                deployment,
                "Normal",
                Reason.GROUP_UPDATING,
                f"decode group of {cell.name} restarts as a whole on the updated pod spec",
            )
            if stale
            else Event(
                deployment,
                "Warning",
                Reason.GROUP_MOVING,
                f"decode group of {cell.name} restarts as a whole off {move}",
            )
        )
        return DecodeGroupActions(
            len(names),
            delete=tuple(sorted(live_decode)),
            events=(event,),
            restarts=recent,
        )
    create: tuple[Manifest, ...] = ()
    if (not live_decode or not launched) and not any(
        n in pods and terminating(pods[n]) for n in names
    ):
        # Not launched yet, or every old pod gone (new pods reuse the names): create the rest.
        create = tuple(wanted[n] for n in names if n not in live)
    return DecodeGroupActions(len(names), create=create, restarts=recent, ready_pods=ready_pods)


def _blame(pods: Pods, failed: Sequence[str], lost: Sequence[str]) -> tuple[list[str], str]:
    """The trays a decode group's restart counts against, and what to say about it.

    When one rank dies, a wide-EP group's other ranks die with it: only a lost tray, else the
    tray whose pod ended first, is to blame. Pods that ended in the same second (the kubelet's
    resolution) cannot be told apart, and none is blamed: the restart budget still stops a
    crash loop, and the event names them."""
    if lost:
        return sorted(t for n in lost if (t := planned_tray(pods[n])) is not None), ""
    if not failed:
        return [], ""
    if len(failed) == 1:
        tray = planned_tray(pods[failed[0]])
        return ([tray], "") if tray is not None else ([], "")
    ends = {n: ended_at(pods[n]) for n in failed}
    known = sorted((end, n) for n, end in ends.items() if end is not None)
    first = [n for end, n in known if end == known[0][0]] if known else sorted(failed)
    tray = planned_tray(pods[first[0]])
    if len(first) == 1 and tray is not None:
        return [tray], f"counted against {tray}, whose pod ended first"
    when = f" at {rfc3339(known[0][0])}" if known else ""
    return [], f"no tray blamed: {', '.join(first)} ended together{when}"


def prefill_actions(
    deployment: str,
    cell: CellPlacement,
    wanted: Mapping[str, Manifest],
    pods: Pods,
    live: Pods,
    *,
    deleting: Sequence[str],
    trays: Topology,
    instances: int | None,
    update: bool = True,
) -> PrefillActions:
    """Each prefill instance alone; on an updated spec, with ``update`` (the cell is drained),
    every outdated instance at once.

    ``instances`` is the spec's count per cell (None: as many as fit)."""
    names = [prefill_pod_name(cell.name, i.index) for i in cell.prefill]
    planned = {prefill_pod_name(cell.name, i.index): i.tray for i in cell.prefill}
    delete: list[str] = []
    events: list[Event] = []
    failures: list[TrayFailure] = []
    scaled_in: list[str] = []
    for pod_name, pod in sorted(live.items()):
        if labels(pod).get(ROLE_LABEL) != "prefill":
            continue
        tray = planned_tray(pod)
        if is_terminal(pod):
            delete.append(pod_name)
            if tray is not None:
                failures.append(TrayFailure(tray, deployment))
            events.append(
                Event(
                    deployment,
                    "Warning",
                    Reason.PREFILL_RESTARTING,
                    f"prefill {pod_name} on {tray} ended ({pod.get('status', {}).get('phase')}); "
                    "it restarts",
                )
            )
        elif (
            pod_name not in planned
            and instances is not None
            and (prefill_index(pod_name) >= instances)
        ):
            delete.append(pod_name)
            scaled_in.append(pod_name)
        elif pod_name not in planned or tray != planned[pod_name]:
            delete.append(pod_name)
            why = trays.trouble(tray) if tray else None
            source = f"{tray} ({why})" if why else f"{tray}"
            target = planned.get(pod_name)
            events.append(
                Event(
                    deployment,
                    "Warning" if why else "Normal",
                    Reason.PREFILL_MOVING,
                    f"prefill {pod_name} moves from {source} to {target}"
                    if target
                    else f"prefill {pod_name} leaves {source}: no free slot in the domain",
                )
            )
    if scaled_in:
        per_cell = f"{instances} instance{'' if instances == 1 else 's'} per cell wanted"
        events.append(
            Event(
                deployment,
                "Normal",
                Reason.PREFILL_REMOVED,
                f"prefill {', '.join(scaled_in)} removed ({per_cell})",
            )
        )
    gone = {*deleting, *delete}
    stale = [n for n in names if n in live and n not in gone and outdated(live[n], wanted[n])]
    for pod_name in stale if update else ():
        delete.append(pod_name)
        events.append(
            Event(
                deployment,
                "Normal",
                Reason.PREFILL_UPDATING,
                f"prefill {pod_name} replaced on the updated pod spec",
            )
        )
    return PrefillActions(
        create=tuple(wanted[n] for n in names if n not in pods),
        delete=tuple(delete),
        events=tuple(events),
        failures=tuple(failures),
        ready=sum(1 for n in names if n in live and ready(live[n])),
    )


def gate_actions(
    wanted: Mapping[str, Manifest], live: Pods, *, deleting: set[str]
) -> tuple[tuple[str, ...], bool]:
    """The gates to lift (all of the cell's at once, once every planned pod exists and none is
    on its way out) and whether the cell is still pending."""
    complete = all(
        n in live and n not in deleting and planned_tray(live[n]) == planned_tray(wanted[n])
        for n in wanted
    )
    ungate = tuple(sorted(n for n in wanted if gated(live[n]))) if complete else ()
    pending = not complete or any(gated(live[n]) for n in wanted if n in live)
    return ungate, pending
