"""The gateway as a Ray Serve application: ``serve run router.serve:app [pool_file=PATH ...]``.

Serve replaces uvicorn and nothing else: each replica runs the FastAPI app that
:func:`router.app.create_app` builds, lifespan included (aiohttp session, pool health checks,
pool-file reloads), so the request path is the same code as ``baton gateway``'s.

:func:`build_app` (also exported as ``app``) is a Serve application builder. It runs where the
application is built (``serve run``, or the controller for a config file), reads the pool file
named by the ``pool_file`` argument or else by ``BATON_POOL_FILE``, and ships the parsed pool to the
replicas; each replica also watches that path for changes, so it must be readable there too.
With ``model_deployment=NAMESPACE/NAME`` instead (comma-separated for several), each replica
follows those ModelDeployments' status (KubeRay: the replica's service account, or
``kubeconfig=PATH``). API keys come from
``BATON_API_KEYS`` (comma-separated), never from arguments, which Serve logs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from fastapi import FastAPI
from pydantic import ValidationError
from ray import serve
from ray.serve import Application

from baton.core.files import describe_errors
from baton.core.follow import DeploymentRef
from baton.core.secrets import read_token
from router.app import create_app
from router.settings import GatewayConfig, GatewaySettings
from router.targets import load_pool_file

__all__ = ["POOL_FILE_ENV", "ServeArgs", "app", "build_app", "config_from_serve_args"]

POOL_FILE_ENV = "BATON_POOL_FILE"
API_KEYS_ENV = "BATON_API_KEYS"
DEPLOYMENT_NAME = "BatonGateway"
# Each request is a relayed stream that waits on an engine; the pool decides engine load, so Serve
# must not queue requests in front of the gateway (its default allows 5 per replica).
MAX_ONGOING_REQUESTS = 4096


class ServeArgs(GatewaySettings):
    """The application arguments (``serve run router.serve:app key=value ...``); all optional:
    the gateway's settings plus where its pool comes from."""

    pool_file: Path | None = None  # default: $BATON_POOL_FILE
    # NAMESPACE/NAME, comma-separated for several: the pools from their status instead
    model_deployment: str | None = None
    kubeconfig: Path | None = None  # with model_deployment; default: the service account
    engine_api_key_file: Path | None = None  # the engines' API key, a mounted Secret


def config_from_serve_args(args: Mapping[str, object], environ: Mapping[str, str]) -> GatewayConfig:
    """The gateway's config from Serve's application arguments and the environment."""
    try:
        parsed = ServeArgs.model_validate(dict(args))
    except ValidationError as exc:
        raise ValueError(f"router.serve:app: {describe_errors(exc, 'argument')}") from exc
    from_env = environ.get(POOL_FILE_ENV)
    pool_file = parsed.pool_file or (Path(from_env) if from_env else None)
    deployments: tuple[DeploymentRef, ...] = ()
    if parsed.model_deployment is not None:
        if parsed.pool_file is not None:
            raise ValueError("router.serve:app: pass pool_file or model_deployment, not both")
        deployments = tuple(
            DeploymentRef.parse(value.strip(), parsed.kubeconfig)
            for value in parsed.model_deployment.split(",")
        )
        pool_file = None
    elif pool_file is None:
        raise ValueError(
            f"router.serve:app: no pool; pass pool_file=PATH or model_deployment=NAMESPACE/NAME "
            f"to `serve run router.serve:app`, or set {POOL_FILE_ENV}"
        )
    keys = tuple(k.strip() for k in environ.get(API_KEYS_ENV, "").split(",") if k.strip())
    settings = GatewaySettings(**parsed.model_dump(include=set(GatewaySettings.model_fields)))
    engine_key = None
    if parsed.engine_api_key_file is not None:
        try:
            engine_key = read_token(parsed.engine_api_key_file)
        except ValueError as exc:
            raise ValueError(f"router.serve:app: engine_api_key_file {exc}") from exc
    return GatewayConfig(
        load_pool_file(pool_file) if pool_file is not None else None,
        keys,
        settings,
        pool_file=pool_file,
        model_deployments=deployments,
        engine_api_key=engine_key,
    )


def gateway_application(config: GatewayConfig) -> Application:
    """One Serve deployment whose replicas each run ``create_app(config)``."""

    def asgi_app() -> FastAPI:  # called on the replica: the app is built there, not pickled
        return create_app(config)

    ingress = serve.ingress(asgi_app)()
    # The decorator form: Ray's annotation covers it, not the one-call form it also accepts.
    as_deployment = serve.deployment(
        name=DEPLOYMENT_NAME, max_ongoing_requests=MAX_ONGOING_REQUESTS
    )
    return as_deployment(ingress).bind()


def build_app(args: dict[str, str]) -> Application:
    """Serve's application builder: ``args`` are ``serve run``'s ``key=value`` pairs."""
    return gateway_application(config_from_serve_args(args, os.environ))


app = build_app  # the import path Serve's convention expects: router.serve:app
