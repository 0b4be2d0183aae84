"""How the cross-field rules run: each declares the keys it reads, and runs only where those keys are
valid, so a rule body is plain typed code.

On a valid config every rule runs on the model itself. On an invalid one, the keys that failed their
own rule are already in the list of problems; the rules whose keys are all valid still run, on a
partial view of the config (every key that passed its own rule, typed), so one message lists
everything. A rule sees only what it declared: reading another key raises UndeclaredKeyError, so a
declaration cannot fall behind its body.

Keys are spelled as in the stack file: `vllm.host`, `tensorParallelSize`; a node's as `nodes[].name`
(the rule sees the nodes whose declared keys are valid) or `nodes[*].gpus` (the rule runs only when
every node's is valid); a deployment's the same way: `deployments[].vllm.port`, `deployments[*].name`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Annotated, Any

from pydantic import BaseModel, TypeAdapter, ValidationError
from pydantic.alias_generators import to_camel

from components.config.errors import submodel


class _Failed:
    """A value that failed its own field rule (the runner's alone: no rule ever sees it)."""

    def __repr__(self) -> str:
        return "<failed>"


FAILED = _Failed()


class UndeclaredKeyError(Exception):
    """A rule read a key it did not declare."""


@dataclass(frozen=True)
class Rule:
    check: Callable[[Any], list[str]]
    keys: tuple[str, ...]
    # runs after the others, and a line of its on a key one of them named already is left out (its message
    # would say the same thing again, from farther away)
    deferred: bool = False

    @property
    def name(self) -> str:
        return self.check.__name__


RULES: list[Rule] = []


def rule(*keys: str, deferred: bool = False) -> Callable[[Callable[[Any], list[str]]], Callable[[Any], list[str]]]:
    """Registers a cross-field rule reading `keys`; rules run in the order they are declared (`deferred`: after
    the others, yielding a key they named)."""

    def register(check: Callable[[Any], list[str]]) -> Callable[[Any], list[str]]:
        RULES.append(Rule(check, keys, deferred))
        return check

    return register


def partial(model: type[BaseModel], raw: Any) -> Any:
    """The raw config as attributes, each field validated on its own: a field that fails is FAILED."""
    if not isinstance(raw, dict):
        return FAILED
    values = {}
    for name, field in model.model_fields.items():
        key = field.alias or name
        if key not in raw:
            # A missing required key has its own "Field required" message.
            values[name] = FAILED if field.is_required() else field.get_default(call_default_factory=True)
            continue
        sub, is_list = submodel(field.annotation)
        value = raw[key]
        if sub is not None and is_list:
            whole = Annotated[list[Any], *field.metadata] if field.metadata else list[Any]
            try:
                TypeAdapter(whole).validate_python(value)  # the list's own rules (at least one node)
            except ValidationError:
                values[name] = FAILED
                continue
            values[name] = [partial(sub, item) for item in value]
        elif sub is not None:
            values[name] = partial(sub, value)
        else:
            try:
                annotation = Annotated[field.annotation, *field.metadata] if field.metadata else field.annotation
                values[name] = TypeAdapter(annotation).validate_python(value)
            except ValidationError:
                values[name] = FAILED
    return SimpleNamespace(**values, raw=raw)


def failed_keys(source: Any, prefix: str = "") -> set[str]:
    """The keys of a partial view that failed: `vllm.port`; `nodes[].name` when any node's did; `nodes`
    when the list itself did. Empty for a valid model."""
    if isinstance(source, BaseModel):
        return set()
    found: set[str] = set()
    for name, value in vars(source).items():
        if name == "raw":
            continue
        key = prefix + to_camel(name)
        if value is FAILED:
            found.add(key)
        elif isinstance(value, list):
            for item in value:
                if item is FAILED:
                    found.add(key)
                elif isinstance(item, SimpleNamespace):
                    found |= failed_keys(item, key + "[].")
        elif isinstance(value, SimpleNamespace):
            found |= failed_keys(value, key + ".")
    return found


LISTS = ("nodes", "deployments")  # lists of objects a rule reads item by item (`nodes[].name`)


def _path_valid(item: Any, path: str) -> bool:
    """Whether `path` (`vllm.port`) of a list's item passed its own rule, and every section on the way."""
    value = item
    for part in path.split("."):
        value = getattr(value, _snake(part), FAILED)
        if value is FAILED:
            return False
    return True


class View:
    """What a rule sees of the config: the keys it declared (each valid), the nodes and deployments it may
    read (those whose declared keys are valid, each with its `index` and `label`)."""

    def __init__(self, source: Any, keys: frozenset[str], prefix: str = "", index: int | None = None) -> None:
        self._source, self._keys, self._prefix = source, keys, prefix
        if index is not None:
            self.index = index
            name = getattr(source, "name", FAILED)
            self.label = name if isinstance(name, str) else f"{prefix.removesuffix('[].')}[{index}]"

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        key = self._prefix + to_camel(name)
        value = getattr(self._source, name)
        if isinstance(value, list) and key in LISTS:
            return self._items(key, value)
        if isinstance(value, (BaseModel, SimpleNamespace)):
            if not any(declared.startswith(key + ".") for declared in self._keys):
                raise UndeclaredKeyError(key)
            return View(value, self._keys, key + ".")
        if key not in self._keys:
            raise UndeclaredKeyError(key)
        return value

    def _items(self, key: str, items: list[Any]) -> list[View]:
        wanted = [each.removeprefix(f"{key}[].") for each in self._keys if each.startswith(f"{key}[].")]
        seen = []
        for index, item in enumerate(items):
            if item is FAILED:
                continue
            if all(_path_valid(item, path) for path in wanted):
                seen.append(View(item, self._keys, f"{key}[].", index))
        return seen

    @property
    def node_count(self) -> int:
        """How many nodes the config lists, valid or not."""
        nodes = getattr(self._source, "nodes", [])
        return len(nodes) if isinstance(nodes, list) else 0

    def failed_values(self, key: str) -> list[Any]:
        """The values found for `key` (`nodes[].name`) where it failed its own rule: a rule may leave
        what they name to their own message."""
        field = _snake(key.removeprefix("nodes[]."))
        nodes = getattr(self._source, "nodes", [])
        if not isinstance(nodes, list):
            return []
        return [
            node.raw.get(to_camel(field))
            for node in nodes
            if isinstance(node, SimpleNamespace) and getattr(node, field) is FAILED
        ]


def _snake(key: str) -> str:
    return "".join(f"_{ch.lower()}" if ch.isupper() else ch for ch in key)


def skipped(keys: Iterable[str], failed: set[str]) -> bool:
    """Whether a rule reading `keys` cannot run: one of them (or the section holding it) failed; for a
    node's key read as `nodes[*].x`, any node's."""
    for key in keys:
        listed = next((name for name in LISTS if key.startswith((f"{name}[].", f"{name}[*]."))), None)
        if listed is not None:
            if listed in failed:
                return True
            if key.startswith(f"{listed}[*]."):
                parts = key.replace("[*]", "[]").split(".")
                if any(".".join(parts[: depth + 1]) in failed for depth in range(1, len(parts))):
                    return True
            continue
        parts = key.split(".")
        if any(".".join(parts[: depth + 1]) in failed for depth in range(len(parts))):
            return True
    return False


def run(source: Any, only: Callable[[Rule], bool] = lambda _: True) -> list[str]:
    """Every rule (of those `only` keeps) whose keys are valid in `source` (a ClusterConfig, or a partial
    view), in order."""
    failed = failed_keys(source)
    problems: list[str] = []
    for each in RULES:
        if not only(each) or skipped(each.keys, failed):
            continue
        keys = frozenset(key.replace("[*]", "[]") for key in each.keys)
        problems += each.check(View(source, keys))
    return problems
