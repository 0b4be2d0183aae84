"""The container image on one node, pulled by reference and used by id."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import pulumi
import pulumi_docker as docker


@dataclass(frozen=True)
class NodeImageArgs:
    reference: pulumi.Input[str]  # tag or name@sha256:… (a promoted release is always a digest)
    keep_locally: bool
    provider: docker.Provider


class NodeImage(pulumi.ComponentResource):
    """Pulls the image on one node. Containers run `image_id`, so a tag moving between pulls on
    different nodes cannot give two nodes different bytes unnoticed (the cluster compares ids)."""

    image_id: pulumi.Output[str]
    repo_digest: pulumi.Output[str]

    def __init__(self, name: str, args: NodeImageArgs, opts: Optional[pulumi.ResourceOptions] = None):
        super().__init__("spark-vllm:index:NodeImage", name, None, opts)
        image = docker.RemoteImage(
            f"{name}-image",
            name=args.reference,
            # keep_locally=False would delete a many-GB image on every replace or destroy.
            keep_locally=args.keep_locally,
            opts=pulumi.ResourceOptions(parent=self, provider=args.provider),
        )
        self.image_id = image.image_id
        self.repo_digest = image.repo_digest
        self.register_outputs({"image_id": self.image_id, "repo_digest": self.repo_digest})
