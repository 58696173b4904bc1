"""Errors of the EPLB service.

::

    EplbError
    ├── AgentError                 one agent's call failed (``address`` names the agent)
    │   ├── AgentUnavailable       the agent or its engine is down, or the connection broke
    │   ├── AgentTimeout           no answer within the call's deadline
    │   ├── AgentUnauthenticated   the agent refused our token (or we sent none)
    │   ├── AgentRejected          the agent answered ``ok: false`` or refused the arguments
    │   └── AgentRestarted         the agent's engine restarted (its incarnation changed)
    └── GroupMismatch              a decode group's agents disagree (ranks, models, placement)

:func:`map_rpc_errors` turns gRPC's exceptions into these at the client boundary, so the rest of
the service never sees ``grpc`` types.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import grpc

__all__ = [
    "AgentError",
    "AgentRejected",
    "AgentRestarted",
    "AgentTimeout",
    "AgentUnauthenticated",
    "AgentUnavailable",
    "EplbError",
    "GroupMismatch",
    "map_rpc_errors",
]


class EplbError(Exception):
    """Base of every error the EPLB service raises on purpose."""


class AgentError(EplbError):
    """A call to the agent at ``address`` failed."""

    def __init__(self, address: str, message: str) -> None:
        super().__init__(f"agent {address}: {message}")
        self.address = address


class AgentUnavailable(AgentError):
    """Raised when the agent cannot be reached or its engine is dead (gRPC UNAVAILABLE)."""


class AgentTimeout(AgentError):
    """Raised when the agent does not answer within the deadline (a hung or stalled rank)."""


class AgentUnauthenticated(AgentError):
    """Raised when the agent refuses the token: check --token-file against the agent's Secret."""


class AgentRejected(AgentError):
    """Raised when the agent refuses the request: a malformed placement, a switch in progress."""


class AgentRestarted(AgentError):
    """Raised when an agent reports a new incarnation: its engine restarted, the window is void."""


class GroupMismatch(EplbError):
    """Raised when a decode group's agents do not describe one consistent DP group."""


_BY_STATUS: dict[grpc.StatusCode, type[AgentError]] = {
    grpc.StatusCode.UNAVAILABLE: AgentUnavailable,
    grpc.StatusCode.CANCELLED: AgentUnavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: AgentTimeout,
    grpc.StatusCode.UNAUTHENTICATED: AgentUnauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: AgentUnauthenticated,
}


@contextmanager
def map_rpc_errors(address: str) -> Iterator[None]:
    """Re-raise gRPC errors of calls to ``address`` as :class:`AgentError` subclasses."""
    try:
        yield
    except grpc.aio.AioRpcError as exc:
        kind = _BY_STATUS.get(exc.code(), AgentRejected)
        raise kind(address, f"{exc.code().name}: {exc.details()}") from exc
