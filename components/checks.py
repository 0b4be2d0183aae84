"""Checks on one node before its Ray container starts: fabric link, peers, Docker, GPU, model.

Each check is a remote command on that node's host. What they print is judged in the cluster
(components/preflight.py): every Ray container's image input waits for every node's checks, so
one failing node leaves nothing half-started anywhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import pulumi
import pulumi_command as command

from components.config import ClusterConfig, NodeConfig
from components.fabric import gate_params
from components.preflight import fingerprint_argv, image_check_argv, model_path, node_memory, preflight_argv
from components.render import script, script_program, shell_line, with_script
from components.steps import remote_step


@dataclass(frozen=True)
class NodeChecksArgs:
    config: ClusterConfig
    node: NodeConfig
    connection: command.remote.ConnectionArgs
    image_id: pulumi.Input[str]  # this node's pulled image, for the GPU check
    model: pulumi.Input[str]
    after: Sequence[pulumi.Resource] = ()  # every node's fabric network, when managed; its model copy
    reread: Sequence[pulumi.Input] = ()  # values whose change means the model must be checked again


def gpu_check(node: NodeConfig, image_id: str) -> str:
    """A throwaway container must see a GPU through the NVIDIA runtime, as the Ray container will."""
    probe = ["docker", "run", "--rm", "--gpus", "all", "--entrypoint", "nvidia-smi", image_id, "-L"]
    hint = shell_line(
        [
            "echo",
            f"preflight {node.name}: no GPU visible in a container (--gpus all) — install the NVIDIA "
            "Container Toolkit and restart Docker, or set container.gpus: false on CPU-only hosts",
        ]
    )
    return f"{shell_line(probe)} || {{ {hint} >&2; exit 1; }}"


def fabric_gate_probe(
    cfg: ClusterConfig,
    node: NodeConfig,
    connection: command.remote.ConnectionArgs,
    triggers: Sequence[pulumi.Input],
    after: Sequence[pulumi.Resource],
    parent: pulumi.Resource,
) -> command.remote.Command:
    """`<node>-fabric-gate`: components/scripts/node_fabric_gate.py on the node's host. Every node's runs at
    once (the bandwidth test needs the peers' probes listening) as soon as the node is reachable: it
    waits for nothing but the fabric networks. Read-only; runs again when `triggers` change."""
    return remote_step(
        f"{node.name}-fabric-gate",
        connection,
        with_script(shell_line(["python3", "-"]), script_program("node_fabric_gate.py", gate_params(cfg, node))),
        triggers=list(triggers),
        parent=parent,
        depends_on=after,
    )


class NodeChecks(pulumi.ComponentResource):
    preflight: command.remote.Command
    fingerprint: Optional[pulumi.Output[str]]
    gpu: Optional[command.remote.Command]

    def __init__(self, name: str, args: NodeChecksArgs, opts: Optional[pulumi.ResourceOptions] = None):
        super().__init__("spark-vllm:index:NodeChecks", name, None, opts)
        cfg, node = args.config, args.node
        model = pulumi.Output.from_input(args.model)
        # Read-only checks have nothing to undo, hence no delete. They run again when the release
        # (model or image) changes, i.e. whenever the Ray containers would be recreated.
        self.preflight = remote_step(
            f"{name}-preflight",
            args.connection,
            model.apply(lambda m: with_script(shell_line(preflight_argv(cfg, node, m)), script("preflight_node.sh"))),
            triggers=[args.image_id, model, *args.reread],
            parent=self,
            depends_on=args.after,
        )
        self.fingerprint = None
        if model_path(cfg.model) or cfg.promote_from or cfg.downloads_once:
            fingerprint = remote_step(
                f"{name}-model-fingerprint",
                args.connection,
                model.apply(
                    lambda m: (
                        with_script(shell_line(fingerprint_argv(m)), script("model_fingerprint.py"))
                        if model_path(m)
                        else "echo '{}'"
                    )
                ),
                triggers=[model, *args.reread],
                parent=self,
                depends_on=[self.preflight],
            )
            self.fingerprint = fingerprint.stdout
        # What the image holds (vLLM, Ray, the dashboard's packages), judged in the cluster's gate.
        self.image = remote_step(
            f"{name}-image-check",
            args.connection,
            pulumi.Output.from_input(args.image_id).apply(
                lambda image: with_script(shell_line(image_check_argv(image)), script("image_probe.py"))
            ),
            triggers=[args.image_id],
            parent=self,
            depends_on=[self.preflight],
        )
        self.gpu = None
        if cfg.container.gpus:
            self.gpu = remote_step(
                f"{name}-gpu-check",
                args.connection,
                pulumi.Output.from_input(args.image_id).apply(lambda image: gpu_check(node, image)),
                triggers=[args.image_id],
                parent=self,
                depends_on=[self.preflight],
            )
        self.passed = pulumi.Output.all(self.preflight.stdout, *([self.gpu.stdout] if self.gpu else [])).apply(
            lambda _: True
        )
        self.image_facts = self.image.stdout
        self.memory = self.preflight.stdout.apply(lambda out: node_memory(node, out))
        self.register_outputs({"passed": self.passed})
