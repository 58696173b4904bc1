"""Load windows (eplb.window): reports in, complete steps and windows out."""

import tracemalloc

import numpy as np

from baton.core.eplb_wire import LoadReport
from baton.core.experts import Placement
from eplb.window import LoadWindow, Verdict

# Two ranks of three slots over four experts; expert 0 has a replica on each rank.
PLACEMENT = Placement.from_phy2log(np.array([[0, 1, 2, 0, 3, 3]]), num_ranks=2)


def report(rank: int, first: int, steps: int, value: int = 1, version: int = 0) -> LoadReport:
    return LoadReport(rank, first, np.full((steps, 1, 3), value, dtype=np.uint32), version)


def test_a_step_is_complete_only_once_every_rank_reported_it() -> None:
    window = LoadWindow(PLACEMENT, 0, capacity=100)
    assert window.add(report(0, 0, 10)) is Verdict.ACCEPTED
    assert window.completed_end == -1
    assert window.add(report(1, 0, 10)) is Verdict.ACCEPTED
    assert window.completed_end == 10


def test_replicas_are_summed_into_logical_expert_load() -> None:
    window = LoadWindow(PLACEMENT, 0, capacity=100)
    window.add(report(0, 0, 4))
    window.add(report(1, 0, 4, value=2))
    # Per step: expert 0 gets 1 (rank 0) + 2 (rank 1), experts 1 and 2 get 1, expert 3 gets 2+2.
    assert window.window(0, 4).load.tolist() == [[12, 4, 4, 16]]


def test_step_balance_is_mean_over_max_rank_load() -> None:
    window = LoadWindow(PLACEMENT, 0, capacity=100)
    window.add(report(0, 0, 1))
    window.add(report(1, 0, 1, value=3))
    assert window.window(0, 1).step_balance == (3 + 9) / 2 / 9


def test_a_window_holds_exactly_its_range_of_steps() -> None:
    window = LoadWindow(PLACEMENT, 0, capacity=100)
    for first in range(0, 40, 10):
        window.add(report(0, first, 10))
        window.add(report(1, first, 10))
    span = window.window(15, 35)
    assert (span.steps, span.complete) == (20, True)
    assert span.load.sum() == 20 * 6


def test_a_ring_forgets_steps_older_than_its_capacity() -> None:
    window = LoadWindow(PLACEMENT, 0, capacity=20)
    for first in range(0, 40, 10):
        window.add(report(0, first, 10))
        window.add(report(1, first, 10))
    assert window.window(0, 20).steps == 0
    assert window.window(20, 40).complete


def test_stale_and_out_of_order_reports_are_dropped() -> None:
    window = LoadWindow(PLACEMENT, 0, capacity=100)
    window.add(report(0, 10, 10))
    assert window.add(report(0, 0, 10)) is Verdict.STALE
    window.add(report(1, 10, 10))
    assert window.add(report(1, 5, 10)) is Verdict.STALE


def test_a_report_of_an_unknown_placement_version_is_dropped_until_expected() -> None:
    window = LoadWindow(PLACEMENT, 0, capacity=100)
    assert window.add(report(0, 0, 10, version=1)) is Verdict.UNKNOWN_VERSION
    window.expect(1, PLACEMENT)
    assert window.add(report(0, 0, 10, version=1)) is Verdict.ACCEPTED


def test_a_report_of_the_wrong_shape_is_dropped() -> None:
    window = LoadWindow(PLACEMENT, 0, capacity=100)
    wrong = LoadReport(0, 0, np.ones((10, 1, 4), dtype=np.uint32), 0)
    assert window.add(wrong) is Verdict.WRONG_SHAPE


def test_a_gap_leaves_the_window_incomplete() -> None:
    window = LoadWindow(PLACEMENT, 0, capacity=100)
    for first in (0, 20):  # steps 10..19 were lost
        window.add(report(0, first, 10))
        window.add(report(1, first, 10))
    span = window.window(0, 30)
    assert (span.steps, span.complete) == (20, False)


def test_a_batch_some_rank_never_reported_is_given_up_once_a_later_one_completes() -> None:
    window = LoadWindow(PLACEMENT, 0, capacity=100)
    window.add(report(0, 0, 10))  # rank 1's report of steps 0..9 is lost
    window.add(report(0, 10, 10))
    window.add(report(1, 10, 10))
    assert window.completed_end == 20
    assert window.add(report(1, 0, 10)) is Verdict.STALE


def test_older_versions_are_forgotten_once_a_newer_step_is_complete() -> None:
    window = LoadWindow(PLACEMENT, 0, capacity=100)
    window.expect(1, PLACEMENT)
    window.add(report(0, 0, 10, version=1))
    window.add(report(1, 0, 10, version=1))
    assert window.window(0, 10).versions == {1}
    assert window.add(report(0, 10, 10, version=0)) is Verdict.UNKNOWN_VERSION


def test_restart_forgets_every_step() -> None:
    window = LoadWindow(PLACEMENT, 0, capacity=100)
    window.add(report(0, 0, 10))
    window.add(report(1, 0, 10))
    window.restart(PLACEMENT, 0)
    assert window.completed_end == -1
    assert window.window(0, 10).steps == 0
    assert window.add(report(0, 0, 10)) is Verdict.ACCEPTED


def test_a_window_sums_the_ring_in_place_without_copying_its_steps() -> None:
    # A copy of the selected rows costs [steps, layers, experts] int64 per call (26 MiB for
    # 200 steps of DeepSeek's 43 layers x 384 experts); churn of that size fragmented the
    # service's heap in the soak. Summing contiguous runs of the ring allocates only the sum.
    placement = Placement.contiguous(layers=43, logical_experts=384, num_ranks=2)
    window = LoadWindow(placement, 0, capacity=300)
    for first in range(0, 400, 50):
        for rank in range(2):
            counts = np.ones((50, 43, 192), dtype=np.uint32)
            window.add(LoadReport(rank, first, counts, 0))
    one_sum = 43 * 384 * 8
    tracemalloc.start()
    try:
        span = window.window(120, 390)  # wraps around the ring's end
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert span.steps == 270 and span.load.sum() == 270 * 43 * 384
    assert peak < 4 * one_sum, f"window() allocated {peak} bytes; the sum alone is {one_sum}"
