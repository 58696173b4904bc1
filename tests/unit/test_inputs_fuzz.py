"""Fuzzing every file and flag a user hands Baton (hypothesis): the pool file, the EPLB
service's configuration, the simulator's cluster file, and the flags of ``baton gateway`` and
``baton sim``. Whatever the input, it is taken or refused with a ValueError (files: naming the
file) or argparse's exit 2, never another exception."""

from __future__ import annotations

import argparse
import contextlib
import io
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from eplb.config import load_config
from router.cli import build_parser as gateway_parser
from router.cli import config_from_args as gateway_config
from router.targets import load_pool_file
from sim.cli import build_parser as sim_parser
from sim.cli import config_from_args as sim_config
from sim.cluster import load_cluster

SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**9), 10**9),
    st.floats(allow_nan=True),
    st.text(max_size=16),
    st.sampled_from(["http://127.0.0.1:8000", "https://x:1", "cell-0", "127.0.0.1:50100"]),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=12,
)
# Valid files, each the start of its mutations.
EXAMPLES: dict[str, dict[str, Any]] = {
    "pool": {
        "cells": [
            {
                "name": "cell-0",
                "prefill": ["http://127.0.0.1:8100"],
                "decode": [{"url": "http://127.0.0.1:8200", "ranks": [0, 1, 2, 3]}],
            }
        ]
    },
    "eplb": {"windowSize": 500, "stepInterval": 500, "groups": [{"name": "c", "agents": ["h:1"]}]},
    "cluster": {
        "decode_groups": [
            {
                "name": "c",
                "data_parallel_size": 8,
                "api_servers": 2,
                "port": 9000,
                "side_channel_port": 9100,
            }
        ]
    },
}
LOADERS: dict[str, Callable[[Path], object]] = {
    "pool": load_pool_file,
    "eplb": load_config,
    "cluster": load_cluster,
}


@st.composite
def _mutated(draw: st.DrawFn, example: dict[str, Any]) -> object:
    """The example with one to three keys (at any depth) replaced or added."""
    document: Any = yaml.safe_load(yaml.safe_dump(example))
    for _ in range(draw(st.integers(1, 3))):
        node = document
        while isinstance(node, (dict, list)) and node and draw(st.booleans()):
            keys = list(node) if isinstance(node, dict) else list(range(len(node)))
            key = draw(st.sampled_from(keys))
            if not isinstance(node[key], (dict, list)):
                break
            node = node[key]
        if isinstance(node, dict):
            node[draw(st.one_of(st.sampled_from([*node, "extra"]), st.text(max_size=6)))] = draw(
                VALUES
            )
        elif isinstance(node, list) and node:
            node[draw(st.integers(0, len(node) - 1))] = draw(VALUES)
    return document


def _text(kind: str) -> st.SearchStrategy[bytes]:
    documents = st.one_of(_mutated(EXAMPLES[kind]), VALUES)
    return st.one_of(
        documents.map(lambda d: yaml.safe_dump(d).encode()),
        st.binary(max_size=64),
        st.text(max_size=64).map(str.encode),
    )


@pytest.mark.parametrize("kind", sorted(LOADERS))
def test_any_file_is_taken_or_refused_naming_the_file(kind: str) -> None:
    @settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(_text(kind))
    def check(content: bytes) -> None:
        with tempfile.TemporaryDirectory() as directory:
            path = Path(directory) / f"{kind}.yaml"
            path.write_bytes(content)
            try:
                LOADERS[kind](path)
            except ValueError as exc:
                assert str(exc).startswith(str(path)), exc

    check()


def _argv(parser: argparse.ArgumentParser) -> st.SearchStrategy[list[str]]:
    flags = sorted(
        option
        for action in parser._actions
        for option in action.option_strings
        if option.startswith("--") and option not in ("--help",)
    )
    word = st.one_of(
        st.text(max_size=12).filter(lambda w: not w.startswith("-")),
        st.integers(-5, 70_000).map(str),
        st.sampled_from(["0", "1.5", "-1", "{}", '{"x": 1}', "/nonexistent", "http://h:1"]),
    )
    pair = st.tuples(st.sampled_from(flags), st.lists(word, max_size=1))
    return st.lists(pair, max_size=5).map(lambda pairs: [w for f, ws in pairs for w in (f, *ws)])


@pytest.mark.parametrize(
    ("parser", "build"),
    [(gateway_parser, gateway_config), (sim_parser, sim_config)],
    ids=["gateway", "sim"],
)
def test_any_flags_are_taken_or_refused_with_a_message(
    parser: Callable[[], argparse.ArgumentParser], build: Callable[[argparse.Namespace], object]
) -> None:
    @settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(_argv(parser()))
    def check(argv: list[str]) -> None:
        with contextlib.redirect_stderr(io.StringIO()):
            try:
                args = parser().parse_args(argv)
            except SystemExit as exc:
                assert exc.code == 2
                return
        try:
            build(args)
        except ValueError as exc:
            assert str(exc)

    check()
