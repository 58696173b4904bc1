"""router/stream.py: what the gateway reads in decode SSE bytes, fed in arbitrary chunks."""

from __future__ import annotations

import orjson
import pytest

from router.stream import DONE, DecodeStream, StreamHead, StreamState, error_event


def event(payload: dict[str, object]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


ROLE_ONLY = event(
    {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
    }
)
TOKEN = event(
    {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": {"content": " abc"}}],
    }
)
COMPLETION_TOKEN = event({"id": "cmpl-1", "choices": [{"index": 0, "text": " abc"}]})
DECODE_USAGE = {
    "prompt_tokens": 100,
    "completion_tokens": 5,
    "total_tokens": 105,
    "prompt_tokens_details": {"cached_tokens": 100},  # decode computed none, so reports all
}
USAGE = event({"id": "chatcmpl-1", "choices": [], "usage": DECODE_USAGE})
ERROR = b'data: {"error":{"message":"boom","type":"server_error","param":null,"code":500}}\n\n'


def feed_all(head: StreamHead, chunks: list[bytes]) -> list[StreamState]:
    return [head.feed(chunk) for chunk in chunks]


def split_every(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


def relay(stream: DecodeStream, chunks: list[bytes]) -> bytes:
    return b"".join(stream.feed(chunk) for chunk in chunks) + stream.finish()


def usage_in(output: bytes) -> dict[str, object]:
    frames = [orjson.loads(e[6:]) for e in output.split(b"\n\n") if e.startswith(b"data: {")]
    return next(frame["usage"] for frame in frames if frame.get("usage"))


# ---- StreamHead


def test_role_only_chat_chunk_is_held_until_a_token_arrives() -> None:
    head = StreamHead()
    assert head.feed(ROLE_ONLY) is StreamState.PENDING
    assert head.feed(TOKEN) is StreamState.TOKEN
    assert head.buffered == ROLE_ONLY + TOKEN


def test_first_completion_chunk_is_a_token() -> None:
    assert StreamHead().feed(COMPLETION_TOKEN) is StreamState.TOKEN


@pytest.mark.parametrize("size", [1, 7, 64], ids=["byte", "7-bytes", "64-bytes"])
def test_first_token_is_detected_across_chunk_boundaries(size: int) -> None:
    head = StreamHead()
    states = feed_all(head, split_every(ROLE_ONLY + TOKEN, size))
    assert states[-1] is StreamState.TOKEN
    assert set(states[:-1]) == {StreamState.PENDING}  # not before the token event is complete
    assert head.buffered == ROLE_ONLY + TOKEN


def test_error_event_before_a_token_is_detected_with_its_payload() -> None:
    head = StreamHead()
    assert feed_all(head, [ROLE_ONLY, ERROR[:20], ERROR[20:]])[-1] is StreamState.ERROR
    assert head.error == ERROR[6:-2]


def test_done_before_a_token_is_the_end() -> None:
    head = StreamHead()
    assert feed_all(head, [ROLE_ONLY, DONE])[-1] is StreamState.END


def test_comment_lines_are_not_tokens() -> None:
    head = StreamHead()
    assert head.feed(b": keep-alive\n\n") is StreamState.PENDING
    assert head.feed(TOKEN) is StreamState.TOKEN


# ---- DecodeStream


def test_chunks_without_usage_pass_through_verbatim() -> None:
    stream = DecodeStream(cached_tokens=32)
    chunk = TOKEN + TOKEN
    assert stream.feed(chunk) is chunk  # the very same bytes object: nothing copied
    assert stream.usage is None
    assert not stream.done


def test_usage_frame_reports_prefill_cached_tokens() -> None:
    stream = DecodeStream(cached_tokens=32)
    output = relay(stream, [TOKEN, USAGE + DONE])
    assert usage_in(output) == {**DECODE_USAGE, "prompt_tokens_details": {"cached_tokens": 32}}
    assert output.startswith(TOKEN) and output.endswith(DONE)


def test_usage_is_captured_and_left_alone_without_prefill() -> None:
    stream = DecodeStream(cached_tokens=None)
    output = relay(stream, [TOKEN, USAGE, DONE])
    assert output == TOKEN + USAGE + DONE
    assert stream.usage == DECODE_USAGE


def test_usage_frame_split_after_its_usage_key_is_patched() -> None:
    stream = DecodeStream(cached_tokens=32)
    cut = USAGE.index(b'"usage"') + len(b'"usage"') + 5
    output = relay(stream, [TOKEN + USAGE[:cut], USAGE[cut:] + DONE])
    assert output.startswith(TOKEN)
    assert usage_in(output)["prompt_tokens_details"] == {"cached_tokens": 32}


def test_usage_frame_alone_split_in_two_is_patched() -> None:
    stream = DecodeStream(cached_tokens=32)
    cut = USAGE.index(b'"usage"') + len(b'"usage"') + 5
    output = relay(stream, [TOKEN, USAGE[:cut], USAGE[cut:] + DONE])
    assert output.startswith(TOKEN + b"data: {")
    assert usage_in(output)["prompt_tokens_details"] == {"cached_tokens": 32}


@pytest.mark.parametrize("size", [16, 64], ids=["16-bytes", "64-bytes"])
def test_usage_frame_split_anywhere_is_patched(size: int) -> None:
    stream = DecodeStream(cached_tokens=32)
    output = relay(stream, split_every(TOKEN + USAGE + DONE, size))
    assert usage_in(output)["prompt_tokens_details"] == {"cached_tokens": 32}
    assert stream.usage is not None


def test_done_is_set_when_the_stream_ends_with_done() -> None:
    stream = DecodeStream(cached_tokens=None)
    stream.feed(TOKEN)
    assert not stream.done
    stream.feed(TOKEN + DONE)
    assert stream.done


def test_done_is_set_after_a_usage_frame() -> None:
    stream = DecodeStream(cached_tokens=32)
    relay(stream, [TOKEN, USAGE + DONE])
    assert stream.done


def test_done_split_across_chunks_is_set() -> None:
    stream = DecodeStream(cached_tokens=None)
    relay(stream, [TOKEN, DONE[:9], DONE[9:]])
    assert stream.done


def test_error_event_ends_the_stream_with_an_openai_error_and_done() -> None:
    data = error_event("decode failed", code="upstream_failed")
    body, _, rest = data.partition(b"\n\n")
    assert rest == DONE
    assert orjson.loads(body[6:]) == {
        "error": {
            "message": "decode failed",
            "type": "server_error",
            "param": None,
            "code": "upstream_failed",
        }
    }


def test_a_token_the_client_had_from_prefill_counts_as_output_not_prompt() -> None:
    # the decode engine's prompt was the prompt and the prefill's token
    shifted = {**DECODE_USAGE, "prompt_tokens": 101, "completion_tokens": 4}
    frame = event({"id": "cmpl-1", "choices": [], "usage": shifted})
    stream = DecodeStream(cached_tokens=40, answered=1)
    usage = usage_in(relay(stream, split_every(COMPLETION_TOKEN + frame + DONE, 7)))
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (
        100,
        5,
        105,
    )
    assert usage["prompt_tokens_details"] == {"cached_tokens": 40}
    assert stream.usage == usage
