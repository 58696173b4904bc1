"""Every package the production code imports is declared in pyproject.toml.

A package that arrives only through another one's dependencies (httptools through
uvicorn[standard], urllib3 through kubernetes) is gone, or changed, the day that one's next
release drops or re-pins it. The services and commands may import only ``[project]
dependencies``; the benchmarks (``bench/``, run by ``make bench`` and ``make demo``, which install
the test extra for vllm-router anyway) may also import the test extra; a module that only some
users run may import its own extra (``EXTRAS``); a module that runs only inside a vLLM engine may
import what every vLLM install has (``IN_ENGINE``), which tests/vllm check against vLLM itself.
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from collections.abc import Iterator
from functools import cache
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# The project's own top-level packages: the production code, whose imports are checked.
OWN = tuple(
    pattern.removesuffix("*")
    for pattern in PYPROJECT["tool"]["setuptools"]["packages"]["find"]["include"]
)
BENCH = "bench"
# Modules that may import an extra of their own, and which.
EXTRAS = {"router/serve.py": "serve"}
# Modules loaded by vLLM's engine processes (the EPLB plugin), and what vLLM brings them.
IN_ENGINE = {"eplb/vllm_plugin.py": ("vllm", "torch")}


def normalized(name: str) -> str:
    """A distribution name as PyPI compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def declared(requirements: list[str]) -> set[str]:
    names = set()
    for requirement in requirements:
        match = re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", requirement)
        assert match is not None, f"unreadable requirement in pyproject.toml: {requirement!r}"
        names.add(normalized(match.group()))
    return names


RUNTIME = declared(PYPROJECT["project"]["dependencies"])
OPTIONAL = {
    extra: declared(requirements)
    for extra, requirements in PYPROJECT["project"]["optional-dependencies"].items()
}
TEST = OPTIONAL["test"]


def imports(path: Path) -> Iterator[tuple[int, str]]:
    """(line, module) of each absolute import in ``path``, wherever it stands in the file."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.lineno, node.module


def third_party_imports() -> Iterator[tuple[Path, int, str]]:
    """(file, line, module) of every import of the production code that is neither the
    standard library nor the project's own."""
    for package in OWN:
        for path in sorted((ROOT / package).rglob("*.py")):
            for line, module in imports(path):
                top = module.partition(".")[0]
                if top not in sys.stdlib_module_names and top not in OWN:
                    yield path.relative_to(ROOT), line, module


@cache
def _providers() -> dict[str, list[str]]:
    return dict(metadata.packages_distributions())  # top-level module -> distributions


@cache
def distributions_of(module: str) -> frozenset[str]:
    """The installed distributions that provide ``module`` (normalized names)."""
    top = module.partition(".")[0]
    candidates = set(_providers().get(top, []))
    if len(candidates) > 1:
        # A namespace package (google): only the distributions that ship the module itself.
        prefix = module.replace(".", "/")
        candidates = {
            name
            for name in candidates
            if any(
                str(file).startswith(f"{prefix}/") or str(file) == f"{prefix}.py"
                for file in metadata.distribution(name).files or []
            )
        }
    return frozenset(normalized(name) for name in candidates)


def test_every_package_the_production_code_imports_is_declared() -> None:
    problems = []
    for path, line, module in third_party_imports():
        if module.partition(".")[0] in IN_ENGINE.get(path.as_posix(), ()):
            continue
        extra = "test" if path.parts[0] == BENCH else EXTRAS.get(path.as_posix())
        allowed = RUNTIME | OPTIONAL[extra] if extra else RUNTIME
        where = "[project] dependencies" + (f" or the {extra} extra" if extra else "")
        provided = distributions_of(module)
        if not provided:
            problems.append(
                f"{path}:{line} imports {module}, which no installed distribution provides: "
                f"declare the one that does in {where} and pip install -e '.[test]'"
            )
        elif not provided & allowed:
            problems.append(
                f"{path}:{line} imports {module} (distribution {' or '.join(sorted(provided))}),"
                f" not declared: add it to {where} in pyproject.toml"
            )
    assert not problems, "\n".join(problems)


def test_the_walk_finds_imports_that_arrive_only_through_other_packages() -> None:
    found = {(str(path), module) for path, _, module in third_party_imports()}
    assert ("router/upstream.py", "httptools") in found  # at the top of a module
    assert ("router/cli.py", "uvicorn") in found  # inside a function
    assert distributions_of("httptools") == {"httptools"}
    assert distributions_of("yaml") == {"pyyaml"}
    assert distributions_of("google.protobuf") == {"protobuf"}
