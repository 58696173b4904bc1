"""router/targets.py: the gateway's targets from flags and the pool file, validated."""

from __future__ import annotations

from pathlib import Path

import pytest

from router.targets import DecodeServerSpec, PoolCell, PoolSpec, load_pool_file, parse_decode_flag


def ranks(url: str, *numbers: int) -> DecodeServerSpec:
    return DecodeServerSpec(url=url, ranks=numbers)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "pool.yaml"
    path.write_text(text)
    return path


# ---- parse_decode_flag


@pytest.mark.parametrize(
    ("flag", "url", "ranks_"),
    [
        ("http://d:8000", "http://d:8000", ()),
        ("http://d:8000/", "http://d:8000", ()),
        ("http://d:8000@3", "http://d:8000", (3,)),
        ("http://d:8000@0-3", "http://d:8000", (0, 1, 2, 3)),
        ("http://d:8000@0,1,2,3", "http://d:8000", (0, 1, 2, 3)),
        ("http://d:8000@0-1,6", "http://d:8000", (0, 1, 6)),
    ],
    ids=["url", "trailing-slash", "one-rank", "range", "list", "range-and-list"],
)
def test_decode_flag_forms(flag: str, url: str, ranks_: tuple[int, ...]) -> None:
    assert parse_decode_flag(flag) == DecodeServerSpec(url=url, ranks=ranks_)


@pytest.mark.parametrize(
    "flag", ["http://d@x", "http://d@1-", "http://d@-1", "http://d@1,,2", "http://d@1-x"]
)
def test_malformed_ranks_name_the_flag_and_the_forms(flag: str) -> None:
    with pytest.raises(ValueError) as caught:
        parse_decode_flag(flag)
    assert str(caught.value) == f"--decode {flag}: ranks must look like @3, @0-3 or @0,1,2,3"


def test_decode_flag_needs_an_http_url() -> None:
    with pytest.raises(ValueError, match=r"--decode ftp://d@0: .*is not an http:// URL"):
        parse_decode_flag("ftp://d@0")


def test_reversed_rank_range_is_an_error() -> None:
    with pytest.raises(ValueError, match="--decode http://d@3-1"):
        parse_decode_flag("http://d@3-1")


def test_pool_file_loads_cells_with_normalised_urls(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "cells:\n- name: c0\n  prefill: ['http://p:1/']\n"
        "  decode: [{url: 'http://d:1/', ranks: [0, 1]}]\n",
    )
    assert load_pool_file(path) == PoolSpec(
        cells=(PoolCell(name="c0", prefill=("http://p:1",), decode=(ranks("http://d:1", 0, 1),)),)
    )


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("cells: [unclosed\n", "not valid YAML"),
        ("cells:\n- name: c0\n  prefill: ['http://p']\n", "field 'cells.0.decode': Field required"),
        (
            "cells:\n- name: c0\n  prefill: ['ftp://p']\n  decode: [{url: 'http://d'}]\n",
            "field 'cells.0.prefill': Value error, 'ftp://p' is not an http:// URL",
        ),
        (
            "cells:\n- name: c0\n  decode: [{url: 'http://d', rank: 3}]\n",
            "field 'cells.0.decode.0.rank': Extra inputs are not permitted",
        ),
        ("cells: []\n", "field 'cells': Tuple should have at least 1 item"),
        (
            "cells:\n- name: c0\n  prefill: ['http://p']\n  decode: [{url: 'http://d'}]\n"
            "  kv_events: {'http://q': 'tcp://q:5557'}\n",
            "kv_events names http://q, which is not one of the cell's prefill",
        ),
        (
            "cells:\n- name: c0\n  prefill: ['http://p']\n  decode: [{url: 'http://d'}]\n"
            "  kv_events: {'http://p': 'p:5557'}\n",
            "kv_events of http://p: give tcp://HOST:PORT, not 'p:5557'",
        ),
    ],
    ids=["yaml", "missing-decode", "bad-url", "unknown-field", "no-cells", "kv-unknown", "kv-url"],
)
def test_pool_file_errors_name_the_file_and_the_field(
    tmp_path: Path, text: str, needle: str
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ValueError) as caught:
        load_pool_file(path)
    message = str(caught.value)
    assert message.startswith(f"{path}: ")
    assert needle in message


def test_missing_pool_file_is_named_with_the_reason(tmp_path: Path) -> None:
    path = tmp_path / "absent.yaml"
    with pytest.raises(ValueError) as caught:
        load_pool_file(path)
    assert str(caught.value) == f"{path}: cannot read the pool file (No such file or directory)"
