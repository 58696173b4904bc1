"""``baton bench gpu``'s device-side steps on the CPU build of vLLM: the driver that runs on a
lent GPU machine (two one-tray cells started detached, a trace replayed through each router,
every handoff counted, the engines stopped) exercised here, so that it cannot rot between GPU
runs. The GPU's own figures come only from a GPU (docs/benchmarks.md)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import ROOT, baton_command

# Conversations of 2-4 blocks of 512 tokens, a follow-up turn extending an earlier prompt.
TRACE = [
    {"timestamp": 0, "input_length": 1100, "output_length": 8, "hash_ids": [1, 2, 3]},
    {"timestamp": 300, "input_length": 700, "output_length": 8, "hash_ids": [1, 4]},
    {"timestamp": 900, "input_length": 1600, "output_length": 8, "hash_ids": [1, 2, 3, 5]},
    {"timestamp": 1400, "input_length": 1200, "output_length": 8, "hash_ids": [1, 4, 6]},
    {"timestamp": 2000, "input_length": 2100, "output_length": 8, "hash_ids": [1, 2, 3, 5, 7]},
    {"timestamp": 2600, "input_length": 900, "output_length": 8, "hash_ids": [1, 8]},
    {"timestamp": 3100, "input_length": 1700, "output_length": 8, "hash_ids": [1, 4, 6, 9]},
    {"timestamp": 3700, "input_length": 1400, "output_length": 8, "hash_ids": [1, 8, 10]},
]


def _step(state: Path, out: Path, *arguments: str) -> dict[str, Any]:
    result = subprocess.run(
        baton_command(
            "bench",
            "gpu",
            "--engines",
            "cpu",
            "--state",
            str(state),
            "--out",
            str(out),
            *arguments,
        ),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    engines = sorted((state / "engines").glob("*.log"))
    logs = "".join(f"\n--- {log.name}\n{log.read_text()[-3000:]}" for log in engines)
    assert result.returncode == 0, result.stderr[-4000:] + logs
    name = {"start": "gpu-start", "points": "gpu", "overhead": "gpu-overhead", "stop": "gpu-stop"}[
        arguments[1]
    ]
    record: dict[str, Any] = json.loads((out / f"{name}.json").read_text())
    return record


@pytest.fixture(scope="module")
def started(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, Any]]]:
    state = tmp_path_factory.mktemp("gpu-state")
    record = _step(state, state, "--step", "start")
    try:
        yield state, record
    finally:
        _step(state, state, "--step", "stop")


def test_start_leaves_two_cells_of_engines_running_and_records_their_start(
    started: tuple[Path, dict[str, Any]],
) -> None:
    state, record = started
    roles = sorted(e["role"] for e in record["engines"])
    assert roles == ["decode", "decode", "prefill", "prefill"]
    assert set(record["ready_s"]) == {e["name"] for e in record["engines"]}
    # the start step's process has exited; the engines it started answer
    for engine in record["engines"]:
        assert httpx.get(f"{engine['url']}/health", timeout=10).status_code == 200
    # a second start finds them up and starts nothing
    again = _step(state, state, "--step", "start")
    assert again["reused"] is True


def test_each_router_replays_the_trace_with_every_prompt_handed_off(
    started: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    state, _ = started
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in TRACE))
    record = _step(
        state,
        tmp_path,
        "--step",
        "points",
        "--trace",
        str(trace),
        "--window",
        "0:4",
        "--warmup",
        "0",
        "--speedups",
        "1",
        "--repeats",
        "1",
        "--trace-routers",
        "baton,vllm-router",
    )
    assert [p["router"] for p in record["points"]] == ["baton", "vllm-router"]
    assert record["left_out"] == []
    for point in record["points"]:
        assert point["errors"] == 0, point["error_kinds"]
        assert point["requests"] == len(TRACE)
        handoff = point["handoff"]
        # the decode engines pulled every prompt's KV and computed none of it
        assert handoff["decode_computed_tokens"] == 0
        assert handoff["decode_pulled_tokens"] > 0
        # caches were reset before the point: the first prompt was computed in full
        assert 0 <= point["prefix_reuse_achieved"] <= point["prefix_reuse_theoretical"]
    assert record["points"][0]["affinity"]["hit"] + record["points"][0]["affinity"]["miss"] > 0


def test_the_gateways_overhead_is_measured_against_a_client_doing_the_handoff_itself(
    started: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    state, _ = started
    record = _step(state, tmp_path, "--step", "overhead", "--requests", "4")
    assert record["gateway_routing"].get("pd") == 4  # a handoff each, as the direct path does
    for path in ("gateway", "direct"):
        assert record["paths"][path]["requests"] == 4, record["paths"][path]["errors"]
        assert record["paths"][path]["ttft_ms_p50"] > 0
    # a figure, not a verdict: on a shared 2-core host the difference is noise
    assert set(record["added_ms"]) == {"ttft_ms_p50", "end_ms_p50"}
