"""One spawned worker process that runs Triton kernels under TRITON_INTERPRET=1.

Triton decides whether kernels (its own standard library's included) are compiled or
interpreted when they are defined, i.e. when triton is first imported. So interpreted
checks run in a spawned worker that sets TRITON_INTERPRET=1 before anything there imports
triton: the test process's environment and modules are never touched, nothing leaks into
other tests, and `gpu` tests import the real, compiled kernels. A test module calls its
module-level `check_*` functions through the `interp` fixture (tests/model/conftest.py).
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import sys
from types import ModuleType
from typing import Any, Callable, Iterator

Run = Callable[..., Any]


def _enter_interpreter() -> None:
    """Worker initializer: runs before the worker imports triton."""
    assert "triton" not in sys.modules
    os.environ["TRITON_INTERPRET"] = "1"


def interpreted(module: str) -> ModuleType:
    """`module` imported in the interpreter worker (only there)."""
    assert os.environ.get("TRITON_INTERPRET") == "1", "check_* functions run in the interpreter worker"
    return importlib.import_module(module)


def interpreter_worker() -> Iterator[Run]:
    """run(check_fn, *args): check_fn(*args) in a spawned interpreter worker (the `interp`
    fixture of tests/model/conftest.py yields one per test module)."""
    with multiprocessing.get_context("spawn").Pool(1, initializer=_enter_interpreter) as pool:
        yield lambda fn, *args: pool.apply(fn, args)
