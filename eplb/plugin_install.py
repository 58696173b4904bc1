"""``baton vllm-plugin install DIR``: Baton's EPLB plugin as a directory vLLM can load.

The controller runs it in an init container from Baton's image, into a volume the engine
container puts on its ``PYTHONPATH``: no custom vLLM image. ``DIR`` gets the plugin's modules and
every module of Baton's they import (numpy and pydantic aside, which vLLM has), and a
``.dist-info`` whose ``entry_points.txt`` names the plugin in vLLM's ``vllm.general_plugins``
group, which is how vLLM finds plugins (``importlib.metadata`` reads it off ``sys.path``).
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import shutil
import sys
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path

from eplb.vllm_plugin import ENTRY_POINT_GROUP, ENTRY_POINT_NAME, ENTRY_POINT_VALUE

__all__ = ["install", "main", "plugin_modules"]

_OWN = ("baton", "eplb")  # the packages the plugin may import from
_DIST = "baton_vllm_plugin"


def _source(module: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise ValueError(f"module {module} is not installed")
    return Path(spec.origin)


def plugin_modules(root: str = "eplb.vllm_plugin") -> list[str]:
    """``root`` and every module of Baton's it imports, transitively, with their packages."""
    seen: set[str] = set()
    todo = [root]
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        parts = module.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]  # the packages' __init__
        for node in ast.walk(ast.parse(_source(module).read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            todo += [name for name in names if name.split(".")[0] in _OWN]
    return sorted(seen)


def install(directory: Path) -> list[Path]:
    """Write the plugin into ``directory``; the files written."""
    written = []
    for module in plugin_modules():
        source = _source(module)
        relative = Path(*module.split("."))
        target = directory / (
            relative / "__init__.py"
            if source.name == "__init__.py"
            else relative.with_suffix(".py")
        )
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
        written.append(target)
    version = metadata.version("baton")
    info = directory / f"{_DIST}-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {_DIST}\nVersion: {version}\n"
        "Summary: Baton's minimal-move EPLB for vLLM engines\n"
    )
    (info / "entry_points.txt").write_text(
        f"[{ENTRY_POINT_GROUP}]\n{ENTRY_POINT_NAME} = {ENTRY_POINT_VALUE}\n"
    )
    written += [info / "METADATA", info / "entry_points.txt"]
    return written


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="baton vllm-plugin", description="Baton's EPLB plugin for vLLM engines."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    target = commands.add_parser("install", help="write the plugin into DIR (an engine volume)")
    target.add_argument("directory", type=Path)
    args = parser.parse_args(argv)
    try:
        files = install(args.directory)
    except (OSError, ValueError) as exc:
        print(f"baton vllm-plugin: error: {args.directory}: {exc}", file=sys.stderr)
        return 2
    print(f"Baton's EPLB plugin written to {args.directory} ({len(files)} files)")
    return 0
