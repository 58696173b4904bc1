"""The simulator's EPLB agent over real gRPC: load streaming and two-phase switches."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from baton.core.proto import eplb_agent_pb2 as pb
from baton.core.proto import eplb_agent_pb2_grpc as pb_grpc
from eplb.algorithm import rebalance
from sim.agent import decode_placement, encode_placement
from tests.helpers import SimHandle, eventually, free_port, keep_decoding, scrape


@pytest.fixture
def agent(
    start_sim: Callable[..., SimHandle],
) -> Iterator[tuple[SimHandle, pb_grpc.EplbAgentStub]]:
    port = free_port()
    sim = start_sim(
        "--data-parallel-size",
        "32",
        "--enable-expert-parallel",
        "--enable-eplb",
        "--eplb-config",
        '{"num_redundant_experts": 32}',
        "--eplb-agent-port",
        str(port),
        "--eplb-agent-insecure",
        "--speculative-config",
        '{"method": "mtp", "num_speculative_tokens": 3}',
    )
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    yield sim, pb_grpc.EplbAgentStub(channel)
    channel.close()


def test_describe_names_ranks_and_both_models(
    agent: tuple[SimHandle, pb_grpc.EplbAgentStub],
) -> None:
    _, stub = agent
    info = stub.Describe(pb.DescribeRequest())
    assert list(info.dp_ranks) == list(range(32))
    models = {
        m.name: (m.layers, m.logical_experts, m.physical_experts, m.top_k) for m in info.models
    }
    assert models == {"target": (43, 384, 416, 6), "draft": (1, 128, 160, 3)}


def test_load_stream_reports_each_ranks_own_slots_per_step(
    agent: tuple[SimHandle, pb_grpc.EplbAgentStub],
) -> None:
    sim, stub = agent
    keep_decoding(sim.url, max_tokens=2000)
    # A rank with nothing running reports zero counts; open the stream once both are decoding.
    eventually(
        lambda: all(
            scrape(sim.url, "vllm:num_requests_running", engine=rank) > 0 for rank in ("0", "31")
        ),
        timeout=30,
    )
    stream = stub.StreamLoad(pb.StreamLoadRequest(dp_ranks=[0, 31], steps_per_report=10))
    seen: dict[tuple[int, str], list[pb.LoadReport]] = {}
    for report in stream:
        seen.setdefault((report.dp_rank, report.model), []).append(report)
        if all(len(seen.get((r, m), [])) >= 2 for r in (0, 31) for m in ("target", "draft")):
            break
    stream.cancel()
    first, second = seen[(0, "target")][:2]
    # batches end at multiples of 10 steps, the first one as soon as it reaches one
    assert (first.layers, first.slots) == (43, 13) and 1 <= first.num_steps <= 10
    assert (first.first_step + first.num_steps) % 10 == 0
    assert second.first_step == first.first_step + first.num_steps and second.num_steps == 10
    counts = np.frombuffer(second.counts, dtype="<u4").reshape(10, 43, 13)
    assert counts.sum() > 0
    draft = seen[(31, "draft")][0]
    assert np.frombuffer(draft.counts, dtype="<u4").reshape(draft.num_steps, 1, 5).sum() > 0


def current(stub: pb_grpc.EplbAgentStub) -> dict[str, pb.Placement]:
    return {p.model: p for p in stub.GetPlacement(pb.GetPlacementRequest()).placements}


def test_malformed_placement_is_rejected_before_anything_is_staged(
    agent: tuple[SimHandle, pb_grpc.EplbAgentStub],
) -> None:
    _, stub = agent
    before = current(stub)["target"]
    phy2log = decode_placement(before, 32, 384).phy2log.copy()
    phy2log[0, :] = 0  # experts 1..383 lose every replica in layer 0
    broken = pb.Placement(
        model="target", layers=43, physical_experts=416, phy2log=phy2log.astype("<i4").tobytes()
    )
    reply = stub.Prepare(pb.PrepareRequest(switch_id="s1", apply_at_step=0, placements=[broken]))
    assert not reply.ok and "has no replica in layer 0" in reply.error
    wrong_shape = pb.Placement(
        model="target",
        layers=43,
        physical_experts=384,
        phy2log=np.zeros((43, 384), "<i4").tobytes(),
    )
    reply = stub.Prepare(pb.PrepareRequest(switch_id="s2", placements=[wrong_shape]))
    assert not reply.ok and "shape" in reply.error
    # Nothing was staged: a commit finds no switch, and the placement is unchanged.
    assert not stub.Commit(pb.CommitRequest(switch_id="s1")).ok
    assert current(stub)["target"].version == before.version


def test_prepare_then_commit_switches_at_the_agreed_step(
    agent: tuple[SimHandle, pb_grpc.EplbAgentStub],
) -> None:
    sim, stub = agent
    keep_decoding(sim.url, max_tokens=2000)
    load = np.random.default_rng(0).integers(1, 1000, size=(43, 384))
    new = rebalance(load, 32, 32)
    step = stub.Describe(pb.DescribeRequest()).current_step
    prepared = stub.Prepare(
        pb.PrepareRequest(
            switch_id="s3", apply_at_step=step + 20, placements=[encode_placement("target", new)]
        )
    )
    assert prepared.ok and prepared.experts_to_copy > 0 and prepared.staging_seconds > 0
    committed = stub.Commit(pb.CommitRequest(switch_id="s3"))
    assert committed.ok and committed.apply_at_step >= step + 20

    def switched() -> bool:
        return current(stub)["target"].version == 1

    eventually(switched, timeout=30)
    assert decode_placement(current(stub)["target"], 32, 384) == new
    assert current(stub)["draft"].version == 0  # the draft was not part of this switch


def test_abort_drops_the_staged_placement(agent: tuple[SimHandle, pb_grpc.EplbAgentStub]) -> None:
    _, stub = agent
    new = rebalance(np.ones((43, 384)), 32, 32)
    assert stub.Prepare(
        pb.PrepareRequest(
            switch_id="s4", apply_at_step=10**9, placements=[encode_placement("target", new)]
        )
    ).ok
    assert stub.Abort(pb.AbortRequest(switch_id="s4", reason="test")).ok
    assert not stub.Commit(pb.CommitRequest(switch_id="s4")).ok
    assert current(stub)["target"].version == 0


DROPPED = "baton:eplb_agent_load_subscribers_dropped_total"


def test_a_load_subscriber_that_never_reads_is_dropped_once(
    agent: tuple[SimHandle, pb_grpc.EplbAgentStub],
) -> None:
    sim, stub = agent
    keep_decoding(sim.url)
    # One report per rank, model and step: the fastest a subscriber can fall behind.
    request = pb.StreamLoadRequest(steps_per_report=1)
    stalled = [stub.StreamLoad(request), stub.StreamLoad(request)]  # never read until the end
    eventually(lambda: scrape(sim.url, DROPPED) == 2, timeout=60)
    for stream in stalled:
        with pytest.raises(grpc.RpcError) as ended:
            for _ in stream:  # what was already in flight, then the status
                pass
        assert ended.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    about_it = [line for line in sim.log().splitlines() if "load subscriber" in line]
    assert len(about_it) == 2, about_it
    # The engine goes on serving a subscriber that reads.
    fresh = stub.StreamLoad(pb.StreamLoadRequest(dp_ranks=[0], steps_per_report=10))
    report = next(fresh)
    assert 1 <= report.num_steps <= 10 and (report.first_step + report.num_steps) % 10 == 0
    fresh.cancel()


def agent_without_flags(
    start_sim: Callable[..., SimHandle], *flags: str
) -> tuple[SimHandle, pb_grpc.EplbAgentStub]:
    port = free_port()
    sim = start_sim(
        *("--data-parallel-size", "32", "--enable-expert-parallel", "--enable-eplb"),
        *("--eplb-agent-port", str(port), *flags),
    )
    return sim, pb_grpc.EplbAgentStub(grpc.insecure_channel(f"127.0.0.1:{port}"))


def every_call(
    stub: pb_grpc.EplbAgentStub, metadata: tuple[tuple[str, str], ...]
) -> dict[str, grpc.StatusCode]:
    """Each RPC of the agent once with ``metadata``: its status code (OK when it answered)."""
    calls: dict[str, Callable[[], object]] = {
        "Describe": lambda: stub.Describe(pb.DescribeRequest(), metadata=metadata, timeout=10),
        "GetPlacement": lambda: stub.GetPlacement(
            pb.GetPlacementRequest(), metadata=metadata, timeout=10
        ),
        "StreamLoad": lambda: next(
            stub.StreamLoad(pb.StreamLoadRequest(), metadata=metadata, timeout=10)
        ),
        "Prepare": lambda: stub.Prepare(
            pb.PrepareRequest(switch_id="x"), metadata=metadata, timeout=10
        ),
        "Commit": lambda: stub.Commit(
            pb.CommitRequest(switch_id="x"), metadata=metadata, timeout=10
        ),
        "Abort": lambda: stub.Abort(pb.AbortRequest(switch_id="x"), metadata=metadata, timeout=10),
    }
    codes: dict[str, grpc.StatusCode] = {}
    for name, call in calls.items():
        try:
            call()
            codes[name] = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            codes[name] = exc.code()
    return codes


def test_with_a_token_every_call_needs_it(
    start_sim: Callable[..., SimHandle], tmp_path: Path
) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    sim, stub = agent_without_flags(start_sim, "--eplb-agent-token-file", str(token_file))
    keep_decoding(sim.url, max_tokens=2000)  # so a stream has reports to send
    for metadata in ((), (("authorization", "Bearer wrong"),)):
        codes = every_call(stub, metadata)
        assert set(codes.values()) == {grpc.StatusCode.UNAUTHENTICATED}, codes
    codes = every_call(stub, (("authorization", "Bearer s3cret"),))
    assert set(codes.values()) == {grpc.StatusCode.OK}, codes


def test_without_a_token_switches_are_refused_unless_the_agent_is_open(
    start_sim: Callable[..., SimHandle],
) -> None:
    sim, stub = agent_without_flags(start_sim)
    keep_decoding(sim.url, max_tokens=2000)
    codes = every_call(stub, ())
    refused = {name for name, code in codes.items() if code != grpc.StatusCode.OK}
    assert refused == {"Prepare", "Commit", "Abort"}, codes
    assert {codes[name] for name in refused} == {grpc.StatusCode.PERMISSION_DENIED}
    assert "--eplb-agent-insecure" in sim.log()  # said at startup, with the way out
    open_sim, open_stub = agent_without_flags(start_sim, "--eplb-agent-insecure")
    keep_decoding(open_sim.url, max_tokens=2000)
    assert set(every_call(open_stub, ()).values()) == {grpc.StatusCode.OK}
    assert "open to anyone" in open_sim.log()


def test_a_new_prepare_replaces_a_switch_staged_but_never_committed(
    agent: tuple[SimHandle, pb_grpc.EplbAgentStub],
) -> None:
    sim, stub = agent
    rng = np.random.default_rng(1)
    first, second, third = (
        encode_placement("target", rebalance(rng.integers(1, 1000, size=(43, 384)), 32, 32))
        for _ in range(3)
    )
    far = 10**9  # no switch here takes effect during the test
    assert stub.Prepare(pb.PrepareRequest(switch_id="s5", apply_at_step=far, placements=[first])).ok
    # The service gave up on s5 and its Abort never arrived here; it moves on to s6.
    reply = stub.Prepare(pb.PrepareRequest(switch_id="s6", apply_at_step=far, placements=[second]))
    assert reply.ok, reply.error
    assert "switch s5 was staged but never committed; s6 replaces it" in sim.log()
    assert not stub.Commit(pb.CommitRequest(switch_id="s5")).ok
    assert stub.Commit(pb.CommitRequest(switch_id="s6")).ok
    # A committed switch is the group's agreement: only an Abort drops it.
    reply = stub.Prepare(pb.PrepareRequest(switch_id="s7", apply_at_step=far, placements=[third]))
    assert not reply.ok and "switch s6 is committed" in reply.error
    assert stub.Abort(pb.AbortRequest(switch_id="s6", reason="test")).ok
    assert stub.Prepare(pb.PrepareRequest(switch_id="s7", apply_at_step=far, placements=[third])).ok
