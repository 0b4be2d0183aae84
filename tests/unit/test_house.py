"""The house's shape, held: the layers import only downward (components/config at the bottom, then plan, then
resources; the node's scripts import nothing of the program, only one another), no module imports itself back through others,
and no function in components/ runs over 60 lines."""

import ast
from pathlib import Path

import pytest

from scripts import import_floors

ROOT = Path(__file__).resolve().parents[2]
COMPONENTS = ROOT / "components"
LAYERS = ("config", "plan", "resources")  # each may import those before it
MAX_FUNCTION_LINES = 60


def _modules() -> dict[str, Path]:
    return import_floors.modules()


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    return import_floors.imports(path, modules)


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_each_layer_imports_only_the_layers_below_it():
    modules = _modules()
    wrong = []
    for module, path in modules.items():
        mine = _layer(module)
        for imported in _imports(path, modules):
            theirs = _layer(imported)
            if mine == "scripts" or theirs == "":
                continue  # the node's modules import one another only (tests/unit/test_node_programs.py)
            if theirs == "scripts":  # the program reads node_contract (the contract both sides read), no other
                if imported != "components.scripts.node_contract":
                    wrong.append(f"{module} -> {imported}")
            elif LAYERS.index(theirs) > LAYERS.index(mine):
                wrong.append(f"{module} -> {imported}")
    assert not wrong


def test_no_module_imports_itself_back():
    modules = _modules()
    graph = {module: _imports(path, modules) - {module} for module, path in modules.items()}
    # a package's __init__ that gathers its modules is not a circle of theirs
    graph = {m: {i for i in found if not m.startswith(i + ".")} for m, found in graph.items()}
    state: dict[str, int] = {}
    circles = []

    def visit(module: str, trail: list[str]) -> None:
        state[module] = 1
        for imported in sorted(graph.get(module, ())):
            if state.get(imported) == 1:
                circles.append(trail[trail.index(imported) :] + [imported])
            elif imported not in state:
                visit(imported, [*trail, imported])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not circles


def test_no_function_in_components_runs_over_sixty_lines():
    long = []
    for path in COMPONENTS.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.name} {lines}")
    assert not long


def test_no_module_imports_another_modules_private_names():
    """A name with a leading underscore is its module's own: one another module needs is public (cluster.py took
    placement.py's `_replica_triggers` and `_served_name`, config two more, before #67)."""
    private = []
    for module, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("components"):
                private += [f"{module}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    assert not private


def test_outputs_are_combined_by_name_not_by_position():
    """`pulumi.Output.all(a=…, b=…)` and the judge reads found["a"]: never `Output.all(a, b)` and p[0], p[1] (cluster.py
    unpacked nine by position before #67). A list of the same kind (`*[…]`, one per node or step) stays a list."""
    positional = []
    for module, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            is_all = isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "all"
            if is_all and ast.unparse(node.func.value).endswith("Output"):
                if any(not isinstance(arg, ast.Starred) for arg in node.args) or (node.args and node.keywords):
                    positional.append(f"{module}:{node.lineno}")
    assert not positional


def test_the_node_sides_drawing_in_the_docs_is_what_its_imports_are_now():
    """docs/how-it-works.md draws components/scripts floor by floor (scripts/import_floors.py): a module added or an
    import changed without the drawing redrawn fails here."""
    drawn = import_floors.drawing("components/scripts")
    assert f"```\n{drawn}\n```" in (ROOT / "docs" / "how-it-works.md").read_text(), drawn


def test_a_circle_has_no_floors():
    with pytest.raises(ValueError, match="an import circle: a -> b -> a"):
        import_floors.floors({"a": {"b"}, "b": {"a"}, "c": set()})
    assert import_floors.floors({"a": {"b", "c"}, "b": {"c"}, "c": set()}) == {"a": 2, "b": 1, "c": 0}
