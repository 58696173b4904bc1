"""The MoE side of a simulated DP group: expert routing each step, placements, EPLB.

Each decode step the group's tokens are routed over the experts of the target model and, with
MTP, of the draft model (``sim.experts``); the placement in force turns that into per-rank load,
and its balance sets the step's MoE time (``sim.perf``).

Who re-places experts:
- ``--enable-eplb`` alone: the engine does, as vLLM does inside the engine: every
  ``step_interval`` steps from the load of the last ``window_size`` steps, with vLLM's default
  policy (``baton.core.vllm_eplb``), switching at once.
- with ``--eplb-agent-port``: the Baton EPLB service does, through the agent's two-phase
  Prepare/Commit (``sim.agent``); the engine never rebalances on its own.

Step counting follows vLLM: only steps with real decode tokens count (dummy steps do not).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from baton.core.experts import Placement, rank_load
from baton.core.model import DRAFT, TARGET, MoEModel
from baton.core.vllm_eplb import vllm_rebalance
from sim.config import EngineConfig
from sim.experts import (
    DRAFT_SKEW,
    TARGET_SKEW,
    ExpertPopularity,
    RoutingSkew,
    physical_load,
    sample_load,
)

__all__ = ["LoadListener", "MoERuntime", "ModelState", "StagedSwitch", "initial_placement"]

# Popularity drifts over tens of thousands of steps: advancing it every few steps is exact to
# well within sampling noise and keeps a step cheap.
_DRIFT_EVERY = 10

LoadListener = Callable[[str, int, np.ndarray, int], None]
"""Called with (model name, step, physical load [layers, slots], placement version)."""


def initial_placement(model: MoEModel, num_ranks: int, num_redundant: int) -> Placement:
    """vLLM's "linear" start: physical slot p holds logical expert p mod E."""
    physical = model.experts + num_redundant
    if physical % num_ranks:
        raise ValueError(
            f"{model.name}: {model.experts} experts + {num_redundant} redundant do "
            f"not split over {num_ranks} ranks; change num_redundant_experts"
        )
    row = np.arange(physical, dtype=np.int64) % model.experts
    return Placement(np.tile(row, (model.layers, 1)), num_ranks, model.experts)


@dataclass(slots=True)
class StagedSwitch:
    switch_id: str
    placement: Placement
    apply_at_step: int
    committed: bool = False


@dataclass(slots=True)
class ModelState:
    model: MoEModel
    popularity: ExpertPopularity
    placement: Placement
    rng: np.random.Generator
    version: int = 0
    window: np.ndarray | None = None  # logical load summed since the window opened
    staged: StagedSwitch | None = None
    last_balance: float = 1.0

    def route(self, tokens: int) -> tuple[np.ndarray, float]:
        """One step's logical load and its balance under the current placement."""
        logical = sample_load(self.popularity.probabilities(), tokens, self.model.top_k, self.rng)
        per_rank = rank_load(logical, self.placement)
        peak = per_rank.max(axis=1).sum()
        self.last_balance = float(per_rank.mean(axis=1).sum() / peak) if peak else 1.0
        return logical, self.last_balance


class MoERuntime:
    """Expert routing, placement and EPLB for one DP group."""

    def __init__(
        self, config: EngineConfig, models: tuple[tuple[MoEModel, RoutingSkew], ...] | None = None
    ) -> None:
        self.config = config
        self.num_ranks = config.data_parallel_size
        redundant = config.eplb.num_redundant_experts if config.enable_eplb else 0
        if models is None:
            models = ((TARGET, TARGET_SKEW),)
            if config.speculative.num_speculative_tokens:
                models += ((DRAFT, DRAFT_SKEW),)
        streams = np.random.default_rng(config.seed).spawn(2 * len(models))
        self.models: dict[str, ModelState] = {}
        for index, (model, skew) in enumerate(models):
            self.models[model.name] = ModelState(
                model=model,
                popularity=ExpertPopularity(model, skew, streams[2 * index]),
                placement=initial_placement(model, self.num_ranks, redundant),
                rng=streams[2 * index + 1],
            )
        self.internal_eplb = config.enable_eplb and config.eplb_agent_port is None
        self.step = 0
        self.listeners: list[LoadListener] = []

    def step_balances(self, target_tokens: int, draft_tokens: int) -> tuple[float, float]:
        """Route one decode step; returns (target balance, draft balance)."""
        if self.step % _DRIFT_EVERY == 0:
            for state in self.models.values():
                state.popularity.advance(_DRIFT_EVERY)
        balances = {}
        for name, state in self.models.items():
            tokens = target_tokens if name == TARGET.name else draft_tokens
            logical, balances[name] = state.route(tokens)
            if self.listeners:
                physical = physical_load(logical, state.placement)
                for listener in self.listeners:
                    listener(name, self.step, physical, state.version)
            if self.internal_eplb:
                self._record_window(state, logical)
        self.step += 1
        for state in self.models.values():
            self._maybe_switch(state)
        return balances.get(TARGET.name, 1.0), balances.get(DRAFT.name, 1.0)

    def _record_window(self, state: ModelState, logical: np.ndarray) -> None:
        eplb = self.config.eplb
        position = self.step % eplb.step_interval
        if position == eplb.step_interval - eplb.window_size:
            state.window = np.zeros_like(logical)
        if state.window is not None:
            state.window += logical
        if position == eplb.step_interval - 1 and state.window is not None:
            state.placement = vllm_rebalance(
                state.window, self.num_ranks, eplb.num_redundant_experts, previous=state.placement
            )
            state.version += 1
            state.window = None

    def _maybe_switch(self, state: ModelState) -> None:
        staged = state.staged
        if staged is not None and staged.committed and self.step >= staged.apply_at_step:
            state.placement = staged.placement
            state.version += 1
            state.staged = None
