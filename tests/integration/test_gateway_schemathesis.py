"""Property-based API tests: schemathesis generates requests from the gateway's own
``/openapi.json`` and every answer must be a non-5xx status, with an OpenAI error body when it is
an error. The gateway runs as ``baton gateway`` in front of a real prefill and a real decode
``baton sim`` (a P/D pool, so ``/ready`` has a reason to be ready).

Each operation's strategy is driven by hypothesis inside one test, so one gateway serves every
operation. (schemathesis 4.32's ``pytest.from_fixture`` schemas read ``Node._nodeid``, which
pytest 9.2 no longer has.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import Case, GenerationMode
from schemathesis.core.result import Ok
from schemathesis.schemas import APIOperation, BaseSchema

from tests.helpers import NIXL, SimHandle, free_port_block

MODEL = "dsv4"
ERROR_FIELDS = {"message", "type", "param", "code"}
# What get_all_operations yields: schemathesis leaves an operation's type parameters open.
Operation = APIOperation[Any, Any, Any, Any]


def name_the_served_model(context: schemathesis.HookContext, body: object) -> object:
    """Name the served model in about half of the generated bodies, so they reach the engine."""
    if isinstance(body, dict) and isinstance(body.get("model"), str) and len(body["model"]) % 2:
        return {**body, "model": MODEL}
    return body


def start_engine(start_sim: Callable[..., SimHandle]) -> SimHandle:
    return start_sim(
        "--served-model-name",
        MODEL,
        "--kv-transfer-config",
        NIXL,
        env={"VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port_block(2))},
    )


@pytest.fixture
def gateway_schema(
    start_sim: Callable[..., SimHandle], start_gateway: Callable[..., SimHandle]
) -> BaseSchema:
    prefill, decode = start_engine(start_sim), start_engine(start_sim)
    gateway: SimHandle = start_gateway(f"--prefill={prefill.url}", f"--decode={decode.url}")
    schema = schemathesis.openapi.from_url(f"{gateway.url}/openapi.json")
    schema.hook("map_body")(name_the_served_model)
    return schema


def assert_answered_without_server_error(case: Case[Operation], session: requests.Session) -> None:
    response = case.call(session=session, timeout=30)
    label = f"{case.operation.label} body={case.body!r}"
    assert response.status_code < 500, f"{label}: {response.status_code} {response.text}"
    if response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == ERROR_FIELDS, f"{label}: {response.text}"
        assert isinstance(error["message"], str) and error["message"], label
        assert isinstance(error["type"], str) and error["type"], label


def fuzz(operation: Operation, mode: GenerationMode, session: requests.Session) -> None:
    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=30,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    def check(case: Case[Operation]) -> None:
        assert_answered_without_server_error(case, session)

    check()


def test_every_generated_request_gets_a_non_5xx_answer(gateway_schema: BaseSchema) -> None:
    operations: list[Operation] = []
    for result in gateway_schema.get_all_operations():
        assert isinstance(result, Ok), result  # an operation of the schema that failed to load
        operations.append(result.ok())
    assert {op.label for op in operations} >= {
        "POST /v1/chat/completions",
        "POST /v1/completions",
        "GET /v1/models",
    }
    with requests.Session() as session:
        for operation in operations:
            fuzz(operation, GenerationMode.POSITIVE, session)
            if operation.body or any(operation.iter_parameters()):  # else nothing to get wrong
                fuzz(operation, GenerationMode.NEGATIVE, session)
