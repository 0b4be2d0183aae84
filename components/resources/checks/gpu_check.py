"""A GPU in a container: a throwaway container of the node's image must see one through the NVIDIA runtime, as
the node's container will (container.gpus); the step fails itself, naming the node and the fix."""

from __future__ import annotations

from typing import Any

import pulumi

from components.config import ClusterConfig, NodeConfig
from components.plan.shell import shell_line
from components.resources.checks.protocol import Check, OnNode, Stage


def gpu_check(node: NodeConfig, image_id: str) -> str:
    probe = ["docker", "run", "--rm", "--gpus", "all", "--entrypoint", "nvidia-smi", image_id, "-L"]
    hint = shell_line(
        [
            "echo",
            f"preflight {node.name}: no GPU visible in a container (--gpus all) — install the NVIDIA "
            "Container Toolkit and restart Docker, or set container.gpus: false on CPU-only hosts",
        ]
    )
    return f"{shell_line(probe)} || {{ {hint} >&2; exit 1; }}"


class GpuCheck(Check):
    name = "gpu-check"
    stage = Stage.NODE

    def wanted(self, cfg: ClusterConfig) -> bool:
        return cfg.container.gpus

    def command(self, on: OnNode) -> pulumi.Input[str]:
        return pulumi.Output.from_input(on.image_id).apply(lambda image: gpu_check(on.node, image))

    def triggers(self, on: OnNode) -> list[pulumi.Input]:
        return [on.image_id]

    def judge(self, cfg: ClusterConfig, outs: dict[str, str], found: dict[str, Any]) -> bool:
        return True  # a node without a GPU in a container failed its step
