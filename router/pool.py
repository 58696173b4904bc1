"""The gateway's pool: prefill instances and decode ranks by cell, their health and their load.

The pool owns every piece of mutable routing state: which targets are healthy (the outcome of
active checks of ``/health``, plus passive ejection by a circuit breaker) and which of them it
routes to (all but the dead while a role's pool is in panic), how many requests and uncached
prompt tokens this gateway has in flight at each target, which prompt prefixes each prefill DP
rank was sent or its engine reports holding (``router/prefix.py``), and the load other gateway
replicas put on each target as the engines last reported it: their
``vllm:num_requests_running`` plus ``vllm:num_requests_waiting`` less this gateway's share (so
several replicas converge on the same view while each keeps its own count exact). It hands out
immutable :class:`PoolSnapshot` objects for the pure policy to choose over.

Pure: no I/O and no clock of its own (it is given one). ``router/prober.py`` probes the engines
and scrapes their load on the loop and records what it finds here; targets come as cells
(``router/targets.py``), set at start and changed through ``update``.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from baton.core.kv_events import KVEventBatch, rank_endpoint
from router.policy import DecodeRankView, PoolSnapshot, PrefillView
from router.prefix import INDEX_BLOCKS, KVEventLedger, PrefixIndex, PromptBlocks
from router.targets import PoolCell, kv_events_host

__all__ = [
    "MISSED_PROBES",
    "PANIC_THRESHOLD",
    "STALL_AFTER_S",
    "Breaker",
    "EngineLoad",
    "Pool",
    "Probe",
    "Server",
]

log = logging.getLogger("baton.gateway.pool")

# This gateway's mean uncached tokens per prefill, which prices other replicas' prefills: the
# plain mean of its first prefills, then a moving mean over about this many.
_MEAN_PREFILLS = 1024


@dataclass(frozen=True, slots=True)
class Probe:
    """What one health check of a server found: ``answered`` False when it timed out (busy, not
    refused); ``up`` when it answered 200 (and its models, when it served them); ``refused``
    when the connection was refused or reset, or the answer was nonsense."""

    answered: bool
    up: bool = False
    refused: bool = False
    models: tuple[str, ...] | None = None  # as /v1/models listed them, when it was asked
    context: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """One scrape of an engine server's ``/metrics``: requests per ``engine`` label (its global
    DP rank), requests running, prompt plus generation tokens counted, and the KV block size
    (0 when not reported)."""

    requests: Mapping[str, int]
    running: int
    tokens: float
    block_size: int


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
    kv_events: str = ""  # prefill only: where DP rank 0 publishes its KV events, "" for nowhere

    def healthy(self, now: float) -> bool:
        return self.up and not self.stalled and self.breaker.allows(now)

    def routable_in_panic(self) -> bool:
        """Worth a request when most of its pool looks down: not known dead, not stalled."""
        return not self.dead and not self.stalled


@dataclass(slots=True)
class Server:
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


_NO_PROMPT = PromptBlocks()

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
        clock: Callable[[], float],
        stall_after_s: float = STALL_AFTER_S,
        breaker: Callable[[], Breaker] = Breaker,
        prefix_index_blocks: int = INDEX_BLOCKS,
        max_requests_per_rank: int = 0,
        kv_events_port: int = 0,
    ) -> None:
        """``clock``: monotonic seconds (the breakers', the stall bound's and the health rounds'
        time); ``stall_after_s``: seconds a decode server may run requests without counting a
        token before it is routed around; ``breaker`` makes each target's circuit breaker;
        ``prefix_index_blocks``: the blocks the prefix index remembers (``router/prefix.py``);
        ``max_requests_per_rank``: the requests a decode rank may hold, this gateway's and other
        replicas' (0: no bound; see :meth:`has_place`); ``kv_events_port``: the port every
        prefill engine's DP rank 0 publishes its KV events on, at the engine's host, where its
        cell names no endpoint of its own (0: none)."""
        self.clock = clock
        self.panic: dict[str, bool] = {"prefill": False, "decode": False}
        self._ejected: list[tuple[Server, str]] = []  # in this health check round
        self.max_requests_per_rank = max_requests_per_rank
        self.waiting_for_place = 0  # requests waiting for a decode rank below the bound now
        # requests let in under the bound that have not reached their decode rank yet (in the
        # prefill leg): each holds a place, or every request admitted while the ranks had room
        # would find them free once its prefill ended
        self.admitted = 0
        # told when a decode rank's load may have fallen (a request ended, a load sync found
        # other replicas' requests gone, a rank came back): whoever waits for a place
        self.on_place_freed: Callable[[], None] = lambda: None
        self.stall_after_s = stall_after_s
        self._new_breaker = breaker
        self.prefixes = PrefixIndex(prefix_index_blocks)
        self.ledger = KVEventLedger(self.prefixes)
        self.kv_events_port = kv_events_port
        self._prefills = 0
        self._mean_uncached_tokens = 0.0
        self.prefill: dict[str, _Target] = {}
        self.decode: dict[str, _Target] = {}
        self._servers: dict[str, Server] = {}
        self._models: tuple[str, ...] = ()
        # what the pool's source says its engines serve (a ModelDeployment's served model):
        # a request for it belongs here even while no engine answers
        self.declared: tuple[str, ...] = ()
        self._context: dict[str, int] = {}
        self.update(cells)

    # ---- targets

    def update(self, cells: Sequence[PoolCell], probed: Mapping[str, Server] | None = None) -> None:
        """Take a new set of targets; targets that stay keep their load and health, and new
        targets of a ``probed`` server start with its health."""
        probed = probed or {}
        prefill: dict[str, _Target] = {}
        decode: dict[str, _Target] = {}
        for cell in cells:
            for url in cell.prefill:
                prefill[url] = self.prefill.get(url) or self._target(url, url, cell.name)
                prefill[url].cell = cell.name
                prefill[url].kv_events = cell.kv_events.get(url) or (
                    f"tcp://{kv_events_host(url)}:{self.kv_events_port}"
                    if self.kv_events_port
                    else ""
                )
            for spec in cell.decode:
                for rank in spec.ranks or (-1,):
                    name = f"{spec.url}#{rank}" if rank >= 0 else spec.url
                    target = self.decode.get(name) or self._target(name, spec.url, cell.name)
                    target.cell, target.dp_rank = cell.name, rank
                    decode[name] = target
        self._forget_prefixes([t for name, t in self.prefill.items() if name not in prefill])
        self.prefill, self.decode = prefill, decode
        servers: dict[str, Server] = {}
        for target in [*prefill.values(), *decode.values()]:
            server = servers.setdefault(
                target.url,
                self._servers.get(target.url) or probed.get(target.url) or Server(target.url),
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

    def snapshot(self, prompt: PromptBlocks = _NO_PROMPT) -> PoolSnapshot:
        """The targets as the policy sees them now: a prefill view per DP rank (per instance
        while its ranks are not known), each with how many tokens of ``prompt`` it holds."""
        now = self.clock()
        held = self.prefixes.match(prompt.keys)  # "<url>#<rank>" -> leading blocks
        prefill, decode = self._routable(self.prefill, now), self._routable(self.decode, now)
        return PoolSnapshot(
            prefill=tuple(
                PrefillView(
                    t.name,
                    t.cell,
                    prefill[t.name],
                    self._rank_tokens(t, rank),
                    held.get(f"{t.name}#{rank}", 0) * prompt.tokens_per_block,
                    rank,
                    self._rank_requests(t, rank),
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
        now = self.clock()
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

    def serves(self, model: str) -> bool:
        """Whether a request for ``model`` belongs to this pool: a healthy engine serves it, or
        the pool's source declares it."""
        return model in self._models or model in self.declared

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
        routable = self._routable(self.decode, self.clock())
        return any(routable.values()) and bool(self.models)

    def prefill_health(self) -> tuple[int, int]:
        """(healthy, configured) prefill instances."""
        now = self.clock()
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

    def routed(self, name: str, dp_rank: int, prompt_blocks: Sequence[int]) -> None:
        """A prompt of ``prompt_blocks`` goes to DP rank ``dp_rank`` (-1: the engine chooses)
        of prefill instance ``name``: that rank will hold its prefix."""
        self.prefixes.routed(f"{name}#{dp_rank}", prompt_blocks)

    def _forget_prefixes(self, targets: Sequence[_Target]) -> None:
        """What ``targets`` (prefill instances) were sent is gone: their engine died or left."""
        ranks = {f"{t.name}#{rank}" for t in targets for rank in range(-1, max(t.dp_ranks, 1))}
        if ranks:
            self.ledger.forget(ranks)

    def kv_event_endpoints(self) -> dict[str, str]:
        """Where each prefill DP rank publishes its KV events -> the rank as the index names it
        (``<url>#<rank>``; ``#-1`` while the instance's ranks are not known, or it has one)."""
        endpoints = {}
        for target in self.prefill.values():
            if target.kv_events:
                for rank in range(max(target.dp_ranks, 1)):
                    label = rank if target.dp_ranks > 1 else -1
                    endpoints[rank_endpoint(target.kv_events, rank)] = f"{target.name}#{label}"
        return endpoints

    def kv_blocks_held(self) -> dict[str, int]:
        """Per prefill DP rank (``<url>#<rank>``), the KV blocks its events say it holds (0
        for one that reported none, or publishes none)."""
        return {
            f"{t.name}#{rank}": self.ledger.held.get(f"{t.name}#{rank}", 0)
            for t in self.prefill.values()
            for rank in (range(t.dp_ranks) if t.dp_ranks > 1 else (-1,))
        }

    def kv_events(self, rank: str, sequence: int, batch: KVEventBatch) -> None:
        """A batch of KV events DP rank ``rank`` published as number ``sequence``."""
        self.ledger.apply(rank, sequence, batch)

    def kv_block_size(self) -> int:
        """The prefill engines' tokens per KV block: as their events or metrics state it, else
        vLLM's default."""
        if self.ledger.block_size:
            return self.ledger.block_size
        sizes = [self._servers[t.url].block_size for t in self.prefill.values()]
        return next((size for size in sizes if size), 16)

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
            self.on_place_freed()

    def has_place(self) -> bool:
        """The decode ranks to route to have a place below ``max_requests_per_rank`` that no
        admitted request holds yet (or there is no bound, or no rank to route to: that is for
        the routing to answer, not a wait). The places are counted over every rank, since each
        request's decode goes to the least loaded one."""
        if not self.max_requests_per_rank:
            return True
        routable = self._routable(self.decode, self.clock())
        loads = [t.in_flight + t.others for name, t in self.decode.items() if routable[name]]
        free = sum(max(0, self.max_requests_per_rank - load) for load in loads)
        return not loads or free > self.admitted

    def admit(self) -> None:
        """A request takes a place under the bound, until its decode begins or it ends."""
        self.admitted += 1

    def release_admission(self, placed: bool) -> None:
        """An admitted request's place: taken by its decode rank (``placed``), or given back
        by a request that ended before one, for whoever waits."""
        self.admitted = max(0, self.admitted - 1)
        if not placed:
            self.on_place_freed()

    def succeeded(self, name: str) -> None:
        target = self.prefill.get(name) or self.decode.get(name)
        if target is not None:
            target.breaker.success()
            server = self._servers.get(target.url)
            if server is not None:
                server.alive_at = self.clock()

    def failed(self, name: str) -> None:
        target = self.prefill.get(name) or self.decode.get(name)
        if target is not None:
            target.breaker.failure(self.clock())

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
        now = self.clock()
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

    def _rank_requests(self, target: _Target, dp_rank: int) -> int:
        """Prefills in flight on one DP rank of a prefill instance (-1: on the whole instance),
        this gateway's and other replicas' as the engine last counted them."""
        if dp_rank < 0:
            return sum(target.rank_requests.values()) + sum(target.rank_others.values())
        return target.rank_requests.get(dp_rank, 0) + target.rank_others.get(dp_rank, 0)

    def _peer_tokens(self, requests: int) -> int:
        """An estimate: the engines count requests, not the tokens left to compute, so other
        replicas' requests on a prefill rank are priced at this gateway's mean uncached tokens
        per prefill (none until it has run one)."""
        return round(requests * self._mean_uncached_tokens)

    # ---- what the prober found (router/prober.py)

    def servers(self) -> list[Server]:
        """Every engine API server the pool health-checks."""
        return list(self._servers.values())

    def load_urls(self) -> set[str]:
        """The servers whose load to sync: those of a target whose last health check passed."""
        return {t.url for t in [*self.prefill.values(), *self.decode.values()] if t.up}

    def record_probe(self, server: Server, probe: Probe) -> None:
        """One health check's outcome. A server that leaves a check unanswered is busy, not
        gone: only ``MISSED_PROBES`` in a row with no other sign of life eject it (a busy API
        server, a large prompt to tokenize, a loaded host miss checks now and then, and ejecting
        at once would take every engine of a busy host out together). A refusal, a reset or an
        answer other than 200 ejects at once."""
        if probe.models is not None:
            server.models, server.context = probe.models, dict(probe.context)
        if not probe.answered:
            server.missed += 1
            # busy, not gone: something answered since the first of its last checks began
            up = server.up and (
                server.missed < MISSED_PROBES or server.alive_at >= server.probes[0]
            )
            dead = server.dead
        elif probe.refused:
            up, dead = False, True
        else:
            up = probe.up
            server.missed, server.alive_at, dead = 0, self.clock(), not up
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

    def end_health_round(self) -> list[tuple[str, str, bool]]:
        """After a round of health checks: the models served and each role's panic judged
        again; the servers the round ejected, each with why and whether its pool is now in
        panic."""
        self._refresh_models()
        self._judge_panic()
        self.on_place_freed()  # a rank back in the pool is a place
        ejected, self._ejected = self._ejected, []
        return [
            (
                server.url,
                reason,
                any(
                    self.panic["prefill" if t.name in self.prefill else "decode"]
                    for t in server.targets
                ),
            )
            for server, reason in ejected
        ]

    def alive(self, url: str) -> None:
        """The server answered something (its /metrics): busy perhaps, not gone."""
        server = self._servers.get(url)
        if server is not None:
            server.alive_at = self.clock()

    def _judge_progress(self, server: Server, running: int, tokens: float) -> None:
        """A decode server with requests running whose token counts have not moved for
        ``stall_after_s`` is stalled (a hung engine keeps answering /health): its ranks take no
        new request until the counts move again."""
        now = self.clock()
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

    def record_engine_load(self, url: str, load: EngineLoad) -> None:
        """Take one scrape of a server's ``/metrics``: other replicas' requests on each of its
        targets (a prefill instance's are all its ranks' requests) and a decode server's
        progress."""
        server = self._servers.get(url)
        if server is None:
            return
        server.block_size = load.block_size or server.block_size
        if any(t.name in self.decode for t in server.targets):
            self._judge_progress(server, load.running, load.tokens)
        # Engines label global DP ranks; the header takes local indices: the n-th smallest label.
        requests = load.requests
        ranks = sorted(requests, key=int)
        for target in server.targets:
            if target.name in self.prefill:
                target.dp_ranks = len(ranks)
                if len(ranks) > 1:
                    target.rank_others = {
                        rank: max(0, requests[label] - target.rank_requests.get(rank, 0))
                        for rank, label in enumerate(ranks)
                    }
                else:  # one unit: requests sent before the ranks were known count too
                    target.rank_others = {-1: max(0, sum(requests.values()) - target.in_flight)}
            elif 0 <= target.dp_rank < len(ranks):
                target.others = max(0, requests[ranks[target.dp_rank]] - target.in_flight)
        self.on_place_freed()  # other replicas' requests may have ended
