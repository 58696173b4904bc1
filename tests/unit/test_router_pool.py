"""router/pool.py without I/O: decode flags, the pool file, the breaker and load accounting."""

from __future__ import annotations

from pathlib import Path

import pytest

from router.pool import (
    Breaker,
    DecodeServerSpec,
    Pool,
    PoolCell,
    PoolSpec,
    load_pool_file,
    parse_decode_flag,
)

P0, P1, P2 = "http://p0:1", "http://p1:1", "http://p2:1"
D0, D1 = "http://d0:1", "http://d1:1"


def spec(*cells: tuple[str, tuple[str, ...], tuple[DecodeServerSpec, ...]]) -> tuple[PoolCell, ...]:
    return tuple(PoolCell(name=n, prefill=p, decode=d) for n, p, d in cells)


def ranks(url: str, *numbers: int) -> DecodeServerSpec:
    return DecodeServerSpec(url=url, ranks=numbers)


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


# ---- Breaker


def test_breaker_opens_at_the_threshold_of_consecutive_failures() -> None:
    breaker = Breaker(threshold=3, cooldown_s=5.0)
    breaker.failure(now=100.0)
    breaker.failure(now=100.0)
    assert breaker.allows(now=100.0)
    breaker.failure(now=100.0)
    assert not breaker.allows(now=100.0)
    assert not breaker.allows(now=104.999)


def test_success_resets_the_failure_count() -> None:
    breaker = Breaker(threshold=3, cooldown_s=5.0)
    breaker.failure(now=100.0)
    breaker.failure(now=100.0)
    breaker.success()
    breaker.failure(now=100.0)
    breaker.failure(now=100.0)
    assert breaker.allows(now=100.0)


def test_breaker_lets_a_trial_through_after_the_cooldown_and_a_success_closes_it() -> None:
    breaker = Breaker(threshold=3, cooldown_s=5.0)
    for _ in range(3):
        breaker.failure(now=100.0)
    assert breaker.allows(now=105.0)
    breaker.success()
    assert breaker.allows(now=105.0)
    breaker.failure(now=105.0)
    assert breaker.allows(now=105.0)  # one failure after closing does not reopen it


def test_failed_trial_reopens_the_breaker_for_a_full_cooldown() -> None:
    breaker = Breaker(threshold=3, cooldown_s=5.0)
    for _ in range(3):
        breaker.failure(now=100.0)
    breaker.failure(now=105.0)  # the trial
    assert not breaker.allows(now=109.999)
    assert breaker.allows(now=110.0)


# ---- Pool: targets, load and snapshots (no I/O: nothing is started)


def pool() -> Pool:
    return Pool(
        spec(("c0", (P0, P1), (ranks(D0, 0, 1),)), ("c1", (P2,), (DecodeServerSpec(url=D1),))),
        probe_interval_s=2.0,
    )


def test_pool_names_decode_targets_by_url_and_rank() -> None:
    assert sorted(pool().decode) == [f"{D0}#0", f"{D0}#1", D1]
    view = {rank.name: rank for rank in pool().snapshot().decode}
    assert (view[f"{D0}#1"].url, view[f"{D0}#1"].dp_rank, view[f"{D0}#1"].cell) == (D0, 1, "c0")
    assert (view[D1].url, view[D1].dp_rank, view[D1].cell) == (D1, -1, "c1")


def test_snapshot_reflects_in_flight_accounting() -> None:
    p = pool()
    p.begin_prefill(P0, 700)
    p.begin_prefill(P0, 300)
    p.end_prefill(P0, 700)
    p.begin_decode(f"{D0}#1")
    p.begin_decode(f"{D0}#1")
    p.end_decode(f"{D0}#1")
    snap = p.snapshot()
    assert {v.name: v.outstanding_tokens for v in snap.prefill} == {P0: 300, P1: 0, P2: 0}
    assert {r.name: r.in_flight for r in snap.decode} == {f"{D0}#0": 0, f"{D0}#1": 1, D1: 0}
    assert p.in_flight() == {P0: 1, P1: 0, P2: 0, f"{D0}#0": 0, f"{D0}#1": 1, D1: 0}


def test_failures_up_to_the_threshold_eject_a_target_from_the_snapshot() -> None:
    p = Pool(
        spec(("c0", (P0,), (DecodeServerSpec(url=D0),))),
        probe_interval_s=2.0,
        breaker=lambda: Breaker(threshold=2),
    )
    p.failed(D0)
    assert all(r.healthy for r in p.snapshot().decode)
    p.failed(D0)
    assert [r.healthy for r in p.snapshot().decode] == [False]
    assert not p.ready()


def test_update_keeps_the_load_of_unchanged_targets_and_drops_removed_ones() -> None:
    p = pool()
    p.begin_prefill(P0, 500)
    p.begin_prefill(P2, 100)
    p.begin_decode(f"{D0}#0")
    p.begin_decode(D1)
    p.update(spec(("c0", (P0, "http://p3:1"), (ranks(D0, 0, 1, 2),))))
    assert p.in_flight() == {P0: 1, "http://p3:1": 0, f"{D0}#0": 1, f"{D0}#1": 0, f"{D0}#2": 0}
    assert {v.name: v.outstanding_tokens for v in p.snapshot().prefill} == {
        P0: 500,
        "http://p3:1": 0,
    }


def test_ending_a_request_on_a_removed_target_is_harmless() -> None:
    p = pool()
    p.begin_prefill(P2, 100)
    p.begin_decode(D1)
    p.update(spec(("c0", (P0,), (ranks(D0, 0),))))
    p.end_prefill(P2, 100)
    p.end_decode(D1)
    assert p.in_flight() == {P0: 0, f"{D0}#0": 0}


def test_target_moved_to_another_cell_keeps_its_load_in_the_new_cell() -> None:
    p = pool()
    p.begin_decode(D1)
    p.update(spec(("c0", (P0,), (ranks(D0, 0),)), ("c9", (P2,), (DecodeServerSpec(url=D1),))))
    view = {r.name: r for r in p.snapshot().decode}[D1]
    assert (view.cell, view.in_flight) == ("c9", 1)


# ---- load_pool_file


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "pool.yaml"
    path.write_text(text)
    return path


def test_pool_file_loads_cells_with_normalised_urls(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "cells:\n- name: c0\n  prefill: ['http://p:1/']\n"
        "  decode: [{url: 'http://d:1/', ranks: [0, 1]}]\n",
    )
    assert load_pool_file(path) == PoolSpec(
        cells=spec(("c0", ("http://p:1",), (ranks("http://d:1", 0, 1),)))
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
    ],
    ids=["yaml", "missing-decode", "bad-url", "unknown-field", "no-cells"],
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
