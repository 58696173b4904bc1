"""``baton controller``: the operator (docs/operator.md)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
from collections.abc import Sequence

from kubernetes.config.config_exception import ConfigException
from prometheus_client import CollectorRegistry, start_http_server

from baton.core.kube import api_client
from baton.core.profile import DEFAULT_PROFILE, ProfileError, load_profile, shipped_profiles
from controller.reconciler import Controller

__all__ = ["main"]

log = logging.getLogger("baton.controller")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="baton controller",
        description="Place ModelDeployment cells on NVL72 trays and keep them there.",
    )
    parser.add_argument(
        "--kubeconfig",
        default=os.environ.get("KUBECONFIG"),
        help="kubeconfig file (default: $KUBECONFIG, else the in-cluster service account)",
    )
    parser.add_argument(
        "--lease-namespace",
        default=os.environ.get("POD_NAMESPACE"),
        help="namespace of the leader-election Lease (default: $POD_NAMESPACE, the pod's own; "
        "required outside a pod: the same as the chart's release namespace, so that a "
        "controller run from a shell and the chart's share one leader)",
    )
    parser.add_argument("--lease-name", default="baton-controller")
    parser.add_argument(
        "--identity",
        default=os.environ.get("POD_NAME") or f"{socket.gethostname()}-{os.getpid()}",
        help="this replica's name in the Lease (default: $POD_NAME, else host-pid)",
    )
    parser.add_argument("--metrics-port", type=int, default=None, help="serve /metrics here")
    parser.add_argument("--metrics-host", default="0.0.0.0", help="address of /metrics")
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    parser.add_argument(
        "--prometheus-url",
        default=None,
        help="a Prometheus that scrapes dcgm-exporter on the trays: the straggler watch marks "
        "trays whose GPU holds back its decode group (default: no watch)",
    )
    parser.add_argument(
        "--straggler-window-seconds",
        type=int,
        default=60,
        help="each GPU's SM clock is judged by its median over windows this long",
    )
    parser.add_argument(
        "--straggler-windows",
        type=int,
        default=3,
        help="windows in a row a GPU (or a group's step) must be slow before the watch acts",
    )
    parser.add_argument(
        "--straggler-step-slowdown",
        type=float,
        default=1.25,
        help="a decode group whose steps take this many times what the performance model "
        "predicts for its batch is reported slow (default 1.25: the model's own error on real "
        "engines is up to 15%%)",
    )
    parser.add_argument(
        "--performance-profile",
        default=None,
        help="the performance model's constants for the engines' model and GPU, a shipped "
        f"profile's name ({', '.join(shipped_profiles())}) or a YAML file (default: "
        f"{DEFAULT_PROFILE.removesuffix('.yaml')}, the study's calibration)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.straggler_window_seconds < 1 or args.straggler_windows < 1:
        parser.error(
            "--straggler-window-seconds and --straggler-windows must be at least 1 "
            f"(got {args.straggler_window_seconds} and {args.straggler_windows})"
        )
    if args.straggler_step_slowdown <= 1.0:
        parser.error(
            f"--straggler-step-slowdown must be above 1 (got {args.straggler_step_slowdown}): "
            "it is how many times the predicted step a slow group's steps take"
        )
    try:
        profile = load_profile(args.performance_profile)
    except ProfileError as exc:
        parser.error(f"--performance-profile: {exc}")
    if args.lease_namespace is None:
        # No guess (controller-runtime refuses one too): two controllers leasing in different
        # namespaces would both lead.
        parser.error(
            "--lease-namespace is required outside a pod: pass the namespace the chart's "
            "controllers lease in (their release namespace, e.g. --lease-namespace baton-system)"
        )
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        api = api_client(args.kubeconfig)
    except (ConfigException, OSError) as exc:
        where = args.kubeconfig or "the in-cluster service account"
        print(
            f"baton controller: error: cannot load {where}: {exc}; "
            "fix: pass --kubeconfig FILE or run in a pod",
            file=sys.stderr,
        )
        return 2
    registry = CollectorRegistry()
    if args.metrics_port is not None:
        start_http_server(args.metrics_port, addr=args.metrics_host, registry=registry)
    controller = Controller(
        api,
        lease_namespace=args.lease_namespace,
        lease_name=args.lease_name,
        identity=args.identity,
        registry=registry,
        prometheus_url=args.prometheus_url,
        straggler_window_s=args.straggler_window_seconds,
        straggler_windows=args.straggler_windows,
        straggler_step_slowdown=args.straggler_step_slowdown,
        performance_profile=profile,
    )
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: controller.stopped.set())
    controller.start()
    log.info("baton controller %s started; waiting for the lease", args.identity)
    controller.stopped.wait()
    controller.stop()
    log.info("baton controller %s stopped", args.identity)
    return 0
