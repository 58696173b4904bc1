"""The simulated engine's EPLB agent: the gRPC side of ``protos/eplb_agent.proto``.

It streams the group's per-step expert load (each rank's own physical experts, as compact
little-endian uint32 bytes) and takes two-phase placement switches from the EPLB service:
Prepare validates and stages (the weights copied one layer per decode step while decode goes
on, each such step paying the copy, as ``sim.moe`` describes; on an idle group at the links'
own pace), Commit makes the switch happen at the agreed step, Abort drops what was staged
(committed or not) until it takes effect. A malformed placement is rejected before anything is
staged. A Prepare replaces a switch staged but never committed (its Abort was lost), logged.

A load subscriber more than ``_WINDOWS_BEHIND`` windows (and ``_STEPS_BEHIND`` steps) behind is
dropped (RESOURCE_EXHAUSTED, one log line, counted for ``/metrics``), so a subscriber that stops
reading costs bounded memory.

A stalled rank cannot stage weights, so Prepare acknowledges only once no rank of the group is
stalled (a hung rank never acks); a switch aborted while it was staging is never staged.

Authentication: with a token (``--eplb-agent-token-file``, a Kubernetes Secret mounted as a
file), every call needs the gRPC metadata ``authorization: Bearer <token>``; a bad or missing
token is refused with UNAUTHENTICATED and logged. Without a token the agent refuses Prepare,
Commit and Abort (PERMISSION_DENIED) unless ``--eplb-agent-insecure`` opens it, for local tests;
either way it says so at startup. TLS is optional (``--eplb-agent-tls-cert`` and
``--eplb-agent-tls-key``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import uuid
from typing import Any

import grpc
import numpy as np

from baton.core.eplb_wire import decode_placement, encode_placement
from baton.core.experts import Placement, moves
from baton.core.proto import eplb_agent_pb2 as pb
from baton.core.proto import eplb_agent_pb2_grpc as pb_grpc
from sim.engine import DPGroup
from sim.moe import ExpertTransfer, MoERuntime

__all__ = ["EplbAgentServer", "decode_placement", "encode_placement"]

log = logging.getLogger("baton.sim.agent")
DEFAULT_STEPS_PER_REPORT = 100
# Windows of load reports (one per rank and model) a subscriber may fall behind before it is
# dropped, and at least as many steps (short reports make short windows, and a busy reader
# lags by time, not windows): a subscriber that stops reading must not grow the engine's memory.
_WINDOWS_BEHIND = 8
_STEPS_BEHIND = 500
# Switch ids aborted recently, remembered so a Prepare still staging them does not stage them.
_REMEMBERED_ABORTS = 256
# Simulated seconds between checks of a stalled or dead group while a Prepare waits.
_STALL_POLL_S = 0.05


class _Servicer(pb_grpc.EplbAgentServicer):
    def __init__(
        self, group: DPGroup, moe: MoERuntime, token: str | None, *, insecure: bool
    ) -> None:
        self.group = group
        self.moe = moe
        self.incarnation = uuid.uuid4().hex
        self._expected = f"Bearer {token}".encode() if token is not None else None
        self._insecure = insecure
        self._aborted: dict[str, None] = {}  # insertion-ordered set of recent aborts

    async def _authenticate(
        self, context: grpc.aio.ServicerContext[Any, Any], method: str, *, switches: bool = False
    ) -> None:
        """Refuse ``method`` (UNAUTHENTICATED) unless it carries the agent's bearer token; on
        an agent without a token, refuse the calls that ``switches`` placement (PERMISSION_DENIED)
        unless the agent was opened with ``--eplb-agent-insecure``."""
        if self._expected is None:
            if switches and not self._insecure:
                log.warning("refused %s from %s: the agent has no token", method, context.peer())
                await context.abort(
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"this agent has no token and takes no {method}; start it with "
                    "--eplb-agent-token-file (or --eplb-agent-insecure for local tests)",
                )
            return
        given = b""
        for key, value in context.invocation_metadata() or ():
            if key == "authorization":
                given = value.encode() if isinstance(value, str) else value
        # Constant-time comparison: the token must not leak through response timing.
        if hmac.compare_digest(given, self._expected):
            return
        reason = "no bearer token" if not given else "bad bearer token"
        log.warning("refused %s from %s: %s", method, context.peer(), reason)
        await context.abort(
            grpc.StatusCode.UNAUTHENTICATED,
            f"{reason}; send metadata 'authorization: Bearer <token>' with the agent's token",
        )

    async def _stage(self, transfer: ExpertTransfer) -> None:
        """Until the switch's weights are copied, then while any rank of the group is stalled.

        While the group decodes, each decode step copies a layer (and pays for it); while it
        has no work, the links are idle and the copies run at their own pace here.
        """
        clock = self.group.sim_clock
        copied = asyncio.Event()
        transfer.on_copy = copied.set
        while not transfer.done and self.moe.transfer is transfer and not self.group.dead:
            if self.group.has_work:
                copied.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(copied.wait(), _STALL_POLL_S * clock.time_scale)
                continue
            before = transfer.copied
            await clock.sleep(transfer.next_seconds)
            if transfer.copied == before and self.moe.transfer is transfer:
                self.moe.copy_next_layer()
        while not self.group.dead:
            stalled = max(rank.stalled_until for rank in self.group.ranks.values()) - clock.now()
            if stalled <= 0:
                return
            await clock.sleep(min(stalled, _STALL_POLL_S))

    async def Describe(
        self,
        request: pb.DescribeRequest,
        context: grpc.aio.ServicerContext[pb.DescribeRequest, pb.AgentInfo],
    ) -> pb.AgentInfo:
        await self._authenticate(context, "Describe")
        if self.group.dead:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "engine is dead")
        models = [
            pb.ModelInfo(
                name=name,
                layers=s.model.layers,
                logical_experts=s.model.experts,
                physical_experts=s.placement.phy2log.shape[1],
                top_k=s.model.top_k,
            )
            for name, s in self.moe.models.items()
        ]
        return pb.AgentInfo(
            engine_id=self.group.config.kv_transfer.engine_id,
            data_parallel_size=self.group.config.data_parallel_size,
            dp_ranks=sorted(self.group.ranks),
            models=models,
            current_step=self.moe.step,
            incarnation=self.incarnation,
        )

    async def StreamLoad(
        self,
        request: pb.StreamLoadRequest,
        context: grpc.aio.ServicerContext[pb.StreamLoadRequest, pb.LoadReport],
    ) -> None:
        await self._authenticate(context, "StreamLoad")
        ranks = list(request.dp_ranks) or sorted(self.group.ranks)
        unknown = set(ranks) - set(self.group.ranks)
        if unknown:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"ranks {sorted(unknown)} are not served here"
            )
        per_report = request.steps_per_report or DEFAULT_STEPS_PER_REPORT
        # A window is one report per rank and model; a subscriber further behind than
        # ``windows_behind`` of them is dropped, so what one holds here stays bounded.
        windows_behind = max(_WINDOWS_BEHIND, -(-_STEPS_BEHIND // per_report))
        queue: asyncio.Queue[pb.LoadReport] = asyncio.Queue(
            windows_behind * len(ranks) * len(self.moe.models)
        )
        buffers: dict[str, tuple[int, int, list[np.ndarray]]] = {}
        overrun = asyncio.Event()

        def listen(model: str, step: int, physical: np.ndarray, version: int) -> None:
            if overrun.is_set():
                return
            first, buffered_version, steps = buffers.get(model, (step, version, []))
            if steps and (step != first + len(steps) or version != buffered_version):
                if not self._flush(queue, model, first, buffered_version, steps, ranks):
                    return drop()
                first, buffered_version, steps = step, version, []
            steps.append(physical)
            buffers[model] = (first, buffered_version, steps)
            # Batches end at multiples of the report size, whenever the stream began, so that
            # every agent's reports of the same steps line up and complete together.
            if (step + 1) % per_report == 0:
                del buffers[model]
                if not self._flush(queue, model, first, buffered_version, steps, ranks):
                    drop()

        def drop() -> None:
            overrun.set()
            buffers.clear()
            while not queue.empty():  # the reports it will never get: free them now
                queue.get_nowait()
            self.moe.load_subscribers_dropped += 1
            log.warning(
                "load subscriber %s dropped: more than %d windows (%d steps) behind",
                context.peer(),
                windows_behind,
                windows_behind * per_report,
            )

        self.moe.listeners.append(listen)
        # A subscriber that does not read blocks its write in gRPC's flow control: writes run
        # in their own task, so the overrun can end the stream while one waits.
        sending = asyncio.ensure_future(self._send(queue, context))
        try:
            while not sending.done():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(overrun.wait(), timeout=1.0)
                if overrun.is_set():
                    sending.cancel()
                    await context.abort(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"more than {windows_behind} windows of load reports behind; "
                        "read faster or ask for fewer ranks",
                    )
                if self.group.dead:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "engine is dead")
            await sending  # a failed write ends the stream with its error
        finally:
            sending.cancel()
            self.moe.listeners.remove(listen)

    @staticmethod
    async def _send(
        queue: asyncio.Queue[pb.LoadReport],
        context: grpc.aio.ServicerContext[pb.StreamLoadRequest, pb.LoadReport],
    ) -> None:
        while True:
            await context.write(await queue.get())

    def _flush(
        self,
        queue: asyncio.Queue[pb.LoadReport],
        model: str,
        first: int,
        version: int,
        steps: list[np.ndarray],
        ranks: list[int],
    ) -> bool:
        """Queue one report per rank of these steps; False when the subscriber has no room."""
        counts = np.stack(steps).astype("<u4")
        slots = counts.shape[2] // self.moe.num_ranks
        for rank in ranks:
            report = pb.LoadReport(
                dp_rank=rank,
                model=model,
                first_step=first,
                num_steps=len(steps),
                layers=counts.shape[1],
                slots=slots,
                counts=counts[:, :, rank * slots : (rank + 1) * slots].tobytes(),
                incarnation=self.incarnation,
                placement_version=version,
            )
            try:
                queue.put_nowait(report)
            except asyncio.QueueFull:
                return False
        return True

    async def Prepare(
        self,
        request: pb.PrepareRequest,
        context: grpc.aio.ServicerContext[pb.PrepareRequest, pb.PrepareResponse],
    ) -> pb.PrepareResponse:
        await self._authenticate(context, "Prepare", switches=True)
        if self.group.dead:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "engine is dead")
        staged: dict[str, Placement] = {}
        for message in request.placements:
            state = self.moe.models.get(message.model)
            if state is None:
                return pb.PrepareResponse(
                    ok=False,
                    error=f"unknown model '{message.model}'; served: {sorted(self.moe.models)}",
                )
            current = state.placement
            if (message.layers, message.physical_experts) != current.phy2log.shape:
                return pb.PrepareResponse(
                    ok=False,
                    error=(
                        f"{message.model}: placement shape [{message.layers}, "
                        f"{message.physical_experts}] differs from the engine's "
                        f"{list(current.phy2log.shape)}"
                    ),
                )
            staged_before = state.staged
            if (
                staged_before is not None
                and staged_before.switch_id != request.switch_id
                and staged_before.committed
            ):
                return pb.PrepareResponse(
                    ok=False,
                    error=(
                        f"{message.model}: switch {staged_before.switch_id} is committed "
                        f"for step {staged_before.apply_at_step}; abort it first"
                    ),
                )
            try:
                placement = decode_placement(
                    message, self.moe.num_ranks, current.num_logical_experts
                )
            except ValueError as exc:
                return pb.PrepareResponse(ok=False, error=str(exc))
            staged[message.model] = placement
        if request.switch_id in self._aborted:
            return pb.PrepareResponse(ok=False, error=f"switch {request.switch_id} was aborted")
        # A switch staged but never committed is one the service gave up on (its Abort did not
        # arrive): the new Prepare replaces it, or this agent would refuse every later switch.
        stale = {
            s.staged.switch_id
            for s in self.moe.models.values()
            if s.staged is not None
            and s.staged.switch_id != request.switch_id
            and not s.staged.committed
        }
        for switch_id in sorted(stale):
            self._remember_abort(switch_id)
            self.moe.abort(switch_id)
            log.warning(
                "switch %s was staged but never committed; %s replaces it",
                switch_id,
                request.switch_id,
            )
        total = sum(
            moves(self.moe.models[name].placement, placement) for name, placement in staged.items()
        )
        started = self.group.clock.now()
        transfer = self.moe.stage(request.switch_id, staged, request.apply_at_step)
        await self._stage(transfer)  # weights copy in the background; decode goes on
        if self.group.dead:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "engine died while staging")
        if request.switch_id in self._aborted or not transfer.done:
            return pb.PrepareResponse(
                ok=False, error=f"switch {request.switch_id} was aborted while staging"
            )
        return pb.PrepareResponse(
            ok=True,
            staging_seconds=self.group.clock.now() - started,
            experts_to_copy=total,
            current_step=self.moe.step,
        )

    async def Commit(
        self,
        request: pb.CommitRequest,
        context: grpc.aio.ServicerContext[pb.CommitRequest, pb.CommitResponse],
    ) -> pb.CommitResponse:
        await self._authenticate(context, "Commit", switches=True)
        if self.group.dead:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "engine is dead")
        switches = [
            s.staged
            for s in self.moe.models.values()
            if s.staged is not None and s.staged.switch_id == request.switch_id
        ]
        if not switches or self.moe.staging(request.switch_id):
            return pb.CommitResponse(ok=False, error=f"switch {request.switch_id} is not staged")
        apply_at = max(self.moe.step, request.apply_at_step or switches[0].apply_at_step)
        for switch in switches:
            switch.apply_at_step = apply_at
            switch.committed = True
        return pb.CommitResponse(ok=True, apply_at_step=apply_at)

    async def Abort(
        self,
        request: pb.AbortRequest,
        context: grpc.aio.ServicerContext[pb.AbortRequest, pb.AbortResponse],
    ) -> pb.AbortResponse:
        await self._authenticate(context, "Abort", switches=True)
        self._remember_abort(request.switch_id)
        # A committed switch is dropped too until it takes effect (it is applied, and leaves
        # ``staged``, at its step): the service aborts every agent when one commit fails.
        dropped = self.moe.abort(request.switch_id)
        if dropped:
            log.info("switch %s aborted: %s", request.switch_id, request.reason)
        return pb.AbortResponse(ok=dropped)

    def _remember_abort(self, switch_id: str) -> None:
        self._aborted[switch_id] = None
        while len(self._aborted) > _REMEMBERED_ABORTS:
            del self._aborted[next(iter(self._aborted))]

    async def GetPlacement(
        self,
        request: pb.GetPlacementRequest,
        context: grpc.aio.ServicerContext[pb.GetPlacementRequest, pb.PlacementState],
    ) -> pb.PlacementState:
        await self._authenticate(context, "GetPlacement")
        return pb.PlacementState(
            placements=[
                encode_placement(name, s.placement, s.version)
                for name, s in self.moe.models.items()
            ],
            current_step=self.moe.step,
            pending=[
                pb.PendingSwitch(
                    model=name,
                    switch_id=s.staged.switch_id,
                    committed=s.staged.committed,
                    apply_at_step=s.staged.apply_at_step,
                )
                for name, s in self.moe.models.items()
                if s.staged is not None
            ],
        )


class EplbAgentServer:
    """The agent of one DP group, on its own gRPC port."""

    def __init__(
        self,
        group: DPGroup,
        host: str,
        port: int,
        *,
        token: str | None = None,
        insecure: bool = False,
        tls_cert: bytes | None = None,
        tls_key: bytes | None = None,
    ) -> None:
        if group.moe is None:
            raise ValueError("the EPLB agent needs --enable-expert-parallel")
        if token is not None and insecure:
            raise ValueError("an EPLB agent with a token cannot be insecure; pass one or the other")
        if (tls_cert is None) != (tls_key is None):
            raise ValueError("TLS needs both a certificate and its key")
        self.host = host
        self.port = port
        self._token, self._insecure = token is not None, insecure
        self._credentials = (
            grpc.ssl_server_credentials([(tls_key, tls_cert)]) if tls_cert and tls_key else None
        )
        self._server = grpc.aio.server()
        servicer = _Servicer(group, group.moe, token, insecure=insecure)
        pb_grpc.add_EplbAgentServicer_to_server(servicer, self._server)

    async def start(self) -> None:
        address = f"{self.host}:{self.port}"
        if self._credentials is not None:
            self._server.add_secure_port(address, self._credentials)
        else:
            self._server.add_insecure_port(address)
        await self._server.start()
        if self._token:
            log.info("EPLB agent on %s: every call needs its bearer token", address)
        elif self._insecure:
            log.warning(
                "EPLB agent on %s has no token and --eplb-agent-insecure: Prepare, Commit and "
                "Abort are open to anyone who can reach it",
                address,
            )
        else:
            log.warning(
                "EPLB agent on %s has no token: it refuses Prepare, Commit and Abort; give it "
                "--eplb-agent-token-file (or --eplb-agent-insecure for local tests)",
                address,
            )

    async def stop(self) -> None:
        await self._server.stop(grace=0.5)
