"""A Ray replica is a process of its own: once its engine is built, its start-up heap is
frozen as `prelude serve`'s is (heap.py), so full collections there skip the model."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
_PROBE = """
import gc, sys
from pathlib import Path
from prelude.cluster.replica import EngineReplica
from tests.cluster.tiny_replica import tiny_factory
factory = tiny_factory(Path(sys.argv[1]))
before = gc.get_freeze_count()
replica = EngineReplica(factory, index=0, threads=None)
print(before, gc.get_freeze_count(), replica.ping())
"""


def test_a_replica_freezes_its_heap_once_its_engine_is_built(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", _PROBE, str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    before, after, _ = (int(x) for x in done.stdout.split())
    assert before == 0 and after > 1000  # the engine, the model and the imports, frozen
