"""The EPLB step of the GPU benchmark, its pure parts: vLLM's rearrangement lines, cadences, the
skewed prompts and the comparison of the arms (the step on live engines: tests/live)."""

from __future__ import annotations

from typing import Any

import pytest

from bench.eplb_engines import Cadence, compare_arms, rearrangements
from bench.workload import topic_text


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
        "experts_moved": moved,
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
    assert row["experts_moved_ratio"] == pytest.approx(0.1)
    assert row["rearrangement_total_s_ratio"] == pytest.approx(0.25)
    assert row["balance_measured"] == pytest.approx({"vllm_default": 0.7, "baton": 0.8})
    assert row["output_tokens_per_s_ratio"] == pytest.approx(1.0)
