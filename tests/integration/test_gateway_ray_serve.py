"""The gateway as a Ray Serve application (``router.serve:app``) in front of a real ``baton sim``.

One local Ray (2 CPUs, no dashboard) per test; Serve's HTTP proxy listens on a free loopback
port; the official openai client is the caller.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import yaml

from baton.core.follow import DeploymentRef
from tests.helpers import SimHandle, free_port

# Ray's own pydantic models use deprecated Field arguments: not ours to fix, and not an error here.
RAY_WARNINGS = "ignore::DeprecationWarning:ray"
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", category=DeprecationWarning, module="ray")
    import ray
    from ray import serve

    from router.serve import POOL_FILE_ENV, app, config_from_serve_args

pytestmark = pytest.mark.filterwarnings(RAY_WARNINGS)
MODEL = "dsv4"


def write_pool(path: Path, decode: SimHandle) -> Path:
    path.write_text(yaml.safe_dump({"cells": [{"name": "c0", "decode": [{"url": decode.url}]}]}))
    return path


@pytest.fixture
def serve_port(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """A local Ray with Serve's HTTP proxy on a free loopback port; both shut down after."""
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")  # no network here; Ray must not try
    ray.init(
        address="local",  # a fresh Ray for this test, never a cluster found on the machine
        num_cpus=2,
        include_dashboard=False,
        object_store_memory=100 * 1024 * 1024,
        log_to_driver=False,
        logging_level=logging.WARNING,
    )
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield port
    finally:
        serve.shutdown()
        ray.shutdown()


def test_serve_app_streams_a_chat_completion_through_the_gateway(
    start_sim, serve_port: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    decode = start_sim("--served-model-name", MODEL)
    monkeypatch.setenv(POOL_FILE_ENV, str(write_pool(tmp_path / "pool.yaml", decode)))
    serve.run(app({}), name="gateway", route_prefix="/")  # what `serve run router.serve:app` does

    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{serve_port}/v1", api_key="unused", max_retries=0, timeout=30
    )
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hello through Ray Serve"}],
        max_tokens=7,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = chunks[-1].usage
    assert len(text) == 7 * 4  # the simulator's tokens are four characters each
    assert usage is not None
    assert usage.completion_tokens == 7
    assert usage.prompt_tokens > 0


def test_serve_args_pool_file_wins_over_the_environment(tmp_path: Path) -> None:
    from_args = tmp_path / "args.yaml"
    from_args.write_text("cells: [{name: a, decode: [{url: 'http://127.0.0.1:1'}]}]\n")
    config = config_from_serve_args(
        {"pool_file": str(from_args), "pd_threshold_tokens": "64"},
        {POOL_FILE_ENV: str(tmp_path / "missing.yaml"), "BATON_API_KEYS": "k1, k2"},
    )
    assert config.pool is not None and config.pool.cells[0].name == "a"
    assert config.pool_file == from_args
    assert config.settings.pd_threshold_tokens == 64
    assert config.api_keys == ("k1", "k2")


def test_serve_args_without_a_pool_name_every_way_to_give_one() -> None:
    wanted = f"pass pool_file=PATH or model_deployment=NAMESPACE/NAME .* or set {POOL_FILE_ENV}"
    with pytest.raises(ValueError, match=wanted):
        config_from_serve_args({}, {})


def test_serve_args_can_follow_a_model_deployment_instead_of_a_pool_file(tmp_path: Path) -> None:
    config = config_from_serve_args(
        {"model_deployment": "serving/dsv4", "kubeconfig": str(tmp_path / "kubeconfig")},
        {POOL_FILE_ENV: str(tmp_path / "ignored.yaml")},
    )
    assert config.pool is None and config.pool_file is None
    assert config.model_deployment == DeploymentRef("serving", "dsv4", tmp_path / "kubeconfig")
    with pytest.raises(ValueError, match="expected NAMESPACE/NAME"):
        config_from_serve_args({"model_deployment": "dsv4"}, {})


def test_unknown_serve_arg_is_named() -> None:
    with pytest.raises(ValueError, match="argument 'pool_fil': Extra inputs are not permitted"):
        config_from_serve_args({"pool_fil": "x.yaml"}, {})
