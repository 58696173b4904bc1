"""Rebalance decisions (eplb.decide): cadence, window use and the gain rule."""

import numpy as np
import pytest

from baton.core.experts import Placement, balance
from eplb.algorithm import rebalance
from eplb.decide import Outcome, Policy, decide, due_boundary, predict_fitted_balance
from eplb.window import Window

POLICY = Policy(window_size=100, step_interval=300)


@pytest.mark.parametrize(
    ("completed_end", "last", "due"),
    [
        pytest.param(299, None, None, id="before the first boundary"),
        pytest.param(300, None, 300, id="on the first boundary"),
        pytest.param(450, 300, None, id="between boundaries"),
        pytest.param(600, 300, 600, id="on the next boundary"),
        pytest.param(1250, 300, 1200, id="behind: only the newest boundary"),
        pytest.param(1250, 1200, None, id="newest already decided"),
    ],
)
def test_decisions_fall_on_interval_boundaries(
    completed_end: int, last: int | None, due: int | None
) -> None:
    assert due_boundary(completed_end, last, POLICY) == due


STUDY = Policy(window_size=1000, step_interval=3000)  # vLLM's defaults and the study's cadence


@pytest.mark.parametrize(
    ("completed_end", "last", "due", "window"),
    [
        pytest.param(2999, None, None, None, id="before step 3,000"),
        pytest.param(3000, None, 3000, (2000, 3000), id="step 3,000 uses steps 2,000-2,999"),
        pytest.param(5999, 3000, None, None, id="nothing between boundaries"),
        pytest.param(6000, 3000, 6000, (5000, 6000), id="step 6,000 uses steps 5,000-5,999"),
    ],
)
def test_study_cadence_rebalances_every_3000_steps_from_the_last_1000(
    completed_end: int, last: int | None, due: int | None, window: tuple[int, int] | None
) -> None:
    boundary = due_boundary(completed_end, last, STUDY)
    assert boundary == due
    if boundary is not None:
        assert STUDY.window_for(boundary) == window


def skewed_window(seed: int = 0, scale: float = 1e6) -> Window:
    rng = np.random.default_rng(seed)
    load = np.rint(rng.lognormal(0.0, 1.0, size=(4, 64)) * scale).astype(np.int64)
    return Window(200, 300, 100, load, 0.5)


def test_a_skewed_window_is_rebalanced_with_the_predicted_gain() -> None:
    current = Placement.contiguous(4, 64, 16)
    current = Placement.from_phy2log(
        np.concatenate([current.phy2log, current.phy2log[:, :16]], axis=1), 16, 64
    )
    window = skewed_window()
    decision = decide(window, current, POLICY, 300)
    assert decision.outcome is Outcome.REBALANCE
    assert (decision.window_first, decision.window_end) == (200, 300)
    assert decision.balance_before == pytest.approx(balance(window.load, current))
    assert decision.balance_fitted == pytest.approx(balance(window.load, decision.placement))
    assert decision.balance_after <= decision.balance_fitted
    assert decision.gain >= POLICY.min_gain
    assert decision.moved_experts > 0


def test_a_placement_already_fitted_to_the_window_is_kept() -> None:
    window = skewed_window()
    current = rebalance(window.load, 16, 16)
    decision = decide(window, current, POLICY, 300)
    assert decision.outcome is Outcome.GAIN_TOO_SMALL
    assert decision.placement is current
    assert decision.moved_experts == 0


def test_an_incomplete_window_is_not_decided_on() -> None:
    window = skewed_window()
    partial = Window(200, 300, 60, window.load, 0.5)
    current = Placement.contiguous(4, 64, 16)
    decision = decide(partial, current, POLICY, 300)
    assert decision.outcome is Outcome.INCOMPLETE_WINDOW
    assert decision.placement is current


def test_no_boundary_is_decided_while_the_last_switch_waits_for_its_step() -> None:
    # Seen in make demo: the boundary at step 1000 came while the switch decided at 500 waited
    # for step 1075; the agents refused the new Prepare and the service counted prepare_failed.
    current = Placement.contiguous(4, 64, 16)
    current = Placement.from_phy2log(
        np.concatenate([current.phy2log, current.phy2log[:, :16]], axis=1), 16, 64
    )
    decision = decide(skewed_window(), current, POLICY, 300, switch_pending=True)
    assert decision.outcome is Outcome.SWITCH_PENDING
    assert decision.placement is current
    assert decision.moved_experts == 0


def test_sampling_noise_lowers_the_predicted_balance_of_a_fitted_placement() -> None:
    window = skewed_window(scale=10.0)  # few tokens: noise is a large share of rank load
    placement = rebalance(window.load, 16, 16)
    assert predict_fitted_balance(window.load, placement) < balance(window.load, placement) - 0.01
    large = skewed_window(scale=1e7)
    placement = rebalance(large.load, 16, 16)
    assert predict_fitted_balance(large.load, placement) == pytest.approx(
        balance(large.load, placement), abs=1e-3
    )


def test_noise_alone_is_not_worth_a_rebalance() -> None:
    # Uniform routing: every window differs only by sampling noise.
    rng = np.random.default_rng(4)
    first = rng.multinomial(100 * 1536, np.full(64, 1 / 64), size=4)
    current = rebalance(first, 16, 16)
    later = Window(200, 300, 100, rng.multinomial(100 * 1536, np.full(64, 1 / 64), size=4), 0.9)
    assert decide(later, current, POLICY, 300).outcome is Outcome.GAIN_TOO_SMALL


def test_a_window_longer_than_the_interval_is_refused() -> None:
    with pytest.raises(ValueError, match="window_size"):
        Policy(window_size=400, step_interval=300)
