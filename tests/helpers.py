"""Helpers for tests that run real processes on loopback."""

from __future__ import annotations

import contextlib
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import httpx

from rigs.processes import eventually, free_port, free_port_block, stop_process, wait_healthy

if TYPE_CHECKING:  # for annotations only: most tests never load openai
    from openai.types import CompletionUsage

ROOT = Path(__file__).resolve().parent.parent
NIXL = '{"kv_connector":"NixlConnector","kv_role":"kv_both"}'


@dataclass
class SimHandle:
    url: str
    port: int
    process: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text()


def scrape_by(url: str, sample_name: str, label: str) -> dict[str, float]:
    """One scrape: the samples named ``sample_name`` keyed by the value of ``label``."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=5).text
    return {
        sample.labels.get(label, ""): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == sample_name
    }


def scrape(url: str, sample_name: str, **labels: str) -> float:
    """Sum of the samples named ``sample_name`` whose labels include ``labels``."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", timeout=5).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == sample_name and all(
                sample.labels.get(k) == v for k, v in labels.items()
            ):
                total += sample.value
    return total


class _Answer(Protocol):
    @property
    def usage(self) -> CompletionUsage | None: ...


def usage_of(answer: _Answer) -> CompletionUsage:
    """An answer's usage: the simulator (and so the gateway) reports it on every answer, and on
    a stream's last chunk when asked."""
    assert answer.usage is not None
    return answer.usage


def cached_tokens_of(answer: _Answer) -> int:
    """``usage.prompt_tokens_details.cached_tokens``, which the simulator always reports."""
    details = usage_of(answer).prompt_tokens_details
    assert details is not None and details.cached_tokens is not None
    return details.cached_tokens


def keep_decoding(url: str, requests: int = 64, max_tokens: int = 200_000, ranks: int = 32) -> None:
    """``requests`` long decodes spread over a server's ``ranks`` (local) ranks, in daemon
    threads."""

    def run(index: int) -> None:
        # The test stops the simulator under these requests when it ends.
        with contextlib.suppress(httpx.HTTPError):
            httpx.post(
                f"{url}/v1/completions",
                headers={"X-data-parallel-rank": str(index % ranks)},
                json={"prompt": "load", "max_tokens": max_tokens, "ignore_eos": True},
                timeout=600,
            )

    for index in range(requests):
        threading.Thread(target=run, args=(index,), daemon=True).start()


__all__ = [
    "NIXL",
    "ROOT",
    "SimHandle",
    "cached_tokens_of",
    "eventually",
    "free_port",
    "free_port_block",
    "keep_decoding",
    "scrape",
    "scrape_by",
    "stop_process",
    "usage_of",
    "wait_healthy",
]
