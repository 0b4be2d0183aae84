"""How the image and the model reach every node: each node's image (pulled, or copied from the copy
source's depot over the fabric), network.guard's rules before anything of the stack listens, and with
modelSync the depot serving the model (a repo id downloaded once on the source first)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import pulumi
import pulumi_command as command

from components.config import ClusterConfig, NodeConfig
from components.resources.depot import Depot, DepotArgs, download_model
from components.resources.guard import NodeGuard, NodeGuardArgs
from components.resources.image import CopyFrom, NodeImage, NodeImageArgs
from components.resources.node import NodeHost
from components.resources.release import ReleaseSource


class ModelSyncError(Exception):
    pass


def model_directory(cfg: ClusterConfig, model: str) -> str:
    """The model as modelSync copies it: a directory, or a repo id's repository in container.hfCacheDir
    (a promoted release may name a repo id where this stack has no such directory)."""
    try:
        return cfg.synced_model_dir(model)
    except ValueError:
        raise ModelSyncError(
            f"modelSync.enabled copies the model, but it is {model!r}, a Hugging Face repo id, and "
            "container.hfCacheDir is not set: set it to a host directory (the copy source downloads the model "
            "there once and the other nodes receive it there)"
        ) from None


@dataclass(frozen=True)
class Transfer:
    """What the transfer left for the checks and the containers."""

    images: dict[str, NodeImage]  # every node's, in config order
    guards: dict[str, NodeGuard]  # with network.guard: every node's
    depot: Optional[Depot]  # the copy source's, when something is copied
    download: Optional[command.remote.Command]  # a repo id fetched once on the copy source
    synced_model: pulumi.Input[str]  # what the depot serves and every other node's sync writes


@dataclass
class _Making:
    """What create_transfer makes, one kind of resource a method, from what it is given once."""

    parent: pulumi.Resource
    cfg: ClusterConfig
    release: ReleaseSource
    hosts: dict[str, NodeHost]
    hf_token: Optional[pulumi.Output[str]]
    guards: dict[str, NodeGuard] = field(default_factory=dict)

    @property
    def opts(self) -> pulumi.ResourceOptions:
        return pulumi.ResourceOptions(parent=self.parent)

    def node_image(self, node: NodeConfig, copy_from: Optional[CopyFrom] = None) -> NodeImage:
        cfg, host = self.cfg, self.hosts[node.name]
        return NodeImage(
            node.name,
            NodeImageArgs(
                node=node,
                reference=self.release.image,
                keep_locally=cfg.container.keep_image,
                transfer=cfg.image_transfer,
                provider=host.provider,
                connection=host.connection,
                copy_from=copy_from,
            ),
            opts=self.opts,
        )

    def guard(self, node: NodeConfig, image: NodeImage) -> None:
        """network.guard on `node`: its rules in place before anything of the stack listens there."""
        if self.cfg.network.guard:
            host = self.hosts[node.name]
            args = NodeGuardArgs(
                config=self.cfg, node=node, image_id=image.image_id, provider=host.provider, connection=host.connection
            )
            self.guards[node.name] = NodeGuard(node.name, args, opts=self.opts)

    def source_depot(self, image: NodeImage) -> tuple[Depot, Optional[command.remote.Command], pulumi.Output]:
        """The copy source's depot (what the other nodes copy from over the fabric), after its guard: a repo id
        downloaded there first; with modelSync the model directory it serves."""
        cfg, source = self.cfg, self.cfg.copy_source
        guarded = [self.guards[source.name].ready] if source.name in self.guards else []
        networks = [h.fabric_network for h in self.hosts.values() if h.fabric_network is not None]
        download, synced = None, self.release.model
        if cfg.downloads_once:
            # A repo id: fetched once here, then served like a directory (the depot mounts it).
            download = download_model(
                source.name, cfg, source, image.image_id, self.release.model, self.hf_token,
                self.hosts[source.name].connection, after=guarded, parent=self.parent,
            )  # fmt: skip
        if cfg.model_sync.enabled:
            synced = self.release.model.apply(lambda model: model_directory(cfg, model))
        depot = Depot(
            "spark-vllm-copy",
            DepotArgs(
                config=cfg,
                image_id=image.image_id,
                model=synced,
                provider=self.hosts[source.name].provider,
                start_after=(*networks, *guarded, *([download] if download else [])),
            ),
            opts=self.opts,
        )
        return depot, download, synced


def create_transfer(
    parent: pulumi.Resource,
    cfg: ClusterConfig,
    release: ReleaseSource,
    hosts: dict[str, NodeHost],
    hf_token: Optional[pulumi.Output[str]],
) -> Transfer:
    """Every node's image. The copy source's is pulled (or found); with imageTransfer.method copy the
    others receive that image id from the source's depot over the fabric."""
    making = _Making(parent, cfg, release, hosts, hf_token)
    source = cfg.copy_source
    images = {source.name: making.node_image(source)}
    making.guard(source, images[source.name])
    depot, download, synced = None, None, release.model
    if cfg.uses_depot:
        depot, download, synced = making.source_depot(images[source.name])
    copy_from = None
    if depot is not None and cfg.image_transfer.method == "copy":
        copy_from = CopyFrom(config=cfg, depot=depot, image_id=images[source.name].image_id)
    for node in cfg.nodes:
        if node.name != source.name:
            images[node.name] = making.node_image(node, copy_from)
            making.guard(node, images[node.name])
    return Transfer(
        images={node.name: images[node.name] for node in cfg.nodes},
        guards=making.guards,
        depot=depot,
        download=download,
        synced_model=synced,
    )
