"""A DeepSeek-V3-architecture model (MLA, routed and shared experts) through P/D: the handoff of
latent KV over NIXL, behind the gateway."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import httpx
import openai
import pytest

from rigs.processes import eventually
from rigs.vllm_live import LiveEngine, LiveRig, live_spec
from tests.helpers import SimHandle, cached_tokens_of, scrape
from tests.live.conftest import gateway_flags

TEXT = "expert rank balance prefill decode handoff cache token " * 40


@pytest.fixture(scope="module")
def cell(rig: LiveRig) -> dict[str, LiveEngine]:
    return rig.start_cell(live_spec(rig.env.model("tiny-deepseek-v3"), "tiny-dsv3"))


@pytest.fixture(scope="module")
def client(
    cell: dict[str, LiveEngine], start_gateway_module: Callable[..., SimHandle]
) -> Iterator[openai.OpenAI]:
    gateway: SimHandle = start_gateway_module(*gateway_flags(cell["prefill"], cell["decode"]))
    eventually(lambda: httpx.get(f"{gateway.url}/ready", timeout=5).status_code == 200, 300)
    with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0) as c:
        yield c


def test_pd_greedy_tokens_equal_a_direct_run(
    cell: dict[str, LiveEngine], client: openai.OpenAI
) -> None:
    pulled = scrape(cell["decode"].url, "vllm:nixl_bytes_transferred_count")
    through = client.completions.create(
        model="tiny-dsv3", prompt=TEXT, max_tokens=16, temperature=0, logprobs=1
    )
    assert scrape(cell["decode"].url, "vllm:nixl_bytes_transferred_count") == pulled + 1
    direct = httpx.post(
        f"{cell['prefill'].url}/v1/completions",
        json={
            "model": "tiny-dsv3",
            "prompt": TEXT,
            "max_tokens": 16,
            "temperature": 0,
            "logprobs": 1,
        },
        timeout=300,
    ).json()["choices"][0]["logprobs"]
    assert through.choices[0].logprobs is not None
    assert through.choices[0].logprobs.tokens == direct["tokens"]
    # MLA's latent KV moved as bf16 blocks: logprobs agree to bf16's precision, not bit for bit
    assert through.choices[0].logprobs.token_logprobs == pytest.approx(
        direct["token_logprobs"], abs=0.02
    )


def test_mla_on_cpu_caches_no_prefix_so_every_prompt_token_is_computed(
    client: openai.OpenAI,
) -> None:
    # vLLM turns prefix caching off for MLA on CPU: a repeated prompt reports nothing cached
    first = client.completions.create(model="tiny-dsv3", prompt=TEXT + " again", max_tokens=2)
    second = client.completions.create(model="tiny-dsv3", prompt=TEXT + " again", max_tokens=2)
    assert cached_tokens_of(first) == cached_tokens_of(second) == 0
