"""The agentic workload: reproducible, AgentX-shaped, and byte-exact from turn to turn."""

from __future__ import annotations

import itertools

from baton.core.sim_tokenizer import count_tokens
from bench.workload import (
    SHAPE,
    Session,
    lane_sessions,
    messages,
    new_messages,
    requests_of,
    start_turn,
    theoretical_reuse,
)


def _first_sessions(seed: int, lanes: int) -> list[Session]:
    return [next(lane_sessions(seed, lane)) for lane in range(lanes)]


def test_the_same_seed_gives_the_same_sessions_and_lanes_differ() -> None:
    assert _first_sessions(7, 4) == _first_sessions(7, 4)
    names = {s.seed for s in _first_sessions(7, 4)}
    assert len(names) == 4
    assert _first_sessions(7, 2) != _first_sessions(8, 2)


def test_each_turn_resends_the_previous_conversation_byte_for_byte() -> None:
    session = next(lane_sessions(3, 0))
    for turn in range(1, len(session.turns)):
        earlier, now = messages(session, turn - 1), messages(session, turn)
        assert now[: len(earlier)] == earlier
        assert now[len(earlier) :] == new_messages(session, turn)


def test_prompt_tokens_count_what_the_messages_hold() -> None:
    session = next(lane_sessions(3, 1))
    for turn in (0, len(session.turns) // 2, len(session.turns) - 1):
        text = "".join(m["content"] for m in messages(session, turn)).encode()
        assert count_tokens(text) == session.prompt_tokens(turn)


def test_contexts_grow_past_100k_tokens_with_96_to_98_percent_theoretical_reuse() -> None:
    sessions = _first_sessions(2026, 40)
    longest = max(s.prompt_tokens(len(s.turns) - 1) for s in sessions)
    assert longest > 100_000
    everything = [r for s in sessions for r in requests_of(s)]
    everything += [
        r for s in sessions for t in s.turns for sub in t.subagents for r in requests_of(sub)
    ]
    assert 0.96 <= theoretical_reuse(everything) <= 0.98


def test_subagents_start_from_their_parents_system_prompt() -> None:
    sessions = (s for lane in range(40) for s in itertools.islice(lane_sessions(5, lane), 2))
    parent, sub = next((s, sub) for s in sessions for t in s.turns for sub in t.subagents)
    assert sub.subagent and sub.parent == parent.name and not parent.subagent
    assert SHAPE.subagent_turns_range[0] <= len(sub.turns)
    assert messages(sub, 0)[0] == messages(parent, 0)[0]
    first = next(requests_of(sub))
    assert first.cached_prefix_tokens == parent.system_tokens


def test_think_time_is_capped_and_a_session_opens_without_one() -> None:
    for session in _first_sessions(11, 20):
        assert session.turns[0].think_s == 0
        assert all(0 < t.think_s <= SHAPE.think_cap_s for t in session.turns[1:])


def test_a_lane_entering_mid_session_warms_the_turn_before_first() -> None:
    session = next(lane_sessions(9, 3))
    start = start_turn(9, 3, session)
    sent = list(requests_of(session, start))
    if start:
        assert sent[0].warmup and sent[0].turn == start - 1 and sent[0].cached_prefix_tokens == 0
        sent = sent[1:]
    assert [r.turn for r in sent] == list(range(start, len(session.turns)))
    assert not any(r.warmup for r in sent)
