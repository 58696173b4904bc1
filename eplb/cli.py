"""``baton eplb``: run the EPLB service for the decode groups of a configuration file."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

import uvicorn
from prometheus_client import CollectorRegistry, start_http_server

from baton.core.follow import DeploymentRef
from baton.core.secrets import read_token
from eplb.config import EplbServiceConfig, GroupSource, StaticGroups, load_config
from eplb.discovery import ModelDeploymentGroups, publish_status
from eplb.engine_reports import EngineReports, create_report_app
from eplb.heap import bound_heap_growth
from eplb.metrics import EplbMetrics
from eplb.service import EplbService

__all__ = ["main"]

log = logging.getLogger("baton.eplb")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="baton eplb",
        description="Expert-load windows, minimal-move rebalance decisions and two-phase "
        "placement switches for every decode group (docs/eplb.md).",
    )
    parser.add_argument("--config", required=True, help="YAML: groups, agents, cadence")
    parser.add_argument(
        "--model-deployment",
        metavar="NAMESPACE/NAME",
        help="take the decode groups from this ModelDeployment's status (watched) and write "
        "the measured balance back into it; the config then lists no groups",
    )
    parser.add_argument(
        "--kubeconfig",
        type=Path,
        default=os.environ.get("KUBECONFIG"),
        help="with --model-deployment (default: $KUBECONFIG, else the service account)",
    )
    parser.add_argument("--metrics-port", type=int, default=None, help="serve /metrics here")
    parser.add_argument(
        "--metrics-host", default="127.0.0.1", help="address of /metrics (default 127.0.0.1)"
    )
    parser.add_argument(
        "--report-port",
        type=int,
        default=None,
        help="take the windows vLLM engines rebalanced with Baton's plugin here (POST "
        "/v1/windows); the agents are then not needed",
    )
    parser.add_argument("--report-host", default="127.0.0.1", help="address of the report endpoint")
    parser.add_argument(
        "--token-file",
        default=None,
        help="bearer token the agents expect and the engines' reports carry (a mounted Secret)",
    )
    parser.add_argument("--tls-ca", default=None, help="PEM CA bundle: talk TLS to the agents")
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    return parser


async def _serve(
    config: EplbServiceConfig,
    metrics: EplbMetrics,
    deployment: DeploymentRef | None,
    token: str | None,
    tls_ca: bytes | None,
    report_address: tuple[str, int] | None,
) -> None:
    loop = asyncio.get_running_loop()
    reports = EngineReports(metrics, config.model_names, config.expert_bytes_of, deployment)
    source: GroupSource = StaticGroups(config.groups)
    follower = None
    if deployment is not None:
        follower = ModelDeploymentGroups(deployment, loop, reports)
        reports.model_names = follower.model_names
        follower.start()
        source = follower
    service = EplbService(config, source, metrics, token=token, tls_ca=tls_ca)
    tasks = [asyncio.create_task(service.run())]
    if deployment is not None:
        tasks.append(asyncio.create_task(publish_status(service, reports, deployment)))
    if report_address is not None:
        host, port = report_address
        server = uvicorn.Server(
            uvicorn.Config(
                create_report_app(reports, token),
                host=host,
                port=port,
                loop="none",
                log_level="warning",
                lifespan="off",
            )
        )
        # uvicorn takes SIGINT/SIGTERM while it serves and stops; everything stops with it
        tasks.append(asyncio.create_task(server.serve()))
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, tasks[0].cancel)
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        log.info("baton eplb stopping")
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if follower is not None:
            follower.stop()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    bound_heap_growth()
    try:
        config: EplbServiceConfig = load_config(args.config)
        deployment = None
        if args.model_deployment is not None:
            if config.groups:
                raise ValueError(
                    f"{args.config}: field 'groups': leave it out with --model-deployment "
                    "(the groups come from the ModelDeployment's status)"
                )
            deployment = DeploymentRef.parse(args.model_deployment, args.kubeconfig)
        elif not config.groups and args.report_port is None:
            raise ValueError(
                f"{args.config}: field 'groups': list the decode groups and their agents, "
                "pass --model-deployment NAMESPACE/NAME, or take the engines' reports with "
                "--report-port"
            )
        token = read_token(args.token_file) if args.token_file else None
        tls_ca = Path(args.tls_ca).read_bytes() if args.tls_ca else None
    except ValueError as exc:
        print(f"baton eplb: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"baton eplb: error: --tls-ca {args.tls_ca}: {exc.strerror}", file=sys.stderr)
        return 2
    registry = CollectorRegistry()
    metrics = EplbMetrics(registry, per_layer=config.per_layer_metrics)
    if args.metrics_port is not None:
        start_http_server(args.metrics_port, addr=args.metrics_host, registry=registry)
    report_address = None if args.report_port is None else (args.report_host, args.report_port)
    asyncio.run(_serve(config, metrics, deployment, token, tls_ca, report_address))
    return 0
