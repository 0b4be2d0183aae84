"""Copies over the fabric: the depot on the copy source, and what the receiving nodes run.

The depot is a long-lived container on the copy source (`fabricCopy.source`, default the head):
components/scripts/node_fabric_copy.py in its "serve" role, bound to that node's fabric address. It
serves the image id the source holds (`imageTransfer.method: copy`) and the model directory
(`modelSync.enabled`) to clients proving the stack's copy token, and writes nothing. Being a
container with a restart policy, it is there for a node added later and for a copy retried after a
failure, and it comes back after a reboot, with no step of the deployment having to start it.

Each receiving node runs the same script over SSH, as a remote command: "image" (stream the image
into `docker load` when the node lacks that id, check the id) and "model" (make the model directory
equal to the source's). Both are safe to repeat: a node that has everything copies nothing.
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import pulumi
import pulumi_command as command
import pulumi_docker as docker

from components.config import ClusterConfig, NodeConfig
from components.plan.container import log_options
from components.plan.programs import script_program
from components.plan.shell import shell_line
from components.resources.steps import remote_step, service_container
from components.scripts.node_contract import (
    DepotParams,
    HfDownloadParams,
    ImageCopyParams,
    ModelCopyParams,
    params_of,
)

DEPOT_CONTAINER = "spark-vllm.depot"  # a dot: no node's container (spark-vllm-<DNS label>) can have it
DOCKER_SOCKET = "/var/run/docker.sock"
TOKEN_ENV = "SPARK_VLLM_COPY_TOKEN"


def sync_root(model_dir: str) -> str:
    """What the copy reads and writes: the model directory, or for a Hugging Face snapshot
    (…/models--org--name/snapshots/REV) its repository, whose blobs/ the snapshot links into.
    (The same rule as sync_root in components/scripts/node_fabric_copy.py.)"""
    model_dir = model_dir.rstrip("/") or "/"
    parent = posixpath.dirname(model_dir)
    repository = posixpath.dirname(parent)
    if posixpath.basename(parent) == "snapshots" and posixpath.basename(repository).startswith("models--"):
        return repository
    return model_dir


def depot_params(cfg: ClusterConfig, image_id: Optional[str], model: Optional[str]) -> dict:
    return params_of(DepotParams, **_peer(cfg, cfg.copy_source, "serve"), image_id=image_id, model_dir=model)


def receive_image_program(cfg: ClusterConfig, node: NodeConfig, image_id: str, reference: str, token: str) -> str:
    """node_fabric_copy.py as an image receiver on `node`, for `python3 -` (secret: it holds the token)."""
    params = params_of(ImageCopyParams, **_peer(cfg, node, "image"), token=token.strip(), image_id=image_id,
                       reference=reference, progress_seconds=cfg.image_transfer.progress_seconds)  # fmt: skip
    return script_program("node_fabric_copy.py", params)


def sync_model_program(cfg: ClusterConfig, node: NodeConfig, model: str, token: str) -> str:
    """node_fabric_copy.py as a model receiver on `node`, for `python3 -` (secret: it holds the token)."""
    params = params_of(ModelCopyParams, **_peer(cfg, node, "model"), token=token.strip(), model_dir=model,
                       progress_seconds=cfg.model_sync.progress_seconds)  # fmt: skip
    return script_program("node_fabric_copy.py", params)


def _peer(cfg: ClusterConfig, node: NodeConfig, role: str) -> dict:
    """CopyParams' fields: `node` in `role`, the depot on the copy source."""
    source = cfg.copy_source
    return {"role": role, "node": node.name, "source": source.name, "address": str(source.fabric_address),
            "port": cfg.fabric_copy.port}  # fmt: skip


def timeout_wrapper(seconds: int) -> str:
    # pulumi-command has no timeout of its own; SIGTERM, then SIGKILL 10 s later.
    return f"timeout --kill-after=10 {seconds} python3 -"


@dataclass(frozen=True)
class DepotArgs:
    config: ClusterConfig
    image_id: pulumi.Input[str]  # the image on the source: the depot runs it, and serves it with method copy
    model: pulumi.Input[str]
    provider: docker.Provider  # the source's Docker
    start_after: tuple = ()  # the source's fabric network, when managed


@dataclass(frozen=True)
class Receiver:
    """A node that receives from the depot: the name its steps take (`<name>-image-copy`, `<name>-model-sync`),
    its config, its SSH connection and the resource its steps belong to."""

    name: str
    node: NodeConfig
    connection: command.remote.ConnectionArgs
    parent: pulumi.Resource


class Depot(pulumi.ComponentResource):
    """The copy token (one per stack, a secret) and the depot container on the copy source; the receiving
    nodes' steps (`receive_image`, `sync_model`)."""

    token: pulumi.Output[str]
    container: docker.Container

    def __init__(self, name: str, args: DepotArgs, opts: Optional[pulumi.ResourceOptions] = None):
        super().__init__("spark-vllm:index:Depot", name, None, opts)
        cfg = self._cfg = args.config
        copies_image = cfg.image_transfer.method == "copy"
        token = command.local.Command(
            "fabric-copy-token",
            create="python3 -c 'import secrets; print(secrets.token_hex(32))'",
            logging=command.local.Logging.NONE,
            opts=pulumi.ResourceOptions(parent=self, additional_secret_outputs=["stdout", "stderr"]),
        )
        self.token = pulumi.Output.secret(token.stdout.apply(lambda value: value.strip()))
        model = pulumi.Output.from_input(args.model)
        params = pulumi.Output.all(image_id=args.image_id, model=model).apply(
            lambda found: depot_params(
                cfg, found["image_id"] if copies_image else None, found["model"] if cfg.model_sync.enabled else None
            )
        )
        mounts = model.apply(lambda m: self._mounts(cfg, m))
        self.container = service_container(
            "spark-vllm-depot",
            name=DEPOT_CONTAINER,
            image=args.image_id,  # the source has it: nothing else to fetch
            entrypoints=params.apply(lambda p: ["python3", "-u", "-c", script_program("node_fabric_copy.py", p)]),
            envs=pulumi.Output.secret(self.token.apply(lambda value: [f"{TOKEN_ENV}={value}"])),
            secret_envs=True,
            mounts=mounts,  # it listens on the fabric address: host network
            restart="unless-stopped",
            logs=log_options(cfg),
            init=True,
            role="copy-depot",
            guarded=cfg.network.guard,  # fabricCopy.port: nothing answers there before the guard's rules
            stop_grace_seconds=5,
            provider=args.provider,
            parent=self,
            depends_on=args.start_after,
        )
        self.register_outputs({"container_id": self.container.id})

    def receive_image(
        self, at: Receiver, image_id: pulumi.Input[str], reference: pulumi.Input[str]
    ) -> command.remote.Command:
        """`<node>-image-copy`: the source's image id on this node, received over the fabric if missing."""
        stdin = pulumi.Output.all(image_id=image_id, reference=reference, token=self.token).apply(
            lambda found: receive_image_program(self._cfg, at.node, **found)
        )
        # Copied again only for another image id; reading and loading are safe to repeat.
        return self._step(at, "image-copy", self._cfg.image_transfer.timeout_seconds, stdin, [image_id])

    def sync_model(
        self, at: Receiver, model: pulumi.Input[str], source_fingerprint: pulumi.Input[str]
    ) -> command.remote.Command:
        """`<node>-model-sync`: this node's model directory made equal to the source's."""
        stdin = pulumi.Output.all(model=model, token=self.token).apply(
            lambda found: sync_model_program(self._cfg, at.node, **found)
        )
        # Again when the model or what the source holds changes (its fingerprint).
        return self._step(at, "model-sync", self._cfg.model_sync.timeout_seconds, stdin, [model, source_fingerprint])

    def _step(
        self, at: Receiver, what: str, timeout_seconds: int, stdin: pulumi.Output[str], triggers: list
    ) -> command.remote.Command:
        return remote_step(
            f"{at.name}-{what}",
            at.connection,
            timeout_wrapper(timeout_seconds + 30),
            stdin=pulumi.Output.secret(stdin),
            triggers=triggers,
            parent=at.parent,
            depends_on=[self.container],
        )

    @staticmethod
    def _mounts(cfg: ClusterConfig, model: str) -> list[docker.ContainerMountArgs]:
        mounts = []
        if cfg.image_transfer.method == "copy":  # `docker save` through the node's own daemon
            mounts.append(docker.ContainerMountArgs(type="bind", source=DOCKER_SOCKET, target=DOCKER_SOCKET))
        if cfg.model_sync.enabled and model.startswith("/"):
            root = sync_root(model)
            mounts.append(docker.ContainerMountArgs(type="bind", source=root, target=root, read_only=True))
        return mounts


DOWNLOAD_HF_HOME = "/spark-vllm-hf"  # container.hfCacheDir in the download's container


def download_command(cfg: ClusterConfig, node: NodeConfig, image_id: str, model: str) -> str:
    """On the copy source: the repo id downloaded into container.hfCacheDir by a throwaway container
    of the node's image, as the SSH user (so the files are theirs, like what modelSync writes); a model
    that is a directory (a promoted release) has nothing to download and reports itself."""
    if model.startswith("/"):
        return shell_line(["echo", json.dumps({"snapshot": model})])
    cache = cfg.container.hf_cache_dir
    run = ["docker", "run", "--rm", "-i", "--network", "host"]
    mount = ["--mount", f"type=bind,source={cache},target={DOWNLOAD_HF_HOME}", "--entrypoint", "python3", image_id, "-"]
    timeout = ["timeout", "--kill-after=10", str(cfg.model_sync.timeout_seconds + 30)]
    # $(id -u):$(id -g) is for the node's shell to expand: the only unquoted words in the line.
    return (
        f"{shell_line(['mkdir', '-p', cache])} && "
        f'{shell_line([*timeout, *run])} --user "$(id -u):$(id -g)" {shell_line(mount)}'
    )


def download_program(cfg: ClusterConfig, node: NodeConfig, model: str, token: Optional[str]) -> str:
    """hf_download.py for `python3 -` (secret when it carries the token); nothing for a directory."""
    if model.startswith("/"):
        return ""
    params = params_of(
        HfDownloadParams,
        node=node.name,
        repo=model,
        hf_home=DOWNLOAD_HF_HOME,
        host_cache=cfg.container.hf_cache_dir.rstrip("/"),
        endpoint=cfg.container.hf_endpoint,
        token=token,
        progress_seconds=cfg.model_sync.progress_seconds,
    )
    return script_program("hf_download.py", params)


def snapshot_of(stdout: str) -> str:
    """The host path of the downloaded snapshot, from the download's last line."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    return json.loads(lines[-1])["snapshot"]


def download_model(
    name: str,
    cfg: ClusterConfig,
    node: NodeConfig,
    image_id: pulumi.Input[str],
    model: pulumi.Input[str],
    token: Optional[pulumi.Input[str]],
    connection: command.remote.ConnectionArgs,
    after: Sequence[pulumi.Resource],
    parent: pulumi.Resource,
) -> command.remote.Command:
    """`<source>-model-download`: a Hugging Face repo id fetched once, on the copy source."""
    create = pulumi.Output.all(image_id=image_id, model=model).apply(lambda found: download_command(cfg, node, **found))
    stdin = pulumi.Output.all(model=model, token=token).apply(lambda found: download_program(cfg, node, **found))
    return remote_step(
        f"{name}-model-download",
        connection,
        create,
        stdin=pulumi.Output.secret(stdin),
        # Again only for another model: a repo already in the cache downloads nothing anyway.
        triggers=[model],
        parent=parent,
        depends_on=after,
    )
