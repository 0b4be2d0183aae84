"""What scripts/diagnose.py needs to collect the stack's diagnostics bundle (the `diagnostics` output) and
the command line that does it (`diagnoseCommand`): how to reach each node over the same SSH the program
uses, and which containers are the stack's there. Plain data: no secret goes in it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional

import pulumi

from components.config import ClusterConfig
from components.config.replicas import replicas_of
from components.plan.names import RUN_DIR
from components.resources.depot import DEPOT_CONTAINER
from components.resources.grafana import GRAFANA
from components.resources.guard import GUARD_CONTAINER
from components.resources.metrics import PROMETHEUS
from components.resources.router import ROUTER_CONTAINER


def node_containers(cfg: ClusterConfig, node_name: str, container: Any) -> list[str]:
    """The stack's containers on a node, vLLM's first (with deployments, each replica's there)."""
    found = _listed(container)
    if cfg.network.guard:
        found.append(GUARD_CONTAINER)
    if cfg.uses_depot and node_name == cfg.copy_source.name:
        found.append(DEPOT_CONTAINER)
    if cfg.metrics.prometheus_node == node_name:
        found.append(PROMETHEUS.container)
    if cfg.metrics.grafana_node == node_name and cfg.metrics.prometheus_node:
        found.append(GRAFANA.container)
    if cfg.router.enabled and cfg.router.node == node_name:
        found.append(ROUTER_CONTAINER)
    return found


def diagnostics_output(
    cfg: ClusterConfig,
    stack: str,
    containers: Mapping[str, Any],
    host_keys: Mapping[str, pulumi.Input[str]],
    identity: Optional[str],
) -> dict[str, Any]:
    return {
        "stack": stack,
        "nodes": [
            {
                "name": node.name,
                "host": node.host,
                "user": node.user,
                "sshPort": node.ssh_port,
                "hostKey": host_keys[node.name],
                "identity": identity,
                "containers": node_containers(cfg, node.name, containers.get(node.name) or []),
                "vllmContainers": _listed(containers.get(node.name) or []),
                "runDir": RUN_DIR,
                "fabricInterface": node.fabric_interface,
                "head": any(node.name == each.config.head_node.name for each in replicas_of(cfg)),
            }
            for node in cfg.nodes
        ],
    }


def _listed(container: Any) -> list[str]:
    return [container] if isinstance(container, str) else list(container)


def diagnose_command(stack: str) -> str:
    """Run from this repository's checkout, where `pulumi` reaches the stack."""
    return f"python3 scripts/diagnose.py --stack {stack}"
