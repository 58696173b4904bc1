"""Baton's EPLB plugin inside vLLM 0.33: vLLM's own policy entry point returns Baton's placement
with the plugin installed (by the init container the controller renders, onto the engine's
PYTHONPATH), vLLM's default without, and the same bits on every rank."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from baton.core.api import ModelDeployment
from baton.core.eplb_report import POLICY_ENV
from baton.core.experts import Placement
from baton.core.model import TARGET
from baton.core.vllm_eplb import vllm_rebalance
from controller.placement import DeploymentShape, plan_placement
from controller.podspec import PLUGIN_DIR, render_cell
from controller.topology import synthetic_topology
from eplb.algorithm import rebalance
from rigs.processes import baton_command
from sim.experts import DEP32_DECODE_TOKENS_PER_STEP, TARGET_SKEW, ExpertPopularity, sample_load
from tests.vllm.conftest import ROOT, vllm_python

RANKS, REDUNDANT = 32, 32


@pytest.fixture(scope="module")
def window() -> dict[str, Any]:
    """A DEP32 target-model window on drifted load, and the placement in force, as vLLM has
    them (int64 tensors' values)."""
    rng = np.random.default_rng(11)
    popularity = ExpertPopularity(TARGET, TARGET_SKEW, rng)

    def load() -> np.ndarray:
        probabilities = popularity.probabilities()
        steps = sample_load(probabilities, DEP32_DECODE_TOKENS_PER_STEP, 6, rng, steps=200)
        window_load: np.ndarray = steps.sum(0)
        return window_load

    old = vllm_rebalance(load(), RANKS, REDUNDANT)
    popularity.advance(3000)
    return {
        "weight": load().tolist(),
        "num_replicas": TARGET.experts + REDUNDANT,
        "num_groups": 1,
        "num_nodes": 1,
        "num_ranks": RANKS,
        "old": old.phy2log.tolist(),
    }


def call_policy(
    window: dict[str, Any], plugin: Path | None, pod_env: dict[str, str] | None = None
) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", POLICY_ENV)}
    env |= pod_env or {}
    if plugin is not None:
        env["PYTHONPATH"] = str(plugin)
    done = subprocess.run(
        [str(vllm_python()), str(ROOT / "tests/vllm/policy_probe.py")],
        input=json.dumps(window),
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    answer: dict[str, Any] = json.loads(done.stdout)
    return answer


@pytest.fixture(scope="module")
def plugin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The plugin as a decode pod gets it: its init container's command, run here with the
    shared volume at a temporary directory; the engine's PYTHONPATH names that volume."""
    deployment = ModelDeployment.model_validate(
        {"metadata": {"name": "dsv4"}, "spec": {"model": "deepseek-ai/DeepSeek-V4.1-Flash"}}
    )
    plan = plan_placement([DeploymentShape.of(deployment)], synthetic_topology(1))
    pod = next(
        m
        for m in render_cell(
            deployment.spec, plan.cells[0], deployment="dsv4", uid="u", namespace="serving"
        )
        if m["kind"] == "Pod"
    )
    [init] = pod["spec"]["initContainers"]
    engine_env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert engine_env["PYTHONPATH"] == PLUGIN_DIR
    directory = tmp_path_factory.mktemp("plugin")
    assert init["command"][0] == "baton" and init["command"][-1] == PLUGIN_DIR
    command = baton_command(*init["command"][1:-1], str(directory))
    subprocess.run(command, check=True, cwd=ROOT, timeout=120)
    return directory


def previous(window: dict[str, Any]) -> Placement:
    return Placement(np.array(window["old"]), RANKS, TARGET.experts)


def test_with_the_plugin_vllms_policy_entry_point_places_as_baton_does(
    window: dict[str, Any], plugin: Path
) -> None:
    answer = call_policy(window, plugin)
    assert answer["policy"] == "BatonEplbPolicy"
    expected = rebalance(np.array(window["weight"]), RANKS, REDUNDANT, previous=previous(window))
    assert np.array_equal(np.array(answer["phy2log"]), expected.phy2log)


def test_a_plugin_told_to_leave_placing_to_vllm_answers_with_vllms_own_placement(
    window: dict[str, Any], plugin: Path
) -> None:
    deployment = ModelDeployment.model_validate(
        {
            "metadata": {"name": "dsv4"},
            "spec": {
                "model": "deepseek-ai/DeepSeek-V4.1-Flash",
                "eplb": {"policy": "vllm_default"},
            },
        }
    )
    plan = plan_placement([DeploymentShape.of(deployment)], synthetic_topology(1))
    pod = next(
        m
        for m in render_cell(
            deployment.spec, plan.cells[0], deployment="dsv4", uid="u", namespace="serving"
        )
        if m["kind"] == "Pod" and m["spec"].get("initContainers")
    )
    env = {e["name"]: e["value"] for e in pod["spec"]["containers"][0]["env"] if "value" in e}
    answer = call_policy(window, plugin, {POLICY_ENV: env[POLICY_ENV]})
    assert answer["policy"] == "BatonEplbPolicy"  # the plugin is in place, measuring
    expected = vllm_rebalance(
        np.array(window["weight"]), RANKS, REDUNDANT, previous=previous(window)
    )
    assert np.array_equal(np.array(answer["phy2log"]), expected.phy2log)


def test_every_rank_reaches_the_same_placement_bit_for_bit(
    window: dict[str, Any], plugin: Path
) -> None:
    # Each EP rank runs the policy in its own process on the same all-reduced inputs.
    first, second = call_policy(window, plugin), call_policy(window, plugin)
    assert first["phy2log"] == second["phy2log"]


def test_without_the_plugin_vllm_places_as_the_cores_copy_of_its_policy(
    window: dict[str, Any],
) -> None:
    # vLLM's own default policy, and the simulator's in-engine EPLB (baton.core.vllm_eplb).
    answer = call_policy(window, None)
    assert answer["policy"] == "DefaultEplbPolicy"
    expected = vllm_rebalance(
        np.array(window["weight"]), RANKS, REDUNDANT, previous=previous(window)
    )
    assert np.array_equal(np.array(answer["phy2log"]), expected.phy2log)
