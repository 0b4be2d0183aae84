"""metrics.grafanaNode: Grafana as a container of the stack (spark-vllm.grafana, host network, data on the
volume spark-vllm-grafana), provisioned at every start with the stack's Prometheus as its datasource (uid
spark-vllm-prometheus, the one the `dashboard` output's panels name) and that dashboard.

Grafana reads provisioning files from GF_PATHS_PROVISIONING (grafana.com/docs/grafana/latest/administration/
provisioning: datasources/*.yaml with `apiVersion: 1` and `datasources`, dashboards/*.yaml with `providers`
of `type: file` reading dashboard JSON from `options.path`). The files reach the container in its
environment (a secret in the state: the admin password is there too) and are written under /tmp by its
entrypoint before Grafana's own (`/run.sh` in the grafana/grafana image) starts. JSON is YAML, so every
file is JSON."""

from __future__ import annotations

import json
from typing import Any, Optional

import pulumi
import pulumi_docker as docker

from components.config import ClusterConfig
from components.plan.container import log_options
from components.plan.dashboard import DATASOURCE_UID
from components.resources.steps import DataKind, data_service

# a dot in the container's name: no node's container (spark-vllm-<DNS label>) has it
GRAFANA = DataKind("grafana", container="spark-vllm.grafana", volume="spark-vllm-grafana", data="/var/lib/grafana")
PROVISIONING = "/tmp/spark-vllm-grafana/provisioning"
DASHBOARDS = "/tmp/spark-vllm-grafana/dashboards"
ENTRYPOINT = "/run.sh"  # the grafana/grafana image's own
FILES = {  # environment variable -> the file its content becomes
    "SPARK_VLLM_GRAFANA_DATASOURCE": f"{PROVISIONING}/datasources/spark-vllm.yaml",
    "SPARK_VLLM_GRAFANA_PROVIDER": f"{PROVISIONING}/dashboards/spark-vllm.yaml",
    "SPARK_VLLM_GRAFANA_DASHBOARD": f"{DASHBOARDS}/spark-vllm.json",
}


def grafana_url(cfg: ClusterConfig) -> Optional[str]:
    return cfg.url_on(cfg.metrics.grafana_node, cfg.metrics.grafana_port)


def prometheus_address(cfg: ClusterConfig) -> str:
    """Where Grafana (host network) reaches the stack's Prometheus: itself on its node, else over the fabric."""
    node = cfg.node_named(cfg.metrics.prometheus_node)
    host = "127.0.0.1" if node.name == cfg.metrics.grafana_node else str(node.fabric_address)
    return f"http://{host}:{cfg.metrics.prometheus_port}"


def provisioning(cfg: ClusterConfig, board: dict[str, Any]) -> dict[str, str]:
    """Each provisioned file's content, by the environment variable that carries it."""
    datasource = {
        "apiVersion": 1,
        "datasources": [
            {
                "name": "spark-vllm Prometheus",
                "type": "prometheus",
                "uid": DATASOURCE_UID,
                "access": "proxy",
                "url": prometheus_address(cfg),
                "isDefault": True,
                "editable": False,
                "jsonData": {"timeInterval": f"{cfg.metrics.scrape_interval_seconds}s"},
            }
        ],
    }
    provider = {
        "apiVersion": 1,
        "providers": [
            {
                "name": "spark-vllm",
                "type": "file",
                "disableDeletion": True,
                "allowUiUpdates": False,
                "options": {"path": DASHBOARDS},
            }
        ],
    }
    texts = [datasource, provider, board]
    return {env: json.dumps(text, sort_keys=True) for env, text in zip(FILES, texts, strict=True)}


def grafana_env(cfg: ClusterConfig, board: dict[str, Any], password: str) -> list[str]:
    return [
        f"GF_SECURITY_ADMIN_PASSWORD={password}",
        f"GF_SERVER_HTTP_PORT={cfg.metrics.grafana_port}",
        f"GF_PATHS_PROVISIONING={PROVISIONING}",
        "GF_ANALYTICS_REPORTING_ENABLED=false",
        "GF_ANALYTICS_CHECK_FOR_UPDATES=false",
        *(f"{env}={text}" for env, text in provisioning(cfg, board).items()),
    ]


def grafana_entrypoint() -> list[str]:
    """The provisioning files from the environment (out of every command line), then Grafana in its place."""
    writes = [f"mkdir -p {PROVISIONING}/datasources {PROVISIONING}/dashboards {DASHBOARDS}"]
    writes += [f'printf "%s\\n" "${env}" > {path}' for env, path in FILES.items()]
    return ["/bin/sh", "-c", " && ".join([*writes, f"exec {ENTRYPOINT}"])]


class Grafana(pulumi.ComponentResource):
    def __init__(
        self,
        name: str,
        cfg: ClusterConfig,
        provider: docker.Provider,
        board: dict[str, Any],
        password: pulumi.Output[str],
        depends_on: list[pulumi.Resource],
        opts: Optional[pulumi.ResourceOptions] = None,
    ):
        super().__init__("spark-vllm:index:Grafana", name, None, opts)
        node = cfg.node_named(cfg.metrics.grafana_node)
        envs = pulumi.Output.secret(password.apply(lambda secret: grafana_env(cfg, board, secret)))
        self.container = data_service(
            node.name, GRAFANA, image=cfg.metrics.grafana_image, entrypoints=grafana_entrypoint(), envs=envs,
            restart=cfg.container.restart, logs=log_options(cfg), provider=provider, parent=self, depends_on=depends_on,
        )  # fmt: skip
        self.register_outputs({"container_id": self.container.id})
