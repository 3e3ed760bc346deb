"""The import graph keeps its layers: lower packages never import higher ones."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "prelude"

# package -> packages it must not import (directly, at any depth of its own modules)
FORBIDDEN = {
    "executor": ("prelude.engine", "prelude.entrypoints"),
    "model": ("prelude.engine", "prelude.executor", "prelude.entrypoints", "prelude.kv"),
    "kv": ("prelude.engine", "prelude.executor", "prelude.entrypoints", "prelude.model"),
    "engine": ("prelude.entrypoints", "prelude.model"),
    "tokenizer": ("prelude.engine", "prelude.executor", "prelude.entrypoints", "prelude.model"),
    # a helper the tests and benchmarks share: it builds checkpoints, it serves nothing
    "testing": ("prelude.engine", "prelude.executor", "prelude.entrypoints", "prelude.bench", "prelude.cluster"),
}
LEAVES = ("params.py", "forward_batch.py", "config.py")


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def test_lower_layers_import_no_higher_layer() -> None:
    bad = []
    for package, forbidden in FORBIDDEN.items():
        for path in (SRC / package).rglob("*.py"):
            for name in _imports(path):
                if name.startswith(forbidden):
                    bad.append(f"{path.relative_to(SRC)} imports {name}")
    assert not bad, bad


def test_value_type_modules_are_leaves() -> None:
    for leaf in LEAVES:
        prelude_imports = {n for n in _imports(SRC / leaf) if n.startswith("prelude")}
        assert prelude_imports <= {"prelude.params"}, (leaf, prelude_imports)
