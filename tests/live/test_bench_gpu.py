"""``baton bench gpu``'s device-side steps on the CPU build of vLLM: the driver that runs on a
lent GPU machine (two one-tray cells started detached, a trace replayed through each router,
every handoff counted, the engines stopped) exercised here, so that it cannot rot between GPU
runs. The GPU's own figures come only from a GPU (docs/benchmarks.md)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from baton.core.profile import FrontendProfile, load_profile
from tests.helpers import SMALL_TRACE, bench_gpu


def _step(state: Path, out: Path, *arguments: str) -> dict[str, Any]:
    result = bench_gpu("cpu", state, out, *arguments)
    engines = sorted((state / "engines").glob("*.log"))
    logs = "".join(f"\n--- {log.name}\n{log.read_text()[-3000:]}" for log in engines)
    assert result.returncode == 0, result.stderr[-4000:] + logs
    name = {
        "start": "gpu-start",
        "points": "gpu",
        "overhead": "gpu-overhead",
        "profile": "gpu-profile",
        "hazards": "gpu-hazards",
        "share": "gpu-share",
        "frontend": "gpu-frontend",
        "stop": "gpu-stop",
    }[arguments[1]]
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
    trace.write_text("".join(json.dumps(r) + "\n" for r in SMALL_TRACE))
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
        assert point["requests"] == len(SMALL_TRACE)
        handoff = point["handoff"]
        # the decode engines pulled every prompt's KV and computed none of it
        assert handoff["decode_computed_tokens"] == 0
        assert handoff["decode_pulled_tokens"] > 0
        # caches were reset before the point: the first prompt was computed in full
        assert 0 <= point["prefix_reuse_achieved"] <= point["prefix_reuse_theoretical"]
    assert record["points"][0]["affinity"]["hit"] + record["points"][0]["affinity"]["miss"] > 0
    assert set(record["points"][0]["not_reused_tokens"]) == {"routed_away", "absent"}


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


def test_the_engines_step_times_are_measured_and_the_simulators_profile_fitted_to_them(
    started: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    state, _ = started
    record = _step(state, tmp_path, "--step", "profile")
    samples = record["samples"]
    grid = record["grid"]
    assert len(samples["prefill"]) == len(grid["prefill"]) * grid["repeats"]
    assert len(samples["decode"]) == len(grid["decode"]) * grid["repeats"]
    assert len(samples["handoff"]) == len(grid["handoff"]) * grid["repeats"]
    # a shape asked for with a cached context was served on it: the prefix cache held it
    cached = [s for s in samples["prefill"] if s["context_tokens"] > 0]
    assert len(cached) == sum(1 for _, c in grid["prefill"] if c) * grid["repeats"]
    assert all(s["seconds"] > 0 for kind in samples.values() for s in kind)
    assert all(s["bytes"] > 0 for s in samples["handoff"])
    if record["fit_error"] is not None:
        # a CPU's pulls take as long for 4 MiB as for 128 KiB on a busy host: no bandwidth to
        # fit, which the record says instead of writing a profile (sim/fit.py's own tests fit)
        assert "handoff" in record["fit_error"] or "decode" in record["fit_error"]
        assert not (tmp_path / "gpu-profile.yaml").exists()
        return
    # the fitted profile loads as the simulator's own, with the engine's chunk and KV size
    fitted = load_profile(tmp_path / "gpu-profile.yaml")
    assert fitted.prefill.max_num_batched_tokens == record["max_num_batched_tokens"]
    assert fitted.kv_bytes_per_token * record["kv_cache_tokens"] == pytest.approx(
        fitted.kv_cache_bytes_per_gpu, rel=0.01
    )
    assert len(record["residuals"]) == sum(len(kind) for kind in samples.values())


def test_engines_stepping_at_once_are_timed_against_each_alone(
    started: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    state, _ = started
    record = _step(state, tmp_path, "--step", "share")
    # every engine of every case, each round, timed from its own histogram
    expected = sorted(
        (round_, case, engine)
        for round_ in range(record["shapes"]["repeats"])
        for case, engines in record["cases"].items()
        for engine in engines
    )
    assert sorted((s["round"], s["case"], s["engine"]) for s in record["samples"]) == expected
    assert all(s["seconds"] > 0 for s in record["samples"])
    assert set(record["stretch"]) == {c for c in record["cases"] if not c.endswith("alone")}
    assert set(record["shared_gpu"]) == {
        f"{me}_beside_{peer}" for me in ("prefill", "decode") for peer in ("prefill", "decode")
    }


def test_the_api_servers_time_before_the_queue_is_measured_for_text_and_ids(
    started: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    state, _ = started
    record = _step(state, tmp_path, "--step", "frontend")
    forms = [(s["form"], s["prompt_tokens"]) for s in record["samples"]]
    assert {form for form, _ in forms} == {"text", "ids"}
    # the ids /tokenize gave are the text's: the engine counts the same prompt either way
    for text_form, ids_form in zip(forms[::2], forms[1::2], strict=True):
        assert text_form[0] == "text" and ids_form[0] == "ids"
        assert text_form[1] == ids_form[1]
    assert all(s["before_queue_s"] >= 0 for s in record["samples"])
    # what the simulator's profile takes, loadable as its own
    FrontendProfile.model_validate(record["frontend"])


def test_the_live_hazards_meet_vllm_as_it_is_and_the_gateway_handles_each(
    started: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    """Last in this module: its final case kills a decode engine."""
    state, _ = started
    cases = _step(state, tmp_path, "--step", "hazards")["cases"]
    # what vLLM does, sent by hand (the CPU build; tests/live/test_sim_follows_vllm.py)
    assert cases["replayed_handoff"]["statuses"] == [200, 200]
    assert cases["unknown_engine"]["status"] == 500
    assert cases["unreachable_side_channel"]["engine_status"] == 500
    for name in ("aborted_stream_engine", "aborted_stream_gateway"):
        aborted = cases[name]
        assert aborted["finished"] == 0 and aborted["generated"] < aborted["max_tokens"], aborted
        assert aborted["decode_healthy"]
    # what the gateway makes of them: every client answered, the decode engine alive
    short = cases["short_block_ids"]
    assert short["status"] == 200 and short["decode_healthy"] and short["gateway_fallbacks"] == 1
    assert short["decode_prompt_tokens"]["external_kv_transfer"] == 0  # decoded alone
    unreachable = cases["unreachable_side_channel"]
    assert unreachable["status"] == 200 and unreachable["gateway_decode_retries"] == 1
    assert unreachable["decode_healthy"]
    killed = cases["decode_killed_mid_request"]
    assert killed["killed"] and killed["statuses_after"] == [200, 200, 200]
    # the client is told the stream broke: an SSE error event, then [DONE]
    assert killed["error_event"] and killed["last_chunks"][-1] == "data: [DONE]", killed
