"""NIXL-style KV handoff between simulator processes (NixlConnector, pull mode).

Prefill side: a request sent with ``kv_transfer_params.do_remote_decode`` keeps its KV blocks
after it finishes, under a lease of ``kv_lease_duration`` (30 s by default) that the decode
side's heartbeats extend by two thirds of it; a read or an expiry frees them, and an expiry
counts ``vllm:nixl_num_kv_expired_reqs``. The side channel listens on the base port plus the
rank's local DP index, as vLLM's does.

Decode side: a request carrying ``do_remote_prefill`` pulls the blocks it lacks over the side
channel (a real HTTP call to the prefill process), then waits the transfer time the profile
gives for the bytes moved, in simulated seconds. A failed pull fails the request (policy "fail",
HTTP 500) or prefills it locally (policy "recompute").

The side channel's messages (JSON over HTTP, paths under ``/nixl``): ``read`` (take the blocks
of one request; frees them), ``heartbeat`` (extend leases) and ``free`` (the decode side gave up).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

from sim.config import EngineConfig
from sim.engine import DPGroup
from sim.request import FinishReason, RequestFailed, SimRequest
from sim.stats import NIXL_BYTES_BUCKETS, NIXL_DESCRIPTOR_BUCKETS, NIXL_TIME_BUCKETS, Buckets

__all__ = ["NixlSide", "NixlStats"]

log = logging.getLogger("baton.sim.nixl")


@dataclass(slots=True)
class NixlStats:
    """Per-rank counters and observations behind the ``vllm:nixl_*`` metrics."""

    failed_transfers: int = 0
    failed_notifications: int = 0
    expired_requests: int = 0
    notifications_after_expiry: int = 0
    xfer_time: Buckets = field(default_factory=lambda: Buckets(NIXL_TIME_BUCKETS))
    bytes_transferred: Buckets = field(default_factory=lambda: Buckets(NIXL_BYTES_BUCKETS))
    descriptors: Buckets = field(default_factory=lambda: Buckets(NIXL_DESCRIPTOR_BUCKETS))


@dataclass(slots=True, eq=False)
class _Lease:
    request: SimRequest
    expires_at: float
    timer: asyncio.TimerHandle | None = None


class NixlSide:
    """The NIXL side channel and pull logic of one API server's local ranks."""

    def __init__(self, config: EngineConfig, group: DPGroup, local_ranks: range) -> None:
        self.config = config
        self.group = group
        self.local_ranks = local_ranks
        self.stats = {rank: NixlStats() for rank in local_ranks}
        self.lose_next_reads = 0  # fault injection: the next reads find their KV lost
        self._leases: dict[str, _Lease] = {}
        self._expired: set[str] = set()
        self._lost: set[str] = set()  # leases a fault dropped: their one read fails
        self._runners: list[web.AppRunner] = []
        self._session: aiohttp.ClientSession | None = None
        self._heartbeat_task: asyncio.Task[None] | None = None
        group.on_finished.append(self._on_finished)

    # ---- lifecycle

    def port_of(self, dp_rank: int) -> int:
        return self.config.side_channel_port + (dp_rank - self.local_ranks.start)

    async def start(self, host: str) -> None:
        app = web.Application()
        app.router.add_post("/nixl/read", self._handle_read)
        app.router.add_post("/nixl/heartbeat", self._handle_heartbeat)
        app.router.add_post("/nixl/free", self._handle_free)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        for rank in self.local_ranks:
            await web.TCPSite(runner, host, self.port_of(rank)).start()
        self._runners.append(runner)
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
        self._heartbeat_task = asyncio.get_running_loop().create_task(self._heartbeats())
        log.info(
            "NIXL side channel of engine %s (DP ranks %d-%d) on %s:%d",
            self.config.kv_transfer.engine_id,
            self.local_ranks.start,
            self.local_ranks.stop - 1,
            host,
            self.port_of(self.local_ranks.start),
        )

    async def stop(self) -> None:
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
            await asyncio.gather(self._heartbeat_task, return_exceptions=True)
        for lease in self._leases.values():
            if lease.timer is not None:
                lease.timer.cancel()
        for runner in self._runners:
            await runner.cleanup()
        if self._session is not None:
            await self._session.close()

    # ---- prefill side

    def transfer_params(self, request: SimRequest) -> dict[str, object]:
        """The ``kv_transfer_params`` a prefill response carries (vLLM 0.33, pull mode)."""
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [list(request.kv_block_ids)],
            "remote_engine_id": f"{self.config.kv_transfer.engine_id}_dp{request.dp_rank}",
            "remote_request_id": request.request_id,
            "remote_host": self.config.side_channel_host,
            "remote_port": self.port_of(request.dp_rank),
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": request.prompt_tokens,
            "remote_blocks_expiry_time": None,
            "remote_registration_generation": 0,
            "transfer_mode": "pull",
        }

    def _on_finished(self, request: SimRequest) -> None:
        if request.dp_rank not in self.local_ranks:
            return  # another API server of this group owns that rank's side channel
        if not request.do_remote_decode or request.allocation is None:
            return
        # vLLM holds only for a normal finish; an abort or error frees at once.
        if request.finish_reason not in (FinishReason.STOP, FinishReason.LENGTH):
            return
        request.kv_block_ids = list(request.allocation.block_ids)
        lease = _Lease(request, self.group.clock.now() + self.config.kv_transfer.lease_duration_s)
        self._leases[request.request_id] = lease
        self._arm(lease)

    def _arm(self, lease: _Lease) -> None:
        if lease.timer is not None:
            lease.timer.cancel()
        delay = (lease.expires_at - self.group.clock.now()) * self.group.sim_clock.time_scale
        lease.timer = asyncio.get_running_loop().call_later(max(0.0, delay), self._expire, lease)

    def _expire(self, lease: _Lease) -> None:
        request = lease.request
        if self._leases.pop(request.request_id, None) is None:
            return
        self._release(request)
        self._expired.add(request.request_id)
        self.stats[request.dp_rank].expired_requests += 1
        log.info(
            "Releasing expired KV blocks for request %s which were retrieved by 0 remote "
            "worker(s) before lease expired",
            request.request_id,
        )

    def _release(self, request: SimRequest) -> None:
        allocation = request.allocation
        if allocation is not None:
            self.group.ranks[request.dp_rank].cache.free(allocation)
        request.kv_block_ids = []

    def held_blocks(self, rank: int) -> int:
        """Blocks rank ``rank`` pins for remote decodes, not yet pulled, freed or expired."""
        return sum(
            len(lease.request.kv_block_ids)
            for lease in self._leases.values()
            if lease.request.dp_rank == rank
        )

    def drop_all(self) -> None:
        """Fault: forget every held lease, as if the KV were lost: their reads fail."""
        for request_id in list(self._leases):
            self._lost.add(request_id)
            lease = self._leases.pop(request_id)
            if lease.timer is not None:
                lease.timer.cancel()
            self._release(lease.request)

    async def _handle_read(self, http: web.Request) -> web.Response:
        body = await http.json()
        request_id = str(body.get("request_id"))
        lease = self._leases.get(request_id)
        lost = request_id in self._lost or (lease is not None and self.lose_next_reads > 0)
        self._lost.discard(request_id)
        if lease is not None and lost:
            self.lose_next_reads -= 1
            self._leases.pop(request_id)
            if lease.timer is not None:
                lease.timer.cancel()
            self._release(lease.request)
            lease = None
        ours = {f"{self.config.kv_transfer.engine_id}_dp{rank}" for rank in self.local_ranks}
        if lease is None and lost:
            return web.json_response({"error": f"KV blocks of {request_id} lost"}, status=404)
        if lease is None and body.get("engine_id") in ours:
            # A replayed, expired or unknown handoff: vLLM's decode engine reads the registered
            # blocks whatever they now hold and finishes 200; only the prefill side's
            # notification finds no request.
            self._note_after_expiry(request_id)
            tokens = int(body.get("tokens", 0))
            moved = tokens * self.config.profile.kv_bytes_per_token
            return web.json_response({"bytes": moved, "blocks": _blocks(body.get("block_ids"))})
        expected = lease and f"{self.config.kv_transfer.engine_id}_dp{lease.request.dp_rank}"
        if (
            lease is None
            or body.get("engine_id") != expected
            or body.get("block_ids") != [lease.request.kv_block_ids]
        ):
            return web.json_response(
                {"error": f"no KV blocks held for request {request_id}"}, status=404
            )
        del self._leases[request_id]
        if lease.timer is not None:
            lease.timer.cancel()
        tokens = int(body.get("tokens", lease.request.prompt_tokens))
        blocks = len(lease.request.kv_block_ids)
        self._release(lease.request)
        return web.json_response(
            {"bytes": tokens * self.config.profile.kv_bytes_per_token, "blocks": blocks}
        )

    async def _handle_heartbeat(self, http: web.Request) -> web.Response:
        body = await http.json()
        extension = self.config.kv_transfer.lease_duration_s * 2 / 3
        now = self.group.clock.now()
        for request_id in body.get("request_ids", []):
            lease = self._leases.get(request_id)
            if lease is None:
                self._note_after_expiry(request_id)
                continue
            lease.expires_at = max(lease.expires_at, now + extension)
            self._arm(lease)
        return web.json_response({})

    async def _handle_free(self, http: web.Request) -> web.Response:
        body = await http.json()
        for request_id in body.get("request_ids", []):
            lease = self._leases.pop(request_id, None)
            if lease is not None:
                if lease.timer is not None:
                    lease.timer.cancel()
                self._release(lease.request)
        return web.json_response({})

    def _note_after_expiry(self, request_id: str) -> None:
        if request_id in self._expired:
            rank = next(iter(self.stats))
            self.stats[rank].notifications_after_expiry += 1

    # ---- decode side

    async def pull(self, request: SimRequest) -> None:
        """Fetch the prompt's KV from the prefill engine named in ``kv_transfer_params``."""
        params: Mapping[str, object] = request.remote_prefill or {}
        rank = self.group.ranks[request.dp_rank]
        stats = self.stats[request.dp_rank]
        missing = request.prompt_tokens - request.cached_tokens
        block_ids = params.get("remote_block_ids")
        size = self.config.block_size
        needed = -(-request.prompt_tokens // size) - request.cached_tokens // size
        if isinstance(block_ids, list) and any(
            isinstance(group, list) and len(group) < needed for group in block_ids
        ):
            # vLLM's decode worker asserts that the prefill side holds every block it
            # allocated (_apply_prefix_caching); the engine core dies with it.
            log.error(
                "AssertionError: %d decode blocks but %s from the prefill side: engine dead",
                needed,
                block_ids,
            )
            self.group.kill()
            return
        try:
            while rank.stalled_until > self.group.clock.now():  # a stalled rank loads nothing
                await self.group.sim_clock.sleep(rank.stalled_until - self.group.clock.now())
            url = f"http://{params['remote_host']}:{params['remote_port']}/nixl/read"
            payload = {
                "request_id": params.get("remote_request_id"),
                "engine_id": params.get("remote_engine_id"),
                "block_ids": block_ids,
                "tokens": missing,
            }
            assert self._session is not None
            async with self._session.post(url, json=payload) as response:
                if response.status != 200:
                    raise RequestFailed(
                        500,
                        f"KV transfer from {params.get('remote_engine_id')} "
                        f"failed: {(await response.json()).get('error')}",
                    )
                moved = int((await response.json())["bytes"])
        except asyncio.CancelledError:
            raise
        except (RequestFailed, aiohttp.ClientError, KeyError, ValueError, TimeoutError) as exc:
            stats.failed_transfers += 1
            self._on_pull_failed(request, exc)
            return
        nvlink = self.config.profile.nvlink
        seconds = nvlink.latency_s + moved / nvlink.bandwidth_bytes_per_s
        await self.group.sim_clock.sleep(seconds)
        if request.finished:
            return
        blocks = _blocks(block_ids)
        log.debug(
            "KV of request %s pulled from engine %s: %d blocks",
            request.request_id,
            params.get("remote_engine_id"),
            blocks,
        )
        stats.xfer_time.observe(seconds)
        stats.bytes_transferred.observe(moved)
        stats.descriptors.observe(blocks)
        request.external_tokens = missing
        request.num_computed = request.prompt_tokens
        # vLLM's decode engine reports every prompt token as cached: it computed none.
        request.cached_tokens = request.prompt_tokens
        assert request.allocation is not None  # a request waits for its KV with its blocks held
        self.group.ranks[request.dp_rank].cache.register(
            request.allocation, request.hashes, request.num_computed, request.prompt
        )
        self.group.admit_loaded(request)

    def _on_pull_failed(self, request: SimRequest, exc: Exception) -> None:
        if request.finished:
            return
        if self.config.kv_transfer.kv_load_failure_policy == "recompute":
            log.warning("KV load for %s failed (%s); recomputing locally", request.request_id, exc)
            self.group.requeue_for_recompute(request)
            return
        failure = (
            exc
            if isinstance(exc, RequestFailed)
            else RequestFailed(500, f"KV transfer for request {request.request_id} failed: {exc}")
        )
        self.group.finish(request, FinishReason.ERROR, failure)

    async def notify_free(self, request: SimRequest) -> None:
        """The decode side dropped a request before pulling: let the prefill side free at once."""
        params = request.remote_prefill or {}
        if self._session is None or "remote_host" not in params:
            return
        url = f"http://{params['remote_host']}:{params['remote_port']}/nixl/free"
        try:
            async with self._session.post(
                url, json={"request_ids": [params.get("remote_request_id")]}
            ):
                pass
        except aiohttp.ClientError:
            self.stats[request.dp_rank].failed_notifications += 1

    def pending_pulls(self) -> dict[tuple[str, int], list[str]]:
        """Remote request ids this server still waits for, by prefill side channel."""
        pending: dict[tuple[str, int], list[str]] = {}
        for rank_id in self.local_ranks:
            for request in self.group.ranks[rank_id].loading:
                params = request.remote_prefill or {}
                port = params.get("remote_port")
                key = (str(params.get("remote_host")), port if isinstance(port, int) else 0)
                pending.setdefault(key, []).append(str(params.get("remote_request_id")))
        return pending

    async def _heartbeats(self) -> None:
        interval = self.config.kv_transfer.lease_duration_s / 6
        while True:
            await self.group.sim_clock.sleep(interval)
            for (host, port), request_ids in self.pending_pulls().items():
                try:
                    assert self._session is not None
                    async with self._session.post(
                        f"http://{host}:{port}/nixl/heartbeat", json={"request_ids": request_ids}
                    ):
                        pass
                except aiohttp.ClientError:
                    for rank in self.stats.values():
                        rank.failed_notifications += 1
                        break


def _blocks(block_ids: object) -> int:
    """Block ids in a ``kv_transfer_params.remote_block_ids`` (one list per KV-cache group)."""
    if not isinstance(block_ids, list):
        return 0
    return sum(len(group) for group in block_ids if isinstance(group, list))
