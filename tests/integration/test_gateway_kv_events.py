"""The gateway reads the prefill engines' KV events (``--kv-events-port`` / a pool file's
``kv_events``, with ``--tokenizer``): what each rank holds, reported by the engines themselves,
so a gateway replica that never saw a prompt sends its continuation where the prompt is cached,
and forgets a cache the engine cleared."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import httpx
import openai

from rigs.processes import free_port_block
from tests.helpers import SimHandle, eventually, scrape, scrape_by
from tests.integration.test_gateway import MODEL, NO_EOS, start_engine

BLOCK = 16  # tokens per KV block
DOCUMENTS = [
    f"Document {n}: the prefill instance {n} of the cell keeps its blocks in one NVLink domain. "
    * 25
    for n in range(6)
]


def full_blocks(text: str) -> int:
    return len(text.encode()) // (4 * BLOCK)  # the simulator's 4 bytes a token


def kv_stack(
    start_sim: Callable[..., SimHandle], start_gateway: Callable[..., SimHandle], tmp_path: Path
) -> tuple[list[SimHandle], list[SimHandle]]:
    """Two prefill instances publishing KV events, a decode engine, two gateway replicas that
    read the events."""
    prefill = []
    endpoints = {}
    for _ in range(2):
        port = free_port_block(1)
        config = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{port}"}
        engine = start_engine(
            start_sim,
            "--block-size",
            str(BLOCK),
            "--kv-events-config",
            json.dumps(config),
            env={"VLLM_SERVER_DEV_MODE": "1"},
        )
        prefill.append(engine)
        endpoints[engine.url] = f"tcp://127.0.0.1:{port}"
    decode = start_engine(start_sim, "--block-size", str(BLOCK))
    pool = tmp_path / "pool.yaml"
    cell = {
        "name": "c0",
        "prefill": [engine.url for engine in prefill],
        "decode": [{"url": decode.url}],
        "kv_events": endpoints,
    }
    pool.write_text(json.dumps({"cells": [cell]}))
    # threshold 0: every prompt, however short, is prefilled on a prefill instance
    flags = ("--pool", str(pool), "--tokenizer", "sim", "--pd-threshold-tokens", "0")
    gateways = [start_gateway(*flags, "--health-interval", "0.5") for _ in range(2)]
    return prefill, gateways


def complete(gateway: SimHandle, prompt: str) -> None:
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="k", max_retries=0)
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, extra_body=NO_EOS)


def blocks_reported(gateway: SimHandle) -> float:
    return sum(scrape_by(gateway.url, "baton_gateway_kv_event_blocks", "target").values())


def cached(gateway: SimHandle) -> float:
    return scrape(gateway.url, "baton_gateway_prompt_tokens_total", kind="cached")


def test_a_replica_that_never_saw_a_prompt_sends_its_continuation_where_it_is_cached(
    start_sim: Callable[..., SimHandle], start_gateway: Callable[..., SimHandle], tmp_path: Path
) -> None:
    prefill, (first, second) = kv_stack(start_sim, start_gateway, tmp_path)
    for document in DOCUMENTS:
        complete(first, document)
    stored = sum(full_blocks(document) for document in DOCUMENTS)
    # the second replica learns the blocks from the engines alone, as the first does
    eventually(lambda: blocks_reported(second) >= stored, timeout=60)
    assert blocks_reported(first) == blocks_reported(second)
    for document in DOCUMENTS:
        before = cached(second)
        complete(second, document + " Which rank holds this?")
        # every full block of the document was found cached (none is computed again): with two
        # instances and no session header, chance would have found half of them
        assert cached(second) - before >= full_blocks(document) * BLOCK
    assert scrape(second.url, "baton_gateway_kv_event_batches_total", outcome="undecodable") == 0
    assert scrape(second.url, "baton_gateway_kv_event_gaps_total") == 0

    for engine in prefill:
        reset = httpx.post(f"{engine.url}/reset_prefix_cache", timeout=10)
        assert reset.json() == {"success": True}
    # a cleared cache is forgotten by both replicas
    eventually(lambda: blocks_reported(first) == blocks_reported(second) == 0, timeout=60)
