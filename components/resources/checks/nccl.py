"""fabric.bandwidthTest nccl: components/scripts/nccl_bandwidth.py in the image on every node at once, on its
GPUs, once every node passed its checks; judged with the fabric gate's figures (components/plan/fabric.py)."""

from __future__ import annotations

from typing import Any

import pulumi

from components.config import ClusterConfig
from components.plan import fabric
from components.plan.programs import last_json, script_program
from components.plan.shell import shell_line, with_script
from components.resources.checks.protocol import Check, OnNode, Stage
from components.scripts.node_contract import NcclFacts


class NcclTest(Check):
    name = "fabric-nccl"
    stage = Stage.ACROSS
    reads: tuple[str, ...] = ("fabric-gate",)
    fabric_figures = True  # the gate's figures with the test's

    def wanted(self, cfg: ClusterConfig) -> bool:
        return fabric.nccl_test(cfg)

    def command(self, on: OnNode) -> pulumi.Input[str]:
        program = script_program("nccl_bandwidth.py", fabric.nccl_params(on.cfg, on.node))
        return pulumi.Output.from_input(on.image_id).apply(
            lambda image: with_script(shell_line(fabric.nccl_argv(on.cfg, on.node, image)), program)
        )

    def triggers(self, on: OnNode) -> list[pulumi.Input]:
        # every node's test must run together: any node's new image runs them all again
        return [*on.image_ids, on.model]

    def judge(self, cfg: ClusterConfig, outs: dict[str, str], found: dict[str, Any]) -> dict[str, Any]:
        """The fabric gate's figures with the test's (bus bandwidth per link); FabricGateError with enforce."""
        facts = {}
        for name, out in outs.items():
            try:
                facts[name] = NcclFacts.from_json(last_json(out))
            except (ValueError, TypeError):  # nothing, not JSON, or not the contract's
                facts[name] = NcclFacts(error=f"the test printed no result: {out.strip()[-300:]!r}")
        gate = found["fabric-gate"]
        problems, figures = fabric.judge_nccl(cfg, facts, gate.get("links") or {})
        fabric.enforce(cfg, problems, pulumi.log.warn)
        return fabric.with_nccl(gate, figures, problems)
