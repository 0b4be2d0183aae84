"""The ports each node's listeners take with a config: sshd, vLLM, Ray's (fixed and ranges), the fabric
gate's test, Prometheus, the copy depot. The port rule (rules.py) refuses two on one port; network.guard
(components/resources/guard.py) fences exactly these."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from components.config.deployments import RouterConfig
from components.config.sections import (
    EdgeConfig,
    FabricConfig,
    FabricCopyConfig,
    MetricsConfig,
    NodeConfig,
    RayConfig,
    VllmConfig,
)

# Ray's listeners: (key under `ray`, on the head only, what listens there).
RAY_CLIENT_KEY, RAY_CLIENT_PORT = "Ray's fixed client port", 10001
# Where Ray's raylet, object manager, agents and metrics listen, and NCCL/Gloo/torch: ports the kernel
# hands out (net.ipv4.ip_local_port_range; Linux's default range, which network.guard reads on the node).
EPHEMERAL_KEY, EPHEMERAL_RANGE = "the kernel's ephemeral range", (32768, 60999)
EDGE_OWN = "the edge's own port (metrics on the fabric address, its check on loopback)"


@dataclass(frozen=True)
class Listener:
    """A port (or a range of ports) something the program starts, or sshd, listens on at a node."""

    key: str  # the config key that sets it
    what: str
    first: int
    last: int
    default: bool  # the key's value is its default (so a clash is more likely the other key's doing)

    def __str__(self) -> str:
        where = str(self.first) if self.first == self.last else f"{self.first}-{self.last}"
        return f"{self.key} {where} ({self.what})"

    def overlaps(self, other: Listener) -> bool:
        return self.first <= other.last and other.first <= self.last


def _default(model: type[BaseModel], field: str) -> int:
    return model.model_fields[field].default


class _Found(list):
    """The listeners found so far, and how one is added."""

    def add(self, key: str, what: str, first: Any, last: Any = None, default: Any = None) -> None:
        """`default`: the key's default (first, last); None for a port no key sets."""
        last = first if last is None else last
        if first is not None and last is not None:
            self.append(Listener(key, what, first, last, default is None or (first, last) == default))


def _single(model: type[BaseModel], field: str) -> tuple[int, int]:
    return _default(model, field), _default(model, field)


def node_listeners(cfg: Any, index: int) -> list[Listener]:
    """What listens on the ports of node `index` with this config (a ClusterConfig, or the view the port
    rule gets of one: components/config/rules.py)."""
    found = _Found()
    node = cfg.nodes[index]
    found.add(f"nodes[{index}].sshPort", "sshd, never touched", node.ssh_port, default=_single(NodeConfig, "ssh_port"))
    head_name = cfg.head if cfg.head is not None else cfg.nodes[0].name
    is_head = node.name == head_name
    vllm = cfg.vllm
    if is_head and cfg.router.enabled:
        found.add("vllm.port", "vLLM API server", vllm.port, default=_single(VllmConfig, "port"))
    elif is_head:  # the edge takes the endpoint's port, vLLM another behind it
        found.add("vllm.port", "the endpoint's edge", vllm.port, default=_single(VllmConfig, "port"))
        found.add("edge.vllmPort", "vLLM API server, behind the edge", cfg.edge.vllm_port,
                  default=_single(EdgeConfig, "vllm_port"))  # fmt: skip
        found.add("edge.metricsPort", EDGE_OWN, cfg.edge.metrics_port,
                  default=_single(EdgeConfig, "metrics_port"))  # fmt: skip
    if cfg.executor == "mp" and is_head and len(cfg.nodes) > 1:
        found.add("vllm.masterPort", "vLLM rank 0 with executor mp", vllm.master_port,
                  default=_single(VllmConfig, "master_port"))  # fmt: skip
    if cfg.executor == "ray":
        _ray_listeners(found, cfg.ray, is_head)
    fabric = cfg.fabric
    testing = len(cfg.nodes) > 1 and fabric.gate != "off"
    if testing and fabric.bandwidth_test == "tcp":
        found.add("fabric.testPort", "fabric gate's bandwidth test, during the checks", fabric.test_port,
                  default=_single(FabricConfig, "test_port"))  # fmt: skip
    if testing and fabric.bandwidth_test == "nccl" and is_head:  # the other ranks only connect
        found.add("fabric.testPort", "the NCCL test's rendezvous, during the checks", fabric.test_port,
                  default=_single(FabricConfig, "test_port"))  # fmt: skip
    _service_listeners(found, cfg, node, head_name)
    return list(found)


def _ray_listeners(found: _Found, ray: Any, is_head: bool) -> None:
    """Ray's: the GCS, dashboard and client server on the head; the workers' range and the rest on every node."""
    if is_head:
        found.add("ray.port", "Ray GCS", ray.port, default=_single(RayConfig, "port"))
        if ray.dashboard is True:
            found.add("ray.dashboardPort", "Ray dashboard", ray.dashboard_port,
                      default=_single(RayConfig, "dashboard_port"))  # fmt: skip
        # Not settable without the `ray[client]` extra (`ray start` refuses the flag), so Ray's own.
        found.add(RAY_CLIENT_KEY, "Ray Client server, with ray[client]", RAY_CLIENT_PORT)
    if ray.min_worker_port <= ray.max_worker_port:
        workers = (_default(RayConfig, "min_worker_port"), _default(RayConfig, "max_worker_port"))
        found.add("ray.minWorkerPort-maxWorkerPort", "Ray worker processes", ray.min_worker_port, ray.max_worker_port,
                  default=workers)  # fmt: skip
    if ray.metrics_export_port is not None:
        found.add("ray.metricsExportPort", "Ray's metrics", ray.metrics_export_port)
    found.add(EPHEMERAL_KEY, "Ray's raylet, object manager and agents, NCCL, Gloo", *EPHEMERAL_RANGE)


def _service_listeners(found: _Found, cfg: Any, node: Any, head_name: str) -> None:
    """The stack's services on `node`: the node metrics, Prometheus, Grafana, the router, the copy depot."""
    metrics = cfg.metrics
    if metrics.node_port is not None:
        found.add("metrics.nodePort", "the supervisor's node metrics", metrics.node_port)
    if metrics.prometheus_node == node.name:
        found.add("metrics.prometheusPort", "Prometheus", metrics.prometheus_port,
                  default=_single(MetricsConfig, "prometheus_port"))  # fmt: skip
    if metrics.grafana_node == node.name:
        found.add("metrics.grafanaPort", "Grafana", metrics.grafana_port,
                  default=_single(MetricsConfig, "grafana_port"))  # fmt: skip
    router = cfg.router
    if router.enabled and router.node == node.name:
        found.add("router.port", "the endpoint's edge, before vllm-router", router.port,
                  default=_single(RouterConfig, "port"))  # fmt: skip
        found.add("router.metricsPort", "the router's metrics", router.metrics_port,
                  default=_single(RouterConfig, "metrics_port"))  # fmt: skip
        found.add("router.innerPort", "vllm-router behind the edge, on loopback", router.inner_port,
                  default=_single(RouterConfig, "inner_port"))  # fmt: skip
        found.add("edge.metricsPort", EDGE_OWN, cfg.edge.metrics_port,
                  default=_single(EdgeConfig, "metrics_port"))  # fmt: skip
    transfer, sync, copy = cfg.image_transfer, cfg.model_sync, cfg.fabric_copy
    copying = transfer.method == "copy" or sync.enabled is True
    if copying and len(cfg.nodes) > 1:
        source = copy.source if copy.source is not None else head_name
        if node.name == source:
            found.add("fabricCopy.port", "fabric copy depot", copy.port, default=_single(FabricCopyConfig, "port"))
