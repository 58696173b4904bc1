"""The docs are the test: each guide's command blocks run in order, as a user pastes them, in one
shell on a fresh machine's state (an empty home directory, the built binaries), and every one
must succeed. A block that needs what this machine has not (a GPU, a real rack) says so
(``sh no-run: WHY``, rigs/docs.py) and is only read by ``bash -n``."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from contextlib import suppress
from pathlib import Path

import pytest

from rigs.devcluster import binaries_dir
from rigs.docs import Block, command_blocks
from tests.helpers import ROOT

# Each guide, and whether it starts from a cluster of trays, as its reader has one, or builds its
# own (docs/dev-cluster.md).
GUIDES = {"docs/dev-cluster.md": False, "docs/operator.md": True, "docs/operations.md": True}
MARK = ">>> block "
# The cluster a reader has: a dev cluster with kube-prometheus-stack's CRDs, whose pods run
# (the chart's controller among them, once the guide installs the chart).
CLUSTER = (
    'eval "$(baton dev-cluster start)"',
    'trap "baton dev-cluster stop >/dev/null" EXIT',
    'kubectl apply --server-side -f "$BATON_DEV_BIN/monitoring-crds" >/dev/null',
)


def _script(blocks: list[Block], cluster: bool) -> str:
    lines = ["set -euo pipefail", *(CLUSTER if cluster else ())]
    for block in blocks:
        if block.no_run is None:
            lines += [f"echo '{MARK}{block.where}' >&2", block.text]
    return "\n".join(lines) + "\n"


def _checkout(into: Path) -> Path:
    """The repository's files as a clone has them, for the walk to run in: a block that writes
    a file (``helm get values ... > values.yaml``) writes it there, not into this checkout."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    )
    for name in filter(None, listed.stdout.decode().split("\0")):
        source = ROOT / name
        if source.is_file():
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, into / name)
    return into


def _read_only(block: Block) -> None:
    checked = subprocess.run(
        ["bash", "-n"], input=block.text, capture_output=True, text=True, timeout=30
    )
    assert checked.returncode == 0, f"{block.where} (no-run: {block.no_run}): {checked.stderr}"


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("guide", GUIDES)
def test_every_command_of_the_guide_runs_as_written(guide: str, tmp_path: Path) -> None:
    blocks = command_blocks(ROOT / guide)
    assert blocks, f"{guide} has no sh blocks"
    for block in blocks:
        if block.no_run is not None:
            _read_only(block)
    home = tmp_path / "home"
    home.mkdir()
    env = {
        "HOME": str(home),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "BATON_DEV_BIN": str(binaries_dir()),  # built by `make dev-bin` before the tests
        "LANG": "C.UTF-8",
    }
    checkout = _checkout(tmp_path / "baton")
    log = tmp_path / "walk.log"
    with log.open("w") as out:
        shell = subprocess.Popen(
            ["bash", "-c", _script(blocks, GUIDES[guide])],
            cwd=checkout,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # what a block leaves in the background stops with it
        )
        try:
            code = shell.wait(timeout=900)
        finally:
            with suppress(ProcessLookupError):
                os.killpg(shell.pid, signal.SIGTERM)
            # a walk that failed before its own `baton dev-cluster stop` leaves the cluster up
            subprocess.run(
                ["baton", "dev-cluster", "stop", "--dir", str(home / ".cache/baton/dev-cluster")],
                env=env,
                cwd=ROOT,
                capture_output=True,
                timeout=120,
            )
    output = log.read_text(errors="replace")
    last = output.rsplit(MARK, 1)[-1].split("\n", 1)[0] if MARK in output else guide
    assert code == 0, f"{last} failed (exit {code}); the walk's output ends:\n{output[-4000:]}"
