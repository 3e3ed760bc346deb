"""Suite-wide fixtures."""

from __future__ import annotations

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
