"""Suite-wide fixtures."""

from __future__ import annotations

import logging
from typing import Iterator

import pytest

from prelude.executor.spare_cores import SpareCores


@pytest.fixture(autouse=True)
def machine_never_quiet(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A tiny model's steps stay on one thread whatever else the machine runs
    (executor/spare_cores.py measures that), so that no test's thread count, and with it a
    GEMM's summation order, depends on the CI machine's load. Tests of the quiet path give
    StepThreads a probe of their own, or call SpareCores' own `quiet`."""
    monkeypatch.setattr(SpareCores, "quiet", lambda self: False)
    yield


@pytest.fixture(autouse=True)
def root_logging_kept() -> Iterator[None]:
    """A test that runs `prelude.cli.main` sets the process's logging up: a plain
    StreamHandler on the stderr pytest captures for that test, the root at INFO. Left there,
    every later log line (the access log of other tests' servers, from their threads) hits
    a closed file and prints a logging error with its whole stack. Such a handler goes, and
    the level comes back, after the test (pytest's own capture handlers are its business)."""
    root = logging.getLogger()
    before, level = set(root.handlers), root.level
    yield
    added = [h for h in root.handlers if h not in before and type(h) is logging.StreamHandler]
    for handler in added:
        root.removeHandler(handler)
    if added:
        root.setLevel(level)
