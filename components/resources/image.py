"""The container image on one node: pulled by reference, or received from the copy source over the
fabric; with progress, and used by id."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import pulumi
import pulumi_command as command
import pulumi_docker as docker

from components.config import ClusterConfig, ImageTransferConfig, NodeConfig
from components.plan.programs import script_program
from components.resources.depot import Depot, Receiver
from components.resources.steps import remote_step
from components.scripts.node_contract import PullParams, params_of


@dataclass(frozen=True)
class CopyFrom:
    """Where a node that does not pull receives the image: the depot, serving the source's image id."""

    config: ClusterConfig
    depot: Depot
    image_id: pulumi.Output[str]


@dataclass(frozen=True)
class NodeImageArgs:
    node: NodeConfig
    reference: pulumi.Input[str]  # tag, name@sha256:…, or with copy an image id
    keep_locally: bool
    transfer: ImageTransferConfig
    provider: docker.Provider
    connection: command.remote.ConnectionArgs
    copy_from: Optional[CopyFrom] = None


def pull_program(node: NodeConfig, reference: str, transfer: ImageTransferConfig) -> str:
    """components/scripts/image_pull.py with its parameters, for `python3 -` on the node's host."""
    params = params_of(
        PullParams,
        node=node.name,
        image=reference,
        timeout_seconds=transfer.timeout_seconds,
        progress_seconds=transfer.progress_seconds,
    )
    return script_program("image_pull.py", params)


class NodeImage(pulumi.ComponentResource):
    """The image on one node. Containers run `image_id`, so a tag moving between pulls on different
    nodes cannot give two nodes different bytes unnoticed (the cluster compares ids).

    The pull itself is a remote command on the node: the Docker provider's pull shows nothing for
    minutes and gives up after 20 (vLLM images are 10–20 GB); this one prints bytes, rate and layers
    every few seconds and gives up after `imageTransfer.timeoutSeconds`. The RemoteImage then finds
    the image on the node and only records its id and digest.

    With `copy_from` the node does not pull: `<node>-image-copy` receives the source's image id over
    the fabric (components/resources/depot.py) and the RemoteImage names that id, so it finds exactly the
    bytes checked on arrival, never a tag.
    """

    image_id: pulumi.Output[str]
    repo_digest: pulumi.Output[str]

    def __init__(self, name: str, args: NodeImageArgs, opts: Optional[pulumi.ResourceOptions] = None):
        super().__init__("spark-vllm:index:NodeImage", name, None, opts)
        timeout = args.transfer.timeout_seconds
        if args.copy_from is not None:
            self._receive(name, args, args.copy_from)
            return
        pull = remote_step(
            f"{name}-pull",
            args.connection,
            f"timeout --kill-after=10 {timeout + 30} python3 -",
            stdin=pulumi.Output.from_input(args.reference).apply(
                lambda reference: pull_program(args.node, reference, args.transfer)
            ),
            # Pulled again only for another reference; read-only otherwise, nothing to undo.
            triggers=[args.reference],
            parent=self,
        )
        image = docker.RemoteImage(
            f"{name}-image",
            name=args.reference,
            # keep_locally=False would delete a many-GB image on every replace or destroy.
            keep_locally=args.keep_locally,
            opts=pulumi.ResourceOptions(
                parent=self,
                provider=args.provider,
                depends_on=[pull],
                custom_timeouts=pulumi.CustomTimeouts(create=f"{timeout}s", update=f"{timeout}s"),
            ),
        )
        self.image_id = image.image_id
        self.repo_digest = image.repo_digest
        self.register_outputs({"image_id": self.image_id, "repo_digest": self.repo_digest})

    def _receive(self, name: str, args: NodeImageArgs, source: CopyFrom) -> None:
        at = Receiver(name, args.node, args.connection, self)
        received = source.depot.receive_image(at, source.image_id, args.reference)
        image = docker.RemoteImage(
            f"{name}-image",
            name=source.image_id,  # the id itself: found on the node, never pulled
            keep_locally=args.keep_locally,
            opts=pulumi.ResourceOptions(parent=self, provider=args.provider, depends_on=[received]),
        )
        self.image_id = image.image_id
        self.repo_digest = image.repo_digest
        self.register_outputs({"image_id": self.image_id, "repo_digest": self.repo_digest})
