"""The gateway as a Ray Serve application (``router.serve:app``) in front of a real P/D pair of
``baton sim`` engines (a prefill instance and a decode server, NIXL between them).

One local Ray (2 CPUs, no dashboard) per test; Serve's HTTP proxy listens on a free loopback
port; the official openai client is the caller.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest
import yaml

from baton.core.follow import DeploymentRef
from tests.helpers import SimHandle, cached_tokens_of, eventually, free_port, scrape, usage_of

# Ray's own pydantic models use deprecated Field arguments: not ours to fix, and not an error here.
RAY_WARNINGS = "ignore::DeprecationWarning:ray"
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", category=DeprecationWarning, module="ray")
    import ray
    from ray import serve

    from router.serve import POOL_FILE_ENV, app, config_from_serve_args

pytestmark = pytest.mark.filterwarnings(RAY_WARNINGS)
MODEL = "dsv4"
LONG = "The cell keeps prefill and decode in one NVLink domain. " * 40  # past the P/D threshold


def write_pool(path: Path, prefill: SimHandle, decode: SimHandle) -> Path:
    cell = {"name": "c0", "prefill": [prefill.url], "decode": [{"url": decode.url}]}
    path.write_text(yaml.safe_dump({"cells": [cell]}))
    return path


@pytest.fixture
def serve_port(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """A local Ray with Serve's HTTP proxy on a free loopback port; both shut down after."""
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")  # no network here; Ray must not try
    # Ray waits 30 s for its GCS server to write its port file, which a busy host can miss
    # ("Timed out waiting for file .../gcs_server_port_...", seen in make test-busy); Ray reads
    # this deadline from the environment.
    monkeypatch.setenv("RAY_gcs_server_port_wait_time_s", "300")
    # Ray gives its raylet a fixed 30 s to register, which a busy host can miss ("The current
    # node timed out during startup", seen in a fresh clone's make test): a second start
    # doubles the deadline.
    for attempt in (1, 2):
        try:
            ray.init(
                address="local",  # a fresh Ray for this test, never a cluster on the machine
                num_cpus=2,
                include_dashboard=False,
                object_store_memory=100 * 1024 * 1024,
                log_to_driver=False,
                logging_level=logging.WARNING,
            )
            break
        except Exception as exc:
            ray.shutdown()
            if attempt == 2 or "timed out during startup" not in str(exc):
                raise
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield port
    finally:
        serve.shutdown()
        ray.shutdown()


def test_serve_app_streams_a_chat_completion_through_prefill_kv_handoff_and_decode(
    start_pd: Callable[..., tuple[SimHandle, SimHandle]], serve_port: int, tmp_path: Path
) -> None:
    prefill, decode = start_pd(flags=("--served-model-name", MODEL))
    pool = write_pool(tmp_path / "pool.yaml", prefill, decode)
    # What `serve run router.serve:app pool_file=...` does.
    serve.run(app({"pool_file": str(pool)}), name="gateway", route_prefix="/")
    gateway = f"http://127.0.0.1:{serve_port}"

    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0, timeout=30)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": LONG}],
        max_tokens=7,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    usage = usage_of(chunks[-1])
    assert len(text) == 7 * 4  # the simulator's tokens are four characters each
    assert usage.completion_tokens == 7
    # Prefill computed the prompt; decode pulled it over NIXL instead of computing it.
    assert scrape(prefill.url, "vllm:prompt_tokens_total") == usage.prompt_tokens
    assert (
        scrape(decode.url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
        == usage.prompt_tokens
    )
    assert scrape(decode.url, "vllm:nixl_bytes_transferred_count") == 1
    # Decode alone would report every prompt token cached; the gateway reports prefill's none.
    assert cached_tokens_of(chunks[-1]) == 0
    # The gateway's own metrics, served by the Serve replica like every other route.
    assert scrape(gateway, "baton_gateway_routing_decisions_total", path="pd") == 1
    assert scrape(gateway, "baton_gateway_routing_decisions_total", path="decode_only") == 0
    assert scrape(gateway, "baton_gateway_requests_total", outcome="ok") == 1
    eventually(lambda: scrape(gateway, "baton_gateway_in_flight_requests") == 0)
    assert scrape(prefill.url, "vllm:kv_cache_usage_perc") == 0  # the lease ended with the pull


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


def test_serve_args_can_follow_model_deployments_instead_of_a_pool_file(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    config = config_from_serve_args(
        {"model_deployment": "serving/dsv4, small/tiny", "kubeconfig": str(kubeconfig)},
        {POOL_FILE_ENV: str(tmp_path / "ignored.yaml")},
    )
    assert config.pool is None and config.pool_file is None
    assert config.model_deployments == (
        DeploymentRef("serving", "dsv4", kubeconfig),
        DeploymentRef("small", "tiny", kubeconfig),
    )
    with pytest.raises(ValueError, match="expected NAMESPACE/NAME"):
        config_from_serve_args({"model_deployment": "dsv4"}, {})


def test_unknown_serve_arg_is_named() -> None:
    with pytest.raises(ValueError, match="argument 'pool_fil': Extra inputs are not permitted"):
        config_from_serve_args({"pool_fil": "x.yaml"}, {})
