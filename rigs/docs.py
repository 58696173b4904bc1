"""The docs' command blocks, as a user pastes them: ``tests/k8s/test_docs.py`` runs them.

A fenced block whose info string starts with ``sh`` holds commands a user runs in order, in one
shell (a variable one block exports, the next uses). Its info string may say more:

- ``sh`` alone: run.
- ``sh no-run: WHY``: only read (``bash -n``), never run, and why: it needs a GPU, a real rack, or
  something the test has done already (``make dev-bin``).

Other blocks (``console`` transcripts, ``yaml``, outputs) are not commands.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Block", "command_blocks"]

_FENCE = re.compile(r"^(?P<indent> *)```(?P<info>[^`]*)$")


@dataclass(frozen=True, slots=True)
class Block:
    """One command block: where it starts (1-based line of its fence) and what it holds."""

    path: Path
    line: int
    text: str
    no_run: str | None  # why it is only read, if so

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def command_blocks(path: Path) -> list[Block]:
    """The ``sh`` blocks of a Markdown file, in order. A block left open is an error."""
    blocks: list[Block] = []
    lines = path.read_text().splitlines()
    opened: tuple[int, str, str] | None = None  # (line, indent, info)
    body: list[str] = []
    for number, line in enumerate(lines, 1):
        fence = _FENCE.match(line)
        if opened is None:
            if fence is not None:
                opened, body = (number, fence["indent"], fence["info"].strip()), []
            continue
        if fence is not None and not fence["info"].strip():
            start, indent, info = opened
            opened = None
            if info == "sh" or info.startswith("sh "):
                why = info[3:].strip()
                if why and not why.startswith("no-run:"):
                    raise ValueError(f"{path}:{start}: say `sh no-run: WHY`, not `{info}`")
                blocks.append(
                    Block(
                        path,
                        start,
                        "\n".join(b.removeprefix(indent) for b in body) + "\n",
                        why.removeprefix("no-run:").strip() or None,
                    )
                )
            continue
        body.append(line)
    if opened is not None:
        raise ValueError(f"{path}:{opened[0]}: a fenced block is never closed")
    return blocks
