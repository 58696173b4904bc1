"""A throttled GPU in the performance model: one slow rank sets the pace of its whole group."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from baton.core.perf import RankBatch, step_seconds
from baton.core.profile import load_profile

PROFILE = load_profile()
# The study's DEP32 decode: 16 requests a rank, 1 + 5 DSpark tokens each, 128K-token contexts.
RANK = RankBatch(16, 16 * 6, 16 * 6 * 131_072.0)


def step(shares: list[float]) -> float:
    ranks = [replace(RANK, clock_share=share) for share in shares]
    return step_seconds(PROFILE, ranks, num_speculative_tokens=5).total_s


def test_one_gpu_at_70_percent_slows_every_step_of_a_dep32_group_by_its_compute() -> None:
    healthy = step([1.0] * 32)
    throttled = step([1.0] * 31 + [0.7])
    # everything but EPLB's copies is compute that waits for the slowest GPU
    assert throttled == pytest.approx(healthy / 0.7)


@given(
    st.lists(st.floats(0.3, 1.0), min_size=2, max_size=32),
    st.integers(0, 31),
)
def test_a_step_is_as_slow_as_its_slowest_gpu_makes_it_wherever_that_gpu_sits(
    shares: list[float], where: int
) -> None:
    # the same slowest clock anywhere in the group: the same step
    slowest = min(shares)
    moved = sorted(shares, reverse=True)
    moved.insert(where % len(moved), moved.pop())
    assert step(moved) == pytest.approx(step(shares))
    # never faster than the healthy group, never slower than all of it at the slowest clock
    assert step([1.0] * len(shares)) <= step(shares) <= step([slowest] * len(shares)) + 1e-12
