"""The gateway's targets as configured: cells of prefill instances and decode API servers, from
flags (``--prefill``, ``--decode URL@RANKS``) or a YAML pool file; ``router/discovery.py`` reads
them from a ModelDeployment's status too. Parsing and validation only: ``router/pool.py`` keeps
their state, ``router/prober.py`` talks to them."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from baton.core.files import load_yaml_model

__all__ = [
    "DecodeServerSpec",
    "PoolCell",
    "PoolSpec",
    "engine_url",
    "kv_events_host",
    "load_pool_file",
    "parse_decode_flag",
]


def engine_url(url: str) -> str:
    """An engine's base URL: plain HTTP, as vLLM serves on the cluster network. The engines'
    client speaks no TLS, so an https URL is refused here rather than failing every request."""
    if url.startswith("https://"):
        raise ValueError(
            f"'{url}': engines are reached over plain HTTP (the gateway speaks no TLS to "
            "engines); use http://, and a service mesh where the network needs encryption"
        )
    if not url.startswith("http://"):
        raise ValueError(f"'{url}' is not an http:// URL")
    return url.rstrip("/")


class DecodeServerSpec(BaseModel):
    """One decode API server and the DP ranks it routes by ``X-data-parallel-rank``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str
    ranks: tuple[int, ...] = ()  # header values (local indices under hybrid LB); () = no header

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        return engine_url(url)


def kv_events_host(url: str) -> str:
    """The host of an engine URL, where its KV events publisher is reached."""
    host = urlsplit(url).hostname or ""
    return f"[{host}]" if ":" in host else host


class PoolCell(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    prefill: tuple[str, ...] = ()
    decode: tuple[DecodeServerSpec, ...] = Field(min_length=1)
    # prefill URL -> where its DP rank 0 publishes KV events (tcp://HOST:PORT; rank r: PORT + r)
    kv_events: dict[str, str] = Field(default_factory=dict)

    @field_validator("prefill")
    @classmethod
    def _http_urls(cls, urls: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(engine_url(url) for url in urls)

    @model_validator(mode="after")
    def _kv_events_of_prefill(self) -> PoolCell:
        for url, endpoint in self.kv_events.items():
            if url not in self.prefill:
                raise ValueError(f"kv_events names {url}, which is not one of the cell's prefill")
            if not endpoint.startswith("tcp://") or not endpoint.rpartition(":")[2].isdigit():
                raise ValueError(f"kv_events of {url}: give tcp://HOST:PORT, not {endpoint!r}")
        return self


class PoolSpec(BaseModel):
    """The pool file's shape: ``cells: [{name, prefill: [URL...], decode: [{url, ranks}]}]``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cells: tuple[PoolCell, ...] = Field(min_length=1)


def parse_decode_flag(value: str) -> DecodeServerSpec:
    """``URL``, ``URL@3`` (one rank), ``URL@0-3`` or ``URL@0,1,2,3`` (hybrid-LB local ranks)."""
    url, at, ranks = value.partition("@")
    if not at:
        return DecodeServerSpec(url=url)
    problem = f"--decode {value}: ranks must look like @3, @0-3 or @0,1,2,3"
    parsed: list[int] = []
    for part in ranks.split(","):
        low, dash, high = part.partition("-")
        if not low.isdigit() or (dash and not high.isdigit()):
            raise ValueError(problem)
        if dash and int(high) < int(low):
            raise ValueError(f"{problem} (a range runs low to high)")
        parsed.extend(range(int(low), int(high) + 1) if dash else [int(low)])
    try:
        return DecodeServerSpec(url=url, ranks=tuple(parsed))
    except ValidationError as exc:
        raise ValueError(f"--decode {value}: {exc.errors()[0]['msg']}") from exc


def load_pool_file(path: str | Path) -> PoolSpec:
    return load_yaml_model(path, PoolSpec, kind="pool file", fix="see docs/gateway.md")
