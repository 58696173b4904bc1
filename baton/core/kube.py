"""Reaching the API server, and the kubernetes client's JSON answers, typed (its signatures say
``object`` for them).

A call made with ``_preload_content=False`` hands back urllib3's response unread, so the JSON
is parsed once here and never turned into model objects; the CustomObjectsApi calls answer the
object already parsed, as a dict.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from kubernetes import client, config
from urllib3 import BaseHTTPResponse

__all__ = ["Json", "api_client", "json_object", "raw_json"]

Json = dict[str, Any]


def json_object(answer: object) -> Json:
    """A CustomObjectsApi answer (or a parsed body): a JSON object, TypeError if not."""
    if not isinstance(answer, dict):
        raise TypeError(f"expected a JSON object from the API, got {type(answer).__name__}")
    return answer


def raw_json(response: object) -> Json:
    """The JSON object in the body of a call made with ``_preload_content=False``."""
    if not isinstance(response, BaseHTTPResponse):
        raise TypeError(
            f"expected urllib3's response (_preload_content=False), got {type(response).__name__}"
        )
    return json_object(json.loads(response.data))


def api_client(kubeconfig: str | Path | None = None) -> client.ApiClient:
    """A client for the API server, found as controller-runtime and kubectl find it: the
    ``--kubeconfig`` flag, else ``$KUBECONFIG``, else the pod's service account."""
    path = kubeconfig or os.environ.get("KUBECONFIG")
    if path:
        api: client.ApiClient = config.new_client_from_config(config_file=str(path))
        return api
    config.load_incluster_config()
    return client.ApiClient()
