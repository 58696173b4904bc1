"""``baton bench gpu --engines sim``: the GPU benchmark's steps on ``baton sim`` engines timed by a
profile fitted on a GPU, the points the GPU ran replayed on the simulator's clock."""

from __future__ import annotations

import itertools
import json
import string
import subprocess
from pathlib import Path
from typing import Any

from tokenizers import Regex, Tokenizer, models, pre_tokenizers

from tests.helpers import SMALL_TRACE, bench_gpu


def _step(state: Path, *arguments: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = bench_gpu("sim", state, state, *arguments)
    assert result.returncode == 0 or not check, result.stderr[-4000:]
    return result


def _saved(state: Path, name: str) -> dict[str, Any]:
    record: dict[str, Any] = json.loads((state / f"{name}.json").read_text())
    return record


def _assert_phases(points: list[dict[str, Any]]) -> None:
    """Where the time went, phase by phase, in Baton's point and vllm-router's."""
    for point in points:
        # a decode engine queues a handed-off request while it pulls the KV, then computes
        # the prompt's last token, as vLLM's does
        decode = point["phases"]["decode"]
        pulled = decode["vllm:nixl_xfer_time_seconds"]
        assert decode["vllm:request_queue_time_seconds"] >= pulled > 0
        assert decode["vllm:request_prefill_time_seconds"] > 0
        assert point["phases"]["prefill"]["vllm:time_to_first_token_seconds"] > 0
        assert point["phases"]["client"]["ttft_seconds"] > 0
    baton, vllm_router = points
    # the client waits for all the gateway does before the first byte, and some more
    ttft = baton["phases"]["gateway"]["baton_gateway_time_to_first_token_seconds"]
    assert baton["phases"]["client"]["ttft_seconds"] >= ttft > 0
    assert "gateway" not in vllm_router["phases"]  # vllm-router keeps no such record


def test_the_simulator_runs_the_gpu_points_with_the_profile_fitted_on_a_gpu(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in SMALL_TRACE))
    state = tmp_path / "state"
    _step(state, "--step", "start", "--profile", "deepseek-v2-lite-12l-h200")
    try:
        started = _saved(state, "gpu-start")
        for argv in started["argv"].values():
            assert argv[argv.index("--profile") + 1] == "deepseek-v2-lite-12l-h200"
            assert "--kv-transfer-config" in argv  # the pod's own flags, as the GPU's engines
        # the four engines share one GPU's time, as on the device
        shared = {argv[argv.index("--shared-gpu") + 1] for argv in started["argv"].values()}
        assert len(shared) == 1 and len(started["argv"]) == 4
        _step(
            state,
            "--step",
            "points",
            "--trace",
            str(trace),
            "--window",
            "0:4",
            "--warmup",
            "0",
            "--repeats",
            "1",
        )
        points = _saved(state, "gpu")["points"]
        assert [p["router"] for p in points] == ["baton", "vllm-router"]
        for point in points:
            assert point["errors"] == 0, point["error_kinds"]
            assert point["requests"] == len(SMALL_TRACE)
            assert point["handoff"]["decode_computed_tokens"] == 0
            assert point["handoff"]["decode_pulled_tokens"] > 0
            assert point["sim_steps"]["steps"] > 0  # the simulator's timeline, kept or not
        _assert_phases(points)
        # the profile step measures vLLM: a simulator's clock is its profile already
        refused = _step(state, "--step", "profile", check=False)
        assert refused.returncode != 0
        assert "--engines gpu|cpu" in refused.stderr
    finally:
        _step(state, "--step", "stop")


def _word_tokenizer(folder: Path) -> Path:
    """Tokenizer files of the GPU model's kind (deploy/vllm/gpu/model.py, which needs
    transformers): each word the benchmarks write one token, written with ``tokenizers``."""
    words = (" " + "".join(w) for w in itertools.product(string.ascii_lowercase, repeat=3))
    vocabulary = {token: i for i, token in enumerate(["<|end|>", "<|unk|>", *words])}
    tokenizer = Tokenizer(models.WordLevel(vocabulary, unk_token="<|unk|>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r" ?[^ ]+| "), behavior="isolated")
    folder.mkdir()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end|>"}))
    return folder


def test_the_gateway_can_tokenize_with_the_gpu_models_files_in_front_of_the_simulator(
    tmp_path: Path,
) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in SMALL_TRACE))
    state = tmp_path / "state"
    files = _word_tokenizer(tmp_path / "tokenizer")
    _step(state, "--step", "start", "--gateway-tokenizer", str(files))
    try:
        window = ("--window", "0:4", "--warmup", "0", "--repeats", "1")
        _step(state, "--step", "points", "--trace", str(trace), *window, "--trace-routers", "baton")
        [point] = _saved(state, "gpu")["points"]
        assert point["errors"] == 0, point["error_kinds"]
        # the simulator counts the gateway's ids as the GPU's engines count the text: a token
        # a word, so the trace's lengths hold
        assert point["input_tokens"] == sum(r["input_length"] for r in SMALL_TRACE)
        assert point["phases"]["gateway"]["baton_gateway_phase_seconds/route"] > 0
        assert point["handoff"]["decode_computed_tokens"] == 0
    finally:
        _step(state, "--step", "stop")


def test_startup_starts_the_engines_once_per_case_keeping_the_caches_each_case_names(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state"
    _step(state, "--step", "startup", "--cases", "cold,warm,vllm_cache_only")
    runs = _saved(state, "gpu-startup")["runs"]
    assert [run["case"] for run in runs] == ["cold", "warm", "vllm_cache_only"]
    for run in runs:
        assert len(run["ready_s"]) == 4 and all(s > 0 for s in run["ready_s"].values())
    cold, warm, vllm_only = (run["caches"] for run in runs)
    assert warm == cold
    assert vllm_only["VLLM_CACHE_ROOT"] == cold["VLLM_CACHE_ROOT"]
    for variable in ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR"):
        assert vllm_only[variable] != cold[variable]
    assert not (state / "engines.json").exists()  # every start stopped
    refused = _step(state, "--step", "startup", "--cases", "lukewarm", check=False)
    assert refused.returncode != 0 and "unknown ['lukewarm']" in refused.stderr


def test_agentx_sessions_run_through_each_router_on_the_same_engines(tmp_path: Path) -> None:
    state = tmp_path / "state"
    _step(state, "--step", "start", "--profile", "deepseek-v2-lite-12l-h200")
    try:
        _step(
            state,
            "--step",
            "agentx",
            "--concurrency",
            "2",
            "--agentx-warmup",
            "2",
            "--agentx-duration",
            "8",
            "--repeats",
            "1",
        )
        result = _saved(state, "gpu-agentx")
        assert result["sessions"]["context_cap_range"] == [40_000, 100_000]
        points = result["points"]
        assert [p["router"] for p in points] == ["baton", "vllm-router"]
        for point in points:
            assert point["errors"] == 0, point["error_kinds"]
            assert point["requests"] > 0
            assert 0 < point["prefix_reuse_theoretical"] < 1
            assert point["handoff"]["decode_computed_tokens"] == 0  # every prompt handed off
            assert point["handoff"]["decode_pulled_tokens"] > 0
            assert point["sim_steps"]["steps"] > 0  # the simulator's timeline, kept or not
        _assert_phases(points)
    finally:
        _step(state, "--step", "stop")
