"""One local Ray instance for the cluster tests (started once: it takes ~10 s), sized
for a 2-core machine: replicas ask for 1 logical CPU each and share the cores."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterator

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="package")
def ray_local() -> Iterator[None]:
    ray = pytest.importorskip("ray")
    # Replica workers import prelude and tests.* (the tiny model factory) like this process.
    paths = [str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()
