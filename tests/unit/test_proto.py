"""The committed gRPC modules are what protos/ says: a plain ``pip install`` carries them."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from google.protobuf import descriptor_pb2
from grpc_tools import protoc

from baton.core.proto import eplb_agent_pb2, eplb_agent_pb2_grpc
from tests.helpers import ROOT


def test_the_committed_modules_match_the_proto(tmp_path: Path) -> None:
    # Seen on a fresh clone: `pip install -e .` then `baton up` failed with "No module named
    # 'baton.core.proto'", which only `make proto` generated. They are committed now; a .proto
    # changed without `make proto` fails here.
    compiled = tmp_path / "descriptors.pb"
    status = protoc.main(
        ["protoc", f"-I{ROOT / 'protos'}", f"--descriptor_set_out={compiled}", "eplb_agent.proto"]
    )
    assert status == 0
    wanted = descriptor_pb2.FileDescriptorSet.FromString(compiled.read_bytes()).file[0]
    _without_json_names(wanted.message_type)  # protoc adds them to a set, not to gencode
    committed = descriptor_pb2.FileDescriptorProto.FromString(
        eplb_agent_pb2.DESCRIPTOR.serialized_pb
    )
    assert committed == wanted, "protos/ changed: run `make proto` and commit the modules"
    service = wanted.service[0]
    stub_methods = {m.name for m in service.method}
    assert all(
        hasattr(eplb_agent_pb2_grpc, f"{service.name}{kind}") for kind in ("Stub", "Servicer")
    )
    servicer = getattr(eplb_agent_pb2_grpc, f"{service.name}Servicer")
    assert stub_methods <= set(vars(servicer))


def _without_json_names(messages: Iterable[descriptor_pb2.DescriptorProto]) -> None:
    for message in messages:
        for field in message.field:
            field.ClearField("json_name")
        _without_json_names(message.nested_type)
