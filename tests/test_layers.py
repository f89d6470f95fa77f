"""The layers of docs/design.md hold: no two top-level packages import each other, no modules
import each other in a circle, and only the command line imports the benchmarks. Read from the
source with `ast` (imports inside functions count too), so nothing is imported to check."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("actors", "connectors", "orchestrator", "benchmarks", "tandem")


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports."""
    files = {}
    for pkg in PACKAGES:
        for f in (ROOT / pkg).rglob("*.py"):
            name = ".".join(f.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            files[name] = f
    graph: dict[str, set[str]] = {m: set() for m in files}
    for module, f in files.items():
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            else:
                continue
            graph[module] |= {n for n in names if n in files and n != module}
    return graph


def test_no_two_packages_import_each_other() -> None:
    graph = import_graph()
    edges = {(m.split(".")[0], d.split(".")[0]) for m, ds in graph.items() for d in ds}
    both_ways = sorted((a, b) for a, b in edges if a < b and (b, a) in edges)
    assert not both_ways, f"packages importing each other: {both_ways}"


def test_no_module_cycles() -> None:
    graph = import_graph()
    cycles = []
    for start in graph:  # a module that reaches itself again through its imports
        seen, stack = set(), list(graph[start])
        while stack:
            m = stack.pop()
            if m == start:
                cycles.append(start)
                break
            if m not in seen:
                seen.add(m)
                stack.extend(graph[m])
    assert not cycles, f"modules on an import cycle: {sorted(cycles)}"


def test_only_the_command_line_imports_the_benchmarks() -> None:
    importers = {m for m, ds in import_graph().items()
                 if not m.startswith("benchmarks") and any(d.startswith("benchmarks") for d in ds)}
    assert importers <= {"tandem.cli"}, importers
