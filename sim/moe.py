"""The MoE side of a simulated DP group: expert routing each step, placements, EPLB.

Each decode step the group's tokens are routed over the experts of the target model and, with
MTP, of the draft model (``sim.experts``); the placement in force turns that into per-rank load,
and its balance sets the step's MoE time (``baton.core.perf``).

Who re-places experts:
- ``--enable-eplb`` alone: the engine does, as vLLM 0.33 does inside the engine: every
  ``step_interval`` steps from the load of the last ``window_size`` steps, with vLLM's default
  policy (``baton.core.vllm_eplb``, which keeps only the experts that stay on the same GPU), or
  with ``--eplb-policy-plugin NAME`` the policy an installed plugin provides under that name
  (entry point group ``baton.sim.eplb_policies``): ``baton`` is Baton's vLLM plugin, which
  places with Baton's algorithm and reports each window, as it does inside vLLM.
- with ``--eplb-agent-port``: Baton's EPLB service does, through the agent's two-phase
  Prepare/Commit (``sim.agent``); the engine never rebalances on its own.

A switch costs what moving its experts costs (:class:`ExpertTransfer`). As vLLM's asynchronous
EPLB worker does, the new weights are copied one MoE layer per decode step, model by model
(target, then draft), while decode goes on; each such step is longer by the NVLink time of that
layer's largest per-rank copy (``baton.core.perf.expert_copy_seconds``). In-engine, a layer runs
on its new placement from the step after its copy; a staged switch (the agent's Prepare) copies the
same way and switches every layer at once at its committed step. A whole DEP32 rebalance of the
target model therefore takes 43 decode steps (about 0.7 s at 16-17 ms a step), the study's "under
one second for the whole DEP32 without pausing decode".

Step counting follows vLLM: only steps with real decode tokens count (dummy steps do not).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib.metadata import entry_points

import numpy as np

from baton.core.experts import Placement, rank_load
from baton.core.model import DRAFT, TARGET, MoEModel, draft_balanced_in_engine
from baton.core.perf import switch_copy_seconds
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

__all__ = [
    "ExpertTransfer",
    "LoadListener",
    "MoERuntime",
    "MoEStep",
    "ModelState",
    "StagedSwitch",
    "initial_placement",
    "load_policy",
    "policy_plugins",
    "vllm_default_policy",
]

POLICY_PLUGINS = "baton.sim.eplb_policies"
EplbPolicy = Callable[[np.ndarray, int, int, int, int, np.ndarray], np.ndarray]
"""vLLM's policy call, numpy in and out: (window load [layers, logical experts], physical slots,
groups, nodes, ranks, placement in force [layers, slots]) -> the new placement's slots."""

# Popularity drifts over tens of thousands of steps: advancing it every few steps is exact to
# well within sampling noise and keeps a step cheap.
_DRIFT_EVERY = 10

LoadListener = Callable[[str, int, np.ndarray, int], None]
"""Called with (model name, step, physical load [layers, slots], placement version)."""


def vllm_default_policy(
    load: np.ndarray,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_ranks: int,
    old: np.ndarray,
) -> np.ndarray:
    """vLLM 0.33's default policy, keeping the slots that stay on the same GPU as vLLM does."""
    experts = load.shape[1]
    previous = Placement(old, num_ranks, experts)
    redundant = num_replicas - experts
    return vllm_rebalance(load, num_ranks, redundant, num_nodes, num_groups, previous).phy2log


def policy_plugins() -> list[str]:
    """The names of the EPLB policy plugins installed for the simulator."""
    return sorted(point.name for point in entry_points(group=POLICY_PLUGINS))


def load_policy(name: str, group: str | None) -> EplbPolicy:
    """The policy plugin ``name`` provides for decode group ``group``, or ValueError."""
    found = list(entry_points(group=POLICY_PLUGINS, name=name))
    if not found:
        raise ValueError(
            f"no EPLB policy plugin {name!r} is installed (installed: "
            f"{', '.join(policy_plugins()) or 'none'})"
        )
    policy: EplbPolicy = found[0].load()(group)
    return policy


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


@dataclass(frozen=True, slots=True)
class MoEStep:
    """What one decode step's MoE costs: each model's balance and the expert copy it carries."""

    target_balance: float
    draft_balance: float
    copy_s: float  # NVLink seconds of this step's share of a switch's weight copies


@dataclass(slots=True)
class ExpertTransfer:
    """The expert weights one switch copies, one (model, layer) per decode step in order.

    ``layers`` holds each layer's copy time (its largest per-rank copy over NVLink); with
    ``switch_each_layer`` (in-engine) a layer runs on its new placement once copied, otherwise
    the copies are only staged. ``on_copy`` is told of each copy (the agent waits on it).
    """

    switch_id: str
    placements: Mapping[str, Placement]
    layers: tuple[tuple[str, int, float], ...]
    switch_each_layer: bool
    copied: int = 0
    on_copy: Callable[[], None] | None = None

    @property
    def done(self) -> bool:
        return self.copied == len(self.layers)

    @property
    def next_seconds(self) -> float:
        return self.layers[self.copied][2] if not self.done else 0.0

    @property
    def seconds(self) -> float:
        """The NVLink time of every copy, end to end."""
        return sum(seconds for _, _, seconds in self.layers)


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
    balanced_in_engine: bool = (
        True  # vLLM's in-engine EPLB rebalances it (draft_balanced_in_engine)
    )
    # every routed step's balance added up, and the steps: a mean over any interval, as a metric
    balance_sum: float = 0.0
    balance_steps: int = 0

    def route(self, tokens: int) -> tuple[np.ndarray, float]:
        """One step's logical load and its balance under the current placement."""
        logical = sample_load(self.popularity.probabilities(), tokens, self.model.top_k, self.rng)
        per_rank = rank_load(logical, self.placement)
        peak = per_rank.max(axis=1).sum()
        self.last_balance = float(per_rank.mean(axis=1).sum() / peak) if peak else 1.0
        self.balance_sum += self.last_balance
        self.balance_steps += 1
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
        self.internal_eplb = config.enable_eplb and config.eplb_agent_port is None
        self.models: dict[str, ModelState] = {}
        for index, (model, skew) in enumerate(models):
            # In-engine, vLLM registers a draft with EPLB only as draft_balanced_in_engine says;
            # one it leaves out keeps its plain layout (no redundant slots) for the whole run.
            # Baton's agent (agent mode) balances any model it is sent.
            balanced = (
                not self.internal_eplb
                or model.name != DRAFT.name
                or (draft_balanced_in_engine(config.speculative.method, model))
            )
            self.models[model.name] = ModelState(
                model=model,
                popularity=ExpertPopularity(model, skew, streams[2 * index]),
                placement=initial_placement(model, self.num_ranks, redundant if balanced else 0),
                rng=streams[2 * index + 1],
                balanced_in_engine=balanced,
            )
        self.policy: EplbPolicy = (
            load_policy(config.eplb_policy_plugin, config.group_name)
            if config.eplb_policy_plugin is not None
            else vllm_default_policy
        )
        self.step = 0
        self.listeners: list[LoadListener] = []
        # Subscribers of the EPLB agent's load stream dropped for falling behind (a metric).
        self.load_subscribers_dropped = 0
        self.transfer: ExpertTransfer | None = None  # the switch whose weights are moving
        self._switches = 0  # in-engine switches so far, for their ids

    def step_balances(self, target_tokens: int, draft_tokens: int) -> MoEStep:
        """Route one decode step; its balances and the expert copy it carries."""
        if self.step % _DRIFT_EVERY == 0:
            for state in self.models.values():
                state.popularity.advance(_DRIFT_EVERY)
        balances = {}
        windows: dict[str, np.ndarray] = {}
        for name, state in self.models.items():
            tokens = target_tokens if name == TARGET.name else draft_tokens
            logical, balances[name] = state.route(tokens)
            if self.listeners:
                physical = physical_load(logical, state.placement)
                for listener in self.listeners:
                    listener(name, self.step, physical, state.version)
            if self.internal_eplb and state.balanced_in_engine:
                window = self._record_window(state, logical)
                if window is not None:
                    windows[name] = window
        copy_s = self.copy_next_layer()  # this step carries one layer of a switch in progress
        if windows:
            self._rebalance(windows)
        self.step += 1
        for state in self.models.values():
            self._maybe_switch(state)
        return MoEStep(balances.get(TARGET.name, 1.0), balances.get(DRAFT.name, 1.0), copy_s)

    def stage(
        self, switch_id: str, placements: Mapping[str, Placement], apply_at_step: int
    ) -> ExpertTransfer:
        """Start copying a switch's weights without switching (the agent's Prepare)."""
        for name, placement in placements.items():
            self.models[name].staged = StagedSwitch(switch_id, placement, apply_at_step)
        self.transfer = self._transfer(switch_id, placements, switch_each_layer=False)
        return self.transfer

    def staging(self, switch_id: str) -> bool:
        """The switch's weights are still being copied."""
        return self.transfer is not None and self.transfer.switch_id == switch_id

    def abort(self, switch_id: str) -> bool:
        """Drop a staged switch (committed or not, until it takes effect) and its copies."""
        dropped = False
        for state in self.models.values():
            if state.staged is not None and state.staged.switch_id == switch_id:
                state.staged = None
                dropped = True
        if self.transfer is not None and self.transfer.switch_id == switch_id:
            self.transfer = None
        return dropped

    def copy_next_layer(self) -> float:
        """Copy the next layer of the switch in progress; its NVLink seconds (0: none)."""
        transfer = self.transfer
        if transfer is None or transfer.done:
            return 0.0
        name, layer, seconds = transfer.layers[transfer.copied]
        transfer.copied += 1
        if transfer.switch_each_layer:
            state = self.models[name]
            rows = np.arange(state.model.layers)[:, None] == layer
            new = transfer.placements[name]
            state.placement = Placement(
                np.where(rows, new.phy2log, state.placement.phy2log),
                self.num_ranks,
                state.model.experts,
            )
            if layer == state.model.layers - 1:
                state.version += 1
        if transfer.done:
            self.transfer = None
        if transfer.on_copy is not None:
            transfer.on_copy()
        return seconds

    def _record_window(self, state: ModelState, logical: np.ndarray) -> np.ndarray | None:
        """Add a step's load to the window; the whole window at its rebalance step."""
        eplb = self.config.eplb
        position = self.step % eplb.step_interval
        if position == eplb.step_interval - eplb.window_size:
            state.window = np.zeros_like(logical)
        if state.window is not None:
            state.window += logical
        if position == eplb.step_interval - 1 and state.window is not None:
            window, state.window = state.window, None
            return window
        return None

    def _rebalance(self, windows: Mapping[str, np.ndarray]) -> None:
        """vLLM's in-engine rebalance: a new placement per model from the policy, copied layer
        by layer. A switch still copying when the next one is due keeps going; that one is
        skipped."""
        if self.transfer is not None:
            return
        placements = {}
        for name, window in windows.items():
            old = self.models[name].placement
            slots = old.phy2log.shape[1]
            phy2log = self.policy(window, slots, 1, 1, self.num_ranks, old.phy2log)
            placements[name] = Placement(phy2log, self.num_ranks, old.num_logical_experts)
        self._switches += 1
        self.transfer = self._transfer(
            f"in-engine-{self._switches}", placements, switch_each_layer=True
        )

    def _transfer(
        self, switch_id: str, placements: Mapping[str, Placement], *, switch_each_layer: bool
    ) -> ExpertTransfer:
        layers = []
        for name, placement in placements.items():
            seconds = switch_copy_seconds(
                self.config.profile, self.models[name].placement, placement
            )
            layers += [(name, layer, float(copy)) for layer, copy in enumerate(seconds)]
        return ExpertTransfer(switch_id, placements, tuple(layers), switch_each_layer)

    def _maybe_switch(self, state: ModelState) -> None:
        staged = state.staged
        if staged is not None and staged.committed and self.step >= staged.apply_at_step:
            state.placement = staged.placement
            state.version += 1
            state.staged = None
