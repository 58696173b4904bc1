"""``baton bench load-sync``: the CPU the gateway's load sync spends reading engines' pages.

Every health interval the gateway scrapes each engine API server's ``/metrics`` for the load
it reports (``router/prober.py``). A page is mostly histograms; the load is a few gauges and
counters. On one rack of ``baton up`` (the simulator's pages, with vLLM 0.33's names and
labels), each server's page is read two ways, side by side on the same pages: parsed whole
with ``prometheus_client`` (the gateway's reading until 2026-12-07), and as the gateway reads
it now (:func:`router.prober.engine_load`: the page checked to be Prometheus text, then only
the families the load needs parsed). Reported: bytes and milliseconds a page for prefill and
decode servers, and the share of one core a sync round of the whole rack costs at the
gateway's default interval.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.agentx import stack
from router.prober import engine_load
from router.settings import GatewaySettings

__all__ = ["run"]


def _whole(text: str) -> None:
    for family in text_string_to_metric_families(text):
        for _ in family.samples:
            pass


def _ms(read: Callable[[str], object], pages: list[str], rounds: int) -> float:
    """Mean CPU milliseconds ``read`` takes a page, over ``rounds`` reads of every page."""
    began = time.process_time()
    for _ in range(rounds):
        for page in pages:
            read(page)
    return (time.process_time() - began) / (rounds * len(pages)) * 1000


def run(quick: bool = False) -> dict[str, object]:
    rounds = 3 if quick else 20
    interval = GatewaySettings().health_interval_s
    with (
        tempfile.TemporaryDirectory(prefix="baton-bench-load-sync-") as directory,
        stack(Path(directory), 1.0, "off") as rack,
    ):
        pages = {
            role: [httpx.get(f"{url}/metrics", timeout=30).text for url in urls]
            for role, urls in (("prefill", rack.prefill), ("decode", rack.decode))
        }
    figures: dict[str, object] = {"health_interval_s": interval, "rounds": rounds}
    per_round = {"whole": 0.0, "gateway": 0.0}
    for role, texts in pages.items():
        whole, gateway = _ms(_whole, texts, rounds), _ms(engine_load, texts, rounds)
        per_round["whole"] += whole * len(texts)
        per_round["gateway"] += gateway * len(texts)
        page_bytes = sum(len(t) for t in texts) / len(texts)
        figures[role] = {
            "servers": len(texts),
            "page_bytes": page_bytes,
            "ms_whole": whole,
            "ms_gateway": gateway,
            "speedup": whole / gateway,
        }
        print(
            f"load sync, {role}: {len(texts)} servers, {page_bytes:,.0f} "
            f"bytes a page: parsed whole {whole:.2f} ms, as the gateway reads it "
            f"{gateway:.2f} ms ({whole / gateway:.1f}x)"
        )
    figures["core_share_whole"] = per_round["whole"] / 1000 / interval
    figures["core_share_gateway"] = per_round["gateway"] / 1000 / interval
    print(
        f"a sync of the rack every {interval:g} s: {figures['core_share_whole']:.0%} of a core "
        f"parsed whole, {figures['core_share_gateway']:.1%} as the gateway reads it"
    )
    return {"benchmark": "load-sync", **figures}
