"""Imports go one way: front ends (server, apps, bench) -> engine -> scheduler / runner / models /
native -> parallel. A lower layer never imports a higher one (not even inside a function), and
the modules' top-level imports form no cycle."""

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
    "flover.engine": FRONT_ENDS,
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, top_level_only: bool) -> set[str]:
    """The flover modules `path` imports (TYPE_CHECKING blocks left out: types only)."""
    tree = ast.parse(path.read_text())
    found: set[str] = set()

    def visit(node: ast.AST, depth: int) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("flover"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("flover"):
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)  # (a submodule, or a name in it)
        inner = depth + isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        if not (top_level_only and inner):
            for child in ast.iter_child_nodes(node):
                visit(child, inner)

    visit(tree, 0)
    return found


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def test_no_layer_imports_a_higher_one():
    wrong = []
    for name, path in MODULES.items():
        for layer, forbidden in FORBIDDEN.items():
            if name == layer or name.startswith(layer + "."):
                wrong += [
                    f"{name} imports {i}"
                    for i in imports(path, top_level_only=False)
                    if any(i == f or i.startswith(f + ".") for f in forbidden)
                ]
    assert not wrong, "\n".join(sorted(wrong))


def test_top_level_imports_form_no_cycle():
    graph = {
        name: {i for i in imports(path, top_level_only=True) if i in MODULES and i != name}
        for name, path in MODULES.items()
    }
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def cycle_from(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path + [node, nxt]
            if nxt not in state:
                found = cycle_from(nxt, path + [node])
                if found:
                    return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            found = cycle_from(start, [])
            assert found is None, " -> ".join(found[found.index(found[-1]) :])
