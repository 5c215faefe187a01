"""The package's import graph: no cycle anywhere in kilnlm, function-level imports included, and the one
dependency rule (runtime/ never imports builder/; plugins/ imports neither).

The graph is read from the installed sources with :mod:`ast` (nothing is imported): an edge for every
``import kilnlm.x`` / ``from kilnlm.x import y`` at any depth of a module (a function-level import is still
a dependency), ``from kilnlm.x import y`` pointing at the submodule ``kilnlm.x.y`` when there is one. It
walks whatever modules the packages hold, so it keeps working when modules move.
"""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

PACKAGES = ("kilnlm.builder", "kilnlm.runtime", "kilnlm.plugins", "kilnlm.cli")
# package -> packages it must never import
FORBIDDEN = {"kilnlm.runtime": ("kilnlm.builder",), "kilnlm.plugins": ("kilnlm.builder", "kilnlm.runtime", "kilnlm.cli")}


def module_files() -> dict[str, Path]:
    """Every module of :data:`PACKAGES` (subpackages included) -> its source file."""
    modules = {}
    for package in PACKAGES:
        spec = importlib.util.find_spec(package)
        assert spec is not None and spec.submodule_search_locations, f"{package} is not installed"
        for root in map(Path, spec.submodule_search_locations):
            for path in root.rglob("*.py"):
                parts = list(path.relative_to(root).with_suffix("").parts)
                if parts[-1] == "__init__":
                    parts.pop()
                modules[".".join([package, *parts])] = path
    return modules


def _resolve_relative(module: str, is_package: bool, level: int, name: str | None) -> str:
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join(base + ([name] if name else []))


def import_graph() -> dict[str, set[str]]:
    """module -> the kilnlm modules it imports (anywhere in its source)."""
    files = module_files()
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = (node.module or "") if node.level == 0 else _resolve_relative(
                    module, path.name == "__init__.py", node.level, node.module)
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base for alias in node.names]
            else:
                continue
            for target in targets:
                while target and target not in files:  # `import kilnlm.x.y.z` of a name inside a module
                    target = target.rpartition(".")[0]
                if target and target != module:
                    edges.add(target)
        graph[module] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` as ``[a, b, ..., a]``, or None (iterative depth-first search)."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if state.get(start):
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def test_the_checker_finds_a_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_graph_sees_function_level_imports():
    graph = import_graph()
    # kilnlm.cli.main imports its subcommands through importlib; build_cmd imports the builder in functions
    assert "kilnlm.builder.config" in graph["kilnlm.cli.build_cmd"]
    assert all(package in graph for package in PACKAGES)


def test_kilnlm_has_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def test_layers_depend_one_way():
    bad = [(module, target) for module, targets in import_graph().items() for package, forbidden in FORBIDDEN.items()
           if module == package or module.startswith(package + ".")
           for target in targets if any(target == f or target.startswith(f + ".") for f in forbidden)]
    assert not bad, f"imports against the dependency rule (runtime/ never imports builder/; plugins/ neither): {bad}"


# What a new process imports before it starts the engine's SHA-256 checks (prehash_engine_files), which then run
# on the core `import torch` (1.1-2.0 s of a cold start) leaves idle: kilnlm's CLI entry point, and the Triton
# tensorrt_llm model's module-level imports besides triton_python_backend_utils.
BEFORE_TORCH = ("kilnlm.cli.main", "kilnlm.runtime.manifest", "kilnlm.runtime.distribution.engine_source",
                "kilnlm.runtime.serving.triton_backend")


def test_what_runs_before_the_engine_is_hashed_imports_no_torch():
    code = ("import sys\n" + "".join(f"import {m}\n" for m in BEFORE_TORCH)
            + "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "[]", f"importing {', '.join(BEFORE_TORCH)} imports {out.strip()}"
