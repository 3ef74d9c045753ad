"""Each room's files import one way: no cycles among the modules of one top-level package, counting every
import (top level, inside functions, under TYPE_CHECKING), and the rooms themselves follow the import direction
of docs/architecture.md, "Where the code lives" (libraries never import roles; roles never import each other;
the devnet imports no role)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PACKAGES = ["protocol", "models", "toploc", "shardcast", "contracts", "environments", "discovery", "node",
            "validator", "trainer", "devnet"]
ROLES = {"node", "validator", "trainer"}
LIBRARIES = {"protocol", "models", "toploc", "shardcast", "contracts", "environments", "discovery"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, known: set[str]) -> set[str]:
    """The project modules `path` imports (resolved to the longest known module name)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
        for name in names:
            parts = name.split(".")
            for i in range(len(parts), 0, -1):
                candidate = ".".join(parts[:i])
                if candidate in known:
                    found.add(candidate)
                    break
    return found


def graph() -> dict[str, set[str]]:
    files = {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    known = set(files)
    return {m: imports_of(p, known) - {m} for m, p in files.items()}


def cycles_within_packages(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module, among modules of the same top-level package
    (a package's __init__ re-exporting its submodules is not a cycle: edges into an __init__ are ignored)."""
    local = {m: {t for t in ts if t.split(".")[0] == m.split(".")[0] and t != m.split(".")[0]}
             for m, ts in edges.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # Tarjan
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in local.get(v, ()):
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

    for v in sorted(local):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles_inside_a_package() -> None:
    assert cycles_within_packages(graph()) == []


def test_cycle_finder_finds_a_cycle() -> None:
    assert cycles_within_packages({"a.x": {"a.y"}, "a.y": {"a.x"}, "a.z": {"a.x"}}) == [["a.x", "a.y"]]


def test_rooms_import_in_the_design_direction() -> None:
    wrong = []
    for module, targets in graph().items():
        room = module.split(".")[0]
        for target in targets:
            other = target.split(".")[0]
            if other == room:
                continue
            if room in LIBRARIES and other in ROLES | {"devnet"}:
                wrong.append(f"library {module} imports {target}")
            if room in ROLES and other in ROLES:
                wrong.append(f"role {module} imports role {target}")
            if room == "devnet" and other in ROLES:
                wrong.append(f"devnet {module} imports role {target}")
    assert wrong == []


def test_test_file_basenames_are_unique() -> None:
    """pytest imports test files by basename (rootdir-relative packages are not used here): two files of one
    name stop the whole collection with 'import file mismatch', so `make test` would run nothing."""
    seen: dict[str, list[str]] = {}
    for path in (ROOT / "tests").rglob("test_*.py"):
        seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert {name: paths for name, paths in seen.items() if len(paths) > 1 } == {}
