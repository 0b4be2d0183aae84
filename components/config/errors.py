"""How a problem with the stack config is told: one line each (key path, value found, what is expected),
all of them in one ConfigError; pydantic's own errors turned into such lines, an unknown key with the
key it probably meant."""

from __future__ import annotations

import difflib
import re
import typing
from collections.abc import Iterator
from typing import Any, Optional

from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo

from components.config.models import SECRET_KEYS, ClusterConfig
from components.vllm_args import scrub_args


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
    """The model a field holds (and whether as a list), or (None, False) for a plain value."""
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


def _key_path(loc: tuple) -> str:
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


def _model_at(loc: tuple) -> Optional[type[BaseModel]]:
    """The model that owns the keys at `loc` (list indexes skipped), or None."""
    model: Optional[type[BaseModel]] = ClusterConfig
    for part in loc:
        if isinstance(part, int) or model is None:
            continue
        field = next((f for n, f in model.model_fields.items() if (f.alias or n) == part), None)
        model = submodel(field.annotation)[0] if field else None
    return model


def config_keys(model: Optional[type[BaseModel]] = None, prefix: str = "") -> Iterator[tuple[str, FieldInfo]]:
    """Every key of the stack config with its full path (`nodes[].gpus`) and its field: a model's own
    keys first, then each nested model's (the order of docs/config.md's reference)."""
    nested = []
    for name, field in (model or ClusterConfig).model_fields.items():
        path = prefix + (field.alias or name)
        yield path, field
        sub, is_list = submodel(field.annotation)
        if sub is not None:
            nested.append((sub, path + ("[]." if is_list else ".")))
    for sub, sub_prefix in nested:
        yield from config_keys(sub, sub_prefix)


# Keys that existed once: their unknown-key message says why they went instead of guessing.
REMOVED_KEYS = {
    "container.shmSizeMb": "no longer a key: Docker ignores a shared-memory size when the container shares the host's "
    "IPC namespace (ipc host, which NCCL and vLLM need), so /dev/shm is the host's; remove it",
}


def _unknown_key_hint(loc: tuple) -> str:
    removed = REMOVED_KEYS.get(_key_path(tuple(p for p in loc if not isinstance(p, int))))
    if removed:
        return removed
    key, owner = str(loc[-1]), _model_at(loc[:-1])
    here = [f.alias or n for n, f in owner.model_fields.items()] if owner else []
    by_lower = {k.lower(): k for k in here}
    close = difflib.get_close_matches(key.lower(), list(by_lower), n=1, cutoff=0.6)
    if close:
        return f"no such key: did you mean {by_lower[close[0]]!r}?"
    elsewhere = next((path for path, _ in config_keys() if path.rsplit(".", 1)[-1] == key), None)
    if elsewhere:
        where = "the top level" if elsewhere == key else elsewhere
        return f"no such key here: {key!r} belongs at {where}"
    return f"no such key (known here: {', '.join(here)})" if here else "no such key"


def describe(error: dict) -> list[str]:
    message = error["msg"]
    for prefix in ("Value error, ", "Assertion failed, "):
        if message.startswith(prefix):
            message = message[len(prefix) :]
    if not error["loc"]:
        # Cross-field rules arrive already formatted, one problem a line.
        return message.splitlines()
    value = error.get("input")
    if error["type"] == "missing":
        value = None
    elif error["type"] == "extra_forbidden":
        message = _unknown_key_hint(error["loc"])
    if isinstance(value, SecretStr) or (error["loc"] and error["loc"][-1] in SECRET_KEYS):
        value = "[secret]"
    return [problem(_key_path(error["loc"]), value, message)]
