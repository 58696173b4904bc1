"""The gateway's configuration: its tunables, in one model that both front ends read, and
where its engines come from.

``baton gateway`` derives a flag from each field of :class:`GatewaySettings`
(``prefill_timeout_s`` is ``--prefill-timeout``), and Ray Serve's application arguments extend
the model; either way the names, bounds and help live here once, and pydantic checks the values.
Routing and timeout defaults are those of ``RoutingPolicy`` and ``Timeouts``, the parameters of
the code that uses them.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from baton.core.follow import DeploymentRef
from router.handoff import Timeouts
from router.policy import PrefillPolicy, RoutingPolicy
from router.pool import STALL_AFTER_S
from router.prefix import INDEX_BLOCKS
from router.targets import PoolSpec
from router.tokens import check_tokenizer

__all__ = ["GatewayConfig", "GatewaySettings"]

_ROUTING = RoutingPolicy()
_TIMEOUTS = Timeouts()


class GatewaySettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    policy: PrefillPolicy = Field(_ROUTING.prefill, description="prefill choice")
    pd_threshold_tokens: int = Field(
        _ROUTING.pd_threshold_tokens,
        ge=0,
        description="prompts estimated below this many tokens skip prefill",
    )
    imbalance_tokens: int = Field(
        _ROUTING.imbalance_tokens,
        ge=0,
        description="uncached-token gap at which affinity spills to the 2nd choice",
    )
    cache_threshold: float = Field(
        _ROUTING.cache_threshold,
        ge=0,
        le=1,
        description="share of a prompt a rank's cached prefix must pass to pull the request there",
    )
    prefill_timeout_s: float = Field(
        _TIMEOUTS.prefill_s, gt=0, description="seconds for the prefill leg"
    )
    first_token_timeout_s: float = Field(
        _TIMEOUTS.first_token_s,
        gt=0,
        description="seconds from the decode request to its first token",
    )
    idle_timeout_s: float = Field(
        _TIMEOUTS.idle_s, gt=0, description="seconds a stream may go without bytes from its engine"
    )
    health_interval_s: float = Field(
        2.0, gt=0, description="seconds between health checks and decode load syncs"
    )
    stall_after_s: float = Field(
        STALL_AFTER_S,
        gt=0,
        description="seconds a decode server may run requests without counting a token before "
        "new requests avoid it",
    )
    max_requests_per_rank: int = Field(
        0,
        ge=0,
        description="requests a decode rank may hold (this gateway's and other replicas'); "
        "beyond it a request waits for a place, then gets 429 (0: no bound)",
    )
    queue_timeout_s: float = Field(
        _TIMEOUTS.queue_s,
        gt=0,
        description="seconds a request waits for a decode rank below --max-requests-per-rank",
    )
    tokenizer: str = Field(
        "",
        description="the engines' tokenizer, to key prompts by the token blocks the engines "
        "cache: the model's directory (its tokenizer.json), or 'sim' for baton sim engines "
        "(none: prompts are keyed by their bytes)",
    )
    kv_events_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="the port each prefill engine's DP rank 0 publishes its KV events on "
        "(vLLM's --kv-events-config; rank r on PORT+r), read to know what each rank holds; "
        "needs --tokenizer (0: none)",
    )
    prefix_index_blocks: int = Field(
        INDEX_BLOCKS,
        ge=1024,
        description="prompt blocks the prefix index remembers over every prefill rank, least "
        "recently used forgotten first (with KV events about 180 bytes and 16 tokens each)",
    )
    first_token_from_prefill: bool = Field(
        False,
        description="send a streamed completion's first token as its prefill leg samples it and "
        "have the decode leg continue after it, where that is the stream one engine would give "
        "(its prompt sent as the engines' ids, nothing that depends on where output begins): "
        "TTFT less the handoff, which then comes between the first token and the second",
    )
    max_body_bytes: int = Field(32 * 1024 * 1024, gt=0, description="largest request body")
    body_timeout_s: float = Field(
        60.0, gt=0, description="seconds a client may take to send its request body"
    )
    max_header_bytes: int = Field(
        64 * 1024, gt=0, description="largest request head (baton gateway; 431 beyond)"
    )
    header_timeout_s: float = Field(
        10.0, gt=0, description="seconds a client may take to send its request head"
    )
    # Longer than clients keep an idle connection pooled (aiohttp 15 s, httpx 5 s): a server
    # that closes first races the client's next request on it. nginx's default.
    keep_alive_timeout_s: int = Field(
        75, gt=0, description="seconds an idle kept-alive client connection stays open"
    )

    @field_validator("tokenizer")
    @classmethod
    def _tokenizer_files(cls, value: str) -> str:
        if value:
            check_tokenizer(value)
        return value

    @model_validator(mode="after")
    def _events_need_tokens(self) -> GatewaySettings:
        if self.kv_events_port and not self.tokenizer:
            raise ValueError(
                "--kv-events-port: the engines' KV events name token blocks, so give "
                "--tokenizer too (the model's directory, or 'sim')"
            )
        return self

    @classmethod
    def add_flags(cls, parser: argparse.ArgumentParser) -> None:
        """One flag per field: its name in kebab case without the ``_s`` unit suffix."""
        for name, info in cls.model_fields.items():
            flag = "--" + name.removesuffix("_s").replace("_", "-")
            default = info.default
            if isinstance(default, PrefillPolicy):
                parser.add_argument(
                    flag,
                    dest=name,
                    default=default.value,
                    choices=[p.value for p in PrefillPolicy],
                    help=info.description,
                )
            elif isinstance(default, bool):
                parser.add_argument(
                    flag,
                    dest=name,
                    action=argparse.BooleanOptionalAction,
                    default=default,
                    help=f"{info.description} (default: {'on' if default else 'off'})",
                )
            else:
                unit = name.rsplit("_", 1)[-1]
                metavar = "SECONDS" if unit == "s" else unit.upper()
                parser.add_argument(
                    flag,
                    dest=name,
                    type=type(default),
                    default=default,
                    metavar=metavar,
                    help=f"{info.description} (default: {default})",
                )

    @classmethod
    def from_flags(cls, args: argparse.Namespace) -> GatewaySettings:
        """The fields :meth:`add_flags` added; ValueError names the flag and what is wrong."""
        try:
            return cls.model_validate({name: getattr(args, name) for name in cls.model_fields})
        except ValidationError as exc:
            raise ValueError(_describe_flags(exc)) from exc

    def routing_policy(self) -> RoutingPolicy:
        return RoutingPolicy(
            prefill=self.policy,
            imbalance_tokens=self.imbalance_tokens,
            pd_threshold_tokens=self.pd_threshold_tokens,
            cache_threshold=self.cache_threshold,
        )

    def timeouts(self) -> Timeouts:
        return Timeouts(
            prefill_s=self.prefill_timeout_s,
            first_token_s=self.first_token_timeout_s,
            idle_s=self.idle_timeout_s,
            queue_s=self.queue_timeout_s,
        )


@dataclass(frozen=True)
class GatewayConfig:
    """Where the engines come from, who may call, and the tunables."""

    pool: PoolSpec | None  # None: the pools come from model_deployments' status
    api_keys: tuple[str, ...] = ()
    settings: GatewaySettings = field(default_factory=GatewaySettings)
    pool_file: Path | None = None  # reloaded when it changes
    # each a pool of its own, routed to by the model its spec serves
    model_deployments: tuple[DeploymentRef, ...] = ()
    # The engines' API key (vLLM's --api-key): sent on every call to an engine.
    engine_api_key: str | None = field(default=None, repr=False)

    @property
    def engine_headers(self) -> dict[str, str]:
        """What every call to an engine carries besides its own headers."""
        key = self.engine_api_key
        return {"Authorization": f"Bearer {key}"} if key else {}


def _describe_flags(exc: ValidationError) -> str:
    return "; ".join(
        f"--{str(error['loc'][0]).removesuffix('_s').replace('_', '-')}: {error['msg']}"
        if error["loc"]
        else error["msg"].removeprefix("Value error, ")  # a rule over several flags
        for error in exc.errors()
    )
