"""Gateway overhead, side by side: direct to decode, Baton's gateway, and vllm-router.

One run against the same fast engines (``baton sim`` prefill and decode; the ``instant`` profile
for "no delay between tokens", a 5 ms decode step otherwise). Each router is pinned to core 1;
the engines and the load generator share core 0. For each target and scenario:

- router CPU microseconds per streamed chunk: the router process's CPU time (utime + stime of
  all its threads, from /proc) over the SSE events the clients received;
- chunks per second received;
- TTFT p50 / p99 (request sent -> first token event received), and the p50/p99 added over
  going direct to the decode engine (which skips prefill: the limit).
- TTFT p50 of each stream's first request (all streams start together: a burst) and of its
  later ones (they start as earlier requests end, so they follow the first turn's spread);
  for Baton also its own mean prefill and handoff (prefill's answer -> decode's first token)
  phase times, from its metrics: how much of its TTFT is spent waiting on the engines.

Scenarios: (a) 32 streams with no delay between tokens; (b) 256 streams with 5 ms between
tokens. vllm-router runs ``--vllm-pd-disaggregation`` with round-robin policies; Baton runs its
defaults. Both do the full P/D sequence (prompts are ~1,000 tokens, over Baton's P/D threshold).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

import aiohttp
import yaml
from prometheus_client.parser import text_string_to_metric_families

from baton.core.profile import load_profile
from bench.procstat import cpu_seconds, pin
from rigs.processes import baton_command, free_port, free_port_block, stop_process, wait_healthy

__all__ = [
    "MODEL",
    "PROMPT",
    "Scenario",
    "direct_and_routed",
    "instant_profile",
    "run",
    "start_engine",
    "start_routers",
    "stream_load",
]

MODEL = "dsv4"
NIXL = '{"kv_connector":"NixlConnector","kv_role":"kv_both"}'
PROMPT = "the baton passes from prefill to decode " * 100  # ~1,000 tokens


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    streams: int
    token_delay_s: float
    requests_per_stream: int
    max_tokens: int


# One measurement: the target's and scenario's names, then figures.
_Row = dict[str, str | float]


class _Result(TypedDict):
    scenario: str
    rounds: list[_Row]
    median: dict[str, dict[str, float]]  # target -> figure -> median over the rounds
    ratios: dict[str, float]


SCENARIOS = (
    Scenario("a: 32 streams, no delay", 32, 0.0, 6, 256),
    Scenario("b: 256 streams, 5 ms/token", 256, 0.005, 2, 128),
)


def instant_profile(directory: Path, token_delay_s: float) -> str:
    """The instant profile, with a decode step of ``token_delay_s`` when given."""
    profile = load_profile("instant").model_dump()
    if token_delay_s:
        profile["decode"]["rest_fixed_s"] = token_delay_s
    path = directory / f"profile-{token_delay_s}.yaml"
    path.write_text(yaml.safe_dump(profile))
    return str(path)


def spawn(
    command: list[str],
    core: int | None,
    env: dict[str, str] | None = None,
    url: str | None = None,
) -> subprocess.Popen[bytes]:
    """``command`` started quietly, pinned to ``core`` unless None, healthy at ``url`` if given."""
    process = subprocess.Popen(
        command,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
    )
    if core is not None:
        pin(process.pid, core)
    if url is not None:
        wait_healthy(url, process, timeout=60)
    return process


def start_engine(profile: str, core: int | None = 0) -> tuple[subprocess.Popen[bytes], str]:
    """A ``baton sim`` engine on ``profile``, pinned to ``core`` unless None: its process and
    URL."""
    port = free_port()
    command = baton_command(
        "sim",
        "--port",
        str(port),
        "--profile",
        profile,
        "--served-model-name",
        MODEL,
        "--kv-transfer-config",
        NIXL,
        "--max-num-seqs",
        "1024",
        "--log-level",
        "warning",
    )
    env = {"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port_block(2))}
    url = f"http://127.0.0.1:{port}"
    return spawn(command, core, env, url), url


async def _one(
    session: aiohttp.ClientSession,
    url: str,
    max_tokens: int,
    ttfts: list[tuple[int, float]],
    turn: int = 0,
) -> int:
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "stream": True,
        "ignore_eos": True,
    }
    sent = time.perf_counter()
    events = 0
    async with session.post(f"{url}/v1/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"{url}: HTTP {response.status}: {await response.text()}")
        async for chunk in response.content.iter_any():
            if not events and b'"text"' in chunk:
                ttfts.append((turn, time.perf_counter() - sent))
            events += chunk.count(b"data: {")
    return events


async def stream_load(url: str, scenario: Scenario) -> tuple[float, int, list[tuple[int, float]]]:
    """Elapsed seconds, SSE events received, and (turn, TTFT) per request: turn 0 is each
    stream's first request (the burst), later turns start as earlier streams end."""
    ttfts: list[tuple[int, float]] = []
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def stream() -> int:
            total = 0
            for turn in range(scenario.requests_per_stream):
                total += await _one(session, url, scenario.max_tokens, ttfts, turn)
            return total

        await _one(session, url, 4, [])  # warm the connection pools
        started = time.perf_counter()
        events = await asyncio.gather(*(stream() for _ in range(scenario.streams)))
        return time.perf_counter() - started, sum(events), ttfts


def _measure(
    target: str, url: str, process: subprocess.Popen[bytes] | None, scenario: Scenario
) -> _Row:
    before = cpu_seconds(process.pid) if process is not None else 0.0
    phases_before = _baton_phases(url) if target == "baton" else {}
    elapsed, events, turns = asyncio.run(stream_load(url, scenario))
    cpu = cpu_seconds(process.pid) - before if process is not None else 0.0
    ttfts = sorted(ttft for _, ttft in turns)
    first = [ttft for turn, ttft in turns if turn == 0]
    later = [ttft for turn, ttft in turns if turn > 0]
    row: _Row = {
        "target": target,
        "scenario": scenario.name,
        "chunks": events,
        "seconds": elapsed,
        "chunks_per_s": events / elapsed,
        "router_cpu_us_per_chunk": cpu / events * 1e6 if process is not None else 0.0,
        "ttft_p50_ms": statistics.median(ttfts) * 1000,
        "ttft_p99_ms": ttfts[int(0.99 * (len(ttfts) - 1))] * 1000,
        "ttft_p50_first_turn_ms": statistics.median(first) * 1000,
        "ttft_p50_later_turns_ms": statistics.median(later) * 1000 if later else 0.0,
    }
    if target == "baton":
        after = _baton_phases(url)
        for phase in ("prefill", "handoff"):
            count = after[f"{phase}_count"] - phases_before[f"{phase}_count"]
            total = after[f"{phase}_sum"] - phases_before[f"{phase}_sum"]
            row[f"baton_{phase}_mean_ms"] = total / count * 1000 if count else 0.0
    return row


def _baton_phases(url: str) -> dict[str, float]:
    """Baton's own phase histograms (sum and count per phase) from its /metrics: where its
    TTFT goes, prefill (request to prefill's answer) and handoff (to decode's first token)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
        text = response.read().decode()
    phases: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "baton_gateway_phase_seconds":
            for sample in family.samples:
                kind = sample.name.removeprefix("baton_gateway_phase_seconds_")
                if kind in ("sum", "count"):
                    phases[f"{sample.labels['phase']}_{kind}"] = sample.value
    return phases


def start_routers(
    prefill: str, decode: str, variants: Mapping[str, Sequence[str]] | None = None
) -> dict[str, tuple[subprocess.Popen[bytes], str]]:
    """Baton's gateway and vllm-router (P/D, round robin) in front of the two engines, each
    pinned to core 1: by name, their process and URL; ``variants``: more Baton gateways, by
    name, each with these flags besides."""

    def baton_gateway(port: int, *flags: str) -> list[str]:
        return baton_command(
            "gateway",
            *("--port", str(port), "--prefill", prefill, "--decode", decode),
            *("--log-level", "warning", *flags),
        )

    baton_port, vllm_port = free_port(), free_port()
    baton = baton_gateway(baton_port)
    binary = shutil.which("vllm-router") or str(Path(sys.executable).parent / "vllm-router")
    vllm = [
        binary,
        "--host",
        "127.0.0.1",
        "--port",
        str(vllm_port),
        "--vllm-pd-disaggregation",
        "--prefill",
        prefill,
        "--decode",
        decode,
        "--policy",
        "round_robin",
        "--prometheus-port",
        str(free_port()),
        "--log-level",
        "warning",
    ]
    baton_url, vllm_url = f"http://127.0.0.1:{baton_port}", f"http://127.0.0.1:{vllm_port}"
    routers = {
        "baton": (spawn(baton, 1, url=baton_url), baton_url),
        "vllm-router": (spawn(vllm, 1, url=vllm_url), vllm_url),
    }
    for name, flags in (variants or {}).items():
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        routers[name] = (spawn(baton_gateway(port, *flags), 1, url=url), url)
    return routers


Target = tuple[str, str, "subprocess.Popen[bytes] | None"]


@contextmanager
def direct_and_routed(
    profile: str, variants: Mapping[str, Sequence[str]] | None = None
) -> Iterator[list[Target]]:
    """A prefill and a decode engine of ``profile`` (core 0) and the routers in front of them
    (core 1), this process on core 0; what to measure: the decode engine directly, then each
    router, by name with its URL and process (None for the engine); ``variants``: more Baton
    gateways, by name with their extra flags. Stopped when the block ends."""
    processes: list[subprocess.Popen[bytes]] = []
    try:
        prefill_process, prefill = start_engine(profile)
        processes.append(prefill_process)
        decode_process, decode = start_engine(profile)
        processes.append(decode_process)
        routers = start_routers(prefill, decode, variants)
        processes += [process for process, _ in routers.values()]
        pin(os.getpid(), 0)
        yield [("direct", decode, None)] + [
            (name, url, process) for name, (process, url) in routers.items()
        ]
    finally:
        stop_process(*processes)


def _scenario(directory: Path, scenario: Scenario, rounds: int) -> list[_Row]:
    rows: list[_Row] = []
    with direct_and_routed(instant_profile(directory, scenario.token_delay_s)) as targets:
        for _ in range(rounds):  # interleaved, so drift on a shared machine hits all alike
            for name, url, process in targets:
                rows.append(_measure(name, url, process, scenario))
    return rows


def _median(rows: list[_Row], target: str, key: str) -> float:
    return statistics.median(float(r[key]) for r in rows if r["target"] == target)


def run(quick: bool = False) -> dict[str, object]:
    rounds = 1 if quick else 3
    results: list[_Result] = []
    with tempfile.TemporaryDirectory() as directory:
        for scenario in SCENARIOS:
            rows = _scenario(Path(directory), scenario, rounds)
            summary = {
                target: {
                    key: _median(rows, target, key)
                    for key in (
                        "router_cpu_us_per_chunk",
                        "chunks_per_s",
                        "ttft_p50_ms",
                        "ttft_p99_ms",
                        "ttft_p50_first_turn_ms",
                        "ttft_p50_later_turns_ms",
                    )
                }
                for target in ("direct", "baton", "vllm-router")
            }
            for target in ("baton", "vllm-router"):
                summary[target]["added_ttft_p50_ms"] = (
                    summary[target]["ttft_p50_ms"] - summary["direct"]["ttft_p50_ms"]
                )
                summary[target]["added_ttft_p99_ms"] = (
                    summary[target]["ttft_p99_ms"] - summary["direct"]["ttft_p99_ms"]
                )
            for phase in ("prefill", "handoff"):
                summary["baton"][f"{phase}_mean_ms"] = _median(
                    rows, "baton", f"baton_{phase}_mean_ms"
                )
            baton, vllm = summary["baton"], summary["vllm-router"]
            ratios = {
                "cpu_per_chunk_baton_over_vllm_router": baton["router_cpu_us_per_chunk"]
                / vllm["router_cpu_us_per_chunk"],
                "added_ttft_p50_baton_minus_vllm_router_ms": baton["added_ttft_p50_ms"]
                - vllm["added_ttft_p50_ms"],
            }
            results.append(
                {"scenario": scenario.name, "rounds": rows, "median": summary, "ratios": ratios}
            )
    _print(results)
    return {
        "benchmark": "gateway",
        "results": results,
        "targets": {"cpu_per_chunk_ratio_max": 0.8, "added_ttft_p50_not_above_vllm_router": True},
    }


def _print(results: list[_Result]) -> None:
    header = (
        "scenario",
        "target",
        "CPU us/chunk",
        "chunks/s",
        "TTFT p50",
        "TTFT p99",
        "+p50 vs direct",
    )
    print("  ".join(f"{h:>14}" for h in header))
    for result in results:
        for target, figures in result["median"].items():
            added = figures.get("added_ttft_p50_ms")
            cells = (
                result["scenario"][:14],
                target,
                f"{figures['router_cpu_us_per_chunk']:.1f}" if target != "direct" else "-",
                f"{figures['chunks_per_s']:.0f}",
                f"{figures['ttft_p50_ms']:.1f} ms",
                f"{figures['ttft_p99_ms']:.1f} ms",
                f"{added:+.1f} ms" if added is not None else "-",
            )
            print("  ".join(f"{c:>14}" for c in cells))
        ratios = result["ratios"]
        print(
            f"  {result['scenario']}: Baton CPU/chunk = "
            f"{ratios['cpu_per_chunk_baton_over_vllm_router']:.2f}x vllm-router's "
            f"(target <= 0.8x); Baton added TTFT p50 - vllm-router's = "
            f"{ratios['added_ttft_p50_baton_minus_vllm_router_ms']:+.1f} ms "
            f"(target <= 0)",
            flush=True,
        )
        turns = ", ".join(
            f"{target} {figures['ttft_p50_first_turn_ms']:.0f}/"
            f"{figures['ttft_p50_later_turns_ms']:.0f} ms"
            for target, figures in result["median"].items()
        )
        baton = result["median"]["baton"]
        print(
            f"    TTFT p50 of each stream's first request / of its later ones: {turns}; "
            f"Baton's own means: prefill {baton['prefill_mean_ms']:.1f} ms, "
            f"handoff to first token {baton['handoff_mean_ms']:.1f} ms",
            flush=True,
        )
