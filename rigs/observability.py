"""A real Prometheus on loopback, scraping a running ``baton up`` and a controller, and the
failure drills that give every dashboard panel and alert something to show.

``tests/k8s/test_observability.py`` queries every panel and rule through Prometheus' HTTP API;
``bench/observability.py`` records the same queries over the run for docs/figures. Prometheus
is built by ``deploy/dev/build.sh`` (``make dev-bin``); nothing here builds.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import yaml
from kubernetes import client
from prometheus_client.parser import text_string_to_metric_families

from baton.core.labels import CLIQUE_LABEL, DEGRADED_ANNOTATION
from baton.core.model import SERVED_MODEL_NAME
from rigs.devcluster import (
    ROOT,
    create_model_deployment,
    fail_pod,
    read_model_deployment,
    record_tray_failures,
)
from rigs.faults import FaultInjection
from rigs.processes import baton_command, eventually, free_port, stop_process

__all__ = [
    "RULES",
    "BatonUp",
    "Prometheus",
    "baton_up",
    "drill",
    "start_prometheus",
]

RULES = ROOT / "deploy" / "prometheus" / "baton-rules.yaml"


@dataclass
class Prometheus:
    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def _get(self, path: str, **params: str) -> Any:
        reply = httpx.get(f"{self.url}{path}", params=params, timeout=30)
        body = reply.json()
        if body.get("status") != "success":
            raise RuntimeError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result (an instant vector or a scalar, as a one-element list)."""
        data = self._get("/api/v1/query", query=expr)
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": data["result"]}]
        result: list[dict[str, Any]] = data["result"]
        return result

    def query_range(self, expr: str, start: float, end: float, step: float) -> list[dict[str, Any]]:
        data = self._get(
            "/api/v1/query_range", query=expr, start=str(start), end=str(end), step=str(step)
        )
        result: list[dict[str, Any]] = data["result"]
        return result

    def wait_for(self, expr: str, timeout: float = 60) -> None:
        """Until ``expr`` has data: the targets it reads have been scraped."""
        eventually(lambda: self.query(expr), timeout=timeout, interval=0.5)

    def wait_caught_up(self, gateway: str, timeout: float = 30) -> None:
        """Until Prometheus holds the gateway's request count as it is now: the last scrapes
        after a drill are in, and the rules have been evaluated on them."""
        text = httpx.get(f"{gateway}/metrics", timeout=10).text
        served = sum(
            sample.value
            for family in text_string_to_metric_families(text)
            for sample in family.samples
            if sample.name == "baton_gateway_requests_total"
        )

        def caught_up() -> bool:
            counts = self.query("sum(baton_gateway_requests_total)")
            return [float(s["value"][1]) for s in counts] == [served]

        eventually(caught_up, timeout=timeout, interval=0.5)

    def rules(self) -> list[dict[str, Any]]:
        return [rule for group in self._get("/api/v1/rules")["groups"] for rule in group["rules"]]

    def stop(self) -> None:
        stop_process(self.process)


@contextlib.contextmanager
def start_prometheus(
    binaries: Path,
    directory: Path,
    *,
    file_sd: Path,
    controller: str,
    interval: str = "1s",
) -> Iterator[Prometheus]:
    """Prometheus scraping the targets ``baton up`` wrote to ``file_sd`` and the controller's
    ``/metrics`` at ``controller`` (host:port), evaluating Baton's rules, until the block ends."""
    config = {
        "global": {"scrape_interval": interval, "evaluation_interval": interval},
        "rule_files": [str(RULES)],
        "scrape_configs": [
            {
                "job_name": "baton",
                "file_sd_configs": [{"files": [str(file_sd)], "refresh_interval": interval}],
            },
            {"job_name": "baton-controller", "static_configs": [{"targets": [controller]}]},
        ],
    }
    config_file = directory / "prometheus.yml"
    config_file.write_text(yaml.safe_dump(config))
    port = free_port()
    log = directory / "prometheus.log"
    process = subprocess.Popen(
        [
            str(binaries / "prometheus"),
            f"--config.file={config_file}",
            f"--storage.tsdb.path={directory / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    prometheus = Prometheus(f"http://127.0.0.1:{port}", process, log)
    try:

        def ready() -> bool:
            if process.poll() is not None:
                raise RuntimeError(f"prometheus exited:\n{log.read_text()}")
            return httpx.get(f"{prometheus.url}/-/ready", timeout=2).status_code == 200

        eventually(ready, timeout=60)
        yield prometheus
    finally:
        prometheus.stop()


@dataclass(frozen=True)
class BatonUp:
    gateway: str
    targets: Path
    faults: FaultInjection

    def engines(self, role: str) -> list[str]:
        """The engine API servers of ``role``, as ``baton up`` listed them."""
        return [
            f"http://{target}"
            for group in json.loads(self.targets.read_text())
            if group["labels"].get("role") == role
            for target in group["targets"]
        ]


@contextlib.contextmanager
def baton_up(directory: Path) -> Iterator[BatonUp]:
    """``baton up`` in plugin mode (the engines report their EPLB windows, as with vLLM) with
    fault injection, writing its Prometheus targets; stopped when the block ends."""
    port = free_port()
    targets = directory / "targets.json"
    log = directory / "up.log"
    faults = FaultInjection(directory)
    process = subprocess.Popen(
        baton_command(
            "up",
            "--port",
            str(port),
            "--eplb-mode",
            "plugin",
            "--fault-injection-token-file",
            str(faults.token_file),
            # windows a short drill completes (vLLM's default is one per 3000 steps)
            "--eplb-steps",
            "100",
            "--prometheus-targets",
            str(targets),
        ),
        cwd=ROOT,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    try:

        def up() -> bool:
            if process.poll() is not None:
                raise RuntimeError(f"baton up exited:\n{log.read_text()}")
            return targets.exists()

        eventually(up, timeout=180, interval=0.5)
        yield BatonUp(f"http://127.0.0.1:{port}", targets, faults)
    finally:
        stop_process(process)


def _chat(gateway: str, words: int, max_tokens: int) -> int:
    """One streamed chat completion; its HTTP status."""
    body = {
        "model": SERVED_MODEL_NAME,
        "messages": [{"role": "user", "content": "balance the experts " * words}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    with httpx.stream("POST", f"{gateway}/v1/chat/completions", json=body, timeout=60) as reply:
        for _ in reply.iter_bytes():
            pass
        return reply.status_code


def drill(stack: BatonUp, *, rounds: int = 3, requests: int = 48) -> dict[int, int]:
    """Traffic through the gateway, long prompts (prefill, then decode) and short ones (decode
    alone), with a failure drill in each round: prefill answers 500 (fallback to decode alone),
    a decode server answers 503 (retry on another rank), prefilled KV is lost before decode
    pulls it, and at the end every decode server fails every attempt (the gateway's 502).
    Returns how many requests got each status."""
    prefill, decode = stack.engines("prefill"), stack.engines("decode")
    statuses: dict[int, int] = {}

    def burst() -> None:
        sizes = [(600, 48) if i % 2 else (20, 24) for i in range(requests)]
        with ThreadPoolExecutor(max_workers=8) as pool:
            for status in pool.map(lambda size: _chat(stack.gateway, *size), sizes):
                statuses[status] = statuses.get(status, 0) + 1

    for round_ in range(rounds):
        burst()
        stack.faults.inject(
            prefill[round_ % len(prefill)], action="fail_requests", count=2, status=500
        )
        stack.faults.inject(
            decode[round_ % len(decode)], action="fail_requests", count=2, status=503
        )
        stack.faults.inject(prefill[(round_ + 1) % len(prefill)], action="drop_kv", count=2)
        burst()
        time.sleep(2)  # a few scrapes between rounds: the rates have points to join
    for engine in decode:  # more failures than the gateway has attempts: every request fails
        stack.faults.inject(engine, action="fail_requests", count=4, status=500)
    for _ in range(4):
        status = _chat(stack.gateway, 600, 8)
        statuses[status] = statuses.get(status, 0) + 1
    burst()
    return statuses


# The drill's second deployment, on a rack of its own: it stays healthy while dsv4 degrades,
# so an alert must fire for dsv4 alone.
HEALTHY = "steady"


def controller_drill(api: client.ApiClient, namespace: str, model: str) -> None:
    """Deployments ``dsv4`` and :data:`HEALTHY` of ``model``, each placed on a rack's trays (two
    racks are needed) by a running controller and Ready; then a decode pod of ``dsv4`` fails on
    a tray with two failures on record: its decode group restarts, the tray is quarantined and
    ``dsv4`` turns Degraded, the other untouched; and an operator marks a tray the cell does
    not use degraded by hand (``baton_tray_degraded``)."""
    for deployment in ("dsv4", HEALTHY):
        create_model_deployment(
            api, namespace, deployment, {"model": model, "cell": {"prefill": {"instances": 2}}}
        )

    def status(name: str = "dsv4") -> dict[str, Any]:
        return read_model_deployment(api, namespace, name).get("status") or {}

    def condition(kind: str, name: str = "dsv4") -> str | None:
        return next(
            (c["status"] for c in status(name).get("conditions", []) if c["type"] == kind), None
        )

    def ready(name: str) -> bool:
        return condition("Ready", name) == "True"

    for deployment in ("dsv4", HEALTHY):
        eventually(partial(ready, deployment), timeout=60, interval=0.25)
    tray = status()["cells"][0]["decode"]["trays"][2]
    core = client.CoreV1Api(api)
    record_tray_failures(api, tray, 2)
    fail_pod(api, namespace, "dsv4-cell-0-decode-2")

    def quarantined() -> bool:
        meta = core.read_node(tray).metadata
        return "baton.dev/quarantined" in ((meta.annotations if meta else None) or {})

    eventually(lambda: quarantined() and condition("Degraded") == "True", timeout=60)
    used = {
        tray
        for cell in status()["cells"]
        for tray in (
            *cell["decode"]["trays"],
            *cell["spareTrays"],
            *(line.split(":")[1] for line in cell["prefill"]),
        )
    }
    domain = status()["cells"][0]["domain"]
    free = next(
        name
        for node in core.list_node(label_selector=f"{CLIQUE_LABEL}={domain}").items
        if (name := node.metadata.name if node.metadata else None) and name not in used
    )
    core.patch_node(
        free, {"metadata": {"annotations": {DEGRADED_ANNOTATION: "fan failing (a drill)"}}}
    )
