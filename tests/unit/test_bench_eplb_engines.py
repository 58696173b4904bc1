"""The EPLB step of the GPU benchmark, its pure parts: vLLM's rearrangement lines, cadences, the
skewed prompts and the comparison of the arms (the step on live engines: tests/live)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench.eplb_engines import Cadence, compare_arms, ranks_of, rearrangements
from bench.workload import topic_text
from rigs.vllm_live import GpuVllm, LiveEngine


def test_rank_0s_rearrangements_are_counted_and_timed_from_its_log_but_the_start_up_runs() -> None:
    # as vLLM 0.26 and 0.33 write them (eplb_state.py's format strings and arguments)
    log = "\n".join(
        [
            "INFO [eplb_state.py:787] Rearranging experts sync mode (profile)...",
            "INFO [eplb_state.py:959] Rearranged experts  (profile)  in 2.00 s.",
            "INFO [eplb_state.py:787] Rearranging experts sync mode ...",
            "INFO [eplb_state.py:959] Rearranged experts   in 0.12 s.",
            "INFO some other line in 3.00 s.",
            "INFO [eplb_state.py:787] Rearranging experts sync mode ...",
            "INFO [eplb_state.py:959] Rearranged experts   in 0.07 s.",
            "INFO [eplb_state.py:787] Rearranging experts (async mode) ...",
        ]
    )
    assert rearrangements(log) == (3, [0.12, 0.07])


def test_a_cadence_is_steps_over_window() -> None:
    cadence = Cadence.parse("3000/1000")
    assert (cadence.step_interval, cadence.window_size, str(cadence)) == (3000, 1000, "3000/1000")
    for bad in ("3000", "a/b", "100/200", "0/0"):
        with pytest.raises(SystemExit):
            Cadence.parse(bad)


def test_a_topics_prompts_draw_on_its_few_words_and_another_topic_on_others() -> None:
    first = {topic_text(seed, 200, 0) for seed in range(5)}
    assert len(first) == 5  # prompts of their own
    words = {text[i : i + 4] for text in first for i in range(0, 800, 4)}
    assert len(words) <= 16
    other = {topic_text(0, 200, 1)[i : i + 4] for i in range(0, 800, 4)}
    assert words.isdisjoint(other)
    assert topic_text(3, 50, 2) == topic_text(3, 50, 2)


def _arm(policy: str, moved: int, pause: float, balance: float) -> dict[str, Any]:
    return {
        "cadence": "16/8",
        "policy": policy,
        "experts_moved_per_window": moved,
        "rearrangement_total_s": pause,
        "output_tokens_per_s": 100.0,
        "balance_measured": balance,
    }


def test_the_comparison_sets_batons_arms_beside_vllms_by_cadence() -> None:
    [row] = compare_arms(
        [
            _arm("vllm_default", 40, 2.0, 0.8),
            _arm("baton", 4, 0.5, 0.9),
            _arm("vllm_default", 60, 4.0, 0.6),
            _arm("baton", 6, 1.0, 0.7),
        ]
    )
    assert row["cadence"] == "16/8"
    assert row["experts_moved_per_window_ratio"] == pytest.approx(0.1)
    assert row["rearrangement_total_s_ratio"] == pytest.approx(0.25)
    assert row["balance_measured"] == pytest.approx({"vllm_default": 0.7, "baton": 0.8})
    assert row["output_tokens_per_s_ratio"] == pytest.approx(1.0)


def test_each_pod_on_a_machine_of_several_gpus_sees_its_own_as_a_device_plugin_gives_them() -> None:
    machine = GpuVllm(site=Path("site"), models=Path("models"), gpus=4)
    # a pod per rank, then pods of two ranks: each takes the next GPUs
    assert [machine.pod_environment(i, 1) for i in range(2)] == [
        {"CUDA_VISIBLE_DEVICES": "0"},
        {"CUDA_VISIBLE_DEVICES": "1"},
    ]
    assert machine.pod_environment(1, 2) == {"CUDA_VISIBLE_DEVICES": "2,3"}
    # one GPU: every pod shares it, as the one-GPU benchmark's four engines do
    assert GpuVllm(site=Path("site"), models=Path("models")).pod_environment(3, 1) == {}


def test_a_pod_of_several_ranks_is_reached_rank_by_rank_by_its_local_index() -> None:
    pods = [
        LiveEngine("p0", "decode", "http://a", 0, [], {}, None, Path("a.log")),  # type: ignore[arg-type]
        LiveEngine("p1", "decode", "http://b", 0, [], {}, None, Path("b.log")),  # type: ignore[arg-type]
    ]
    assert [(r.url, r.headers) for r in ranks_of(pods, 1)] == [("http://a", {}), ("http://b", {})]
    assert [(r.url, r.headers) for r in ranks_of(pods[:1], 2)] == [
        ("http://a", {"X-data-parallel-rank": "0"}),
        ("http://a", {"X-data-parallel-rank": "1"}),
    ]
