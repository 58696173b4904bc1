"""Every vLLM metric Baton reads or the simulator exports exists in vLLM 0.33 with the same type
and label names, as vLLM's own stat loggers define them."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.prober import ENGINE_LOAD_METRICS
from tests.helpers import NIXL
from tests.vllm.conftest import Vllm


@pytest.fixture(scope="module")
def definitions(vllm: Vllm) -> dict[str, dict[str, Any]]:
    answer = vllm.ask("metrics")
    assert answer["ok"] and len(answer["metrics"]) > 30  # the stat loggers were found
    metrics: dict[str, dict[str, Any]] = answer["metrics"]
    return metrics


def test_the_gateway_reads_vllms_per_engine_load_gauges(
    definitions: dict[str, dict[str, Any]],
) -> None:
    for name in ENGINE_LOAD_METRICS:
        assert definitions[name]["type"] == "gauge"
        assert "engine" in definitions[name]["labels"]  # the DP rank the gateway keys on


def test_every_vllm_metric_the_simulator_exports_is_vllms_own(
    definitions: dict[str, dict[str, Any]], start_sim_module: Any
) -> None:
    sim = start_sim_module("--kv-transfer-config", NIXL, "--served-model-name", "dsv4")
    body = {"model": "dsv4", "prompt": "count me", "max_tokens": 3}
    assert httpx.post(f"{sim.url}/v1/completions", json=body, timeout=30).status_code == 200
    exported = {
        family.name: family
        for family in text_string_to_metric_families(httpx.get(f"{sim.url}/metrics").text)
        if family.name.startswith("vllm:")
    }
    assert len(exported) > 20
    for name, family in exported.items():
        assert name in definitions, f"{name} is not a vLLM 0.33 metric"
        assert family.type == definitions[name]["type"], name
        labels = {key for sample in family.samples for key in sample.labels} - {"le"}
        if definitions[name].get("info"):  # the config fields the simulator models, and engine
            assert "engine" in labels and labels <= set(definitions[name]["labels"]), name
        else:
            assert labels == set(definitions[name]["labels"]), name
