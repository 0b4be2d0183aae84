"""The stack config's key paths: every key with its full path, and pydantic's errors told at theirs (an
unknown key with the nearest known one). Above models.py: errors.py, below it, only tells problems."""

from __future__ import annotations

import difflib
from collections.abc import Iterator
from typing import Optional

from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo

from components.config.errors import problem, submodel
from components.config.models import SECRET_KEYS, ClusterConfig


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
    loc = tuple(error["loc"])
    if loc[-1] == "[key]":  # a map's key (apiKeys' client name) is a name, shown; never its value
        loc = loc[:-1]
    elif value is not None and (isinstance(value, SecretStr) or {loc[0], loc[-1]} & set(SECRET_KEYS)):
        value = "[secret]"
    return [problem(_key_path(loc), value, message)]
