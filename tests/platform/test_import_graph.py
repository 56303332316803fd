"""The platform's module-level imports form no cycle (imports inside functions, as Celery task bodies
do, are not edges: they run after every module has loaded)."""
from __future__ import annotations

import ast
from pathlib import Path

PLATFORM = Path(__file__).resolve().parents[2] / "platform"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PLATFORM).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _top_level_imports(path: Path, name: str, known: set[str]) -> set[str]:
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.parse(path.read_text()).body:  # module level only
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        found |= {t for t in targets if t in known}
    return found


def import_graph() -> dict[str, set[str]]:
    files = [p for p in PLATFORM.rglob("*.py") if "migrations" not in p.parts]
    known = {_module_name(p) for p in files}
    return {_module_name(p): _top_level_imports(p, _module_name(p), known) - {_module_name(p)} for p in files}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, str] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node], path[len(path):] = "open", [node]
        for child in sorted(graph.get(node, ())):
            if state.get(child) == "open":
                return path[path.index(child):] + [child]
            if child not in state and (cycle := visit(child)):
                return cycle
        state[node] = "done"
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_finder_sees_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_platform_modules_import_no_cycle():
    graph = import_graph()
    assert "batches.services" in graph and "batches.tasks" in graph["batches.services"], "the graph is read"
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))
