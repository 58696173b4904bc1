"""The agentic workload of ``baton bench agentx``: seeded, pure, reproducible.

Shaped after SemiAnalysis AgentX (the workload of the DeepSeek-V4-on-GB300 study), whose replay
rules are public (the agentx-harness fork of NVIDIA AIPerf, the InferenceX aggregation code):

- **From AgentX's published description.** The load dial is concurrent sessions, not a request
  rate; a session is a sequence of turns, each re-sending the whole growing history (turn k+1 =
  turn k's messages + the assistant's reply + a tool result), so about 96-98% of prompt tokens
  are a theoretical prefix hit; contexts grow to 100K+ tokens; the reply length is fixed per
  turn (``max_tokens`` = the recorded length with ``ignore_eos``); think time (the tool's run)
  separates a turn's end from the next turn's start and is capped at 10 s; a turn may fan out
  to subagents that run in parallel while the parent waits for them (join); a session header
  goes with every request; a lane starts at a random point of its first session, the turn
  before it sent as a warmup, and starts a new session at turn 0 when one ends; the prompts are
  synthetic but byte-identical from turn to turn, so prefix reuse is exact.
- **Assumptions** (AgentX's distributions are not public in a form we could read): the
  lognormal medians and spreads of :data:`SHAPE` below, the 5% fan-out chance, 2-4 subagents
  of 3-8 turns each, subagents starting from their parent's system prompt (the agent's tools
  and instructions) and naming their parent in ``X-Parent-Session-ID`` beside their own
  ``X-Session-ID``, as OpenCode's subagents do (Claude Code's send the parent's session id
  instead; both seen on the wire: github.com/preloop/preloop pull 701), and each session
  ending once its context passes a cap drawn between 60K and 160K tokens. The medians were
  set so that the theoretical reuse lands in the published 96-98% (96.2% over the first
  sessions of 60 lanes), which the tests pin down.

Text is made of 4-byte words (``" abc"``), one token each under the simulator's tokenizer (and
close to one for real tokenizers), so token counts here are the prompt's tokens there.
"""

from __future__ import annotations

import itertools
import math
import random
import string
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = [
    "SHAPE",
    "Request",
    "Session",
    "Turn",
    "WorkloadShape",
    "lane_sessions",
    "messages",
    "new_messages",
    "requests_of",
    "start_turn",
    "text",
    "theoretical_reuse",
]


@dataclass(frozen=True, slots=True)
class WorkloadShape:
    """Distributions of one session (tokens, and simulated seconds of think time)."""

    system_tokens_median: float = 16_000  # the agent's instructions and tool schemas
    first_task_tokens_median: float = 2_000
    subagent_task_tokens_median: float = 600  # the parent's instructions to a subagent
    tool_result_tokens_median: float = 800
    output_tokens_median: float = 320
    think_s_median: float = 1.5
    spread: float = 0.9  # sigma of every lognormal
    think_cap_s: float = 10.0  # AgentX caps an idle gap at 10 s
    tool_result_cap: int = 24_000
    output_cap: int = 4_096
    context_cap_range: tuple[int, int] = (60_000, 160_000)
    fan_out_chance: float = 0.05
    subagents_range: tuple[int, int] = (2, 4)
    subagent_turns_range: tuple[int, int] = (3, 8)


SHAPE = WorkloadShape()


@dataclass(frozen=True, slots=True)
class Turn:
    """One request of a session: new user tokens (the task or a tool result), the reply's
    length, the think time before it, and the subagents it starts once answered."""

    new_tokens: int
    output_tokens: int
    think_s: float
    subagents: tuple[Session, ...] = ()


@dataclass(frozen=True, slots=True)
class Session:
    """A session's script. ``seed`` makes its text; ``system_seed`` its system prompt, shared
    with its subagents."""

    name: str
    seed: int
    system_seed: int
    system_tokens: int
    turns: tuple[Turn, ...]
    parent: str = ""  # a subagent's parent session; "" for a root session

    @property
    def subagent(self) -> bool:
        return bool(self.parent)

    def prompt_tokens(self, turn: int) -> int:
        """Tokens of turn ``turn``'s prompt: the system prompt, every earlier turn's input and
        reply, and this turn's input (chat-template tokens aside)."""
        before = sum(t.new_tokens + t.output_tokens for t in self.turns[:turn])
        return self.system_tokens + before + self.turns[turn].new_tokens


@dataclass(frozen=True, slots=True)
class Request:
    """One request as the runner sends it: the session, the turn, and whether it is a warmup
    (the turn before a lane's random start, sent once to warm the caches, not measured)."""

    session: Session
    turn: int
    warmup: bool = False
    cached_prefix_tokens: int = 0  # the theoretical hit: a prefix an earlier request sent


def _lognormal(rng: random.Random, median: float, sigma: float) -> float:
    return rng.lognormvariate(math.log(median), sigma)


def _session(
    rng: random.Random,
    name: str,
    shape: WorkloadShape,
    *,
    system: tuple[int, int] | None = None,
    turns: int | None = None,
    parent: str = "",
) -> Session:
    """A root session (``turns`` None: until its context cap) or ``parent``'s subagent
    (``system``: its parent's system prompt seed and length; ``turns``: how many)."""
    seed = rng.getrandbits(63)
    if system is None:
        system = (rng.getrandbits(63), round(_lognormal(rng, shape.system_tokens_median, 0.3)))
    cap = rng.randint(*shape.context_cap_range)
    script: list[Turn] = []
    context = system[1]
    while (turns is None and context < cap) or (turns is not None and len(script) < turns):
        first = not script
        if not first:
            median = shape.tool_result_tokens_median
        elif turns is None:
            median = shape.first_task_tokens_median
        else:
            median = shape.subagent_task_tokens_median
        new = max(16, min(shape.tool_result_cap, round(_lognormal(rng, median, shape.spread))))
        output = max(
            8,
            min(shape.output_cap, round(_lognormal(rng, shape.output_tokens_median, shape.spread))),
        )
        think = (
            0.0
            if first
            else min(shape.think_cap_s, _lognormal(rng, shape.think_s_median, shape.spread))
        )
        subagents: tuple[Session, ...] = ()
        if turns is None and not first and rng.random() < shape.fan_out_chance:
            subagents = tuple(
                _session(
                    rng,
                    f"{name}-sub{len(script)}.{i}",
                    shape,
                    system=system,
                    turns=rng.randint(*shape.subagent_turns_range),
                    parent=name,
                )
                for i in range(rng.randint(*shape.subagents_range))
            )
        script.append(Turn(new, output, think, subagents))
        context += new + output
    return Session(name, seed, system[0], system[1], tuple(script), parent)


def lane_sessions(seed: int, lane: int, shape: WorkloadShape = SHAPE) -> Iterator[Session]:
    """Lane ``lane``'s sessions, one after another, the same for every run with ``seed``."""
    rng = random.Random(f"{seed}/{lane}")
    number = 0
    while True:
        yield _session(rng, f"s{seed}-l{lane}-{number}", shape)
        number += 1


def start_turn(seed: int, lane: int, session: Session) -> int:
    """Where a lane enters its first session (AgentX's random start point t*)."""
    return random.Random(f"{seed}/{lane}/start").randrange(len(session.turns))


def requests_of(session: Session, start: int = 0) -> Iterator[Request]:
    """The requests a session sends from turn ``start`` (its warmup first when ``start`` > 0),
    each with the prefix an earlier request already sent (its theoretical cache hit): the
    previous turn's prompt, or for a subagent's first turn its parent's system prompt. A turn's
    subagents are sessions of their own, run by the caller while the parent waits."""
    if start:
        yield Request(session, start - 1, warmup=True)
    for turn in range(start, len(session.turns)):
        if turn:
            previous = session.prompt_tokens(turn - 1)
        else:
            previous = session.system_tokens if session.subagent else 0
        yield Request(session, turn, cached_prefix_tokens=previous)


def theoretical_reuse(requests: list[Request]) -> float:
    """Share of prompt tokens that repeat a prefix an earlier request of the same session
    sent (the AgentX "theoretical prefix cache hit", at token rather than block grain)."""
    total = sum(r.session.prompt_tokens(r.turn) for r in requests)
    return sum(r.cached_prefix_tokens for r in requests) / total if total else 0.0


_WORDS = tuple(
    " " + "".join(letters) for letters in itertools.product(string.ascii_lowercase, repeat=3)
)


def text(seed: int, tokens: int) -> str:
    """``tokens`` 4-byte words from ``seed``: the same string for the same arguments."""
    return "".join(random.Random(seed).choices(_WORDS, k=tokens))


def topic_text(seed: int, tokens: int, topic: int, width: int = 16) -> str:
    """``tokens`` words of topic ``topic``'s ``width`` words alone: text of few distinct tokens,
    which a MoE routes to few experts; another topic, other words."""
    first = topic * width % len(_WORDS)
    return "".join(random.Random(seed).choices(_WORDS[first : first + width], k=tokens))


def new_messages(session: Session, turn: int) -> list[dict[str, str]]:
    """What turn ``turn`` adds to the conversation: the system prompt and the task at turn 0,
    later the reply the script records for the previous turn (not the one generated: AgentX
    replays recorded text, so every router sees the same bytes) and this turn's input."""
    task = {
        "role": "user",
        "content": text(session.seed + 2 * turn, session.turns[turn].new_tokens),
    }
    if turn == 0:
        return [
            {"role": "system", "content": text(session.system_seed, session.system_tokens)},
            task,
        ]
    reply = text(session.seed + 2 * turn - 1, session.turns[turn - 1].output_tokens)
    return [{"role": "assistant", "content": reply}, task]


def messages(session: Session, turn: int) -> list[dict[str, str]]:
    """Turn ``turn``'s whole conversation (each turn re-sends all of it)."""
    return [message for index in range(turn + 1) for message in new_messages(session, index)]
