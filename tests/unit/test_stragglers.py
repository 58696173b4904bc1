"""Straggler detection and the move decision (``controller.stragglers``), as properties."""

from __future__ import annotations

import random
from datetime import UTC, datetime, timedelta

from hypothesis import given
from hypothesis import strategies as st

from controller.stragglers import (
    Degraded,
    GpuClock,
    StragglerWatch,
    clock_outliers,
    degraded_marks,
    move_decision,
    reason_names,
    worth_moving,
)
from controller.topology import Degradation, tray_degradation

NOMINAL = 1900.0


def group(noise: list[float]) -> list[GpuClock]:
    """A DEP32 group's 32 GPUs on 8 trays, each at the nominal clock less its noise share."""
    return [
        GpuClock(f"tray-{i // 4}", str(i % 4), NOMINAL * (1.0 - abs(share)))
        for i, share in enumerate(noise)
    ]


# healthy GPUs: boost clocks wander up to 2% below the nominal between windows
healthy_noise = st.lists(st.floats(-0.02, 0.02), min_size=32, max_size=32)


@given(healthy_noise)
def test_healthy_gpus_wandering_a_few_percent_are_never_outliers(noise: list[float]) -> None:
    assert clock_outliers(group(noise)) == []


@given(healthy_noise, st.integers(0, 31), st.floats(0.3, 0.9))
def test_one_throttled_gpu_is_the_one_outlier_wherever_it_sits(
    noise: list[float], where: int, share: float
) -> None:
    clocks = group(noise)
    slow = clocks[where]
    clocks[where] = GpuClock(slow.tray, slow.gpu, NOMINAL * share, 0x40)
    assert clock_outliers(clocks) == [clocks[where]]


@given(st.lists(st.floats(100.0, 3000.0), min_size=4, max_size=64))
def test_never_more_than_half_a_group_is_called_slow(clocks: list[float]) -> None:
    # the median is the group's pace: at most the GPUs below it can be outliers
    gpus = [GpuClock(f"tray-{i // 4}", str(i % 4), c) for i, c in enumerate(clocks)]
    assert len(clock_outliers(gpus)) <= len(gpus) // 2


@given(st.lists(st.booleans(), min_size=1, max_size=20), st.integers(1, 5))
def test_a_tray_is_degraded_only_after_persist_outlier_windows_in_a_row(
    windows: list[bool], persist: int
) -> None:
    watch = StragglerWatch(persist=persist)
    rng = random.Random(0)
    run = 0
    for index, throttled in enumerate(windows):
        clocks = group([rng.uniform(-0.01, 0.01) for _ in range(32)])
        if throttled:
            clocks[5] = GpuClock("tray-1", "1", NOMINAL * 0.7, 0x40)
        run = run + 1 if throttled else 0  # one clean window forgets the run
        degraded = watch.observe(float(index), clocks)
        if run >= persist:
            [verdict] = degraded
            assert (verdict.tray, verdict.gpu) == ("tray-1", "1")
            assert verdict.since == float(index - run + 1)
            assert verdict.reasons == ("hw_thermal_slowdown",)
        else:
            assert degraded == []


def test_a_verdict_says_how_slow_and_why() -> None:
    verdict = Degraded("tray-3", "2", 0.7, reason_names(0x40 | 0x4), 10.0)
    assert verdict.message == (
        "GPU 2 runs at 70% of its decode group's median SM clock "
        "(sw_power_cap, hw_thermal_slowdown)"
    )


@given(st.floats(1.0, 5.0), st.floats(0.0, 1e5), st.floats(0.0, 1e4), st.floats(0.0, 1.0))
def test_moving_pays_only_past_the_restart_and_stays_paying(
    slowdown: float, degraded_for: float, restart: float, more: float
) -> None:
    if worth_moving(slowdown, degraded_for, restart):
        # a worse or longer slowdown never makes the move worth less
        assert worth_moving(slowdown + more, degraded_for, restart)
        assert worth_moving(slowdown, degraded_for + more, restart)
        assert degraded_for > restart  # it never pays before one restart's time has passed
    assert not worth_moving(1.0, degraded_for, restart)


def test_a_gpu_at_70_percent_is_moved_once_it_cost_a_restart() -> None:
    # 1/0.7 as long a step: 30% of the group's capacity lost while it stays
    assert not worth_moving(1 / 0.7, 599.0, 180.0)
    assert worth_moving(1 / 0.7, 601.0, 180.0)


T0 = datetime(2026, 12, 5, 12, 0, tzinfo=UTC)


@given(st.floats(1.01, 5.0), st.floats(0.0, 1e5), st.floats(1.0, 1e4))
def test_a_group_not_moved_yet_is_told_when_its_move_pays(
    slowdown: float, degraded_for: float, restart: float
) -> None:
    mark = Degradation("GPU 1 slow", T0, slowdown)
    move = move_decision("tray-3", mark, T0 + timedelta(seconds=degraded_for), restart)
    assert move.now == worth_moving(slowdown, degraded_for, restart)
    if not move.now:
        assert move.pays_in_s is not None and move.pays_in_s >= 0
        later = T0 + timedelta(seconds=degraded_for + move.pays_in_s + 1e-3)
        assert move_decision("tray-3", mark, later, restart).now


def test_a_tray_marked_by_hand_moves_at_once() -> None:
    move = move_decision("tray-3", Degradation("fan failing"), T0, 300.0)
    assert move.now and move.why == "tray-3 marked degraded by hand (fan failing)"


def test_the_marks_a_verdict_writes_read_back_as_the_same_degradation() -> None:
    verdict = Degraded("tray-3", "1", 0.7, ("hw_thermal_slowdown",), 4.0)
    marks = degraded_marks(verdict, T0)
    assert marks == {
        "baton.dev/degraded": "GPU 1 runs at 70% of its decode group's median SM clock "
        "(hw_thermal_slowdown)",
        "baton.dev/degraded-since": "2026-12-05T12:00:00Z",
        "baton.dev/degraded-slowdown": "1.429",
    }
    assert tray_degradation(marks) == Degradation(marks["baton.dev/degraded"], T0, 1.429)


def test_marks_that_do_not_parse_read_as_marked_by_hand_and_false_as_none() -> None:
    bad = {
        "baton.dev/degraded": "slow",
        "baton.dev/degraded-since": "yesterday",
        "baton.dev/degraded-slowdown": "0.5",
    }
    assert tray_degradation(bad) == Degradation("slow")
    assert tray_degradation({"baton.dev/degraded": "false"}) is None
    assert tray_degradation({}) is None
