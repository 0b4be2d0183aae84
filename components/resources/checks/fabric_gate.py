"""The fabric gate: components/scripts/node_fabric_gate.py on every node of the stack at once (the bandwidth test
needs the peers' probes listening), before anything else runs there; judged by components/plan/fabric.py."""

from __future__ import annotations

from typing import Any

import pulumi

from components.config import ClusterConfig
from components.plan import fabric
from components.plan.programs import last_json, script_program
from components.plan.shell import shell_line, with_script
from components.resources.checks.protocol import Check, OnNode, Stage
from components.scripts.node_contract import FabricFacts


class FabricGate(Check):
    name = "fabric-gate"
    stage = Stage.FABRIC
    fabric_figures = True

    def wanted(self, cfg: ClusterConfig) -> bool:
        return cfg.fabric.gate != "off"

    def command(self, on: OnNode) -> pulumi.Input[str]:
        return with_script(
            shell_line(["python3", "-"]), script_program("node_fabric_gate.py", fabric.gate_params(on.cfg, on.node))
        )

    def triggers(self, on: OnNode) -> list[pulumi.Input]:
        # a new release runs on a freshly checked fabric; the image as named is known before any pull
        return [on.image, on.model]

    def judge(self, cfg: ClusterConfig, outs: dict[str, str], found: dict[str, Any]) -> dict[str, Any]:
        """The figures (links, MTU, RDMA, bandwidth) and every problem; with fabric.gate enforce a
        FabricGateError listing them, so nothing after the gate runs."""
        facts = {}
        for name, out in outs.items():
            try:
                facts[name] = FabricFacts.from_json(last_json(out))
            except (ValueError, TypeError) as error:  # no JSON line, or one the contract does not know
                facts[name] = FabricFacts(error=f"{error}: {out.strip()[:200]!r}")
        problems, figures = fabric.judge(cfg, facts)
        fabric.enforce(cfg, problems, pulumi.log.warn)
        return {**figures, "problems": problems}

    def summary(self, finding: dict[str, Any]) -> str:
        return f"fabric: {fabric.describe(finding)}"
