"""The simulator's MoE runtime: vLLM's in-engine EPLB and what a switch costs (sim.moe)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from baton.core.experts import Placement, moves_per_rank
from baton.core.model import DRAFT, EXPERT_BYTES, TARGET
from baton.core.perf import RankBatch, expert_copy_seconds, step_seconds
from baton.core.profile import load_profile
from baton.core.vllm_eplb import vllm_rebalance
from eplb.algorithm import rebalance
from sim.config import EngineConfig, EplbConfig, SpeculativeConfig
from sim.experts import DEP32_DECODE_TOKENS_PER_STEP, TARGET_SKEW
from sim.moe import MoERuntime, policy_plugins

PROFILE = load_profile()


def engine_config(
    step_interval: int = 20,
    window_size: int = 10,
    policy_plugin: str | None = None,
    speculative: SpeculativeConfig | None = None,
) -> EngineConfig:
    """One DEP32 API server with in-engine EPLB (32 redundant experts) every ``step_interval``
    steps from the last ``window_size``."""
    return EngineConfig(
        model="m",
        served_model_names=("m",),
        profile=PROFILE,
        data_parallel_size=32,
        data_parallel_size_local=32,
        enable_expert_parallel=True,
        enable_eplb=True,
        eplb=EplbConfig(
            window_size=window_size, step_interval=step_interval, num_redundant_experts=32
        ),
        eplb_policy_plugin=policy_plugin,
        speculative=speculative or SpeculativeConfig(),
        group_name="cell-0",
    )


def runtime(
    step_interval: int = 20, window_size: int = 10, policy_plugin: str | None = None
) -> MoERuntime:
    config = engine_config(step_interval, window_size, policy_plugin)
    return MoERuntime(config, models=((TARGET, TARGET_SKEW),))


def decode(moe: MoERuntime, steps: int) -> list[float]:
    """Run ``steps`` DEP32 decode steps; each step's EPLB copy seconds."""
    return [moe.step_balances(DEP32_DECODE_TOKENS_PER_STEP, 0).copy_s for _ in range(steps)]


@pytest.mark.parametrize(("method", "balanced"), [("dspark", False), ("mtp", True)])
def test_in_engine_eplb_balances_the_draft_as_vllm_does_for_its_method(
    method: str, balanced: bool
) -> None:
    # vLLM 0.33 leaves a DSpark draft whose expert layout is not the target's (V4.1's: 128
    # experts against 384) out of its EPLB: its plain layout stays, with no redundant slots.
    config = engine_config(speculative=SpeculativeConfig(method=method, num_speculative_tokens=5))
    moe = MoERuntime(config)
    draft = moe.models[DRAFT.name]
    start = draft.placement.phy2log.copy()
    assert start.shape[1] == (DRAFT.experts + 32 if balanced else DRAFT.experts)
    for _ in range(20 + TARGET.layers + 2):
        moe.step_balances(DEP32_DECODE_TOKENS_PER_STEP, 5 * DEP32_DECODE_TOKENS_PER_STEP)
    assert moe.models[TARGET.name].version == 1  # the target switched either way
    assert (draft.version == 1) is balanced
    assert bool((draft.placement.phy2log != start).any()) is balanced


def test_in_engine_eplb_copies_one_layer_per_decode_step_then_switches_it() -> None:
    moe = runtime()
    state = moe.models["target"]
    start = state.placement.phy2log.copy()
    assert decode(moe, 20) == [0.0] * 20  # the window fills; the rebalance is due at step 19
    assert moe.transfer is not None and moe.transfer.copied == 0
    for copied in range(1, TARGET.layers + 1):
        decode(moe, 1)
        changed = (state.placement.phy2log != start).any(axis=1)
        assert not changed[copied:].any(), "a layer switched before its weights arrived"
    assert moe.transfer is None and state.version == 1
    assert changed.sum() > TARGET.layers // 2  # vLLM's policy re-placed most layers


def test_each_step_of_a_switch_pays_the_nvlink_time_of_its_layers_largest_copy() -> None:
    moe = runtime()
    decode(moe, 20)
    transfer = moe.transfer
    assert transfer is not None
    before = moe.models["target"].placement
    after = transfer.placements["target"]
    largest = moves_per_rank(before, after).max(axis=1)
    paid = decode(moe, TARGET.layers)
    assert paid == pytest.approx([expert_copy_seconds(PROFILE, int(n)) for n in largest])
    assert decode(moe, 5) == [0.0] * 5


def test_a_switch_costs_in_proportion_to_the_experts_it_moves() -> None:
    rng = np.random.default_rng(0)
    load = rng.lognormal(0.0, 1.0, size=(TARGET.layers, TARGET.experts)) * 1e4
    drifted = load * rng.lognormal(0.0, 0.2, size=load.shape)
    current = rebalance(load, 32, 32)
    vllm = vllm_rebalance(drifted, 32, 32, previous=current)
    minimal = rebalance(drifted, 32, 32, previous=current)

    def copy_seconds(new: Placement) -> float:
        moe = runtime()
        moe.models["target"].placement = current
        return moe.stage("s", {"target": new}, apply_at_step=0).seconds

    assert copy_seconds(current) == 0.0
    assert copy_seconds(minimal) < copy_seconds(vllm) / 5


def test_a_whole_dep32_switch_takes_under_a_second_of_decode_without_pausing_it() -> None:
    # The study: a whole DEP32 rebalance in under one second without pausing decode. At its
    # reference decode step (64 requests per GPU, 4 tokens each, 128K context: 6 ms MoE + 10 ms
    # rest), a from-scratch switch (13 new experts per rank and layer) copies a layer per step.
    context = 128 * 1024
    batch = RankBatch(64, 64 * 4, 64 * 4 * context)
    step = step_seconds(PROFILE, [batch] * 32, num_speculative_tokens=3, target_balance=0.94)
    copy = expert_copy_seconds(PROFILE, 13)
    assert TARGET.layers * (step.total_s + copy) < 1.0
    assert copy < 0.02 * step.total_s


def test_the_profile_copies_an_expert_of_the_published_shape() -> None:
    assert PROFILE.decode.expert_bytes == pytest.approx(EXPERT_BYTES)


def _first_switch(moe: MoERuntime) -> tuple[Placement, np.ndarray]:
    """The placement of the first in-engine rebalance, and the window load its policy got."""
    windows: list[np.ndarray] = []
    policy = moe.policy

    def recorded(load: np.ndarray, *args: Any) -> np.ndarray:
        windows.append(load.copy())
        return policy(load, *args)

    moe.policy = recorded
    decode(moe, 20)
    assert moe.transfer is not None and len(windows) == 1
    return moe.transfer.placements["target"], windows[0]


def test_with_batons_plugin_the_in_engine_eplb_places_with_batons_algorithm() -> None:
    by_vllm, _ = _first_switch(runtime())
    moe = runtime(policy_plugin="baton")
    start = moe.models["target"].placement
    by_baton, window = _first_switch(moe)
    assert np.array_equal(by_baton.phy2log, rebalance(window, 32, 32, previous=start).phy2log)
    assert np.array_equal(by_vllm.phy2log, vllm_rebalance(window, 32, 32, previous=start).phy2log)


def test_an_eplb_policy_plugin_that_is_not_installed_is_refused_with_the_installed_ones() -> None:
    with pytest.raises(ValueError, match="installed: baton"):
        runtime(policy_plugin="nope")
    assert policy_plugins() == ["baton"]
