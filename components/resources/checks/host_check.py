"""The host: components/scripts/host_facts.py on each node's host (kernel, OS, driver and its CUDA, the GPUs and
their compute capability, Docker's NVIDIA support, rdma-core, the fabric NIC's firmware), judged with the image's
facts (the image check's) by components/plan/host.py before any container."""

from __future__ import annotations

from typing import Any

import pulumi

from components.config import ClusterConfig
from components.plan.host import host_verdict
from components.plan.programs import last_json, script
from components.plan.shell import shell_line, with_script
from components.resources.checks.protocol import Check, OnNode, Stage
from components.scripts.node_contract import HostFacts, ImageFacts


class HostCheckError(Exception):
    """A node's host cannot run the image; one line a problem, each naming the node and the fix."""


def host_facts(name: str, stdout: str) -> HostFacts:
    try:
        return HostFacts.from_json(last_json(stdout))
    except (ValueError, TypeError) as error:
        raise HostCheckError(
            f"host check {name}: the host's python3 said nothing readable ({stdout.strip()[:200]!r})"
        ) from error


class HostCheck(Check):
    name = "host-check"
    stage = Stage.NODE
    reads = ("image-check",)

    def command(self, on: OnNode) -> pulumi.Input[str]:
        argv = ["env", f"FABRIC_IF={on.node.fabric_interface}", "python3", "-"]
        return with_script(shell_line(argv), script("host_facts.py"))

    def triggers(self, on: OnNode) -> list[pulumi.Input]:
        # as the preflight's: whenever the containers would be made again (a new image or model)
        return [on.image_id, on.model, *on.reread]

    def judge(self, cfg: ClusterConfig, outs: dict[str, str], found: dict[str, Any]) -> dict[str, Any]:
        """Every node's host facts (as the outputs show them); HostCheckError listing every problem."""
        hosts = {name: host_facts(name, out) for name, out in outs.items()}
        images = found["image-check"]
        verdict = host_verdict(cfg, hosts, {name: ImageFacts.from_json(facts) for name, facts in images.items()})
        if verdict.problems:
            raise HostCheckError("\n".join(verdict.problems))
        for warning in verdict.warnings:
            pulumi.log.warn(warning)
        return {name: facts.to_json() for name, facts in hosts.items()}
