"""The edge: HAProxy in front of the stack's endpoint (components/plan/edge.py says what it lets through,
components/plan/endpoint.py where it and vLLM listen). On the endpoint's node:

  `<node>-edge-image`      the HAProxy image (edge.image), pulled by the node;
  `<node>-edge`            the container spark-vllm.edge (host network), its configuration on the volume
                           spark-vllm-edge, so a restart or a reboot starts it with the last one applied;
  `spark-vllm-edge-config` the configuration (haproxy.cfg and the files it names: the certificate and key with
                           `tls`, the counters' Lua), written over stdin (a secret: it holds the program's key
                           and the TLS key), checked by HAProxy, and reloaded in place: a change of keys,
                           certificate, models or limits replaces no container and drops no request in flight.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

import pulumi
import pulumi_command as command
import pulumi_docker as docker

from components.config import ClusterConfig
from components.plan.container import log_options
from components.plan.edge import CONFIG_DIR, EdgeSpec, archive
from components.plan.endpoint import edge_node
from components.plan.names import EDGE_USER_ID
from components.plan.programs import script
from components.plan.shell import with_log_tail_on_failure
from components.resources.steps import SECRET_IO, DataKind, data_service, remote_step

EDGE = DataKind("edge", "spark-vllm.edge", volume="spark-vllm-edge", data=CONFIG_DIR)
APPLY_TIMEOUT_SECONDS = 120
# The edge's watchdog (components/scripts/edge_entry.sh): its own check every 10 s; three missed in a row end
# the container, which Docker starts again (container.restart).
WATCH_INTERVAL_SECONDS = 10
WATCH_MISSES = 3


def entrypoints() -> list[str]:
    """The container's main process: edge_entry.sh, which runs HAProxy and watches it."""
    return ["bash", "-c", script("edge_entry.sh"), "edge_entry", str(WATCH_INTERVAL_SECONDS), str(WATCH_MISSES)]


def apply_command(cfg: ClusterConfig) -> str:
    """The step's command on the node: edge_apply.sh in the edge's container, as root (the image's user is
    haproxy), the configuration on stdin; on failure the node's name and the edge's log tail. Plain: made of
    what is known at plan time, never of the secret configuration."""
    argv = ["timeout", "--kill-after=10", str(APPLY_TIMEOUT_SECONDS), "docker", "exec", "-u", "0", "-i",
            EDGE.container, "bash", "-c", script("edge_apply.sh"), "edge_apply"]  # fmt: skip
    return with_log_tail_on_failure(argv, edge_node(cfg), EDGE.container)


class Edge(pulumi.ComponentResource):
    def __init__(
        self,
        name: str,
        cfg: ClusterConfig,
        spec: pulumi.Input[EdgeSpec],
        provider: docker.Provider,
        connection: command.remote.ConnectionArgs,
        depends_on: Sequence[pulumi.Resource] = (),
        pull_after: Sequence[pulumi.Resource] = (),
        opts: Optional[pulumi.ResourceOptions] = None,
    ):
        super().__init__("spark-vllm:index:Edge", name, None, opts)
        node = edge_node(cfg)
        self.container = data_service(
            node.name,
            EDGE,
            image=cfg.edge.image,
            entrypoints=entrypoints(),
            restart=cfg.container.restart,
            logs=log_options(cfg),
            user=EDGE_USER_ID,  # the uid network.guard lets reach vllm-router's port (the official image's own)
            guarded=cfg.network.guard,  # its own port (edge.metricsPort) is fenced
            provider=provider,
            parent=self,
            depends_on=depends_on,
            pull_after=pull_after,
        )
        self.config = remote_step(
            f"{name}-edge-config",
            connection,
            apply_command(cfg),
            stdin=pulumi.Output.secret(pulumi.Output.from_input(spec).apply(archive)),
            triggers=[self.container.id],
            parent=self,
            secret_outputs=SECRET_IO,
        )
        self.register_outputs({"container_id": self.container.id})
