"""The two kinds of resource the components build over and over, in one place each: a remote step (a
command on a node over SSH) and a service container (a long-lived container of the stack's own beside the
node's vLLM container: the copy depot, network.guard, Prometheus)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import pulumi
import pulumi_command as command
import pulumi_docker as docker

from components.plan.container import LOG_DRIVER
from components.plan.names import GUARD_MARKER_DIR_IN_NODE, GUARD_MARKER_IN_NODE, GUARD_VOLUME
from components.plan.programs import script

# What a step that may print a secret (the API key in vLLM's log tail, a token on stdin) keeps out of
# plain state: pulumi-command marks none of its outputs secret by itself.
SECRET_IO = ["stdin", "stdout", "stderr"]


def remote_step(
    name: str,
    connection: command.remote.ConnectionArgs,
    create: pulumi.Input[str],
    *,
    parent: pulumi.Resource,
    stdin: Optional[pulumi.Input[str]] = None,
    delete: Optional[pulumi.Input[str]] = None,
    triggers: Optional[Sequence[pulumi.Input]] = None,
    depends_on: Sequence[pulumi.Resource] = (),
    secret_outputs: Sequence[str] = (),
    delete_before_replace: Optional[bool] = None,
) -> command.remote.Command:
    """A command on a node over SSH. Its previous output never reaches its environment (the remote sshd
    would have to accept it), read-only steps have no `delete`, `triggers` run it again (each one as
    `plain_trigger` makes it), and `secret_outputs` (SECRET_IO where a log tail or stdin may hold a secret)
    stay out of plain state."""
    return command.remote.Command(
        name,
        connection=connection,
        create=create,
        stdin=stdin,
        delete=delete,
        triggers=[plain_trigger(each) for each in triggers] if triggers is not None else None,
        add_previous_output_in_env=False,
        opts=pulumi.ResourceOptions(
            parent=parent,
            depends_on=list(depends_on),
            delete_before_replace=delete_before_replace,
            additional_secret_outputs=list(secret_outputs) or None,
        ),
    )


def plain_trigger(value: pulumi.Input) -> pulumi.Output:
    """A trigger pulumi-command can read in every preview. A secret one (what another step printed, kept
    secret by SECRET_IO) is an unknown secret in a new stack's first preview, which pulumi-command 1.2.1
    refuses before anything runs ("triggers[2]: malformed secret: missing value"); so a secret value becomes
    the sha256 of its JSON, which changes when the value does (one-way: today's only secret trigger is a serve
    step's handover output, nothing a guess could find from its digest). Others pass unchanged."""
    value = pulumi.Output.from_input(value)
    secret = pulumi.Output.from_input(value.is_secret())
    return pulumi.Output.all(plain=pulumi.Output.unsecret(value), secret=secret).apply(
        lambda found: _digest(found["plain"]) if found["secret"] else found["plain"]
    )


def _digest(value: Any) -> str:
    return "sha256:" + hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


def service_container(
    resource_name: str,
    *,
    name: str,
    image: pulumi.Input[str],
    entrypoints: pulumi.Input[Sequence[str]],
    role: str,
    provider: docker.Provider,
    parent: pulumi.Resource,
    restart: str,
    logs: Mapping[str, str],
    mounts: pulumi.Input[Sequence[docker.ContainerMountArgs]],
    node: Optional[str] = None,
    envs: Optional[pulumi.Input[Sequence[str]]] = None,
    secret_envs: bool = False,
    init: Optional[bool] = None,
    capabilities: Optional[docker.ContainerCapabilitiesArgs] = None,
    user: Optional[int] = None,
    stop_grace_seconds: int = 10,
    depends_on: Sequence[pulumi.Resource] = (),
    guarded: bool = False,
) -> docker.Container:
    """A container of the stack's own on a node's host network, with a fixed name (so the old one goes
    before the new one starts), labelled with its node and role, its log rotated (`logs`: log_options), that must
    keep running; `user`: the uid (and gid) it runs as, where the image's own would not do. `guarded`: it listens on
    a port network.guard fences, so its program starts only once the guard's rules hold in this boot."""
    if guarded:
        entrypoints, mounts = guard_gated(entrypoints, mounts)
    labels = [docker.ContainerLabelArgs(label="spark-vllm.node", value=node)] if node else []
    labels.append(docker.ContainerLabelArgs(label="spark-vllm.role", value=role))
    return docker.Container(
        resource_name,
        name=name,
        image=image,
        entrypoints=entrypoints,
        envs=envs,
        network_mode="host",
        capabilities=capabilities,
        mounts=mounts,
        restart=restart,
        log_driver=LOG_DRIVER,
        log_opts=dict(logs),  # rotated (container.logs): no log fills a node's disk
        user=None if user is None else f"{user}:{user}",
        init=init,
        labels=labels,
        must_run=True,
        destroy_grace_seconds=stop_grace_seconds,
        opts=pulumi.ResourceOptions(
            parent=parent,
            provider=provider,
            delete_before_replace=True,
            depends_on=list(depends_on),
            additional_secret_outputs=["envs"] if secret_envs else None,
        ),
    )


def guard_gated(
    entrypoints: pulumi.Input[Sequence[str]], mounts: pulumi.Input[Sequence[docker.ContainerMountArgs]]
) -> tuple[pulumi.Output, pulumi.Output]:
    """The container's program behind guard_gate.sh, and the guard's marker volume mounted (read-only) for it."""
    marker = docker.ContainerMountArgs(
        type="volume", source=GUARD_VOLUME, target=GUARD_MARKER_DIR_IN_NODE, read_only=True
    )
    gate = ["bash", "-c", script("guard_gate.sh"), "guard_gate", GUARD_MARKER_IN_NODE]
    return (
        pulumi.Output.from_input(entrypoints).apply(lambda program: [*gate, *program]),
        pulumi.Output.from_input(mounts).apply(lambda given: [*given, marker]),
    )


@dataclass(frozen=True)
class DataKind:
    """One of the stack's data services (Prometheus, Grafana): its resources `<node>-<role>`, its container's
    name on the node, and the named volume that holds its data (mounted at `data`), outliving the container."""

    role: str
    container: str
    volume: str
    data: str


def data_service(
    node: str,
    kind: DataKind,
    *,
    image: str,
    provider: docker.Provider,
    parent: pulumi.Resource,
    pull_after: Optional[Sequence[pulumi.Resource]] = None,
    **service: Any,
) -> docker.Container:
    """A data service of the stack's from an image it pulls (`<node>-<role>-image`, kept on the node, once
    `pull_after` is there: by default what the container waits for), its data on its volume, its environment a
    secret; `service`: the rest of service_container's arguments."""
    after = service.get("depends_on", ()) if pull_after is None else pull_after
    opts = pulumi.ResourceOptions(parent=parent, provider=provider, depends_on=list(after))
    pulled = docker.RemoteImage(f"{node}-{kind.role}-image", name=image, keep_locally=True, opts=opts)
    mounts = [docker.ContainerMountArgs(type="volume", source=kind.volume, target=kind.data)]
    return service_container(
        f"{node}-{kind.role}", name=kind.container, image=pulled.image_id, mounts=mounts, secret_envs=True, node=node,
        role=kind.role, provider=provider, parent=parent, **service,
    )  # fmt: skip
