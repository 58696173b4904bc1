"""Ctrl-C ends a run with pytest's summary of what failed, even during a fixture's setup.

pytest's ``tmp_path`` teardown reads the test's result, which its report hook stores only once a
phase has reported; a Ctrl-C while a fixture starts a process (most of this suite's setups)
leaves none, and the teardown's ``KeyError`` replaced the summary. An empty result, stored before
setup, is what pytest reads for a test that never ran (it keeps the directory).
"""

from __future__ import annotations

import pytest
from _pytest.tmpdir import tmppath_result_key


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    item.stash.setdefault(tmppath_result_key, {})
