"""What a node check is: a step that runs on each node (a remote command whose stdout is its result) and
a judge that reads every node's result together. components/resources/checks/__init__.py lists them; the gate
(components/resources/gate.py) runs the list and collects the verdicts."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any, Optional, Protocol

import pulumi

from components.config import ClusterConfig, NodeConfig


class Stage(Enum):
    """When a check's steps run."""

    FABRIC = "fabric"  # on every node of the stack at once, before anything else runs there: the stack's own
    NODE = "node"  # on each node of a replica (in its NodeChecks), once the fabric passed; after the first one
    ACROSS = "across"  # on every node of a replica at once, once each passed its NODE checks


@dataclass(frozen=True)
class OnNode:
    """What a check's step on one node reads."""

    cfg: ClusterConfig
    node: NodeConfig
    image: pulumi.Input[str]  # the image as the release names it (known before any pull)
    image_id: Optional[pulumi.Input[str]]  # this node's pulled image (None for the fabric stage: before pulls)
    model: pulumi.Output[str]  # what the checks read: the model, or a downloaded repo id's snapshot directory
    reread: tuple = ()  # values whose change means the node's model must be checked again (a new copy)
    image_ids: tuple = ()  # every node's image id (an ACROSS check runs again on any node's new image)


class NodeCheck(Protocol):
    """One check: `<node>-<name>` on every node it runs on, judged once for all of them."""

    name: str
    stage: Stage
    reads: tuple[str, ...]  # the names of earlier checks whose findings its judge reads
    fabric_figures: bool  # its finding is the fabric's figures (the `fabric` output), the latest such one wins

    def wanted(self, cfg: ClusterConfig) -> bool:
        """Whether this stack (a replica's view for NODE and ACROSS) runs it."""

    def command(self, on: OnNode) -> pulumi.Input[str]:
        """The step's command on `on.node`."""

    def triggers(self, on: OnNode) -> list[pulumi.Input]:
        """What runs the step again (a read-only step has no delete)."""

    def judge(self, cfg: ClusterConfig, outs: dict[str, str], found: dict[str, Any]) -> Any:
        """Every node's stdout (node -> stdout) -> the check's finding; raises, naming the nodes, when it
        fails the deploy. `found`: the findings of the checks it `reads`."""

    def summary(self, finding: Any) -> str:
        """Its part of the line the fabric stage's verdict records (FABRIC checks)."""


class Check:
    """What most checks share: they read no other check's finding and run on every stack."""

    reads: tuple[str, ...] = ()
    fabric_figures = False

    def wanted(self, cfg: ClusterConfig) -> bool:
        return True

    def summary(self, finding: Any) -> str:
        return f"{self.name} passed"
