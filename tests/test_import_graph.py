"""The import graph of the tracked Python files: no cycle anywhere, and the target reaches the draft
service's code through one module (target_service/draft_local.py, the in-process draft).

Every import counts, at module level or inside a function, under TYPE_CHECKING or not: a lazy import
hides a cycle from the interpreter, not from a reader. Read with ast, nothing is imported."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _modules() -> dict[str, Path]:
    """Dotted module name -> file, for every tracked .py file (a package is its __init__.py)."""
    out = subprocess.run(["git", "ls-files", "-z", "*.py"], cwd=ROOT, capture_output=True, check=True).stdout
    modules = {}
    for name in filter(None, out.decode().split("\0")):
        parts = name.removesuffix(".py").split("/")
        if parts[-1] == "__init__":
            parts.pop()
        if (ROOT / name).is_file():
            modules[".".join(parts)] = ROOT / name
    return modules


def _project_module(name: str, modules: dict[str, Path]) -> str | None:
    """The tracked module `name` is, or is inside (None: outside the project)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(_project_module(a.name, modules) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: up level - 1 packages from this one
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            for a in node.names:  # `from pkg import module` imports the module
                full = f"{base}.{a.name}"
                found.add(full if full in modules else _project_module(base, modules))
    return found - {None, module}


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: _imports(m, path, modules) for m, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_cycles_finds_a_cycle_and_only_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e2"}, "e2": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_among_the_tracked_modules():
    graph = import_graph()
    assert {"common.metrics", "target_service.scheduler", "draft_service.stream"} <= graph.keys()
    assert "draft_service.state" in graph["draft_service.stream"]  # power: imports are read
    assert cycles(graph) == []


def test_the_target_reaches_the_draft_service_through_one_module():
    graph = import_graph()
    importers = sorted(
        m for m, deps in graph.items()
        if m.startswith("target_service.") and any(d.startswith("draft_service") for d in deps)
    )  # fmt: skip
    assert importers == ["target_service.draft_local"]
