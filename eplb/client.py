"""A thin asyncio client of one EPLB agent (``protos/eplb_agent.proto``).

Adds the bearer token to every call (the agent requires it for Prepare, Commit and Abort), uses
TLS when given a CA bundle, puts a gRPC deadline on every unary call (the agent sees it, so a
Prepare that timed out is cancelled there too), and turns gRPC failures and ``ok: false``
answers into :mod:`eplb.errors`. Decisions live elsewhere.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import grpc

from baton.core.proto import eplb_agent_pb2 as pb
from baton.core.proto import eplb_agent_pb2_grpc as pb_grpc
from eplb.errors import AgentRejected, map_rpc_errors

__all__ = ["AgentClient"]


class AgentClient:
    """One agent at ``address`` (``host:port``)."""

    def __init__(self, address: str, *, token: str | None = None, tls_ca: bytes | None = None):
        self.address = address
        self._tls_ca = tls_ca
        self._metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self._channel: grpc.aio.Channel | None = None
        self._stub_instance: pb_grpc.EplbAgentStub | None = None

    @property
    def _stub(self) -> pb_grpc.EplbAgentStub:
        # A grpc.aio channel belongs to the event loop it is created on: create it on first use.
        # protoc's stub is unannotated: each call's reply is typed where it is received.
        if self._stub_instance is None:
            if self._tls_ca is not None:
                credentials = grpc.ssl_channel_credentials(root_certificates=self._tls_ca)
                self._channel = grpc.aio.secure_channel(self.address, credentials)
            else:
                self._channel = grpc.aio.insecure_channel(self.address)
            self._stub_instance = pb_grpc.EplbAgentStub(self._channel)
        return self._stub_instance

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
        self._channel = self._stub_instance = None

    async def describe(self, deadline: float) -> pb.AgentInfo:
        with map_rpc_errors(self.address):
            info: pb.AgentInfo = await self._stub.Describe(
                pb.DescribeRequest(), timeout=deadline, metadata=self._metadata
            )
            return info

    async def get_placement(self, deadline: float) -> pb.PlacementState:
        with map_rpc_errors(self.address):
            state: pb.PlacementState = await self._stub.GetPlacement(
                pb.GetPlacementRequest(), timeout=deadline, metadata=self._metadata
            )
            return state

    async def stream_load(self, steps_per_report: int) -> AsyncIterator[pb.LoadReport]:
        """Every rank's load reports, until the stream breaks (raises) or the caller stops."""
        call = self._stub.StreamLoad(
            pb.StreamLoadRequest(steps_per_report=steps_per_report), metadata=self._metadata
        )
        try:
            with map_rpc_errors(self.address):
                async for report in call:
                    yield report
        finally:
            call.cancel()

    async def prepare(
        self, switch_id: str, placements: Sequence[pb.Placement], deadline: float
    ) -> pb.PrepareResponse:
        with map_rpc_errors(self.address):
            reply: pb.PrepareResponse = await self._stub.Prepare(
                pb.PrepareRequest(switch_id=switch_id, placements=placements),
                timeout=deadline,
                metadata=self._metadata,
            )
        if not reply.ok:
            raise AgentRejected(self.address, f"Prepare {switch_id}: {reply.error}")
        return reply

    async def commit(self, switch_id: str, apply_at_step: int, deadline: float) -> int:
        """Commit; returns the step at which the agent switches."""
        with map_rpc_errors(self.address):
            reply: pb.CommitResponse = await self._stub.Commit(
                pb.CommitRequest(switch_id=switch_id, apply_at_step=apply_at_step),
                timeout=deadline,
                metadata=self._metadata,
            )
        if not reply.ok:
            raise AgentRejected(self.address, f"Commit {switch_id}: {reply.error}")
        return reply.apply_at_step

    async def abort(self, switch_id: str, reason: str, deadline: float) -> bool:
        """Abort; True when the agent dropped something it had staged."""
        with map_rpc_errors(self.address):
            reply: pb.AbortResponse = await self._stub.Abort(
                pb.AbortRequest(switch_id=switch_id, reason=reason),
                timeout=deadline,
                metadata=self._metadata,
            )
        return reply.ok
