"""When the EPLB service rebalances a decode group's model, and whether a rebalance is worth it.

Cadence (vLLM's): decisions fall on step boundaries ``k * step_interval`` (engine steps with real
decode tokens, ``k >= 1``), each using the window of the ``window_size`` steps just before it,
``[b - window_size, b)``. A service that falls behind decides only on the newest boundary it has
data for; older ones are skipped, never replayed.

Decision at a boundary, for one model:

0. No decision while the model's last committed switch has not reached its step: skip
   (``switch_pending``). An agent holds one committed switch at a time and refuses a new
   Prepare until it applies, and the window describes a placement about to be replaced.
1. The window must be complete (every step of it reported by every rank); otherwise skip
   (``incomplete_window``): a partial window after a restart or a lost report would describe
   fewer steps than the policy promises.
2. Compute a placement from the window's load with the current one as ``previous``
   (``eplb.algorithm.rebalance``: experts stay where they are unless moving them buys
   more than ``tolerance`` of balance).
3. Predict the window balance (sum over layers of mean rank load / sum of max rank load, the
   load summed over a window) of the next window of as many steps, for both placements, and
   skip (``gain_too_small``) when the new one gains less than ``min_gain``: a switch costs
   NVLink bytes and a two-phase round trip, and gains below sampling noise are not gains.

   The window's counts are a sample. The placement in force was not fitted to this sample, so
   its balance on it is already a fair draw of the next window's (``balance_before``). The new
   placement was fitted to it and evens out this sample's noise too, so its balance on the
   sample (``balance_fitted``) overstates the next window's. A rank's count over a window is a
   sum of routed-token picks, with variance about its mean ``m`` (Poisson); the fitted loads
   are level where the true ones carry one sample's noise, and the next window adds another, so
   each layer's peak is predicted as the fitted peak plus ``sqrt(2 m) * z`` with ``z`` the
   expected maximum of ``ranks`` standard normals (``balance_after``). At DEP32 with a
   1,000-step window the term is about 0.1% of balance; with a few requests over 100 steps it
   is several percent, and it keeps the service from chasing noise.

Everything here is pure: data in, decision out. The service acts on it; the benchmark and the
tests call it directly.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from statistics import NormalDist

import numpy as np

from baton.core.experts import Placement, balance, moves, rank_load
from eplb.algorithm import DEFAULT_TOLERANCE, rebalance
from eplb.window import Window

__all__ = [
    "DEFAULT_MIN_GAIN",
    "Decision",
    "Outcome",
    "Policy",
    "decide",
    "due_boundary",
    "predict_fitted_balance",
]

# Balance (0-1) a rebalance must be predicted to gain: below it, sampling noise (step 3).
DEFAULT_MIN_GAIN = 0.002


@dataclass(frozen=True, slots=True)
class Policy:
    """How one decode group is rebalanced (the service's configuration, per model).

    vLLM's own defaults are ``baton.core.vllm_eplb.VLLM_WINDOW_SIZE`` and
    ``VLLM_STEP_INTERVAL``.
    """

    window_size: int
    step_interval: int
    min_gain: float = DEFAULT_MIN_GAIN
    tolerance: float = DEFAULT_TOLERANCE
    num_nodes: int = 1
    num_groups: int = 1

    def window_for(self, boundary: int) -> tuple[int, int]:
        """The steps ``[first, end)`` whose load the decision at ``boundary`` uses."""
        return boundary - self.window_size, boundary

    def __post_init__(self) -> None:
        if not 0 < self.window_size <= self.step_interval:
            raise ValueError(
                f"window_size {self.window_size} must be in (0, step_interval {self.step_interval}]"
            )
        if self.min_gain < 0 or self.tolerance < 0:
            raise ValueError("min_gain and tolerance must be non-negative")


class Outcome(StrEnum):
    REBALANCE = "rebalance"
    GAIN_TOO_SMALL = "gain_too_small"
    INCOMPLETE_WINDOW = "incomplete_window"
    SWITCH_PENDING = "switch_pending"


@dataclass(frozen=True, slots=True)
class Decision:
    """What to do at ``boundary``: ``placement`` is the new one, or the current one on a skip.

    ``balance_before`` / ``balance_after``: predicted window balance of the current and the new
    placement over the next window; ``balance_fitted``: the new one's on the window it was
    fitted to (see the module docstring); ``moved_experts``: experts arriving on a rank.
    """

    boundary: int
    window_first: int
    window_end: int
    outcome: Outcome
    placement: Placement
    balance_before: float
    balance_after: float
    balance_fitted: float
    moved_experts: int

    @property
    def gain(self) -> float:
        return self.balance_after - self.balance_before


def due_boundary(completed_end: int, last_boundary: int | None, policy: Policy) -> int | None:
    """The newest boundary at or before ``completed_end`` not decided yet, if any.

    ``completed_end`` is one past the newest step every rank has reported.
    """
    boundary = (completed_end // policy.step_interval) * policy.step_interval
    if boundary <= 0 or (last_boundary is not None and boundary <= last_boundary):
        return None
    return boundary


def decide(
    window: Window,
    current: Placement,
    policy: Policy,
    boundary: int,
    *,
    switch_pending: bool = False,
) -> Decision:
    """Steps 0-3 of the module docstring for the window ending at ``boundary``."""
    skip = Outcome.SWITCH_PENDING if switch_pending else None
    if skip is None and (not window.complete or window.steps == 0):
        skip = Outcome.INCOMPLETE_WINDOW
    if skip is not None:
        return Decision(
            boundary, window.first_step, window.end_step, skip, current, 1.0, 1.0, 1.0, 0
        )
    num_redundant = current.phy2log.shape[1] - current.num_logical_experts
    candidate = rebalance(
        window.load,
        current.num_ranks,
        num_redundant,
        policy.num_nodes,
        policy.num_groups,
        previous=current,
        tolerance=policy.tolerance,
    )
    before = balance(window.load, current)
    after = predict_fitted_balance(window.load, candidate)
    outcome = Outcome.REBALANCE if after - before >= policy.min_gain else Outcome.GAIN_TOO_SMALL
    return Decision(
        boundary,
        window.first_step,
        window.end_step,
        outcome,
        candidate if outcome is Outcome.REBALANCE else current,
        before,
        after,
        balance(window.load, candidate),
        moves(current, candidate) if outcome is Outcome.REBALANCE else 0,
    )


def predict_fitted_balance(counts: np.ndarray, placement: Placement) -> float:
    """Expected balance over the next window of ``placement``, fitted to ``counts``.

    ``counts`` are routed-token counts per layer and logical expert summed over a window; each
    layer's peak rank load is raised by ``sqrt(2 * mean rank load) * z`` (module docstring).
    """
    per_rank = rank_load(counts, placement)
    mean = per_rank.mean(axis=-1)
    peak = per_rank.max(axis=-1) + np.sqrt(2.0 * mean) * _expected_max_normal(placement.num_ranks)
    total_peak = float(peak.sum())
    return float(mean.sum()) / total_peak if total_peak > 0 else 1.0


def _expected_max_normal(count: int) -> float:
    """Expected maximum of ``count`` standard normals (Blom's approximation; 0 for one)."""
    if count <= 1:
        return 0.0
    return NormalDist().inv_cdf((count - 0.375) / (count + 0.25))
