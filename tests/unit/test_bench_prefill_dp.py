"""``baton bench prefill-dp``: the throughput over the window every lagged rank is busy."""

from __future__ import annotations

import pytest

from bench.prefill_dp import counter_at, direction, window_rate


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


def _row(dep: int, lanes: int, costs: dict[int, float]) -> dict[str, object]:
    return {
        "dep": dep,
        "lanes_per_rank": lanes,
        "lag_cost": sum(costs.values()) / len(costs),
        "lag_cost_by_seed": costs,
    }


def test_the_direction_is_judged_on_the_mean_over_seeds_with_each_seeds_verdict_beside_it() -> None:
    rows = [
        _row(2, 8, {1: 0.08, 2: 0.02, 3: 0.03}),
        _row(4, 8, {1: 0.02, 2: 0.09, 3: 0.10}),  # one seed alone points the other way
        _row(2, 2, {1: 0.01, 2: 0.01, 3: 0.01}),
        _row(4, 2, {1: 0.12, 2: 0.11, 3: 0.13}),
    ]
    verdict = direction(rows)
    assert verdict["direction_reproduced"] is True
    assert verdict["seeds_reproducing_direction"] == {"2": 3, "8": 2}


def test_the_direction_fails_when_the_wider_instance_loses_less_at_any_load() -> None:
    rows = [
        _row(2, 8, {1: 0.076}),
        _row(4, 8, {1: 0.023}),
        _row(2, 2, {1: 0.006}),
        _row(4, 2, {1: 0.124}),
    ]
    verdict = direction(rows)
    assert verdict["direction_reproduced"] is False
    assert verdict["seeds_reproducing_direction"] == {"2": 1, "8": 0}
