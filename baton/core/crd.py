"""The ModelDeployment CRD, generated from the pydantic models in ``baton/core/api.py``.

``baton crd`` prints it; ``helm/baton/files/crds/baton.dev_modeldeployments.yaml`` is its
checked-in copy (the chart renders it as a template, so ``helm upgrade`` updates it; without Helm,
``kubectl apply -f`` it) and ``tests/unit/test_crd.py`` fails when the two differ.

The conversion turns pydantic's JSON Schema into a Kubernetes structural schema: references
inlined, ``Optional`` as ``nullable``, ``const`` as a one-value ``enum``, JSON Schema 2020's
numeric ``exclusiveMinimum`` as OpenAPI 3.0's ``minimum`` plus ``exclusiveMinimum: true``,
titles dropped.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from typing import Any

import yaml
from pydantic import BaseModel

from baton.core.api import GROUP, KIND, PLURAL, VERSION, ModelDeploymentSpec, ModelDeploymentStatus

__all__ = ["CRD_PATH", "generate_crd", "main"]

CRD_PATH = "helm/baton/files/crds/baton.dev_modeldeployments.yaml"
_DESCRIPTION = (
    "A model served with P/D disaggregation and wide EP, in cells of one decode "
    "group and its prefill instances per NVLink domain."
)
_KEEP = (
    "description",
    "default",
    "enum",
    "minimum",
    "maximum",
    "minLength",
    "maxLength",
    "pattern",
    "minItems",
    "maxItems",
    "format",
    "x-kubernetes-validations",
    "x-kubernetes-preserve-unknown-fields",
)


def _structural(node: Mapping[str, Any], defs: Mapping[str, Any]) -> dict[str, Any]:
    if "$ref" in node:
        target = _structural(defs[node["$ref"].rsplit("/", 1)[-1]], defs)
        return {**target, **{k: v for k, v in node.items() if k in ("description", "default")}}
    if "anyOf" in node:
        options = [option for option in node["anyOf"] if option.get("type") != "null"]
        if len(options) != 1:
            raise ValueError(f"unions other than Optional do not fit a structural schema: {node}")
        merged = {
            **_structural(options[0], defs),
            **{k: v for k, v in node.items() if k in _KEEP and k != "default"},
        }
        if len(options) < len(node["anyOf"]):
            merged["nullable"] = True
        if node.get("default") is not None:
            merged["default"] = node["default"]
        return merged
    out: dict[str, Any] = {k: node[k] for k in _KEEP if k in node}
    if "const" in node:
        out["enum"] = [node["const"]]
    if "exclusiveMinimum" in node:
        out["minimum"], out["exclusiveMinimum"] = node["exclusiveMinimum"], True
    kind = node.get("type")
    if kind is None and "enum" in node:
        kind = "string"
    out["type"] = kind
    if kind == "array":
        out["items"] = _structural(node["items"], defs)
    elif kind == "object":
        if "properties" in node:
            out["properties"] = {
                name: _structural(prop, defs) for name, prop in node["properties"].items()
            }
            if node.get("required"):
                out["required"] = list(node["required"])
        elif isinstance(node.get("additionalProperties"), Mapping):
            out["additionalProperties"] = _structural(node["additionalProperties"], defs)
        else:
            out["x-kubernetes-preserve-unknown-fields"] = True
    return out


def _schema(model: type[BaseModel]) -> dict[str, Any]:
    raw = model.model_json_schema(by_alias=True)
    return _structural(raw, raw.get("$defs", {}))


def generate_crd() -> dict[str, Any]:
    columns: Sequence[tuple[str, str, str, str]] = (
        (
            "Ready",
            "string",
            '.status.conditions[?(@.type=="Ready")].status',
            "the Ready condition: False for a refused spec or a degraded deployment too",
        ),
        (
            "Reason",
            "string",
            '.status.conditions[?(@.type=="Ready")].reason',
            "why the deployment is or is not Ready (the Ready condition's reason)",
        ),
        ("Cells", "string", ".status.ready", "ready cells / wanted cells"),
        (
            "Updated",
            "string",
            ".status.updated",
            "cells ready on the current revision / wanted cells",
        ),
        ("Prefill", "string", ".status.prefillReady", "ready / desired prefill instances"),
        ("Decode Ranks", "integer", ".status.decodeRanks", "ready decode ranks"),
        ("Balance", "string", ".status.balance", "EPLB balance of the target model"),
        ("Age", "date", ".metadata.creationTimestamp", ""),
    )
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": KIND.lower(),
                "shortNames": ["mdep"],
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    # scale: `kubectl scale mdep NAME --replicas=N` sets spec.cells
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.cells",
                            "statusReplicasPath": ".status.placedCells",
                        },
                    },
                    "additionalPrinterColumns": [
                        {
                            "name": name,
                            "type": kind,
                            "jsonPath": path,
                            **({"description": text} if text else {}),
                        }
                        for name, kind, path, text in columns
                    ],
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "description": _DESCRIPTION,
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": _schema(ModelDeploymentSpec),
                                "status": _schema(ModelDeploymentStatus),
                            },
                            "required": ["spec"],
                        }
                    },
                }
            ],
        },
    }


def render() -> str:
    header = "# Generated by `baton crd` from baton/core/api.py; do not edit by hand.\n"
    return header + yaml.safe_dump(generate_crd(), sort_keys=False, width=100)


def main(argv: Sequence[str] | None = None) -> int:
    del argv
    sys.stdout.write(render())
    return 0
