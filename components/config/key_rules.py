"""The rules of the endpoint's keys and certificate (apiKey, apiKeys, tls): registered when imported (rules.py
imports this). A message names the client or the part of the certificate, never a key or a certificate's text."""

from __future__ import annotations

import hashlib
from typing import Any, Optional

from components.config.errors import problem
from components.config.models import DEFAULT_CLIENT, PROGRAM_CLIENT
from components.config.runner import rule
from components.config.tls import tls_problems


@rule("apiKey", "apiKeys")
def each_client_has_its_own_key(cfg: Any) -> list[str]:
    """Two clients with one key could not be told apart (and removing one would not lock it out); the names the
    edge gives apiKey's client and the program's own are taken."""
    problems = []
    for name in sorted(set(cfg.api_keys) & {DEFAULT_CLIENT, PROGRAM_CLIENT}):
        whose = "apiKey's" if name == DEFAULT_CLIENT else "the program's own steps'"
        problems.append(problem(f"apiKeys.{name}", "[secret]", f"another name: {name!r} is {whose} in the edge's log"))
    keys = {DEFAULT_CLIENT: cfg.api_key} if cfg.api_key is not None else {}
    keys |= dict(cfg.api_keys)
    by_digest: dict[str, list[str]] = {}
    for name, key in keys.items():
        by_digest.setdefault(hashlib.sha256(key.get_secret_value().encode()).hexdigest(), []).append(name)
    for names in by_digest.values():
        if len(names) > 1:
            paths = ["apiKey" if name == DEFAULT_CLIENT else f"apiKeys.{name}" for name in names]
            problems.append(
                problem(
                    paths[-1],
                    "[secret]",
                    f"a key of its own: {', '.join(paths)} are one key, so the edge could "
                    "not tell those clients apart (make one with `openssl rand -base64 24`)",
                )
            )
    return problems


def endpoint_host(cfg: Any) -> Optional[str]:
    """The host clients reach the endpoint at (a validated config; None where it names a node it lacks)."""
    node = cfg.endpoint_node
    return node.host if node is not None else None


def certificate_problems(cfg: Any, host: Optional[str]) -> list[str]:
    """What is wrong with `tls` for an endpoint reached at `host` (None: a config whose nodes or router did not
    validate, so every check but the names). loading.py runs this after the rules: only the whole config says
    where the endpoint is (a deployment's view of it does not)."""
    tls = getattr(cfg, "tls", None)
    parts = [getattr(tls, name, None) for name in ("certificate", "ca")]
    if not all(isinstance(part, str) for part in parts) or not hasattr(getattr(tls, "key", None), "get_secret_value"):
        return []  # no tls, or one whose keys failed their own rules (said already)
    found = tls_problems(tls.certificate, tls.key.get_secret_value(), tls.ca, host)
    return [problem(path, "[secret]" if path == "tls.key" else "[PEM]", expected) for path, expected in found]
