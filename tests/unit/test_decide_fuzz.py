"""Fuzzing the controller with ModelDeployment specs a user could write (hypothesis).

Whatever the spec, one reconcile never raises; a spec the resource refuses gets Placed=False
with reason InvalidSpec and a message naming the field, and a spec it takes gets no such
condition. The specs are the default one with random fields set to random JSON values, unknown
fields among them.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any, get_args, get_origin

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from baton.core.api import ModelDeployment, ModelDeploymentSpec
from controller.decide import decide
from controller.observe import Observed
from controller.topology import synthetic_nodes

NODES = synthetic_nodes(1)
T0 = datetime(2026, 12, 2, tzinfo=UTC)


def _paths(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """Every field of ``model`` as a path of the names a manifest uses, nested ones too."""
    for name, info in model.model_fields.items():
        path = (*prefix, info.alias or name)
        yield path
        annotation = info.annotation
        nested = [annotation, *get_args(annotation)] if get_origin(annotation) else [annotation]
        for candidate in nested:
            if isinstance(candidate, type) and issubclass(candidate, BaseModel):
                yield from _paths(candidate, path)


PATHS = sorted(set(_paths(ModelDeploymentSpec)))
JSON = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**6), 10**6),
    st.sampled_from([0, 1, 2, 4, 8, 32, 1000, 3000]),
    st.text(max_size=12),
    st.sampled_from(["agent", "plugin", "auto", "nixl", "NixlConnector", "vllm"]),
    st.lists(st.text(max_size=6), max_size=3),
    st.dictionaries(st.text(max_size=6), st.integers(), max_size=2),
)
DEFAULTS = ModelDeploymentSpec(model="m").model_dump(by_alias=True, mode="json")


def _default(path: tuple[str, ...]) -> object:
    node: object = DEFAULTS
    for key in path:
        node = node.get(key) if isinstance(node, dict) else None
    return node


def _plausible(path: tuple[str, ...]) -> st.SearchStrategy[object]:
    """Values of the field's own type, mostly within its range: specs a user meant."""
    default = _default(path)
    if isinstance(default, bool):
        return st.booleans()
    if isinstance(default, int):
        return st.sampled_from([0, 1, 2, 4, 8, 16, 32, 500, 1000, 3000])
    if isinstance(default, str):
        return st.sampled_from([default, "plugin", "agent", "auto", "nixl"])
    return JSON


LEAVES = [path for path in PATHS if not isinstance(_default(path), dict)]
KNOWN = st.sampled_from(LEAVES).flatmap(
    lambda path: st.tuples(st.just(path), st.one_of(_plausible(path), JSON))
)
UNKNOWN = st.tuples(
    st.tuples(st.sampled_from(["cell", "eplb", "engine"]), st.text(min_size=1, max_size=8)), JSON
)
MEANT = st.sampled_from(LEAVES).flatmap(lambda path: st.tuples(st.just(path), _plausible(path)))
ANY = st.one_of(KNOWN, UNKNOWN, st.tuples(st.sampled_from(PATHS), JSON))
# half the specs are edits a user meant (often valid), half anything
EDITS = st.one_of(st.lists(MEANT, min_size=1, max_size=2), st.lists(ANY, min_size=1, max_size=3))


def _set(spec: dict[str, Any], path: tuple[str, ...], value: object) -> None:
    node = spec
    for key in path[:-1]:
        child = node.get(key)
        if not isinstance(child, dict):
            child = node[key] = {}
        node = child
    node[path[-1]] = value


def _deployment(spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "baton.dev/v1alpha1",
        "kind": "ModelDeployment",
        "metadata": {"name": "fuzzed", "namespace": "serving", "uid": "u1", "generation": 3},
        "spec": spec,
    }


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(EDITS)
def test_any_spec_is_reconciled_without_error_and_a_refused_one_says_which_field(
    edits: list[tuple[tuple[str, ...], object]],
) -> None:
    spec: dict[str, Any] = {"model": "deepseek-ai/DeepSeek-V4.1-Flash"}
    for path, value in edits:
        _set(spec, path, copy.deepcopy(value))
    deployment = _deployment(spec)
    try:
        ModelDeployment.model_validate(deployment)
        refusal = None
    except ValidationError as exc:
        refusal = exc
    actions = decide(Observed("serving", [deployment], NODES, [], [], T0))
    conditions = (actions.status.get("fuzzed") or {}).get("conditions") or []
    invalid = [c for c in conditions if c.get("reason") == "InvalidSpec"]
    event("refused" if refusal is not None else "accepted")
    if refusal is None:
        assert not invalid
        return
    assert sorted(c["type"] for c in invalid) == ["Placed", "Ready"]
    assert all(c["status"] == "False" for c in invalid)
    [condition] = [c for c in invalid if c["type"] == "Placed"]
    for error in refusal.errors():
        where = ".".join(map(str, error["loc"]))
        assert f"'{where}'" in condition["message"], (where, condition["message"])
    assert condition["observedGeneration"] == 3
