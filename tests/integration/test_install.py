"""The README's first commands: the ``baton`` command installs by itself from a clone (a wheel
carries its generated gRPC modules and the shipped performance profiles) and ``baton up`` serves
from that install, with nothing imported from the checkout."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import httpx

from rigs.processes import ProcessExited
from tests.helpers import clean_checkout, eventually, free_port, stop_process


def test_a_wheel_of_a_clean_clone_installs_alone_and_baton_up_serves_from_it(
    tmp_path: Path,
) -> None:
    source = clean_checkout(tmp_path / "clone")
    wheels = tmp_path / "wheels"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(wheels),
            str(source),
        ],
        check=True,
        capture_output=True,
    )
    [wheel] = wheels.glob("baton-*.whl")
    packaged = set(zipfile.ZipFile(wheel).namelist())
    assert "baton/core/proto/eplb_agent_pb2_grpc.py" in packaged  # `make proto` is not needed
    assert any(name.startswith("baton/core/profiles/") for name in packaged)

    # A fresh environment holding the wheel; its dependencies are this interpreter's (the
    # registry is not this test's to fetch from), and this checkout is on no path of it.
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    Path(site, "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "install",
            "-q",
            "--no-deps",
            str(wheel),
        ],
        check=True,
        capture_output=True,
    )
    where = subprocess.run(
        [str(python), "-c", "import baton, router; print(baton.__file__, router.__file__)"],
        cwd=tmp_path,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()
    assert all(path.startswith(site) for path in where), where

    port = free_port()
    log = tmp_path / "up.log"
    up = subprocess.Popen(
        [str(venv / "bin" / "baton"), "up", "--port", str(port)],
        cwd=tmp_path,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        if up.poll() is not None:
            raise ProcessExited(f"baton up exited with {up.returncode}:\n{log.read_text()}")
        return httpx.get(f"{url}/ready", timeout=2).status_code == 200

    try:
        eventually(ready, timeout=180, interval=0.5)
        models = httpx.get(f"{url}/v1/models", timeout=10).json()["data"]
        answer = httpx.post(
            f"{url}/v1/completions",
            json={"model": models[0]["id"], "prompt": "Place a cell.", "max_tokens": 4},
            timeout=60,
        )
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 4
    finally:
        stop_process(up)
    output = log.read_text()
    assert "OpenAI API at" in output and "Traceback" not in output
