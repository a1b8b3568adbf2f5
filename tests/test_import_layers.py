"""Imports go one way: front ends (server, apps, bench) -> engine -> scheduler / runner / models /
native -> parallel. A lower layer never imports a higher one (not inside a function, not for a
type under TYPE_CHECKING), and the imports form no cycle, between modules or between folders."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "flover"
FRONT_ENDS = ("flover.server", "flover.apps", "flover.bench", "flover.client")
# layer -> the packages it must never import
FORBIDDEN = {
    "flover.models": ("flover.engine", "flover.runner", "flover.native", *FRONT_ENDS),
    "flover.native": ("flover.engine", "flover.runner", *FRONT_ENDS),
    "flover.runner": ("flover.engine", *FRONT_ENDS),
    "flover.parallel": ("flover.engine", "flover.runner", "flover.native", "flover.models", *FRONT_ENDS),
    "flover.structured": ("flover.engine", "flover.runner", "flover.native", "flover.models", *FRONT_ENDS),
    "flover.engine": FRONT_ENDS,
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """The flover modules `path` imports, wherever the import stands (in a function, under
    TYPE_CHECKING: a type is a dependency too)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("flover"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("flover"):
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)  # (a submodule, or a name in it)
    return found


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def test_no_layer_imports_a_higher_one():
    wrong = []
    for name, path in MODULES.items():
        for layer, forbidden in FORBIDDEN.items():
            if name == layer or name.startswith(layer + "."):
                wrong += [
                    f"{name} imports {i}"
                    for i in imports(path)
                    if any(i == f or i.startswith(f + ".") for f in forbidden)
                ]
    assert not wrong, "\n".join(sorted(wrong))


def cycle_in(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of the directed graph (its nodes in order, the first repeated last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def cycle_from(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                found = path + [node, nxt]
                return found[found.index(nxt) :]
            if nxt not in state:
                found = cycle_from(nxt, path + [node])
                if found:
                    return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            found = cycle_from(start, [])
            if found:
                return found
    return None


GRAPH = {name: {i for i in imports(path) if i in MODULES and i != name} for name, path in MODULES.items()}


def folder(module: str) -> str:
    """A module's folder: flover.<package> for the subpackages' modules, flover for the others."""
    path = MODULES[module]
    return ".".join(module.split(".")[:2]) if path.parent != PACKAGE else "flover"


def test_imports_form_no_cycle():
    found = cycle_in(GRAPH)
    assert found is None, " -> ".join(found)


def test_folders_import_one_another_in_one_direction():
    """Between the subpackages (engine, runner, models, native, parallel, structured, server,
    apps, bench, testing): no folder reaches back to one that reaches it."""
    folders: dict[str, set[str]] = {}
    for module, deps in GRAPH.items():
        for dep in deps:
            if "flover" not in (folder(module), folder(dep)) and folder(module) != folder(dep):
                folders.setdefault(folder(module), set()).add(folder(dep))
    found = cycle_in(folders)
    assert found is None, " -> ".join(found)


def test_the_checks_see_a_cycle_and_an_import_under_type_checking(tmp_path):
    """The checks can fail: a two-module cycle is found, and an import under TYPE_CHECKING counts."""
    assert cycle_in({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    source = tmp_path / "m.py"
    source.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from flover.engine import x\n")
    assert "flover.engine" in imports(source)
