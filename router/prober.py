"""The pool's eyes: health checks of every engine API server and syncs of its load, on the loop.

Every ``probe_interval_s`` the prober asks each server for ``/health`` (and, once up, its
``/v1/models``), and scrapes ``/metrics`` of those that passed for the load other gateway
replicas put on them; it records each outcome in the pool (``router/pool.py``), which decides
what it means. It also takes new sets of targets (``apply``: new engines are checked before
the pool routes to them) and holds the requests that wait for a decode rank below the pool's
bound (``decode_place``).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections import deque
from collections.abc import Awaitable, Callable, Sequence

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from router.pool import EngineLoad, Pool, Probe, Server
from router.targets import PoolCell

__all__ = ["ENGINE_LOAD_METRICS", "METRICS_PAGE_BYTES", "Prober", "engine_load"]

log = logging.getLogger("baton.gateway.pool")

# vLLM's per-engine gauges whose sum is the load a rank carries (the ``engine`` label is its
# global DP rank): requests, not tokens; vLLM exports no gauge of the prompt tokens it has yet to
# compute.
ENGINE_LOAD_METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting")
# The largest /metrics page read: a DEP32 decode server's four ranks are about 200 KB.
METRICS_PAGE_BYTES = 8 * 1024 * 1024
# Counters that move with every step an engine makes on running requests.
_PROGRESS_METRICS = ("vllm:prompt_tokens", "vllm:generation_tokens")


# The lines of the families read, with their TYPE lines (a counter's samples join their family
# by it); the rest of a page, mostly histogram buckets, is never parsed.
_READ_LINES = re.compile(
    r"^(?:# TYPE )?(?:vllm:cache_config_info|"
    + "|".join(re.escape(name) for name in (*ENGINE_LOAD_METRICS, *_PROGRESS_METRICS))
    + r")(?:_total)?[ {].*\n?",
    re.MULTILINE,
)
# A line that is neither blank, a comment nor a sample: a page that is not Prometheus text.
_NOT_A_SAMPLE = re.compile(
    r"^(?![ \t]*$|#|[a-zA-Z_:][a-zA-Z0-9_:]*(?:\{.*\})?[ \t]+(?:[-+]?[0-9.]|[-+]?Inf|NaN)).*$",
    re.MULTILINE,
)


def engine_load(text: str) -> EngineLoad:
    """One ``/metrics`` page of a vLLM API server, read for the load it reports; ValueError
    when it is not Prometheus text. Only the families read are parsed: a decode server's page is
    mostly histogram buckets, and parsed whole it cost the gateway 10-19 ms of CPU a page, every
    sync, for every server (docs/benchmarks.md, "The load sync's CPU")."""
    if (odd := _NOT_A_SAMPLE.search(text)) is not None:
        raise ValueError(f"a line that is no sample: {odd.group()[:80]!r}")
    requests: dict[str, int] = {}
    running = 0
    tokens = 0.0
    block_size = 0
    read = "".join(match.group() for match in _READ_LINES.finditer(text))
    for family in text_string_to_metric_families(read):
        if family.name == "vllm:cache_config_info":
            size = next(iter(family.samples)).labels.get("block_size", "") if family.samples else ""
            block_size = int(size) if size.isdigit() else 0
        if family.name in ENGINE_LOAD_METRICS:
            for sample in family.samples:
                engine = sample.labels.get("engine", "0")
                requests[engine] = requests.get(engine, 0) + int(sample.value)
                if family.name == "vllm:num_requests_running":
                    running += int(sample.value)
        elif family.name in _PROGRESS_METRICS:
            tokens += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return EngineLoad(requests, running, tokens, block_size)


class Prober:
    def __init__(
        self,
        pool: Pool,
        *,
        probe_interval_s: float,
        on_missed_probe: Callable[[str], None] | None = None,
        on_ejected: Callable[[str, str, bool], None] | None = None,
    ) -> None:
        """``probe_interval_s``: seconds between health checks, and between load syncs;
        ``on_missed_probe``: told the server's URL when a health check goes unanswered;
        ``on_ejected``: told the server's URL, why (``failed_health_check``,
        ``unanswered_health_checks``) and whether its pool is in panic, each time a health
        check round ejects a server."""
        self.pool = pool
        self.probe_interval_s = probe_interval_s
        self._on_missed_probe = on_missed_probe
        self._on_ejected = on_ejected
        self._session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._generation = 0  # of target sets handed to apply(), newest wins
        self._odd: set[str] = set()  # servers whose odd /metrics was told (until it is not)
        # requests waiting for a place under the decode bound, first come first placed
        self._waiting: deque[asyncio.Future[None]] = deque()
        pool.on_place_freed = self._wake_waiting

    async def start(self, session: aiohttp.ClientSession) -> None:
        """Probe every engine and take its load before serving: the first prefills then name
        their DP rank (each rank has a prefix cache of its own), as every later turn will."""
        self._session = session
        await self.check_health()
        await self.sync_load()
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._every(self.probe_interval_s, self.check_health)),
            loop.create_task(self._every(self.probe_interval_s, self.sync_load)),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def apply(self, cells: Sequence[PoolCell]) -> None:
        """Give the pool a new set of targets once its new engines have answered a health check
        (their health and model names known), so a changed pool never serves a moment with
        engines whose models are unknown. A newer set arriving meanwhile wins."""
        self._generation += 1
        generation = self._generation
        probed: dict[str, Server] = {}
        if self._session is not None:
            urls = {url for cell in cells for url in (*cell.prefill, *(d.url for d in cell.decode))}
            known = {server.url for server in self.pool.servers()}
            probed = {url: Server(url) for url in urls - known}
            await asyncio.gather(*(self._probe(server) for server in probed.values()))
        if generation == self._generation:
            self.pool.update(cells, probed)
            # their load and prefill DP ranks, without waiting for the next sync
            await asyncio.gather(*(self._sync_server(url) for url in probed))

    async def _every(self, interval: float, action: Callable[[], Awaitable[None]]) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await action()
            except Exception:  # a probe must never stop probing
                log.exception("pool background task failed")

    # ---- health

    async def check_health(self) -> None:
        await asyncio.gather(*(self._probe(server) for server in self.pool.servers()))
        for url, reason, panic in self.pool.end_health_round():
            if self._on_ejected is not None:
                self._on_ejected(url, reason, panic)

    async def _probe(self, server: Server) -> None:
        server.probes.append(self.pool.clock())
        probe = await self._ask(server)
        if not probe.answered and self._on_missed_probe is not None:
            self._on_missed_probe(server.url)
        self.pool.record_probe(server, probe)

    async def _ask(self, server: Server) -> Probe:
        assert self._session is not None
        timeout = aiohttp.ClientTimeout(total=max(1.0, self.probe_interval_s))
        try:
            async with self._session.get(f"{server.url}/health", timeout=timeout) as response:
                if response.status != 200:
                    return Probe(answered=True, up=False)
            if server.models:
                return Probe(answered=True, up=True)
            async with self._session.get(f"{server.url}/v1/models", timeout=timeout) as resp:
                if resp.status != 200:
                    # Healthy but refusing the gateway (vLLM's --api-key): unusable.
                    log.warning(
                        "%s answers /v1/models with %d; if it needs a key, give the gateway "
                        "--engine-api-key-file",
                        server.url,
                        resp.status,
                    )
                    return Probe(answered=True, up=False)
                cards = (await resp.json()).get("data", [])
                return Probe(
                    answered=True,
                    up=True,
                    models=tuple(card["id"] for card in cards),
                    context={
                        card["id"]: card["max_model_len"]
                        for card in cards
                        if isinstance(card.get("max_model_len"), int)
                    },
                )
        except TimeoutError:
            return Probe(answered=False)  # unanswered, not refused: the pool judges
        except (aiohttp.ClientError, ValueError, KeyError):
            return Probe(answered=True, refused=True)  # refused, reset or nonsense

    # ---- load

    async def sync_load(self) -> None:
        """Estimate the load other gateway replicas put on each target (decode rank, prefill
        instance) from what the engines report. The engines' count lags this gateway's (a
        request in handoff is not there yet), so it only adds to this gateway's exact count,
        never replaces it. The same scrape tells a stalled decode server (the pool's
        ``_judge_progress``)."""
        await asyncio.gather(*(self._sync_server(url) for url in self.pool.load_urls()))

    async def _sync_server(self, url: str) -> None:
        assert self._session is not None
        try:
            timeout = aiohttp.ClientTimeout(total=max(1.0, self.probe_interval_s))
            async with self._session.get(f"{url}/metrics", timeout=timeout) as response:
                status, page = response.status, bytearray()
                async for chunk in response.content.iter_chunked(1 << 16):
                    page += chunk
                    if len(page) > METRICS_PAGE_BYTES:
                        break
        except TimeoutError:
            self._odd_metrics(url, "leaves /metrics unanswered")
            return
        except aiohttp.ClientError:
            return  # the health checks judge an engine that refuses or resets
        self.pool.alive(url)  # it answered: busy perhaps, not gone
        if status != 200:
            self._odd_metrics(url, f"answers /metrics with HTTP {status}")
        elif len(page) > METRICS_PAGE_BYTES:
            self._odd_metrics(url, f"serves a /metrics page over {METRICS_PAGE_BYTES} bytes")
        else:
            try:
                load = engine_load(page.decode("utf-8", "replace"))
            except ValueError as exc:
                self._odd_metrics(
                    url, f"serves a /metrics page that is not Prometheus text ({exc})"
                )
                return
            self._odd.discard(url)
            self.pool.record_engine_load(url, load)

    def _odd_metrics(self, url: str, what: str) -> None:
        """One engine's odd /metrics is told once, and leaves its load unknown: never an error
        of the gateway's."""
        if url not in self._odd:
            self._odd.add(url)
            log.warning("%s %s; its load is unknown until it serves Prometheus text", url, what)

    # ---- admission

    def _wake_waiting(self) -> None:
        # One waiting request per place, each admitted here, so a freed place wakes one
        # request and not the whole queue (a request that gave up has left the queue).
        pool = self.pool
        while self._waiting and pool.has_place():
            pool.admit()
            self._waiting.popleft().set_result(None)

    async def decode_place(self, within_s: float) -> str:
        """Admission under the pool's ``max_requests_per_rank``: ``free`` when a place is there
        now and nobody waits for one (always, with no bound), ``waited`` when one was given to
        this request within ``within_s`` (a request ended or gave its place back, a load sync
        found other replicas' requests gone, a rank came back), else ``saturated``. Called
        before a request's prefill, so a request that cannot be placed holds no KV; a placed
        request holds its place (``Pool.admit``) until its decode begins or it ends."""
        pool = self.pool
        if not pool.max_requests_per_rank:
            return "free"
        if not self._waiting and pool.has_place():
            pool.admit()
            return "free"
        waiter = asyncio.get_running_loop().create_future()
        self._waiting.append(waiter)
        pool.waiting_for_place += 1
        placed = False
        try:
            await asyncio.wait_for(asyncio.shield(waiter), within_s)
            placed = True
        except TimeoutError:
            placed = waiter.done()  # placed as its time ran out
        finally:
            pool.waiting_for_place -= 1
            if not waiter.done():  # still in the queue: it leaves it, holding nothing
                self._waiting.remove(waiter)
            elif not placed:  # placed as the client left: the place goes on to the next
                pool.release_admission(placed=False)
        return "waited" if placed else "saturated"
