"""The package's layers and shape, read from its source: the core imports no Lightning, no import runs back up a
layer, no module imports itself through others, and no function is longer than a screen (docs/architecture.md,
"Layers").

Every import counts, a function's too: a function-level import still runs, only later, so it ties the two modules
together as much as one at the top does (and an import circle that a function hides fails at the first call that
runs it, far from the import). Only the type checker's imports (``if TYPE_CHECKING:``) are left out: they never run.
"""

from __future__ import annotations

import ast
from collections import deque
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_app_rlhf"

LAYERS = {
    "core": 0, "generation": 1, "algorithms": 2, "models": 3, "parallel": 4, "checkpoint": 5, "agents": 5, "engine": 6,
    "planner": 7, "strategies": 8, "callbacks": 9, "demo": 9, "data": 9,
    "module_checkpoint": 10, "module_trainer": 10, "module": 10, "calibration_run": 10, "cli": 11, "bench": 12, "__main__": 12, "__init__": 12,
}
"""Each top-level unit of the package and its layer: a module may import its own layer's and lower layers' modules."""
CORE = ("core", "generation", "models", "algorithms", "parallel", "checkpoint", "agents", "engine", "planner")
"""The layers below Lightning: plain PyTorch."""

MAX_FUNCTION_LINES = 80
"""The longest a function may be, from its ``def`` to its last line, docstring included: about a screen, so that it
can be read whole; a longer one is split into named steps with explicit inputs and outputs."""
LONG_FUNCTIONS = {
    # The planner's Metropolis search: one loop whose proposal, acceptance test and bookkeeping share a dozen local
    # variables; split into steps they would travel as a state object, which reads worse than the loop.
    "lightning_app_rlhf.planner.search.mcmc_search",
}
"""The functions allowed over ``MAX_FUNCTION_LINES``, by qualified name, each with the reason."""


def _modules() -> dict[str, Path]:
    return {".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__"): path
            for path in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    """``TYPE_CHECKING`` or ``typing.TYPE_CHECKING``: a block only the type checker reads."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(path: Path, module: str) -> list[tuple[str, int]]:
    """``(imported name, line)`` of every import in ``path`` that runs, at module level or inside a function or
    class, but not the type checker's (``if TYPE_CHECKING:``, whose ``else:`` does run); relative imports resolved.
    ``from pkg import name`` gives ``pkg.name``: ``_internal`` maps it to the submodule ``pkg.name`` if there is one,
    else to ``pkg``."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):  # drop the type checker's imports (this walk has queued them; the next one won't)
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            node.body = []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".")[: -node.level + (1 if path.name == "__init__.py" else 0) or None]
                base = ".".join([*parts, *([base] if base else [])])
            out += [(f"{base}.{alias.name}", node.lineno) for alias in node.names]
    return out


def _unit(module: str) -> str:
    return module.split(".")[1] if module.count(".") else "__init__"


def _internal(name: str, modules: dict[str, Path]) -> str | None:
    """The package module that an import of ``name`` loads (``pkg.mod.Name`` -> ``pkg.mod``), if any."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _import_graph(modules: dict[str, Path]) -> dict[str, dict[str, int]]:
    """Module -> {package module it imports: the line of the first such import}, every import that runs counted.

    Importing ``pkg.sub.mod`` runs ``pkg/__init__.py`` and ``pkg/sub/__init__.py`` first, so those are edges too,
    except a package the importing module lies in (Python has that one in ``sys.modules`` already, half run) unless
    the module imports from it by name."""
    graph: dict[str, dict[str, int]] = {}
    for module, path in modules.items():
        edges: dict[str, int] = {}
        for name, line in _imports(path, module):
            target = _internal(name, modules)
            if target is None:
                continue
            parts = target.split(".")
            packages = [".".join(parts[:n]) for n in range(2, len(parts))]  # pkg.sub of pkg.sub.mod (not the root)
            for package in packages:
                if package in modules and not module.startswith(package + "."):
                    edges.setdefault(package, line)
            if target != module:  # `from pkg import name` inside pkg's own module: pkg may be half run, so an edge
                edges.setdefault(target, line)
        graph[module] = edges
    return graph


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One shortest cycle for each strongly connected set of modules (Tarjan's algorithm, then a breadth-first
    search from the set's first module back to itself)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    components: list[set[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set()
            while not component or node not in component:
                component.add(stack.pop())
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            connect(node)
    cycles = []
    for component in components:
        start = min(component)
        came_from: dict[str, str] = {}
        queue = deque([start])
        while start not in came_from:
            node = queue.popleft()
            for nxt in sorted(graph[node]):
                if nxt in component and nxt not in came_from:
                    came_from[nxt] = node
                    queue.append(nxt)
        cycle = [start]
        while len(cycle) == 1 or cycle[-1] != start:
            cycle.append(came_from[cycle[-1]])
        cycles.append(cycle[::-1])
    return sorted(cycles)


def _functions(tree: ast.AST, prefix: str) -> Iterator[tuple[str, int, int]]:
    """``(qualified name, first line, lines from def to end)`` of every function and method, nested ones too."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = f"{prefix}.{node.name}"
            if not isinstance(node, ast.ClassDef):
                yield name, node.lineno, node.end_lineno - node.lineno + 1
            yield from _functions(node, name)
        else:
            yield from _functions(node, prefix)


MODULES = _modules()


def test_every_unit_has_a_layer():
    assert {_unit(m) for m in MODULES} <= set(LAYERS), sorted({_unit(m) for m in MODULES} - set(LAYERS))


@pytest.mark.parametrize("module", [m for m in MODULES if _unit(m) in CORE])
def test_the_core_imports_no_lightning(module):
    lightning = [f"{name} (line {line})" for name, line in _imports(MODULES[module], module)
                 if name.split(".")[0] == "lightning"]
    assert not lightning, f"{module} imports {lightning}: the core is plain PyTorch; move it to the Lightning layer"


def test_no_import_runs_back_up():
    upward = []
    for module, path in MODULES.items():
        for name, line in _imports(path, module):
            target = _internal(name, MODULES)
            if target and target != module and LAYERS[_unit(target)] > LAYERS[_unit(module)]:
                upward.append(f"{module} -> {target} ({path.relative_to(PACKAGE.parent)}:{line})")
    assert not upward, sorted(set(upward))


def test_imports_inside_functions_count_and_the_type_checkers_do_not(tmp_path):
    """The reader of imports sees a function's import and a method's, resolves a relative one, and skips both
    spellings of the type checker's block but not its ``else:``."""
    source = tmp_path / "mod.py"
    source.write_text(
        "import typing\nfrom typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    import hidden_a\n"
        "if typing.TYPE_CHECKING:\n    import hidden_b\nelse:\n    import shown_else\n"
        "def f():\n    from . import sibling\n    import shown_f\n"
        "class C:\n    def m(self):\n        from .other import Name\n")
    names = [name for name, _ in _imports(source, "pkg.sub.mod")]
    assert sorted(names) == ["pkg.sub.other.Name", "pkg.sub.sibling", "shown_else", "shown_f", "typing",
                             "typing.TYPE_CHECKING"]


def test_the_cycle_finder_names_a_circle_through_a_function_and_a_package():
    """A circle closed by a function-level import, or by the ``__init__`` that importing a submodule runs, is found
    and named; a package importing its own modules is no circle."""
    modules = {m: Path(f"{m}.py") for m in ("r", "r.a", "r.b", "r.p", "r.p.x", "r.c")}
    graph = {"r.a": {"r.b": 1}, "r.b": {"r.a": 9}, "r.p": {"r.p.x": 1}, "r.p.x": {"r.c": 2}, "r.c": {"r.p": 3},
             "r": {}}
    assert _cycles(graph) == [["r.a", "r.b", "r.a"], ["r.c", "r.p", "r.p.x", "r.c"]]
    assert _cycles({"r.p": {"r.p.x": 1}, "r.p.x": {}}) == []
    assert _internal("r.p.x.Name", modules) == "r.p.x" and _internal("r.p.Name", modules) == "r.p"


def test_no_import_circle():
    """The package's modules import each other in no circle: every import that runs counts, a function's too, and
    importing ``pkg.mod`` imports ``pkg`` first (a package imports what it exports)."""
    graph = _import_graph(MODULES)
    named = []
    for cycle in _cycles(graph):
        steps = [f"{a} -> {b} ({MODULES[a].relative_to(PACKAGE.parent)}:{graph[a][b]})"
                 for a, b in zip(cycle, cycle[1:])]
        named.append(" -> ".join(cycle) + ":\n    " + "\n    ".join(steps))
    assert not named, ("import circles (move what both need to a module below them, or import at the right "
                       "layer):\n" + "\n".join(named))


def test_no_function_is_longer_than_a_screen():
    """Every function, method and nested function is at most ``MAX_FUNCTION_LINES`` long, but the allowed few."""
    found, long = set(), []
    for module, path in MODULES.items():
        for name, line, length in _functions(ast.parse(path.read_text()), module):
            found.add(name)
            if length > MAX_FUNCTION_LINES and name not in LONG_FUNCTIONS:
                long.append(f"{name} ({path.relative_to(PACKAGE.parent)}:{line}): {length} lines")
    assert LONG_FUNCTIONS <= found, f"allowed but gone (drop them from LONG_FUNCTIONS): {LONG_FUNCTIONS - found}"
    assert not long, (f"over {MAX_FUNCTION_LINES} lines: split each into named steps with explicit inputs and "
                      "outputs:\n" + "\n".join(sorted(long)))
