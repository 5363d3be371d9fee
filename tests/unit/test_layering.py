"""Layering, read from the modules' own import statements (``ast``, nothing imported): no import cycle
among peagle_core modules nor among pipelines modules, peagle_core imports none of the layers above it
nor Ray/MLflow, and pipelines imports neither ray_jobs nor bench nor tests (``ray_jobs → pipelines →
peagle_core``).

Every ``import`` / ``from ... import`` counts, wherever it is (module level, inside a function,
under ``TYPE_CHECKING``), absolute or relative. ``from pkg import name`` is an edge to the module
``pkg.name`` when that is a module, else to ``pkg``. The implicit import of a parent package
(``import a.b`` first runs ``a/__init__.py``) is no edge: a package's ``__init__`` may import its
submodules (``peagle_core.objectives`` registers the built-in objectives that way).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = ("pipelines", "ray_jobs", "ray", "mlflow")  # top-level packages peagle_core must not import
ABOVE_PIPELINES = ("ray_jobs", "bench", "tests")  # top-level packages pipelines must not import


def module_files(package_dir: Path) -> dict[str, Path]:
    """``{dotted module name: file}`` of every ``.py`` file under ``package_dir`` (a package)."""
    out = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imported_names(module: str, path: Path) -> list[tuple[str, int]]:
    """``(absolute dotted name, line)`` of every import in the file; for ``from X import a, b``
    both ``X.a`` and ``X.b`` (the caller decides whether they are modules)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
    package = module if is_pkg else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                if node.level > 1:
                    base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            out.append((base, node.lineno))
            out += [(f"{base}.{alias.name}", node.lineno) for alias in node.names if alias.name != "*"]
    return out


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Edges ``module -> modules it imports`` among ``modules`` (self-edges dropped)."""
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for mod, path in modules.items():
        for name, _ in imported_names(mod, path):
            if name in modules:
                target = name
            else:  # "pkg.mod.attr" -> "pkg.mod"; a name outside every module gives no edge
                parent = name.rpartition(".")[0]
                target = parent if parent in modules else None
            if target and target != mod:
                graph[mod].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as ``[a, b, ..., a]``, or ``None`` (iterative DFS, deterministic order)."""
    state: dict[str, int] = {}  # 1 = on the DFS stack, 2 = done
    for start in sorted(graph):
        if state.get(start):
            continue
        stack = [(start, iter(sorted(graph[start])))]
        path = [start]
        state[start] = 1
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                path.pop()
                state[node] = 2
            elif state.get(child) == 1:
                return path[path.index(child):] + [child]
            elif not state.get(child):
                state[child] = 1
                path.append(child)
                stack.append((child, iter(sorted(graph.get(child, ())))))
    return None


def test_peagle_core_has_no_import_cycle():
    modules = module_files(ROOT / "peagle_core")
    assert "peagle_core.objectives.base" in modules and len(modules) > 10  # the walk found the package
    cycle = find_cycle(import_graph(modules))
    assert cycle is None, "import cycle in peagle_core: " + " -> ".join(cycle)


def test_pipelines_has_no_import_cycle():
    """Every import of every pipelines module counts, a function-level one too: a cycle hidden in a function
    is a cycle. The message names the modules of the cycle in order."""
    modules = module_files(ROOT / "pipelines")
    assert {"pipelines.pipeline", "pipelines.registry.refs", "pipelines.stages.base"} <= set(modules)
    cycle = find_cycle(import_graph(modules))
    assert cycle is None, "import cycle in pipelines: " + " -> ".join(cycle)


def imports_of(package: str, top_levels: tuple[str, ...]) -> list[str]:
    """``path:line imports name`` for every import (function-level ones included) in ``package`` of a module
    under one of ``top_levels``."""
    return sorted({f"{path.relative_to(ROOT)}:{line} imports {name}"
                   for mod, path in module_files(ROOT / package).items()
                   for name, line in imported_names(mod, path) if name.split(".")[0] in top_levels})


def test_pipelines_imports_nothing_above_it():
    bad = imports_of("pipelines", ABOVE_PIPELINES)
    assert not bad, "pipelines must import no ray_jobs / bench / tests:\n" + "\n".join(bad)


def test_peagle_core_imports_nothing_above_it():
    bad = imports_of("peagle_core", FORBIDDEN)
    assert not bad, "peagle_core must import no pipelines / ray_jobs / ray / mlflow:\n" + "\n".join(bad)


def test_checker_finds_cycles_through_function_and_relative_imports(tmp_path):
    """The checker itself: a cycle made of a relative import and an import inside a function."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from pkg.sub import b\n    return b\n")
    (pkg / "sub" / "b.py").write_text("from .c import g\n")
    (pkg / "sub" / "c.py").write_text("from .. import a\n\ndef g():\n    return a\n")
    (pkg / "d.py").write_text("import pkg.a\nimport ray\n")
    modules = module_files(pkg)
    graph = import_graph(modules)
    assert graph["pkg.sub.c"] == {"pkg.a", "pkg"}
    assert find_cycle(graph) == ["pkg.a", "pkg.sub.b", "pkg.sub.c", "pkg.a"]
    (pkg / "sub" / "c.py").write_text("def g():\n    return 1\n")
    assert find_cycle(import_graph(module_files(pkg))) is None
    assert ("ray", 2) in imported_names("pkg.d", pkg / "d.py")
