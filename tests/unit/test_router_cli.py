"""``baton gateway``'s command line: flags from the shared settings, errors naming the flag."""

from __future__ import annotations

import pytest

from router.app import create_app
from router.cli import build_parser, config_from_args, main
from router.handoff import Timeouts
from router.policy import PrefillPolicy, RoutingPolicy
from router.settings import GatewayConfig


def test_flags_map_onto_the_gateway_config() -> None:
    args = build_parser().parse_args(
        [
            "--prefill=http://127.0.0.1:9001",
            "--decode=http://127.0.0.1:9002@0-3",
            "--policy=least_loaded",
            "--prefill-timeout=7",
            "--first-token-timeout=8",
            "--idle-timeout=9",
            "--health-interval=0.5",
            "--pd-threshold-tokens=64",
            "--max-body-bytes=1024",
        ]
    )
    config = config_from_args(args)
    policy, timeouts = config.settings.routing_policy(), config.settings.timeouts()
    assert policy.prefill is PrefillPolicy.LEAST_LOADED
    assert policy.pd_threshold_tokens == 64
    assert (timeouts.prefill_s, timeouts.first_token_s, timeouts.idle_s) == (7, 8, 9)
    assert config.settings.health_interval_s == 0.5
    assert config.settings.max_body_bytes == 1024
    assert config.pool is not None
    (cell,) = config.pool.cells
    assert cell.prefill == ("http://127.0.0.1:9001",)
    assert cell.decode[0].ranks == (0, 1, 2, 3)


def test_defaults_are_the_settings_defaults() -> None:
    config = config_from_args(build_parser().parse_args(["--decode=http://127.0.0.1:9002"]))
    assert config == GatewayConfig(config.pool)
    assert config.settings.routing_policy() == RoutingPolicy()
    assert config.settings.timeouts() == Timeouts()


@pytest.mark.parametrize(
    ("flag", "named"),
    [
        ("--prefill-timeout=0", "--prefill-timeout"),
        ("--max-body-bytes=-1", "--max-body-bytes"),
        ("--health-interval=-2", "--health-interval"),
        ("--workers=0", "--workers"),
    ],
)
def test_an_out_of_range_value_is_refused_naming_its_flag(
    flag: str, named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--decode=http://127.0.0.1:9002", flag]) == 2
    error = capsys.readouterr().err
    assert error.startswith("baton gateway: error: ")
    assert named in error


def test_no_engines_is_refused_with_the_ways_to_name_them(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main([]) == 2
    assert "--decode" in capsys.readouterr().err


def test_an_empty_api_key_is_refused_not_taken_as_no_authentication(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # `--api-key "$KEY"` with KEY unset
    assert main(["--decode=http://127.0.0.1:9002", "--api-key", ""]) == 2
    error = capsys.readouterr().err
    assert "--api-key is empty (an unset variable?)" in error


def test_an_https_engine_is_refused_at_load_naming_the_url(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["--decode=https://10.0.0.9:8000@0-3"]) == 2
    error = capsys.readouterr().err
    assert "'https://10.0.0.9:8000'" in error and "plain HTTP" in error


def test_a_gateway_with_no_api_keys_says_it_serves_everyone(
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = config_from_args(build_parser().parse_args(["--decode=http://127.0.0.1:9002"]))
    with caplog.at_level("WARNING", logger="baton.gateway"):
        create_app(config)
    assert "no API keys: every client is served without authentication" in caplog.text


def test_model_deployment_repeats_for_one_pool_per_deployment() -> None:
    args = build_parser().parse_args(
        ["--model-deployment=serving/dsv4", "--model-deployment", "small/tiny"]
    )
    config = config_from_args(args)
    assert config.pool is None
    assert [ref.key for ref in config.model_deployments] == ["serving/dsv4", "small/tiny"]


def test_a_model_deployment_given_twice_is_refused_by_name(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = main(["--model-deployment=serving/dsv4", "--model-deployment=serving/dsv4"])
    assert code == 2
    assert "--model-deployment serving/dsv4 given twice" in capsys.readouterr().err
