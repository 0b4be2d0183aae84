"""Prints the README's config reference from the pydantic models (`--write` updates README.md).

tests/unit/test_readme.py fails when the README and the models disagree.
"""

from __future__ import annotations

import sys
import typing
from pathlib import Path

from pydantic import BaseModel

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from components.config import config_keys  # noqa: E402

BEGIN, END = "<!-- config-reference:begin -->", "<!-- config-reference:end -->"


def _type_name(annotation) -> str:
    origin = typing.get_origin(annotation)
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return " or ".join(_type_name(a) for a in args)
    if origin is list:
        return f"list of {_type_name(args[0])}"
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in typing.get_args(annotation))
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "object"
    return {
        "str": "string",
        "int": "integer",
        "float": "number",
        "bool": "boolean",
        "IPv4Address": "IPv4",
        "SecretStr": "secret",
    }.get(getattr(annotation, "__name__", str(annotation)), str(annotation))


def _default(field) -> str:
    if field.is_required():
        return "required"
    if field.default_factory is not None:
        value = field.default_factory()
        return "`[]`" if value == [] else "see below"
    return (
        "–"
        if field.default is None
        else f"`{str(field.default).lower() if isinstance(field.default, bool) else field.default}`"
    )


def rows() -> list[str]:
    return [
        f"| `{path}` | {_type_name(field.annotation)} | {_default(field)} | {field.description} |"
        for path, field in config_keys()
    ]


def reference() -> str:
    header = ["| key (`spark-vllm:` …) | type | default | meaning |", "|---|---|---|---|"]
    return "\n".join([BEGIN, *header, *rows(), END])


def main() -> int:
    text = reference()
    if "--write" in sys.argv:
        readme = ROOT / "README.md"
        current = readme.read_text()
        start, end = current.index(BEGIN), current.index(END) + len(END)
        readme.write_text(current[:start] + text + current[end:])
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
