"""``baton bench trace``: a public production trace replayed on a whole simulated rack, Baton
against vllm-router and round robin.

The trace is a JSONL file in the format Mooncake published with its FAST'25 paper
(github.com/kvcache-ai/Mooncake, ``FAST25-release/traces/``): one request a line, its arrival
``timestamp`` (ms), ``input_length`` and ``output_length`` (tokens) and ``hash_ids``, one id
per 512-token block of the prompt, equal ids for equal prefixes. Each request is replayed as
recorded: sent at its timestamp (the clock sped up ``--speedups`` times: the load dial), a
streamed completion whose prompt is built block by block so that equal ids are equal text (512
four-byte words a block, one token each under the simulator's tokenizer), ``max_tokens`` = the
recorded output with ``ignore_eos``. No session header goes with it unless
``--session-header``, which names each request's conversation as a client that keeps one would:
a request continuing an earlier prompt (every full block of it, then more) joins its session.

Each point runs on a fresh ``baton up`` rack, as ``baton bench agentx`` does (the same rack,
router pinning, figures and per-GPU counts): Baton's gateway, vllm-router (``cache_aware``
prefill, ``power_of_two`` decode) or round robin in front of the same engines, cold caches.

Reuse is judged against the trace itself: the theoretical reuse is the share of prompt tokens
whose block (and every block before it) an earlier request of the window sent, as one infinite
prefix cache would serve them. Where the rest went comes from the engines' request log
(``baton up --request-log``: which DP rank of which engine computed each prompt, when, and how
many of its tokens its prefix cache held), per request:

- ``in_flight``: no engine had finished computing the prefix when the request's rank looked it
  up (a concurrent request was still prefilling it, or had not arrived);
- ``elsewhere``: some DP rank held it, but the request went to another (routing: a spill, a key
  that did not follow the prefix, a rank chosen by load);
- ``evicted``: the rank it went to had computed the prefix, and no longer held it all.

Each is a share of the prompt tokens sent, as reuse is.

What reuse allows at best is printed beside the routers: the window's TTFT floor (each measured
request's prefill alone on an idle rank, its reusable prefix cached, by the engines' profile),
below which no router's TTFT percentile can fall; and the throughput a prefill-bound rack could
gain from reuse against each router.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import hashlib
import math
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Never

import aiohttp
import orjson
from tqdm import tqdm

from baton.core.perf import lone_prefill_seconds
from baton.core.profile import DEFAULT_PROFILE, Profile, load_profile
from bench.agentx import (
    Record,
    engine_counters,
    fmt,
    gateway_affinity,
    gateway_first_tokens,
    gateway_not_reused,
    option_picker,
    percentile,
    plots_directory,
    router,
    served_model,
    stack,
    stream_into,
    summarize,
)
from bench.workload import text
from rigs.processes import busy_host

__all__ = [
    "BLOCK_TOKENS",
    "SESSION_MIN_BLOCKS",
    "TraceError",
    "TraceRequest",
    "add_arguments",
    "compare",
    "load_trace",
    "prefill_spread",
    "prompt_digest",
    "prompt_text",
    "replay",
    "reusable_tokens",
    "reuse_lost",
    "run",
    "sessions",
    "ttft_floor_ms",
]

BLOCK_TOKENS = 512  # tokens per hash id in Mooncake's traces
SESSION_MIN_BLOCKS = 2
ROUTERS = ("baton", "vllm-router", "round-robin")


class TraceError(ValueError):
    """A trace file that cannot be replayed: the message names the file, line and field."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    line: int  # in the trace file, from 1
    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    def block_tokens(self, index: int) -> int:
        """Tokens of block ``index`` of this prompt (the last one may be short)."""
        return max(0, min(BLOCK_TOKENS, self.input_length - index * BLOCK_TOKENS))


def load_trace(
    path: Path, start_s: float = 0.0, duration_s: float | None = None
) -> list[TraceRequest]:
    """The requests of ``path`` that arrive in [start_s, start_s + duration_s) of its clock,
    in arrival order."""
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise TraceError(f"{path}: cannot read the trace ({exc.strerror})") from None
    end_ms = math.inf if duration_s is None else (start_s + duration_s) * 1000
    requests = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        request = _parse(path, number, line)
        if start_s * 1000 <= request.timestamp_ms < end_ms:
            requests.append(request)
    if not requests:
        raise TraceError(
            f"{path}: no request arrives in the window {start_s:g} s + "
            f"{'the rest' if duration_s is None else f'{duration_s:g} s'}; "
            "choose --window within the trace's timestamps"
        )
    requests.sort(key=lambda r: (r.timestamp_ms, r.line))
    return requests


def _parse(path: Path, number: int, line: str) -> TraceRequest:
    where = f"{path}:{number}"
    try:
        record = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        raise TraceError(f"{where}: not a JSON object ({exc}); one request per line") from None
    if not isinstance(record, dict):
        raise TraceError(f"{where}: not a JSON object; one request per line")

    def integer(name: str, least: int) -> int:
        value = record.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise TraceError(f"{where}: field {name!r} is {value!r}; give an integer >= {least}")
        return value

    request = TraceRequest(
        number,
        integer("timestamp", 0),
        integer("input_length", 1),
        integer("output_length", 1),
        tuple(record.get("hash_ids") or ()),
    )
    blocks = -(-request.input_length // BLOCK_TOKENS)
    if len(request.hash_ids) != blocks or not all(
        isinstance(h, int) and not isinstance(h, bool) for h in request.hash_ids
    ):
        raise TraceError(
            f"{where}: field 'hash_ids' must hold {blocks} integers, one per {BLOCK_TOKENS}-token "
            f"block of input_length {request.input_length}; it has {len(request.hash_ids)}"
        )
    return request


@functools.lru_cache(maxsize=65_536)
def _block(hash_id: int) -> str:
    return text(hash_id, BLOCK_TOKENS)


def prompt_text(request: TraceRequest) -> str:
    """The prompt: block by block, the same text for the same id (cut short in the last)."""
    return "".join(_block(h)[: request.block_tokens(i) * 4] for i, h in enumerate(request.hash_ids))


def _tokens(request: TraceRequest, blocks: int) -> int:
    """Tokens of the first ``blocks`` blocks, less the one token an engine always computes."""
    return min(sum(request.block_tokens(i) for i in range(blocks)), request.input_length - 1)


def reusable_tokens(requests: Sequence[TraceRequest]) -> list[int]:
    """Per request, the prompt tokens an infinite prefix cache would serve: its leading blocks
    that an earlier request sent (ids are prefix hashes: a block's id names its whole prefix)."""
    seen: set[int] = set()
    reusable = []
    for request in requests:
        blocks = 0
        for hash_id in request.hash_ids:
            if hash_id not in seen:
                break
            blocks += 1
        reusable.append(_tokens(request, blocks))
        seen.update(request.hash_ids)
    return reusable


def sessions(requests: Sequence[TraceRequest]) -> list[str]:
    """A session name per request, as a client keeping conversations would send it: a request
    whose prompt continues an earlier one (it starts with all of that one's full blocks, at
    least :data:`SESSION_MIN_BLOCKS` of them, and has more) joins the latest such request's
    session; any other starts its own. The minimum keeps apart conversations that share no
    more than a system prompt (every request of Mooncake's conversation trace opens with the
    same block), which a short first turn would otherwise chain together."""
    session_of: dict[tuple[int, ...], str] = {}  # full-block prefix -> its latest session
    names = []
    for request in requests:
        full = request.input_length // BLOCK_TOKENS
        name = next(
            (
                session_of[request.hash_ids[:k]]
                for k in range(len(request.hash_ids) - 1, SESSION_MIN_BLOCKS - 1, -1)
                if request.hash_ids[:k] in session_of
            ),
            f"trace-{request.line}",
        )
        names.append(name)
        if full >= SESSION_MIN_BLOCKS:
            session_of[request.hash_ids[:full]] = name
    return names


# ---- where reuse was lost


@dataclass(frozen=True, slots=True)
class _Computed:
    """Where and when an engine computed a prompt, from its request log line."""

    rank: tuple[str, int]  # (API server, DP rank)
    scheduled: float  # simulated seconds: when the rank looked its prefix up
    first_token: float  # when the rank had computed it
    cached_tokens: int


def _computed(log_lines: Iterable[dict[str, Any]]) -> dict[str, list[_Computed]]:
    """Per prompt digest, in arrival order, the engine requests that computed the prompt: a
    prefill for a remote decode, or a request served alone (not one pulling its KV)."""
    by_digest: dict[str, list[_Computed]] = defaultdict(list)
    for line in log_lines:
        if line["external_tokens"] or line["first_token"] is None or line["scheduled"] is None:
            continue
        by_digest[line["prompt"]].append(
            _Computed(
                (line["server"], line["dp_rank"]),
                line["scheduled"],
                line["first_token"],
                line["cached_tokens"],
            )
        )
    for computed in by_digest.values():
        computed.sort(key=lambda c: c.scheduled)
    return by_digest


def prompt_digest(prompt: str) -> str:
    """What the simulator's request log names a prompt by (BLAKE2b-128 of its bytes)."""
    return hashlib.blake2b(prompt.encode(), digest_size=16).hexdigest()


def reuse_lost(
    requests: Sequence[TraceRequest], log_lines: Iterable[dict[str, Any]]
) -> dict[str, float] | None:
    """The prompt tokens the trace let the rack reuse and it computed again, by cause (the
    module's docstring), as shares of the prompt tokens of the requests the engines computed;
    ``found_in_flight`` is the reverse: tokens found cached on a rank before the request that
    computed them there had finished (vLLM caches each block as it is computed). None when no
    request of the trace is in the log."""
    computed = _computed(log_lines)
    matched: list[tuple[TraceRequest, _Computed, int]] = []
    taken: dict[str, int] = defaultdict(int)
    for request, reusable in zip(requests, reusable_tokens(requests), strict=True):
        digest = prompt_digest(prompt_text(request))
        candidates = computed.get(digest, [])
        if taken[digest] < len(candidates):  # equal prompts pair up in order
            matched.append((request, candidates[taken[digest]], reusable))
            taken[digest] += 1
    if not matched:
        return None
    # When each block was first computed anywhere, and on each rank.
    anywhere: dict[int, float] = {}
    on_rank: dict[tuple[tuple[str, int], int], float] = {}
    for request, done, _ in matched:
        for hash_id in request.hash_ids:
            anywhere[hash_id] = min(anywhere.get(hash_id, math.inf), done.first_token)
            key = (done.rank, hash_id)
            on_rank[key] = min(on_rank.get(key, math.inf), done.first_token)
    lost = dict.fromkeys(("in_flight", "elsewhere", "evicted", "found_in_flight"), 0)
    for request, done, reusable in matched:
        available = _leading(request, reusable, lambda h: anywhere[h] <= done.scheduled)  # noqa: B023
        there = _leading(
            request,
            reusable,
            lambda h: on_rank[(done.rank, h)] <= done.scheduled,  # noqa: B023
        )
        lost["in_flight"] += reusable - available
        lost["elsewhere"] += available - there
        lost["evicted"] += max(0, there - done.cached_tokens)
        lost["found_in_flight"] += max(0, min(done.cached_tokens, reusable) - there)
    total = sum(request.input_length for request, _, _ in matched)
    return {cause: tokens / total for cause, tokens in lost.items()} | {
        "requests_matched": len(matched) / len(requests)
    }


def ttft_floor_ms(
    requests: Sequence[TraceRequest], reusable: Sequence[int], profile: Profile, warmup_s: float
) -> dict[str, float]:
    """The TTFT no router can beat on the rack's engines: each measured request's (arriving
    ``warmup_s`` or more after the window's first) prefill alone on an idle rank with every
    token the trace lets it reuse cached, timed by the engines' performance profile; no queue,
    handoff or decode step, so below any TTFT the request can have. Its p50/p90/p99 in ms, as
    the measured TTFT's (nearest rank), and how many requests."""
    origin = requests[0].timestamp_ms
    floors = [
        lone_prefill_seconds(profile, request.input_length - cached, cached) * 1000
        for request, cached in zip(requests, reusable, strict=True)
        if request.timestamp_ms - origin >= warmup_s * 1000
    ]
    return {"requests": len(floors)} | {f"p{q}": percentile(floors, q) for q in (50, 90, 99)}


def _leading(request: TraceRequest, reusable: int, ready: Callable[[int], bool]) -> int:
    """Tokens of the request's leading blocks that are ``ready``, at most ``reusable``."""
    blocks = 0
    for hash_id in request.hash_ids:
        if not ready(hash_id):
            break
        blocks += 1
    return min(_tokens(request, blocks), reusable)


def prefill_spread(log_lines: Iterable[dict[str, Any]]) -> dict[str, float] | None:
    """How evenly prompts were computed over the engines' API servers: the busiest one's share
    of prompt tokens computed, and the mean's."""
    computed: dict[str, int] = defaultdict(int)
    for line in log_lines:
        if line["remote_decode"]:
            computed[line["server"]] += line["prompt_tokens"] - line["cached_tokens"]
    total = sum(computed.values())
    if not total:
        return None
    return {"busiest_share": max(computed.values()) / total, "servers": len(computed)}


# ---- the replay


@dataclass(slots=True)
class _Replay:
    url: str
    model: str
    time_scale: float
    speedup: float
    session_header: bool
    http: aiohttp.ClientSession
    started: float = 0.0
    records: list[Record] = field(default_factory=list)
    progress: tqdm[Never] | None = None


async def _send(replay: _Replay, request: TraceRequest, session: str, at_wall: float) -> Record:
    await asyncio.sleep(max(0.0, replay.started + at_wall - time.perf_counter()))
    record = Record(session, request.line, False, time.perf_counter() - replay.started)
    body = {
        "model": replay.model,
        "prompt": prompt_text(request),
        "max_tokens": request.output_length,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    headers = {"Content-Type": "application/json"}
    if replay.session_header:
        headers["X-Session-ID"] = session
    url = f"{replay.url}/v1/completions"
    answered = await stream_into(record, replay.http, url, body, headers, replay.started)
    if answered and replay.progress is not None:
        replay.progress.update(1)
    return record


async def replay(
    url: str,
    model: str,
    requests: Sequence[TraceRequest],
    *,
    speedup: float,
    time_scale: float,
    session_header: bool,
    label: str,
) -> tuple[list[Record], float]:
    """Every request at its timestamp (sped up), all of them answered or failed; the records
    in trace order and the wall seconds it took."""
    origin = requests[0].timestamp_ms
    names = sessions(requests)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=300 * time_scale)
    async with aiohttp.ClientSession(
        timeout=timeout, connector=aiohttp.TCPConnector(limit=0)
    ) as http:
        replay = _Replay(url, model, time_scale, speedup, session_header, http)
        replay.progress = tqdm(
            # on a terminal only: a log (a device call's output) keeps the figures
            total=len(requests),
            desc=label,
            unit=" req",
            leave=False,
            file=sys.stderr,
            disable=None,
        )
        replay.started = time.perf_counter()
        try:
            records = await asyncio.gather(
                *(
                    _send(
                        replay,
                        request,
                        name,
                        (request.timestamp_ms - origin) / 1000 / speedup * time_scale,
                    )
                    for request, name in zip(requests, names, strict=True)
                )
            )
        finally:
            replay.progress.close()
    return list(records), time.perf_counter() - replay.started


# ---- points


@dataclass(frozen=True, slots=True)
class Settings:
    trace: str
    window_start_s: float  # of the trace's clock
    window_s: float
    warmup_s: float  # of the trace's clock, from the window's start: not measured
    speedups: tuple[float, ...]
    routers: tuple[str, ...]
    session_header: tuple[bool, ...]
    time_scale: float
    usd_per_gpu_hour: float
    busy_per_core: int = 0  # CPU-bound processes run beside the rack, per core
    max_requests_per_rank: int = 0  # Baton's bound on a decode rank's requests (0: none)
    first_token_from_prefill: bool = False  # Baton's gateway sends the prefill's token at once


# A request waiting for a decode rank under Baton's bound waits this long (wall seconds) before
# 429: the replay's client, unlike the OpenAI client, retries nothing, so a point must not turn
# a wait into an error.
BOUNDED_QUEUE_TIMEOUT_S = 600.0


def _gateway_flags(settings: Settings, name: str) -> tuple[str, ...]:
    if name != "baton":
        return ()
    flags: tuple[str, ...] = ()
    if settings.max_requests_per_rank:
        bound = str(settings.max_requests_per_rank)
        flags += ("--max-requests-per-rank", bound, "--queue-timeout", str(BOUNDED_QUEUE_TIMEOUT_S))
    if settings.first_token_from_prefill:
        flags += ("--first-token-from-prefill",)
    return flags


def _point(
    settings: Settings,
    requests: Sequence[TraceRequest],
    theoretical: float,
    name: str,
    speedup: float,
    session_header: bool,
    directory: Path,
) -> dict[str, Any]:
    label = f"{name} x{speedup:g}" + (" +session" if session_header else "")
    log_path = directory / f"requests-{name}-{speedup:g}-{int(session_header)}.jsonl"
    log_path.unlink(missing_ok=True)
    with (
        busy_host(settings.busy_per_core),
        stack(
            directory,
            settings.time_scale,
            "agent",
            extra=("--request-log", str(log_path), *_gateway_flags(settings, name)),
        ) as rack,
        router(name, rack, directory) as url,
    ):
        records, wall_s = asyncio.run(
            replay(
                url,
                served_model(url),
                requests,
                speedup=speedup,
                time_scale=settings.time_scale,
                session_header=session_header,
                label=label,
            )
        )
        counters = engine_counters(rack)
        affinity = gateway_affinity(rack.gateway) if name == "baton" else None
        not_reused = gateway_not_reused(rack.gateway) if name == "baton" else None
        first_tokens = gateway_first_tokens(rack.gateway) if name == "baton" else None
        gpus = rack.gpus
    log_lines = [orjson.loads(line) for line in log_path.read_text().splitlines() if line]
    figures = summarize(
        records,
        theoretical,
        time_scale=settings.time_scale,
        warmup_s=settings.warmup_s / speedup,
        gpus=gpus,
        computed_prompt_tokens=counters["computed"],
        usd_per_gpu_hour=settings.usd_per_gpu_hour,
    )
    late = counters["late_steps"] / counters["steps"] if counters["steps"] else 0.0
    return {
        "router": name,
        "speedup": speedup,
        "session_header": session_header,
        "offered_requests_per_s": len(requests) / (settings.window_s / speedup),
        "busy_processes_per_core": settings.busy_per_core,
        "max_requests_per_rank": settings.max_requests_per_rank if name == "baton" else None,
        "first_token_from_prefill": settings.first_token_from_prefill if name == "baton" else None,
        "wall_s": wall_s,
        "late_steps": late,
        # the decode engines' own inter-token latency (simulated ms), apart from the relay's
        "decode_itl_ms": counters["decode_itl_s"] / counters["decode_itl_count"] * 1000
        if counters["decode_itl_count"]
        else None,
        "decode_computed_prompt_tokens": counters["decode_computed"],
        "affinity": affinity,
        # the gateway's own record of prompt tokens its index knew a rank held and that were
        # computed again, by cause: beside reuse_lost, whether the index knew
        "not_reused_tokens": not_reused,
        # streams whose first token the gateway sent from their prefill leg, warmup included
        "first_tokens_from_prefill": first_tokens,
        "reuse_lost": reuse_lost(requests, log_lines),
        "prefill_spread": prefill_spread(log_lines),
        **figures,
    }


def sweep(settings: Settings) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every point (per speedup, each router and header setting in turn, so the machine's
    drift hits them alike), and what the window holds."""
    requests = load_trace(Path(settings.trace), settings.window_start_s, settings.window_s)
    reusable = reusable_tokens(requests)
    prompt = sum(r.input_length for r in requests)
    theoretical = sum(reusable) / prompt
    profile = load_profile()  # `baton up` runs its engines on the default profile
    window: dict[str, Any] = {
        "trace_sha256": hashlib.sha256(Path(settings.trace).read_bytes()).hexdigest(),
        "requests": len(requests),
        "prompt_tokens": prompt,
        "output_tokens": sum(r.output_length for r in requests),
        "mean_input_tokens": prompt / len(requests),
        "theoretical_reuse": theoretical,
        "sessions": len(set(sessions(requests))),
        "ttft_floor_ms": ttft_floor_ms(requests, reusable, profile, settings.warmup_s),
        "ttft_floor_profile": DEFAULT_PROFILE.removesuffix(".yaml"),
    }
    points = []
    with tempfile.TemporaryDirectory(prefix="baton-bench-trace-") as tmp:
        for speedup in settings.speedups:
            for name in settings.routers:
                # a session header is the trace's client keeping conversations: Baton's option
                for header in settings.session_header if name == "baton" else (False,):
                    point = _point(
                        settings,
                        requests,
                        theoretical,
                        name,
                        speedup,
                        header,
                        Path(tmp),
                    )
                    print(_row(point), file=sys.stderr)
                    points.append(point)
    return points, window


def compare(points: Sequence[dict[str, Any]], floor: Mapping[str, float]) -> list[dict[str, Any]]:
    """Baton against each other router at each speedup (without session headers on either
    side, as the trace was recorded): TTFT p90, throughput per GPU and P90 per-user rate as
    ratios, each one's reuse as a share of the theoretical; and the bounds reuse sets on those
    ratios: the least TTFT p90 ratio any router could reach against the other on these
    engines (``floor``, :func:`ttft_floor_ms`), and the most throughput a rack bound by its
    prefill engines could gain from reuse (the prompt tokens the other computed over the
    fewest the trace allows: every reusable token reused; a rack bound by decode gains none)."""
    by = {(p["router"], p["speedup"], p["session_header"]): p for p in points}
    rows = []
    for (name, speedup, header), point in by.items():
        baton = by.get(("baton", speedup, False))
        if name == "baton" or header or baton is None:
            continue
        if "ttft_ms" not in point or "ttft_ms" not in baton:
            continue
        rows.append(
            {
                "speedup": speedup,
                "against": name,
                "ttft_p90_ratio": baton["ttft_ms"]["p90"] / point["ttft_ms"]["p90"],
                "floor_p90_ratio": floor["p90"] / point["ttft_ms"]["p90"],
                "prefill_bound_throughput_ratio_max": (1 - point["prefix_reuse_achieved"])
                / (1 - point["prefix_reuse_theoretical"]),
                "throughput_per_gpu_ratio": baton["tokens_per_s_per_gpu"]
                / point["tokens_per_s_per_gpu"],
                "p90_per_user_ratio": baton["p90_tokens_per_s_per_user"]
                / point["p90_tokens_per_s_per_user"],
                "baton_reuse_of_theoretical": _of_theoretical(baton),
                "their_reuse_of_theoretical": _of_theoretical(point),
            }
        )
    return rows


def _of_theoretical(point: dict[str, Any]) -> float:
    achieved = point.get("prefix_reuse_achieved")
    return achieved / point["prefix_reuse_theoretical"] if achieved is not None else math.nan


# ---- report


def _row(point: dict[str, Any]) -> str:
    ttft = point.get("ttft_ms", {})
    lost = point.get("reuse_lost") or {}
    reuse = point.get("prefix_reuse_achieved")
    return (
        f"| {point['router']}{' +session' if point['session_header'] else ''} "
        f"| x{point['speedup']:g} | {point['requests']} "
        f"| {fmt(point.get('tokens_per_s_per_gpu'), ',.0f')} "
        f"| {fmt(point.get('p90_tokens_per_s_per_user'), '.1f')} "
        f"| {fmt(ttft.get('p50'), ',.0f')} / {fmt(ttft.get('p90'), ',.0f')} / "
        f"{fmt(ttft.get('p99'), ',.0f')} "
        f"| {fmt(reuse * 100 if reuse is not None else None, '.1f')}% of "
        f"{point['prefix_reuse_theoretical'] * 100:.1f}% "
        f"| {' / '.join(fmt(lost.get(c, math.nan) * 100, '.1f') for c in LOST)} "
        f"| {point['errors']} | {point.get('late_steps', math.nan) * 100:.1f}% |"
    )


LOST = ("in_flight", "elsewhere", "evicted")
HEADER = (
    "| router | speedup | requests | tokens/s/GPU | P90 tok/s/user | TTFT p50 / p90 / p99 ms "
    "| prefix reuse (theoretical) | reuse lost: in flight / elsewhere / evicted (% of prompt) "
    "| errors | late steps |\n|---|---|---|---|---|---|---|---|---|---|"
)


def plot(points: Sequence[dict[str, Any]], window: dict[str, Any], path: Path) -> None:
    """TTFT p90 by speedup, reuse against the theoretical, and where each router lost reuse."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def label(point: dict[str, Any]) -> str:
        router: str = point["router"]
        return router + (" +session" if point["session_header"] else "")

    series = list(dict.fromkeys(label(p) for p in points))
    fig, (ttft, reuse, lost) = plt.subplots(1, 3, figsize=(16, 4.8))
    for name in series:
        mine = sorted(
            (p for p in points if label(p) == name and "ttft_ms" in p), key=lambda p: p["speedup"]
        )
        xs = [p["speedup"] for p in mine]
        ttft.plot(xs, [p["ttft_ms"]["p90"] for p in mine], marker="o", label=name)
        reuse.plot(
            xs, [(p.get("prefix_reuse_achieved") or 0) * 100 for p in mine], marker="o", label=name
        )
    ttft.set(xlabel="trace speed-up", ylabel="TTFT p90 (ms)", yscale="log", title="TTFT p90")
    ttft.legend(fontsize=8)
    reuse.axhline(
        window["theoretical_reuse"] * 100,
        color="black",
        linestyle=":",
        label=f"theoretical {window['theoretical_reuse'] * 100:.1f}%",
    )
    reuse.set(
        xlabel="trace speed-up",
        ylabel="prompt tokens served from cache (%)",
        ylim=(0, None),
        title="Prefix reuse",
    )
    reuse.legend(fontsize=8)
    bars = [p for p in points if p.get("reuse_lost")]
    bottoms = [0.0] * len(bars)
    for cause in LOST:
        heights = [p["reuse_lost"][cause] * 100 for p in bars]
        lost.bar(range(len(bars)), heights, bottom=bottoms, label=cause.replace("_", " "))
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    lost.set_xticks(
        range(len(bars)),
        [f"{label(p)}\nx{p['speedup']:g}" for p in bars],
        fontsize=6,
        rotation=60,
    )
    lost.set(ylabel="% of prompt tokens", title="Reuse lost, by cause")
    lost.legend(fontsize=8)
    fig.suptitle(
        f"{window['trace']}: {window['requests']} requests, mean input "
        f"{window['mean_input_tokens']:,.0f} tokens",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("trace")
    group.add_argument("--trace", type=Path, help="a JSONL trace in Mooncake's format (required)")
    group.add_argument(
        "--window",
        help="START:SECONDS of the trace's clock to replay (default 0:300; quick 0:60)",
    )
    group.add_argument(
        "--warmup",
        type=float,
        help="trace seconds at the window's start whose requests are not measured (default "
        "60; quick 15): the caches start cold",
    )
    group.add_argument(
        "--speedups",
        help="how many times faster than recorded the trace is replayed, comma-separated: the "
        "load dial (default 8,16,24; quick 8)",
    )
    group.add_argument(
        "--trace-routers",
        help=f"routers to compare, comma-separated (default: {','.join(ROUTERS)})",
    )
    group.add_argument(
        "--session-header",
        choices=["no", "yes", "both"],
        help="send each request's conversation in X-Session-ID (yes), not (no: as recorded), "
        "or both for Baton (default: both; other routers never get it)",
    )
    group.add_argument(
        "--time-scale",
        type=float,
        help="wall seconds per simulated second (default 4; quick 2)",
    )
    group.add_argument(
        "--busy",
        type=int,
        default=0,
        help="run this many CPU-bound processes per core beside the rack at every point (a "
        "busy host); the result is saved as trace-busy.json",
    )
    group.add_argument(
        "--usd-per-gpu-hour",
        type=float,
        help="GPU price for $/M tokens (default 3.00, an assumption, not a quote)",
    )
    group.add_argument(
        "--max-requests-per-rank",
        type=int,
        default=0,
        help="Baton's gateway holds a request until a decode DP rank has fewer than this many "
        "(its --max-requests-per-rank; default 0: no bound)",
    )
    group.add_argument(
        "--first-token-from-prefill",
        action="store_true",
        help="Baton's gateway sends each streamed completion's first token from its prefill leg "
        "(its --first-token-from-prefill)",
    )


def _settings(args: argparse.Namespace, quick: bool) -> Settings:
    given = vars(args)
    pick = option_picker(args, quick)

    if given.get("trace") is None:
        raise SystemExit(
            "baton bench trace: --trace FILE is required: a JSONL trace in Mooncake's format, "
            "e.g. FAST25-release/traces/conversation_trace.jsonl of github.com/kvcache-ai/Mooncake"
        )
    window = pick("window", "0:300", "0:60")
    try:
        start, seconds = (float(v) for v in window.split(":"))
    except ValueError:
        raise SystemExit(
            f"baton bench trace: --window {window!r}: give START:SECONDS, e.g. 0:300"
        ) from None
    speedups_text = pick("speedups", "8,16,24", "8")
    try:
        speedups = tuple(float(v) for v in speedups_text.split(","))
    except ValueError:
        raise SystemExit(
            f"baton bench trace: --speedups {speedups_text!r}: give numbers like 4,8"
        ) from None
    if seconds <= 0 or start < 0 or min(speedups) <= 0:
        raise SystemExit(
            "baton bench trace: --window needs START >= 0 and SECONDS > 0, --speedups numbers > 0"
        )
    routers = tuple(
        r for r in pick("trace_routers", ",".join(ROUTERS), ",".join(ROUTERS)).split(",") if r
    )
    unknown = sorted(set(routers) - set(ROUTERS))
    if unknown or not routers:
        raise SystemExit(
            f"baton bench trace: --trace-routers: unknown {unknown}; choose from {list(ROUTERS)}"
        )
    header = pick("session_header", "both", "both")
    bound = int(given.get("max_requests_per_rank") or 0)
    if bound < 0:
        raise SystemExit(
            f"baton bench trace: --max-requests-per-rank {bound}: give 0 (no bound) or more"
        )
    return Settings(
        trace=str(given["trace"]),
        window_start_s=start,
        window_s=seconds,
        warmup_s=float(pick("warmup", 60.0, 15.0)),
        speedups=speedups,
        routers=routers,
        session_header={"no": (False,), "yes": (True,), "both": (False, True)}[header],
        time_scale=float(pick("time_scale", 4.0, 2.0)),
        usd_per_gpu_hour=float(pick("usd_per_gpu_hour", 3.0, 3.0)),
        busy_per_core=int(given.get("busy") or 0),
        max_requests_per_rank=bound,
        first_token_from_prefill=bool(given.get("first_token_from_prefill")),
    )


def run(quick: bool = False, args: argparse.Namespace | None = None) -> dict[str, object]:
    settings = _settings(args or argparse.Namespace(), quick)
    started = time.time()
    try:
        points, window = sweep(settings)
    except TraceError as exc:
        raise SystemExit(f"baton bench trace: {exc}") from None
    window["trace"] = Path(settings.trace).name
    result: dict[str, object] = {
        "benchmark": "trace-busy" if settings.busy_per_core else "trace",
        "settings": asdict(settings),
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)),
        "window": window,
        "points": points,
        "comparison": compare(points, window["ttft_floor_ms"]),
        "targets": {"reuse_of_theoretical_min": 0.95, "ttft_p90_ratio_max": 0.5},
    }
    print(
        f"{window['trace']} {settings.window_start_s:g}+{settings.window_s:g} s: "
        f"{window['requests']} requests, theoretical reuse {window['theoretical_reuse']:.1%}; "
        f"TTFT floor p50 / p90 / p99 {window['ttft_floor_ms']['p50']:,.0f} / "
        f"{window['ttft_floor_ms']['p90']:,.0f} / {window['ttft_floor_ms']['p99']:,.0f} ms "
        f"(each prompt alone, its reusable prefix cached; profile {window['ttft_floor_profile']})"
    )
    print(HEADER)
    for point in points:
        print(_row(point))
    for row in result["comparison"]:  # type: ignore[attr-defined]
        print(
            f"x{row['speedup']:g}: Baton / {row['against']}: "
            f"TTFT p90 {row['ttft_p90_ratio']:.2f}x (no router below "
            f"{row['floor_p90_ratio']:.2f}x), "
            f"throughput per GPU {row['throughput_per_gpu_ratio']:.2f}x, P90 per-user "
            f"{row['p90_per_user_ratio']:.2f}x (prefill-bound, reuse gains at most "
            f"{row['prefill_bound_throughput_ratio_max']:.2f}x); reuse of the theoretical: Baton "
            f"{row['baton_reuse_of_theoretical']:.1%}, {row['against']} "
            f"{row['their_reuse_of_theoretical']:.1%}"
        )
    if not quick and not settings.busy_per_core:
        path = plots_directory(args) / "trace.png"
        plot(points, window, path)
        print(f"wrote {path}", file=sys.stderr)
    return result
