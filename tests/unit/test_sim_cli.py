"""``baton sim`` flag errors name the flag and the fix, and exit with status 2."""

from __future__ import annotations

from pathlib import Path

import pytest

from sim.cli import build_parser, config_from_args, main, split_unknown_flags


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = main(list(argv))
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--kv-transfer-config", "{oops"], "--kv-transfer-config: not valid JSON"),
        (
            ["--kv-transfer-config", '{"kv_load_failure_policy": "retry"}'],
            "field 'kv_load_failure_policy'",
        ),
        (["--eplb-config", '{"window_size": 0}'], "--eplb-config: field 'window_size'"),
        (
            ["--kv-events-config", '{"enable_kv_cache_events": true, "endpoint": "tcp://*:0"}'],
            "port 0: give a port",
        ),
        (
            ["--kv-events-config", '{"replay_endpoint": "tcp://*:5558"}'],
            "no replay buffer: leave replay_endpoint out",
        ),
        (["--kv-events-config", '{"publisher": "kafka"}'], "--kv-events-config: field 'publisher'"),
        (
            [
                "--data-parallel-size",
                "4",
                "--data-parallel-start-rank",
                "3",
                "--data-parallel-size-local",
                "2",
            ],
            "does not fit in --data-parallel-size 4",
        ),
        (["--time-scale", "0"], "--time-scale: must be positive"),
        (["--profile", "/nonexistent.yaml"], "--profile: /nonexistent.yaml: cannot read"),
        (
            ["--eplb-agent-token-file", "/nonexistent-token"],
            "--eplb-agent-token-file: /nonexistent-token: cannot read the token file",
        ),
        (["--eplb-agent-tls-cert", "/tmp/cert.pem"], "go together; pass both or neither"),
        (
            ["--eplb-agent-token-file", "/nonexistent-token", "--eplb-agent-insecure"],
            "--eplb-agent-insecure and --eplb-agent-token-file contradict each other",
        ),
        (
            ["--enable-fault-injection"],
            "--enable-fault-injection and --fault-injection-token-file go together",
        ),
        (
            ["--enable-fault-injection", "--fault-injection-token-file", "/nonexistent-token"],
            "--fault-injection-token-file: /nonexistent-token: cannot read the token file",
        ),
    ],
    ids=[
        "json",
        "kv-policy",
        "eplb-window",
        "kv-events-port-0",
        "kv-events-replay",
        "kv-events-publisher",
        "dp-ranks",
        "time-scale",
        "profile-missing",
        "token-file-missing",
        "tls-half",
        "token-and-insecure",
        "faults-without-token",
        "faults-token-missing",
    ],
)
def test_bad_flag_exits_2_naming_the_flag(
    capsys: pytest.CaptureFixture[str], argv: list[str], needle: str
) -> None:
    code, err = run(capsys, *argv)
    assert code == 2
    assert needle in err


def test_bad_profile_field_names_file_field_and_fix(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    profile = tmp_path / "p.yaml"
    profile.write_text("model: m\nhardware: h\nkv_bytes_per_token: -1\n")
    code, err = run(capsys, "--profile", str(profile))
    assert code == 2
    assert str(profile) in err and "field 'kv_bytes_per_token'" in err
    assert "start from the default profile" in err


def test_bad_cluster_file_names_the_field(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    cluster = tmp_path / "c.yaml"
    cluster.write_text(
        "decode_groups: [{name: d, port: 1, side_channel_port: 2, api_servers: 3}]\n"
    )
    code, err = run(capsys, "--cluster", str(cluster))
    assert code == 2
    assert "api_servers (3) must divide data_parallel_size (32)" in err


def test_unknown_flags_and_their_values_are_set_aside() -> None:
    kept, unknown = split_unknown_flags(
        build_parser(),
        [
            "my-model",
            "--all2all-backend",
            "deepep_low_latency",
            "--async-scheduling",
            "--port",
            "9000",
            "--gpu-memory-utilization=0.9",
        ],
    )
    assert kept == ["my-model", "--port", "9000"]
    assert unknown == [
        "--all2all-backend",
        "deepep_low_latency",
        "--async-scheduling",
        "--gpu-memory-utilization=0.9",
    ]


def test_data_parallel_rank_means_one_external_lb_rank() -> None:
    args = build_parser().parse_args(["--data-parallel-size", "32", "--data-parallel-rank", "7"])
    config = config_from_args(args)
    assert list(config.local_ranks) == [7]
