"""An engine's API server before its engine core's queue (the profile's ``frontend``)."""

from __future__ import annotations

import pytest

from baton.core.perf import api_server_ready
from baton.core.profile import FrontendProfile, load_profile

FRONTEND = FrontendProfile(request_s=0.01, tokenize_per_token_s=2e-6)


def test_a_prompt_sent_as_ids_pays_the_request_time_alone() -> None:
    assert api_server_ready(FRONTEND, 5.0, 7.0, None) == (5.01, 7.0)


def test_a_text_prompt_is_tokenized_before_it_reaches_the_queue() -> None:
    ready, free = api_server_ready(FRONTEND, 5.0, 0.0, 10_000)
    assert free == pytest.approx(5.02)
    assert ready == pytest.approx(5.03)


def test_text_prompts_queue_for_the_one_tokenizing_thread() -> None:
    _, free = api_server_ready(FRONTEND, 5.0, 0.0, 10_000)
    ready, free = api_server_ready(FRONTEND, 5.0, free, 10_000)  # arrived together
    assert free == pytest.approx(5.04)
    assert ready == pytest.approx(5.05)


def test_a_profile_without_a_frontend_sends_requests_straight_to_the_queue() -> None:
    frontend = load_profile().frontend
    assert api_server_ready(frontend, 5.0, 0.0, 10_000) == (5.0, 0.0)
