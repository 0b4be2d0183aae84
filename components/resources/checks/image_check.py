"""What the image holds: components/scripts/image_probe.py in it on each node (vLLM's and Ray's versions, the
dashboard's packages…), against what the config needs."""

from __future__ import annotations

from typing import Any

import pulumi

from components.config import ClusterConfig
from components.plan.preflight import image_check_argv, image_problems, image_warnings
from components.plan.programs import last_json, script
from components.plan.shell import shell_line, with_script
from components.resources.checks.protocol import Check, OnNode, Stage
from components.scripts.node_contract import ImageFacts


class ImageCheckError(Exception):
    """The image on one or more nodes lacks what the config needs; one line a problem, each with its fix."""


def image_fit(cfg: ClusterConfig, stdouts_by_node: dict[str, str]) -> bool:
    """True when every node's image holds what the config needs; ImageCheckError listing every problem."""
    problems = [line for node in cfg.nodes for line in image_problems(cfg, node, stdouts_by_node[node.name])]
    if problems:
        raise ImageCheckError("\n".join(problems))
    for node in cfg.nodes:
        for warning in image_warnings(node, stdouts_by_node[node.name]):
            pulumi.log.warn(warning)
    return True


class ImageCheck(Check):
    name = "image-check"
    stage = Stage.NODE

    def command(self, on: OnNode) -> pulumi.Input[str]:
        return pulumi.Output.from_input(on.image_id).apply(
            lambda image: with_script(shell_line(image_check_argv(image)), script("image_probe.py"))
        )

    def triggers(self, on: OnNode) -> list[pulumi.Input]:
        return [on.image_id]

    def judge(self, cfg: ClusterConfig, outs: dict[str, str], found: dict[str, Any]) -> dict[str, Any]:
        """Every node's image facts (the host check holds them against its host), once every image fits."""
        image_fit(cfg, outs)
        return {name: ImageFacts.from_json(last_json(out)).to_json() for name, out in outs.items()}
