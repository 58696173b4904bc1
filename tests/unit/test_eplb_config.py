"""``baton eplb``'s configuration file: defaults, field checks, and the CLI's exit status."""

from pathlib import Path

import pytest

from baton.core.model import EXPERT_BYTES
from eplb.cli import main
from eplb.config import load_config


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "eplb.yaml"
    path.write_text(text)
    return path


def test_a_minimal_file_takes_the_documented_defaults(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, "groups: [{name: cell-0, agents: ['h:1']}]"))
    policy = config.policy
    assert (policy.window_size, policy.step_interval) == (500, 500)
    assert (policy.min_gain, policy.tolerance) == (0.002, 0.005)
    assert config.expert_bytes_of("draft") == EXPERT_BYTES
    assert config.groups[0].agents == ("h:1",)
    assert config.model_names() == {384: "target", 128: "draft"}


def test_the_models_a_report_may_name_are_the_files_own(tmp_path: Path) -> None:
    # A service in plugin mode that follows no ModelDeployment serves whatever model its
    # engines run, named by expert count as in spec.eplb.models.
    text = "models: [{name: tiny, experts: 16, topK: 2}]\ngroups: [{name: a, agents: ['h:1']}]"
    assert load_config(write(tmp_path, text)).model_names() == {16: "tiny"}


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        pytest.param("groups: []", "field 'groups'", id="no groups"),
        pytest.param(
            "windowSize: 600\nstepInterval: 300\ngroups: [{name: a, agents: ['h:1']}]",
            "must not exceed stepInterval",
            id="window longer than interval",
        ),
        pytest.param(
            "applyMarginSteps: 500\ngroups: [{name: a, agents: ['h:1']}]",
            "must be below stepInterval",
            id="margin past the next decision",
        ),
        pytest.param(
            "windowSise: 100\ngroups: [{name: a, agents: ['h:1']}]",
            "field 'windowSise'",
            id="misspelt field",
        ),
        pytest.param(
            "groups: [{name: a, agents: ['h:1']}, {name: a, agents: ['h:2']}]",
            "unique",
            id="duplicate group",
        ),
        pytest.param(
            "models: [{name: a, experts: 16, topK: 2}, {name: b, experts: 16, topK: 2}]\n"
            "groups: [{name: a, agents: ['h:1']}]",
            "each model needs its own",
            id="two models of one expert count",
        ),
    ],
)
def test_a_bad_file_names_the_field(tmp_path: Path, text: str, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        load_config(write(tmp_path, text))


def test_the_cli_exits_2_on_a_bad_file_or_token(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    assert main(["--config", str(tmp_path / "missing.yaml")]) == 2
    assert "cannot read the config file" in capsys.readouterr().err
    good = write(tmp_path, "groups: [{name: a, agents: ['h:1']}]")
    (tmp_path / "empty-token").write_text("\n")
    assert main(["--config", str(good), "--token-file", str(tmp_path / "empty-token")]) == 2
    assert "the token file is empty" in capsys.readouterr().err
