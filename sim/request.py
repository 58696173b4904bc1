"""One inference request inside the simulated engine, and its lifecycle.

The HTTP layer builds a :class:`SimRequest` from a validated body, the engine moves it through
WAITING -> (WAITING_FOR_REMOTE_KVS) -> RUNNING -> FINISHED, and the HTTP layer drains its output
as it appears. Output is text made of 4-byte words (see ``baton.core.sim_tokenizer``), so
tokens = words.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum

from baton.core.sim_tokenizer import count_tokens
from sim.kvcache import Allocation, block_hashes

__all__ = ["FinishReason", "RequestFailed", "RequestState", "SimRequest", "make_request"]


class RequestState(StrEnum):
    WAITING = "waiting"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


class RequestFailed(Exception):
    """The engine could not serve a request; carries vLLM's HTTP status and message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(slots=True, eq=False)
class SimRequest:
    request_id: str  # engine-internal id: the external id plus a random suffix, as vLLM
    external_id: str
    prompt: bytes
    prompt_tokens: int
    hashes: list[bytes]
    max_tokens: int
    min_tokens: int
    eos_after: int | None  # reply length at which the "model" emits EOS; None with ignore_eos
    stop: tuple[str, ...]
    seed: int
    digest: bytes
    arrival: float
    do_remote_decode: bool = False
    # kv_transfer_params from the prefill engine, forwarded verbatim by the proxy.
    remote_prefill: Mapping[str, object] | None = None
    state: RequestState = RequestState.WAITING
    dp_rank: int = 0
    allocation: Allocation | None = None
    num_computed: int = 0  # prompt tokens whose KV exists on this rank
    cached_tokens: int = 0  # prompt tokens reported as cached in usage
    external_tokens: int = 0  # prompt tokens pulled from a prefill engine
    words: list[str] = field(default_factory=list)
    text: str = ""
    sent: int = 0  # characters of ``text`` already handed to the client
    holdback: int = 0  # characters kept back until a stop string can no longer start in them
    first_token_at: float | None = None
    last_token_at: float | None = None
    # the group's given-up lag at its last token: an inter-token latency leaves out the lag
    # given up since (the host's delay, not the modelled engine's)
    lag_given_up_at_last_token: float = 0.0
    queued_at: float | None = None  # in the engine core's queue, past the API server
    scheduled_at: float | None = None
    finished_at: float | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | None = None
    failure: RequestFailed | None = None
    kv_block_ids: list[int] = field(default_factory=list)  # held for a remote decode
    _ready: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def prefill_done(self) -> bool:
        return self.num_computed >= self.prompt_tokens

    @property
    def output_tokens(self) -> int:
        return len(self.words)

    @property
    def finished(self) -> bool:
        return self.state is RequestState.FINISHED

    def notify(self) -> None:
        self._ready.set()

    async def wait_output(self) -> None:
        """Wait until new text or the end is available."""
        await self._ready.wait()
        self._ready.clear()

    def take_text(self) -> str:
        """Text produced since the last call, minus what a stop string might still cut."""
        end = len(self.text) if self.finished else max(self.sent, len(self.text) - self.holdback)
        chunk = self.text[self.sent : end]
        self.sent = end
        return chunk


def make_request(
    prompt: bytes,
    *,
    external_id: str,
    max_tokens: int,
    block_size: int,
    arrival: float,
    seed: int = 0,
    ignore_eos: bool = True,
    mean_output_tokens: int = 256,
    min_tokens: int = 0,
    stop: tuple[str, ...] = (),
    do_remote_decode: bool = False,
    remote_prefill: Mapping[str, object] | None = None,
) -> SimRequest:
    """A request as the engine sees it, from a rendered prompt and sampling parameters.

    Without ``ignore_eos`` the "model" stops after an exponentially distributed number of tokens
    (mean ``mean_output_tokens``) drawn from the seed and the prompt, so a seeded request always
    has the same length and text.
    """
    digest = hashlib.blake2b(prompt, digest_size=16).digest()
    eos_after = None
    if not ignore_eos:
        draw = random.Random(seed ^ int.from_bytes(digest[:8], "little"))
        eos_after = 1 + int(draw.expovariate(1 / mean_output_tokens))
    return SimRequest(
        request_id=f"{external_id}-{secrets.token_hex(4)}",
        external_id=external_id,
        prompt=prompt,
        prompt_tokens=count_tokens(prompt),
        hashes=block_hashes(prompt, block_size),
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        eos_after=eos_after,
        stop=stop,
        holdback=max((len(s) for s in stop), default=1) - 1,
        seed=seed,
        digest=digest,
        arrival=arrival,
        do_remote_decode=do_remote_decode,
        remote_prefill=remote_prefill,
    )
