"""No import cycles: inference/ and kernels/tessera_kernels/ counting every import (a lazy import that closes a cycle
is still a cycle, only hidden until that function runs); platform/ counting module-level imports
(Celery task bodies import their services inside the function, by design: those run after every
module has loaded). And inference/ never imports Django.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_names(path: Path, module: str, module_level_only: bool = False) -> set[str]:
    """Every module name an import statement in this file names (absolute, relative resolved)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    names = set()
    for node in tree.body if module_level_only else ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)  # `from pkg import submodule`
    return names


def import_graph(packages: list[Path], module_level_only: bool = False) -> dict[str, set[str]]:
    """The graph of these packages' modules, each named from the source root that holds its package."""
    modules = {
        module_name(p, package.parent): p
        for package in packages
        for p in package.rglob("*.py")
        if "migrations" not in p.parts
    }
    return {
        name: {m for m in imported_names(path, name, module_level_only) if m in modules and m != name}
        for name, path in modules.items()
    }


def engine_graph() -> dict[str, set[str]]:
    return import_graph([REPO / "inference", REPO / "kernels" / "tessera_kernels"])


def platform_graph() -> dict[str, set[str]]:
    platform = REPO / "platform"
    return import_graph([p for p in platform.iterdir() if (p / "__init__.py").exists()], module_level_only=True)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path (first node repeated at the end), or None."""
    state: dict[str, str] = {}  # "open" while on the DFS stack, "done" after
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt) :] + [nxt]
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
    graph = engine_graph()
    assert "inference.executor" in graph["inference.engine"]  # the graph is real
    assert "tessera_kernels._triton_utils" in graph["tessera_kernels.norm"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_module_level_import_cycles_in_platform():
    graph = platform_graph()
    assert "batches.tasks" in graph["batches.services"], "the graph is read"
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_sees_a_function_level_import_and_a_cycle(tmp_path):
    source = tmp_path / "mod_a.py"
    source.write_text("def later():\n    from inference import mod_b\n")
    assert "inference.mod_b" in imported_names(source, "inference.mod_a")
    assert "inference.mod_b" not in imported_names(source, "inference.mod_a", module_level_only=True)
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}}
    assert find_cycle(graph) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_inference_never_imports_django():
    offenders = {
        name
        for name, path in ((module_name(p, REPO), p) for p in (REPO / "inference").rglob("*.py"))
        if any(m == "django" or m.startswith("django.") for m in imported_names(path, name))
    }
    assert not offenders


def test_apps_never_import_the_project_package():
    """tessera/ (settings, URLs, ASGI, Celery) imports the apps, never the other way round: apps read
    settings through django.conf, share Redis and HTTP guards through common/, and declare Celery tasks
    with shared_task. Function-level imports count too."""
    platform = REPO / "platform"
    imports = {}
    for path in platform.rglob("*.py"):
        if "migrations" in path.parts or path.relative_to(platform).parts[0] == "tessera":
            continue
        name = module_name(path, platform)
        imports[name] = {
            m
            for m in imported_names(path, name)
            if (m == "tessera" or m.startswith("tessera.")) and not m.startswith("tessera.settings")
        }
    assert "common.http_guards" in imports and "batches.validation" in imports, "the apps are read"
    assert {name: found for name, found in imports.items() if found} == {}


def test_kernels_folder_is_a_source_root_not_a_package_named_kernels():
    """transformers imports Hugging Face's `kernels` package (its dependency); a kernels/ package of ours on
    sys.path, as the repository root is, would shadow it and break `import transformers`."""
    assert not (REPO / "kernels" / "__init__.py").exists()
    importlib.import_module("transformers.activations")  # imports `kernels` where transformers depends on it
    import tessera_kernels

    assert Path(tessera_kernels.__file__).parent == REPO / "kernels" / "tessera_kernels"
