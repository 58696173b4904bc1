"""The ModelDeployment resource: its models validate manifests, and the CRD is generated from
them (the checked-in copy must match)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from baton.core.api import ModelDeployment
from baton.core.crd import CRD_PATH, generate_crd, render
from controller.placement import DeploymentShape

ROOT = Path(__file__).resolve().parents[2]


def test_checked_in_crd_matches_the_models() -> None:
    checked_in = (ROOT / CRD_PATH).read_text()
    assert checked_in == render(), f"{CRD_PATH} is stale: regenerate it with `baton crd`"


def _nodes(schema: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield schema
    for child in schema.get("properties", {}).values():
        yield from _nodes(child)
    if "items" in schema:
        yield from _nodes(schema["items"])
    if isinstance(schema.get("additionalProperties"), dict):
        yield from _nodes(schema["additionalProperties"])


def test_schema_is_structural() -> None:
    version = generate_crd()["spec"]["versions"][0]
    for node in _nodes(version["schema"]["openAPIV3Schema"]):
        assert node.get("type") in {"object", "array", "string", "integer", "number", "boolean"}
        assert not {"$ref", "anyOf", "oneOf", "allOf", "const", "title"} & set(node)


def test_crd_has_status_subresource_short_name_and_printer_columns() -> None:
    spec = generate_crd()["spec"]
    version = spec["versions"][0]
    assert spec["names"]["shortNames"] == ["mdep"]
    assert version["subresources"] == {
        "status": {},
        "scale": {"specReplicasPath": ".spec.cells", "statusReplicasPath": ".status.placedCells"},
    }
    columns = {column["name"]: column["jsonPath"] for column in version["additionalPrinterColumns"]}
    assert list(columns) == [
        "Ready",
        "Reason",
        "Cells",
        "Updated",
        "Prefill",
        "Decode Ranks",
        "Balance",
        "Age",
    ]
    # READY is the Ready condition itself (False for a refused spec or a degraded deployment,
    # whatever the cells' count), CELLS the count of ready cells against those wanted
    assert columns["Ready"] == '.status.conditions[?(@.type=="Ready")].status'
    assert columns["Cells"] == ".status.ready"


def test_spec_requires_model_and_bounds_its_numbers() -> None:
    spec = generate_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert spec["required"] == ["model"]
    assert spec["properties"]["cells"]["minimum"] == 0
    decode = spec["properties"]["cell"]["properties"]["decode"]["properties"]
    assert decode["dep"]["minimum"] == 1 and decode["gpusPerPod"]["maximum"] == 8


def test_only_model_is_required_and_everything_else_is_the_studys_shape() -> None:
    deployment = ModelDeployment.model_validate(
        {"spec": {"model": "deepseek-ai/DeepSeek-V4.1-Flash"}}
    )
    shape = DeploymentShape.of(deployment)
    assert (shape.decode.dep, shape.decode.gpus_per_pod, shape.decode.spare_trays) == (32, 4, 1)
    assert (shape.prefill.dep, shape.prefill.instances, shape.cells) == (2, None, 1)
    assert [m.name for m in deployment.spec.eplb.models] == ["target", "draft"]


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ({}, "model"),
        ({"model": "m", "cells": -1}, "cells"),
        ({"model": "m", "cell": {"decode": {"dep": 30}}}, "multiple of gpusPerPod"),
        ({"model": "m", "eplb": {"windowSize": 5000}}, "must not exceed stepInterval"),
        ({"model": "m", "eplb": {"mode": "agent"}}, "mode agent needs tokenSecret"),
        ({"model": "m", "kvTransfer": {"connector": "Mooncake"}}, "connector"),
        ({"model": "m", "replicas": 3}, "replicas"),
        (
            {"model": "m", "engine": {"command": ["baton", "sim"]}},
            "engine.image is vLLM's (vllm/vllm-openai:v0.33.0), which has no baton",
        ),
        (
            {"model": "m", "engine": {"image": "ghcr.io/baton-dev/baton:0.1.0"}},
            "which has no vLLM",
        ),
    ],
    ids=[
        "no-model",
        "negative-cells",
        "decode-not-whole-trays",
        "eplb-window",
        "agent-without-token",
        "connector",
        "unknown-field",
        "simulator-in-vllms-image",
        "vllm-in-batons-image",
    ],
)
def test_invalid_spec_is_rejected_naming_the_field(spec: dict[str, Any], needle: str) -> None:
    with pytest.raises(ValidationError) as caught:
        ModelDeployment.model_validate({"spec": spec})
    assert needle in str(caught.value)


def test_manifest_round_trips_through_yaml() -> None:
    manifest = ModelDeployment.model_validate(
        yaml.safe_load("""
apiVersion: baton.dev/v1alpha1
kind: ModelDeployment
metadata: {name: dsv4, namespace: serving}
spec:
  model: deepseek-ai/DeepSeek-V4.1-Flash
  servedModelName: deepseek-v4.1-flash
  engine: {command: [baton, sim], image: baton:dev}
  cells: 2
  cell: {prefill: {instances: 18}}
""")
    )
    dumped = manifest.model_dump(by_alias=True, exclude_none=True)
    assert ModelDeployment.model_validate(dumped) == manifest
    assert dumped["spec"]["engine"]["command"] == ["baton", "sim"]


def _undocumented(schema: dict[str, Any], path: str) -> list[str]:
    missing = []
    for name, field in schema.get("properties", {}).items():
        where = f"{path}.{name}"
        if not field.get("description"):
            missing.append(where)
        missing += _undocumented(field, where)
        missing += _undocumented(field.get("items", {}), f"{where}[]")
    return missing


def test_kubectl_explain_has_a_description_for_every_spec_field() -> None:
    [version] = generate_crd()["spec"]["versions"]
    spec = version["schema"]["openAPIV3Schema"]["properties"]["spec"]
    assert not _undocumented(spec, "spec")
