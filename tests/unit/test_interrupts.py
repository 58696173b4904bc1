"""Interrupting the suite ends in pytest's summary, not in a traceback of pytest's own."""

from __future__ import annotations

import pytest

from tests.helpers import ROOT


def test_ctrl_c_during_a_fixtures_setup_ends_with_the_summary(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Seen interrupting `make test`: a KeyError from a StashKey in pytest's tmp_path teardown,
    # and no summary of what had failed.
    pytester.makepyfile(
        """
        import pytest

        @pytest.fixture
        def engine(tmp_path):
            raise KeyboardInterrupt  # Ctrl-C while the fixture starts a process
            yield tmp_path

        def test_served(engine):
            pass
        """
    )
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    result = pytester.runpytest_subprocess("-p", "tests.interrupts")
    result.stdout.fnmatch_lines(["*KeyboardInterrupt*", "*no tests ran*"])
    assert "KeyError" not in result.stdout.str() + result.stderr.str()
    assert result.ret == pytest.ExitCode.INTERRUPTED
