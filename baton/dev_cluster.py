"""``baton dev-cluster``: the loopback Kubernetes control plane of the tests, for a user's hands.

etcd, kube-apiserver, kube-scheduler, kube-controller-manager and kwok (``rigs/devcluster.py``,
built by ``make dev-bin``) run detached from the command, so they outlive it, in one directory
(``--dir``, default ``~/.cache/baton/dev-cluster``) that holds their data, logs, the kubeconfig
and ``state.json``: the API server's URL, the kubeconfig's path, the racks and CPU nodes created
and every process's pid. The other subcommands read that file. Beside them a kubelet for
processes (``rigs/kubelet.py``) runs each pod kwok reports Running as a local process at its pod
IP: the chart's controller, gateway and EPLB service as the chart writes them, engine pods as
``baton sim`` with their vLLM flags; ``kubectl logs`` and ``kubectl port-forward`` reach them.

- ``start [--racks N] [--cpu-nodes N] [--images]``: a fresh control plane with N racks of 18
  fake GB300 trays and N CPU nodes; prints the kubeconfig and ``export`` lines. No Baton CRD: as
  on a real cluster, ``helm install`` brings it (and owns it). With ``--images``, a container
  whose image podman holds (Baton's, from ``make image``) runs in a podman container of it
  (``rigs/containers.py``), as the pod spec says.
- ``kubeconfig``: the kubeconfig's path.
- ``add-racks N``: N more racks of trays.
- ``tray NAME --not-ready | --ready``: kwok stops playing the tray's kubelet and its Ready
  condition goes False; or kwok plays it again and it is Ready again.
- ``status``: the processes and nodes.
- ``stop``: stops every process (doing nothing when none runs).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from pydantic import BaseModel, ConfigDict, Field

from baton.core.api import BATON_IMAGE
from baton.core.files import load_yaml_model
from baton.core.labels import CLIQUE_LABEL
from rigs.containers import image_present
from rigs.devcluster import (
    add_cpu_nodes,
    add_trays,
    binaries_dir,
    mark_tray_not_ready,
    mark_tray_ready,
    node_ready,
    start_control_plane,
)
from rigs.processes import process_running, stop_pid

__all__ = ["DevClusterState", "main"]

PROG = "baton dev-cluster"
STATE_FILE = "state.json"
DEFAULT_DIR = Path.home() / ".cache" / "baton" / "dev-cluster"


class ClusterProcess(BaseModel):
    model_config = ConfigDict(extra="forbid")

    pid: int
    # What /proc/<pid>/cmdline must start with: a reused pid is never signalled.
    executable: str


class DevClusterState(BaseModel):
    """``state.json``: written by ``start``, read by every other subcommand."""

    model_config = ConfigDict(extra="forbid")

    server: str = ""
    kubeconfig: str = ""
    binaries: str = ""
    racks: int = Field(0, ge=0)
    cpu_nodes: int = Field(0, ge=0)
    # In start order; an empty map is a stopped cluster.
    processes: dict[str, ClusterProcess] = Field(default_factory=dict)


class DevClusterError(Exception):
    """What went wrong, naming the file or flag and the fix; printed as the command's error."""


def _state_path(directory: Path) -> Path:
    return directory / STATE_FILE


def _read_state(directory: Path) -> DevClusterState | None:
    path = _state_path(directory)
    if not path.exists():
        return None
    try:
        return load_yaml_model(
            path,
            DevClusterState,
            kind="dev cluster state",
            fix=f"`{PROG} start` writes it; stop what it lists by hand and start again",
        )
    except ValueError as exc:
        raise DevClusterError(str(exc)) from exc


def _write_state(directory: Path, state: DevClusterState) -> None:
    path = _state_path(directory)
    # Written whole, then renamed: a reader never sees half a file.
    partial = path.with_suffix(".partial")
    partial.write_text(state.model_dump_json(indent=2) + "\n")
    partial.replace(path)


def _running(state: DevClusterState) -> list[str]:
    return [
        name
        for name, process in state.processes.items()
        if process_running(process.pid, process.executable)
    ]


def _require_running(directory: Path) -> DevClusterState:
    """The state of the cluster in ``directory``, every process of which is running."""
    state = _read_state(directory)
    if state is None or not state.processes:
        raise DevClusterError(
            f"no dev cluster is running in {directory} ({_state_path(directory)} records "
            f"none); start one with `{PROG} start --dir {directory}`"
        )
    running = _running(state)
    exited = [name for name in state.processes if name not in running]
    if exited:
        logs = ", ".join(str(directory / f"{name}.log") for name in exited)
        raise DevClusterError(
            f"the dev cluster in {directory} is broken: {', '.join(exited)} exited (see {logs}); "
            f"`{PROG} stop --dir {directory}`, then start it again"
        )
    return state


def _api(state: DevClusterState) -> client.ApiClient:
    api: client.ApiClient = config.new_client_from_config(config_file=state.kubeconfig)
    return api


def _start(directory: Path, racks: int, cpu_nodes: int, images: bool) -> int:
    try:
        bin_dir = binaries_dir()
    except RuntimeError as exc:
        raise DevClusterError(str(exc)) from exc
    if images and not image_present(BATON_IMAGE):
        raise DevClusterError(
            f"--images: podman holds no {BATON_IMAGE} (or podman is not installed); build it "
            "with `make image`, or start without --images"
        )
    previous = _read_state(directory)
    if previous is not None and _running(previous):
        raise DevClusterError(
            f"a dev cluster is already running in {directory} ({previous.server}, recorded in "
            f"{_state_path(directory)}); `{PROG} stop --dir {directory}` first, or start "
            "another with --dir"
        )
    if previous is None and directory.exists() and any(directory.iterdir()):
        raise DevClusterError(
            f"{directory} is not empty and holds no dev cluster (no {STATE_FILE}); "
            "empty it or choose another --dir"
        )
    # A stopped cluster's data (etcd, certificates, logs) would bring its nodes back: start anew.
    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True)
    # Recorded before anything starts, so a failed start leaves a directory `start` reuses.
    _write_state(directory, DevClusterState(binaries=str(bin_dir)))
    print(f"{PROG}: starting the control plane in {directory}", file=sys.stderr)
    try:
        plane = start_control_plane(directory, bin_dir, detached=True, run_pods=True, images=images)
    except (RuntimeError, TimeoutError) as exc:
        raise DevClusterError(f"the control plane did not start: {exc}") from exc
    state = DevClusterState(
        server=plane.server,
        kubeconfig=str(plane.kubeconfig),
        binaries=str(bin_dir),
        processes={
            name: ClusterProcess(pid=process.pid, executable=plane.commands[name][0])
            for name, process in plane.processes.items()
        },
    )
    _write_state(directory, state)
    try:
        api = _api(state)
        add_cpu_nodes(api, cpu_nodes)
        trays = add_trays(api, racks)
    except Exception as exc:
        plane.stop()
        _write_state(directory, state.model_copy(update={"processes": {}}))
        raise DevClusterError(
            f"the control plane started but did not take the nodes ({exc!r}); its "
            f"logs are in {directory}"
        ) from exc
    except BaseException:  # Ctrl-C: nothing is left running
        plane.stop()
        _write_state(directory, state.model_copy(update={"processes": {}}))
        raise
    state.racks, state.cpu_nodes = racks, cpu_nodes
    _write_state(directory, state)
    print(
        f"{PROG}: running at {state.server} (racks: {racks}, trays: {len(trays)}, CPU nodes: "
        f"{cpu_nodes}); kubeconfig: {state.kubeconfig}; kubectl and helm: {bin_dir}",
        file=sys.stderr,
    )
    # Lines a shell can evaluate: eval "$(baton dev-cluster start)".
    print(f"export KUBECONFIG={state.kubeconfig}")
    print(f"export PATH={bin_dir}:$PATH")
    return 0


def _add_racks(directory: Path, racks: int) -> int:
    state = _require_running(directory)
    nodes = add_trays(_api(state), racks, first_rack=state.racks)
    state.racks += racks
    _write_state(directory, state)
    print(
        f"{PROG}: added {len(nodes)} trays ({nodes[0]['metadata']['name']} to "
        f"{nodes[-1]['metadata']['name']}); {state.racks} racks in all"
    )
    return 0


def _tray(directory: Path, name: str, ready: bool) -> int:
    state = _require_running(directory)
    api = _api(state)
    try:
        node = client.CoreV1Api(api).read_node(name)
    except ApiException as exc:
        if exc.status != 404:
            raise
        raise DevClusterError(
            f"the dev cluster in {directory} has no tray {name!r}; "
            f"`kubectl --kubeconfig {state.kubeconfig} get nodes` lists them"
        ) from exc
    labels = (node.metadata.labels if node.metadata else None) or {}
    if CLIQUE_LABEL not in labels:
        raise DevClusterError(
            f"{name} is not a tray (it has no {CLIQUE_LABEL} label); name a tray, such as "
            "rack-0-tray-0"
        )
    if ready:
        mark_tray_ready(api, name)
        print(f"{PROG}: {name} is Ready (kwok plays its kubelet again)")
    else:
        mark_tray_not_ready(api, name)
        print(f"{PROG}: {name} is NotReady (kwok no longer plays its kubelet)")
    return 0


def _status(directory: Path) -> int:
    state = _read_state(directory)
    if state is None or not state.processes:
        print(f"{PROG}: no dev cluster is running in {directory}")
        return 1
    running = _running(state)
    print(f"server      {state.server}")
    print(f"kubeconfig  {state.kubeconfig}")
    print(f"binaries    {state.binaries}")
    for name, process in state.processes.items():
        alive = "running" if name in running else f"exited (see {directory / f'{name}.log'})"
        print(f"{name:<24}pid {process.pid:<8} {alive}")
    if "kube-apiserver" in running:
        nodes = client.CoreV1Api(_api(state)).list_node().items
        trays = [n for n in nodes if n.metadata and CLIQUE_LABEL in (n.metadata.labels or {})]
        cpu = [n for n in nodes if n not in trays]
        print(
            f"trays       {sum(map(node_ready, trays))}/{len(trays)} Ready in {state.racks} racks"
        )
        print(f"CPU nodes   {sum(map(node_ready, cpu))}/{len(cpu)} Ready")
    return 0 if len(running) == len(state.processes) else 1


def _stop(directory: Path) -> int:
    state = _read_state(directory)
    if state is None or not _running(state):
        print(f"{PROG}: no dev cluster is running in {directory}; nothing to stop")
        if state is not None and state.processes:
            _write_state(directory, state.model_copy(update={"processes": {}}))
        return 0
    # The reverse of start order: kwok and the controllers before the API server and etcd.
    for process in reversed(list(state.processes.values())):
        stop_pid(process.pid, process.executable)
    _write_state(directory, state.model_copy(update={"processes": {}}))
    print(f"{PROG}: stopped {len(state.processes)} processes; data and logs stay in {directory}")
    return 0


def _count(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        value = int(text)
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    # Every subcommand takes --dir, after its name as after `start`.
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--dir",
        type=Path,
        default=DEFAULT_DIR,
        help=f"the cluster's directory (default {DEFAULT_DIR})",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    def command(name: str, summary: str) -> argparse.ArgumentParser:
        return commands.add_parser(name, parents=[common], help=summary, description=summary)

    start = command("start", "start a control plane with racks of fake trays")
    start.add_argument("--racks", type=_count(0), default=1, help="NVL72 racks (default 1)")
    start.add_argument(
        "--cpu-nodes", type=_count(0), default=1, help="CPU nodes for system pods (default 1)"
    )
    start.add_argument(
        "--images",
        action="store_true",
        help=f"run the containers of images podman holds ({BATON_IMAGE}, from `make image`) "
        "in podman containers, not as processes",
    )
    command("kubeconfig", "print the kubeconfig's path")
    add_racks = command("add-racks", "add racks of 18 fake GB300 trays")
    add_racks.add_argument("racks", type=_count(1), help="how many racks")
    tray = command("tray", "make a tray NotReady or Ready again")
    tray.add_argument("name", help="the tray's node name, e.g. rack-0-tray-3")
    readiness = tray.add_mutually_exclusive_group(required=True)
    readiness.add_argument(
        "--not-ready", action="store_false", dest="ready", help="kwok stops its kubelet"
    )
    readiness.add_argument("--ready", action="store_true", help="kwok plays its kubelet again")
    command("status", "the processes and nodes")
    command("stop", "stop every process of the cluster")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    directory: Path = args.dir.expanduser().resolve()
    try:
        if args.command == "start":
            return _start(directory, args.racks, args.cpu_nodes, args.images)
        if args.command == "kubeconfig":
            print(_require_running(directory).kubeconfig)
            return 0
        if args.command == "add-racks":
            return _add_racks(directory, args.racks)
        if args.command == "tray":
            return _tray(directory, args.name, args.ready)
        if args.command == "status":
            return _status(directory)
        return _stop(directory)
    except DevClusterError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
