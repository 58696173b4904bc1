"""The OpenAI/vLLM wire shapes the simulator accepts and returns.

Request bodies are untrusted: pydantic models with vLLM's field names, unknown fields allowed
(vLLM ignores them). Error bodies are vLLM's: ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from http import HTTPStatus
from typing import Annotated, Any, Literal

import orjson
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

__all__ = [
    "ChatCompletionRequest",
    "CompletionRequest",
    "StreamOptions",
    "error_body",
    "validation_message",
]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")

    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _SamplingRequest(BaseModel, ABC):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    n: Annotated[int, Field(ge=1)] = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0)] = 0
    user: str | None = None
    kv_transfer_params: dict[str, Any] | None = None

    @field_validator("stream_options")
    @classmethod
    def _only_when_streaming(
        cls, options: StreamOptions | None, info: ValidationInfo
    ) -> StreamOptions | None:
        if options is not None and not info.data.get("stream"):
            raise ValueError("Stream options can only be defined when `stream=True`.")
        return options

    @property
    @abstractmethod
    def requested_max_tokens(self) -> int | None:
        """The most tokens the request allows; None: what the context leaves."""

    @model_validator(mode="after")
    def _min_within_max(self) -> _SamplingRequest:
        # vLLM's SamplingParams check, against the max tokens the request allows.
        limit = self.requested_max_tokens
        if limit is not None and self.min_tokens > limit:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={limit}, "
                f"got {self.min_tokens}."
            )
        return self

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(s for s in self.stop if s)


class CompletionRequest(_SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    echo: bool = False
    return_token_ids: bool | None = False  # each choice's generated ids beside its text

    @property
    def requested_max_tokens(self) -> int | None:
        return 16 if self.max_tokens is None else self.max_tokens  # vLLM turns null into 16


class ChatCompletionRequest(_SamplingRequest):
    messages: Annotated[list[dict[str, Any]], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    add_generation_prompt: bool = True

    @property
    def requested_max_tokens(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )


ErrorType = Literal[
    "BadRequestError", "NotFoundError", "InternalServerError", "ServiceUnavailableError"
]
_TYPES: dict[int, ErrorType] = {
    400: "BadRequestError",
    404: "NotFoundError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


def error_body(status: int, message: str, param: str | None = None) -> bytes:
    """vLLM's error body for ``status``."""
    kind = _TYPES.get(status, HTTPStatus(status).phrase.replace(" ", "") + "Error")
    return orjson.dumps(
        {"error": {"message": message, "type": kind, "param": param, "code": status}}
    )


def validation_message(exc: ValidationError) -> tuple[str, str | None]:
    """A one-line message naming the bad fields, and the first field as ``param``."""
    errors = exc.errors()
    parts = []
    for err in errors:
        where = ".".join(str(p) for p in err["loc"]) or "body"
        parts.append(f"{where}: {err['msg']}")
    param = ".".join(str(p) for p in errors[0]["loc"]) if errors and errors[0]["loc"] else None
    return "; ".join(parts), param
