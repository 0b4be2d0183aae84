"""A folder of components/ drawn from its imports, floor by floor: a module's floor is one above the highest of those
it imports within the folder (floor 0 imports none of them), so every arrow runs down. Prints the drawing that
docs/how-it-works.md shows for the node side (tests/unit/test_house.py holds the two equal, and the rules it draws:
no circle, no arrow back up).

    venv/bin/python -m scripts.import_floors [components/scripts]
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMPONENTS = ROOT / "components"


def modules() -> dict[str, Path]:
    """components' modules by dotted name (a package by its own name)."""
    found = {}
    for path in COMPONENTS.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(path: Path, known: dict[str, Path]) -> set[str]:
    """The components modules `path` imports (at any depth of the file: a hidden import counts too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("components"):
            for alias in node.names:
                dotted = f"{node.module}.{alias.name}"
                found.add(dotted if dotted in known else node.module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("components")}
    return {name for name in found if name in known}


def graph(folder: str) -> dict[str, set[str]]:
    """module -> the modules of the same folder it imports (short names: `supervisor`, `node_contract`)."""
    package = ".".join(Path(folder).parts)
    known = modules()
    inside = {name: path for name, path in known.items() if name.startswith(package + ".")}
    short = {name: name[len(package) + 1 :] for name in inside}
    return {
        short[name]: {short[i] for i in imports(path, known) if i in inside} - {short[name]}
        for name, path in inside.items()
    }


def floors(found: dict[str, set[str]]) -> dict[str, int]:
    """Each module's floor; a circle has none (ValueError naming it)."""
    floor: dict[str, int] = {}

    def climb(module: str, trail: tuple[str, ...]) -> int:
        if module in trail:
            raise ValueError("an import circle: " + " -> ".join((*trail[trail.index(module) :], module)))
        if module not in floor:
            floor[module] = 1 + max((climb(i, (*trail, module)) for i in found[module]), default=-1)
        return floor[module]

    for module in sorted(found):
        climb(module, ())
    return floor


def drawing(folder: str) -> str:
    """The folder floor by floor, the top first, each module with what it imports."""
    found = graph(folder)
    floor = floors(found)
    arrows = sum(len(targets) for targets in found.values())
    lines = [f"{folder}: {len(found)} modules, {arrows} imports between them, {max(floor.values()) + 1} floors"]
    for level in range(max(floor.values()), -1, -1):
        lines.append(f"floor {level}")
        for module in sorted(m for m in found if floor[m] == level):
            below = ", ".join(sorted(found[module]))
            lines.append(f"  {module}" + (f" -> {below}" if below else ""))
    return "\n".join(lines)


if __name__ == "__main__":
    print(drawing(sys.argv[1] if len(sys.argv) > 1 else "components/scripts"))
