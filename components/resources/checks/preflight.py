"""Preflight: components/scripts/preflight_node.sh on each node (Docker, the fabric address bound, peers reachable,
the model's directory, the node's memory); it fails the step itself, naming the node. The first NODE check: the
others run once it passed."""

from __future__ import annotations

from typing import Any

import pulumi

from components.config import ClusterConfig
from components.plan.memory import NodeMemory
from components.plan.preflight import node_memory, preflight_argv
from components.plan.programs import script
from components.plan.shell import shell_line, with_script
from components.resources.checks.protocol import Check, OnNode, Stage


class Preflight(Check):
    name = "preflight"
    stage = Stage.NODE

    def command(self, on: OnNode) -> pulumi.Input[str]:
        return on.model.apply(
            lambda model: with_script(shell_line(preflight_argv(on.cfg, on.node, model)), script("preflight_node.sh"))
        )

    def triggers(self, on: OnNode) -> list[pulumi.Input]:
        # run again when the release (model or image) changes, i.e. whenever the containers would be recreated
        return [on.image_id, on.model, *on.reread]

    def judge(self, cfg: ClusterConfig, outs: dict[str, str], found: dict[str, Any]) -> dict[str, NodeMemory]:
        """Every node's memory (what the memory plan weighs the model against)."""
        return {name: node_memory(cfg.node_named(name), out) for name, out in outs.items()}
