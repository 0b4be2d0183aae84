"""One node's long-lived container and, with Ray on workers, the wait until it joined.

Its main process is the supervisor (components/scripts/supervisor.py), in both executors: with Ray
it keeps `ray start --block` (head or worker) running and, on the head, vLLM; with mp it keeps this
node's vLLM rank running. vLLM's settings reach it from the serve step (components/resources/serve.py), so a
vLLM-only change touches no container, and a vLLM that dies or a node that restarts comes back by
itself: Docker's restart policy brings the container back, the supervisor what runs in it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional

import pulumi
import pulumi_command as command
import pulumi_docker as docker

from components.config import ClusterConfig, NodeConfig
from components.plan.container import LOG_DRIVER, container_name, log_options, node_env, ray_address, supervisor_params
from components.plan.fabric import rdma_in_container
from components.plan.names import (
    COMPILE_CACHE_VOLUMES,
    GPU_TURN_DIR_IN_NODE,
    GPU_TURN_VOLUME,
    GUARD_MARKER_DIR_IN_NODE,
    GUARD_VOLUME,
    HF_CACHE_IN_CONTAINER,
    HF_CACHE_VOLUME,
    POLL_SECONDS,
    PROGRESS_SECONDS,
)
from components.plan.programs import install_supervisor_argv, script, script_program
from components.plan.shell import exec_python, with_log_tail_on_failure
from components.resources.steps import remote_step


@dataclass(frozen=True)
class NodeContainerArgs:
    config: ClusterConfig
    node: NodeConfig
    image_id: pulumi.Input[str]
    model: pulumi.Input[str]
    provider: docker.Provider
    connection: command.remote.ConnectionArgs
    secret_env: pulumi.Input[Sequence[str]]  # ["HF_TOKEN=…", "RAY_AUTH_TOKEN=…"], secret
    start_after: Sequence[pulumi.Resource] = ()  # workers wait for the head's container


def ulimits(cfg: ClusterConfig) -> list[docker.ContainerUlimitArgs]:
    limits = cfg.container.ulimits
    return [
        docker.ContainerUlimitArgs(name=name, soft=value, hard=value)
        for name, value in (("memlock", limits.memlock), ("stack", limits.stack), ("nofile", limits.nofile))
    ]


def model_mounts(model: str) -> list[docker.ContainerMountArgs]:
    """The model directory at the same path on every node, read-only; a repo id needs no mount."""
    if not model.startswith("/"):
        return []
    return [docker.ContainerMountArgs(type="bind", source=model, target=model, read_only=True)]


def compile_cache_mounts(cfg: ClusterConfig) -> list[docker.ContainerMountArgs]:
    """container.compileCache: vLLM's and FlashInfer's caches in volumes of the node, outliving the container."""
    if not cfg.container.compile_cache:
        return []
    return [
        docker.ContainerMountArgs(type="volume", source=volume, target=path) for volume, path in COMPILE_CACHE_VOLUMES
    ]


def hf_cache_mount(cfg: ClusterConfig) -> docker.ContainerMountArgs:
    if cfg.container.hf_cache_dir:
        return docker.ContainerMountArgs(type="bind", source=cfg.container.hf_cache_dir, target=HF_CACHE_IN_CONTAINER)
    return docker.ContainerMountArgs(type="volume", source=HF_CACHE_VOLUME, target=HF_CACHE_IN_CONTAINER)


def _mounts(cfg: ClusterConfig, model: pulumi.Input[str]) -> pulumi.Output[list]:
    """The container's mounts: the model, the Hugging Face cache, the compile caches, the node's GPU turn, the
    guard's marker."""
    turn = docker.ContainerMountArgs(type="volume", source=GPU_TURN_VOLUME, target=GPU_TURN_DIR_IN_NODE)
    guard = (
        [docker.ContainerMountArgs(type="volume", source=GUARD_VOLUME, target=GUARD_MARKER_DIR_IN_NODE, read_only=True)]
        if cfg.network.guard
        else []
    )
    return pulumi.Output.from_input(model).apply(
        lambda path: [*model_mounts(path), hf_cache_mount(cfg), *compile_cache_mounts(cfg), turn, *guard]
    )


def _labels(cfg: ClusterConfig, node: NodeConfig, is_head: bool) -> list:
    labels = [
        docker.ContainerLabelArgs(label="spark-vllm.node", value=node.name),
        docker.ContainerLabelArgs(label="spark-vllm.role", value="head" if is_head else "worker"),
        docker.ContainerLabelArgs(label="spark-vllm.executor", value=cfg.executor),
    ]
    if cfg.called():  # with deployments: which replica (a single-model stack's containers keep their labels)
        labels.append(docker.ContainerLabelArgs(label="spark-vllm.replica", value=cfg.called()))
    return labels


class NodeContainer(pulumi.ComponentResource):
    container: docker.Container
    container_name: str
    joined: Optional[command.remote.Command]

    def __init__(self, name: str, args: NodeContainerArgs, opts: Optional[pulumi.ResourceOptions] = None):
        # Stacks deployed before the supervisor knew this component as RayNode: the same resources.
        opts = pulumi.ResourceOptions.merge(
            opts, pulumi.ResourceOptions(aliases=[pulumi.Alias(type_="spark-vllm:index:RayNode")])
        )
        super().__init__("spark-vllm:index:NodeContainer", name, None, opts)
        cfg, node = args.config, args.node
        self.is_head = node.name == cfg.head_node.name
        self.container_name = container_name(cfg, node)
        self.container = self._create_container(name, args)
        self.supervisor = self._install_supervisor(name, args)
        self.joined = None if self.is_head or cfg.executor != "ray" else self._create_join_wait(name, args)
        self.register_outputs({"container_name": self.container_name, "container_id": self.container.id})

    def _install_supervisor(self, name: str, args: NodeContainerArgs) -> command.remote.Command:
        """The supervisor's source into the container (where supervisor_boot.py waits for it): again for
        a new container, and whenever the source changed (it then runs from the container's next start)."""
        return remote_step(
            f"{name}-supervisor",
            args.connection,
            with_log_tail_on_failure(install_supervisor_argv(self.container_name), args.node, self.container_name),
            stdin=script("supervisor.py"),
            # a new version is a changed stdin: written again, container kept
            triggers=[self.container.id],
            parent=self,
        )

    def _create_container(self, name: str, args: NodeContainerArgs) -> docker.Container:
        cfg, node = args.config, args.node
        rdma = rdma_in_container(cfg, node)
        mounts = _mounts(cfg, args.model)
        env = node_env(cfg, node)
        envs = pulumi.Output.from_input(args.secret_env).apply(lambda secret: [*env, *secret])
        return docker.Container(
            f"{name}-container",
            name=self.container_name,
            image=args.image_id,
            # The supervisor as the main process: Python is in every vLLM image. The container holds only
            # its small bootstrap; the supervisor itself is installed by `<node>-supervisor`, so a new
            # version of it replaces no container.
            entrypoints=["python3", "-u", "-c", script("supervisor_boot.py")],
            command=[json.dumps(supervisor_params(cfg, node), sort_keys=True)],
            envs=envs,
            network_mode="host",  # Ray, NCCL and vLLM must see the fabric interface itself
            # Host IPC: /dev/shm is the host's (Docker ignores a shm size with it), as NCCL needs.
            ipc_mode="host",
            gpus="all" if cfg.container.gpus else None,
            ulimits=ulimits(cfg),
            mounts=mounts,
            restart=cfg.container.restart,
            log_driver=LOG_DRIVER,
            log_opts=log_options(cfg),  # rotated (container.logs): vLLM's log cannot fill the node's disk
            init=True,  # reaps orphaned children and forwards SIGTERM to the supervisor
            privileged=cfg.container.privileged,
            capabilities=docker.ContainerCapabilitiesArgs(adds=["IPC_LOCK"]) if rdma else None,
            devices=[docker.ContainerDeviceArgs(host_path="/dev/infiniband", container_path="/dev/infiniband")]
            if rdma and not cfg.container.privileged
            else None,
            labels=_labels(cfg, node, self.is_head),
            must_run=True,
            destroy_grace_seconds=30,
            # Fixed name and host network: a second container cannot exist beside the old one.
            opts=pulumi.ResourceOptions(
                parent=self,
                provider=args.provider,
                delete_before_replace=True,
                # A changed bind (another model directory) is a new container: the provider would update
                # the mount in its state only (a field inside a block of the set), the node keeping the old one.
                replace_on_changes=["mounts"],
                aliases=[pulumi.Alias(name=f"{name}-ray")],
                additional_secret_outputs=["envs"],
                depends_on=list(args.start_after),
            ),
        )

    def _create_join_wait(self, name: str, args: NodeContainerArgs) -> command.remote.Command:
        cfg, node = args.config, args.node
        params = {
            "node": node.name,
            "ray_address": ray_address(cfg),
            "expected": [{"name": node.name, "fabric_address": str(node.fabric_address)}],
            "gpus_needed": 0,
            "timeout_seconds": cfg.ray.join_timeout_seconds,
            "poll_seconds": POLL_SECONDS,
            "progress_seconds": PROGRESS_SECONDS,
        }
        return remote_step(
            f"{name}-joined",
            args.connection,
            with_log_tail_on_failure(
                exec_python(self.container_name, cfg.ray.join_timeout_seconds + 60), node, self.container_name
            ),
            stdin=script_program("ray_join.py", params),
            # A new container must join again; a read-only wait has nothing to undo, hence no delete.
            triggers=[self.container.id],
            parent=self,
            depends_on=[self.supervisor],
        )
