"""Expert routing model of the simulator: which experts the tokens of a decode step pick.

Popularity. Each MoE layer has a Zipf-shaped popularity: a seeded random order gives its experts
the popularity ranks ``j = 1 .. E``, and the log pick weight of the rank-``j`` expert is
``-s * log(j)`` plus a drift term ``sigma * z``. The drift ``z`` of every (layer, expert) is a
stationary Ornstein-Uhlenbeck process, ``z(t + k) = a**k z(t) + sqrt(1 - a**(2k)) N(0, 1)`` with
``a = exp(-1 / drift_steps)``, so popularity wanders smoothly in log space and a hot expert stays
hot. Probabilities are the per-layer softmax of the log weights. A fixed Zipf shape, rather than
independent log-normal popularities, keeps the concentration (and so the balance without EPLB) a
property of the model more than of the seed; with one draft layer that matters.

Routing. A step of ``T`` tokens with top-``k`` routing sends ``T * k`` token-expert picks per
layer, drawn as one multinomial over the layer's popularity. Real top-k picks are distinct per
token, which lowers an expert's count variance by about ``(1 - k p) / (1 - p)``, 1-2% for an
expert of average popularity; that is ignored.

Calibration (``TARGET_SKEW``, ``DRAFT_SKEW``) reproduces the study's DEP32 figures (72 requests
per GPU, 6 tokens per request, balance measured per step as vLLM does): contiguous placement
without EPLB 0.35 (target) / 0.21 (draft); uniform routing 0.96 / 0.94, from sampling noise
alone; EPLB with 32 redundant experts rebuilt every 3,000 steps from the last 1,000 steps
0.94 / 0.89, i.e. about 97% / 93% of the gap between the two recovered. The Zipf exponent sets
the first figure. EPLB falls short of a static optimum only because a placement is 1,000 to
4,000 steps old when used, so the study pins only how far log-popularity moves in that time,
about ``sigma * sqrt(2 * age / drift_steps)``; ``drift_steps`` is therefore fixed at 50,000 steps
(the traffic mix changing
over about a quarter of an hour of decode at 15-20 ms per step) and ``sigma`` is fitted per model.

Everything here is pure: randomness comes only from generators the caller passes or seeds.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from baton.core.experts import Placement, balance_per_step
from baton.core.model import MoEModel
from baton.core.vllm_eplb import VLLM_STEP_INTERVAL, VLLM_WINDOW_SIZE, vllm_rebalance

__all__ = [
    "DEP32_DECODE_TOKENS_PER_STEP",
    "DRAFT_SKEW",
    "TARGET_SKEW",
    "UNIFORM_ROUTING",
    "BalanceRun",
    "EplbSchedule",
    "ExpertPopularity",
    "Rebalancer",
    "RoutingSkew",
    "physical_load",
    "sample_load",
    "simulate_balance",
]


# DEP32 decode in the study: 32 ranks x 72 requests per GPU x (1 + 5 draft) tokens per request.
DEP32_DECODE_TOKENS_PER_STEP = 32 * 72 * 6


@dataclass(frozen=True, slots=True)
class RoutingSkew:
    """Calibration constants of the popularity model (see the module docstring).

    ``zipf_exponent``: concentration ``s`` of the per-layer profile (0 is uniform routing).
    ``drift_sigma``: stationary standard deviation of each expert's log-popularity drift.
    ``drift_steps``: correlation time of that drift, in decode steps.
    """

    zipf_exponent: float
    drift_sigma: float
    drift_steps: float

    def __post_init__(self) -> None:
        if not (self.zipf_exponent >= 0 and self.drift_sigma >= 0 and self.drift_steps > 0):
            raise ValueError(f"invalid routing skew {self}")

    def log_profile(self, experts: int) -> np.ndarray:
        """Log pick weight of the j-th most popular expert, ``[experts]``, descending."""
        return -self.zipf_exponent * np.log(np.arange(1, experts + 1, dtype=np.float64))


TARGET_SKEW = RoutingSkew(zipf_exponent=0.71, drift_sigma=0.27, drift_steps=50_000.0)
DRAFT_SKEW = RoutingSkew(zipf_exponent=0.86, drift_sigma=0.38, drift_steps=50_000.0)
UNIFORM_ROUTING = RoutingSkew(zipf_exponent=0.0, drift_sigma=0.0, drift_steps=math.inf)


class ExpertPopularity:
    """Drifting per-layer popularity over experts: ``probabilities()`` is ``[layers, experts]``."""

    __slots__ = ("_base", "_drift", "_probabilities", "_rng", "_skew")

    def __init__(self, model: MoEModel, skew: RoutingSkew, rng: np.random.Generator) -> None:
        self._skew = skew
        self._rng = rng
        # Each layer gives the profile's popularity ranks to its experts in a random order.
        ranks = rng.permuted(np.tile(np.arange(model.experts), (model.layers, 1)), axis=1)
        self._base = skew.log_profile(model.experts)[ranks]
        # Start the drift in its stationary distribution so there is no burn-in.
        self._drift = rng.standard_normal((model.layers, model.experts))
        self._probabilities = self._normalised()

    def advance(self, steps: int = 1) -> None:
        """Move the drift ``steps`` decode steps forward (exact OU transition)."""
        if steps < 0:
            raise ValueError("cannot advance a negative number of steps")
        if steps == 0 or self._skew.drift_sigma == 0 or math.isinf(self._skew.drift_steps):
            return
        keep = math.exp(-steps / self._skew.drift_steps)
        noise = self._rng.standard_normal(self._drift.shape)
        self._drift = keep * self._drift + math.sqrt(1.0 - keep * keep) * noise
        self._probabilities = self._normalised()

    def probabilities(self) -> np.ndarray:
        """Current pick probabilities, ``[layers, experts]``, each row summing to 1 (read-only)."""
        return self._probabilities

    def _normalised(self) -> np.ndarray:
        logits = self._base + self._skew.drift_sigma * self._drift
        weights = np.exp(logits - logits.max(axis=1, keepdims=True))
        probabilities: np.ndarray = weights / weights.sum(axis=1, keepdims=True)
        probabilities.setflags(write=False)
        return probabilities


def sample_load(
    popularity_probs: np.ndarray,
    num_tokens: int,
    top_k: int,
    rng: np.random.Generator,
    steps: int | None = None,
) -> np.ndarray:
    """Routed-token counts per expert for one step, ``[layers, experts]`` int64.

    Each layer draws ``num_tokens * top_k`` picks from its row of ``popularity_probs``. With
    ``steps``, draws that many independent steps at once: ``[steps, layers, experts]``.
    """
    probs = np.asarray(popularity_probs, dtype=np.float64)
    if probs.ndim != 2:
        raise ValueError(f"popularity must be [layers, experts], got {probs.shape}")
    if num_tokens < 0 or top_k <= 0:
        raise ValueError("num_tokens must be >= 0 and top_k > 0")
    size = probs.shape[:1] if steps is None else (steps, probs.shape[0])
    return rng.multinomial(num_tokens * top_k, probs, size=size).astype(np.int64, copy=False)


def physical_load(logical_load: np.ndarray, placement: Placement) -> np.ndarray:
    """Split integer expert counts over replicas: ``[..., layers, experts]`` -> ``[..., layers,
    physical slots]``.

    An expert's ``c`` tokens over ``r`` replicas give each replica ``c // r`` and one more to the
    first ``c % r`` replicas in slot order, so every expert's count is preserved exactly.
    """
    counts = np.asarray(logical_load)
    if not np.issubdtype(counts.dtype, np.integer):
        raise ValueError("logical load must be integer counts")
    expected = (placement.num_layers, placement.num_logical_experts)
    if counts.ndim < 2 or counts.shape[-2:] != expected:
        raise ValueError(f"load must end in [layers, experts] = {expected}, got {counts.shape}")
    layer_index = np.arange(placement.num_layers)[:, None]
    replicas = placement.replica_counts[layer_index, placement.phy2log]
    # Which replica (0 .. r-1, in slot order) each physical slot holds.
    held = placement.log2phy >= 0
    layer_of, _, replica_of = np.nonzero(held)
    replica_index = np.empty_like(placement.phy2log)
    replica_index[layer_of, placement.log2phy[held]] = replica_of
    per_slot = counts.astype(np.int64)[..., layer_index, placement.phy2log]
    shares: np.ndarray = per_slot // replicas + (replica_index < per_slot % replicas)
    return shares


@dataclass(frozen=True, slots=True)
class EplbSchedule:
    """An EPLB cadence: rebalance every ``step_interval`` steps from the last ``window_size``
    (vLLM's defaults: 3,000 and 1,000), the new placement in force ``switch_delay`` steps later
    (``None``: one step per MoE layer, as vLLM's in-engine EPLB copies a layer per step)."""

    step_interval: int = VLLM_STEP_INTERVAL
    window_size: int = VLLM_WINDOW_SIZE
    num_redundant_experts: int = 32
    num_nodes: int = 1
    num_groups: int = 1
    switch_delay: int | None = None

    def __post_init__(self) -> None:
        if not 0 < self.window_size <= self.step_interval or self.num_redundant_experts < 0:
            raise ValueError(f"invalid EPLB schedule {self}")
        if self.switch_delay is not None and self.switch_delay < 0:
            raise ValueError(f"invalid EPLB schedule {self}")


Rebalancer = Callable[[np.ndarray, Placement, int], Placement | None]
"""(window load ``[layers, experts]``, placement in force, boundary step) -> the new placement,
or None to keep the one in force."""


@dataclass(frozen=True, slots=True)
class BalanceRun:
    """A simulated run: mean per-step balance, the balance of each step, and every switch as
    (placement before, placement after)."""

    balance: float
    series: np.ndarray  # [steps]
    switches: tuple[tuple[Placement, Placement], ...]
    skipped: int  # boundaries where the rebalancer kept the placement


# Popularity is held for, then advanced by, blocks of this many steps: against a drift time of
# 50,000 steps the error is far below sampling noise, and it cuts the per-step drift cost tenfold.
_BLOCK_STEPS = 10


def _vllm_rebalancer(schedule: EplbSchedule, num_ranks: int) -> Rebalancer:
    """vLLM's in-engine EPLB: its default policy at every boundary, from the placement in force."""

    def rebalancer(load: np.ndarray, current: Placement, boundary: int) -> Placement:
        return vllm_rebalance(
            load,
            num_ranks,
            schedule.num_redundant_experts,
            schedule.num_nodes,
            schedule.num_groups,
            previous=current,
        )

    return rebalancer


def simulate_balance(
    model: MoEModel,
    skew: RoutingSkew,
    *,
    steps: int,
    tokens_per_step: int,
    seed: int,
    num_ranks: int = 32,
    eplb: EplbSchedule | None = None,
    rebalancer: Rebalancer | None = None,
) -> BalanceRun:
    """Per-step vLLM balancedness over ``steps`` decode steps.

    Without ``eplb`` the placement is vLLM's contiguous default. With it, the run starts in
    steady state: ``window_size`` unmeasured steps are recorded first and the placement is built
    from scratch from them (vLLM's policy) at measured step 0; then at every ``step_interval``
    the rebalancer (default: vLLM's in-engine EPLB) runs on the load of the preceding
    ``window_size`` steps, and its placement is in force ``switch_delay`` steps later.
    """
    if steps <= 0:
        raise ValueError("steps must be positive")
    drift_rng, routing_rng = np.random.default_rng(seed).spawn(2)
    popularity = ExpertPopularity(model, skew, drift_rng)
    placement = Placement.contiguous(model.layers, model.experts, num_ranks)
    window_load = np.zeros((model.layers, model.experts), dtype=np.int64)
    if eplb is not None and rebalancer is None:
        rebalancer = _vllm_rebalancer(eplb, num_ranks)
    delay = model.layers if eplb is None or eplb.switch_delay is None else eplb.switch_delay
    next_rebalance = 0
    pending: tuple[int, Placement] | None = None
    switches: list[tuple[Placement, Placement]] = []
    series: list[np.ndarray] = []
    skipped = 0
    step = -eplb.window_size if eplb is not None else 0
    while step < steps:
        block = min(_BLOCK_STEPS, steps - step)
        if pending is not None and step >= pending[0]:
            switches.append((placement, pending[1]))
            placement, pending = pending[1], None
        if eplb is not None and rebalancer is not None:
            if step == next_rebalance:
                if step == 0:  # the steady state the run starts in
                    placement = vllm_rebalance(
                        window_load,
                        num_ranks,
                        eplb.num_redundant_experts,
                        eplb.num_nodes,
                        eplb.num_groups,
                    )
                else:
                    new = rebalancer(window_load.copy(), placement, step)
                    if new is None:
                        skipped += 1
                    else:
                        pending = (step + delay, new)
                window_load[:] = 0
                next_rebalance += eplb.step_interval
            window_start = next_rebalance - eplb.window_size
            block = min(block, next_rebalance - step)
            if pending is not None:
                block = min(block, max(pending[0] - step, 1))
            if step < window_start:
                block = min(block, window_start - step)
        loads = sample_load(
            popularity.probabilities(), tokens_per_step, model.top_k, routing_rng, steps=block
        )
        if eplb is not None and step >= next_rebalance - eplb.window_size:
            window_load += loads.sum(axis=0)
        if step >= 0:
            series.append(balance_per_step(loads, placement))
        popularity.advance(block)
        step += block
    per_step = np.concatenate(series)
    return BalanceRun(float(per_step.mean()), per_step, tuple(switches), skipped)
