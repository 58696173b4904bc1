"""The real Prometheus of deploy/dev scraping live vLLM engines behind the gateway (``baton up
--engine vllm``): every dashboard query and rule that reads a ``vllm:*`` series answers."""

from __future__ import annotations

import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from baton.up import LIVE_SERVED_NAME
from deploy.grafana.dashboards import DASHBOARDS
from rigs.devcluster import binaries_dir
from rigs.observability import Prometheus, start_prometheus
from rigs.processes import free_port
from tests.helpers import grafana_expr
from tests.live.conftest import baton_up_live

VLLM = re.compile(r"vllm:[a-z_:]+")


def chat(url: str, session: int, turn: int) -> None:
    with openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0) as client:
        stream = client.chat.completions.create(
            model=LIVE_SERVED_NAME,
            messages=[
                {"role": "system", "content": "plan the rollout of the next cell " * 30},
                {"role": "user", "content": f"session {session} turn {turn} " * (20 + turn)},
            ],
            max_tokens=16,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        assert list(stream)


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Prometheus]:
    directory = tmp_path_factory.mktemp("prometheus")
    with (
        baton_up_live(directory) as stack,
        # no controller here: its scrape target is a port nothing listens on
        start_prometheus(
            binaries_dir(), directory, file_sd=stack.targets, controller=f"127.0.0.1:{free_port()}"
        ) as running,
    ):
        running.wait_for('vllm:num_requests_running{role="decode"}', timeout=120)
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda i: chat(stack.url, i % 4, i // 4), range(16)))
        running.wait_caught_up(stack.url, timeout=120)
        yield running


@pytest.mark.parametrize("uid", [spec.uid for spec in DASHBOARDS])
def test_every_panel_query_on_vllm_series_returns_data_from_live_engines(
    prometheus: Prometheus, uid: str
) -> None:
    [spec] = [spec for spec in DASHBOARDS if spec.uid == uid]
    empty = [
        f"{panel.title}: {query.expr}"
        for panel in spec.panels
        for query in panel.queries
        if VLLM.search(query.expr) and not prometheus.query(grafana_expr(query.expr))
    ]
    assert not empty, "queries on vLLM series without data:\n" + "\n".join(empty)


def test_every_rule_on_vllm_series_evaluates_and_records_data(prometheus: Prometheus) -> None:
    rules = [rule for rule in prometheus.rules() if VLLM.search(rule["query"])]
    assert rules
    for rule in rules:
        assert rule["health"] == "ok", (rule["name"], rule.get("lastError"))
        if rule["type"] == "recording":
            assert prometheus.query(rule["name"]), f"{rule['name']} recorded no data"
