"""Fixtures shared by the model tests."""

from __future__ import annotations

from typing import Iterator

import pytest

from tests.model.triton_interp import Run, interpreter_worker


@pytest.fixture(scope="module")
def interp() -> Iterator[Run]:
    """run(check_fn, *args): check_fn(*args) under TRITON_INTERPRET=1 in a spawned worker."""
    yield from interpreter_worker()
