"""Routing choices, decided purely from a pool snapshot and the request's routing facts.

No I/O, no clock, no randomness: several gateway replicas given the same snapshot make the same
choice, so routing state never has to be shared between them.

**Prefill** (one DEP2 instance):

1. Affinity key. A session header (:data:`SESSION_HEADERS`, the agent harnesses' names; a
   subagent's parent first), else the ``user`` field, else the conversation
   (:func:`conversation_digest`): a hash chain over message boundaries up to and including the
   first user message, each message told apart by its fields, each text by its length and its
   first and last :data:`PREFIX_SAMPLE_CHARS` characters (a 500 KB system prompt is neither
   serialized nor hashed whole: a collision only puts two conversations' prefills on one
   instance). Every turn of a conversation resends
   that prefix, so every turn (and nothing else) shares the key, while conversations that only
   share a system prompt do not.
   A completion prompt is keyed on its first :data:`PROMPT_KEY_BYTES` bytes.
2. Prefixes. The unit of prefill is a DP rank of an instance: each rank has a prefix cache and a
   queue of its own (vLLM's internal load balancer would send a session's next turn to whichever
   rank has fewest requests, where its history is not cached). The pool's index
   (``router/prefix.py``) tells, per rank, how many leading tokens of the prompt it was sent: a
   conversation's earlier turns, a system prompt or a document other requests shared, wherever
   they went, header or not. An instance whose ranks are not known yet is one unit, and its
   engine chooses the rank.
3. Candidates. Rendezvous hashing of the key ranks the healthy ranks; the two candidates are the
   two holding the longest prefixes, equals in the key's order (power of two choices): the
   key's first two when none holds any, so conversations that share only what no rank holds yet
   spread by key, and requests of many keys that share a prefix spill onto the rank that holds
   it next, not onto each key's own. A prefix pulls a request only where it is more than
   ``cache_threshold`` of the prompt (vllm-router's and SGLang's cache-aware default, 0.3):
   conversations that share only a chat template's opening or a system prompt spread by key,
   where otherwise every one would pile onto the first ranks that computed that opening (with
   the engines' KV events, the index knows it to the block).
4. Load bound, in uncached prompt tokens: what the engines will compute, since a prompt's
   cached prefix costs a rank next to nothing (an agentic turn resends its whole history,
   nearly all of it cached where the session's last turn ran). A candidate's load with the
   request is its rank's outstanding uncached tokens plus the request's estimated prompt tokens
   less those the rank holds. The first candidate wins unless its load exceeds the other's by
   more than ``imbalance_tokens`` and, where the other rank is busy, by the cached prefix the
   request would leave behind as well (recomputed on a busy rank, it delays the requests
   queued after it there: on real engines under load, spills were where Baton's lost reuse
   went); a hot prefix then spills over instead of queueing, to the sibling rank of the same
   instance as readily as to another instance, since a rank's queue, not its instance's, is
   what a prefill waits in. (``least_loaded`` takes the lowest such load
   of all, whatever the key.)

**Decode** (one DP rank of the cell's decode group): the fewest in-flight requests among the
cell's healthy ranks (request count is enough: the DeepSeek-V4.1-Flash GB300 study found decode
step time barely depends on context length, so it balanced decode DP ranks by request count);
ties are broken by rendezvous hashing of the request id, so replicas spread rather than herd.

**P/D decider**: a prompt whose estimated uncached tokens are below ``pd_threshold_tokens`` skips
prefill and goes to decode alone.

**Cells**: the prefill choice fixes the cell, and decode stays in it; only cells with a healthy
decode rank are considered for prefill.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

import orjson

from baton.core.model import BYTES_PER_TOKEN

__all__ = [
    "PREFIX_SAMPLE_CHARS",
    "PROMPT_KEY_BYTES",
    "SESSION_HEADERS",
    "AffinityKey",
    "AffinitySource",
    "DecodeRankView",
    "PoolSnapshot",
    "PrefillChoice",
    "PrefillPolicy",
    "PrefillView",
    "RoutingPolicy",
    "affinity_key",
    "choose_decode_rank",
    "choose_prefill",
    "conversation_digest",
    "estimate_prompt_tokens",
    "needs_prefill",
    "prompt_bytes",
    "uncached_tokens",
]

# Session headers sent by agent harnesses and routers, in priority order. First a subagent's
# parent: a subagent starts from its parent's system prompt, so it is keyed on the parent. OpenCode
# sends a subagent's own X-Session-ID with the parent's X-Parent-Session-ID; Claude Code keeps the
# parent's X-Claude-Code-Session-ID (both seen on the wire: github.com/preloop/preloop pull 701).
# Then the generic names, NVIDIA Dynamo's, Claude Code's, the thread ids of agent frameworks,
# SGLang Model Gateway's routing key and the correlation id some proxies add.
SESSION_HEADERS = (
    "x-parent-session-id",
    "x-session-id",
    "x-dynamo-session-id",
    "x-claude-code-session-id",
    "session-id",
    "thread-id",
    "x-smg-routing-key",
    "x-correlation-id",
)
PROMPT_KEY_BYTES = 4096
# A text of the conversation key is told apart by its length and the characters at its start
# and end, so a 500 KB system prompt is not hashed whole to make a key.
PREFIX_SAMPLE_CHARS = 4096


@dataclass(frozen=True, slots=True)
class PrefillView:
    """One DP rank of a prefill instance, or the whole instance while its ranks are not known."""

    name: str  # stable identity: the instance's URL
    cell: str
    healthy: bool
    # uncached prompt tokens in flight on the rank: this gateway's, plus other replicas' as
    # estimated
    outstanding_tokens: int
    cached_tokens: int  # the request's prompt tokens the rank was sent (router/prefix.py)
    dp_rank: int = -1  # what X-data-parallel-rank carries; -1: the engine chooses
    outstanding_requests: int = 0  # prefills in flight on the rank, this gateway's and others'

    @property
    def unit(self) -> str:
        """The rank's identity: ``<url>#<rank>``, or the URL where the engine chooses."""
        return self.name if self.dp_rank < 0 else f"{self.name}#{self.dp_rank}"


@dataclass(frozen=True, slots=True)
class DecodeRankView:
    name: str  # stable identity: "<url>#<rank>"
    url: str
    cell: str
    dp_rank: int  # what X-data-parallel-rank carries (a local index under hybrid LB)
    healthy: bool
    in_flight: int


@dataclass(frozen=True, slots=True)
class PrefillChoice:
    view: PrefillView
    spilled: bool  # the first candidate (its cache, else its first choice) was too loaded
    uncached_tokens: int  # the request's estimate there: what it adds to the outstanding tokens
    best_cached_tokens: int = 0  # the longest prefix of the prompt any rank was sent

    @property
    def routed_away_tokens(self) -> int:
        """Prompt tokens another rank held beyond what the chosen one did: a spill's cost."""
        return max(0, self.best_cached_tokens - self.view.cached_tokens)


@dataclass(frozen=True, slots=True)
class PoolSnapshot:
    prefill: tuple[PrefillView, ...]
    decode: tuple[DecodeRankView, ...]


class AffinitySource(StrEnum):
    SESSION = "session"
    USER = "user"
    CONVERSATION = "conversation"
    PROMPT = "prompt"
    REQUEST = "request"


@dataclass(frozen=True, slots=True)
class AffinityKey:
    source: AffinitySource
    digest: bytes


class PrefillPolicy(StrEnum):
    AFFINITY = "affinity"  # session / conversation affinity, bounded by load (the default)
    LEAST_LOADED = "least_loaded"  # fewest outstanding uncached tokens; a baseline


@dataclass(frozen=True, slots=True)
class RoutingPolicy:
    prefill: PrefillPolicy = PrefillPolicy.AFFINITY
    imbalance_tokens: int = 8192  # one prefill step of spill-over allowance
    pd_threshold_tokens: int = 256  # vllm-router's default for skipping P/D
    cache_threshold: float = 0.3  # the share of a prompt a cached prefix must pass to pull it


def _digest(*parts: bytes) -> bytes:
    hasher = hashlib.blake2b(digest_size=16)
    for part in parts:
        hasher.update(part)
    return hasher.digest()


def affinity_key(
    headers: Mapping[str, str], body: Mapping[str, object], request_id: str
) -> AffinityKey:
    """The key that keeps a session's or conversation's prefills on one instance."""
    for name in SESSION_HEADERS:
        value = headers.get(name)
        if value:
            return AffinityKey(AffinitySource.SESSION, _digest(b"s", value.encode()))
    user = body.get("user")
    if isinstance(user, str) and user:
        return AffinityKey(AffinitySource.USER, _digest(b"u", user.encode()))
    conversation = conversation_digest(body)
    if conversation is not None:
        source = AffinitySource.CONVERSATION if body.get("messages") else AffinitySource.PROMPT
        return AffinityKey(source, conversation)
    return AffinityKey(AffinitySource.REQUEST, _digest(b"r", request_id.encode()))


def conversation_digest(body: Mapping[str, object]) -> bytes | None:
    """What every turn of one conversation shares and other conversations do not: a hash chain
    over message boundaries up to and including the first user message, or a completion
    prompt's first :data:`PROMPT_KEY_BYTES` bytes; None for neither."""
    messages = body.get("messages")
    if isinstance(messages, list) and messages:
        chain = b""
        for message in messages:
            chain = _digest(chain, *_message_parts(message))
            if isinstance(message, Mapping) and message.get("role") == "user":
                break
        return chain
    prompt = body.get("prompt")
    if isinstance(prompt, str) and prompt:
        return _digest(prompt[:PROMPT_KEY_BYTES].encode())
    if isinstance(prompt, list) and prompt:
        return _digest(orjson.dumps(prompt[: PROMPT_KEY_BYTES // BYTES_PER_TOKEN]))
    return None


def _message_parts(message: object) -> Iterator[bytes]:
    """A message for its key, without serializing its text: its fields in name order, a text
    told apart by its length and its first and last :data:`PREFIX_SAMPLE_CHARS` characters,
    anything else by its JSON; each part led by its length."""
    fields = sorted(message.items()) if isinstance(message, Mapping) else [("", message)]
    for name, value in fields:
        if isinstance(value, str):
            tail = value[-PREFIX_SAMPLE_CHARS:] if len(value) > PREFIX_SAMPLE_CHARS else ""
            part = f"{name}={len(value)}:{value[:PREFIX_SAMPLE_CHARS]}:{tail}".encode()
        else:
            part = f"{name}=".encode() + orjson.dumps(value, option=orjson.OPT_SORT_KEYS)
        yield len(part).to_bytes(8)
        yield part


def estimate_prompt_tokens(body: Mapping[str, object], serialized: bytes | None = None) -> int:
    """Prompt tokens estimated from text length (4 bytes a token) or counted from token ids;
    ``serialized``: the body's :func:`prompt_bytes`, when already made (a chat's then need not be
    serialized again: they are as long as its messages' JSON)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        if all(isinstance(item, int) for item in prompt):
            return len(prompt)
        return sum(estimate_prompt_tokens({"prompt": item}) for item in prompt)
    if isinstance(prompt, str):
        return len(prompt.encode()) // BYTES_PER_TOKEN + 1
    messages = body.get("messages")
    if isinstance(messages, list):
        length = len(serialized) if serialized is not None else len(orjson.dumps(messages))
        return length // BYTES_PER_TOKEN + 1
    return 0


def prompt_bytes(body: Mapping[str, object]) -> bytes:
    """The prompt as bytes that a later prompt continuing it starts with: the JSON of its
    messages (or prompt) left open, a text without its closing quote, a list with a comma for its
    closing bracket (so that ``[1,2,3`` is not taken to start ``[1,2,30]``); empty for neither."""
    prompt = body.get("messages", body.get("prompt"))
    if isinstance(prompt, str):
        return orjson.dumps(prompt)[:-1]
    if isinstance(prompt, list):
        return orjson.dumps(prompt)[:-1] + b","
    return b""


def needs_prefill(uncached_tokens: int, policy: RoutingPolicy) -> bool:
    """The P/D decider: short uncached prompts are prefilled by the decode rank itself."""
    return uncached_tokens >= policy.pd_threshold_tokens


def uncached_tokens(view: PrefillView, prompt_tokens: int) -> int:
    """The request's prompt tokens ``view``'s instance would compute: those not cached there."""
    return max(0, prompt_tokens - view.cached_tokens)


def _score(key: bytes, name: str) -> bytes:
    return _digest(key, name.encode())


def _ranked(key: bytes, names: Iterable[str]) -> list[str]:
    return sorted(names, key=lambda name: _score(key, name), reverse=True)


def choose_prefill(
    snapshot: PoolSnapshot,
    key: AffinityKey,
    prompt_tokens: int,
    policy: RoutingPolicy,
    exclude: Sequence[str] = (),
) -> PrefillChoice | None:
    """The prefill rank for ``key``'s request of ``prompt_tokens`` (estimated), or None when no
    cell can take it; ``exclude`` names instances."""
    serving_cells = {rank.cell for rank in snapshot.decode if rank.healthy}
    candidates = {
        view.unit: view
        for view in snapshot.prefill
        if view.healthy and view.cell in serving_cells and view.name not in exclude
    }
    if not candidates:
        return None
    ranked = [candidates[unit] for unit in _ranked(key.digest, candidates)]

    def load(view: PrefillView) -> int:  # the rank's uncached tokens with this request
        return view.outstanding_tokens + uncached_tokens(view, prompt_tokens)

    # The pair: the two ranks holding the longest prefixes of the prompt, equals in the key's
    # order (with none holding any, the key's first two). Leaving the first costs its cached
    # prefix; a spill goes where the prefix is too, when it is anywhere else, so that requests
    # sharing a hot prefix under many keys spill onto one more rank, not many.
    def pull(view: PrefillView) -> int:  # the prefix, where it is enough to follow
        return (
            view.cached_tokens if view.cached_tokens > policy.cache_threshold * prompt_tokens else 0
        )

    pair = sorted(ranked, key=lambda view: -pull(view))[:2]  # stable: key order
    if policy.prefill is PrefillPolicy.LEAST_LOADED:
        view = min(ranked, key=load)
    elif len(pair) > 1 and load(pair[0]) > load(pair[1]) + _spill_bound(pair[0], pair[1], policy):
        view = pair[1]
    else:
        view = pair[0]
    return PrefillChoice(
        view, view is not pair[0], uncached_tokens(view, prompt_tokens), pair[0].cached_tokens
    )


def _spill_bound(first: PrefillView, second: PrefillView, policy: RoutingPolicy) -> int:
    """How much sooner the second candidate must finish the request to take it from the first:
    the allowance, and where the second rank is busy, the prefix the request leaves behind,
    once for each request queued there. Computed again, those tokens delay every request that
    will queue behind it, which its own gain does not count: about as many as are queued ahead
    of it (Little's law, the queue in steady state), at least one; on an idle rank, nobody."""
    if not second.outstanding_tokens:
        return policy.imbalance_tokens
    left_behind = max(0, first.cached_tokens - second.cached_tokens)
    return policy.imbalance_tokens + left_behind * max(1, second.outstanding_requests)


def choose_decode_rank(
    snapshot: PoolSnapshot,
    request_key: bytes,
    cell: str | None = None,
    exclude: Sequence[str] = (),
) -> DecodeRankView | None:
    """The least-loaded healthy decode rank (in ``cell`` when given), or None."""
    ranks = [
        rank
        for rank in snapshot.decode
        if rank.healthy and (cell is None or rank.cell == cell) and rank.name not in exclude
    ]
    if not ranks:
        return None
    fewest = min(rank.in_flight for rank in ranks)
    tied = [rank for rank in ranks if rank.in_flight == fewest]
    if len(tied) == 1:
        return tied[0]
    return max(tied, key=lambda rank: _score(request_key, rank.name))
