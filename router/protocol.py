"""The request bodies the gateway validates: OpenAI's fields, vLLM's extensions passed through.

These models check what routing and the client contract depend on (types, ranges, required
fields) and document the API in ``/openapi.json``. Unknown fields are allowed and forwarded to
the engines untouched (``ignore_eos``, ``min_tokens``, ``chat_template_kwargs``, ...).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["ChatCompletionRequest", "ChatMessage", "CompletionRequest", "StreamOptions"]


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(_Open):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class TextPart(_Open):
    type: Literal["text"]
    text: str


class ChatMessage(_Open):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | dict[str, object]] | None = None
    name: str | None = None


class _Sampling(_Open):
    model: Annotated[str, Field(min_length=1, description="a model served by the pool")]
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    n: Annotated[int, Field(ge=1, le=128)] | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    user: str | None = None


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None


class CompletionRequest(_Sampling):
    prompt: (
        Annotated[str, Field(min_length=1)]
        | Annotated[list[int], Field(min_length=1)]
        | Annotated[list[str], Field(min_length=1)]
        | Annotated[list[list[int]], Field(min_length=1)]
    )
    echo: bool | None = None
