"""The import graph keeps its layers: lower packages never import higher ones."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "prelude"

_ABOVE_KERNELS = ("prelude.model", "prelude.executor", "prelude.engine", "prelude.entrypoints", "prelude.kv",
                  "prelude.tokenizer", "prelude.cluster", "prelude.bench", "prelude.config")
# The model layer's rooms, lowest first: kernels, then layers and attention, then the
# fast paths and LoRA, then the architectures over the decoder trunk, the registry, loading.
_MODEL_TOP = ("prelude.model.arch", "prelude.model.registry", "prelude.model.loading", "prelude.model.decoder")

# package (folder under src/prelude) -> packages it must not import (at any depth of its own modules)
FORBIDDEN = {
    "kernels": _ABOVE_KERNELS,
    "model/layers": (*_MODEL_TOP, "prelude.model.fast_paths", "prelude.model.lora", "prelude.model.read_positions"),
    "model/attention": (*_MODEL_TOP, "prelude.model.fast_paths", "prelude.model.lora", "prelude.model.layers"),
    "model/fast_paths": _MODEL_TOP,
    "model/lora": (*_MODEL_TOP, "prelude.model.fast_paths"),
    "model/arch": ("prelude.model.loading", "prelude.model.registry"),
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


def _module_of(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_the_import_graph_has_no_cycles() -> None:
    """Between modules (imports inside functions and TYPE_CHECKING blocks counted), and
    between the model layer's folders."""
    modules = {_module_of(p): p for p in SRC.rglob("*.py")}
    graph = {m: {n for n in _imports(p) if n in modules and n != m} for m, p in modules.items()}

    def room(module: str) -> str:
        parts = module.split(".")
        return ".".join(parts[:3]) if len(parts) > 3 and parts[1] in ("model", "kernels") else module

    rooms: dict[str, set[str]] = {}
    for m, deps in graph.items():
        rooms.setdefault(room(m), set()).update(room(d) for d in deps if room(d) != room(m))
    for g in (graph, rooms):
        state: dict[str, int] = {}
        stack: list[str] = []

        def visit(node: str) -> None:
            state[node] = 1
            stack.append(node)
            for nxt in sorted(g.get(node, ())):
                if state.get(nxt) == 1:
                    raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(nxt):] + [nxt]))
                if nxt not in state:
                    visit(nxt)
            stack.pop()
            state[node] = 2

        for node in sorted(g):
            if node not in state:
                visit(node)


def test_value_type_modules_are_leaves() -> None:
    for leaf in LEAVES:
        prelude_imports = {n for n in _imports(SRC / leaf) if n.startswith("prelude")}
        assert prelude_imports <= {"prelude.params"}, (leaf, prelude_imports)
