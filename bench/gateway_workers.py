"""Gateway workers side by side: ``baton gateway --workers 1`` and ``--workers 2``.

One run, the same simulated engines (``baton sim`` prefill and decode, the ``instant`` profile:
tokens as fast as the engine makes them) and the same load generator (this process): 256
concurrent streams of P/D requests (~1,000-token prompts, 256 tokens each; two per stream, one
with ``--quick``) through each gateway in turn, and
straight to the decode engine ("direct": what the engines and the load generator reach without
a gateway), interleaved over rounds. Both gateways run throughout on ports of their own; the one
not measured only checks health. Nothing is pinned: the gateway's workers share the machine's
cores with the engines and the load generator, so on a small machine two workers cannot reach
twice one's rate. For each target:

- chunks per second received (SSE events);
- gateway CPU microseconds per chunk: utime + stime of the gateway's processes (the parent and
  its workers, from /proc) over the chunks received;
- gateway cores busy: the same CPU time over the elapsed time;
- with two workers, how their CPU time split: how evenly the kernel spread the connections;
- TTFT p50 (request sent to first token received).
"""

from __future__ import annotations

import asyncio
import os
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from bench.gateway import Scenario, instant_profile, spawn, start_engine, stream_load
from bench.procstat import children, cpu_seconds
from rigs.processes import baton_command, free_port, stop_process

__all__ = ["run"]

WORKERS = (1, 2)
FIGURES = ("chunks_per_s", "gateway_cpu_us_per_chunk", "gateway_cores", "ttft_p50_ms")


# One measurement: the target's name, then figures; worker_cpu_split is each worker's share of
# the workers' CPU time, largest first.
_Row = dict[str, Any]


def _name(workers: int) -> str:
    return f"{workers} worker{'s' if workers > 1 else ''}"


def _gateway(workers: int, prefill: str, decode: str) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    command = baton_command("gateway", "--port", str(port))
    command += ["--prefill", prefill, "--decode", decode, "--workers", str(workers)]
    url = f"http://127.0.0.1:{port}"
    return spawn([*command, "--log-level", "warning"], None, url=url), url


def _cpu(pid: int) -> dict[int, float]:
    """CPU seconds of ``pid`` and of each process it runs (its workers, multiprocessing's
    resource tracker)."""
    return {process: cpu_seconds(process) for process in (pid, *children(pid))}


def _is_worker(pid: int) -> bool:
    with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
        return b"spawn_main" in cmdline.read()


def _measure(target: str, url: str, gateway: int | None, scenario: Scenario) -> _Row:
    before = _cpu(gateway) if gateway is not None else {}
    elapsed, chunks, ttfts = asyncio.run(stream_load(url, scenario))
    after = _cpu(gateway) if gateway is not None else {}
    spent = {pid: after[pid] - before.get(pid, 0.0) for pid in after}
    cpu = sum(spent.values())
    workers = [seconds for pid, seconds in spent.items() if pid != gateway and _is_worker(pid)]
    return {
        "target": target,
        "chunks": chunks,
        "seconds": elapsed,
        "chunks_per_s": chunks / elapsed,
        "gateway_cpu_us_per_chunk": cpu / chunks * 1e6,
        "gateway_cores": cpu / elapsed,
        "worker_cpu_split": sorted((w / sum(workers) for w in workers), reverse=True),
        "ttft_p50_ms": statistics.median(ttft for _, ttft in ttfts) * 1000,
    }


def run(quick: bool = False) -> dict[str, object]:
    rounds = 1 if quick else 3
    scenario = Scenario("256 streams, no delay", 256, 0.0, 1 if quick else 2, 256)
    # on any core, as the engines started from here (`baton bench gateway` pins this process)
    os.sched_setaffinity(0, range(os.cpu_count() or 1))
    processes: list[subprocess.Popen[bytes]] = []
    rows: list[_Row] = []
    try:
        with tempfile.TemporaryDirectory() as directory:
            profile = instant_profile(Path(directory), scenario.token_delay_s)
            prefill_process, prefill = start_engine(profile, core=None)
            decode_process, decode = start_engine(profile, core=None)
            processes += [prefill_process, decode_process]
            targets: list[tuple[str, str, int | None]] = [("direct", decode, None)]
            for workers in WORKERS:
                process, url = _gateway(workers, prefill, decode)
                processes.append(process)
                targets.append((_name(workers), url, process.pid))
            for _ in range(rounds):  # interleaved, so drift on a shared machine hits all alike
                for target, url, pid in targets:
                    rows.append(_measure(target, url, pid, scenario))
    finally:
        stop_process(*processes)
    median = {
        target: {
            key: statistics.median(float(r[key]) for r in rows if r["target"] == target)
            for key in FIGURES
        }
        for target, _, _ in targets
    }
    direct, one, two = median["direct"], median[_name(1)], median[_name(2)]
    scaling = {
        "chunks_per_s_2_over_1": two["chunks_per_s"] / one["chunks_per_s"],
        "gateway_cores_2_over_1": two["gateway_cores"] / one["gateway_cores"],
        "chunks_per_s_2_workers_over_direct": two["chunks_per_s"] / direct["chunks_per_s"],
    }
    _print(scenario, rows, median, scaling)
    return {
        "benchmark": "gateway-workers",
        "scenario": scenario.name,
        "rounds": rows,
        "median": median,
        "scaling": scaling,
    }


def _print(
    scenario: Scenario,
    rows: list[_Row],
    median: dict[str, dict[str, float]],
    scaling: dict[str, float],
) -> None:
    header = ("target", "chunks/s", "CPU us/chunk", "gateway cores", "worker split", "TTFT p50")
    print(f"{scenario.name}, {os.cpu_count()} cores; medians of the rounds (split: the last)")
    print("  ".join(f"{h:>14}" for h in header))
    for target, figures in median.items():
        splits = [r["worker_cpu_split"] for r in rows if r["target"] == target]
        split = "/".join(f"{share:.0%}" for share in splits[-1]) if len(splits[-1]) > 1 else "-"
        gateway = target != "direct"
        cells = (
            target,
            f"{figures['chunks_per_s']:,.0f}",
            f"{figures['gateway_cpu_us_per_chunk']:.1f}" if gateway else "-",
            f"{figures['gateway_cores']:.2f}" if gateway else "-",
            split,
            f"{figures['ttft_p50_ms']:.1f} ms",
        )
        print("  ".join(f"{c:>14}" for c in cells))
    print(
        f"  2 workers / 1: {scaling['chunks_per_s_2_over_1']:.2f}x chunks/s, "
        f"{scaling['gateway_cores_2_over_1']:.2f}x gateway cores busy; 2 workers reach "
        f"{scaling['chunks_per_s_2_workers_over_direct']:.0%} of direct",
        flush=True,
    )
