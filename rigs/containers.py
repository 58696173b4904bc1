"""A pod's container as a podman container: the dev cluster's kubelet runs a container whose
image is in the machine's podman storage (``make image`` builds Baton's under the chart's own
reference) this way, with what the pod spec says, as a kubelet would:

- the container's ``command`` (the entrypoint) and ``args``, its environment (values, Secret
  and ConfigMap keys, downward API fields), its volume mounts (read-only where the mount says);
- its security context, the container's over the pod's: the user and group (the image's own
  user where neither names one, refused under ``runAsNonRoot`` when that is root or not
  numeric), ``fsGroup`` as a supplementary group, a read-only root file system, dropped and
  added capabilities, ``allowPrivilegeEscalation: false`` as no-new-privileges;
- the service account's token, CA and namespace at the path the Kubernetes client reads in a
  pod, with ``KUBERNETES_SERVICE_HOST`` and ``_PORT`` naming the API server.

The network is the host's, so that the pod's loopback IP (see rigs/kubelet.py) is the pod's
address: what would bind every interface binds the pod IP instead, and the pods' hosts file is
the container's ``/etc/hosts``. Podman runs with deploy/image/containers.conf (runc, cgroupfs,
limits a VM allows).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

__all__ = [
    "CONTAINERS_CONF",
    "SERVICE_ACCOUNT_MOUNT",
    "ContainerRefused",
    "bound_to",
    "container_name",
    "image_present",
    "image_user",
    "podman_argv",
    "podman_env",
    "remove",
    "run_as",
]

CONTAINERS_CONF = Path(__file__).resolve().parents[1] / "deploy" / "image" / "containers.conf"
PODMAN = "podman"
SERVICE_ACCOUNT_MOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
ANY_ADDRESS = "0.0.0.0"


class ContainerRefused(ValueError):
    """The pod's security context or spec cannot be honoured; the message says why."""


def podman_env() -> dict[str, str]:
    """The environment podman runs in: the machine's, with Baton's containers.conf."""
    return {**os.environ, "CONTAINERS_CONF": str(CONTAINERS_CONF)}


@cache
def image_present(image: str) -> bool:
    """Whether ``image`` is in this machine's podman storage (no podman: never)."""
    if shutil.which(PODMAN) is None or not CONTAINERS_CONF.exists():
        return False
    found = subprocess.run(
        [PODMAN, "image", "exists", image], env=podman_env(), capture_output=True, timeout=60
    )
    return found.returncode == 0


@cache
def image_user(image: str) -> str:
    """The user ``image`` runs as (its USER; empty: root)."""
    shown = subprocess.run(
        [PODMAN, "image", "inspect", "--format", "{{.Config.User}}", image],
        env=podman_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return shown.stdout.strip()


def container_name(pod: Mapping[str, Any], container: str) -> str:
    """Podman's name for ``container`` of ``pod`` (the kubelet's dockershim pattern)."""
    meta = pod["metadata"]
    return f"k8s_{container}_{meta['name']}_{meta['namespace']}_{meta['uid'][:8]}"


def run_as(pod: Mapping[str, Any], container: Mapping[str, Any], image_user: str) -> str:
    """``uid[:gid]`` the container runs as; refused as a kubelet refuses it under runAsNonRoot."""
    pod_context = pod["spec"].get("securityContext") or {}
    own = container.get("securityContext") or {}
    uid = own.get("runAsUser", pod_context.get("runAsUser"))
    gid = own.get("runAsGroup", pod_context.get("runAsGroup"))
    user = image_user if uid is None else str(uid)
    if gid is not None:
        user = f"{user.partition(':')[0]}:{gid}"
    if own.get("runAsNonRoot", pod_context.get("runAsNonRoot")):
        name = user.partition(":")[0]
        if not name.isdigit():
            raise ContainerRefused(
                f"runAsNonRoot and the image's user {name or 'root'!r} is not numeric"
            )
        if int(name) == 0:
            raise ContainerRefused("runAsNonRoot and the container would run as root (uid 0)")
    return user


def _security_flags(pod: Mapping[str, Any], container: Mapping[str, Any]) -> list[str]:
    own = container.get("securityContext") or {}
    flags: list[str] = []
    fs_group = (pod["spec"].get("securityContext") or {}).get("fsGroup")
    if fs_group is not None:
        flags += ["--group-add", str(fs_group)]
    if own.get("readOnlyRootFilesystem"):
        # podman's --read-only would mount tmpfs on /tmp, /run and /var/tmp; Kubernetes does not
        flags += ["--read-only", "--read-only-tmpfs=false"]
    if own.get("allowPrivilegeEscalation") is False:
        flags += ["--security-opt", "no-new-privileges"]
    if own.get("privileged"):
        flags.append("--privileged")
    capabilities = own.get("capabilities") or {}
    flags += [f"--cap-drop={c.lower()}" for c in capabilities.get("drop", [])]
    flags += [f"--cap-add={c.lower()}" for c in capabilities.get("add", [])]
    return flags


def bound_to(arg: str, ip: str) -> str:
    """``arg`` with every-interface made the pod's own address."""
    if arg == ANY_ADDRESS:
        return ip
    flag, equals, value = arg.partition("=")
    return f"{flag}={ip}" if equals and value == ANY_ADDRESS else arg


def podman_argv(
    pod: Mapping[str, Any],
    container: Mapping[str, Any],
    *,
    image_user: str,
    env: Mapping[str, str],
    mounts: Sequence[tuple[Path, str, bool]],
    hosts: Path,
    service_account: Path | None,
    server: str,
) -> list[str]:
    """``podman run`` for ``container`` of ``pod``: ``image_user`` is its image's user, ``env``
    its resolved environment, ``mounts`` (directory here, path in the container, read-only)
    its volumes, ``hosts`` the pods' hosts file, ``service_account`` a directory holding the
    pod's token, CA and namespace (None: no token mounted), ``server`` the API server's URL."""
    image = container["image"]
    ip = pod["status"]["podIP"]
    name = container_name(pod, container["name"])
    argv = [
        PODMAN,
        "run",
        "--rm",
        "--replace",
        "--pull=never",
        f"--name={name}",
        "--network=host",
        "--uts=private",
        f"--hostname={pod['metadata']['name']}",
        "--no-hosts",
        f"--volume={hosts}:/etc/hosts:ro",
        f"--user={run_as(pod, container, image_user)}",
        *_security_flags(pod, container),
    ]
    variables = dict(env)
    if service_account is not None:
        address = urlsplit(server)
        variables["KUBERNETES_SERVICE_HOST"] = address.hostname or ""
        variables["KUBERNETES_SERVICE_PORT"] = str(address.port or 443)
        argv.append(f"--volume={service_account}:{SERVICE_ACCOUNT_MOUNT}:ro")
    for directory, path, read_only in mounts:
        argv.append(f"--volume={directory}:{path}{':ro' if read_only else ''}")
    argv += [f"--env={key}={value}" for key, value in variables.items()]
    command = container.get("command") or []
    if command:
        argv.append(f"--entrypoint={json.dumps(list(command))}")
    argv.append(image)
    argv += [bound_to(str(arg), ip) for arg in container.get("args") or []]
    return argv


def remove(names: Sequence[str]) -> None:
    """Remove containers by name, running or not (a ``podman run`` killed leaves its own)."""
    if names:
        subprocess.run(
            [PODMAN, "rm", "--force", "--ignore", "--time=0", *names],
            env=podman_env(),
            capture_output=True,
            timeout=120,
        )
