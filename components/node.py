"""One machine: the Docker provider that reaches it over SSH, and how remote commands reach it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import pulumi
import pulumi_command as command
import pulumi_docker as docker

from components.config import NodeConfig
from components.render import docker_host_url
from components.ssh import SshFiles


@dataclass(frozen=True)
class NodeHostArgs:
    node: NodeConfig
    ssh_files: SshFiles
    private_key: Optional[pulumi.Input[str]]  # secret; None: ssh-agent (SSH_AUTH_SOCK)


class NodeHost(pulumi.ComponentResource):
    """A Docker host reached as `ssh://user@host`, the same way `docker -H ssh://…` does.

    Both transports to the node (the Docker provider's local `ssh` and pulumi-command's own SSH
    client) pin the same host key when `hostKey` is set.
    """

    provider: docker.Provider
    connection: command.remote.ConnectionArgs

    def __init__(self, name: str, args: NodeHostArgs, opts: Optional[pulumi.ResourceOptions] = None):
        super().__init__("spark-vllm:index:NodeHost", name, None, opts)
        node = args.node
        self.provider = docker.Provider(
            f"{name}-docker",
            host=docker_host_url(node),
            ssh_opts=args.ssh_files.docker_ssh_opts(node),
            opts=pulumi.ResourceOptions(parent=self),
        )
        self.connection = command.remote.ConnectionArgs(
            host=node.host,
            port=node.ssh_port,
            user=node.user,
            private_key=args.private_key,
            host_key=node.host_key,
            # A reboot or a busy sshd should not fail the whole deployment at once.
            dial_error_limit=20,
        )
        self.docker_host = pulumi.Output.from_input(docker_host_url(node))
        self.register_outputs({"docker_host": self.docker_host})
