"""router/pool.py, pure: the breaker, targets, health as recorded, and load accounting."""

from __future__ import annotations

import asyncio

import pytest

from router.policy import AffinityKey, RoutingPolicy, affinity_key, choose_prefill, prompt_bytes
from router.pool import Breaker, Pool
from router.prefix import BLOCK_BYTES, BLOCK_TOKENS, PromptBlocks, block_hashes
from router.prober import Prober, engine_load
from router.targets import DecodeServerSpec, PoolCell

P0, P1, P2 = "http://p0:1", "http://p1:1", "http://p2:1"
D0, D1 = "http://d0:1", "http://d1:1"


def CLOCK() -> float:
    return 100.0  # monotonic seconds; the breakers' cooldowns are judged against it


def spec(*cells: tuple[str, tuple[str, ...], tuple[DecodeServerSpec, ...]]) -> tuple[PoolCell, ...]:
    return tuple(PoolCell(name=n, prefill=p, decode=d) for n, p, d in cells)


def ranks(url: str, *numbers: int) -> DecodeServerSpec:
    return DecodeServerSpec(url=url, ranks=numbers)


# ---- Breaker


def test_breaker_opens_at_the_threshold_of_consecutive_failures() -> None:
    breaker = Breaker(threshold=3, cooldown_s=5.0)
    breaker.failure(now=100.0)
    breaker.failure(now=100.0)
    assert breaker.allows(now=100.0)
    breaker.failure(now=100.0)
    assert not breaker.allows(now=100.0)
    assert not breaker.allows(now=104.999)


def test_success_resets_the_failure_count() -> None:
    breaker = Breaker(threshold=3, cooldown_s=5.0)
    breaker.failure(now=100.0)
    breaker.failure(now=100.0)
    breaker.success()
    breaker.failure(now=100.0)
    breaker.failure(now=100.0)
    assert breaker.allows(now=100.0)


def test_breaker_lets_a_trial_through_after_the_cooldown_and_a_success_closes_it() -> None:
    breaker = Breaker(threshold=3, cooldown_s=5.0)
    for _ in range(3):
        breaker.failure(now=100.0)
    assert breaker.allows(now=105.0)
    breaker.success()
    assert breaker.allows(now=105.0)
    breaker.failure(now=105.0)
    assert breaker.allows(now=105.0)  # one failure after closing does not reopen it


def test_failed_trial_reopens_the_breaker_for_a_full_cooldown() -> None:
    breaker = Breaker(threshold=3, cooldown_s=5.0)
    for _ in range(3):
        breaker.failure(now=100.0)
    breaker.failure(now=105.0)  # the trial
    assert not breaker.allows(now=109.999)
    assert breaker.allows(now=110.0)


# ---- Pool: targets, load and snapshots (no I/O: nothing is started)


def pool() -> Pool:
    return Pool(
        spec(("c0", (P0, P1), (ranks(D0, 0, 1),)), ("c1", (P2,), (DecodeServerSpec(url=D1),))),
        clock=CLOCK,
    )


def test_pool_names_decode_targets_by_url_and_rank() -> None:
    assert sorted(pool().decode) == [f"{D0}#0", f"{D0}#1", D1]
    view = {rank.name: rank for rank in pool().snapshot().decode}
    assert (view[f"{D0}#1"].url, view[f"{D0}#1"].dp_rank, view[f"{D0}#1"].cell) == (D0, 1, "c0")
    assert (view[D1].url, view[D1].dp_rank, view[D1].cell) == (D1, -1, "c1")


def test_snapshot_reflects_in_flight_accounting() -> None:
    p = pool()
    p.begin_prefill(P0, -1, 700)
    p.begin_prefill(P0, -1, 300)
    p.end_prefill(P0, -1, 700)
    p.begin_decode(f"{D0}#1")
    p.begin_decode(f"{D0}#1")
    p.end_decode(f"{D0}#1")
    snap = p.snapshot()
    assert {v.name: v.outstanding_tokens for v in snap.prefill} == {P0: 300, P1: 0, P2: 0}
    assert {v.name: v.outstanding_requests for v in snap.prefill} == {P0: 1, P1: 0, P2: 0}
    assert {r.name: r.in_flight for r in snap.decode} == {f"{D0}#0": 0, f"{D0}#1": 1, D1: 0}
    assert p.in_flight() == {P0: 1, P1: 0, P2: 0, f"{D0}#0": 0, f"{D0}#1": 1, D1: 0}


def decode_pool(*urls: str) -> Pool:
    return Pool(
        spec(("c0", (P0,), tuple(DecodeServerSpec(url=url) for url in urls))),
        clock=CLOCK,
        breaker=lambda: Breaker(threshold=2),
    )


def test_failures_up_to_the_threshold_eject_a_target_from_the_snapshot() -> None:
    p = decode_pool(D0, D1)
    p.failed(D0)
    assert all(r.healthy for r in p.snapshot().decode)
    p.failed(D0)
    assert [r.healthy for r in p.snapshot().decode] == [False, True]


def test_below_half_healthy_a_pool_panics_and_routes_to_every_target_not_known_dead() -> None:
    p = decode_pool(D0, D1, "http://d2:1")
    for _ in range(2):
        p.failed(D0)
        p.failed(D1)
    # one of three healthy: in panic, the two whose circuits opened take requests again
    assert [r.healthy for r in p.snapshot().decode] == [True, True, True]
    p.decode["http://d2:1"].up = False
    p.decode["http://d2:1"].dead = True  # its server refused a health check: never in panic
    assert [r.healthy for r in p.snapshot().decode] == [True, True, False]


def test_update_keeps_the_load_of_unchanged_targets_and_drops_removed_ones() -> None:
    p = pool()
    p.begin_prefill(P0, -1, 500)
    p.begin_prefill(P2, -1, 100)
    p.begin_decode(f"{D0}#0")
    p.begin_decode(D1)
    p.update(spec(("c0", (P0, "http://p3:1"), (ranks(D0, 0, 1, 2),))))
    assert p.in_flight() == {P0: 1, "http://p3:1": 0, f"{D0}#0": 1, f"{D0}#1": 0, f"{D0}#2": 0}
    assert {v.name: v.outstanding_tokens for v in p.snapshot().prefill} == {
        P0: 500,
        "http://p3:1": 0,
    }


def test_ending_a_request_on_a_removed_target_is_harmless() -> None:
    p = pool()
    p.begin_prefill(P2, -1, 100)
    p.begin_decode(D1)
    p.update(spec(("c0", (P0,), (ranks(D0, 0),))))
    p.end_prefill(P2, -1, 100)
    p.end_decode(D1)
    assert p.in_flight() == {P0: 0, f"{D0}#0": 0}


def test_target_moved_to_another_cell_keeps_its_load_in_the_new_cell() -> None:
    p = pool()
    p.begin_decode(D1)
    p.update(spec(("c0", (P0,), (ranks(D0, 0),)), ("c9", (P2,), (DecodeServerSpec(url=D1),))))
    view = {r.name: r for r in p.snapshot().decode}[D1]
    assert (view.cell, view.in_flight) == ("c9", 1)


# ---- what each affinity key holds cached, and uncached tokens in flight


def session(name: str) -> AffinityKey:
    return affinity_key({"x-session-id": name}, {}, "r")


def keyed_to(p: Pool, instance: str, count: int) -> list[AffinityKey]:
    """``count`` session keys whose affinity choice in ``p`` is ``instance``."""
    found = []
    for index in range(64):  # half of them for each of two instances
        k = session(f"s{index}")
        choice = choose_prefill(p.snapshot(), k, 0, RoutingPolicy())
        if choice is not None and choice.view.name == instance:
            found.append(k)
    assert len(found) >= count
    return found[:count]


def two_instances() -> Pool:
    return Pool(spec(("c0", (P0, P1), (ranks(D0, 0),))), clock=CLOCK)


def conversation(*contents: str, system: str | None = None) -> dict[str, object]:
    """A chat body: user and assistant messages in turn, after ``system`` when given."""
    roles = ("user", "assistant")
    messages = [{"role": roles[i % 2], "content": text} for i, text in enumerate(contents)]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    return {"messages": messages}


def blocks(body: dict[str, object]) -> tuple[int, ...]:
    return block_hashes(prompt_bytes(body))


def cached(p: Pool, body: dict[str, object]) -> dict[str, int]:
    return {v.name: v.cached_tokens for v in p.snapshot(PromptBlocks(blocks(body))).prefill}


def tokens(body: dict[str, object]) -> int:
    """The prompt's tokens in its full blocks: what the index can count cached."""
    return len(blocks(body)) * BLOCK_TOKENS


TASK = "fix the bug in the pool " * 2_000  # about 48 KB: a dozen blocks
SYSTEM_PROMPT = "you are a coding agent " * 1_000


def test_a_cached_turn_in_flight_counts_its_uncached_tokens_and_keeps_the_next_session() -> None:
    """The agentic case end to end: a session with its history cached on its instance sends
    its next turn; while it runs, a second session keyed to the same instance, with its own
    history cached there, sends its next turn. Counting whole prompts put both whole on the
    instance and spilled the second session off its cache; counted uncached, both stay."""
    p = two_instances()
    first, second = keyed_to(p, P0, 2)
    first_history = conversation(TASK + "first")
    p.routed(P0, -1, blocks(first_history))
    second_history = conversation(TASK.upper() + "second")
    p.routed(P0, -1, blocks(second_history))
    body = conversation(TASK + "first", "done", "next")
    estimate = tokens(first_history) + 5_000
    turn = choose_prefill(p.snapshot(PromptBlocks(blocks(body))), first, estimate, RoutingPolicy())
    assert turn is not None and turn.view.name == P0 and turn.uncached_tokens == 5_000
    p.begin_prefill(P0, turn.view.dp_rank, turn.uncached_tokens)
    body = conversation(TASK.upper() + "second", "done", "next")
    estimate = tokens(second_history) + 2_000
    next_turn = choose_prefill(
        p.snapshot(PromptBlocks(blocks(body))), second, estimate, RoutingPolicy()
    )
    assert next_turn is not None and next_turn.view.name == P0 and not next_turn.spilled
    assert next_turn.uncached_tokens == 2_000


def test_a_prompt_counts_as_cached_where_its_longest_prefix_was_sent() -> None:
    p = two_instances()
    turn = conversation(TASK)
    p.routed(P0, -1, blocks(turn))
    later = conversation(TASK, "done", "next " * 2_000)
    assert cached(p, later) == {P0: tokens(turn), P1: 0}
    # its next turn went to P1: both hold a prefix, P1 the longer
    p.routed(P1, -1, blocks(later))
    assert cached(p, conversation(TASK, "done", "next " * 2_000, "ok")) == {
        P0: tokens(turn),
        P1: tokens(later),
    }
    # another conversation, whatever its key, finds nothing; the empty prompt neither
    assert cached(p, conversation("write the docs " * 2_000)) == {P0: 0, P1: 0}
    assert {v.name: v.cached_tokens for v in p.snapshot().prefill} == {P0: 0, P1: 0}


def test_a_subagent_finds_its_parents_system_prompt_where_the_parent_ran() -> None:
    p = two_instances()
    parent = conversation("fix the bug", "looking", "result", system=SYSTEM_PROMPT)
    p.routed(P1, -1, blocks(parent))
    task = cached(p, conversation("find where tokens are counted", system=SYSTEM_PROMPT))
    system_blocks = len(prompt_bytes(conversation(system=SYSTEM_PROMPT))) // BLOCK_BYTES
    assert task == {P0: 0, P1: system_blocks * BLOCK_TOKENS} and system_blocks > 3
    # another system prompt finds nothing
    assert cached(p, conversation("fix the bug", system="you are a poet " * 1_000))[P1] == 0


def test_the_dp_rank_sent_the_prefix_is_the_one_the_view_names() -> None:
    p = two_instances()
    p.record_engine_load(P0, engine_load(engine_metrics({"0": (0, 0), "1": (0, 0)})))  # DEP2
    body = conversation(TASK)
    p.routed(P0, 1, blocks(body))
    held = {v.unit: v.cached_tokens for v in p.snapshot(PromptBlocks(blocks(body))).prefill}
    assert held == {f"{P0}#0": 0, f"{P0}#1": tokens(body), P1: 0}


def test_an_instance_that_leaves_the_pool_comes_back_holding_nothing() -> None:
    p = two_instances()
    body = conversation(TASK)
    p.routed(P0, -1, blocks(body))
    p.update(spec(("c0", (P1,), (ranks(D0, 0),))))
    p.update(spec(("c0", (P0, P1), (ranks(D0, 0),))))
    assert cached(p, body) == {P0: 0, P1: 0}


def engine_metrics(requests: dict[str, tuple[int, int]]) -> str:
    """A vLLM ``/metrics`` page: (running, waiting) requests per ``engine`` label."""
    lines = []
    for name, column in (("vllm:num_requests_running", 0), ("vllm:num_requests_waiting", 1)):
        lines.append(f"# TYPE {name} gauge")
        lines += [
            f'{name}{{engine="{engine}",model_name="dsv4"}} {counts[column]}'
            for engine, counts in requests.items()
        ]
    return "\n".join(lines) + "\n"


def test_the_load_is_read_from_a_whole_page_among_histograms_and_look_alike_families() -> None:
    buckets = "".join(
        f'vllm:time_to_first_token_seconds_bucket{{engine="0",le="{le}"}} 3.0\n'
        for le in ("0.001", "0.5", "+Inf")
    )
    page = (
        "# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
        + engine_metrics({"0": (2, 5), "1": (1, 0)})
        + "# TYPE vllm:time_to_first_token_seconds histogram\n"
        + buckets
        # counters as prometheus_client's text format writes them, vLLM's pages included
        + "# TYPE vllm:prompt_tokens_total counter\n"
        + 'vllm:prompt_tokens_total{engine="0"} 700.0\n'
        + "# TYPE vllm:prompt_tokens_created gauge\n"
        + 'vllm:prompt_tokens_created{engine="0"} 1.7e9\n'
        + "# TYPE vllm:prompt_tokens_cached_total counter\n"  # a family the load is not
        + 'vllm:prompt_tokens_cached_total{engine="0"} 500.0\n'
        + "# TYPE vllm:generation_tokens_total counter\n"
        + 'vllm:generation_tokens_total{engine="1"} 40.0\n'
        + '\nvllm:cache_config_info{block_size="16",engine="0"} 1.0\n'
    )
    load = engine_load(page)
    assert load.requests == {"0": 7, "1": 1}
    assert load.running == 3
    assert load.tokens == 740.0
    assert load.block_size == 16


def test_a_page_that_is_not_prometheus_text_is_refused_wherever_its_odd_line_is() -> None:
    good = engine_metrics({"0": (0, 0)})
    for odd in ("<html><body>metrics live elsewhere</body></html>", '{"requests": 3}', "Not Found"):
        for page in (odd, good + odd + "\n", odd + "\n" + good):
            with pytest.raises(ValueError, match="no sample"):
                engine_load(page)


def test_other_replicas_prefills_are_counted_and_priced_at_this_gateways_mean_uncached_tokens() -> (
    None
):
    p = two_instances()
    p.record_engine_load(P0, engine_load(engine_metrics({"0": (1, 1), "1": (1, 0)})))
    # no prefill of its own yet: nothing to price the engine's three requests at
    assert p.peer_outstanding_tokens() == {P0: 0, P1: 0}
    p.begin_prefill(P1, -1, 2_000)
    p.end_prefill(P1, -1, 2_000)
    p.begin_prefill(P0, 0, 4_000)  # mean 3K uncached tokens per prefill
    # the engine's three requests (both ranks) less this gateway's one on rank 0: two, at 3K
    # each, one on each rank
    p.record_engine_load(P0, engine_load(engine_metrics({"0": (1, 1), "1": (1, 0)})))
    p.record_engine_load(P1, engine_load(engine_metrics({"0": (0, 0), "1": (0, 0)})))
    assert p.peer_outstanding_tokens() == {P0: 6_000, P1: 0}
    assert {v.unit: v.outstanding_tokens for v in p.snapshot().prefill} == {
        f"{P0}#0": 7_000,
        f"{P0}#1": 3_000,
        f"{P1}#0": 0,
        f"{P1}#1": 0,
    }
    # and each rank's prefills: this gateway's own and the others' the engine counted
    assert {v.unit: v.outstanding_requests for v in p.snapshot().prefill} == {
        f"{P0}#0": 2,
        f"{P0}#1": 1,
        f"{P1}#0": 0,
        f"{P1}#1": 0,
    }
    assert p.in_flight()[P0] == 1  # its own count stays exact


def test_an_engine_behind_this_gateways_own_count_means_no_peer_load() -> None:
    p = two_instances()
    p.begin_prefill(P0, -1, 4_000)
    p.begin_prefill(P0, -1, 4_000)
    # one of its two requests has not reached the engine yet: never a negative peer load
    p.record_engine_load(P0, engine_load(engine_metrics({"0": (1, 0)})))
    assert p.peer_outstanding_tokens() == {P0: 0, P1: 0}


def test_a_prefill_instance_s_dp_ranks_are_learned_from_its_engine_labels() -> None:
    p = two_instances()
    # before, an instance is one unit and its engine chooses the rank; after, one per rank
    assert [v.unit for v in p.snapshot().prefill] == [P0, P1]
    p.record_engine_load(P0, engine_load(engine_metrics({"0": (1, 0), "1": (0, 0)})))  # DEP2
    p.record_engine_load(P1, engine_load(engine_metrics({"0": (0, 0)})))
    assert [v.unit for v in p.snapshot().prefill] == [f"{P0}#0", f"{P0}#1", P1]
    assert p.prefill_dp_ranks() == {P0: 2, P1: 1}


def test_an_engine_s_kv_block_size_is_read_from_its_cache_config_info() -> None:
    p = two_instances()
    assert p.block_size(P0) == 0  # before its first sync: not known
    info = (
        "# TYPE vllm:cache_config_info gauge\n"
        'vllm:cache_config_info{block_size="128",enable_prefix_caching="True",engine="0"} 1.0\n'
    )
    p.record_engine_load(P0, engine_load(engine_metrics({"0": (0, 0)}) + info))
    assert (p.block_size(P0), p.block_size(P1)) == (128, 0)
    p.record_engine_load(
        P0, engine_load(engine_metrics({"0": (0, 0)}))
    )  # a page without it keeps it
    assert p.block_size(P0) == 128


# ---- Admission under the decode bound


def bounded_pool(bound: int) -> Pool:
    """One decode rank that may hold ``bound`` requests."""
    return Pool(
        spec(("c0", (P0,), (DecodeServerSpec(url=D0),))), clock=CLOCK, max_requests_per_rank=bound
    )


def test_admitted_requests_hold_their_places_until_their_decode_begins() -> None:
    pool = bounded_pool(2)
    (rank,) = pool.decode
    pool.admit()
    pool.admit()  # both in their prefill legs: the rank holds nothing yet, and is full
    assert not pool.has_place()
    pool.begin_decode(rank)
    pool.release_admission(placed=True)
    assert not pool.has_place()  # the place moved to the rank's count
    pool.release_admission(placed=False)  # the other ended before its decode
    assert pool.has_place()
    pool.end_decode(rank)
    assert pool.has_place() and pool.admitted == 0


def test_a_freed_place_admits_one_waiting_request_in_arrival_order() -> None:
    async def scenario() -> None:
        pool = bounded_pool(1)
        (rank,) = pool.decode
        prober = Prober(pool, probe_interval_s=1.0)
        assert await prober.decode_place(30.0) == "free"  # the one place, held
        waiting = [asyncio.create_task(prober.decode_place(30.0)) for _ in range(3)]
        for _ in range(100):  # the loop's turns until each task waits, bounded
            if pool.waiting_for_place == 3:
                break
            await asyncio.sleep(0)
        assert pool.waiting_for_place == 3
        pool.begin_decode(rank)
        pool.release_admission(placed=True)
        pool.end_decode(rank)  # the first request ends: one place, for the first in line
        assert await asyncio.wait_for(waiting[0], 10) == "waited"
        assert not waiting[1].done() and not waiting[2].done() and pool.admitted == 1
        pool.release_admission(placed=False)  # it ends before its decode: the next one's turn
        assert await asyncio.wait_for(waiting[1], 10) == "waited"
        assert not waiting[2].done()
        waiting[2].cancel()  # the client leaves while waiting: it holds nothing
        with pytest.raises(asyncio.CancelledError):
            await waiting[2]
        assert pool.waiting_for_place == 0 and pool.admitted == 1
        assert await prober.decode_place(0.01) == "saturated"  # nobody frees the place
        assert pool.admitted == 1

    asyncio.run(scenario())
