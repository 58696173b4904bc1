"""One test per calibration point of the performance model (the study's figures)."""

from __future__ import annotations

import pytest

from baton.core.perf import PrefillChunk, RankBatch, expected_tokens_per_step, step_seconds
from baton.core.profile import load_profile

PROFILE = load_profile()
K128 = 128 * 1024
K855 = 855 * 1024


def decode_group(
    requests_per_rank: int, tokens_per_request: int, context: int, ranks: int = 32
) -> list[RankBatch]:
    query = requests_per_rank * tokens_per_request
    return [
        RankBatch(requests_per_rank, query, requests_per_rank * context * tokens_per_request)
    ] * ranks


def test_8k_prefill_on_empty_context_takes_87_9_ms() -> None:
    step = step_seconds(PROFILE, [RankBatch(prefill_chunks=(PrefillChunk(8192, 0),)), RankBatch()])
    assert step.total_s == pytest.approx(0.0879, rel=0.01)


def test_8k_prefill_on_512k_cached_context_takes_189_4_ms() -> None:
    chunk = PrefillChunk(8192, 512 * 1024)
    step = step_seconds(PROFILE, [RankBatch(prefill_chunks=(chunk,)), RankBatch()])
    assert step.total_s == pytest.approx(0.1894, rel=0.01)


def test_dep32_decode_at_64_requests_per_gpu_is_6_ms_moe_plus_10_ms_rest() -> None:
    step = step_seconds(PROFILE, decode_group(64, 4, K128), target_balance=0.94)
    assert step.moe_s == pytest.approx(0.0060, rel=0.02)
    assert step.rest_s == pytest.approx(0.0100, rel=0.02)


def test_128k_to_855k_context_adds_about_7_percent_to_the_target_forward() -> None:
    short = step_seconds(PROFILE, decode_group(16, 6, K128), target_balance=0.94)
    long = step_seconds(PROFILE, decode_group(16, 6, K855), target_balance=0.94)
    added = (long.moe_s + long.rest_s) - (short.moe_s + short.rest_s)
    assert added == pytest.approx(0.0006, rel=0.1)
    assert added / (short.moe_s + short.rest_s) == pytest.approx(0.07, abs=0.01)


def test_mtp_with_three_draft_tokens_emits_several_tokens_per_step() -> None:
    assert expected_tokens_per_step(3, 0.7) == pytest.approx(1 + 0.7 + 0.49 + 0.343)
    assert expected_tokens_per_step(0, 0.7) == 1.0


def test_mtp_adds_a_draft_forward_per_draft_token() -> None:
    plain = step_seconds(PROFILE, decode_group(64, 1, K128))
    mtp = step_seconds(PROFILE, decode_group(64, 4, K128), num_speculative_tokens=3)
    assert plain.draft_s == 0
    assert mtp.draft_s == pytest.approx(
        3 * (PROFILE.decode.draft_fixed_s + PROFILE.decode.draft_per_token_s * 64 * 0.94)
    )


def test_moe_time_is_set_by_the_most_loaded_rank_as_balance_falls() -> None:
    group = decode_group(64, 4, K128)
    balanced = step_seconds(PROFILE, group, target_balance=0.94).moe_s
    skewed = step_seconds(PROFILE, group, target_balance=0.35).moe_s
    token_part = balanced - PROFILE.decode.moe_fixed_s
    assert skewed - PROFILE.decode.moe_fixed_s == pytest.approx(token_part * 0.94 / 0.35)


def test_uneven_requests_per_rank_cost_the_whole_group() -> None:
    even = [RankBatch(64, 256, 64 * K128 * 4)] * 32
    uneven = [RankBatch(96, 384, 96 * K128 * 4)] * 16 + [RankBatch(32, 128, 32 * K128 * 4)] * 16
    # Same requests in total, same MoE load: the slowest rank sets the step.
    assert step_seconds(PROFILE, uneven).moe_s == pytest.approx(step_seconds(PROFILE, even).moe_s)
    assert step_seconds(PROFILE, uneven).total_s > step_seconds(PROFILE, even).total_s * 1.15


def test_idle_rank_still_runs_a_dummy_batch() -> None:
    busy = RankBatch(1, 1, K128)
    assert step_seconds(PROFILE, [busy, RankBatch()]).rest_s == pytest.approx(
        step_seconds(PROFILE, [busy, busy]).rest_s
    )
