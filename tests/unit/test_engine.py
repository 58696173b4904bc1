"""The engine's scheduler and lockstep, stepped offline on a virtual clock."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import replace
from typing import Any

import pytest

from baton.core.profile import load_profile
from sim.config import EngineConfig, SpeculativeConfig
from sim.engine import DPGroup, SimClock
from sim.offline import run_closed_loop, run_open_loop
from sim.request import FinishReason, SimRequest, make_request

PROFILE = load_profile()


def config(**overrides: Any) -> EngineConfig:
    base = EngineConfig(
        model="m",
        served_model_names=("m",),
        profile=PROFILE,
        data_parallel_size=2,
        data_parallel_size_local=2,
        enable_expert_parallel=True,
    )
    return replace(base, **overrides)


def request(
    text: str | bytes, max_tokens: int = 8, block_size: int = 16, **kwargs: Any
) -> SimRequest:
    prompt = text if isinstance(text, bytes) else text.encode()
    return make_request(
        prompt, external_id="r", max_tokens=max_tokens, block_size=block_size, arrival=0.0, **kwargs
    )


def test_dep2_prefill_sustains_about_64_4k_tokens_per_second_per_gpu_at_concurrency_256() -> None:
    """AgentX prefill-only: 2K-14K new tokens on a ~200K-token cached context per request."""
    block = 256
    prefix = b"agentic context " * 50_000  # 200,000 tokens, cached after the first request
    rng = random.Random(1)

    def next_request(i: int) -> SimRequest | None:
        if i >= 1000:
            return None
        suffix = rng.randbytes(rng.randint(2048, 14336) * 4)
        return request(prefix + suffix, max_tokens=1, block_size=block)

    result = run_closed_loop(config(block_size=block), next_request, concurrency=256)
    per_gpu = result.computed_prompt_tokens / result.seconds / 2
    assert per_gpu == pytest.approx(64_400, rel=0.05)


def test_running_requests_are_bounded_by_max_num_seqs() -> None:
    arrivals = [(0.0, 0, request(f"prompt {i}", max_tokens=50)) for i in range(10)]
    bounded = run_open_loop(config(max_num_seqs=2), arrivals)
    arrivals = [(0.0, 0, request(f"prompt {i}", max_tokens=50)) for i in range(10)]
    unbounded = run_open_loop(config(max_num_seqs=256), arrivals)
    assert bounded.generated_tokens == unbounded.generated_tokens == 500
    assert bounded.seconds > 4 * unbounded.seconds  # five waves of two instead of one wave


def test_second_request_with_the_same_prefix_hits_the_prefix_cache() -> None:
    prefix = "system prompt " * 100
    first, second = request(prefix + "one"), request(prefix + "two")
    run_open_loop(config(), [(0.0, 0, first), (1.0, 0, second)])
    assert first.cached_tokens == 0
    assert second.cached_tokens == (len(prefix) // 64) * 16  # whole 16-token blocks of the prefix


def test_prefix_cache_is_per_rank() -> None:
    prefix = "system prompt " * 100
    first, second = request(prefix + "one"), request(prefix + "two")
    run_open_loop(config(), [(0.0, 0, first), (1.0, 1, second)])
    assert second.cached_tokens == 0


def test_long_prompt_is_prefilled_in_chunks_of_the_token_budget() -> None:
    long = request(b"x" * (20_000 * 4), max_tokens=1)
    result = run_open_loop(config(max_num_batched_tokens=8192), [(0.0, 0, long)])
    assert result.steps == 3  # 8192 + 8192 + 3616 tokens
    assert long.finish_reason is FinishReason.LENGTH


def test_uneven_load_over_lockstep_ranks_costs_time() -> None:
    def arrivals(split: tuple[int, int]) -> list[tuple[float, int, SimRequest]]:
        return [
            (0.0, rank, request(f"r{rank}-{i}", max_tokens=200))
            for rank, count in enumerate(split)
            for i in range(count)
        ]

    even = run_open_loop(config(), arrivals((64, 64)))
    uneven = run_open_loop(config(), arrivals((112, 16)))
    assert even.generated_tokens == uneven.generated_tokens
    assert uneven.seconds > even.seconds * 1.1


def test_mtp_emits_several_tokens_per_step() -> None:
    mtp = config(speculative=SpeculativeConfig(num_speculative_tokens=3, acceptance_rate=1.0))
    plain = config()
    with_mtp = run_open_loop(mtp, [(0.0, 0, request("p", max_tokens=400))])
    without = run_open_loop(plain, [(0.0, 0, request("p", max_tokens=400))])
    assert without.steps == 400  # one prefill step emits the first token, then one per step
    assert with_mtp.steps == 1 + 100  # four tokens per decode step when every draft is accepted


def test_model_stops_on_its_own_unless_eos_is_ignored() -> None:
    stopping = request("may stop", max_tokens=100_000, ignore_eos=False, seed=3)
    run_open_loop(config(), [(0.0, 0, stopping)])
    assert stopping.finish_reason is FinishReason.STOP
    assert stopping.output_tokens == stopping.eos_after


def test_kv_capacity_holds_requests_back() -> None:
    tiny = PROFILE.model_copy(update={"kv_cache_bytes_per_gpu": 890 * 16 * 20})  # 20 blocks

    def arrivals() -> list[tuple[float, int, SimRequest]]:
        return [(0.0, 0, request(bytes([i]) + b"y" * 64 * 8, max_tokens=4)) for i in range(4)]

    cramped = run_open_loop(config(profile=tiny), arrivals())
    roomy = run_open_loop(config(), arrivals())
    assert cramped.requests == roomy.requests == 4
    # Each request needs 9 of the 20 blocks: two run at a time, so the run takes two waves.
    assert cramped.steps >= 2 * roomy.steps - 1


def test_a_host_that_falls_behind_delays_tokens_but_not_the_inter_token_latencies() -> None:
    """The simulator gives up its lag past a bound: clients see the delay, while the
    inter-token latencies stay the modelled engine's steps (a busy host is not a slow engine)."""

    async def run() -> DPGroup:
        group = DPGroup(config(), SimClock(time_scale=1.0), range(2))
        group.start()
        for rank in (0, 1):
            group.submit(request(f"prompt {rank}", max_tokens=400), rank)
        deadline = time.monotonic() + 60
        while group.has_work and time.monotonic() < deadline:
            time.sleep(0.2)  # noqa: ASYNC251 (the host busy elsewhere: the loop misses deadlines)
            await asyncio.sleep(0.05)
        await group.stop()
        return group

    group = asyncio.run(run())
    assert not group.has_work
    assert group.lag_given_up_s > 0.5  # the host fell behind, by far more than a step
    itl = [group.ranks[rank].itl for rank in (0, 1)]
    mean_itl = sum(b.total for b in itl) / sum(sum(b.counts) for b in itl)
    assert mean_itl == pytest.approx(group.modelled_s / group.steps, rel=0.1)
