"""Someone else's P/D router accepts the simulator as vLLM.

vllm-router (the vLLM project's Rust router, from PyPI) runs its NIXL P/D sequence against a
prefill and a decode ``baton sim``: prefill with ``do_remote_decode``, then decode with the
returned ``kv_transfer_params``. The completions must stream correctly and the decode engine
must have pulled the prompt's KV instead of computing it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.helpers import SimHandle, eventually, free_port, scrape, stop_process, usage_of


@pytest.fixture
def vllm_router(
    start_pd: Callable[..., tuple[SimHandle, SimHandle]], tmp_path: Path
) -> Iterator[tuple[str, str, str]]:
    prefill, decode = start_pd()
    binary = shutil.which("vllm-router") or str(Path(sys.executable).parent / "vllm-router")
    port = free_port()
    log = (tmp_path / "vllm-router.log").open("wb")
    process = subprocess.Popen(
        [
            binary,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--vllm-pd-disaggregation",
            "--prefill",
            prefill.url,
            "--decode",
            decode.url,
            "--policy",
            "round_robin",
            "--prometheus-port",
            str(free_port()),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        eventually(lambda: httpx.get(f"{url}/health", timeout=1).status_code == 200, timeout=60)
        yield url, prefill.url, decode.url
    finally:
        stop_process(process)


def test_vllm_router_streams_pd_completions_through_the_simulator(
    vllm_router: tuple[str, str, str],
) -> None:
    router_url, prefill_url, decode_url = vllm_router
    client = openai.OpenAI(base_url=f"{router_url}/v1", api_key="unused", max_retries=0)
    prompt = "context shared by prefill and decode " * 60
    for turn in range(3):
        stream = client.completions.create(
            model="deepseek-ai/DeepSeek-V4.1-Flash",
            prompt=f"{prompt} turn {turn}",
            max_tokens=12,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        assert len(text) == 12 * 4
    prompt_tokens = scrape(decode_url, "vllm:prompt_tokens_total")
    assert scrape(prefill_url, "vllm:prompt_tokens_total") == prompt_tokens
    assert (
        scrape(decode_url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") > 0
    )
    assert scrape(decode_url, "vllm:prompt_tokens_by_source_total", source="local_compute") == 0
    assert scrape(prefill_url, "vllm:kv_cache_usage_perc") == 0  # every handoff was pulled


def test_vllm_router_chat_through_the_simulator(vllm_router: tuple[str, str, str]) -> None:
    router_url, _, decode_url = vllm_router
    client = openai.OpenAI(base_url=f"{router_url}/v1", api_key="unused", max_retries=0)
    response = client.chat.completions.create(
        model="deepseek-ai/DeepSeek-V4.1-Flash",
        messages=[{"role": "user", "content": "hello from vllm-router " * 20}],
        max_tokens=6,
        extra_body={"ignore_eos": True},
    )
    assert usage_of(response).completion_tokens == 6
    assert scrape(decode_url, "vllm:nixl_bytes_transferred_count") == 1
