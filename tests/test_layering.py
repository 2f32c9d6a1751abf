"""The import graph of engine/, pipeline/ and flows/ as the architecture draws it.

Every `import` and `from ... import` is read with `ast` (inside functions too: a lazy import
is still a dependency) and resolved to the module it loads. The graph must have no cycle, and
no arrow against the layers:

    flows -> pipeline -> engine
    engine: facade (engine, engine.llm) -> core -> scheduler / KV cache / runner
            -> model (models, quantization, weights, sharding) -> attention -> kernels,
            with a foundation of records and rules (config, request, outputs, tokenizer, ...)
            that every layer may import and that imports only itself.

A module imports its own layer or the layers below it. A new module must be given a layer
here (an unplaced one fails the test).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("flows", "pipeline", "engine")

# edges another change removes; each names why it is still here
ALLOWED: set[tuple[str, str]] = set()  # (importer, imported) pairs let through; none today

# engine's layers, top first; a module belongs to the first entry that is it or its package
ENGINE_LAYERS = [
    ("facade", ["engine", "engine.llm"]),
    ("core", ["engine.core", "engine.scoring", "engine.input_processor", "engine.output_processor",
              "engine.loader", "engine.spec_decode", "engine.parallel.executor", "engine.parallel.worker",
              "engine.parallel"]),
    ("scheduler / kv cache / runner", ["engine.scheduler", "engine.kv_cache", "engine.kv_cache_manager",
                                       "engine.model_runner", "engine.sampler", "engine.cuda_graph"]),
    ("model", ["engine.models", "engine.quant", "engine.gguf_blocks", "engine.smoothquant", "engine.calibration_cache",
               "engine.weights", "engine.parallel.sharding", "engine.parallel.group"]),
    ("attention", ["engine.attention"]),
    ("kernels", ["engine.kernels", "engine.threads", "engine.host"]),
    ("foundation", ["engine.config", "engine.request", "engine.outputs", "engine.metrics",
                    "engine.model_config", "engine.tokenizer", "engine.model_zoo", "engine.gguf_index",
                    "engine.disk_cache", "engine.structured"]),
]


def _modules(root: Path) -> dict[str, tuple[Path, bool]]:
    """module name -> (file, is a package's __init__), for the packages under `root`."""
    mods = {}
    for pkg in PACKAGES:
        for path in (root / pkg).rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            if is_pkg:
                parts = parts[:-1]
            mods[".".join(parts)] = (path, is_pkg)
    return mods


def _resolve(name: str, mods) -> str | None:
    """The module of ours that `name` (a module or a name inside one) loads, or None (not ours)."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the modules of ours it imports (anywhere in its body), for the tree at `root`."""
    mods = _modules(root)
    graph: dict[str, set[str]] = {}
    for mod, (path, is_pkg) in mods.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[:len(base) - (node.level - 1)]
                    prefix = ".".join(base + ([node.module] if node.module else []))
                else:
                    prefix = node.module or ""
                # `from pkg import sub` loads pkg.sub; `from mod import name` loads mod
                targets = [f"{prefix}.{a.name}" if f"{prefix}.{a.name}" in mods else prefix for a in node.names]
            else:
                continue
            deps.update(t for t in (_resolve(n, mods) for n in targets) if t is not None and t != mod)
        graph[mod] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def engine_layer(mod: str) -> int:
    """The index of `mod`'s layer in ENGINE_LAYERS (0: the top).

    Raises:
        KeyError: the module is in no layer.
    """
    best = None
    for rank, (_, prefixes) in enumerate(ENGINE_LAYERS):
        for p in prefixes:
            if (mod == p or mod.startswith(p + ".")) and (best is None or len(p) > best[1]):
                best = (rank, len(p))
    if best is None:
        raise KeyError(mod)
    return best[0]


def back_arrows(graph: dict[str, set[str]]) -> list[str]:
    """Every edge that points up a layer, as 'a -> b (why)'."""
    top = {pkg: i for i, pkg in enumerate(PACKAGES)}  # flows 0 (top), pipeline 1, engine 2
    bad = []
    for a in sorted(graph):
        for b in sorted(graph[a]):
            if (a, b) in ALLOWED:
                continue
            pa, pb = a.split(".")[0], b.split(".")[0]
            if top[pb] < top[pa]:
                bad.append(f"{a} -> {b} ({pa} imports {pb})")
            elif pa == pb == "engine" and engine_layer(b) < engine_layer(a):
                bad.append(f"{a} -> {b} ({ENGINE_LAYERS[engine_layer(a)][0]} imports "
                           f"{ENGINE_LAYERS[engine_layer(b)][0]})")
    return bad


GRAPH = import_graph()


def test_every_engine_module_has_a_layer():
    unplaced = []
    for m in sorted(GRAPH):
        if m.split(".")[0] == "engine":
            try:
                engine_layer(m)
            except KeyError:
                unplaced.append(m)
    assert unplaced == []


def test_no_import_cycles():
    assert cycles(GRAPH) == []


def test_no_import_against_the_layers():
    assert back_arrows(GRAPH) == []


def test_allowed_edges_still_exist():
    """An ALLOWED edge that is gone must leave the list (it would silently allow it again)."""
    assert [e for e in sorted(ALLOWED) if e[1] not in GRAPH.get(e[0], set())] == []


def test_the_checks_catch_a_cycle_a_back_arrow_and_a_lazy_import(tmp_path):
    """The walker on a made-up tree: a function-level import that closes a cycle, and an engine
    module importing the facade, are both reported."""
    for rel, text in {
        "engine/__init__.py": "",
        "engine/llm.py": "from .core import step\n",
        "engine/core.py": "def step():\n    from .llm import LLM\n",
        "engine/kernels/__init__.py": "from engine.scheduler import Scheduler\n",
        "engine/scheduler.py": "",
        "pipeline/__init__.py": "",
        "flows/__init__.py": "import pipeline\n",
    }.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    graph = import_graph(tmp_path)
    assert graph["engine.core"] == {"engine.llm"}  # found inside the function
    assert cycles(graph) == [["engine.core", "engine.llm"]]
    assert back_arrows(graph) == [
        "engine.core -> engine.llm (core imports facade)",
        "engine.kernels -> engine.scheduler (kernels imports scheduler / kv cache / runner)",
    ]


@pytest.mark.parametrize("mod, layer", [("engine.llm", "facade"), ("engine.loader", "core"),
                                        ("engine.parallel.sharding", "model"), ("engine.kernels.cpu.layers", "kernels")])
def test_layers_by_longest_prefix(mod, layer):
    assert ENGINE_LAYERS[engine_layer(mod)][0] == layer
