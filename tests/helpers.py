"""Helpers for tests that run real processes on loopback."""

from __future__ import annotations

import atexit
import functools
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import httpx

from rigs.faults import FaultInjection
from rigs.processes import (
    baton_command,
    eventually,
    free_port,
    free_port_block,
    keep_decoding,
    stop_process,
    wait_healthy,
)

if TYPE_CHECKING:  # for annotations only: most tests never load openai
    from openai.types import CompletionUsage

ROOT = Path(__file__).resolve().parent.parent
NIXL = '{"kv_connector":"NixlConnector","kv_role":"kv_both"}'
METRICS_DOC = ROOT / "docs" / "metrics.md"
# A Mooncake-format trace (bench/trace.py): conversations of 2-4 blocks of 512 tokens, a follow-up
# turn extending an earlier prompt.
SMALL_TRACE: list[dict[str, Any]] = [
    {"timestamp": 0, "input_length": 1100, "output_length": 8, "hash_ids": [1, 2, 3]},
    {"timestamp": 300, "input_length": 700, "output_length": 8, "hash_ids": [1, 4]},
    {"timestamp": 900, "input_length": 1600, "output_length": 8, "hash_ids": [1, 2, 3, 5]},
    {"timestamp": 1400, "input_length": 1200, "output_length": 8, "hash_ids": [1, 4, 6]},
    {"timestamp": 2000, "input_length": 2100, "output_length": 8, "hash_ids": [1, 2, 3, 5, 7]},
    {"timestamp": 2600, "input_length": 900, "output_length": 8, "hash_ids": [1, 8]},
    {"timestamp": 3100, "input_length": 1700, "output_length": 8, "hash_ids": [1, 4, 6, 9]},
    {"timestamp": 3700, "input_length": 1400, "output_length": 8, "hash_ids": [1, 8, 10]},
]


def bench_gpu(
    engines: str, state: Path, out: Path, *arguments: str
) -> subprocess.CompletedProcess[str]:
    """``baton bench gpu`` on ``engines`` (cpu, sim) with its engines' record in ``state`` and
    its JSON in ``out``, run to its end."""
    return subprocess.run(
        baton_command(
            "bench",
            "gpu",
            "--engines",
            engines,
            "--state",
            str(state),
            "--out",
            str(out),
            *arguments,
        ),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
    )


@dataclass
class SimHandle:
    url: str
    port: int
    process: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text()


@functools.cache
def fault_injection() -> FaultInjection:
    """This test run's fault-injection token: engines started with its ``flags`` take
    ``POST /sim/faults`` from its ``inject``."""
    directory = Path(tempfile.mkdtemp(prefix="baton-test-faults-"))
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    return FaultInjection(directory)


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


def documented() -> dict[str, tuple[str, set[str]]]:
    """docs/metrics.md's tables: each metric's type and labels."""
    kinds = "counter|gauge|histogram|summary"
    rows = re.findall(rf"^\| `([^`]+)` \| ({kinds}) \|([^|]*)\|", METRICS_DOC.read_text(), re.M)
    table = {
        name: (kind, {label.strip() for label in labels.split(",") if label.strip()})
        for name, kind, labels in rows
    }
    assert len(table) == len(rows), "a metric documented twice"
    return table


def served(url: str) -> dict[str, tuple[str, set[str] | None]]:
    """One scrape: each family's name (counters with _total, as stored), type and labels
    (None for a labelled family with no series yet)."""
    from prometheus_client.parser import text_string_to_metric_families

    families: dict[str, tuple[str, set[str] | None]] = {}
    for family in text_string_to_metric_families(httpx.get(url, timeout=10).text):
        name = f"{family.name}_total" if family.type == "counter" else family.name
        samples = [s for s in family.samples if not s.name.endswith("_created")]
        labels = {label for s in samples for label in s.labels} - {"le"} if samples else None
        families[name] = (family.type, labels)
    # prometheus_client's creation time of each counter and histogram, which its text format
    # serves as a gauge family of its own: the client's, not a Baton metric
    return {
        name: value
        for name, value in families.items()
        if not (
            name.endswith("_created")
            and {f"{name.removesuffix('_created')}{end}" for end in ("", "_total")} & set(families)
        )
    }


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


__all__ = [
    "METRICS_DOC",
    "NIXL",
    "ROOT",
    "SimHandle",
    "baton_command",
    "cached_tokens_of",
    "documented",
    "eventually",
    "fault_injection",
    "free_port",
    "free_port_block",
    "keep_decoding",
    "scrape",
    "scrape_by",
    "served",
    "stop_process",
    "usage_of",
    "wait_healthy",
]


# What Grafana puts for its variables; five minutes spans a whole drill.
RATE_WINDOW = "5m"


def grafana_expr(expr: str, **chosen: str) -> str:
    """A panel's query (as its spec writes it) as Grafana sends it: narrowed to the deployments
    chosen (``namespace=``, ``deployment=``, ``model=``; each "All" unless given) and every
    variable given its value."""
    from deploy.grafana.dashboards import (
        DEPLOYMENT,
        GPU_HOUR_PRICE,
        GPU_HOUR_PRICE_DEFAULT,
        MODEL,
        NAMESPACE,
        scoped,
    )

    expr = scoped(expr)
    for variable in (NAMESPACE, DEPLOYMENT, MODEL):
        value = chosen.pop(variable, None)
        # Kubernetes names hold no character a regex reads otherwise, but for "." (any one)
        expr = expr.replace(f"${variable}", ".*" if value is None else value)
    assert not chosen, f"no such variable: {chosen}"
    return expr.replace("$__rate_interval", RATE_WINDOW).replace(
        f"${GPU_HOUR_PRICE}", GPU_HOUR_PRICE_DEFAULT
    )


def clean_checkout(into: Path) -> Path:
    """The repository's files as a clone has them (tracked, and new files not ignored), copied
    into ``into``: nothing built or cached in this checkout comes along."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    )
    for name in filter(None, listed.stdout.decode().split("\0")):
        source = ROOT / name
        if source.is_file():
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, into / name)
    return into
