"""``baton controller``'s command line: one Lease namespace from the chart or a shell."""

from __future__ import annotations

from pathlib import Path

import pytest

from controller.cli import build_parser, main


def test_outside_a_pod_the_lease_namespace_must_be_named(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("POD_NAMESPACE", raising=False)
    with pytest.raises(SystemExit) as exited:
        main(["--kubeconfig", "/nonexistent/kubeconfig"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--lease-namespace is required outside a pod" in err
    assert "release namespace" in err


def test_in_a_pod_the_lease_is_in_the_pods_namespace_as_the_chart_renders_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("POD_NAMESPACE", "baton-system")
    assert build_parser().parse_args([]).lease_namespace == "baton-system"


def test_a_straggler_window_under_one_second_is_refused_with_the_flags_named(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--lease-namespace", "default", "--straggler-window-seconds", "0"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--straggler-window-seconds and --straggler-windows must be at least 1" in err
    assert "got 0 and 3" in err


def test_without_the_flag_the_controller_reads_the_kubeconfig_that_kubeconfig_names(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # As kubectl and controller-runtime do: a pod of the dev cluster is given its service
    # account's kubeconfig this way. An unreadable one is named in the error.
    broken = tmp_path / "kubeconfig"
    broken.write_text("{}")
    monkeypatch.setenv("KUBECONFIG", str(broken))
    assert main(["--lease-namespace", "default"]) == 2
    assert f"cannot load {broken}" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--straggler-step-slowdown", "1"],
            "--straggler-step-slowdown must be above 1 (got 1.0)",
        ),
        (
            ["--performance-profile", "h100.yaml"],
            "--performance-profile: h100.yaml: cannot read the profile",
        ),
    ],
)
def test_a_step_bound_or_profile_the_watch_cannot_use_is_refused_naming_it(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--lease-namespace", "default", *flags])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err
