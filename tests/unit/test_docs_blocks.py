"""The docs' command blocks as rigs.docs reads them (tests/k8s/test_docs.py runs them)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rigs.docs import command_blocks


def test_sh_blocks_are_commands_in_order_and_others_are_not(tmp_path: Path) -> None:
    doc = tmp_path / "d.md"
    doc.write_text(
        "Intro\n\n```sh\nexport A=1\n```\n\n```yaml\nkey: v\n```\n\n"
        "- a step:\n  ```sh no-run: needs a GPU\n  nvidia-smi\n  ```\n\n"
        '```console\n$ echo x\nx\n```\n\n```sh\necho "$A"\n```\n'
    )
    blocks = command_blocks(doc)
    assert [(b.line, b.text, b.no_run) for b in blocks] == [
        (3, "export A=1\n", None),
        (12, "nvidia-smi\n", "needs a GPU"),
        (21, 'echo "$A"\n', None),
    ]
    assert blocks[0].where == f"{doc}:3"


def test_a_block_that_says_something_else_than_no_run_is_refused(tmp_path: Path) -> None:
    doc = tmp_path / "d.md"
    doc.write_text("```sh maybe\nls\n```\n")
    with pytest.raises(ValueError, match=r"d.md:1: say `sh no-run: WHY`"):
        command_blocks(doc)


def test_an_unclosed_block_is_refused(tmp_path: Path) -> None:
    doc = tmp_path / "d.md"
    doc.write_text("text\n```sh\nls\n")
    with pytest.raises(ValueError, match=r"d.md:2: a fenced block is never closed"):
        command_blocks(doc)
