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

from prometheus_client import CollectorRegistry, start_http_server

from baton.core.follow import DeploymentRef
from baton.core.secrets import read_token
from eplb.config import EplbServiceConfig, GroupSource, StaticGroups, load_config
from eplb.discovery import ModelDeploymentGroups, publish_status
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
        "--token-file", default=None, help="bearer token the agents expect (a mounted Secret)"
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
) -> None:
    loop = asyncio.get_running_loop()
    source: GroupSource = StaticGroups(config.groups)
    follower = None
    if deployment is not None:
        follower = ModelDeploymentGroups(deployment, loop)
        follower.start()
        source = follower
    service = EplbService(config, source, metrics, token=token, tls_ca=tls_ca)
    task = asyncio.create_task(service.run())
    publisher = None
    if deployment is not None:
        publisher = asyncio.create_task(publish_status(service, deployment))
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, task.cancel)
    try:
        await task
    except asyncio.CancelledError:
        log.info("baton eplb stopping")
    finally:
        if publisher is not None:
            publisher.cancel()
        if follower is not None:
            follower.stop()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
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
        elif not config.groups:
            raise ValueError(
                f"{args.config}: field 'groups': list the decode groups and their agents, "
                "or pass --model-deployment NAMESPACE/NAME"
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
    asyncio.run(_serve(config, metrics, deployment, token, tls_ca))
    return 0
