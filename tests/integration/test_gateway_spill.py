"""``baton gateway``'s prefill affinity and spill on running processes: the load bound counts
the prompt tokens the engines will compute (a session's cached history costs nothing), a replica
counts the prefills other replicas have in flight, as the engines report them, and a session's
prefills keep to the DP rank of its instance that holds its history."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Any

import httpx
import openai
from openai.types.chat import ChatCompletionMessageParam

from router.policy import (
    DecodeRankView,
    PoolSnapshot,
    PrefillView,
    RoutingPolicy,
    affinity_key,
    choose_prefill,
    estimate_prompt_tokens,
)
from router.prefix import BLOCK_TOKENS
from tests.helpers import SimHandle, cached_tokens_of, eventually, scrape, scrape_by
from tests.integration.test_gateway import LONG, MODEL, Stack, start_engine

# A stalled prefill instance holds a prefill in flight while the test routes the next request:
# seconds more than that takes.
STALL_S = 6.0


def sessions_keyed_to(prefill: SimHandle, stack: Stack, count: int) -> list[str]:
    """``count`` session ids whose affinity choice is ``prefill``, by the gateway's own policy."""
    views = tuple(PrefillView(p.url, "default", True, 0, 0) for p in stack.prefill)
    decode = (DecodeRankView("d", "http://d", "default", 0, True, 0),)
    found: list[str] = []
    for index in range(64):  # half the ids go to each of two instances
        session = f"session-{index}"
        key = affinity_key({"x-session-id": session}, {}, "r")
        choice = choose_prefill(PoolSnapshot(views, decode), key, 0, RoutingPolicy())
        if choice is not None and choice.view.name == prefill.url:
            found.append(session)
        if len(found) == count:
            return found
    raise AssertionError(f"no {count} sessions keyed to {prefill.url}")


def history(session: str, blocks: int) -> list[ChatCompletionMessageParam]:
    """A session's opening turn: about ``blocks`` x 560 tokens, its own from the first byte."""
    return [{"role": "user", "content": f"{session} opens. " + LONG * blocks}]


def ask(gateway: SimHandle, session: str, messages: list[ChatCompletionMessageParam]) -> Any:
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="k", max_retries=0)
    return client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=4,
        extra_headers={"X-Session-ID": session},
        extra_body={"ignore_eos": True},
    )


def follow_up(
    messages: list[ChatCompletionMessageParam], reply: Any
) -> list[ChatCompletionMessageParam]:
    """The next turn: the whole history, the reply, and about 1,100 new tokens."""
    content = reply.choices[0].message.content
    return [
        *messages,
        {"role": "assistant", "content": content},
        {"role": "user", "content": LONG * 2},
    ]


def prefill_in_flight(gateway: SimHandle, prefill: SimHandle) -> float:
    return scrape(
        gateway.url, "baton_gateway_in_flight_requests", role="prefill", target=prefill.url
    )


def affinity(gateway: SimHandle, result: str) -> float:
    return scrape(gateway.url, "baton_gateway_affinity_total", source="session", result=result)


def served(prefill: SimHandle) -> float:
    return scrape(prefill.url, "vllm:request_success_total")


def stack_of(start_sim: Callable[..., SimHandle], start_gateway: Callable[..., SimHandle]) -> Stack:
    prefill = [start_engine(start_sim) for _ in range(2)]
    decode = start_engine(start_sim)
    gateway = start_gateway(
        "--api-key", "k", *(f"--prefill={p.url}" for p in prefill), f"--decode={decode.url}"
    )
    return Stack(gateway, prefill, decode)


def test_cached_history_in_flight_does_not_push_sessions_off_their_instance(
    start_sim: Callable[..., SimHandle], start_gateway: Callable[..., SimHandle]
) -> None:
    """An agentic follow-up turn in flight (20K prompt tokens, all but 1K of them cached) on
    the instance another session's history is cached on: that session's next turn stays there.
    Counting each turn's whole prompt, the bound (8192 tokens) would have spilled it."""
    stack = stack_of(start_sim, start_gateway)
    home, other = stack.prefill
    long_session, short_session = sessions_keyed_to(home, stack, 2)
    turns = {long_session: history(long_session, 36), short_session: history(short_session, 22)}
    for session, messages in turns.items():
        turns[session] = follow_up(messages, ask(stack.gateway, session, messages))
    assert served(home) == 2 and served(other) == 0
    # The long session's follow-up waits on its instance for the whole test ...
    stack.fault(home, action="stall", seconds=STALL_S)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        long_turn = pool.submit(ask, stack.gateway, long_session, turns[long_session])
        eventually(lambda: prefill_in_flight(stack.gateway, home) == 1)
        # ... when the other session's follow-up comes: it joins it there.
        short_turn = pool.submit(ask, stack.gateway, short_session, turns[short_session])
        eventually(lambda: affinity(stack.gateway, "hit") + affinity(stack.gateway, "miss") == 4)
        assert affinity(stack.gateway, "miss") == 0
        assert prefill_in_flight(stack.gateway, home) == 2
        replies = {long_session: long_turn.result(), short_session: short_turn.result()}
    assert served(other) == 0
    for session, reply in replies.items():
        # its whole history was found cached: all but the new turn, to a 16-token block
        new_tokens = estimate_prompt_tokens({"messages": turns[session][-2:]})
        assert cached_tokens_of(reply) >= reply.usage.prompt_tokens - new_tokens - 16, session
    stack.assert_nothing_leaked()


def test_prompt_tokens_computed_again_are_counted_by_why(
    start_sim: Callable[..., SimHandle], start_gateway: Callable[..., SimHandle]
) -> None:
    """The gateway's own record of where reuse went: a turn whose history its instance lost
    (its prefix cache reset) counts the history as absent; a turn sent away from the instance
    holding its history (that instance busy with a long prefill) counts it as routed away."""
    prefill = [start_engine(start_sim, env={"VLLM_SERVER_DEV_MODE": "1"}) for _ in range(2)]
    decode = start_engine(start_sim)
    gateway = start_gateway(
        "--api-key", "k", *(f"--prefill={p.url}" for p in prefill), f"--decode={decode.url}"
    )
    stack = Stack(gateway, prefill, decode)
    home, other = stack.prefill
    session, blocker = sessions_keyed_to(home, stack, 2)

    def not_reused(cause: str) -> float:
        return scrape(
            stack.gateway.url, "baton_gateway_prompt_tokens_not_reused_total", cause=cause
        )

    turn = history(session, 22)
    turn = follow_up(turn, ask(stack.gateway, session, turn))
    history_tokens = estimate_prompt_tokens({"messages": turn[:-1]})
    assert (not_reused("absent"), not_reused("routed_away")) == (0, 0)
    # the instance forgets the session's history: its next turn goes there and computes it
    assert httpx.post(f"{home.url}/reset_prefix_cache", timeout=10).json() == {"success": True}
    reply = ask(stack.gateway, session, turn)
    assert served(other) == 0 and cached_tokens_of(reply) == 0
    # the gateway's index knows what it sent in whole blocks
    assert not_reused("absent") > history_tokens - BLOCK_TOKENS
    assert not_reused("routed_away") == 0
    # a long prefill holds the instance: the next turn spills, leaving its history behind
    turn = follow_up(turn, reply)
    stack.fault(home, action="stall", seconds=STALL_S)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        held = pool.submit(ask, stack.gateway, blocker, history(blocker, 60))
        eventually(lambda: prefill_in_flight(stack.gateway, home) == 1)
        ask(stack.gateway, session, turn)
        held.result()
    assert affinity(stack.gateway, "miss") == 1 and served(other) == 1
    assert not_reused("routed_away") > history_tokens - BLOCK_TOKENS


def test_a_replica_counts_the_prefills_other_replicas_have_in_flight(
    start_sim: Callable[..., SimHandle], start_gateway: Callable[..., SimHandle]
) -> None:
    """Replicas share no state: the second learns from the prefill engine's request count that
    the first has a prefill in flight there, counts it at its own mean uncached tokens per
    prefill, and spills a new session from that instance."""
    stack = stack_of(start_sim, start_gateway)
    home, other = stack.prefill
    second = start_gateway(
        "--api-key",
        "k",
        *(f"--prefill={p.url}" for p in stack.prefill),
        f"--decode={stack.decode.url}",
        "--health-interval",
        "0.2",
    )
    first_session, second_session = sessions_keyed_to(home, stack, 2)
    # The second replica's one prefill so far: its mean, 12K uncached tokens
    warm = history("warm-up", 22)
    ask(second, "warm-up", warm)
    mean = estimate_prompt_tokens({"messages": warm})

    def peers() -> dict[str, float]:
        return scrape_by(second.url, "baton_gateway_peer_outstanding_tokens", "target")

    assert peers() == {home.url: 0, other.url: 0}
    stack.fault(home, action="stall", seconds=STALL_S)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        held = pool.submit(ask, stack.gateway, first_session, history(first_session, 36))
        eventually(lambda: peers() == {home.url: mean, other.url: 0})
        # A new session keyed to that instance: 12K peer tokens + 2K of its own there exceed
        # the other instance's 2K by more than the bound.
        before = served(other)
        ask(second, second_session, history(second_session, 3))
        assert affinity(second, "miss") == 1
        assert served(other) == before + 1
        held.result()
    eventually(lambda: peers() == {home.url: 0, other.url: 0})
    assert scrape(stack.gateway.url, "baton_gateway_in_flight_requests") == 0


def dep2_stack(
    start_sim: Callable[..., SimHandle],
    start_gateway: Callable[..., SimHandle],
    health_interval_s: float,
) -> Stack:
    """A gateway in front of one DEP2 prefill instance and a one-rank decode engine."""
    prefill = start_engine(start_sim, "--data-parallel-size", "2")
    decode = start_engine(start_sim)
    gateway = start_gateway(
        "--api-key",
        "k",
        f"--prefill={prefill.url}",
        f"--decode={decode.url}",
        "--health-interval",
        str(health_interval_s),
    )
    return Stack(gateway, [prefill], decode)


def sessions_on_rank(prefill: SimHandle, rank: int) -> list[str]:
    """Session names the gateway keys to DP rank ``rank`` of a DEP2 instance."""
    views = tuple(PrefillView(prefill.url, "default", True, 0, 0, dp_rank) for dp_rank in (0, 1))
    decode = (DecodeRankView("d", "http://d", "default", 0, True, 0),)
    found = []
    for name in (f"session-{i}" for i in range(64)):
        key = affinity_key({"x-session-id": name}, {}, "r")
        choice = choose_prefill(PoolSnapshot(views, decode), key, 0, RoutingPolicy())
        if choice is not None and choice.view.dp_rank == rank:
            found.append(name)
    return found


def test_a_sessions_turns_reach_the_dp_rank_that_holds_its_history(
    start_sim: Callable[..., SimHandle], start_gateway: Callable[..., SimHandle]
) -> None:
    """Each rank of a DEP2 prefill instance has its own prefix cache, and the engine gives a
    request no rank names to the rank with the fewest requests. A session's follow-up sent while
    another session's prefill holds the rank its first turn ran on must still go there and find
    its history cached: left to the engine it went to the idle rank and computed all of it."""
    stack = dep2_stack(start_sim, start_gateway, 0.2)
    gateway, [prefill] = stack.gateway, stack.prefill
    eventually(
        lambda: scrape(gateway.url, "baton_gateway_prefill_dp_ranks", target=prefill.url) == 2
    )
    # two sessions keyed to rank 0, the rank the engine picks first when both are idle
    session, other = sessions_on_rank(prefill, 0)[:2]
    first = history(session, 22)
    turn = follow_up(first, ask(gateway, session, first))
    stack.fault(prefill, action="stall", seconds=STALL_S)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        # shorter than the session's history: queueing behind it costs less than recomputing
        # the history on the idle rank, so the rank holding the history takes the turn
        held = pool.submit(ask, gateway, other, history(other, 10))
        eventually(lambda: scrape(prefill.url, "vllm:num_requests_running", engine="0") == 1)
        reply = ask(gateway, session, turn)
        held.result()
    new_tokens = estimate_prompt_tokens({"messages": turn[-2:]})
    assert cached_tokens_of(reply) >= reply.usage.prompt_tokens - new_tokens - 16
    stack.assert_nothing_leaked()


def test_the_first_turns_after_the_gateway_starts_name_their_dp_rank(
    start_sim: Callable[..., SimHandle], start_gateway: Callable[..., SimHandle]
) -> None:
    """Seen in baton bench agentx: the load starts as soon as the gateway is ready, before its
    first load sync, so the DP ranks of each prefill instance were not known yet and every
    lane's first turn (its long warmup) went to whichever rank the engine chose, where the next
    turn, named by rendezvous, may not go. The gateway learns the ranks before it serves: a
    session keyed to rank 1 lands there on its first request, though the engine, both ranks
    idle, would have chosen rank 0."""
    # a load sync every 60 s: only one the gateway makes before it serves can name the rank
    stack = dep2_stack(start_sim, start_gateway, 60)
    [prefill] = stack.prefill
    session = sessions_on_rank(prefill, 1)[0]
    ask(stack.gateway, session, history(session, 2))
    assert scrape(prefill.url, "vllm:request_success_total", engine="1") == 1
    assert scrape(prefill.url, "vllm:request_success_total", engine="0") == 0
