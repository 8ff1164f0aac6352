"""No import cycles between the project's modules. Every import counts, also one inside a function or under
TYPE_CHECKING: deferring an import hides a cycle from the interpreter but leaves two modules that each need the
other, which is the coupling this test is for. Importing a.b.c also runs a/__init__ and a/b/__init__."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("router", "tokenizer_svc", "shard_svc", "kimiserve", "launcher", "native")


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py") if (ROOT / pkg).is_dir() else ():
            rel = path.relative_to(ROOT).with_suffix("")
            if rel.parts[:2] == ("kimiserve", "v1"):  # generated gRPC stubs
                continue
            mods[".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)] = path
    return mods


def _imported_names(module: str, path: Path) -> set[str]:
    names = set()
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
    return names


def import_graph() -> dict[str, set[str]]:
    mods = _modules()

    def owner(name: str) -> str | None:  # the project module a dotted name lives in, if any
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, path in mods.items():
        deps = {owner(n) for n in _imported_names(module, path)} - {None, module}
        parents = {".".join(d.split(".")[:i]) for d in deps for i in range(1, d.count(".") + 1)}
        graph[module] = deps | {p for p in parents if p in mods and not module.startswith(p + ".") and p != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_imports_of_every_kind():
    graph = import_graph()
    assert "shard_svc.engine.engine" in graph["shard_svc.build"] or \
        "shard_svc.engine.assemble" in graph["shard_svc.build"]
    assert "router.batch" in graph["router.batch.runner"]  # a package's __init__ runs too


def test_no_module_imports_itself_through_others():
    graph = import_graph()
    found = cycles(graph)
    described = ["; ".join(f"{m} -> {sorted(d for d in graph[m] if d in c)}" for m in c) for c in found]
    assert not found, "import cycles:\n" + "\n".join(described)


def test_a_cycle_is_found():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
