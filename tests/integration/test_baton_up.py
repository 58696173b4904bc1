"""``baton up``: the whole local stack starts, serves through the openai client, and stops clean."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import psutil
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletionMessageParam

from baton.core.model import SERVED_MODEL_NAME
from baton.core.sim_tokenizer import render_chat
from rigs.processes import ProcessExited
from tests.helpers import (
    ROOT,
    baton_command,
    eventually,
    free_port,
    scrape,
    scrape_by,
    stop_process,
)


@contextlib.contextmanager
def baton_up(tmp_path: Path, *flags: str) -> Iterator[tuple[subprocess.Popen[bytes], str, Path]]:
    port = free_port()
    log = (tmp_path / "up.log").open("wb")
    process = subprocess.Popen(
        baton_command("up", "--port", str(port), *flags),
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        if process.poll() is not None:
            output = (tmp_path / "up.log").read_text()
            raise ProcessExited(f"baton up exited with {process.returncode}:\n{output}")
        return httpx.get(f"{url}/ready", timeout=2).status_code == 200

    try:
        eventually(ready, timeout=180)
        yield process, url, tmp_path / "up.log"
    finally:
        stop_process(process)


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], str, Path]]:
    with baton_up(tmp_path) as running:
        yield running


def test_baton_up_prints_the_rack_map_and_streams_through_the_gateway(
    stack: tuple[subprocess.Popen[bytes], str, Path],
) -> None:
    _, url, log = stack
    output = eventually(lambda: "OpenAI API at" in log.read_text() and log.read_text())
    assert isinstance(output, str)
    assert "rack-0-tray-0   DDDD" in output and "rack-0-tray-8   SSSS" in output
    assert f"OpenAI API at {url}/v1" in output
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    messages: list[ChatCompletionMessageParam] = [
        {"role": "user", "content": "plan the rack " * 200}
    ]
    stream = client.chat.completions.create(
        model=SERVED_MODEL_NAME,
        messages=messages,
        stream=True,
        max_tokens=16,
        extra_body={"ignore_eos": True},
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert len(text) == 16 * 4
    # the prompt's blocks, reported by the prefill rank that computed them, reach the gateway
    prompt_blocks = len(render_chat(messages)) // (4 * 16)

    def reported() -> float:
        return sum(scrape_by(url, "baton_gateway_kv_event_blocks", "target").values())

    eventually(lambda: reported() >= prompt_blocks, timeout=60)


def test_sigterm_stops_every_process_and_frees_the_ports(
    stack: tuple[subprocess.Popen[bytes], str, Path],
) -> None:
    process, url, _ = stack
    children = psutil.Process(process.pid).children(recursive=True)
    assert len(children) >= 2  # the engines and the gateway
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == 0
    _, alive = psutil.wait_procs(children, timeout=10)
    assert not alive
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health", timeout=2)


def test_once_ready_the_eplb_service_follows_the_agents_of_every_decode_group(
    tmp_path: Path,
) -> None:
    eplb = free_port()
    with baton_up(tmp_path, "--eplb-metrics-port", str(eplb)):
        # scraped as soon as the gateway is ready: the first window boundary must find the
        # service following the group since before any load
        synced = scrape_by(f"http://127.0.0.1:{eplb}", "baton_eplb_group_synced", "group")
    assert synced == {"dsv4-cell-0": 1.0}


def test_baton_up_fails_clearly_when_the_eplb_service_exits_before_it_is_up(
    tmp_path: Path,
) -> None:
    log = tmp_path / "up.log"
    # The service's metrics port, taken: it exits at start.
    with socket.create_server(("127.0.0.1", free_port())) as taken:
        process = subprocess.Popen(
            [
                *baton_command("up", "--port", str(free_port())),
                *("--eplb-metrics-port", str(taken.getsockname()[1])),
            ],
            cwd=ROOT,
            stdout=log.open("wb"),
            stderr=subprocess.STDOUT,
        )
        try:
            assert process.wait(timeout=180) == 1
        finally:
            stop_process(process)
    output = log.read_text()
    assert "baton up: error: the EPLB service exited" in output
    assert "Baton is up" not in output


def test_in_plugin_mode_the_eplb_service_takes_the_engines_reports(tmp_path: Path) -> None:
    eplb = free_port()
    flags = ("--eplb-mode", "plugin", "--eplb-metrics-port", str(eplb))
    with baton_up(tmp_path, *flags) as (_, url, log):
        assert httpx.get(f"http://127.0.0.1:{eplb}/metrics", timeout=5).status_code == 200
        output = eventually(lambda: "EPLB reports" in log.read_text() and log.read_text())
        assert isinstance(output, str)
        reports = re.search(r"EPLB reports +(http://\S+)/v1/windows", output)
        assert reports is not None
        assert httpx.get(f"{reports.group(1)}/health", timeout=5).status_code == 200
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        answer = client.completions.create(model=SERVED_MODEL_NAME, prompt="hi", max_tokens=4)
        assert answer.usage is not None and answer.usage.completion_tokens == 4


@pytest.mark.parametrize(
    ("mode", "says"),
    [
        ("vllm", "the engines' own, vLLM's policy (no EPLB service)"),
        ("off", "EPLB              off"),
    ],
)
def test_the_comparison_modes_serve_without_an_eplb_service(
    tmp_path: Path, mode: str, says: str
) -> None:
    targets = tmp_path / "targets.json"
    flags = ("--eplb-mode", mode, "--prometheus-targets", str(targets))
    with baton_up(tmp_path, *flags) as (process, url, log):
        output = eventually(lambda: says in log.read_text() and log.read_text())
        assert isinstance(output, str) and "EPLB metrics" not in output
        commands = [" ".join(p.cmdline()) for p in psutil.Process(process.pid).children()]
        assert not any("baton.cli eplb" in command for command in commands)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        answer = client.completions.create(model=SERVED_MODEL_NAME, prompt="hi", max_tokens=8)
        assert answer.usage is not None and answer.usage.completion_tokens == 8
        decode = next(
            group["targets"][0]
            for group in json.loads(targets.read_text())
            if group["labels"].get("role") == "decode"
        )
        # the simulator's own balance series, whichever EPLB runs: decode steps were routed
        steps = scrape_by(f"http://{decode}", "baton:sim_expert_balance_count", "moe_model")
        assert steps["target"] > 0


def test_max_requests_per_rank_holds_the_rack_to_its_bound_and_answers_429_past_it(
    tmp_path: Path,
) -> None:
    flags = ("--eplb-mode", "off", "--max-requests-per-rank", "1", "--queue-timeout", "1")
    with baton_up(tmp_path, *flags) as (_, url, _):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)

        def open_stream() -> openai.Stream[Completion]:
            # long enough to hold its decode rank for the whole test
            return client.completions.create(
                model=SERVED_MODEL_NAME,
                prompt="hold the rank",
                max_tokens=20_000,
                stream=True,
                extra_body={"ignore_eos": True},
            )

        held: list[openai.Stream[Completion]] = []
        try:
            with pytest.raises(openai.RateLimitError) as refused:
                while len(held) < 200:  # more than the rack's decode ranks
                    held.append(open_stream())
            assert held, "the first request found no decode rank free"
            assert refused.value.response.headers["retry-after"] == "1"
            assert refused.value.code == "rate_limit_exceeded"
            waits = scrape_by(url, "baton_gateway_admission_waits_total", "result")
            assert waits.get("saturated") == 1.0
            # one stream closed frees its rank, once the gateway and the engine's load (its
            # next load sync) both say so: the next request is placed
            held.pop().close()
            eventually(
                lambda: (
                    scrape(url, "baton_gateway_in_flight_requests", role="decode") <= len(held)
                    and scrape(url, "baton_gateway_peer_in_flight_requests") == 0
                ),
                timeout=60,
            )
            held.append(open_stream())
            assert next(iter(held[-1])).choices[0].text
        finally:
            for stream in held:
                stream.close()
