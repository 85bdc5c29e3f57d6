"""No import circle in the package: every module under shared/ and services/ (mapped to its `pdserve.*` name through
pyproject.toml's package-dir) is parsed, and every `pdserve` import it makes, at module level, under
`if TYPE_CHECKING`, or inside a function, is an edge to the module it names. A strongly connected group of two or
more modules fails the test with one of its circles spelled out."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def package_dirs() -> dict[str, Path]:
    """Package name -> its folder, from pyproject.toml (`pdserve` -> shared, `pdserve.router` -> services/router...)."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return {name: ROOT / folder for name, folder in cfg["tool"]["setuptools"]["package-dir"].items()}


def module_files() -> dict[str, Path]:
    """Every module's dotted name -> its file (a package is its __init__.py); a file under a nested package-dir
    (services/router under `pdserve.router`) is named by that, the most specific mapping."""
    dirs = package_dirs()
    out: dict[str, Path] = {}
    for pkg, folder in sorted(dirs.items(), key=lambda kv: len(kv[0])):  # nested mappings override
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([pkg, *parts])] = path
    return out


def imported_modules(name: str, path: Path, modules: set[str]) -> set[str]:
    """The package's modules `name` imports anywhere in its file (relative imports resolved)."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def add(target: str) -> None:
        while target and target not in modules:  # `import pdserve.a.b.attr`: the longest module prefix
            target = target.rpartition(".")[0]
        if target and target != name:
            found.add(target)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                full = f"{source}.{alias.name}"
                add(full if full in modules else source)  # a submodule, else a name of `source`
    return found


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    names = set(files)
    return {name: imported_modules(name, path, names) for name, path in files.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle per strongly connected group of two or more modules (Tarjan, iterative), each as a path that
    starts and ends at the same module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    groups: list[set[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.add(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(group)
    return [_circle(graph, group) for group in groups]


def _circle(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """A shortest path from the group's first module back to itself, inside the group (breadth first)."""
    start = min(group)
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node] & group):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [start, *reversed(path[:-1]), start] if node != start else [start, start]
                if child not in previous:
                    previous[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"no circle in a strongly connected group {sorted(group)}")


def test_cycle_finder_spells_out_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert cycles(graph) == [["a", "b", "c", "a"]]  # a self-import is not a circle between modules
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_every_module_and_its_imports():
    graph = import_graph()
    assert "pdserve.engine.engine" in graph and "pdserve.decode.servicer" in graph and "pdserve.router" in graph
    assert "pdserve.engine.kv_handoff" in graph["pdserve.engine.engine"]  # a module-level import
    assert "pdserve.engine.kernels.invariant_matmul" in graph["pdserve.engine.kernel_choice"]  # inside a function


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "import cycles:\n" + "\n".join(" -> ".join(c) for c in found)
