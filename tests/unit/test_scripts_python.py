"""What the node's scripts may use (#67): components/scripts/node_contract.py promises Python 3.7 and later, whatever
python3 the host or the image has, and the scripts run there as they are. Read, not run (no Python 3.7 here): every
script parses as Python 3.7's grammar (no walrus, no positional-only parameters, no `match`, no parenthesized
context managers), and calls nothing of the standard library newer than 3.7 — a table of what the scripts' kind of
code reaches for, each with the release that added it. node_image_archive.py called str.removesuffix (3.9) and
node_answers.py zip(strict=) (3.10) before this test."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).resolve().parents[2] / "components" / "scripts").glob("*.py"))
OLDEST = (3, 7)

# methods that exist only from a later Python, whatever they are called on (a script has no removesuffix but str's),
# with the release that added them; `os.readlink` is 3.7's, Path.readlink 3.9's
NEWER_METHODS = {"removeprefix": "3.9", "removesuffix": "3.9", "is_relative_to": "3.9", "with_stem": "3.9",
                 "readlink": "3.9", "bit_count": "3.10"}  # fmt: skip
OLD_ENOUGH = {("os", "readlink")}
# functions of a module that exist only from a later Python
NEWER_MODULE_ATTRIBUTES = {
    ("shlex", "join"): "3.8", ("functools", "cache"): "3.9", ("functools", "cached_property"): "3.8",
    ("math", "prod"): "3.8", ("math", "isqrt"): "3.8", ("math", "dist"): "3.8", ("statistics", "fmean"): "3.8",
    ("random", "randbytes"): "3.9", ("asyncio", "to_thread"): "3.9", ("os", "waitstatus_to_exitcode"): "3.9",
    ("os", "pidfd_open"): "3.9",
}  # fmt: skip
# keyword arguments that a 3.7 call refuses: (function name, keyword) -> the release that added it
NEWER_KEYWORDS = {
    ("zip", "strict"): "3.10", ("copytree", "dirs_exist_ok"): "3.8", ("unlink", "missing_ok"): "3.8",
    ("dataclass", "slots"): "3.10", ("dataclass", "kw_only"): "3.10", ("field", "kw_only"): "3.10",
}  # fmt: skip
NEWER_MODULES = {"zoneinfo": "3.9", "graphlib": "3.9", "tomllib": "3.11", "importlib.metadata": "3.8"}
NEWER_TYPING = {"Literal": "3.8", "Final": "3.8", "Protocol": "3.8", "TypedDict": "3.8", "TypeAlias": "3.10"}


def newer_than_oldest(source: str) -> list[str]:
    """What in `source` needs a Python newer than OLDEST, one line each with its line number."""
    tree = ast.parse(source, feature_version=OLDEST)
    found = []
    guarded = _guarded_imports(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            receiver = node.value.id if isinstance(node.value, ast.Name) else None
            if (receiver, node.attr) in NEWER_MODULE_ATTRIBUTES:
                release = NEWER_MODULE_ATTRIBUTES[(receiver, node.attr)]
                found.append(f"{node.lineno}: {receiver}.{node.attr} is Python {release}'s")
            elif node.attr in NEWER_METHODS and (receiver, node.attr) not in OLD_ENOUGH:
                found.append(f"{node.lineno}: .{node.attr} is Python {NEWER_METHODS[node.attr]}'s")
        elif isinstance(node, ast.Call):
            name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
            for keyword in node.keywords:
                release = NEWER_KEYWORDS.get((name, keyword.arg))
                if release:
                    found.append(f"{node.lineno}: {name}({keyword.arg}=) is Python {release}'s")
        elif isinstance(node, (ast.Import, ast.ImportFrom)) and node.lineno not in guarded:
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            for name in names:
                if name in NEWER_MODULES:
                    found.append(f"{node.lineno}: import {name} is Python {NEWER_MODULES[name]}'s (guard it)")
            if isinstance(node, ast.ImportFrom) and node.module == "typing":
                for alias in node.names:
                    if alias.name in NEWER_TYPING:
                        found.append(f"{node.lineno}: typing.{alias.name} is Python {NEWER_TYPING[alias.name]}'s")
    return sorted(found, key=lambda line: int(line.split(":")[0]))


def _guarded_imports(tree: ast.AST) -> set[int]:
    """Lines of imports inside a `try:` that catches ImportError (a script that does without them)."""
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(
            isinstance(handler.type, ast.Name) and handler.type.id in ("ImportError", "ModuleNotFoundError")
            for handler in node.handlers
        ):
            lines |= {inner.lineno for inner in node.body if isinstance(inner, (ast.Import, ast.ImportFrom))}
    return lines


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.name)
def test_every_script_keeps_to_the_oldest_python_the_contract_promises(script):
    assert newer_than_oldest(script.read_text()) == []


# (source, what the check says) — the spellings it must catch, and what 3.7 has
CASES = [
    ("x = 'a.json'.removesuffix('.json')\n", ["1: .removesuffix is Python 3.9's"]),
    ("name.removeprefix('sha256:')\n", ["1: .removeprefix is Python 3.9's"]),
    ("for a, b in zip(x, y, strict=False):\n    pass\n", ["1: zip(strict=) is Python 3.10's"]),
    ("import shlex\nshlex.join(argv)\n", ["2: shlex.join is Python 3.8's"]),
    ("import os\nos.readlink(path)\n", []),
    ("from pathlib import Path\nPath(p).readlink()\n", ["2: .readlink is Python 3.9's"]),
    ("if (n := len(x)) > 1:\n    pass\n", "syntax"),
    ("def f(a, /, b):\n    pass\n", "syntax"),
    ("import importlib.metadata\n", ["1: import importlib.metadata is Python 3.8's (guard it)"]),
    ("try:\n    import importlib.metadata as m\nexcept ImportError:\n    m = None\n", []),
    ("from typing import Literal\n", ["1: typing.Literal is Python 3.8's"]),
    ("import shutil\nshutil.copytree(a, b, dirs_exist_ok=True)\n", ["2: copytree(dirs_exist_ok=) is Python 3.8's"]),
    ("subprocess.run(argv, capture_output=True, text=True)\n", []),
    ("print(f'{x!r:>10}')\n", []),
]


@pytest.mark.parametrize("source, said", CASES)
def test_the_check_catches_each_spelling(source, said):
    if said == "syntax":
        with pytest.raises(SyntaxError):
            newer_than_oldest(source)
    else:
        assert newer_than_oldest(source) == said
