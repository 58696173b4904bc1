"""A real Kubernetes control plane on loopback for the operator's tests.

etcd, kube-apiserver, kube-scheduler and kube-controller-manager (built from Go modules by
``deploy/dev/build.sh``) and kwok, which plays the kubelet of every node labelled as a fake tray:
heartbeats, and pods bound to it reported Running with an IP. Everything lives in a temporary
directory and stops with :meth:`ControlPlane.stop`.
"""

from __future__ import annotations

import os
import ssl
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml

from baton.processes import free_port, stop_process

__all__ = ["ControlPlane", "binaries_dir", "start_control_plane"]

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "baton-test-admin-token"
KWOK_ANNOTATION = "kwok.x-k8s.io/node"


def binaries_dir() -> Path:
    """Where deploy/dev/build.sh put the binaries (building them when absent)."""
    override = os.environ.get("BATON_DEV_BIN")
    if override:
        return Path(override)
    built = subprocess.run(
        [str(ROOT / "deploy/dev/build.sh")], check=True, capture_output=True, text=True
    )
    return Path(built.stdout.strip().splitlines()[-1])


@dataclass
class ControlPlane:
    directory: Path
    server: str
    kubeconfig: Path
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)

    def log(self, name: str) -> str:
        return (self.directory / f"{name}.log").read_text()

    def stop(self) -> None:
        for process in reversed(list(self.processes.values())):
            stop_process(process)


def _spawn(plane: ControlPlane, name: str, command: list[str]) -> None:
    log = (plane.directory / f"{name}.log").open("wb")
    plane.processes[name] = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, cwd=plane.directory
    )


def _alive(plane: ControlPlane) -> None:
    for name, process in plane.processes.items():
        if process.poll() is not None:
            raise RuntimeError(
                f"{name} exited with {process.returncode}:\n{plane.log(name)[-3000:]}"
            )


def _wait(plane: ControlPlane, check: Callable[[], bool], timeout: float) -> None:
    """Until ``check`` passes; fails at once with its log if a component exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _alive(plane)
        try:
            if check():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the control plane was not ready within {timeout} s")


def _write_kubeconfig(plane: ControlPlane) -> None:
    # The API server writes a self-signed serving certificate into --cert-dir; trust it.
    ca = plane.directory / "certs" / "apiserver.crt"
    plane.kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {
                        "name": "test",
                        "cluster": {"server": plane.server, "certificate-authority": str(ca)},
                    }
                ],
                "users": [{"name": "admin", "user": {"token": TOKEN}}],
                "contexts": [{"name": "test", "context": {"cluster": "test", "user": "admin"}}],
                "current-context": "test",
            }
        )
    )


def start_control_plane(directory: Path, bin_dir: Path) -> ControlPlane:
    directory.mkdir(parents=True, exist_ok=True)
    etcd_port, etcd_peer, api_port = free_port(), free_port(), free_port()
    plane = ControlPlane(directory, f"https://127.0.0.1:{api_port}", directory / "kubeconfig")
    key = directory / "sa.key"
    subprocess.run(["openssl", "genrsa", "-out", str(key), "2048"], check=True, capture_output=True)
    subprocess.run(
        ["openssl", "rsa", "-in", str(key), "-pubout", "-out", str(directory / "sa.pub")],
        check=True,
        capture_output=True,
    )
    (directory / "tokens.csv").write_text(f"{TOKEN},admin,admin,system:masters\n")
    try:
        _spawn(
            plane,
            "etcd",
            [
                str(bin_dir / "etcd"),
                "--data-dir",
                str(directory / "etcd"),
                "--listen-client-urls",
                f"http://127.0.0.1:{etcd_port}",
                "--listen-peer-urls",
                f"http://127.0.0.1:{etcd_peer}",
            ],
        )
        _spawn(
            plane,
            "kube-apiserver",
            [
                str(bin_dir / "kube-apiserver"),
                f"--etcd-servers=http://127.0.0.1:{etcd_port}",
                "--bind-address=127.0.0.1",
                f"--secure-port={api_port}",
                f"--cert-dir={directory / 'certs'}",
                f"--token-auth-file={directory / 'tokens.csv'}",
                "--authorization-mode=RBAC",
                f"--service-account-key-file={directory / 'sa.pub'}",
                f"--service-account-signing-key-file={key}",
                "--service-account-issuer=https://kubernetes.default.svc",
                "--service-cluster-ip-range=10.96.0.0/16",
                "--allow-privileged=true",
                # the kubernetes Service needs no endpoints here (and cannot use loopback ones)
                "--endpoint-reconciler-type=none",
            ],
        )
        ca = directory / "certs" / "apiserver.crt"

        def api_ready() -> bool:
            if not ca.exists():
                return False
            response = httpx.get(
                f"{plane.server}/readyz",
                verify=ssl.create_default_context(cafile=str(ca)),
                timeout=2,
                headers={"Authorization": f"Bearer {TOKEN}"},
            )
            return response.status_code == 200

        _wait(plane, api_ready, 120)
        _write_kubeconfig(plane)
        common = [f"--kubeconfig={plane.kubeconfig}", "--leader-elect=false"]
        _spawn(
            plane, "kube-scheduler", [str(bin_dir / "kube-scheduler"), *common, "--secure-port=0"]
        )
        _spawn(
            plane,
            "kube-controller-manager",
            [
                str(bin_dir / "kube-controller-manager"),
                *common,
                "--secure-port=0",
                f"--service-account-private-key-file={key}",
                "--use-service-account-credentials=false",
            ],
        )
        _spawn(
            plane,
            "kwok",
            [
                str(bin_dir / "kwok"),
                f"--kubeconfig={plane.kubeconfig}",
                "--manage-all-nodes=false",
                f"--manage-nodes-with-annotation-selector={KWOK_ANNOTATION}=fake",
                f"--server-address=127.0.0.1:{free_port()}",
                *(
                    f"--config={stage}"
                    for stage in sorted((bin_dir / "kwok-stages").glob("*.yaml"))
                ),
            ],
        )
        _alive(plane)
    except BaseException:
        plane.stop()
        raise
    return plane
