"""The packages' layers (docs/architecture.md, "Layers"): ``envs`` < ``policies`` <
``scheduler.runtime`` < ``scheduler`` < ``embodied``. A module imports only from its own layer
or below, and no chain of imports leads back to where it started. Imports inside function bodies
count too: a lazy import hides a dependency, but it is still one.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("envs", "policies", "scheduler.runtime", "scheduler", "embodied")  # bottom to top
PACKAGES = ("envs", "policies", "scheduler", "embodied")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(f): f for package in PACKAGES for f in sorted((ROOT / package).rglob("*.py"))}


def _project_module(name: str) -> str | None:
    """The project module an import of ``name`` loads (``a.b.c`` may be module ``a.b``'s name ``c``)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(path: Path) -> list[tuple[int, str]]:
    """``(line, project module)`` for every import in the file, at any depth."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
        else:
            continue
        found += [(node.lineno, m) for m in map(_project_module, names) if m is not None]
    return found


GRAPH = {module: {m for _, m in _imports(path) if m != module} for module, path in MODULES.items()}


def _layer(module: str) -> int:
    """Index in LAYERS of the deepest layer that holds ``module`` (``scheduler.runtime.worker`` is
    in ``scheduler.runtime``, ``scheduler.auto`` in ``scheduler``)."""
    holders = [layer for layer in LAYERS if module == layer or module.startswith(layer + ".")]
    return LAYERS.index(max(holders, key=len))


def test_no_module_imports_from_a_layer_above_its_own():
    upward = [f"{MODULES[m].relative_to(ROOT)}:{line} imports {target}"
              for m in MODULES for line, target in _imports(MODULES[m]) if _layer(target) > _layer(m)]
    assert not upward, "upward imports (move the shared piece down, or pass it in):\n" + "\n".join(upward)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles_between_modules():
    assert not _cycles(GRAPH), f"import cycles: {_cycles(GRAPH)}"


@pytest.mark.parametrize("graph, expected", [
    ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
    ({"a": {"b"}, "b": {"a"}, "c": {"a"}}, [["a", "b"]]),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"d"}}, [["a", "b", "c"]]),
], ids=["chain", "pair", "triangle"])
def test_cycle_finder_finds_cycles(graph, expected):
    assert _cycles(graph) == expected


def test_the_checks_see_every_package_and_lazy_imports():
    """The graph is not empty by mistake: every layer is there, and a function-body import counts."""
    assert {LAYERS[_layer(m)] for m in MODULES} == set(LAYERS)
    assert "policies.registry" in GRAPH["embodied.config"]  # imported inside validate()


# Imports a function may defer: packages that take a second or more to import, or need a device or
# a simulator (the CLI answers --help and config errors without torch; a policy that never uses
# vLLM never imports it), and the project modules that import one of them at their top.
HEAVY = {"torch", "ray", "transformers", "peft", "vllm", "mani_skill", "sapien", "libero", "robosuite", "mujoco",
         "gymnasium", "matplotlib", "tensorboard", "hydra", "imageio", "simplejpeg", "psutil", "tensorflow",
         "metaworld"}


def _top_level_imports(path: Path) -> tuple[set[str], set[str]]:
    """``(project modules, other modules)`` imported at the file's top level."""
    project, other = set(), set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        else:
            continue
        for name in names:
            (project.add(_project_module(name)) if _project_module(name) else other.add(name))
    return project, other


def _is_heavy_name(name: str) -> bool:
    return any(name == h or name.startswith(h + ".") for h in HEAVY)


def _heavy_modules() -> set[str]:
    """Project modules whose import pulls in a HEAVY package (through top-level imports)."""
    tops = {m: _top_level_imports(p) for m, p in MODULES.items()}
    heavy = {m for m, (_, other) in tops.items() if any(map(_is_heavy_name, other))}
    while True:
        more = {m for m, (project, _) in tops.items() if project & heavy} - heavy
        if not more:
            return heavy
        heavy |= more


def _deferred_imports(path: Path) -> list[tuple[int, str]]:
    """``(line, imported name)`` for imports inside function bodies."""
    found = []
    for fn in ast.walk(ast.parse(path.read_text())):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for node in ast.walk(fn):
                if isinstance(node, ast.Import):
                    found += [(node.lineno, alias.name) for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    found.append((node.lineno, node.module))
    return found


def test_imports_are_at_module_top_except_heavy_ones():
    heavy = _heavy_modules()
    light = [f"{path.relative_to(ROOT)}:{line} imports {name} inside a function"
             for path in MODULES.values() for line, name in _deferred_imports(path)
             if not _is_heavy_name(name) and _project_module(name) not in heavy]
    assert not light, "move these imports to the module's top (nothing heavy to defer):\n" + "\n".join(light)


def test_the_runtime_does_not_import_the_planner():
    """The runtime (worker groups, channel, faults, weight sync, offload) runs a Plan it is given;
    choosing one (placement, profiler, cost model, planner) is the layer above."""
    runtime = [m for m in MODULES if _layer(m) == LAYERS.index("scheduler.runtime")]
    assert "scheduler.runtime.worker" in runtime and "scheduler.placement" not in runtime
    assert _layer("scheduler.placement") > _layer("scheduler.runtime.faults")
