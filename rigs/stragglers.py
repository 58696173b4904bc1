"""A simulated DEP32 decode group whose GPUs a real Prometheus reads as dcgm-exporter's series,
under the names of trays a ModelDeployment was placed on: the straggler watch's test and
benchmark rig.

``baton sim --cluster`` runs the group (8 API servers of 4 ranks each, one exporter per server
named ``<name>-tray-<i>``, every GPU kept busy by long decodes, each followed by the next for
as long as the group runs), optionally with its EPLB agent
followed by a ``baton eplb`` service; Prometheus scrapes the exporters, the engines, the EPLB
service and a controller's ``/metrics``. ``restart`` stops the group and starts a fresh one on
the same ports: what moving a decode group does to its engines (a new incarnation on vLLM's
initial placement, and without whatever slowed the old one).
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

from rigs.devcluster import binaries_dir
from rigs.faults import FaultInjection
from rigs.observability import Prometheus, start_prometheus
from rigs.processes import (
    ProcessExited,
    baton_command,
    eventually,
    free_port_block,
    keep_decoding,
    stop_process,
    wait_healthy,
)

__all__ = ["SERVERS", "SimulatedGroup", "simulated_group"]

SERVERS = 8  # a DEP32 group in hybrid LB: one API server per tray, four ranks each
RANKS = 32


@dataclass
class SimulatedGroup:
    """The group's processes and where they answer."""

    directory: Path
    name: str
    faults: FaultInjection
    decode_port: int
    dcgm_port: int
    agent_port: int | None
    requests_per_server: int
    eplb_metrics: str | None = None  # the EPLB service's /metrics URL, where one runs
    process: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    load_started: list[float] = field(default_factory=list)  # wall time of each start's load
    _eplb: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    _prometheus: Prometheus | None = field(default=None, repr=False)
    # ends the load's requests once the group stops (they would decode for minutes each)
    _load_stop: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def prometheus(self) -> Prometheus:
        """The Prometheus scraping the group (there once ``simulated_group`` yields it)."""
        if self._prometheus is None:
            raise RuntimeError("the group's Prometheus is not running")
        return self._prometheus

    @property
    def servers(self) -> list[str]:
        return [f"http://127.0.0.1:{self.decode_port + i}" for i in range(SERVERS)]

    @property
    def trays(self) -> list[str]:
        """The exporters' ``Hostname`` labels, rank order."""
        return [f"{self.name}-tray-{i}" for i in range(SERVERS)]

    @property
    def log(self) -> Path:
        return self.directory / f"cluster-{self.restarts}.log"

    def start(self) -> None:
        """The group's engines, each server's GPUs then kept decoding."""
        self.process = subprocess.Popen(
            baton_command("sim", "--cluster", str(self.directory / "cluster.yaml")),
            stdout=self.log.open("wb"),
            stderr=subprocess.STDOUT,
        )
        for server in self.servers:
            wait_healthy(server, self.process, self.log, timeout=180)
        self._load_stop = threading.Event()
        for server in self.servers:
            keep_decoding(
                server,
                requests=self.requests_per_server,
                ranks=RANKS // SERVERS,
                until=self._load_stop,
            )
        self.load_started.append(time.time())

    def stop(self) -> None:
        self._load_stop.set()
        if self.process is not None:
            stop_process(self.process)
            self.process = None

    def restart(self) -> None:
        """A fresh group on the same ports (a moved group's engines: new incarnation, initial
        placement, no fault of the old ones)."""
        self.stop()
        self.restarts += 1
        self.start()


def _answers(url: str | None, process: subprocess.Popen[bytes], log: Path) -> bool:
    if process.poll() is not None:
        raise ProcessExited(f"baton eplb exited with {process.returncode}:\n{log.read_text()}")
    try:
        return url is not None and httpx.get(url, timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


@contextmanager
def simulated_group(
    directory: Path,
    name: str,
    *,
    controller: str,
    eplb_steps: int | None = None,
    requests_per_server: int = 8,
    dcgm_noise: str = "quiet",
    deployment: str = "",
    cell: str = "",
) -> Iterator[SimulatedGroup]:
    """The group ``name`` running, scraped by Prometheus each second with the controller's
    ``/metrics`` at ``controller`` (host:port); with ``eplb_steps``, its EPLB agent followed by
    a ``baton eplb`` service rebalancing every that many steps from as many. ``dcgm_noise``:
    the exporters' ``--dcgm-noise``. The engines' series are labelled as the chart's
    PodMonitor labels a placed group's: ``deployment`` (NAMESPACE/NAME) and ``cell``."""
    directory.mkdir(parents=True, exist_ok=True)
    group = SimulatedGroup(
        directory,
        name,
        FaultInjection(directory),
        decode_port=free_port_block(SERVERS),
        dcgm_port=free_port_block(SERVERS),
        agent_port=free_port_block(1) if eplb_steps is not None else None,
        requests_per_server=requests_per_server,
    )
    token = directory / "agent-token"
    token.write_text("straggler-rig")
    spec: dict[str, object] = {
        "name": name,
        "data_parallel_size": RANKS,
        "api_servers": SERVERS,
        "port": group.decode_port,
        "side_channel_port": free_port_block(RANKS),
        "dcgm_port": group.dcgm_port,
        "dcgm_noise": dcgm_noise,
    }
    if eplb_steps is not None:
        spec |= {
            "eplb_agent_port": group.agent_port,
            "eplb_agent_token_file": str(token),
            "eplb": {"num_redundant_experts": 32},
        }
    cluster = {
        "served_model_name": "dsv4",
        "fault_injection_token_file": str(group.faults.token_file),
        "decode_groups": [spec],
    }
    (directory / "cluster.yaml").write_text(yaml.safe_dump(cluster))
    targets: list[dict[str, object]] = [
        {
            "targets": [f"127.0.0.1:{group.dcgm_port + i}" for i in range(SERVERS)],
            "labels": {"job": "dcgm-exporter"},
        },
        {
            "targets": [s.removeprefix("http://") for s in group.servers],
            "labels": {
                "job": "baton-engines",
                "role": "decode",
                "modeldeployment": deployment,
                "cell": cell,
            },
        },
    ]
    with ExitStack() as stack:
        stack.callback(group.stop)
        group.start()
        if eplb_steps is not None:
            metrics = free_port_block(1)
            config = {
                "window_size": eplb_steps,
                "step_interval": eplb_steps,
                # the service names a placed group by its cell, as when it follows a deployment
                "groups": [{"name": cell or name, "agents": [f"127.0.0.1:{group.agent_port}"]}],
            }
            (directory / "eplb.yaml").write_text(yaml.safe_dump(config))
            eplb_log = directory / "eplb.log"
            group._eplb = subprocess.Popen(
                baton_command(
                    "eplb",
                    "--config",
                    str(directory / "eplb.yaml"),
                    "--metrics-port",
                    str(metrics),
                    "--token-file",
                    str(token),
                ),
                stdout=eplb_log.open("wb"),
                stderr=subprocess.STDOUT,
            )
            eplb_process = group._eplb
            stack.callback(lambda: stop_process(eplb_process))
            group.eplb_metrics = f"http://127.0.0.1:{metrics}/metrics"
            eventually(lambda: _answers(group.eplb_metrics, eplb_process, eplb_log), timeout=60)
            targets.append({"targets": [f"127.0.0.1:{metrics}"], "labels": {"job": "baton-eplb"}})
        file_sd = directory / "targets.json"
        file_sd.write_text(json.dumps(targets))
        group._prometheus = stack.enter_context(
            start_prometheus(binaries_dir(), directory, file_sd=file_sd, controller=controller)
        )
        yield group
