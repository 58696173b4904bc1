"""``baton gateway``: the OpenAI-compatible gateway on uvicorn (uvloop, httptools).

Targets come from ``--prefill``/``--decode`` flags (one cell, "default"), a ``--pool`` file, or
the status of ModelDeployments (``--model-deployment NAMESPACE/NAME``, repeated for several,
each watched and routed to by the model it serves).
API keys come from ``--api-key`` (repeatable), ``BATON_API_KEYS`` (comma-separated) and
``--api-key-file`` (one per line); they are never logged. The engines' own key (vLLM's
``--api-key``) comes from ``--engine-api-key-file``, a mounted Secret, and goes with every call
to an engine.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import uvicorn

from baton.core.follow import DeploymentRef
from baton.core.secrets import read_token
from router.app import create_gateway
from router.settings import GatewayConfig, GatewaySettings
from router.targets import PoolCell, PoolSpec, load_pool_file, parse_decode_flag
from router.workers import LOG_FORMAT, serve_workers, tune_gc, uvicorn_options

__all__ = ["config_from_args", "main"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="baton gateway", description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        metavar="N",
        help="gateway processes serving the port, a core each (default: 1; docs/gateway.md)",
    )
    parser.add_argument(
        "--prefill",
        action="append",
        default=[],
        metavar="URL",
        help="a prefill engine (repeat for more)",
    )
    parser.add_argument(
        "--decode",
        action="append",
        default=[],
        metavar="URL[@RANKS]",
        help="a decode API server; @0-3 or @0,1,2,3 names its DP ranks "
        "(local indices under hybrid LB), routed by X-data-parallel-rank",
    )
    parser.add_argument("--pool", type=Path, help="YAML pool file (cells); reloaded on change")
    parser.add_argument(
        "--model-deployment",
        action="append",
        default=[],
        metavar="NAMESPACE/NAME",
        help="route to the endpoints this ModelDeployment's status publishes (watched); "
        "repeat for several, each request going to the one serving its model",
    )
    parser.add_argument(
        "--kubeconfig",
        type=Path,
        default=os.environ.get("KUBECONFIG"),
        help="with --model-deployment (default: $KUBECONFIG, else the service account)",
    )
    parser.add_argument("--api-key", action="append", default=[], metavar="KEY")
    parser.add_argument("--api-key-file", type=Path, metavar="FILE")
    parser.add_argument(
        "--engine-api-key-file",
        type=Path,
        metavar="FILE",
        help="the engines' API key (vLLM's --api-key), sent on every engine call",
    )
    GatewaySettings.add_flags(parser)
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"]
    )
    return parser


def _api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    if any(not key.strip() for key in args.api_key):
        # `--api-key "$KEY"` with KEY unset would otherwise turn authentication off unnoticed.
        raise ValueError(
            "--api-key is empty (an unset variable?): give the key, or leave the flag out "
            "to serve without authentication"
        )
    keys = list(args.api_key)
    keys += [k.strip() for k in os.environ.get("BATON_API_KEYS", "").split(",") if k.strip()]
    if args.api_key_file is not None:
        try:
            lines = args.api_key_file.read_text().splitlines()
        except OSError as exc:
            raise ValueError(
                f"--api-key-file {args.api_key_file}: cannot read it ({exc.strerror})"
            ) from exc
        keys += [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    return tuple(keys)


def _engine_api_key(path: Path | None) -> str | None:
    if path is None:
        return None
    try:
        return read_token(path)
    except ValueError as exc:
        raise ValueError(f"--engine-api-key-file {exc}") from exc


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    sources = [args.pool is not None, bool(args.decode), bool(args.model_deployment)]
    if sum(sources) > 1:
        raise ValueError(
            "give one source of engines: --pool FILE, --prefill/--decode URLs or "
            "--model-deployment NAMESPACE/NAME"
        )
    deployments = tuple(DeploymentRef.parse(v, args.kubeconfig) for v in args.model_deployment)
    pool: PoolSpec | None = None
    if deployments:
        _distinct(deployments)
    elif args.pool is not None:
        pool = load_pool_file(args.pool)
    elif args.decode:
        decode = tuple(parse_decode_flag(value) for value in args.decode)
        pool = PoolSpec(
            cells=(PoolCell(name="default", prefill=tuple(args.prefill), decode=decode),)
        )
    else:
        raise ValueError(
            "--decode: at least one decode engine is required "
            "(or --pool FILE, or --model-deployment NAMESPACE/NAME)"
        )
    return GatewayConfig(
        pool,
        _api_keys(args),
        GatewaySettings.from_flags(args),
        pool_file=args.pool,
        model_deployments=deployments,
        engine_api_key=_engine_api_key(args.engine_api_key_file),
    )


def _distinct(deployments: Sequence[DeploymentRef]) -> None:
    keys = [ref.key for ref in deployments]
    twice = sorted({key for key in keys if keys.count(key) > 1})
    if twice:
        raise ValueError(f"--model-deployment {', '.join(twice)} given twice: give each once")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format=LOG_FORMAT)
    try:
        if args.workers < 1:
            raise ValueError(f"--workers: at least 1 (got {args.workers})")
        config = config_from_args(args)
    except ValueError as exc:
        print(f"baton gateway: error: {exc}", file=sys.stderr)
        return 2
    if args.workers > 1:
        return serve_workers(config, args.host, args.port, args.workers, args.log_level)
    tune_gc()
    uvicorn.run(
        create_gateway(config), host=args.host, port=args.port, **uvicorn_options(config.settings)
    )
    return 0
