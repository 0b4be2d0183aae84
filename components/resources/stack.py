"""Reading the stack's `spark-vllm:` config into a validated ClusterConfig (before any resource)."""

from __future__ import annotations

import json
from typing import Any

import pulumi
from pulumi.runtime import config as runtime_config

from components.config import NAMESPACE, ClusterConfig, load_cluster_config


def raw_stack_config(namespace: str = NAMESPACE) -> dict[str, Any]:
    """Every `namespace:` key of the stack, structured values decoded from their JSON form.

    All keys are read, not just the known ones, so a misspelt key is refused by the model
    instead of being silently ignored.
    """
    raw: dict[str, Any] = {}
    prefix = f"{namespace}:"
    # The language host passes config in PULUMI_CONFIG; the tests under Pulumi's mocks set it in the
    # runtime. Read both.
    everything = {**runtime_config.get_config_env(), **runtime_config.CONFIG.get()}
    for full_key, value in everything.items():
        if not full_key.startswith(prefix):
            continue
        key = full_key[len(prefix) :]
        if isinstance(value, str) and value.startswith(("[", "{")):
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                pass  # left as text: the model names the key and says what it expected
        raw[key] = value
    return raw


def foreign_config(namespace: str = NAMESPACE) -> tuple[dict[str, Any], set[str]]:
    """The stack's keys of every other namespace (full key → value) and which of them are secrets:
    the config rules refuse the ones that misspell `namespace`."""
    everything = {**runtime_config.get_config_env(), **runtime_config.CONFIG.get()}
    foreign = {key: value for key, value in everything.items() if not key.startswith(f"{namespace}:")}
    return foreign, {key for key in foreign if runtime_config.is_config_secret(key)}


def this_stack() -> str:
    """organization/project/stack of the running program (the file backend's organization is `organization`)."""
    organization = pulumi.get_organization() or "organization"
    return f"{organization}/{pulumi.get_project()}/{pulumi.get_stack()}"


def plain_text_keys(raw: dict[str, Any], namespace: str = NAMESPACE) -> set[str]:
    """The keys of `raw` that the stack holds in plain text, not as secrets (`--secret`)."""
    return {key for key in raw if not runtime_config.is_config_secret(f"{namespace}:{key}")}


def load_stack_config() -> ClusterConfig:
    raw = raw_stack_config()
    foreign, foreign_secret = foreign_config()
    cfg = load_cluster_config(
        raw, plain_text_keys(raw), this_stack=this_stack(), foreign=foreign, foreign_secret=foreign_secret
    )
    for node in cfg.nodes:
        if node.host_key is None:
            pulumi.log.warn(
                f"node {node.name}: no hostKey, so the first `pulumi up` trusts the key the node shows then "
                "(read with ssh-keyscan, kept in the stack's state, pinned on both SSH transports). To verify "
                f"it from the start, set nodes[].hostKey from `ssh-keyscan -p {node.ssh_port} -t ed25519 {node.host}` "
                "(security.requireHostKeys: true makes it required)"
            )
    if cfg.executor_reason:
        pulumi.log.info(cfg.executor_reason)  # shown in preview: which executor auto chose, and why
    if cfg.vllm.trust_remote_code:
        pulumi.log.warn(f"vllm.trustRemoteCode is on: the code shipped with model {cfg.model or '(promoted)'} runs")
    if cfg.vllm.allow_unauthenticated and cfg.api_key is None and not cfg.vllm.host.is_loopback:
        pulumi.log.warn(f"vLLM serves on {cfg.vllm.host}:{cfg.vllm.port} without an API key")
    return cfg


__all__ = ["ClusterConfig", "load_stack_config", "raw_stack_config"]
