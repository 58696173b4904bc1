"""``baton bench prefill-dp``: the throughput over the window every lagged rank is busy."""

from __future__ import annotations

import pytest

from bench.prefill_dp import counter_at, window_rate


def test_the_counter_is_read_between_samples_by_interpolation() -> None:
    samples = [(0.0, 0.0), (2.0, 100.0), (4.0, 500.0)]
    assert counter_at(samples, 1.0) == pytest.approx(50.0)
    assert counter_at(samples, 3.0) == pytest.approx(300.0)
    assert counter_at(samples, 9.0) == 500.0  # after the last sample: the last value


def test_the_rate_covers_only_the_window_and_is_shared_by_the_instances_gpus() -> None:
    samples = [(0.0, 0.0), (5.0, 1000.0), (15.0, 21000.0), (20.0, 22000.0)]
    rate = window_rate(samples, (5.0, 15.0), gpus=2)
    assert rate["computed_tokens_per_s"] == pytest.approx(2000.0)
    assert rate["computed_tokens_per_s_per_gpu"] == pytest.approx(1000.0)
