"""A DEP2 prefill instance (one API server, two DP ranks with expert parallelism) behind the
gateway: each affinity key's prefills go to one DP rank, named by ``X-data-parallel-rank``, and
the decode engine pulls from that rank's side channel."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest

from rigs.processes import eventually
from rigs.vllm_live import LiveEngine, LiveRig, live_spec
from tests.helpers import SimHandle, scrape_by
from tests.live.conftest import gateway_flags

WORDS = ("cache", "decode", "engine", "balance", "token", "prompt", "handoff", "prefill")


@pytest.fixture(scope="module")
def cell(rig: LiveRig) -> dict[str, LiveEngine]:
    return rig.start_cell(live_spec(rig.env.model("tiny-qwen3-moe"), "tiny", prefill_dep=2))


@pytest.fixture(scope="module")
def gateway(
    cell: dict[str, LiveEngine], start_gateway_module: Callable[..., SimHandle]
) -> SimHandle:
    # With DP ranks behind one server, vLLM's /metrics shows no engine series until each rank
    # has stepped (seen live): one request to each rank first, as traffic would.
    for rank in ("0", "1"):
        answer = httpx.post(
            f"{cell['prefill'].url}/v1/completions",
            json={"model": "tiny", "prompt": "warm up", "max_tokens": 1},
            headers={"X-data-parallel-rank": rank},
            timeout=300,
        )
        assert answer.status_code == 200, answer.text
    handle: SimHandle = start_gateway_module(*gateway_flags(cell["prefill"], cell["decode"]))
    # the instance's two ranks, from the engine labels of its /metrics
    eventually(
        lambda: (
            scrape_by(handle.url, "baton_gateway_prefill_dp_ranks", "target")
            == {cell["prefill"].url: 2}
        ),
        timeout=300,
    )
    return handle


def prompt_tokens(engine: LiveEngine) -> dict[str, float]:
    return scrape_by(engine.url, "vllm:prompt_tokens_total", "engine")


def test_a_rank_out_of_range_is_refused_as_vllm_refuses_it(cell: dict[str, LiveEngine]) -> None:
    body = {"model": "tiny", "prompt": "x", "max_tokens": 1}
    answer = httpx.post(
        f"{cell['prefill'].url}/v1/completions",
        json=body,
        headers={"X-data-parallel-rank": "5"},
        timeout=180,
    )
    assert answer.status_code == 400
    assert "out of range" in answer.text


def test_each_sessions_prefills_go_to_one_dp_rank_and_decode_pulls_from_it(
    cell: dict[str, LiveEngine], gateway: SimHandle
) -> None:
    prefill, decode = cell["prefill"], cell["decode"]
    ranks_used: set[str] = set()
    # rendezvous hashing over the instance's ranks (named by its URL, a free port each run):
    # six sessions all hashed to one rank in 1 run of 32 (seen in CI); ten, in 1 of 512
    for session in range(10):
        turns = []
        for turn in range(2):
            before = prompt_tokens(prefill)
            pulled = scrape_by(decode.url, "vllm:prompt_tokens_by_source_total", "source")
            text = " ".join(WORDS[(session * 3 + i) % len(WORDS)] for i in range(200 + 40 * turn))
            answer = httpx.post(
                f"{gateway.url}/v1/completions",
                json={"model": "tiny", "prompt": f"session {session}: {text}", "max_tokens": 3},
                headers={"X-Session-ID": f"session-{session}"},
                timeout=300,
            )
            assert answer.status_code == 200, answer.text
            after = prompt_tokens(prefill)
            moved = {rank for rank in after if after[rank] > before.get(rank, 0)}
            assert len(moved) == 1  # one rank prefilled it
            turns.append(moved.pop())
            now = scrape_by(decode.url, "vllm:prompt_tokens_by_source_total", "source")
            assert now["external_kv_transfer"] > pulled["external_kv_transfer"]
            assert now["local_compute"] == pulled["local_compute"]
        assert turns[0] == turns[1]  # the session's turns stay on its rank
        ranks_used.add(turns[0])
    assert ranks_used == {"0", "1"}  # rendezvous hashing spread the sessions over both
