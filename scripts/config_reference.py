"""The config reference, generated from the pydantic models: docs/config.md's table and the `config:`
declaration in Pulumi.yaml (`--write` updates both; without it, prints the table).

tests/unit/test_readme.py fails when either disagrees with the models.

Pulumi.yaml declares every top-level key that has a default (with its type, description and
default) and `nodes` (required). Keys without a default stay undeclared, listed as comments: Pulumi
makes a declared key without a default required, and these are optional (or one of a pair, such as
image/promoteFrom). A declared type is checked by the CLI before the program runs; everything
finer (values, cross-field rules) is the program's, reported all at once.
"""

from __future__ import annotations

import json
import sys
import typing
from pathlib import Path

from pydantic import BaseModel

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from components.config import config_keys  # noqa: E402
from components.config.models import SECRET_KEYS  # noqa: E402

BEGIN, END = "<!-- config-reference:begin -->", "<!-- config-reference:end -->"
YAML_BEGIN, YAML_END = "# config-declaration:begin", "# config-declaration:end"


def _type_name(annotation) -> str:
    origin = typing.get_origin(annotation)
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return " or ".join(_type_name(a) for a in args)
    if origin is list:
        return f"list of {_type_name(args[0])}"
    if origin is dict:
        return f"map of name to {_type_name(args[1])}"
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
        return "`[]`" if value == [] else "`{}`" if value == {} else "see below"
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


def _pulumi_type(annotation) -> tuple[str, dict]:
    """(type, extra) of a top-level key as Pulumi's project config schema spells it."""
    origin = typing.get_origin(annotation)
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if origin is typing.Annotated or (origin in (typing.Union,) and len(args) == 1):
        return _pulumi_type(args[0])
    if origin is list:
        item, _ = _pulumi_type(args[0])
        return "array", {"items": {"type": item}}
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "object", {}
    name = getattr(annotation, "__name__", "")
    return {"int": "integer", "bool": "boolean"}.get(name, "string"), {}


def project_config() -> str:
    """The `config:` block of Pulumi.yaml, between its markers."""
    declared, undeclared = [], []
    top_level = [(path, field) for path, field in config_keys() if "." not in path and "[" not in path]
    for path, field in top_level:
        kind, extra = _pulumi_type(field.annotation)
        description = field.description
        sub = [
            p.split(".", 1)[1].removeprefix("[].") for p, _ in config_keys() if p.startswith((f"{path}.", f"{path}[]."))
        ]
        if sub:
            description += f" Keys: {', '.join(sub)} (docs/config.md)."
        entry = {"type": kind, **extra, "description": description}
        if path in SECRET_KEYS:  # set with --secret: a declared default would sit beside it in plain text
            undeclared.append((path, field.description))
        elif field.is_required():
            declared.append((path, entry))
        elif field.default_factory is not None:
            declared.append((path, {**entry, "default": {} if kind == "object" else field.default_factory()}))
        elif field.default is not None:
            declared.append((path, {**entry, "default": field.default}))
        else:
            undeclared.append((path, field.description))
    lines = [YAML_BEGIN, "# Generated from components/config/ by scripts/config_reference.py --write.", "config:"]
    for path, entry in declared:
        lines.append(f"  {path}:")
        for key, value in entry.items():
            lines.append(f"    {key}: {json.dumps(value, ensure_ascii=False)}")
    lines.append("# Optional keys, not declared (Pulumi would make a declared key without a default required):")
    lines += [f"#   {path}: {description}" for path, description in undeclared]
    lines.append(YAML_END)
    return "\n".join(lines)


def _replace(path: Path, begin: str, end: str, text: str) -> None:
    current = path.read_text()
    start, stop = current.index(begin), current.index(end) + len(end)
    path.write_text(current[:start] + text + current[stop:])


def main() -> int:
    if "--write" in sys.argv:
        _replace(ROOT / "docs" / "config.md", BEGIN, END, reference())
        _replace(ROOT / "Pulumi.yaml", YAML_BEGIN, YAML_END, project_config())
    elif "--project" in sys.argv:
        print(project_config())
    else:
        print(reference())
    return 0


if __name__ == "__main__":
    sys.exit(main())
