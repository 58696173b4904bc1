"""The docs are the test: each guide's command blocks run in order, as a user pastes them, in one
shell on a fresh machine's state (an empty home directory, the built binaries), and every one
must succeed. A block that needs what this machine has not (a GPU, a real rack) says so
(``sh no-run: WHY``, rigs/docs.py) and is only read by ``bash -n``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from contextlib import suppress
from pathlib import Path

import pytest

from rigs.devcluster import binaries_dir
from rigs.docs import Block, command_blocks
from tests.helpers import ROOT, clean_checkout

# Each guide, and whether it starts from a cluster of trays, as its reader has one, or builds its
# own (docs/dev-cluster.md).
GUIDES = {"docs/dev-cluster.md": False, "docs/operator.md": True, "docs/operations.md": True}
# Pages whose every block is only read: the README's install and `make` lines (run by CI itself
# and by tests/integration/test_install.py).
READ_ONLY = ("README.md",)
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
    checkout = clean_checkout(tmp_path / "baton")
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


@pytest.mark.parametrize("page", READ_ONLY)
def test_every_command_of_the_page_is_marked_not_run_and_parses(page: str) -> None:
    blocks = command_blocks(ROOT / page)
    assert blocks, f"{page} has no sh blocks"
    for block in blocks:
        assert block.no_run, f"{block.where}: a block of {page} is never run; say why"
        _read_only(block)
