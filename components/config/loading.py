"""Loading the `spark-vllm:` namespace: the models, their rules, and what only the stack around them
can say (secrets set in plain text, a promotion from itself, a misspelt namespace), all problems in
one ConfigError before anything else runs."""

from __future__ import annotations

import re
import shlex
from collections.abc import Collection, Mapping
from typing import Any, Optional

from pydantic import ValidationError

from components.config.errors import ConfigError, problem
from components.config.key_paths import describe
from components.config.key_rules import certificate_problems, endpoint_host
from components.config.models import SECRET_KEYS, ClusterConfig, resolve_raw
from components.config.rules import run_rules
from components.config.runner import partial
from components.config.types import NAMESPACE


def _plain_secret_problems(raw: dict[str, Any], plain: Collection[str]) -> list[str]:
    problems = []
    for key in SECRET_KEYS:
        if key in raw and key in plain:
            value = "< ~/.ssh/id_ed25519" if key == "sshPrivateKey" else "…"
            problems.append(
                problem(
                    key,
                    "[set in plain text]",
                    f"a Pulumi secret: as it is, the value sits readable in Pulumi.<stack>.yaml, which gets committed; "
                    f"run `pulumi config rm {key}` then `pulumi config set --secret {key} {value}` "
                    "(and change the value if that file was shared)",
                )
            )
    return problems


def _edit_distance(a: str, b: str) -> int:
    """Damerau-Levenshtein distance (optimal string alignment): a swapped pair of letters counts once."""
    rows = [list(range(len(b) + 1))] + [[i] + [0] * len(b) for i in range(1, len(a) + 1)]
    for i in range(1, len(a) + 1):
        for j in range(1, len(b) + 1):
            cost = 0 if a[i - 1] == b[j - 1] else 1
            rows[i][j] = min(rows[i - 1][j] + 1, rows[i][j - 1] + 1, rows[i - 1][j - 1] + cost)
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                rows[i][j] = min(rows[i][j], rows[i - 2][j - 2] + 1)
    return rows[-1][-1]


def near_namespace(namespace: str) -> bool:
    """Whether `namespace` is a misspelling of this project's (`spark_vllm`, `Spark-vLLM`, `spark-vlm`,
    `sprak-vllm`), not another namespace (`docker`, `pulumi`, `aws`)."""
    if namespace == NAMESPACE:
        return False
    folded = re.sub(r"[^a-z0-9]", "", namespace.lower())
    return folded == re.sub(r"[^a-z0-9]", "", NAMESPACE) or _edit_distance(namespace.lower(), NAMESPACE) <= 2


def namespace_problems(foreign: Mapping[str, Any], secret: Collection[str] = ()) -> list[str]:
    """Keys of another namespace (`full key → value`) that misspell this project's: Pulumi hands them to
    the program like any other namespace's, and the program would never read them. `secret` names the
    full keys held as secrets (their values are not shown)."""
    problems = []
    for full_key in sorted(foreign):
        namespace, sep, key = full_key.partition(":")
        if not sep or not near_namespace(namespace):
            continue
        value = "[secret]" if full_key in secret or key in SECRET_KEYS else foreign[full_key]
        flag = "--secret " if full_key in secret or key in SECRET_KEYS else ""
        problems.append(
            problem(
                full_key,
                value,
                f"a key of the {NAMESPACE!r} namespace: {namespace!r} is not {NAMESPACE!r}, so the program never "
                f"reads it; `pulumi config rm {shlex.quote(full_key)}` then `pulumi config set {flag}--path "
                f"{shlex.quote(NAMESPACE + ':' + key)} …`",
            )
        )
    return problems


def _qualified(name: str, this_stack: str) -> tuple[str, ...]:
    """A stack name as organization/project/stack, filled from `this_stack` (Pulumi reads `stack` and
    `organization/stack` within the current project)."""
    organization, project, _ = this_stack.split("/")
    parts = name.split("/")
    if len(parts) == 1:
        return organization, project, parts[0]
    if len(parts) == 2:
        return parts[0], project, parts[1]
    return tuple(parts)


def _self_promotion_problems(raw: dict[str, Any], this_stack: Optional[str]) -> list[str]:
    promote = raw.get("promoteFrom")
    if this_stack is None or not isinstance(promote, str) or this_stack.count("/") != 2:
        return []
    if _qualified(promote, this_stack) != tuple(this_stack.split("/")):
        return []
    return [
        problem(
            "promoteFrom",
            promote,
            f"another stack than this one ({this_stack}): a stack promoting from itself redeploys its own last "
            "release and validates nothing; name the stack that validated the release (e.g. "
            f"{this_stack.rsplit('/', 1)[0]}/staging)",
        )
    ]


def load_cluster_config(
    raw: dict[str, Any],
    plain: Collection[str] = (),
    *,
    this_stack: Optional[str] = None,
    foreign: Optional[Mapping[str, Any]] = None,
    foreign_secret: Collection[str] = (),
) -> ClusterConfig:
    """Validate the `spark-vllm:` namespace given as a dict of camelCase keys. `plain` names the keys
    the stack holds in plain text (not `--secret`): any of apiKey, hfToken, sshPrivateKey there is refused.
    `this_stack` (organization/project/stack) refuses a promoteFrom of itself; `foreign` (the stack's
    keys of other namespaces, `foreign_secret` those held as secrets) refuses a misspelt namespace.

    Raises ConfigError naming every problem; nothing else in the program runs before this.
    """
    outer_problems = _plain_secret_problems(raw, plain)
    outer_problems += _self_promotion_problems(raw, this_stack)
    outer_problems += namespace_problems(foreign or {}, foreign_secret)
    try:
        cfg = ClusterConfig.model_validate(raw)
    except ValidationError as error:
        cfg, problems = None, [line for item in error.errors() for line in describe(item)]
    else:
        problems = run_rules(cfg)  # every key valid: the cross-field rules run on the whole config
        outer_problems += certificate_problems(cfg, endpoint_host(cfg))
    problems += [line for line in outer_problems if line not in problems]
    if cfg is not None and not problems:
        return cfg
    if cfg is None and isinstance(raw, dict):
        raw, _ = resolve_raw(raw)  # as the model resolves it
        # The rules whose keys are valid run on what is: one message lists everything.
        seen = partial(ClusterConfig, raw)
        problems += [line for line in run_rules(seen) + certificate_problems(seen, None) if line not in problems]
    raise ConfigError(problems)
