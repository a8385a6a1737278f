"""Imports run one way: no cycle anywhere in mlc_lora (every import counts, also one inside a
function), the runtime layer (runner) knows nothing of the engine or the server, and the engine and
the server never import the compiler (compiler_passes)."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = {"mlc_lora": ROOT / "python" / "mlc_lora", "mlc_lora.compiler_passes": ROOT / "compiler_passes"}


def _modules() -> dict[str, tuple[Path, bool]]:
    """module name -> (file, is a package __init__)."""
    out = {}
    for prefix, base in SOURCES.items():
        for path in base.rglob("*.py"):
            parts = list(path.relative_to(base).with_suffix("").parts)
            package = parts[-1] == "__init__"
            if package:
                parts = parts[:-1]
            out[".".join([prefix, *parts])] = (path, package)
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the mlc_lora modules it imports (`from pkg import mod` counts as mod, not pkg)."""
    modules = _modules()

    def known(name: str) -> str:
        while name not in modules:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for name, (path, package) in modules.items():
        here = name if package else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = here
                    for _ in range(node.level - 1):
                        pkg = pkg.rpartition(".")[0]
                    base = f"{pkg}.{base}" if base else pkg
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            edges |= {known(t) for t in targets if t.split(".")[0] == "mlc_lora"}
        graph[name] = edges - {name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_cycles_are_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle_in_mlc_lora():
    graph = import_graph()
    assert len(graph) > 60 and "mlc_lora.runner.sharded" in graph
    assert cycles(graph) == []


def test_layers_import_one_way():
    graph = import_graph()
    for name, edges in graph.items():
        layer = name.split(".")[1] if "." in name else ""
        if layer in ("engine", "serve", "runner"):
            assert not [e for e in edges if e.startswith("mlc_lora.compiler_passes")], name
        if layer == "runner":
            assert not [e for e in edges if e.split(".")[1:2] in (["engine"], ["serve"])], name
        if layer == "engine":
            assert not [e for e in edges if e.startswith("mlc_lora.serve")], name
