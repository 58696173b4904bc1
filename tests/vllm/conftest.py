"""vLLM itself, answering in its own virtualenv (tests/vllm/oracle.py), once per test session."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]


class Vllm:
    """The oracle process: one JSON question, one JSON answer."""

    def __init__(self, process: subprocess.Popen[str], version: str) -> None:
        self.process = process
        self.version = version

    def ask(self, op: str, **query: Any) -> dict[str, Any]:
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(json.dumps({"op": op, **query}) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the vLLM oracle exited with {self.process.wait()}")
        answer: dict[str, Any] = json.loads(line)
        return answer


def vllm_python() -> Path:
    """The python of the vLLM environment ``make vllm-env`` builds; never built here."""
    where = subprocess.run(
        [str(ROOT / "deploy/vllm/env.sh"), "--where"], check=True, capture_output=True, text=True
    )
    python = Path(where.stdout.strip())
    if not (python.parent.parent / ".complete").exists():
        raise RuntimeError(
            f"vLLM's environment is not built at {python.parent.parent}; run `make vllm-env` "
            "(deploy/vllm/env.sh: about 9.4 GB, 5-20 minutes on a new machine, then cached)"
        )
    return python


@pytest.fixture(scope="session")
def vllm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Vllm]:
    log = tmp_path_factory.mktemp("vllm") / "oracle.log"
    with log.open("w") as stderr:
        process = subprocess.Popen(
            [str(vllm_python()), str(ROOT / "tests/vllm/oracle.py")],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
    assert process.stdout is not None
    ready = process.stdout.readline()  # vLLM's imports take 10-20 s
    if not ready:
        raise RuntimeError(
            f"the vLLM oracle exited with {process.wait()} before answering:\n"
            f"{log.read_text()[-3000:]}"
        )
    yield Vllm(process, json.loads(ready)["vllm"])
    process.kill()
    process.wait()


@pytest.fixture(scope="module")
def start_sim_module(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """``start_sim`` for a whole module: simulators that every test of it shares."""
    from tests.conftest import _Launcher

    launcher = _Launcher(tmp_path_factory.mktemp("sim"))

    def start(*flags: str) -> Any:
        return launcher.start("sim", flags, None)

    yield start
    launcher.stop()
