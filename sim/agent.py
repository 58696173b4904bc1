"""The simulated engine's EPLB agent: the gRPC side of ``protos/eplb_agent.proto``.

It streams the group's per-step expert load (each rank's own physical experts, as compact
little-endian uint32 bytes) and takes two-phase placement switches from the EPLB service:
Prepare validates and stages (weights copied in simulated background time while decode goes on),
Commit makes the switch happen at the agreed step, Abort drops what was staged. A malformed
placement is rejected before anything is staged.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator

import grpc
import numpy as np

from baton.proto import eplb_agent_pb2 as pb
from baton.proto import eplb_agent_pb2_grpc as pb_grpc
from controller.eplb.algorithm import Placement, moves_per_rank
from sim.engine import DPGroup
from sim.moe import MoERuntime, StagedSwitch

__all__ = ["EplbAgentServer", "decode_placement", "encode_placement"]

log = logging.getLogger("baton.sim.agent")
DEFAULT_STEPS_PER_REPORT = 100
_QUEUE_REPORTS = 4096


def encode_placement(name: str, placement: Placement, version: int = 0) -> pb.Placement:
    return pb.Placement(
        model=name,
        layers=placement.num_layers,
        physical_experts=placement.phy2log.shape[1],
        phy2log=placement.phy2log.astype("<i4").tobytes(),
        version=version,
    )


def decode_placement(message: pb.Placement, num_ranks: int, num_logical: int) -> Placement:
    """Rebuild and check a placement; ValueError names what is wrong."""
    expected = message.layers * message.physical_experts * 4
    if len(message.phy2log) != expected:
        raise ValueError(
            f"{message.model}: phy2log has {len(message.phy2log)} bytes, expected "
            f"{expected} for [{message.layers}, {message.physical_experts}] int32"
        )
    phy2log = np.frombuffer(message.phy2log, dtype="<i4").astype(np.int64)
    phy2log = phy2log.reshape(message.layers, message.physical_experts)
    if phy2log.min(initial=0) < 0 or phy2log.max(initial=0) >= num_logical:
        raise ValueError(f"{message.model}: phy2log names an expert outside [0, {num_logical})")
    held = np.zeros((message.layers, num_logical), dtype=bool)
    held[np.arange(message.layers)[:, None], phy2log] = True
    if not held.all():
        layer, expert = np.argwhere(~held)[0]
        raise ValueError(
            f"{message.model}: logical expert {expert} has no replica in layer {layer}"
        )
    return Placement(phy2log, num_ranks, num_logical)


class _Servicer(pb_grpc.EplbAgentServicer):
    def __init__(self, group: DPGroup, moe: MoERuntime) -> None:
        self.group = group
        self.moe = moe
        self.incarnation = uuid.uuid4().hex

    async def Describe(
        self, request: pb.DescribeRequest, context: grpc.aio.ServicerContext
    ) -> pb.AgentInfo:
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
        self, request: pb.StreamLoadRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.LoadReport]:
        ranks = list(request.dp_ranks) or sorted(self.group.ranks)
        unknown = set(ranks) - set(self.group.ranks)
        if unknown:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, f"ranks {sorted(unknown)} are not served here"
            )
        per_report = request.steps_per_report or DEFAULT_STEPS_PER_REPORT
        queue: asyncio.Queue[pb.LoadReport] = asyncio.Queue(_QUEUE_REPORTS)
        buffers: dict[str, tuple[int, int, list[np.ndarray]]] = {}

        def listen(model: str, step: int, physical: np.ndarray, version: int) -> None:
            first, buffered_version, steps = buffers.get(model, (step, version, []))
            if steps and (step != first + len(steps) or version != buffered_version):
                self._flush(queue, model, first, buffered_version, steps, ranks)
                first, buffered_version, steps = step, version, []
            steps.append(physical)
            buffers[model] = (first, buffered_version, steps)
            if len(steps) >= per_report:
                self._flush(queue, model, first, buffered_version, steps, ranks)
                del buffers[model]

        self.moe.listeners.append(listen)
        try:
            while True:
                try:
                    report = await asyncio.wait_for(queue.get(), timeout=1.0)
                except TimeoutError:
                    if self.group.dead:
                        await context.abort(grpc.StatusCode.UNAVAILABLE, "engine is dead")
                    continue
                yield report
        finally:
            self.moe.listeners.remove(listen)

    def _flush(
        self,
        queue: asyncio.Queue[pb.LoadReport],
        model: str,
        first: int,
        version: int,
        steps: list[np.ndarray],
        ranks: list[int],
    ) -> None:
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
                log.warning(
                    "load subscriber too slow; dropped %s steps %d+ of rank %d", model, first, rank
                )

    async def Prepare(
        self, request: pb.PrepareRequest, context: grpc.aio.ServicerContext
    ) -> pb.PrepareResponse:
        if self.group.dead:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "engine is dead")
        staged: dict[str, tuple[Placement, int]] = {}
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
            if state.staged is not None and state.staged.switch_id != request.switch_id:
                return pb.PrepareResponse(
                    ok=False,
                    error=(
                        f"{message.model}: switch {state.staged.switch_id} is already "
                        "staged; abort it first"
                    ),
                )
            try:
                placement = decode_placement(
                    message, self.moe.num_ranks, current.num_logical_experts
                )
            except ValueError as exc:
                return pb.PrepareResponse(ok=False, error=str(exc))
            staged[message.model] = (
                placement,
                int(moves_per_rank(current, placement).sum(axis=0).max()),
            )
        copies = max((worst for _, worst in staged.values()), default=0)
        profile = self.group.config.profile
        seconds = copies * profile.decode.expert_bytes / profile.nvlink.bandwidth_bytes_per_s
        await self.group.clock.sleep(seconds)  # weights stage in the background; decode goes on
        if self.group.dead:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "engine died while staging")
        total = 0
        for name, (placement, _) in staged.items():
            self.moe.models[name].staged = StagedSwitch(
                request.switch_id, placement, request.apply_at_step
            )
            total += int(moves_per_rank(self.moe.models[name].placement, placement).sum())
        return pb.PrepareResponse(ok=True, staging_seconds=seconds, experts_to_copy=total)

    async def Commit(
        self, request: pb.CommitRequest, context: grpc.aio.ServicerContext
    ) -> pb.CommitResponse:
        if self.group.dead:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "engine is dead")
        switches = [
            s.staged
            for s in self.moe.models.values()
            if s.staged is not None and s.staged.switch_id == request.switch_id
        ]
        if not switches:
            return pb.CommitResponse(ok=False, error=f"switch {request.switch_id} is not staged")
        apply_at = max(self.moe.step, switches[0].apply_at_step)
        for switch in switches:
            switch.apply_at_step = apply_at
            switch.committed = True
        return pb.CommitResponse(ok=True, apply_at_step=apply_at)

    async def Abort(
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> pb.AbortResponse:
        dropped = False
        for state in self.moe.models.values():
            if (
                state.staged is not None
                and state.staged.switch_id == request.switch_id
                and not state.staged.committed
            ):
                state.staged = None
                dropped = True
        if dropped:
            log.info("switch %s aborted: %s", request.switch_id, request.reason)
        return pb.AbortResponse(ok=dropped)

    async def GetPlacement(
        self, request: pb.GetPlacementRequest, context: grpc.aio.ServicerContext
    ) -> pb.PlacementState:
        return pb.PlacementState(
            placements=[
                encode_placement(name, s.placement, s.version)
                for name, s in self.moe.models.items()
            ],
            current_step=self.moe.step,
        )


class EplbAgentServer:
    """The agent of one DP group, on its own gRPC port."""

    def __init__(self, group: DPGroup, host: str, port: int) -> None:
        if group.moe is None:
            raise ValueError("the EPLB agent needs --enable-expert-parallel")
        self.host = host
        self.port = port
        self._server = grpc.aio.server()
        pb_grpc.add_EplbAgentServicer_to_server(_Servicer(group, group.moe), self._server)

    async def start(self) -> None:
        self._server.add_insecure_port(f"{self.host}:{self.port}")
        await self._server.start()

    async def stop(self) -> None:
        await self._server.stop(grace=0.5)
