"""The steps of the node checks (components/resources/checks/): the stack's fabric stage, each node's NodeChecks
(its NODE checks, the first one before the others) and a replica's ACROSS stage; and each check's verdict, its judge
over every node's result."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Optional

import pulumi
import pulumi_command as command

from components.config import ClusterConfig
from components.plan.shell import shell_line
from components.resources.checks import CHECKS, NodeCheck, OnNode, Stage
from components.resources.steps import remote_step


def of_stage(stage: Stage, cfg: ClusterConfig) -> list[NodeCheck]:
    return [check for check in CHECKS if check.stage is stage and check.wanted(cfg)]


@dataclass(frozen=True)
class NodeChecksArgs:
    on: OnNode
    connection: command.remote.ConnectionArgs
    after: Sequence[pulumi.Resource] = ()  # the fabric's verdict and networks; the node's model download or copy


class NodeChecks(pulumi.ComponentResource):
    """One node's NODE checks, `<name>-<check>` each: read-only (nothing to undo, no delete)."""

    steps: dict[str, command.remote.Command]

    def __init__(self, name: str, args: NodeChecksArgs, opts: Optional[pulumi.ResourceOptions] = None):
        super().__init__("spark-vllm:index:NodeChecks", name, None, opts)
        self.on = args.on
        self.steps = {}
        first: list[pulumi.Resource] = []
        for check in of_stage(Stage.NODE, args.on.cfg):
            self.steps[check.name] = remote_step(
                f"{name}-{check.name}",
                args.connection,
                check.command(args.on),
                triggers=check.triggers(args.on),
                parent=self,
                depends_on=first or args.after,
            )
            first = first or [self.steps[check.name]]
        self.register_outputs({})

    def stdout(self, check: str) -> Optional[pulumi.Output[str]]:
        step = self.steps.get(check)
        return step.stdout if step is not None else None


def verdict(check: NodeCheck, cfg: ClusterConfig, outs: dict[str, pulumi.Output[str]], found: dict) -> pulumi.Output:
    """The check's judge over every node's stdout (and the findings it reads)."""
    stdout = pulumi.Output.all(**outs)  # node -> its stdout
    read = {name: found[name] for name in check.reads}  # finding -> what it found
    reads = pulumi.Output.all(**read) if read else pulumi.Output.from_input({})
    return pulumi.Output.all(stdout=stdout, reads=reads).apply(
        lambda each: check.judge(cfg, each["stdout"], each["reads"])
    )


def node_stage(cfg: ClusterConfig, checks: dict[str, NodeChecks], found: dict[str, pulumi.Output]) -> dict:
    """`found` with the verdict of each NODE check over every node's NodeChecks (node -> its checks)."""
    found = dict(found)
    for check in of_stage(Stage.NODE, cfg):
        found[check.name] = verdict(check, cfg, {name: each.stdout(check.name) for name, each in checks.items()}, found)
    return found


@dataclass(frozen=True)
class FabricVerdict:
    """The stack's fabric stage: its findings by check, the fabric's figures, and what exists once it passed
    (None with fabric.gate off)."""

    found: dict[str, pulumi.Output] = field(default_factory=dict)
    figures: pulumi.Output = field(
        default_factory=lambda: pulumi.Output.from_input({"checked": False, "reason": "fabric.gate: off"})
    )
    passed: Optional[command.local.Command] = None


def fabric_stage(
    parent: pulumi.Resource, cfg: ClusterConfig, on: dict[str, OnNode], connections: dict, networks: list
) -> FabricVerdict:
    """Every FABRIC check on every node at once as soon as it is reachable (it waits for nothing but the
    fabric networks), judged together by `spark-vllm-fabric-passed`: with fabric.gate enforce its input fails
    listing every problem, so it never exists and nothing after it (the checks, the containers) runs."""
    checks = of_stage(Stage.FABRIC, cfg)
    if not checks:
        return FabricVerdict()
    found: dict[str, pulumi.Output] = {}
    for check in checks:
        steps = {
            name: remote_step(
                f"{name}-{check.name}", connections[name], check.command(each), triggers=check.triggers(each),
                parent=parent, depends_on=networks,
            )
            for name, each in on.items()
        }  # fmt: skip
        found[check.name] = verdict(check, cfg, {name: step.stdout for name, step in steps.items()}, found)
    lines = pulumi.Output.all(*found.values()).apply(
        lambda parts: "; ".join(check.summary(part) for check, part in zip(checks, parts, strict=True))
    )
    passed = command.local.Command(
        "spark-vllm-fabric-passed",
        create=lines.apply(lambda line: shell_line(["echo", line])),
        opts=pulumi.ResourceOptions(parent=parent),
    )
    return FabricVerdict(found, checked_fabric(found, FabricVerdict().figures), passed)


def across_stage(
    parent: pulumi.Resource, cfg: ClusterConfig, checks: dict[str, NodeChecks], connections: dict,
    found: dict[str, pulumi.Output],
) -> dict[str, pulumi.Output]:  # fmt: skip
    """`found` with a replica's ACROSS checks, on every node at once once each node's NODE checks ran."""
    found = dict(found)
    after = [step for each in checks.values() for step in each.steps.values()]
    image_ids = tuple(each.on.image_id for each in checks.values())
    for check in of_stage(Stage.ACROSS, cfg):
        steps = {}
        for name, each in checks.items():
            on = replace(each.on, image_ids=image_ids)
            steps[name] = remote_step(
                cfg.named(f"{name}-{check.name}"), connections[name], check.command(on),
                triggers=check.triggers(on), parent=parent, depends_on=after,
            )  # fmt: skip
        found[check.name] = verdict(check, cfg, {name: step.stdout for name, step in steps.items()}, found)
    return found


def checked_fabric(found: dict[str, Any], fabric: pulumi.Output) -> pulumi.Output:
    """The fabric's figures: the latest finding of a check that gives them (the NCCL test's merged into the
    gate's), else `fabric`."""
    givers = [check.name for check in CHECKS if check.fabric_figures and check.name in found]
    return found[givers[-1]] if givers else fabric
