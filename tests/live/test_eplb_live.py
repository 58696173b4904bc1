"""Baton's EPLB plugin inside vLLM's own loop, and a decode group of several ranks behind the
gateway.

The cell is what the controller renders for a DEP2 decode group in plugin mode: two decode pods
(one DP rank and one API server each, hybrid load balancing), expert parallelism, vLLM's EPLB
with two redundant experts, Baton's plugin installed by each pod's init container onto the
engine's PYTHONPATH and reporting to a running ``baton eplb``; one prefill instance feeds both
ranks over NIXL. vLLM rebalances every 16 decode steps from the last 8, synchronously (the CPU
build's one mode). The rig's hooks record each rank's placements and can make Baton's algorithm
fail (deploy/vllm/cpu/rig/baton_vllm_cpu_rig/expert_balance.py)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import count
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from baton.core.experts import Placement
from baton.core.vllm_eplb import vllm_rebalance
from eplb.algorithm import rebalance
from rigs.hazards import ReportRelay, prompt
from rigs.processes import EplbReportsService, eplb_reports_service, eventually
from rigs.vllm_live import LiveEngine, LiveRig, live_spec
from tests.helpers import SimHandle, scrape
from tests.live.conftest import (
    gateway_flags,
    moved,
    sources,
)

RANKS, REDUNDANT, EXPERTS = 2, 2, 16  # the tiny Qwen3-MoE: 16 experts, top 2
MODEL_NAME = "tiny"
GROUP = "live-cell-0"  # the rig's cell
# requests keep coming until the state a test waits for, within these bounds
TRAFFIC_REQUESTS, TRAFFIC_S = 200, 900.0


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EplbReportsService]:
    """``baton eplb`` taking the engines' reports; the tiny model is its only model."""
    config = f"models: [{{name: {MODEL_NAME}, experts: {EXPERTS}, topK: 2}}]\n"
    with eplb_reports_service(tmp_path_factory.mktemp("eplb"), config) as running:
        yield running


def reported_windows(service: EplbReportsService, policy: str) -> float:
    """The group's windows the service has taken from the engines, by who placed them."""
    return scrape(service.metrics, "baton_eplb_engine_windows_total", group=GROUP, policy=policy)


@pytest.fixture(scope="module")
def relay(service: EplbReportsService) -> Iterator[ReportRelay]:
    proxy = ReportRelay(service.url)
    yield proxy
    proxy.close()


@dataclass
class Hooks:
    placements: Path  # ep-rank-<r>.jsonl: one line per rearrangement
    fault: Path  # while it exists, Baton's algorithm raises in the engines

    def rearrangements(self, rank: int) -> list[dict[str, Any]]:
        path = self.placements / f"ep-rank-{rank}.jsonl"
        if not path.exists():
            return []
        lines = path.read_text().splitlines()
        complete = lines if path.read_text().endswith("\n") else lines[:-1]
        return [next(iter(json.loads(line).values())) for line in complete]  # the one model


@pytest.fixture(scope="module")
def hooks(tmp_path_factory: pytest.TempPathFactory) -> Hooks:
    return Hooks(tmp_path_factory.mktemp("placements"), tmp_path_factory.mktemp("fault") / "on")


@pytest.fixture(scope="module")
def cell(rig: LiveRig, relay: ReportRelay, hooks: Hooks) -> dict[str, LiveEngine]:
    eplb = {
        "mode": "plugin",
        "stepInterval": 16,
        "windowSize": 8,
        "redundantExperts": REDUNDANT,
        "communicator": "torch_gloo",
        "reportUrl": relay.url,
        "models": [{"name": MODEL_NAME, "experts": EXPERTS, "topK": 2}],
    }
    # float32: in bfloat16 a new placement, which changes the tokens an expert's matmul sums
    # over, moved the last bits enough to flip a greedy token of the untrained model's
    # near-flat logits (seen at the sixth token)
    spec = live_spec(
        rig.env.model("tiny-qwen3-moe"),
        "tiny",
        decode_dep=RANKS,
        eplb=eplb,
        args=("--dtype", "float32"),
    )
    return rig.start_cell(
        spec,
        hooks={
            "BATON_RIG_EPLB_PLACEMENTS": str(hooks.placements),
            "BATON_RIG_EPLB_FAULT": str(hooks.fault),
        },
    )


def greedy(engine: LiveEngine, text: str) -> dict[str, Any]:
    answer = httpx.post(
        f"{engine.url}/v1/completions",
        json={"model": "tiny", "prompt": text, "max_tokens": 16, "temperature": 0, "logprobs": 1},
        timeout=300,
    )
    assert answer.status_code == 200, answer.text
    logprobs = answer.json()["choices"][0]["logprobs"]
    return {"tokens": logprobs["tokens"], "logprobs": logprobs["token_logprobs"]}


REFERENCE_PROMPTS = ("reference one", "reference two")


@pytest.fixture(scope="module")
def reference(cell: dict[str, LiveEngine], hooks: Hooks) -> dict[tuple[str, str], Any]:
    """Greedy answers of each decode rank, from the placement vLLM starts with."""
    assert hooks.rearrangements(0) == []
    return {
        (rank, text): greedy(cell[rank], prompt(text, 40))
        for rank in ("decode", "decode-1")
        for text in REFERENCE_PROMPTS
    }


@pytest.fixture(scope="module")
def gateway(
    cell: dict[str, LiveEngine], reference: Any, start_gateway_module: Callable[..., SimHandle]
) -> SimHandle:
    handle: SimHandle = start_gateway_module(
        *gateway_flags(cell["prefill"], [cell["decode"], cell["decode-1"]])
    )
    return handle


_requests = count()


def traffic_until(gateway: SimHandle, done: Callable[[], bool]) -> None:
    """P/D requests through the gateway, one after another, each answered, until ``done()``."""
    deadline = time.monotonic() + TRAFFIC_S
    for sent in range(TRAFFIC_REQUESTS):
        if done():
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"still not there after {sent} requests and {TRAFFIC_S:.0f} s")
        answer = httpx.post(
            f"{gateway.url}/v1/completions",
            json={
                "model": "tiny",
                "prompt": prompt(f"load {next(_requests)}", 60),
                "max_tokens": 24,
                "ignore_eos": True,
            },
            timeout=300,
        )
        assert answer.status_code == 200, answer.text
    assert done(), f"still not there after {TRAFFIC_REQUESTS} requests"


def test_the_gateway_spreads_requests_over_every_rank_of_the_decode_group(
    cell: dict[str, LiveEngine], gateway: SimHandle
) -> None:
    ranks = (cell["decode"], cell["decode-1"])

    def served() -> list[float]:
        return [scrape(rank.url, "vllm:request_success_total") for rank in ranks]

    def recovered() -> float:  # handoffs that failed and that the gateway served all the same
        names = ("baton_gateway_retries_total", "baton_gateway_fallbacks_total")
        return sum(scrape(gateway.url, name) for name in names)

    before, pulled_before = served(), [sources(rank) for rank in ranks]
    recovered_before = recovered()
    traffic_until(gateway, lambda: all(a > b for a, b in zip(served(), before, strict=True)))
    # every rank pulled its prompts from the prefill instance, and computed one only for a
    # handoff that failed and the gateway recovered: on a busy host vLLM's NIXL handshake gave
    # up after its 5 s (the prefill engine's side channel had not answered), that decode
    # answered 500, and the gateway's retry on the other rank computed the prompt
    for rank, pulled_before_rank in zip(ranks, pulled_before, strict=True):
        pulled = moved(pulled_before_rank, sources(rank))
        assert pulled["external_kv_transfer"] > 0
        assert pulled["local_compute"] == 0 or recovered() > recovered_before


def test_every_rank_places_the_same_experts_from_the_same_load(
    gateway: SimHandle, hooks: Hooks
) -> None:
    traffic_until(gateway, lambda: min(len(hooks.rearrangements(r)) for r in range(RANKS)) >= 3)
    first, second = hooks.rearrangements(0), hooks.rearrangements(1)
    both = min(len(first), len(second))
    assert first[:both] == second[:both]
    # the window's load is real routing (the rig's router shim counts it), not zeros
    assert all(np.asarray(r["load"]).sum() > 0 for r in first[:both])


def test_the_experts_move_as_batons_algorithm_decided_and_rank_0_reports_each_window(
    gateway: SimHandle, hooks: Hooks, service: EplbReportsService
) -> None:
    traffic_until(gateway, lambda: len(hooks.rearrangements(0)) >= 3)
    eventually(lambda: reported_windows(service, "baton") >= 3, timeout=120)
    placed = hooks.rearrangements(0)
    for window in placed:
        load, before = np.asarray(window["load"]), np.asarray(window["before"])
        decided = rebalance(
            load.astype(np.float64),
            RANKS,
            window["num_replicas"] - EXPERTS,
            1,
            window["num_groups"],
            previous=Placement(before, RANKS, EXPERTS),
        )
        assert window["after"] == decided.phy2log.tolist()
    assert any(w["after"] != w["before"] for w in placed), "no expert ever moved"
    assert reported_windows(service, "vllm_default") == 0
    assert 0 < scrape(service.metrics, "baton_eplb_balance", group=GROUP, stage="before") <= 1


def test_greedy_output_stays_identical_across_rearrangements(
    cell: dict[str, LiveEngine],
    gateway: SimHandle,
    hooks: Hooks,
    reference: dict[tuple[str, str], Any],
) -> None:
    done = len(hooks.rearrangements(0))
    traffic_until(gateway, lambda: len(hooks.rearrangements(0)) >= done + 2)
    assert any(w["after"] != w["before"] for w in hooks.rearrangements(0))
    for (rank, text), answer in reference.items():
        now = greedy(cell[rank], prompt(text, 40))
        assert now["tokens"] == answer["tokens"]
        # the same experts summed over other batches of tokens: equal to float32's last bits
        # (seen: 5e-7 apart)
        assert now["logprobs"] == pytest.approx(answer["logprobs"], abs=1e-5)


def test_a_hung_eplb_service_holds_up_neither_requests_nor_rebalances(
    gateway: SimHandle, hooks: Hooks, relay: ReportRelay, service: EplbReportsService
) -> None:
    relay.held = True
    try:
        done = len(hooks.rearrangements(0))
        # each request answered, and vLLM kept rebalancing while its reports went nowhere
        traffic_until(gateway, lambda: len(hooks.rearrangements(0)) >= done + 3)
    finally:
        relay.held = False
    reported = reported_windows(service, "baton")
    traffic_until(gateway, lambda: reported_windows(service, "baton") > reported)


def test_an_error_in_batons_algorithm_leaves_vllms_own_policy_in_charge(
    gateway: SimHandle, hooks: Hooks, service: EplbReportsService
) -> None:
    done = len(hooks.rearrangements(0))
    hooks.fault.touch()
    try:
        traffic_until(gateway, lambda: len(hooks.rearrangements(0)) > done)
    finally:
        hooks.fault.unlink()
    window = hooks.rearrangements(0)[done]
    load, before = np.asarray(window["load"]), np.asarray(window["before"])
    placed = vllm_rebalance(
        load,
        RANKS,
        window["num_replicas"] - EXPERTS,
        1,
        window["num_groups"],
        Placement(before, RANKS, EXPERTS),
    )
    assert window["after"] == placed.phy2log.tolist()
    eventually(lambda: reported_windows(service, "vllm_default") >= 1, timeout=120)
    # and the next window is Baton's again
    after = len(hooks.rearrangements(0))
    traffic_until(gateway, lambda: len(hooks.rearrangements(0)) > after)
    window = hooks.rearrangements(0)[after]
    decided = rebalance(
        np.asarray(window["load"], dtype=np.float64),
        RANKS,
        window["num_replicas"] - EXPERTS,
        1,
        window["num_groups"],
        previous=Placement(np.asarray(window["before"]), RANKS, EXPERTS),
    )
    assert window["after"] == decided.phy2log.tolist()
