"""No module of k3core imports, at import time, a module that imports it back.

The graph is read from the source (ast), not by importing: an edge a -> b is an `import` or `from ... import` that
runs when a is imported (module level, including inside `if`/`try` and class bodies; not inside a function, and
not under `if TYPE_CHECKING:`). `from k3core.x import y` points at `k3core.x.y` when that is a module, else at
`k3core.x`.
"""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "k3core"


def module_names(package: Path) -> dict[str, Path]:
    names = {}
    for path in package.rglob("*.py"):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names[".".join(parts)] = path
    return names


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_time_imports(body: list[ast.stmt]):
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        elif isinstance(node, ast.If):
            if not _is_type_checking(node):
                yield from _import_time_imports(node.body)
            yield from _import_time_imports(node.orelse)
        else:                                       # class bodies, try/with/for/while blocks run at import
            for field in ("body", "orelse", "finalbody"):
                yield from _import_time_imports(getattr(node, field, []))
            for handler in getattr(node, "handlers", []):
                yield from _import_time_imports(handler.body)


def import_graph(package: Path) -> dict[str, set[str]]:
    """module -> the modules of the same package it imports at import time."""
    modules = module_names(package)

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _import_time_imports(ast.parse(path.read_text(), str(path)).body):
            if isinstance(node, ast.Import):
                targets = [owner(alias.name) for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = here.split(".")[: len(here.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                targets = [owner(f"{base}.{alias.name}") for alias in node.names]
            graph[name].update(t for t in targets if t is not None and t != name)
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
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_k3core_has_no_import_time_cycle():
    graph = import_graph(PACKAGE)
    assert "k3core.llm" in graph and "k3core.cache.radix_cache" in graph
    found = cycles(graph)
    assert not found, "import cycles inside k3core/ (move the shared name to a module both can import): " + \
        "; ".join(" <-> ".join(c) for c in found)


def test_the_check_sees_a_cycle(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("try:\n    from ..c import thing\nexcept ImportError:\n    pass\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    (pkg / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.e\n"
                              "def f():\n    import pkg.e\n")
    (pkg / "e.py").write_text("import pkg.d\n")
    assert cycles(import_graph(pkg)) == [["pkg.a", "pkg.c", "pkg.sub.b"]]
