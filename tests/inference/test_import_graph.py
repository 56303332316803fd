"""The import graph of inference/ and kernels/ has no cycles, and inference/ never imports Django.

Imports are read with ast from every module, function-level imports included (a lazy import
that closes a cycle is still a cycle: it only hides it until that function runs).
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("inference", "kernels")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}


def imported_names(path: Path, module: str) -> set[str]:
    """Every module name an import statement in this file names (absolute, relative resolved)."""
    is_package = path.name == "__init__.py"
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join(anchor + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)  # `from pkg import submodule`
    return names


def import_graph() -> dict[str, set[str]]:
    modules = all_modules()
    return {name: {m for m in imported_names(path, name) if m in modules and m != name}
            for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path (first node repeated at the end), or None."""
    state: dict[str, str] = {}  # "open" while on the DFS stack, "done" after
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycles_in_inference_and_kernels():
    graph = import_graph()
    assert "inference.engine" in graph and "inference.executor" in graph["inference.engine"]  # the graph is real
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_a_cycle_through_a_function_level_import(tmp_path):
    source = tmp_path / "mod_a.py"
    source.write_text("def later():\n    from inference import mod_b\n")
    assert "inference.mod_b" in imported_names(source, "inference.mod_a")
    graph = {"inference.mod_a": {"inference.mod_b"}, "inference.mod_b": {"inference.mod_c"},
             "inference.mod_c": {"inference.mod_a"}}
    assert find_cycle(graph) == ["inference.mod_a", "inference.mod_b", "inference.mod_c", "inference.mod_a"]


def test_inference_never_imports_django():
    offenders = {name for name, path in all_modules().items() if name.startswith("inference")
                 and any(m == "django" or m.startswith("django.") for m in imported_names(path, name))}
    assert not offenders
