"""How a problem with the stack config is told: one line each (key path, value found, what is expected),
all of them in one ConfigError. Below every other module of the config: pydantic's own errors are told at
their key paths in key_paths.py."""

from __future__ import annotations

import re
import types
import typing
from typing import Any, Optional

from pydantic import BaseModel

from components.config.vllm_args import scrub_args


def problem(path: str, value: Any, expected: str) -> str:
    return f"{path}: {shown(value)!r} — {expected}"


_URL_CREDENTIALS = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/?#\s@]+@")


def shown(value: Any) -> Any:
    """A value as a message may show it: never a secret it holds. A URL's credentials (`https://user:token@…`) and
    the value of a secret flag in an argument list (`--api-key …`, in any spelling vLLM reads) are replaced."""
    if isinstance(value, str):
        return _URL_CREDENTIALS.sub(r"\1[secret]@", value)
    if isinstance(value, dict):
        return {key: shown(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        items = scrub_args(list(value)) if all(isinstance(item, str) for item in value) else list(value)
        return [shown(item) for item in items]
    return value


def submodel(annotation: Any) -> tuple[Optional[type[BaseModel]], bool]:
    """The model a field holds (and whether as a list), or (None, False) for a plain value. An optional
    section (`Optional[Model]`, unset: off) is its model."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 2 and type(None) in args:
        annotation = next(arg for arg in args if arg is not type(None))
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation, False
    if typing.get_origin(annotation) is list:
        inner = typing.get_args(annotation)[0]
        if isinstance(inner, type) and issubclass(inner, BaseModel):
            return inner, True
    return None, False


class ConfigError(Exception):
    """A stack config that breaks one or more rules. The message lists every problem, one a line."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        lines = "\n".join(f"  - {problem}" for problem in problems)
        super().__init__(f"spark-vllm: the stack config has {len(problems)} problem(s):\n{lines}")
