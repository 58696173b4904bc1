"""The gateway's pool: prefill instances and decode ranks by cell, their health and their load.

The pool owns every piece of mutable routing state: which targets are healthy (active checks of
``/health`` plus passive ejection by a circuit breaker) and which of them it routes to (all but
the dead while a role's pool is in panic), how many requests and uncached prompt
tokens this gateway has in flight at each target, which prompt prefixes each prefill DP rank was
sent (``router/prefix.py``), and every few seconds the load other
gateway replicas put on each target: the engines' own ``vllm:num_requests_running`` plus
``vllm:num_requests_waiting`` less this gateway's share (so several replicas converge on the same
view while each keeps its own count exact). It hands out immutable :class:`PoolSnapshot` objects
for the pure policy to choose over.

Targets come as cells: from flags or a YAML pool file (:class:`PoolSpec`, reloaded when it
changes) or from a ModelDeployment's status (``router/discovery.py``): set at start through
``update``, changed later through ``apply``, which health-checks new engines first.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from baton.core.files import load_yaml_model
from router.policy import DecodeRankView, PoolSnapshot, PrefillView
from router.prefix import BLOCK_TOKENS, PrefixIndex

__all__ = [
    "ENGINE_LOAD_METRICS",
    "METRICS_PAGE_BYTES",
    "MISSED_PROBES",
    "PANIC_THRESHOLD",
    "STALL_AFTER_S",
    "Breaker",
    "DecodeServerSpec",
    "Pool",
    "PoolCell",
    "PoolSpec",
    "engine_url",
    "load_pool_file",
    "parse_decode_flag",
]

log = logging.getLogger("baton.gateway.pool")

# vLLM's per-engine gauges whose sum is the load a rank carries (the ``engine`` label is its
# global DP rank): requests, not tokens; vLLM exports no gauge of the prompt tokens it has yet to
# compute.
ENGINE_LOAD_METRICS = ("vllm:num_requests_running", "vllm:num_requests_waiting")
# This gateway's mean uncached tokens per prefill, which prices other replicas' prefills: the
# plain mean of its first prefills, then a moving mean over about this many.
_MEAN_PREFILLS = 1024
# The largest /metrics page read: a DEP32 decode server's four ranks are about 200 KB.
METRICS_PAGE_BYTES = 8 * 1024 * 1024
# Counters that move with every step an engine makes on running requests.
_PROGRESS_METRICS = ("vllm:prompt_tokens", "vllm:generation_tokens")


def engine_url(url: str) -> str:
    """An engine's base URL: plain HTTP, as vLLM serves on the cluster network. The engines'
    client speaks no TLS, so an https URL is refused here rather than failing every request."""
    if url.startswith("https://"):
        raise ValueError(
            f"'{url}': engines are reached over plain HTTP (the gateway speaks no TLS to "
            "engines); use http://, and a service mesh where the network needs encryption"
        )
    if not url.startswith("http://"):
        raise ValueError(f"'{url}' is not an http:// URL")
    return url.rstrip("/")


class DecodeServerSpec(BaseModel):
    """One decode API server and the DP ranks it routes by ``X-data-parallel-rank``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str
    ranks: tuple[int, ...] = ()  # header values (local indices under hybrid LB); () = no header

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        return engine_url(url)


class PoolCell(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    prefill: tuple[str, ...] = ()
    decode: tuple[DecodeServerSpec, ...] = Field(min_length=1)

    @field_validator("prefill")
    @classmethod
    def _http_urls(cls, urls: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(engine_url(url) for url in urls)


class PoolSpec(BaseModel):
    """The pool file's shape: ``cells: [{name, prefill: [URL...], decode: [{url, ranks}]}]``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cells: tuple[PoolCell, ...] = Field(min_length=1)


def parse_decode_flag(value: str) -> DecodeServerSpec:
    """``URL``, ``URL@3`` (one rank), ``URL@0-3`` or ``URL@0,1,2,3`` (hybrid-LB local ranks)."""
    url, at, ranks = value.partition("@")
    if not at:
        return DecodeServerSpec(url=url)
    problem = f"--decode {value}: ranks must look like @3, @0-3 or @0,1,2,3"
    parsed: list[int] = []
    for part in ranks.split(","):
        low, dash, high = part.partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise ValueError(problem)
        if dash and int(high) < int(low):
            raise ValueError(f"{problem} (a range runs low to high)")
        parsed.extend(range(int(low), int(high) + 1) if dash else [int(low)])
    try:
        return DecodeServerSpec(url=url, ranks=tuple(parsed))
    except ValidationError as exc:
        raise ValueError(f"--decode {value}: {exc.errors()[0]['msg']}") from exc


def load_pool_file(path: str | Path) -> PoolSpec:
    return load_yaml_model(path, PoolSpec, kind="pool file", fix="see docs/gateway.md")


@dataclass(slots=True)
class Breaker:
    """Passive ejection: ``threshold`` consecutive failures open the breaker for ``cooldown_s``.

    After the cooldown requests are let through again; the first success closes the breaker and
    the next failure opens it for another cooldown."""

    threshold: int = 3
    cooldown_s: float = 5.0
    failures: int = 0
    open_until: float = 0.0

    def allows(self, now: float) -> bool:
        return self.failures < self.threshold or now >= self.open_until

    def success(self) -> None:
        self.failures = 0

    def failure(self, now: float) -> None:
        self.failures += 1
        if self.failures >= self.threshold:
            self.open_until = now + self.cooldown_s


@dataclass(slots=True)
class _Target:
    name: str
    url: str
    cell: str
    breaker: Breaker
    up: bool = True  # the last active health check answered 200
    dead: bool = False  # its server refused, reset or answered its health check with an error
    in_flight: int = 0  # this gateway's requests, exact
    others: int = 0  # decode only: other replicas' requests, estimated at the last load sync
    dp_rank: int = -1  # decode only: the X-data-parallel-rank value, -1 for none
    dp_ranks: int = 0  # prefill only: DP ranks its engine reports (engine labels), 0 before
    # prefill only, per DP rank sent to (-1: the engine chose): this gateway's requests and
    # uncached prompt tokens, exact, and other replicas' requests as of the last load sync
    rank_requests: dict[int, int] = field(default_factory=dict)
    rank_tokens: dict[int, int] = field(default_factory=dict)
    rank_others: dict[int, int] = field(default_factory=dict)
    stalled: bool = False  # decode only: its server runs requests but makes no progress

    def healthy(self, now: float) -> bool:
        return self.up and not self.stalled and self.breaker.allows(now)

    def routable_in_panic(self) -> bool:
        """Worth a request when most of its pool looks down: not known dead, not stalled."""
        return not self.dead and not self.stalled


@dataclass(slots=True)
class _Server:
    """One engine API server: its health and the ranks (targets) behind it."""

    url: str
    targets: list[_Target] = field(default_factory=list)
    models: tuple[str, ...] = ()
    # each model's context length as the engine states it (vLLM's max_model_len), when it does
    context: dict[str, int] = field(default_factory=dict)
    up: bool = True  # the last active health check answered 200
    dead: bool = False  # the last health check was refused, reset or answered with an error
    alive_at: float = 0.0  # monotonic: its last sign of life (an answer to anything, a success)
    missed: int = 0  # health checks in a row it left unanswered (timed out)
    # when its last MISSED_PROBES health checks began (monotonic), oldest first
    probes: deque[float] = field(default_factory=lambda: deque(maxlen=MISSED_PROBES))
    tokens: float = -1.0  # prompt + generation tokens the engine has counted, at the last sync
    block_size: int = 0  # tokens per KV block, from vllm:cache_config_info (0: not seen yet)
    progressed_at: float = 0.0  # monotonic: when that count last moved, or the engine was idle
    stalled: bool = False


# Health checks a server may leave unanswered in a row before it is ejected (Kubernetes' probe
# default failureThreshold), unless it showed another sign of life meanwhile (it answered /metrics,
# a request through it succeeded): then it is busy, not gone. An answer other than 200, or a
# refused connection, ejects at once: that server is dead.
MISSED_PROBES = 3
# Seconds a decode server may run requests without counting a token before new requests avoid
# it: longer than any prefill it may be running for a request that is not streaming yet.
STALL_AFTER_S = 30.0
# Below this share of healthy targets a role's pool is in panic and routes to every target not
# known dead (Envoy's panic threshold, and its default): a busy host leaves every engine's health
# checks unanswered together, and ejecting them all turns slow answers into 503s.
PANIC_THRESHOLD = 0.5


class Pool:
    def __init__(
        self,
        cells: Sequence[PoolCell],
        *,
        probe_interval_s: float,
        stall_after_s: float = STALL_AFTER_S,
        breaker: Callable[[], Breaker] = Breaker,
        prefixes: PrefixIndex | None = None,
        on_missed_probe: Callable[[str], None] | None = None,
        on_ejected: Callable[[str, str, bool], None] | None = None,
        max_requests_per_rank: int = 0,
    ) -> None:
        """``probe_interval_s``: seconds between health checks, and between load syncs;
        ``stall_after_s``: seconds a decode server may run requests without counting a token
        before it is routed around; ``breaker`` makes each target's circuit breaker;
        ``prefixes``: the index of what each prefill DP rank was sent (a default one);
        ``on_missed_probe``: told the server's URL when a health check goes unanswered;
        ``on_ejected``: told the server's URL, why (``failed_health_check``,
        ``unanswered_health_checks``) and whether its pool is in panic, each time a health
        check round ejects a server; ``max_requests_per_rank``: the requests a decode rank may
        hold, this gateway's and other replicas' (0: no bound; see :meth:`decode_place`)."""
        self.probe_interval_s = probe_interval_s
        self._on_missed_probe = on_missed_probe
        self._on_ejected = on_ejected
        self.panic: dict[str, bool] = {"prefill": False, "decode": False}
        self._ejected: list[tuple[_Server, str]] = []  # in this health check round
        self.max_requests_per_rank = max_requests_per_rank
        self.waiting_for_place = 0  # requests waiting in decode_place now
        self._place_freed: asyncio.Future[None] | None = None  # woken when a rank's load falls
        self.stall_after_s = stall_after_s
        self._new_breaker = breaker
        self.prefixes = prefixes or PrefixIndex()
        self._prefills = 0
        self._mean_uncached_tokens = 0.0
        self.prefill: dict[str, _Target] = {}
        self.decode: dict[str, _Target] = {}
        self._servers: dict[str, _Server] = {}
        self._session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._models: tuple[str, ...] = ()
        self._context: dict[str, int] = {}
        self._generation = 0  # of target sets handed to apply(), newest wins
        self._odd: set[str] = set()  # servers whose odd /metrics was told (until it is not)
        self.update(cells)

    # ---- targets

    async def apply(self, cells: Sequence[PoolCell]) -> None:
        """Take a new set of targets once its new engines have answered a health check (their
        health and model names known), so a changed pool never serves a moment with engines
        whose models are unknown. A newer set arriving meanwhile wins."""
        self._generation += 1
        generation = self._generation
        probed: dict[str, _Server] = {}
        if self._session is not None:
            urls = {url for cell in cells for url in (*cell.prefill, *(d.url for d in cell.decode))}
            probed = {url: _Server(url) for url in urls - self._servers.keys()}
            await asyncio.gather(*(self._probe(server) for server in probed.values()))
        if generation == self._generation:
            self.update(cells, probed)
            # their load and prefill DP ranks, without waiting for the next sync
            await asyncio.gather(*(self._sync_server(url) for url in probed))

    def update(
        self, cells: Sequence[PoolCell], probed: Mapping[str, _Server] | None = None
    ) -> None:
        """Take a new set of targets; targets that stay keep their load and health, and new
        targets of a ``probed`` server start with its health."""
        probed = probed or {}
        prefill: dict[str, _Target] = {}
        decode: dict[str, _Target] = {}
        for cell in cells:
            for url in cell.prefill:
                prefill[url] = self.prefill.get(url) or self._target(url, url, cell.name)
                prefill[url].cell = cell.name
            for spec in cell.decode:
                for rank in spec.ranks or (-1,):
                    name = f"{spec.url}#{rank}" if rank >= 0 else spec.url
                    target = self.decode.get(name) or self._target(name, spec.url, cell.name)
                    target.cell, target.dp_rank = cell.name, rank
                    decode[name] = target
        self._forget_prefixes([t for name, t in self.prefill.items() if name not in prefill])
        self.prefill, self.decode = prefill, decode
        servers: dict[str, _Server] = {}
        for target in [*prefill.values(), *decode.values()]:
            server = servers.setdefault(
                target.url,
                self._servers.get(target.url) or probed.get(target.url) or _Server(target.url),
            )
            if target not in server.targets:
                server.targets.append(target)
                if target.url in probed:
                    target.up, target.dead = server.up, server.dead
        for server in servers.values():
            server.targets = [t for t in server.targets if t.name in prefill or t.name in decode]
        self._servers = servers
        self._refresh_models()

    def _target(self, name: str, url: str, cell: str) -> _Target:
        return _Target(name, url, cell, self._new_breaker())

    def snapshot(self, prompt_blocks: Sequence[bytes] = ()) -> PoolSnapshot:
        """The targets as the policy sees them now: a prefill view per DP rank (per instance
        while its ranks are not known), each with how many tokens of the prompt whose
        ``prefix.block_hashes`` are ``prompt_blocks`` that rank was sent."""
        now = time.monotonic()
        held = self.prefixes.match(prompt_blocks)  # "<url>#<rank>" -> leading blocks
        prefill, decode = self._routable(self.prefill, now), self._routable(self.decode, now)
        return PoolSnapshot(
            prefill=tuple(
                PrefillView(
                    t.name,
                    t.cell,
                    prefill[t.name],
                    self._rank_tokens(t, rank),
                    held.get(f"{t.name}#{rank}", 0) * BLOCK_TOKENS,
                    rank,
                )
                for t in self.prefill.values()
                for rank in (range(t.dp_ranks) if t.dp_ranks > 1 else (-1,))
            ),
            decode=tuple(
                DecodeRankView(
                    t.name, t.url, t.cell, t.dp_rank, decode[t.name], t.in_flight + t.others
                )
                for t in self.decode.values()
            ),
        )

    @staticmethod
    def _routable(targets: Mapping[str, _Target], now: float) -> dict[str, bool]:
        """Which of a role's targets take requests: the healthy ones, or in panic (fewer than
        ``PANIC_THRESHOLD`` of them healthy) every one not known dead or stalled."""
        healthy = {name: t.healthy(now) for name, t in targets.items()}
        if sum(healthy.values()) >= PANIC_THRESHOLD * len(targets):
            return healthy
        return {name: t.routable_in_panic() for name, t in targets.items()}

    def _judge_panic(self) -> None:
        now = time.monotonic()
        for role, targets in (("prefill", self.prefill), ("decode", self.decode)):
            healthy = sum(t.healthy(now) for t in targets.values())
            panic = healthy < PANIC_THRESHOLD * len(targets)
            if panic and not self.panic[role]:
                live = sum(t.routable_in_panic() for t in targets.values())
                log.warning(
                    "panic: %d of %d %s targets healthy; routing to all %d not known dead",
                    healthy,
                    len(targets),
                    role,
                    live,
                )
            elif self.panic[role] and not panic:
                log.info("%d of %d %s targets healthy; panic over", healthy, len(targets), role)
            self.panic[role] = panic

    @property
    def models(self) -> tuple[str, ...]:
        """Model names the healthy engines serve (from their ``/v1/models``), as of the last
        health check or target update: every request checks its model against them."""
        return self._models

    def context_length(self, model: str) -> int | None:
        """The longest context every healthy engine serving ``model`` takes (prompt plus
        output tokens), when they state one: a request beyond it fails on any of them."""
        return self._context.get(model)

    def _refresh_models(self) -> None:
        names: dict[str, None] = {}
        context: dict[str, int] = {}
        for server in self._servers.values():
            if not server.dead:  # a busy server still serves its models
                names.update(dict.fromkeys(server.models))
                for model, length in server.context.items():
                    context[model] = min(length, context.get(model, length))
        self._models = tuple(names)
        self._context = context

    def ready(self) -> bool:
        """A decode target to route to whose models are known: it serves every request, alone
        when no prefill instance is healthy."""
        routable = self._routable(self.decode, time.monotonic())
        return any(routable.values()) and bool(self.models)

    def prefill_health(self) -> tuple[int, int]:
        """(healthy, configured) prefill instances."""
        now = time.monotonic()
        return sum(t.healthy(now) for t in self.prefill.values()), len(self.prefill)

    # ---- load accounting (called by the handoff)

    def begin_prefill(self, name: str, dp_rank: int, uncached_tokens: int) -> None:
        target = self.prefill[name]
        target.in_flight += 1
        target.rank_requests[dp_rank] = target.rank_requests.get(dp_rank, 0) + 1
        target.rank_tokens[dp_rank] = target.rank_tokens.get(dp_rank, 0) + uncached_tokens
        self._prefills += 1
        weight = min(self._prefills, _MEAN_PREFILLS)
        self._mean_uncached_tokens += (uncached_tokens - self._mean_uncached_tokens) / weight

    def end_prefill(self, name: str, dp_rank: int, uncached_tokens: int) -> None:
        target = self.prefill.get(name)
        if target is not None and dp_rank in target.rank_requests:
            target.in_flight -= 1
            target.rank_requests[dp_rank] -= 1
            target.rank_tokens[dp_rank] -= uncached_tokens

    def routed(self, name: str, dp_rank: int, prompt_blocks: Sequence[bytes]) -> None:
        """A prompt of ``prompt_blocks`` goes to DP rank ``dp_rank`` (-1: the engine chooses)
        of prefill instance ``name``: that rank will hold its prefix."""
        self.prefixes.routed(f"{name}#{dp_rank}", prompt_blocks)

    def _forget_prefixes(self, targets: Sequence[_Target]) -> None:
        """What ``targets`` (prefill instances) were sent is gone: their engine died or left."""
        ranks = {f"{t.name}#{rank}" for t in targets for rank in range(-1, max(t.dp_ranks, 1))}
        if ranks:
            self.prefixes.forget(ranks)

    def block_size(self, name: str) -> int:
        """The KV block size target ``name``'s engine reports, or 0 before its first sync."""
        target = self.prefill.get(name) or self.decode.get(name)
        server = self._servers.get(target.url) if target is not None else None
        return server.block_size if server is not None else 0

    def begin_decode(self, name: str) -> None:
        self.decode[name].in_flight += 1

    def end_decode(self, name: str) -> None:
        target = self.decode.get(name)
        if target is not None:
            target.in_flight = max(0, target.in_flight - 1)
            self._wake_waiting()

    def _wake_waiting(self) -> None:
        freed, self._place_freed = self._place_freed, None
        if freed is not None and not freed.done():
            freed.set_result(None)

    def _has_place(self) -> bool:
        """A decode rank to route to holds fewer requests than the bound (or there is none to
        route to: that is for the routing to answer, not a wait)."""
        routable = self._routable(self.decode, time.monotonic())
        loads = [t.in_flight + t.others for name, t in self.decode.items() if routable[name]]
        return not loads or min(loads) < self.max_requests_per_rank

    async def decode_place(self, within_s: float) -> str:
        """Whether a decode rank below ``max_requests_per_rank`` is there: ``free`` now (always,
        with no bound), ``waited`` when one freed up within ``within_s`` (a request ended here,
        a load sync found other replicas' requests gone, a rank came back), else ``saturated``.
        Called before a request's prefill, so a request that cannot be placed holds no KV."""
        if not self.max_requests_per_rank or self._has_place():
            return "free"
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within_s
        self.waiting_for_place += 1
        try:
            while not self._has_place():
                remaining = deadline - loop.time()
                if remaining <= 0:
                    return "saturated"
                if self._place_freed is None:
                    self._place_freed = loop.create_future()
                try:
                    await asyncio.wait_for(asyncio.shield(self._place_freed), remaining)
                except TimeoutError:
                    return "waited" if self._has_place() else "saturated"
            return "waited"
        finally:
            self.waiting_for_place -= 1

    def succeeded(self, name: str) -> None:
        target = self.prefill.get(name) or self.decode.get(name)
        if target is not None:
            target.breaker.success()
            server = self._servers.get(target.url)
            if server is not None:
                server.alive_at = time.monotonic()

    def failed(self, name: str) -> None:
        target = self.prefill.get(name) or self.decode.get(name)
        if target is not None:
            target.breaker.failure(time.monotonic())

    def server_urls(self) -> tuple[str, ...]:
        """Every engine API server the pool health-checks."""
        return tuple(self._servers)

    def in_flight(self) -> dict[str, int]:
        """This gateway's in-flight requests per target (prefill and decode), for metrics and
        leak checks."""
        return {t.name: t.in_flight for t in [*self.prefill.values(), *self.decode.values()]}

    def healthy_targets(self) -> dict[tuple[str, str], int]:
        """Healthy targets per (role, cell), zeros included: a cell whose decode group is down
        must show as 0, not vanish."""
        now = time.monotonic()
        counts: dict[tuple[str, str], int] = {}
        for role, targets in (("prefill", self.prefill), ("decode", self.decode)):
            for target in targets.values():
                key = (role, target.cell)
                counts[key] = counts.get(key, 0) + target.healthy(now)
        return counts

    def peer_in_flight(self) -> dict[str, int]:
        """Requests other gateway replicas hold per decode rank, as of the last load sync."""
        return {t.name: t.others for t in self.decode.values()}

    def prefill_dp_ranks(self) -> dict[str, int]:
        """The DP ranks each prefill instance reported at the last load sync (0: none yet)."""
        return {t.name: t.dp_ranks for t in self.prefill.values()}

    def peer_outstanding_tokens(self) -> dict[str, int]:
        """Uncached prompt tokens other gateway replicas have in flight per prefill instance, as
        estimated at the last load sync (see :meth:`_peer_tokens`)."""
        return {
            t.name: self._peer_tokens(sum(t.rank_others.values())) for t in self.prefill.values()
        }

    def _rank_tokens(self, target: _Target, dp_rank: int) -> int:
        """Uncached prompt tokens in flight on one DP rank of a prefill instance (-1: on the
        whole instance), this gateway's and other replicas'."""
        if dp_rank < 0:
            own = sum(target.rank_tokens.values())
            return own + self._peer_tokens(sum(target.rank_others.values()))
        mine = target.rank_tokens.get(dp_rank, 0)
        return mine + self._peer_tokens(target.rank_others.get(dp_rank, 0))

    def _peer_tokens(self, requests: int) -> int:
        """An estimate: the engines count requests, not the tokens left to compute, so other
        replicas' requests on a prefill rank are priced at this gateway's mean uncached tokens
        per prefill (none until it has run one)."""
        return round(requests * self._mean_uncached_tokens)

    # ---- background: health and load

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

    async def _every(self, interval: float, action: Callable[[], Awaitable[None]]) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await action()
            except Exception:  # a probe must never stop probing
                log.exception("pool background task failed")

    async def check_health(self) -> None:
        await asyncio.gather(*(self._probe(server) for server in list(self._servers.values())))
        self._refresh_models()
        self._judge_panic()
        self._wake_waiting()  # a rank back in the pool is a place
        ejected, self._ejected = self._ejected, []
        for server, reason in ejected:
            if self._on_ejected is not None:
                panic = any(
                    self.panic["prefill" if t.name in self.prefill else "decode"]
                    for t in server.targets
                )
                self._on_ejected(server.url, reason, panic)

    async def _probe(self, server: _Server) -> None:
        assert self._session is not None
        server.probes.append(time.monotonic())
        timeout = aiohttp.ClientTimeout(total=max(1.0, self.probe_interval_s))
        try:
            async with self._session.get(f"{server.url}/health", timeout=timeout) as response:
                up = response.status == 200
            if up and not server.models:
                async with self._session.get(f"{server.url}/v1/models", timeout=timeout) as resp:
                    if resp.status != 200:
                        # Healthy but refusing the gateway (vLLM's --api-key): unusable.
                        log.warning(
                            "%s answers /v1/models with %d; if it needs a key, give the gateway "
                            "--engine-api-key-file",
                            server.url,
                            resp.status,
                        )
                        up = False
                    else:
                        data = await resp.json()
                        cards = data.get("data", [])
                        server.models = tuple(card["id"] for card in cards)
                        server.context = {
                            card["id"]: card["max_model_len"]
                            for card in cards
                            if isinstance(card.get("max_model_len"), int)
                        }
        except TimeoutError:
            # Unanswered, not refused: a busy API server (a large prompt to tokenize, a long
            # pause, a loaded host) misses a check now and then, and ejecting it at once would
            # take every engine of a busy host out together. Only MISSED_PROBES in a row with
            # no other sign of life eject it.
            server.missed += 1
            if self._on_missed_probe is not None:
                self._on_missed_probe(server.url)
            # busy, not gone: something answered since the first of its last three checks began
            up = server.up and (
                server.missed < MISSED_PROBES or server.alive_at >= server.probes[0]
            )
            dead = server.dead
        except (aiohttp.ClientError, ValueError, KeyError):
            up, dead = False, True  # refused, reset or nonsense: down now
        else:
            server.missed, server.alive_at, dead = 0, time.monotonic(), not up
        unanswered = server.missed >= MISSED_PROBES
        for target in server.targets:
            if up and not target.up:
                log.info("target %s is healthy again; readmitted", target.name)
                target.breaker.success()
            elif not up and target.up:
                reason = (
                    f"left {server.missed} health checks in a row unanswered, and nothing else"
                    if unanswered
                    else "failed its health check"
                )
                log.warning("target %s %s; ejected", target.name, reason)
            target.up, target.dead = up, dead
        if server.up and not up:
            reason = "unanswered_health_checks" if unanswered else "failed_health_check"
            self._ejected.append((server, reason))
        if dead and not server.dead:  # a restarted engine starts with an empty prefix cache
            self._forget_prefixes([t for t in server.targets if t.name in self.prefill])
        server.up, server.dead = up, dead

    async def sync_load(self) -> None:
        """Estimate the load other gateway replicas put on each target (decode rank, prefill
        instance) from what the engines report. The engines' count lags this gateway's (a
        request in handoff is not there yet), so it only adds to this gateway's exact count,
        never replaces it. The same scrape tells a stalled decode server (see
        :meth:`_judge_progress`)."""
        urls = {t.url for t in [*self.prefill.values(), *self.decode.values()] if t.up}
        await asyncio.gather(*(self._sync_server(url) for url in urls))

    def _judge_progress(self, server: _Server, running: int, tokens: float) -> None:
        """A decode server with requests running whose token counts have not moved for
        ``stall_after_s`` is stalled (a hung engine keeps answering /health): its ranks take no
        new request until the counts move again."""
        now = time.monotonic()
        if running == 0 or tokens != server.tokens:
            server.tokens, server.progressed_at = tokens, now
            stalled = False
        else:
            stalled = now - server.progressed_at >= self.stall_after_s
        if stalled and not server.stalled:
            log.warning(
                "%s made no progress for %.0f s with %d requests running; routed around until "
                "it does",
                server.url,
                now - server.progressed_at,
                running,
            )
        elif server.stalled and not stalled:
            log.info("%s makes progress again; readmitted", server.url)
        server.stalled = stalled
        for target in server.targets:
            target.stalled = stalled

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
        server = self._servers.get(url)
        if server is not None:
            server.alive_at = time.monotonic()  # it answered: busy perhaps, not gone
        if status != 200:
            self._odd_metrics(url, f"answers /metrics with HTTP {status}")
        elif len(page) > METRICS_PAGE_BYTES:
            self._odd_metrics(url, f"serves a /metrics page over {METRICS_PAGE_BYTES} bytes")
        else:
            self.record_engine_load(url, page.decode("utf-8", "replace"))

    def _odd_metrics(self, url: str, what: str) -> None:
        """One engine's odd /metrics is told once, and leaves its load unknown: never an error
        of the gateway's."""
        if url not in self._odd:
            self._odd.add(url)
            log.warning("%s %s; its load is unknown until it serves Prometheus text", url, what)

    def record_engine_load(self, url: str, text: str) -> None:
        """Take one scrape of a server's ``/metrics``: other replicas' requests on each of its
        targets (a prefill instance's are all its ranks' requests) and a decode server's
        progress."""
        server = self._servers.get(url)
        if server is None:
            return
        try:
            load, running, tokens, block_size = _engine_load(text)
        except ValueError as exc:
            self._odd_metrics(url, f"serves a /metrics page that is not Prometheus text ({exc})")
            return
        self._odd.discard(url)
        server.block_size = block_size or server.block_size
        if any(t.name in self.decode for t in server.targets):
            self._judge_progress(server, running, tokens)
        # Engines label global DP ranks; the header takes local indices: the n-th smallest label.
        ranks = sorted(load, key=int)
        for target in server.targets:
            if target.name in self.prefill:
                target.dp_ranks = len(ranks)
                if len(ranks) > 1:
                    target.rank_others = {
                        rank: max(0, load[label] - target.rank_requests.get(rank, 0))
                        for rank, label in enumerate(ranks)
                    }
                else:  # one unit: requests sent before the ranks were known count too
                    target.rank_others = {-1: max(0, sum(load.values()) - target.in_flight)}
            elif 0 <= target.dp_rank < len(ranks):
                target.others = max(0, load[ranks[target.dp_rank]] - target.in_flight)
        self._wake_waiting()  # other replicas' requests may have ended


def _engine_load(text: str) -> tuple[dict[str, int], int, float, int]:
    """Requests per engine label, requests running, prompt plus generation tokens counted, and
    the KV block size (0 when not reported)."""
    load: dict[str, int] = {}
    running = 0
    tokens = 0.0
    block_size = 0
    for family in text_string_to_metric_families(text):
        if family.name == "vllm:cache_config_info":
            size = next(iter(family.samples)).labels.get("block_size", "") if family.samples else ""
            block_size = int(size) if size.isdigit() else 0
        if family.name in ENGINE_LOAD_METRICS:
            for sample in family.samples:
                engine = sample.labels.get("engine", "0")
                load[engine] = load.get(engine, 0) + int(sample.value)
                if family.name == "vllm:num_requests_running":
                    running += int(sample.value)
        elif family.name in _PROGRESS_METRICS:
            tokens += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return load, running, tokens, block_size
