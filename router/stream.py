"""What the gateway reads in the decode engine's SSE bytes: I/O-free, decoder-shaped objects.

The hot path forwards upstream bytes verbatim. :class:`StreamHead` looks at the stream only until
the first generated token (to decide whether a failure is still retryable and to time TTFT);
:class:`DecodeStream` then looks only for the usage frame, which it captures for metrics and, on
the P/D path, corrects: vLLM's decode engine reports every prompt token as cached because it
computed none, so ``prompt_tokens_details.cached_tokens`` is replaced by the prefill engine's;
and where the client had the first token from the prefill leg, the decode engine counted that
token as prompt, so it moves back to the completion's count.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import orjson

__all__ = ["DONE", "DecodeStream", "StreamHead", "StreamState", "error_event"]

DONE = b"data: [DONE]\n\n"
_EVENT_END = b"\n\n"


def error_event(message: str, kind: str = "server_error", code: str = "upstream_failed") -> bytes:
    """An SSE error event and the end of the stream, for a failure after the first byte."""
    error = {"error": {"message": message, "type": kind, "param": None, "code": code}}
    return b"data: " + orjson.dumps(error) + _EVENT_END + DONE


class StreamState(StrEnum):
    PENDING = "pending"
    TOKEN = "token"
    ERROR = "error"
    END = "end"


@dataclass(slots=True)
class StreamHead:
    """Buffers the stream's head until it holds a generated token, an error event or the end.

    vLLM's chat stream opens with a role-only chunk before any token is generated; it is held
    back with the rest, so nothing reaches the client before the request can no longer be
    retried.
    """

    buffered: bytes = b""
    state: StreamState = StreamState.PENDING
    error: bytes = b""

    def feed(self, chunk: bytes) -> StreamState:
        self.buffered += chunk
        cut = self.buffered.rfind(_EVENT_END)
        if cut < 0:
            return self.state
        for event in self.buffered[:cut].split(_EVENT_END):
            if not event.startswith(b"data: "):
                continue
            if event.startswith(b'data: {"error"'):
                self.state, self.error = StreamState.ERROR, event[6:]
                return self.state
            if event == b"data: [DONE]":
                self.state = StreamState.END
                return self.state
            if b'"role":"assistant"' in event and b'"content":""' in event:
                continue  # the role-only opening chunk
            self.state = StreamState.TOKEN
            return self.state
        return self.state


class DecodeStream:
    """Passes SSE bytes through; captures (and on P/D corrects) the usage frame; notes [DONE]."""

    __slots__ = ("_pending", "answered", "cached_tokens", "done", "usage")

    def __init__(self, cached_tokens: int | None, answered: int = 0) -> None:
        """``answered``: tokens the client had before this stream (the prefill leg's), which
        the decode engine counts as prompt."""
        self.cached_tokens = cached_tokens
        self.answered = answered
        self.usage: dict[str, object] | None = None
        self.done = False
        self._pending = b""

    def feed(self, chunk: bytes) -> bytes:
        if not self._pending and chunk.endswith(_EVENT_END) and b'"usage"' not in chunk:
            self.done = chunk.endswith(DONE)
            return chunk  # the fast path: whole events, no usage frame: verbatim
        # A read that ends inside an event waits for the rest, so a usage frame or [DONE]
        # split across reads is seen whole.
        data = self._pending + chunk
        cut = data.rfind(_EVENT_END)
        if cut < 0:
            self._pending = data
            return b""
        complete, self._pending = data[: cut + 2], data[cut + 2 :]
        out = self._rewrite(complete) if b'"usage"' in complete else complete
        self.done = out.endswith(DONE)
        return out

    def finish(self) -> bytes:
        rest, self._pending = self._pending, b""
        return rest

    def _rewrite(self, events: bytes) -> bytes:
        parts = events.split(_EVENT_END)
        for index, event in enumerate(parts):
            if not event.startswith(b"data: {") or b'"usage"' not in event:
                continue
            frame = orjson.loads(event[6:])
            usage = frame.get("usage")
            if not isinstance(usage, dict):
                continue
            if self.cached_tokens is not None:
                usage["prompt_tokens_details"] = {
                    **(usage.get("prompt_tokens_details") or {}),
                    "cached_tokens": self.cached_tokens,
                }
            prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
            if self.answered and isinstance(prompt, int) and isinstance(completion, int):
                usage["prompt_tokens"] = prompt - self.answered
                usage["completion_tokens"] = completion + self.answered
            if self.cached_tokens is not None or self.answered:
                parts[index] = b"data: " + orjson.dumps(frame)
            self.usage = usage
        return _EVENT_END.join(parts)
