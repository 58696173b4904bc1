"""Baton's gateway in front of live vLLM engines: a one-tray cell (one prefill instance, one decode
rank) of the tiny Qwen3-MoE, started as the controller renders its pods, with the engines' API
key on. The same assertions as the simulator's tests where they apply."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types import CompletionUsage
from openai.types.chat import ChatCompletionMessageParam

from rigs.hazards import RewritingProxy, prompt
from rigs.processes import eventually, free_port
from rigs.vllm_live import LiveEngine, LiveRig, live_spec
from tests.helpers import SimHandle, cached_tokens_of, scrape, usage_of
from tests.live.conftest import (
    ENGINE_KEY,
    SECRETS,
    gateway_flags,
    moved,
    sources,
)

MODEL = "tiny-qwen3-moe"
BLOCK = 128  # vLLM's block size on CPU: prefix caching works in whole blocks of 128 tokens
FIRST = "baton_gateway_first_tokens_from_prefill_total"


def completion(client: openai.OpenAI, text: str, stream: bool) -> tuple[str, CompletionUsage]:
    if stream:
        chunks = list(
            client.completions.create(
                model="tiny",
                prompt=text,
                max_tokens=12,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        return "".join(c.choices[0].text for c in chunks if c.choices), usage_of(chunks[-1])
    answer = client.completions.create(model="tiny", prompt=text, max_tokens=12)
    return answer.choices[0].text, usage_of(answer)


def chat(client: openai.OpenAI, text: str, stream: bool) -> tuple[str, CompletionUsage]:
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": text}]
    if stream:
        chunks = list(
            client.chat.completions.create(
                model="tiny",
                messages=messages,
                max_tokens=12,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        return text, usage_of(chunks[-1])
    answer = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12)
    return answer.choices[0].message.content or "", usage_of(answer)


@pytest.fixture(scope="module")
def cell(rig: LiveRig) -> dict[str, LiveEngine]:
    # the prefill pod publishes its KV events as the controller renders it (the rig moves the
    # endpoint to a port of its own)
    spec = live_spec(rig.env.model(MODEL), "tiny", api_key=True)
    return rig.start_cell(spec, SECRETS)


def kv_event_flags(rig: LiveRig, prefill: LiveEngine) -> tuple[str, ...]:
    """The gateway reads the prefill engine's KV events, keying prompts with the model's own
    tokenizer files."""
    assert prefill.kv_events is not None
    port = prefill.kv_events.rpartition(":")[2]
    return ("--tokenizer", str(rig.env.model(MODEL)), "--kv-events-port", port)


@pytest.fixture(scope="module")
def key_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "engine-key"
    path.write_text(ENGINE_KEY)
    return path


@pytest.fixture(scope="module")
def gateway(
    rig: LiveRig,
    cell: dict[str, LiveEngine],
    key_file: Path,
    start_gateway_module: Callable[..., SimHandle],
) -> SimHandle:
    handle: SimHandle = start_gateway_module(
        *gateway_flags(cell["prefill"], cell["decode"], key_file),
        *kv_event_flags(rig, cell["prefill"]),
        "--first-token-from-prefill",
    )
    eventually(lambda: httpx.get(f"{handle.url}/ready", timeout=5).status_code == 200, 300)
    return handle


@pytest.fixture(scope="module")
def client(gateway: SimHandle) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0) as c:
        yield c


def test_the_engines_refuse_a_call_without_their_key(cell: dict[str, LiveEngine]) -> None:
    for engine in cell.values():
        answer = httpx.post(
            f"{engine.url}/v1/completions", json={"model": "tiny", "prompt": "x"}, timeout=60
        )
        assert answer.status_code == 401
        assert httpx.get(f"{engine.url}/health", timeout=60).status_code == 200


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("route", ["completions", "chat"])
def test_every_prompt_token_reaches_decode_over_nixl_and_none_is_computed_there(
    cell: dict[str, LiveEngine],
    gateway: SimHandle,
    client: openai.OpenAI,
    route: str,
    stream: bool,
) -> None:
    text = prompt(f"pd {route} {stream}")
    before = sources(cell["decode"])
    prefill_before = sources(cell["prefill"])
    first_before = scrape(gateway.url, FIRST)
    generated, usage = (completion if route == "completions" else chat)(client, text, stream)
    assert usage.completion_tokens == 12 and generated
    # a streamed completion's first token may come from prefill: the decode engine's prompt is
    # then the prompt and that token
    continued = scrape(gateway.url, FIRST) - first_before
    room = len(tokens_of(cell["prefill"], text)) % BLOCK not in (0, BLOCK - 1)
    assert continued == int((route, stream) == ("completions", True) and room)
    pulled = moved(before, sources(cell["decode"]))
    # the decode engine computed no prompt token: all came over NIXL (or its own prefix cache)
    assert pulled["local_compute"] == 0
    assert (
        pulled["external_kv_transfer"] + pulled["local_cache_hit"]
        == usage.prompt_tokens + continued
    )
    assert pulled["external_kv_transfer"] > 0
    computed = moved(prefill_before, sources(cell["prefill"]))
    assert computed["local_compute"] + computed["local_cache_hit"] == usage.prompt_tokens


def test_pd_greedy_output_equals_a_direct_run_token_for_token(
    cell: dict[str, LiveEngine], gateway: SimHandle, client: openai.OpenAI
) -> None:
    # the gateway sends both legs the prompt's ids, from the engines' own tokenizer files;
    # the engine given the text tokenizes it itself
    as_ids = scrape(gateway.url, "baton_gateway_prompts_as_token_ids_total")
    text = prompt("greedy", 500)
    through = client.completions.create(
        model="tiny", prompt=text, max_tokens=24, temperature=0, logprobs=1
    )
    assert scrape(gateway.url, "baton_gateway_prompts_as_token_ids_total") == as_ids + 1
    direct = httpx.post(
        f"{cell['prefill'].url}/v1/completions",
        json={"model": "tiny", "prompt": text, "max_tokens": 24, "temperature": 0, "logprobs": 1},
        headers={"Authorization": f"Bearer {ENGINE_KEY}"},
        timeout=300,
    ).json()
    assert through.choices[0].logprobs is not None
    assert through.usage is not None
    assert through.usage.prompt_tokens == direct["usage"]["prompt_tokens"]
    assert through.choices[0].logprobs.tokens == direct["choices"][0]["logprobs"]["tokens"]
    assert (
        through.choices[0].logprobs.token_logprobs
        == (direct["choices"][0]["logprobs"]["token_logprobs"])
    )


def test_a_streamed_completions_first_token_from_prefill_leaves_the_greedy_output_unchanged(
    cell: dict[str, LiveEngine], gateway: SimHandle, client: openai.OpenAI
) -> None:
    text = prompt("first token", 500)
    # room for the first token in the prompt's last KV block (router/first_token.py)
    while len(tokens_of(cell["prefill"], text)) % BLOCK in (0, BLOCK - 1):
        text += " more"
    before = scrape(gateway.url, FIRST)
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt=text,
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert scrape(gateway.url, FIRST) == before + 1
    direct = httpx.post(
        f"{cell['prefill'].url}/v1/completions",
        json={"model": "tiny", "prompt": text, "max_tokens": 24, "temperature": 0},
        headers={"Authorization": f"Bearer {ENGINE_KEY}"},
        timeout=300,
    ).json()
    streamed = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(streamed) == direct["choices"][0]["text"]
    usage = usage_of(chunks[-1])
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        direct["usage"]["prompt_tokens"],
        24,
    )


def tokens_of(engine: LiveEngine, text: str) -> list[int]:
    answer = httpx.post(
        f"{engine.url}/tokenize",
        json={"model": "tiny", "prompt": text},
        headers={"Authorization": f"Bearer {ENGINE_KEY}"},
        timeout=60,
    )
    answer.raise_for_status()
    tokens: list[int] = answer.json()["tokens"]
    return tokens


def test_a_shared_prefix_hits_the_prefix_cache_on_both_sides_and_usage_says_so(
    cell: dict[str, LiveEngine], client: openai.OpenAI
) -> None:
    shared = prompt("shared prefix", 600)
    first = client.completions.create(model="tiny", prompt=shared + " first", max_tokens=4)
    assert cached_tokens_of(first) == 0
    before = sources(cell["decode"])
    second = client.completions.create(model="tiny", prompt=shared + " second turn", max_tokens=4)
    cached = cached_tokens_of(second)  # what the prefill engine served from its prefix cache
    assert cached >= BLOCK and cached % BLOCK == 0
    assert cached <= usage_of(second).prompt_tokens
    # the decode engine holds the first pull's blocks too: it pulls only the rest
    pulled = moved(before, sources(cell["decode"]))
    assert pulled["local_cache_hit"] >= BLOCK
    assert pulled["external_kv_transfer"] < usage_of(second).prompt_tokens


def test_a_client_gone_mid_stream_stops_the_decode_engines_work(
    cell: dict[str, LiveEngine], gateway: SimHandle
) -> None:
    decode = cell["decode"]
    generated = scrape(decode.url, "vllm:generation_tokens_total")
    # as many tokens as the context leaves: with one OpenMP thread an engine makes ~150 a
    # second, and 1,500 were once all made before a busy host carried the abort through
    body = {
        "model": "tiny",
        "prompt": prompt("abort"),
        "max_tokens": 3000,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream("POST", f"{gateway.url}/v1/completions", json=body, timeout=300) as answer:
        lines = answer.iter_lines()
        assert [next(lines) for _ in range(6)]
        # the engine's gauges are published on its own beat: on a busy host, after the stream
        # has started (CI saw 0 here once)
        eventually(lambda: scrape(decode.url, "vllm:num_requests_running") == 1, timeout=60)
    eventually(lambda: scrape(decode.url, "vllm:num_requests_running") == 0, timeout=180)
    assert scrape(decode.url, "vllm:generation_tokens_total") - generated < 3000
    assert httpx.get(f"{decode.url}/health", timeout=60).status_code == 200


def test_the_gateway_reads_the_engines_real_metrics(gateway: SimHandle) -> None:
    # the prefill instance's DP ranks come from the engine labels of its /metrics
    eventually(lambda: scrape(gateway.url, "baton_gateway_prefill_dp_ranks") == 1, timeout=180)
    assert "Traceback" not in gateway.log()


# ---- what live vLLM does that the simulator did not, and how the gateway meets it


@pytest.fixture(scope="module")
def proxy(cell: dict[str, LiveEngine]) -> Iterator[RewritingProxy]:
    rewriting = RewritingProxy(cell["prefill"].url)
    yield rewriting
    rewriting.close()


@pytest.fixture(scope="module")
def proxied(
    cell: dict[str, LiveEngine],
    proxy: RewritingProxy,
    key_file: Path,
    start_gateway_module: Callable[..., SimHandle],
) -> SimHandle:
    """A second gateway, whose prefill instance answers through the proxy."""
    handle: SimHandle = start_gateway_module(*gateway_flags(proxy.url, cell["decode"], key_file))
    eventually(lambda: httpx.get(f"{handle.url}/ready", timeout=5).status_code == 200, 300)
    # the prefill engine's block size, from its /metrics, before the first request
    eventually(lambda: scrape(handle.url, "baton_gateway_prefill_dp_ranks") == 1, timeout=180)
    return handle


def through(gateway: SimHandle, text: str) -> httpx.Response:
    body = {"model": "tiny", "prompt": text, "max_tokens": 6, "ignore_eos": True}
    return httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=300)


def test_fewer_block_ids_than_the_prompt_needs_never_reach_decode(
    cell: dict[str, LiveEngine], proxy: RewritingProxy, proxied: SimHandle
) -> None:
    # vLLM's decode engine asserts on such a handoff and dies (/health 503 until restarted)
    def drop_blocks(params: dict[str, Any]) -> None:
        params["remote_block_ids"] = [group[:1] for group in params["remote_block_ids"]]

    proxy.rewrite = drop_blocks
    decode = cell["decode"]
    before = sources(decode)
    answer = through(proxied, prompt("short blocks"))
    assert answer.status_code == 200, answer.text
    assert answer.json()["usage"]["completion_tokens"] == 6
    assert httpx.get(f"{decode.url}/health", timeout=60).status_code == 200
    computed = moved(before, sources(decode))
    assert computed["external_kv_transfer"] == 0  # decode alone
    assert computed["local_compute"] > 0
    assert scrape(proxied.url, "baton_gateway_fallbacks_total", reason="short_block_ids") == 1


def test_an_unreachable_side_channel_is_decoded_alone_and_never_pulled_again(
    cell: dict[str, LiveEngine], proxy: RewritingProxy, proxied: SimHandle
) -> None:
    # vLLM answers 500 after a few seconds when the pull cannot connect (kv_load_failure_policy
    # "fail", the controller's default); the handoff was delivered, so it is never sent again
    def closed_port(params: dict[str, Any]) -> None:
        # a new engine id, so decode cannot reuse the handshake it made with the real one
        params["remote_engine_id"] = f"moved-{params['remote_engine_id']}"
        params["remote_port"] = free_port()

    proxy.rewrite = closed_port
    decode = cell["decode"]
    retries = scrape(proxied.url, "baton_gateway_fallbacks_total", reason="decode_retry")
    before = sources(decode)
    answer = through(proxied, prompt("unreachable side channel"))
    assert answer.status_code == 200, answer.text
    assert scrape(proxied.url, "baton_gateway_fallbacks_total", reason="decode_retry") == (
        retries + 1
    )
    computed = moved(before, sources(decode))
    assert computed["external_kv_transfer"] == 0
    assert httpx.get(f"{decode.url}/health", timeout=60).status_code == 200


def test_a_replica_knows_from_vllms_kv_events_the_blocks_its_prompt_will_find_cached(
    rig: LiveRig,
    cell: dict[str, LiveEngine],
    key_file: Path,
    gateway: SimHandle,
    client: openai.OpenAI,
    start_gateway_module: Callable[..., SimHandle],
) -> None:
    """The gateway's own rendering and tokenization of a chat and of a completion prompt, with
    the model's tokenizer files, key the same blocks vLLM caches: a replica that never saw the
    first prompt, knowing only what the engine's KV events said, expects exactly the tokens
    vLLM then serves from cache."""
    replica = start_gateway_module(
        *gateway_flags(cell["prefill"], cell["decode"], key_file),
        *kv_event_flags(rig, cell["prefill"]),
    )
    eventually(lambda: httpx.get(f"{replica.url}/ready", timeout=5).status_code == 200, 300)
    # long enough that the gateway tokenizes it in two chunks (router/tokens.py)
    system = "The prefill rank keeps every block of the cell in its cache. " * 80
    firsts: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": system},
        {"role": "user", "content": "Which rank computed this?"},
    ]
    chat_usage = usage_of(
        client.chat.completions.create(model="tiny", messages=firsts, max_tokens=2)
    )
    completion_usage = usage_of(
        client.completions.create(model="tiny", prompt=f"kv events {system}", max_tokens=2)
    )
    stored = (chat_usage.prompt_tokens // BLOCK) + (completion_usage.prompt_tokens // BLOCK)

    def blocks() -> float:
        return scrape(replica.url, "baton_gateway_kv_event_blocks")

    eventually(lambda: blocks() >= stored, timeout=120)
    with openai.OpenAI(base_url=f"{replica.url}/v1", api_key="x", max_retries=0) as other:
        for ask in (
            lambda: other.chat.completions.create(
                model="tiny",
                messages=[firsts[0], {"role": "user", "content": "And which one decodes it?"}],
                max_tokens=2,
            ),
            lambda: other.completions.create(
                model="tiny", prompt=f"kv events {system} once more", max_tokens=2
            ),
        ):
            expected = scrape(replica.url, "baton_gateway_prompt_tokens_indexed_total")
            found = scrape(replica.url, "baton_gateway_prompt_tokens_total", kind="cached")
            ask()
            expected = scrape(replica.url, "baton_gateway_prompt_tokens_indexed_total") - expected
            found = scrape(replica.url, "baton_gateway_prompt_tokens_total", kind="cached") - found
            assert expected == found >= 2 * BLOCK
