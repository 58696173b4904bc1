"""Fault injection for tests and failure drills.

``POST /sim/faults`` exists only with ``--enable-fault-injection``, which needs
``--fault-injection-token-file FILE``: every call must carry ``Authorization: Bearer <token>``
(compared in constant time; else 401), so an engine reachable by others cannot be killed by
them. The body is one of:

- ``{"action": "kill", "rank": r}``: rank r dies; a wide-EP group cannot lose a rank, so the
  whole group fails its requests and ``/health`` answers 503 (vLLM's EngineDeadError).
- ``{"action": "stall", "rank": r, "seconds": s}``: rank r stops for s simulated seconds; the
  lockstep group stalls with it, and its KV pulls wait.
- ``{"action": "fail_requests", "count": n, "status": code}``: the next n generation requests
  get ``code`` with vLLM's error body.
- ``{"action": "drop_kv", "count": n}``: every KV block held for a remote decode now is lost,
  and so are the next n handoffs' blocks when their decode side comes to pull them.
- ``{"action": "freeze", "seconds": s}``: right after answering, the API server's process
  stops serving for s wall seconds (its event loop is busy), as an API server tokenizing a huge
  prompt or paused by the host does: requests and health checks wait, nothing fails. In
  ``--cluster`` mode every engine of the process freezes with it.
- ``{"action": "slow", "factor": f, "seconds": s}``: for s simulated seconds every step of the
  group takes f times as long (a throttled or degraded GPU): requests progress, slowly.
- ``{"action": "throttle", "rank": r, "share": c, "seconds": s}``: for s simulated seconds rank
  r's GPU runs at share c of its nominal SM clock (heat or a power cap): its compute takes 1/c
  as long and, in lockstep, so does every MoE layer of the group; the DCGM exporter
  (``--dcgm-port``) shows the lower clock and a thermal clock-event reason.
- ``{"action": "nvlink_errors", "rank": r, "rate": n, "factor": f, "seconds": s}``: for s
  simulated seconds rank r's GPU's NVLinks fail n times a second (CRC errors, each replayed),
  and every step of the group takes f times as long (the MoE all-to-all waits for the replays,
  in lockstep); the clocks stay as they are, and the DCGM exporter's NVLink error counters of
  that GPU climb.
- ``{"action": "late_health", "delay": d, "seconds": s}``: for s wall seconds ``/health``
  answers d seconds late, while requests and ``/metrics`` are served as before (a loaded host
  whose probes time out while the engine keeps streaming).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import time
from typing import Annotated, Literal

from aiohttp import web
from pydantic import BaseModel, Field, ValidationError

from sim.engine import DPGroup
from sim.nixl import NixlSide
from sim.protocol import error_body, validation_message

__all__ = ["FaultInjector"]


class _Fault(BaseModel):
    action: Literal[
        "kill",
        "stall",
        "fail_requests",
        "drop_kv",
        "freeze",
        "slow",
        "throttle",
        "nvlink_errors",
        "late_health",
    ]
    rank: int | None = None
    seconds: Annotated[float, Field(gt=0)] = 1.0
    factor: Annotated[float, Field(ge=1)] = 10.0  # slow; nvlink_errors: 1.3
    rate: Annotated[float, Field(gt=0)] = 100.0  # nvlink_errors: errors a second
    share: Annotated[float, Field(gt=0, le=1)] = 0.7  # throttle
    delay: Annotated[float, Field(gt=0, le=60)] = 2.0  # late_health
    count: Annotated[int, Field(ge=0)] | None = None  # fail_requests: 1; drop_kv: 0
    status: Annotated[int, Field(ge=400, le=599)] = 500


class FaultInjector:
    def __init__(self, group: DPGroup, nixl: NixlSide, local_ranks: range, token: str) -> None:
        self.group = group
        self.nixl = nixl
        self.local_ranks = local_ranks
        self._token_digest = hashlib.sha256(token.encode()).digest()
        self._failures: list[int] = []
        self._late_health: tuple[float, float] = (0.0, 0.0)  # (until, delay), monotonic

    def health_delay(self) -> float:
        """How late ``/health`` answers now (late_health), in seconds."""
        until, delay = self._late_health
        return delay if time.monotonic() < until else 0.0

    def _authorized(self, http: web.Request) -> bool:
        scheme, _, presented = http.headers.get("Authorization", "").partition(" ")
        digest = hashlib.sha256(presented.encode()).digest()
        return scheme.lower() == "bearer" and hmac.compare_digest(digest, self._token_digest)

    def take_failure(self) -> int | None:
        """The status to fail the next request with, if a failure is queued."""
        return self._failures.pop(0) if self._failures else None

    async def handle(self, http: web.Request) -> web.Response:
        if not self._authorized(http):
            return web.Response(
                status=401,
                content_type="application/json",
                body=error_body(
                    401,
                    "POST /sim/faults needs 'Authorization: Bearer <token>' with the token of "
                    "--fault-injection-token-file",
                ),
            )
        try:
            fault = _Fault.model_validate_json(await http.read())
        except ValidationError as exc:
            message, param = validation_message(exc)
            return web.Response(
                status=400, body=error_body(400, message, param), content_type="application/json"
            )
        rank = fault.rank if fault.rank is not None else self.local_ranks.start
        if rank not in self.group.ranks:
            return web.Response(
                status=400,
                content_type="application/json",
                body=error_body(
                    400, f"rank {rank} is not in this DP group ({sorted(self.group.ranks)})", "rank"
                ),
            )
        if fault.action == "kill":
            self.group.kill()
        elif fault.action == "stall":
            self.group.ranks[rank].stalled_until = self.group.clock.now() + fault.seconds
        elif fault.action == "freeze":
            # after the answer is written: the caller learns the fault is on before it bites
            asyncio.get_running_loop().call_later(0.05, time.sleep, fault.seconds)
        elif fault.action == "slow":
            self.group.slow_factor = fault.factor
            self.group.slow_until = self.group.clock.now() + fault.seconds
        elif fault.action == "throttle":
            throttled = self.group.ranks[rank]
            throttled.clock_share = fault.share
            throttled.clock_until = self.group.clock.now() + fault.seconds
        elif fault.action == "nvlink_errors":
            now = self.group.clock.now()
            self.group.ranks[rank].fail_links(now, fault.rate, fault.seconds)
            if "factor" not in fault.model_fields_set:
                fault.factor = 1.3
            self.group.slow_factor = fault.factor
            self.group.slow_until = now + fault.seconds
        elif fault.action == "late_health":
            self._late_health = (time.monotonic() + fault.seconds, fault.delay)
        elif fault.action == "fail_requests":
            self._failures.extend([fault.status] * (1 if fault.count is None else fault.count))
        else:
            self.nixl.drop_all()
            self.nixl.lose_next_reads = fault.count or 0
        return web.json_response({"applied": fault.model_dump()})
