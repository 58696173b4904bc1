"""The EPLB service: load windows, rebalance decisions and two-phase switches per decode group.

For every decode group (from a :class:`~eplb.config.GroupSource`) a
:class:`GroupRunner` loops:

1. Sync: Describe every agent (the ranks must cover the DP group exactly once, the models must
   agree), read the placement in force (every agent must report the same), and open one
   :class:`~eplb.window.LoadWindow` per model (target and draft separately).
2. Follow: subscribe to every agent's StreamLoad and feed the windows. After each report, if a
   decision boundary is due (``eplb.decide``), decide on a worker thread and, when
   the decision is to rebalance, switch:

   - Prepare to every agent at once; every ack within ``prepareTimeoutSeconds`` or Abort to all.
   - Commit to every agent at one agreed step: the highest step an agent reported when staging
     finished plus ``applyMarginSteps``, and later still if an engine's pace while staging would
     take it there before the Commits and then the Aborts could run out their deadlines. Any
     Commit failing or timing out: Abort to all (an agent drops a committed switch until it
     takes effect), which so lands before any rank switches: no rank ever switches alone.
   - The placement in force becomes the new one; once a full window has run under it, its
     achieved window balance is measured against the prediction.
3. A broken stream, an agent that cannot be reached, or a new incarnation (an engine restart)
   ends (2): the group's windows are discarded and the runner syncs again after
   ``reconnectSeconds``.

Before (1) opens any window, the switches an earlier service left on the agents (it was killed
during Prepare or Commit, or stayed down past a switch's step) are finished or aborted, and
agents left on different placements are brought back to one (``eplb.recovery``). A group whose
engines restarted (a failure, or a move off a degraded tray: the agents answer again on the
engines' cold placement) gets back the placement that was in force before, at once, with a
two-phase switch of its own as soon as its windows are open, committed for a coming step as a
rebalance's is (best effort: one the engines cannot stage in time is aborted, left to the
cadence), instead of running unbalanced for a whole cadence; the service remembers it across
the group's runners (a moved group's agents have new addresses).

Every decision and switch is logged, counted (``eplb.metrics``) and kept in
``GroupRunner.records`` (the last :data:`RECORDS_KEPT`, with the achieved balances of their
switches in ``GroupRunner.achieved``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
import uuid
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from baton.core.eplb_wire import decode_placement, decode_report, encode_placement
from baton.core.experts import Placement, balance, rank_load
from baton.core.proto import eplb_agent_pb2 as pb
from eplb.client import AgentClient
from eplb.config import EplbServiceConfig, GroupSource, GroupSpec
from eplb.decide import Decision, Outcome, decide, due_boundary
from eplb.errors import (
    AgentError,
    AgentRestarted,
    AgentTimeout,
    AgentUnavailable,
    EplbError,
    GroupMismatch,
)
from eplb.metrics import EplbMetrics
from eplb.recovery import AgentState, Pending, plan_recovery
from eplb.window import LoadWindow, Verdict

__all__ = ["RECORDS_KEPT", "EplbService", "GroupRunner", "SwitchRecord"]

log = logging.getLogger("baton.eplb")

# Decisions a runner keeps: each holds its placement (every layer's maps, about 0.55 MB for a
# switch of the 43-layer target model), so keeping all grew the service without bound.
RECORDS_KEPT = 64

_DESCRIBE_DEADLINE_S = 5.0


@dataclass(frozen=True, slots=True)
class SwitchRecord:
    """One decision of one group and model, and what became of it.

    ``result`` is the decision's outcome when it did not rebalance, else ``committed``,
    ``prepare_failed``, ``prepare_timeout`` or ``commit_failed``.
    """

    group: str
    model: str
    decision: Decision
    result: str
    switch_id: str | None = None
    apply_at_step: int | None = None
    round_trip_s: float | None = None


@dataclass(frozen=True, slots=True)
class _Achievement:
    """A committed switch whose first full window under the new placement is awaited."""

    switch_id: str
    version: int
    applied_at: int
    predicted: float
    placement: Placement


@dataclass(frozen=True, slots=True)
class _Ack:
    """An agent's Prepare acknowledgement: its step when staging finished, when the service
    heard it, and the steps per second the engine ran from just before Prepare until then."""

    step: int
    at: float  # time.monotonic()
    pace: float


@dataclass(slots=True)
class _ModelTrack:
    """What a group runner knows of one model: placement in force, window, last boundary."""

    name: str
    placement: Placement
    version: int
    window: LoadWindow
    last_boundary: int | None
    awaiting: list[_Achievement] = field(default_factory=list)
    switch_step: int = -1  # the step the last committed switch applies at (-1: none since sync)


class GroupRunner:
    """One decode group: its agents, windows, decisions and switches (see the module doc)."""

    def __init__(
        self,
        spec: GroupSpec,
        config: EplbServiceConfig,
        clients: list[AgentClient],
        metrics: EplbMetrics,
        remembered: dict[str, tuple[Placement, int]] | None = None,
    ) -> None:
        self.spec = spec
        self.config = config
        self.policy = config.policy
        self.clients = clients
        self.metrics = metrics
        self.tracks: dict[str, _ModelTrack] = {}
        self.records: deque[SwitchRecord] = deque(maxlen=RECORDS_KEPT)
        self.achieved: dict[str, float] = {}
        # Latest window balance per model (at each decision, then as achieved after a
        # switch) and the step the last switch took effect: what status reports.
        self.balance: dict[str, float] = {}
        self.last_rebalance_step: dict[str, int] = {}
        self._incarnations: dict[str, str] = {}
        # The placement and version of each model last in force (synced or committed): what a
        # restarted group gets back.
        self.last_in_force: dict[str, tuple[Placement, int]] = dict(remembered or {})
        self._restoring: dict[str, Placement] = {}  # found at sync, switched back in _follow
        self._failing = False
        self.synced = asyncio.Event()
        # exported too, so that a caller can wait for the group (baton up does)
        self.metrics.group_synced.labels(spec.name).set(0)

    async def run(self) -> None:
        while True:
            try:
                await self.sync()
                await self._follow()
            except AgentRestarted as exc:
                self._restart("incarnation_changed", exc)
            except (AgentError, GroupMismatch) as exc:
                self._restart("agent_lost", exc)
            await asyncio.sleep(self.config.reconnect_seconds)

    def _restart(self, reason: str, exc: EplbError) -> None:
        if self.synced.is_set():
            self.metrics.window_restarts.labels(self.spec.name, reason).inc()
        # Warn once per outage; the reconnect attempts after it only log at debug level.
        if not self._failing:
            log.warning("group %s: %s; its windows restart (%s)", self.spec.name, exc, reason)
        else:
            log.debug("group %s: %s; retrying", self.spec.name, exc)
        self._failing = True
        self.synced.clear()
        self.metrics.group_synced.labels(self.spec.name).set(0)

    async def sync(self) -> None:
        """Step 1: describe the group and open fresh windows."""
        infos = await asyncio.gather(
            *(client.describe(_DESCRIBE_DEADLINE_S) for client in self.clients)
        )
        size = {info.data_parallel_size for info in infos}
        if len(size) != 1:
            raise GroupMismatch(f"group {self.spec.name}: agents disagree on DP size {size}")
        num_ranks = size.pop()
        ranks = sorted(rank for info in infos for rank in info.dp_ranks)
        if ranks != list(range(num_ranks)):
            raise GroupMismatch(
                f"group {self.spec.name}: agents serve ranks {ranks}, expected each of "
                f"0..{num_ranks - 1} once; list every agent of the group in the config"
            )
        shapes = {
            tuple(
                sorted((m.name, m.layers, m.logical_experts, m.physical_experts) for m in i.models)
            )
            for i in infos
        }
        if len(shapes) != 1:
            raise GroupMismatch(f"group {self.spec.name}: agents disagree on models {shapes}")
        logical = {m.name: m.logical_experts for m in infos[0].models}
        states = await asyncio.gather(
            *(client.get_placement(_DESCRIBE_DEADLINE_S) for client in self.clients)
        )
        await self._recover(states, num_ranks, logical)
        in_force = _agreed_placements(self.spec.name, states)
        self._restoring = self._to_restore(in_force, num_ranks, logical)
        step = max(info.current_step for info in infos)
        capacity = self.policy.window_size + 4 * self.config.steps_per_report
        self.tracks = {}
        for name, message in in_force.items():
            placement = decode_placement(message, num_ranks, logical[name])
            self.tracks[name] = _ModelTrack(
                name=name,
                placement=placement,
                version=message.version,
                window=LoadWindow(placement, message.version, capacity),
                # Boundaries already passed belong to windows this service never saw.
                last_boundary=(step // self.policy.step_interval) * self.policy.step_interval,
            )
        # a placement to restore stays the one remembered until the restore is in force
        self.last_in_force = {
            n: self.last_in_force[n] if n in self._restoring else (t.placement, t.version)
            for n, t in self.tracks.items()
        }
        self._incarnations = {
            client.address: info.incarnation
            for client, info in zip(self.clients, infos, strict=True)
        }
        log.info(
            "group %s: %d ranks over %d agents, models %s, step %d",
            self.spec.name,
            num_ranks,
            len(self.clients),
            sorted(self.tracks),
            step,
        )
        self._failing = False
        self.synced.set()
        self.metrics.group_synced.labels(self.spec.name).set(1)

    async def _recover(
        self, states: list[pb.PlacementState], num_ranks: int, logical: dict[str, int]
    ) -> None:
        """Finish or abort the switches an earlier service left, and bring agents left on
        different placements back to one (``eplb.recovery``). Raises GroupMismatch, so that
        the runner syncs again, until nothing is left to do."""
        agents = [
            AgentState(
                client.address,
                {p.model: (p.phy2log, p.version) for p in state.placements},
                tuple(
                    Pending(p.model, p.switch_id, p.committed, p.apply_at_step)
                    for p in state.pending
                ),
            )
            for client, state in zip(self.clients, states, strict=True)
        ]
        recovery = plan_recovery(agents)
        if recovery.clean:
            return
        by_address = {client.address: client for client in self.clients}
        deadline = self.config.commit_timeout_seconds
        for switch_id in recovery.abort:
            self.metrics.switches_recovered.labels(self.spec.name, "aborted").inc()
            await self._abort_all(switch_id, "left staged by an earlier EPLB service")
        for address, switch_id, step in recovery.commit:
            self.metrics.switches_recovered.labels(self.spec.name, "committed").inc()
            log.warning(
                "group %s: switch %s was committed on some agents only (an earlier service "
                "stopped during Commit); committing it on %s for step %d",
                self.spec.name,
                switch_id,
                address,
                step,
            )
            await by_address[address].commit(switch_id, step, deadline)
        for model, (lagging, leader) in sorted(recovery.behind.items()):
            self.metrics.switches_recovered.labels(self.spec.name, "reunified").inc()
            await self._reunify(model, lagging, by_address[leader], states, num_ranks, logical)
        waits = ", ".join(f"{switch_id} at step {step}" for switch_id, step in recovery.wait_for)
        raise GroupMismatch(
            f"group {self.spec.name}: recovering switches an earlier service left"
            + (f" (waiting for {waits})" if waits else "")
        )

    async def _reunify(
        self,
        model: str,
        lagging: tuple[str, ...],
        leader: AgentClient,
        states: list[pb.PlacementState],
        num_ranks: int,
        logical: dict[str, int],
    ) -> None:
        """Switch the agents ``lagging`` behind on ``model`` to ``leader``'s placement, with a
        two-phase switch of their own."""
        state = states[self.clients.index(leader)]
        message = next(p for p in state.placements if p.model == model)
        placement = decode_placement(message, num_ranks, logical[model])
        clients = [client for client in self.clients if client.address in lagging]
        switch_id = f"{self.spec.name}-{model}-reunify-{uuid.uuid4().hex[:8]}"
        log.warning(
            "group %s %s: agents %s are on another placement than %s (version %d): switching "
            "them to it (%s)",
            self.spec.name,
            model,
            ", ".join(lagging),
            leader.address,
            message.version,
            switch_id,
        )
        await self._switch_alone(
            clients, switch_id, encode_placement(model, placement, message.version), "reunifying"
        )

    def _to_restore(
        self, in_force: dict[str, pb.Placement], num_ranks: int, logical: dict[str, int]
    ) -> dict[str, Placement]:
        """The placements last in force of the models whose agents came back on an older one
        (a restarted group: see the module doc), to switch them back to once the windows are
        open.

        A version counts the switches an engine has applied since it started
        (docs/eplb-protocol.md): engines reporting fewer than the service last knew have
        restarted since."""
        restoring: dict[str, Placement] = {}
        for model, message in sorted(in_force.items()):
            last = self.last_in_force.get(model)
            if last is None or message.version >= last[1]:
                continue  # nothing known, or no restart since (as many switches or more)
            placement = last[0]
            shape = (message.layers, message.physical_experts)
            if (
                placement.num_ranks != num_ranks
                or placement.num_logical_experts != logical[model]
                or placement.phy2log.shape != shape
            ):
                continue  # another shape of group: the remembered placement does not apply
            if not np.array_equal(
                decode_placement(message, num_ranks, logical[model]).phy2log, placement.phy2log
            ):
                restoring[model] = placement
        return restoring

    async def _restore_placements(self) -> None:
        """Switch each model of ``_restoring`` back, as its engines' next switch, committed for
        a coming step as a rebalance is. Best effort: a restore that fails (the engines cannot
        stage it in time) is aborted everywhere and left to the cadence."""
        restoring, self._restoring = self._restoring, {}
        for model, placement in sorted(restoring.items()):
            track = self.tracks[model]
            version = track.version + 1
            switch_id = f"{self.spec.name}-{model}-restore-{uuid.uuid4().hex[:8]}"
            log.warning(
                "group %s %s: its engines came back on placement version %d of their own, not "
                "the one in force before they restarted (version %d then); restoring it (%s)",
                self.spec.name,
                model,
                track.version,
                self.last_in_force[model][1],
                switch_id,
            )
            track.window.expect(version, placement)
            try:
                applied_at = await self._switch_alone(
                    self.clients,
                    switch_id,
                    encode_placement(model, placement, version),
                    "restoring",
                )
            except AgentError as exc:
                log.warning(
                    "group %s %s: restoring failed (%s); the cadence rebalances it",
                    self.spec.name,
                    model,
                    exc,
                )
                continue  # remembered still: a later sync of these engines tries again
            track.placement, track.version, track.switch_step = placement, version, applied_at
            self.last_in_force[model] = (placement, version)
            self.metrics.switches_recovered.labels(self.spec.name, "restored").inc()

    async def _switch_alone(
        self, clients: list[AgentClient], switch_id: str, message: pb.Placement, what: str
    ) -> int:
        """A two-phase switch of ``clients`` to ``message`` outside the windows and decisions
        (recovery); the step it applies at. Any failure aborts it everywhere and raises."""
        try:
            acks = await asyncio.gather(
                *(self._prepare(client, switch_id, message) for client in clients)
            )
            step = self._apply_step(list(acks))
            committed = await asyncio.gather(
                *(
                    client.commit(switch_id, step, self.config.commit_timeout_seconds)
                    for client in clients
                )
            )
        except AgentError as exc:
            await self._abort_all(switch_id, f"{what} failed: {exc}")
            raise
        return max(committed)

    async def _follow(self) -> None:
        """Step 2: read every agent's load stream until one breaks."""
        queue: asyncio.Queue[tuple[str, pb.LoadReport] | AgentError] = asyncio.Queue()
        readers = [
            asyncio.create_task(self._read(client, queue), name=f"eplb-stream-{client.address}")
            for client in self.clients
        ]
        try:
            await self._restore_placements()
            while True:
                item = await queue.get()
                if isinstance(item, AgentError):
                    raise item
                address, message = item
                if message.incarnation != self._incarnations[address]:
                    raise AgentRestarted(address, "its engine restarted (new incarnation)")
                track = self.tracks.get(message.model)
                if track is not None and self._accept(track, message):
                    await self._after_report(track)
        finally:
            for reader in readers:
                reader.cancel()
            await asyncio.gather(*readers, return_exceptions=True)

    async def _read(
        self, client: AgentClient, queue: asyncio.Queue[tuple[str, pb.LoadReport] | AgentError]
    ) -> None:
        try:
            async for message in client.stream_load(self.config.steps_per_report):
                queue.put_nowait((client.address, message))
            queue.put_nowait(AgentUnavailable(client.address, "load stream ended"))
        except AgentError as exc:
            queue.put_nowait(exc)

    def _accept(self, track: _ModelTrack, message: pb.LoadReport) -> bool:
        try:
            verdict = track.window.add(decode_report(message))
        except ValueError:
            verdict = Verdict.WRONG_SHAPE
        if verdict is Verdict.ACCEPTED:
            return True
        self.metrics.reports_dropped.labels(self.spec.name, track.name, verdict.value).inc()
        log.debug(
            "group %s: dropped %s report of rank %d at step %d: %s",
            self.spec.name,
            track.name,
            message.dp_rank,
            message.first_step,
            verdict,
        )
        return False

    async def _after_report(self, track: _ModelTrack) -> None:
        self._measure_achieved(track)
        boundary = due_boundary(track.window.completed_end, track.last_boundary, self.policy)
        if boundary is None:
            return
        track.last_boundary = boundary
        window = track.window.window(*self.policy.window_for(boundary))
        labels = (self.spec.name, track.name)
        started = time.perf_counter()
        # The algorithm takes tens of milliseconds: off the event loop, so streams keep flowing.
        # reports show the engines' steps: before the last switch's step it is still pending
        pending = track.window.completed_end < track.switch_step
        decision = await asyncio.to_thread(
            decide, window, track.placement, self.policy, boundary, switch_pending=pending
        )
        self.metrics.decision_seconds.labels(*labels).observe(time.perf_counter() - started)
        if window.steps:
            self.metrics.step_balance.labels(*labels).set(window.step_balance)
            self._set_layer_balance(track, window.load)
            self.balance[track.name] = decision.balance_before
        if decision.outcome is not Outcome.REBALANCE:
            self._record(SwitchRecord(self.spec.name, track.name, decision, decision.outcome))
            log.info(
                "group %s %s: no rebalance at step %d (%s; window balance %.4f -> %.4f predicted)",
                self.spec.name,
                track.name,
                boundary,
                decision.outcome,
                decision.balance_before,
                decision.balance_after,
            )
            return
        self.metrics.balance.labels(*labels, "before").set(decision.balance_before)
        self.metrics.balance.labels(*labels, "predicted").set(decision.balance_after)
        await self.switch(track.name, decision)

    async def switch(self, model: str, decision: Decision) -> SwitchRecord:
        """Two-phase switch of ``model`` to ``decision.placement`` on every agent."""
        track = self.tracks[model]
        switch_id = f"{self.spec.name}-{track.name}-{decision.boundary}-{uuid.uuid4().hex[:8]}"
        message = encode_placement(track.name, decision.placement, track.version + 1)
        started = time.perf_counter()
        prepared = await asyncio.gather(
            *(self._prepare(client, switch_id, message) for client in self.clients),
            return_exceptions=True,
        )
        failures = [r for r in prepared if isinstance(r, BaseException)]
        if failures:
            timed_out = any(isinstance(f, AgentTimeout) for f in failures)
            await self._abort_all(switch_id, f"prepare failed: {failures[0]}")
            return self._record(
                SwitchRecord(
                    self.spec.name,
                    track.name,
                    decision,
                    "prepare_timeout" if timed_out else "prepare_failed",
                    switch_id,
                )
            )
        apply_at = self._apply_step([r for r in prepared if isinstance(r, _Ack)])
        track.window.expect(track.version + 1, decision.placement)
        committed = await asyncio.gather(
            *(
                client.commit(switch_id, apply_at, self.config.commit_timeout_seconds)
                for client in self.clients
            ),
            return_exceptions=True,
        )
        failures = [r for r in committed if isinstance(r, BaseException)]
        if failures:
            await self._abort_all(switch_id, f"commit failed: {failures[0]}")
            return self._record(
                SwitchRecord(self.spec.name, track.name, decision, "commit_failed", switch_id)
            )
        round_trip = time.perf_counter() - started
        applied_at = max(step for step in committed if isinstance(step, int))
        track.placement, track.version = decision.placement, track.version + 1
        self.last_in_force[track.name] = (track.placement, track.version)
        self.last_rebalance_step[track.name] = track.switch_step = applied_at
        track.awaiting.append(
            _Achievement(
                switch_id, track.version, applied_at, decision.balance_after, decision.placement
            )
        )
        labels = (self.spec.name, track.name)
        self.metrics.switch_seconds.labels(*labels).observe(round_trip)
        self.metrics.experts_moved.labels(*labels).inc(decision.moved_experts)
        self.metrics.bytes_moved.labels(*labels).inc(
            decision.moved_experts * self.config.expert_bytes_of(track.name)
        )
        record = self._record(
            SwitchRecord(
                self.spec.name,
                track.name,
                decision,
                "committed",
                switch_id,
                applied_at,
                round_trip,
            )
        )
        log.info(
            "group %s %s: switch %s committed for step %d: window [%d, %d) balance %.4f -> "
            "%.4f predicted (%.4f on the window), %d experts moved, round trip %.1f ms",
            self.spec.name,
            track.name,
            switch_id,
            applied_at,
            decision.window_first,
            decision.window_end,
            decision.balance_before,
            decision.balance_after,
            decision.balance_fitted,
            decision.moved_experts,
            round_trip * 1e3,
        )
        return record

    async def _prepare(self, client: AgentClient, switch_id: str, message: pb.Placement) -> _Ack:
        """Prepare on one agent, timing the engine's steps from just before it to the ack."""
        timeout = self.config.prepare_timeout_seconds
        started = time.monotonic()
        before = (await client.get_placement(timeout)).current_step
        ack = await client.prepare(switch_id, [message], timeout)
        heard = time.monotonic()
        return _Ack(
            ack.current_step, heard, (ack.current_step - before) / max(heard - started, 1e-3)
        )

    def _apply_step(self, acks: list[_Ack]) -> int:
        """The step every agent is committed to switch at.

        At least ``applyMarginSteps`` past the highest acknowledged step; and, at the pace each
        engine ran while staging, not before the Commits and then the Aborts could each run out
        their deadline: an agent that fails or vanishes at Commit is then aborted everywhere
        before any engine reaches the step. An engine that acknowledged early has stepped on
        while the others staged, which is counted from its ack."""
        now = time.monotonic()
        horizon = 2 * self.config.commit_timeout_seconds
        margin = max(ack.step for ack in acks) + self.config.apply_margin_steps
        paced = max(math.ceil(ack.step + ack.pace * (now - ack.at + horizon)) for ack in acks)
        if paced > margin:
            log.info(
                "group %s: switch step %d, past the margin's %d: the engines' pace (up to %.0f "
                "steps/s) would reach it before Commit and Abort deadlines run out",
                self.spec.name,
                paced,
                margin,
                max(ack.pace for ack in acks),
            )
        return max(margin, paced)

    async def _abort_all(self, switch_id: str, reason: str) -> None:
        results = await asyncio.gather(
            *(
                client.abort(switch_id, reason, self.config.commit_timeout_seconds)
                for client in self.clients
            ),
            return_exceptions=True,
        )
        log.warning(
            "group %s: switch %s aborted on every agent: %s", self.spec.name, switch_id, reason
        )
        for client, result in zip(self.clients, results, strict=True):
            if isinstance(result, BaseException):
                # A dead agent's engine is gone with its staged switch; a live one that missed
                # the Abort still holds it and refuses the next Prepare until aborted.
                log.error(
                    "group %s: Abort %s on %s failed: %s",
                    self.spec.name,
                    switch_id,
                    client.address,
                    result,
                )

    def _measure_achieved(self, track: _ModelTrack) -> None:
        """Achieved window balance of each switch over ``[applied, applied + window)``, once
        complete, if that window ran entirely under the switch's placement."""
        for awaiting in list(track.awaiting):
            end = awaiting.applied_at + self.policy.window_size
            if track.window.completed_end < end:
                continue
            track.awaiting.remove(awaiting)
            window = track.window.window(awaiting.applied_at, end)
            if not window.complete or window.versions != {awaiting.version}:
                log.info(
                    "group %s %s: switch %s not measured: its first window was incomplete or "
                    "overtaken by the next switch",
                    self.spec.name,
                    track.name,
                    awaiting.switch_id,
                )
                continue
            achieved = balance(window.load, awaiting.placement)
            self.achieved[awaiting.switch_id] = achieved
            self.balance[track.name] = achieved
            self.metrics.balance.labels(self.spec.name, track.name, "achieved").set(achieved)
            log.info(
                "group %s %s: switch %s achieved window balance %.4f over [%d, %d) "
                "(predicted %.4f)",
                self.spec.name,
                track.name,
                awaiting.switch_id,
                achieved,
                awaiting.applied_at,
                end,
                awaiting.predicted,
            )

    def _set_layer_balance(self, track: _ModelTrack, load: np.ndarray) -> None:
        if self.metrics.layer_balance is None:
            return
        per_rank = rank_load(load, track.placement)
        peak = per_rank.max(axis=-1)
        ratios = np.where(peak > 0, per_rank.mean(axis=-1) / np.maximum(peak, 1e-300), 1.0)
        for layer, ratio in enumerate(ratios):
            self.metrics.layer_balance.labels(self.spec.name, track.name, str(layer)).set(ratio)

    def _record(self, record: SwitchRecord) -> SwitchRecord:
        self.records.append(record)
        kept = {kept.switch_id for kept in self.records}
        for switch_id in [s for s in self.achieved if s not in kept]:
            del self.achieved[switch_id]
        self.metrics.rebalances.labels(record.group, record.model, record.result).inc()
        return record


def _agreed_placements(group: str, states: list[pb.PlacementState]) -> dict[str, pb.Placement]:
    """The placement of each model that every agent reports, or GroupMismatch."""
    first = {p.model: p for p in states[0].placements}
    for state in states[1:]:
        other = {p.model: p for p in state.placements}
        if other.keys() != first.keys() or any(
            other[m].phy2log != first[m].phy2log or other[m].version != first[m].version
            for m in first
        ):
            raise GroupMismatch(f"group {group}: agents report different placements in force")
    return first


class EplbService:
    """Every decode group's runner, kept in step with the groups its source lists: a new group
    gets a runner, a group whose agents changed (a recreated decode group) a fresh one, a group
    gone has its runner stopped. One group's failures never stop another's."""

    def __init__(
        self,
        config: EplbServiceConfig,
        source: GroupSource,
        metrics: EplbMetrics,
        *,
        token: str | None = None,
        tls_ca: bytes | None = None,
    ) -> None:
        self.config, self.source, self.metrics = config, source, metrics
        self._token, self._tls_ca = token, tls_ca
        self.runners: dict[str, GroupRunner] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        # each group's placements last in force, kept when its runner goes (its agents
        # changed: the group was recreated), for the next one to restore
        self._remembered: dict[str, dict[str, tuple[Placement, int]]] = {}

    async def run(self) -> None:
        """Follow the source until cancelled."""
        try:
            while True:
                await self._update(self.source.decode_groups())
                await self.source.changed()
        finally:
            for name in list(self.runners):
                await self._stop(name)

    async def _update(self, groups: tuple[GroupSpec, ...]) -> None:
        wanted = {spec.name: spec for spec in groups}
        for name, runner in list(self.runners.items()):
            if wanted.get(name) != runner.spec:
                log.info("group %s: %s", name, "agents changed" if name in wanted else "gone")
                await self._stop(name)
        for name, spec in wanted.items():
            if name in self.runners:
                continue
            clients = [
                AgentClient(address, token=self._token, tls_ca=self._tls_ca)
                for address in spec.agents
            ]
            runner = GroupRunner(
                spec,
                self.config.for_group(spec),
                clients,
                self.metrics,
                self._remembered.get(name),
            )
            self.runners[name] = runner
            self._tasks[name] = asyncio.create_task(runner.run(), name=f"eplb-group-{name}")

    async def _stop(self, name: str) -> None:
        runner = self.runners.pop(name)
        self._remembered[name] = runner.last_in_force
        task = self._tasks.pop(name)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        for client in runner.clients:
            await client.close()
        # a group gone is followed by nobody: no series of it is left to read as either
        self.metrics.group_synced.remove(name)
