"""``baton eplb``: run the EPLB service for the decode groups of a configuration file."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from prometheus_client import CollectorRegistry, start_http_server

from baton.secrets import read_token
from controller.eplb.config import EplbServiceConfig, StaticGroups, load_config
from controller.eplb.metrics import EplbMetrics
from controller.eplb.service import EplbService

__all__ = ["main"]

log = logging.getLogger("baton.eplb")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="baton eplb",
        description="Expert-load windows, minimal-move rebalance decisions and two-phase "
        "placement switches for every decode group (docs/eplb.md).",
    )
    parser.add_argument("--config", required=True, help="YAML: groups, agents, cadence")
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


async def _serve(service: EplbService) -> None:
    task = asyncio.create_task(service.run())
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, task.cancel)
    try:
        await task
    except asyncio.CancelledError:
        log.info("baton eplb stopping")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        config: EplbServiceConfig = load_config(args.config)
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
    service = EplbService(config, StaticGroups(config.groups), metrics, token=token, tls_ca=tls_ca)
    asyncio.run(_serve(service))
    return 0
