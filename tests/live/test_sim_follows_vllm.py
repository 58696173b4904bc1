"""The same requests to a live vLLM P/D pair and to a ``baton sim`` pair: the same outcomes.

Where they differed, the simulator was changed to follow vLLM (docs/simulator.md). Each case
sends the handoff by hand, as the gateway's two legs would."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from typing import Any, Protocol

import httpx
import pytest
import zmq

from baton.core.kv_events import BlockStored, decode_batch
from baton.core.sim_tokenizer import decode_token_ids
from rigs.processes import eventually, free_port_block
from rigs.vllm_live import LiveEngine, LiveRig, live_spec
from tests.helpers import SimHandle, scrape, scrape_by

PROMPT = "handoff balance engine prompt token cache decode prefill " * 30


class Engine(Protocol):
    url: str


Pair = tuple[Engine, Engine]


# every engine publishes its KV events (the rig moves each pod's endpoint to ports of its own)
KV_EVENTS = {"enable_kv_cache_events": True, "endpoint": "tcp://*:5557", "topic": "kv"}


@pytest.fixture(scope="module")
def live(rig: LiveRig) -> Pair:
    spec = live_spec(
        rig.env.model("tiny-qwen3-moe"), "tiny", args=["--kv-events-config", json.dumps(KV_EVENTS)]
    )
    cell = rig.start_cell(spec)
    return cell["prefill"], cell["decode"]


@pytest.fixture
def sim(start_pd: Callable[..., Pair]) -> Pair:
    # vLLM's block size is the platform's: 16 tokens on CUDA (the simulator's default, as it
    # stands for GPU engines), 128 on the CPU build these live engines run
    flags = ("--served-model-name", "tiny", "--profile", "instant", "--block-size", "128")
    return start_pd(flags=flags)


def prefill(engine: Engine, tag: str) -> dict[str, Any]:
    body = {
        "model": "tiny",
        "prompt": f"{tag} {PROMPT}",
        "max_tokens": 1,
        "kv_transfer_params": {"do_remote_decode": True},
    }
    answer = httpx.post(f"{engine.url}/v1/completions", json=body, timeout=300)
    assert answer.status_code == 200, answer.text
    params: dict[str, Any] = answer.json()["kv_transfer_params"]
    return params


def decode(engine: Engine, tag: str, params: dict[str, Any]) -> int:
    body = {
        "model": "tiny",
        "prompt": f"{tag} {PROMPT}",
        "max_tokens": 4,
        "kv_transfer_params": params,
    }
    return httpx.post(f"{engine.url}/v1/completions", json=body, timeout=300).status_code


def dead(engine: Engine) -> bool:
    try:
        return httpx.get(f"{engine.url}/health", timeout=60).status_code == 503
    except httpx.ConnectError:
        return True


def both(live: Pair, sim: Pair, case: Callable[[Pair], object]) -> None:
    assert case(live) == case(sim)


def test_a_replayed_handoff_is_answered_200(live: Pair, sim: Pair) -> None:
    def replay(pair: Pair) -> tuple[int, int]:
        params = prefill(pair[0], "replay")
        return decode(pair[1], "replay", params), decode(pair[1], "replay", params)

    both(live, sim, replay)
    assert replay(sim) == (200, 200)


def test_a_handoff_from_an_engine_decode_never_met_fails_the_request(live: Pair, sim: Pair) -> None:
    def unknown(pair: Pair) -> int:
        params = prefill(pair[0], "unknown engine")
        return decode(pair[1], "unknown engine", {**params, "remote_engine_id": "no-such-engine"})

    both(live, sim, unknown)
    assert unknown(sim) == 500


def test_a_client_gone_mid_stream_is_aborted_and_counted_as_no_finished_request(
    live: Pair, sim: Pair
) -> None:
    def leave(pair: Pair) -> tuple[float, float]:
        engine = pair[1]
        finished = scrape(engine.url, "vllm:request_success_total")
        # nearly the model's 4,096 positions: an engine with one OpenMP thread made all of
        # 1,000 tokens (seconds) before the client's close reached it, on a quiet host
        body = {
            "model": "tiny",
            "prompt": "leave",
            "max_tokens": 4000,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.stream("POST", f"{engine.url}/v1/completions", json=body, timeout=180) as answer:
            lines = answer.iter_lines()
            assert [next(lines) for _ in range(4)]
        eventually(lambda: scrape(engine.url, "vllm:num_requests_running") == 0, timeout=180)
        return scrape(engine.url, "vllm:request_success_total") - finished, scrape(
            engine.url, "vllm:num_requests_running"
        )

    both(live, sim, leave)
    assert leave(sim) == (0, 0)


def test_a_handoffs_decode_side_is_queued_then_scheduled_to_recompute_the_last_token(
    live: Pair, sim: Pair
) -> None:
    # vLLM's scheduler takes a request out of WAITING_FOR_REMOTE_KVS once its KV has arrived
    # and schedules the prompt's last token again, so that the next one can be sampled: the
    # decode engine times a queue (the pull included) and a prefill, and counts no prompt
    # token as computed
    def timed(pair: Pair) -> tuple[float, ...]:
        engine = pair[1]

        def counts() -> tuple[float, float, float]:
            return (
                scrape(engine.url, "vllm:request_queue_time_seconds_count"),
                scrape(engine.url, "vllm:request_prefill_time_seconds_count"),
                scrape(engine.url, "vllm:prompt_tokens_by_source_total", source="local_compute"),
            )

        before = counts()
        params = prefill(pair[0], "timed")
        assert decode(engine, "timed", params) == 200

        def grown() -> tuple[float, ...]:  # empty, falsy, until the queue time is counted
            delta = tuple(now - was for now, was in zip(counts(), before, strict=True))
            return delta if delta[0] else ()

        # an engine's statistics reach its API server a step or two after the last token
        return eventually(grown, timeout=60)

    both(live, sim, timed)
    assert timed(sim) == (1, 1, 0)


def test_a_handoff_names_a_block_per_block_size_tokens_and_metrics_say_the_size(
    live: Pair, sim: Pair
) -> None:
    def blocks(pair: Pair) -> tuple[int, bool]:
        body = {
            "model": "tiny",
            "prompt": f"blocks {PROMPT}",
            "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True},
        }
        answer = httpx.post(f"{pair[0].url}/v1/completions", json=body, timeout=300).json()
        [size] = map(int, scrape_by(pair[0].url, "vllm:cache_config_info", "block_size"))
        [ids] = answer["kv_transfer_params"]["remote_block_ids"]
        return size, len(ids) == math.ceil(answer["usage"]["prompt_tokens"] / size)

    both(live, sim, blocks)
    assert blocks(sim) == (128, True)


def test_fewer_block_ids_than_the_prompt_fills_kill_the_decode_engine(
    live: Pair, sim: Pair
) -> None:
    # the last test of the module: the live decode engine stays dead until stopped
    def short(pair: Pair) -> tuple[int, bool]:
        params = prefill(pair[0], "short")
        params["remote_block_ids"] = [group[:1] for group in params["remote_block_ids"]]
        status = decode(pair[1], "short", params)
        # the engine core's death reaches the API server a moment later: vLLM's then
        # answers /health 503 or has exited, the simulator's answers 503
        eventually(lambda: dead(pair[1]), timeout=180)
        return status, True

    both(live, sim, short)


def _stored_by(endpoint: str, url: str, prompts: list[str]) -> list[list[BlockStored]]:
    """The BlockStored events an engine published for each of ``prompts``, sent one after
    another as plain completions (its subscription first confirmed with probe prompts: a SUB
    socket misses what came before it reached the publisher)."""
    socket: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.SUB)
    socket.setsockopt(zmq.SUBSCRIBE, b"")
    socket.connect(endpoint)

    def complete(prompt: str) -> None:
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 1}
        answer = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
        assert answer.status_code == 200, answer.text

    def drain(within_s: float) -> list[BlockStored]:
        stored: list[BlockStored] = []
        while socket.poll(int(within_s * 1000)):
            topic, _, payload = socket.recv_multipart()
            assert topic == b"kv"
            stored += [e for e in decode_batch(payload).events if isinstance(e, BlockStored)]
            within_s = 1.0  # the rest of a request's batches follow within a step or two
        return stored

    try:
        deadline = time.monotonic() + 120
        probe = 0
        while not drain(2.0):
            assert time.monotonic() < deadline, f"no KV events from {endpoint}"
            complete(f"probe {probe} " + PROMPT)
            probe += 1
        drain(1.0)
        found = []
        for prompt in prompts:
            complete(prompt)
            found.append(drain(30.0))
        return found
    finally:
        socket.close(linger=0)


def test_kv_events_report_a_prompts_blocks_then_only_a_continuations_new_ones(
    live: Pair, start_sim: Callable[..., SimHandle]
) -> None:
    """A prompt's full blocks, the first with no parent, then for a prompt that continues it
    only the blocks past the shared ones, chained to the last shared block: on vLLM and on the
    simulator alike (vLLM's tokens are its tokenizer's, which its /tokenize answers)."""
    first = "kv events " + PROMPT * 2
    longer = first + " and a continuation that runs well past one more block " * 40
    port = free_port_block(2)
    config = {**KV_EVENTS, "endpoint": f"tcp://*:{port}"}
    sim = start_sim(
        *("--served-model-name", "tiny", "--profile", "instant", "--block-size", "128"),
        *("--kv-events-config", json.dumps(config)),
    )
    engine = live[0]
    assert isinstance(engine, LiveEngine) and engine.kv_events is not None

    def vllm_tokens(prompt: str) -> list[int]:
        body = {"model": "tiny", "prompt": prompt}
        ids: list[int] = httpx.post(f"{engine.url}/tokenize", json=body, timeout=60).json()[
            "tokens"
        ]
        return ids

    def sim_tokens(prompt: str) -> list[int]:  # the simulator has no /tokenize: its rule
        return decode_token_ids(prompt.encode())

    sim_endpoint = f"tcp://127.0.0.1:{port}"
    for url, endpoint, tokens in (
        (engine.url, engine.kv_events, vllm_tokens),
        (sim.url, sim_endpoint, sim_tokens),
    ):
        once, then = _stored_by(endpoint, url, [first, longer])
        block = once[0].block_size
        hashes = [h for e in once for h in e.block_hashes]
        first_tokens, longer_tokens = tokens(first), tokens(longer)
        assert len(hashes) == len(first_tokens) // block, url
        assert once[0].parent_block_hash is None, url
        assert [t for e in once for t in e.token_ids] == first_tokens[: len(hashes) * block]
        new = [h for e in then for h in e.block_hashes]
        assert len(new) == len(longer_tokens) // block - len(hashes), url
        assert then[0].parent_block_hash == hashes[-1], url
        assert [t for e in then for t in e.token_ids] == longer_tokens[
            len(hashes) * block : (len(hashes) + len(new)) * block
        ], url
