"""What the router's keeper is handed, and where the router and its workers are: pure (no Pulumi), so the
GPU lane renders the same (tests/gpu/lane_router.py)."""

from __future__ import annotations

from typing import Any

from components.config import ClusterConfig, NodeConfig
from components.scripts.node_contract import KEEPER_MODES, params_of


def router_node(cfg: ClusterConfig) -> NodeConfig:
    return next(node for node in cfg.nodes if node.name == cfg.router.node)


def keeper_params(cfg: ClusterConfig, mode: str, **extra: Any) -> dict[str, Any]:
    """router_keeper.py's parameters in `mode`, with that mode's own (its class in KEEPER_MODES: a key it lacks or
    one of another mode is a TypeError here)."""
    router, node = cfg.router, router_node(cfg)
    return params_of(
        KEEPER_MODES[mode],
        mode=mode,
        host="0.0.0.0" if router.host == "0.0.0.0" else str(node.fabric_address),
        port=router.port,
        inner_port=router.inner_port,
        metrics_host=str(node.fabric_address),
        metrics_port=router.metrics_port,
        policy=router.policy,
        version=router.version,
        index_url=router.index_url,
        health_interval=router.health_check_interval_seconds,
        **extra,
    )
