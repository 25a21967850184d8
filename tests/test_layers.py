"""The package's layers, read from its source: the core imports no Lightning, no import runs back up a layer, and no
module imports itself through others (docs/architecture.md, "Layers")."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_app_rlhf"

LAYERS = {
    "core": 0, "generation": 1, "algorithms": 2, "models": 3, "parallel": 4, "checkpoint": 5, "engine": 6,
    "planner": 7, "strategies": 8, "callbacks": 9, "demo": 9, "data": 9,
    "module_checkpoint": 10, "module_trainer": 10, "module": 10, "cli": 11, "bench": 12, "__main__": 12, "__init__": 12,
}
"""Each top-level unit of the package and its layer: a module may import its own layer's and lower layers' modules."""
CORE = ("core", "generation", "models", "algorithms", "parallel", "checkpoint", "engine", "planner")
"""The layers below Lightning: plain PyTorch."""


def _modules() -> dict[str, Path]:
    return {".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__"): path
            for path in sorted(PACKAGE.rglob("*.py"))}


def _imports(path: Path, module: str) -> list[tuple[str, bool]]:
    """``(imported module, at module level)`` of every import in ``path`` that runs (not the type checker's:
    ``if TYPE_CHECKING:``); relative imports resolved."""
    tree = ast.parse(path.read_text())
    top = set(map(id, tree.body))
    for node in ast.walk(tree):  # drop the type checker's imports
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            node.body = []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, id(node) in top) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")[: -node.level + (1 if path.name == "__init__.py" else 0) or None]
                base = ".".join([*parts, *([base] if base else [])])
            # pkg.mod.Name resolves to pkg.mod, pkg.submodule to the submodule (_internal)
            out += [(f"{base}.{alias.name}", id(node) in top) for alias in node.names]
    return out


def _unit(module: str) -> str:
    return module.split(".")[1] if module.count(".") else "__init__"


def _internal(name: str, modules: dict[str, Path]) -> str | None:
    """The package module that an import of ``name`` loads (``pkg.mod.Name`` -> ``pkg.mod``), if any."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


MODULES = _modules()


def test_every_unit_has_a_layer():
    assert {_unit(m) for m in MODULES} <= set(LAYERS), sorted({_unit(m) for m in MODULES} - set(LAYERS))


@pytest.mark.parametrize("module", [m for m in MODULES if _unit(m) in CORE])
def test_the_core_imports_no_lightning(module):
    lightning = [name for name, _ in _imports(MODULES[module], module) if name.split(".")[0] == "lightning"]
    assert not lightning, f"{module} imports {lightning}: the core is plain PyTorch; move it to the Lightning layer"


def test_no_import_runs_back_up():
    upward = []
    for module, path in MODULES.items():
        for name, _ in _imports(path, module):
            target = _internal(name, MODULES)
            if target and target != module and LAYERS[_unit(target)] > LAYERS[_unit(module)]:
                upward.append(f"{module} -> {target}")
    assert not upward, sorted(set(upward))


def test_no_import_circle():
    """Module-level imports between the package's modules form no cycle (a package imports what it exports)."""
    graph = {module: {target for name, top in _imports(path, module) if top
                      for target in [_internal(name, MODULES)] if target and target != module}
             for module, path in MODULES.items()}
    # A package's __init__ runs before its modules: importing pkg.mod imports pkg first.
    for module in MODULES:
        for target in list(graph[module]):
            parent = target.rpartition(".")[0]
            if parent in MODULES and parent != module and not module.startswith(parent + "."):
                graph[module].add(parent)
    state: dict[str, int] = {}
    cycles = []

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join([*trail[trail.index(nxt):], nxt]))
            elif nxt not in state:
                visit(nxt, [*trail, nxt])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, cycles
