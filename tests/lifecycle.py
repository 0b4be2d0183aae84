"""What `pulumi up` would do to each resource between two runs of the program.

Pulumi's mocks run no provider diff, so the decision is reasoned from each provider's rules
(../shared/REFERENCE.md): almost every Container input forces a replacement; a remote Command is
replaced when `triggers` change and updated when `create`, `stdin`, `environment`, `update` or
`delete` change; a RemoteImage is replaced when its `name` changes; a provider is updated in place.
The same function drives the rehearsal engine in tests/e2e, so both agree on what a change does.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

CONTAINER = "docker:index/container:Container"
IMAGE = "docker:index/remoteImage:RemoteImage"
DOCKER_PROVIDER = "pulumi:providers:docker"
REMOTE_COMMAND = "command:remote:Command"
LOCAL_COMMAND = "command:local:Command"

# Container inputs the docker provider updates in place; every other input replaces it.
CONTAINER_IN_PLACE = {"restart", "memory", "memorySwap", "cpuShares", "maxRetryCount"}


def changed_keys(old: dict[str, Any], new: dict[str, Any]) -> set[str]:
    return {key for key in set(old) | set(new) if old.get(key) != new.get(key)}


def action(typ: str, old: dict[str, Any] | None, new: dict[str, Any] | None) -> str:
    """One of: same, update, replace, create, delete."""
    if old is None:
        return "create"
    if new is None:
        return "delete"
    keys = changed_keys(old, new)
    if not keys:
        return "same"
    if typ == CONTAINER:
        return "update" if keys <= CONTAINER_IN_PLACE else "replace"
    if typ == IMAGE:
        return "replace" if keys & {"name", "platform", "pullTriggers", "triggers"} else "update"
    if typ in (REMOTE_COMMAND, LOCAL_COMMAND):
        return "replace" if "triggers" in keys else "update"
    if typ.startswith("pulumi:providers:"):
        return "update"
    return "replace"


def plan(old: Iterable, new: Iterable) -> dict[str, str]:
    """URN → action, for every custom resource of two runs (objects with .urn, .typ, .inputs, .custom)."""
    before = {r.urn: r for r in old if r.custom}
    after = {r.urn: r for r in new if r.custom}
    result = {}
    for urn in before.keys() | after.keys():
        typ = (after.get(urn) or before[urn]).typ
        result[urn] = action(
            typ, before[urn].inputs if urn in before else None, after[urn].inputs if urn in after else None
        )
    return result


def touched(plan_: dict[str, str]) -> dict[str, str]:
    return {urn.rsplit("::", 1)[1]: act for urn, act in plan_.items() if act != "same"}
