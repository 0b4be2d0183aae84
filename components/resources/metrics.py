"""Metrics: what a Prometheus scrapes, and (metrics.prometheusNode) a Prometheus of the stack's own.

Targets, on the addresses network.guard lets the nodes reach: vLLM's `/metrics` on the head (rank 0
with executor mp; vLLM's key guards /v1 only, so no key is needed or given), the edge's requests per client
and model on its node's fabric address, and, with `ray.metricsExportPort`, Ray's metrics on every node's
fabric address. The `prometheusConfig` output is a Prometheus configuration (JSON, which is YAML) a user's
Prometheus can load as it is; it holds no secret. With metrics.prometheusNode, that node runs
the container `spark-vllm.prometheus` (host network, `metrics.prometheusImage`) with this
configuration and its samples on the volume `spark-vllm-prometheus`, kept when the stack goes.
"""

from __future__ import annotations

import json
from typing import Any, Optional

import pulumi
import pulumi_docker as docker

from components.config import ClusterConfig, NodeConfig
from components.config.replicas import replicas_of
from components.plan.container import log_options
from components.plan.endpoint import edge_node, vllm_host, vllm_port
from components.plan.shell import shell_line
from components.resources.steps import DataKind, data_service

# a dot in the container's name: no node's container (spark-vllm-<DNS label>) has it
PROMETHEUS = DataKind("prometheus", "spark-vllm.prometheus", volume="spark-vllm-prometheus", data="/prometheus")
PROMETHEUS_CONFIG_FILE = "/tmp/spark-vllm-prometheus.yml"
CONFIG_ENV = "SPARK_VLLM_PROMETHEUS_CONFIG"


def vllm_target(cfg: ClusterConfig) -> str:
    """vLLM's address as the nodes reach it (its head's fabric address, behind the edge)."""
    return f"{vllm_host(cfg)}:{vllm_port(cfg)}"


def _vllm_jobs(cfg: ClusterConfig) -> list[tuple[str, dict[str, str]]]:
    """(target, labels) of every replica's vLLM API server (its head's)."""
    return [(vllm_target(each.config), each.labels()) for each in replicas_of(cfg)]


def _ray_targets(cfg: ClusterConfig) -> list[tuple[str, str]]:
    """(target, node) of Ray's metrics, for every Ray cluster with ray.metricsExportPort."""
    found = []
    for each in replicas_of(cfg):
        rcfg = each.config
        if rcfg.executor == "ray" and rcfg.ray.metrics_export_port is not None:
            found += [(f"{node.fabric_address}:{rcfg.ray.metrics_export_port}", node.name) for node in rcfg.nodes]
    return list(dict.fromkeys(found))


def router_target(cfg: ClusterConfig) -> Optional[str]:
    if not cfg.router.enabled:
        return None
    node = next(node for node in cfg.nodes if node.name == cfg.router.node)
    return f"{node.fabric_address}:{cfg.router.metrics_port}"


def edge_target(cfg: ClusterConfig) -> str:
    """The edge's own port (edge.metricsPort) on its node's fabric address: its requests per client and model."""
    return f"{edge_node(cfg).fabric_address}:{cfg.edge.metrics_port}"


def targets(cfg: ClusterConfig) -> dict[str, list[str]]:
    found = {"vllm": [target for target, _ in _vllm_jobs(cfg)], "edge": [edge_target(cfg)]}
    if _ray_targets(cfg):
        found["ray"] = [target for target, _ in _ray_targets(cfg)]
    if cfg.metrics.node_port is not None:
        found["node"] = [f"{node.fabric_address}:{cfg.metrics.node_port}" for node in cfg.nodes]
    if router_target(cfg):
        found["router"] = [router_target(cfg)]
    return found


def scrape_config(cfg: ClusterConfig) -> dict[str, Any]:
    interval = f"{cfg.metrics.scrape_interval_seconds}s"
    vllm_job: dict[str, Any] = {
        "job_name": "vllm",
        "metrics_path": "/metrics",
        "static_configs": [{"targets": [target], "labels": labels} for target, labels in _vllm_jobs(cfg)],
    }
    edge_at = {"targets": [edge_target(cfg)], "labels": {"node": edge_node(cfg).name}}
    edge_job = {"job_name": "spark-vllm-edge", "static_configs": [edge_at]}
    jobs = [vllm_job, edge_job]
    ray = [{"targets": [target], "labels": {"node": node}} for target, node in _ray_targets(cfg)]
    if ray:
        jobs.append({"job_name": "ray", "static_configs": ray})
    if cfg.metrics.node_port is not None:
        port = cfg.metrics.node_port
        jobs.append(
            {
                "job_name": "spark-vllm-node",
                "static_configs": [
                    {"targets": [f"{node.fabric_address}:{port}"], "labels": {"node": node.name}} for node in cfg.nodes
                ],
            }
        )
    if router_target(cfg):
        jobs.append(
            {
                "job_name": "vllm-router",
                "static_configs": [{"targets": [router_target(cfg)], "labels": {"node": cfg.router.node}}],
            }
        )
    if cfg.metrics.prometheus_node is not None:
        port = cfg.metrics.prometheus_port
        jobs.append({"job_name": "prometheus", "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]})
    return {"global": {"scrape_interval": interval, "evaluation_interval": interval}, "scrape_configs": jobs}


def prometheus_config(cfg: ClusterConfig) -> str:
    return json.dumps(scrape_config(cfg), indent=2)


def config_env(text: str) -> str:
    """The configuration as the container's environment entry: one line (JSON needs no newlines)."""
    return f"{CONFIG_ENV}={json.dumps(json.loads(text), separators=(',', ':'))}"


def prometheus_node(cfg: ClusterConfig) -> Optional[NodeConfig]:
    return cfg.node_named(cfg.metrics.prometheus_node)


def prometheus_url(cfg: ClusterConfig) -> Optional[str]:
    return cfg.url_on(cfg.metrics.prometheus_node, cfg.metrics.prometheus_port)


def prometheus_entrypoint(cfg: ClusterConfig) -> list[str]:
    """The container's main process: the configuration (from the environment, where Docker keeps it
    out of every command line) written to a file, then Prometheus in its place."""
    metrics = cfg.metrics
    prometheus = [
        "/bin/prometheus",
        f"--config.file={PROMETHEUS_CONFIG_FILE}",
        f"--storage.tsdb.path={PROMETHEUS.data}",
        f"--storage.tsdb.retention.time={metrics.retention_days}d",
        f"--web.listen-address=0.0.0.0:{metrics.prometheus_port}",
    ]
    write = f'printf "%s\\n" "${CONFIG_ENV}" > {PROMETHEUS_CONFIG_FILE}'
    return ["/bin/sh", "-c", f"{write} && exec {shell_line(prometheus)}"]


class Prometheus(pulumi.ComponentResource):
    """metrics.prometheusNode: Prometheus as a container of the stack on that node."""

    def __init__(
        self,
        name: str,
        cfg: ClusterConfig,
        provider: docker.Provider,
        config_text: pulumi.Input[str],
        depends_on: list[pulumi.Resource],
        opts: Optional[pulumi.ResourceOptions] = None,
    ):
        super().__init__("spark-vllm:index:Prometheus", name, None, opts)
        node = prometheus_node(cfg)
        envs = pulumi.Output.from_input(config_text).apply(lambda text: [config_env(text)])
        # On the host network: it scrapes the nodes' fabric addresses, which the guard lets in.
        self.container = data_service(
            node.name, PROMETHEUS, image=cfg.metrics.prometheus_image, entrypoints=prometheus_entrypoint(cfg),
            envs=envs, restart=cfg.container.restart, logs=log_options(cfg), provider=provider, parent=self,
            depends_on=depends_on,
        )  # fmt: skip
        self.register_outputs({"container_id": self.container.id})
