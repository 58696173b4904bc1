"""``baton up --engine vllm``: a newcomer's local stack on live vLLM engines, served through the
openai client and stopped clean."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from baton.up import LIVE_SERVED_NAME
from tests.helpers import ROOT, baton_command
from tests.live.conftest import baton_up_live


def test_baton_up_on_live_engines_serves_a_chat_and_stops_every_process(tmp_path: Path) -> None:
    with baton_up_live(tmp_path) as stack:
        client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="x", max_retries=0)
        stream = client.chat.completions.create(
            model=LIVE_SERVED_NAME,
            messages=[{"role": "user", "content": "plan the rollout of the next cell " * 40}],
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = list(stream)
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8
        assert '"role": "prefill"' in stack.targets.read_text()
        children = psutil.Process(stack.process.pid).children(recursive=True)
        assert len(children) >= 5  # two engines with their engine cores, and the gateway
        stack.process.send_signal(signal.SIGTERM)
        assert stack.process.wait(timeout=120) == 0
        _, alive = psutil.wait_procs(children, timeout=60)
        assert not alive
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{stack.url}/health", timeout=5)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (("--eplb-mode", "plugin"), "vLLM refuses EPLB on CPU devices"),
        (("--racks", "2"), "--racks applies to the simulated rack only"),
    ],
)
def test_flags_of_the_simulated_rack_are_refused_with_the_fix(
    flags: tuple[str, ...], message: str
) -> None:
    answer = subprocess.run(
        baton_command("up", "--engine", "vllm", *flags),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert answer.returncode == 2
    assert message in answer.stderr
