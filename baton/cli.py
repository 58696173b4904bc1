"""The ``baton`` command: one entry point, a subcommand per service or tool.

Each subcommand owns its flags; this module only dispatches, so ``baton sim --help`` shows
exactly the simulator's flags.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

__all__ = ["main"]


def _sim(argv: Sequence[str]) -> int:
    from sim.cli import main as sim_main

    return sim_main(argv)


def _gateway(argv: Sequence[str]) -> int:
    from router.cli import main as gateway_main

    return gateway_main(argv)


def _eplb(argv: Sequence[str]) -> int:
    from eplb.cli import main as eplb_main

    return eplb_main(argv)


def _bench(argv: Sequence[str]) -> int:
    from bench.cli import main as bench_main

    return bench_main(argv)


def _place(argv: Sequence[str]) -> int:
    from baton.place import main as place_main

    return place_main(argv)


def _up(argv: Sequence[str]) -> int:
    from baton.up import main as up_main

    return up_main(argv)


def _controller(argv: Sequence[str]) -> int:
    from controller.cli import main as controller_main

    return controller_main(argv)


def _vllm_plugin(argv: Sequence[str]) -> int:
    from eplb.plugin_install import main as plugin_main

    return plugin_main(argv)


def _dev_cluster(argv: Sequence[str]) -> int:
    from baton.dev_cluster import main as dev_cluster_main

    return dev_cluster_main(argv)


def _crd(argv: Sequence[str]) -> int:
    from baton.core.crd import main as crd_main

    return crd_main(argv)


COMMANDS: dict[str, tuple[Callable[[Sequence[str]], int], str]] = {
    "sim": (_sim, "run the vLLM-compatible engine simulator"),
    "gateway": (_gateway, "run the OpenAI-compatible P/D gateway"),
    "controller": (_controller, "run the operator: ModelDeployments to pods on NVL72 trays"),
    "eplb": (_eplb, "run the EPLB service (expert load balancing of decode groups)"),
    "bench": (_bench, "run a benchmark and save its JSON"),
    "place": (_place, "dry-run placement of cells on NVL72 trays"),
    "crd": (_crd, "print the ModelDeployment CRD generated from baton/core/api.py"),
    "up": (_up, "all of Baton on one machine: a simulated rack, engines, gateway"),
    "dev-cluster": (_dev_cluster, "a loopback Kubernetes control plane with fake GB300 trays"),
    "vllm-plugin": (_vllm_plugin, "install Baton's EPLB plugin for vLLM engines into a directory"),
}


def _usage() -> str:
    lines = ["usage: baton COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<12} {summary}" for name, (_, summary) in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(_usage())
        return 0
    command = COMMANDS.get(args[0])
    if command is None:
        print(f"baton: unknown command '{args[0]}'\n\n{_usage()}", file=sys.stderr)
        return 2
    return command[0](args[1:])


if __name__ == "__main__":
    sys.exit(main())
