"""One machine: the Docker provider that reaches it over SSH, and how remote commands reach it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import pulumi
import pulumi_command as command
import pulumi_docker as docker

from components.config import NetworkConfig, NodeConfig
from components.plan.netplan import netplan_apply_argv, node_netplan_yaml
from components.plan.programs import script
from components.plan.shell import docker_host_url, shell_line, with_script
from components.resources.ssh import SshAccess, keyscan_command
from components.resources.steps import remote_step


@dataclass(frozen=True)
class NodeHostArgs:
    node: NodeConfig
    ssh_access: SshAccess
    private_key: Optional[pulumi.Input[str]]  # secret; None: ssh-agent (SSH_AUTH_SOCK)
    network: NetworkConfig
    dial_error_limit: int = 20  # ssh.dialErrorLimit


class NodeHost(pulumi.ComponentResource):
    """A Docker host reached as `ssh://user@host`, the same way `docker -H ssh://…` does.

    Both transports to the node (the Docker provider's local `ssh` and pulumi-command's own SSH
    client) trust exactly one host key: `hostKey`, or — without it — the key the node showed the
    first time this stack reached it (read once by `ssh-keyscan`, kept in the stack's state).
    """

    provider: docker.Provider
    connection: command.remote.ConnectionArgs
    host_key: pulumi.Input[str]  # the pinned key as given, or the scanned one (an Output)
    fabric_network: Optional[command.remote.Command]

    def __init__(self, name: str, args: NodeHostArgs, opts: Optional[pulumi.ResourceOptions] = None):
        super().__init__("spark-vllm:index:NodeHost", name, None, opts)
        node = args.node
        # A pinned key stays a plain value: every remote command carries the connection, and a plain
        # value is cheaper for the SDK to send than an Output (benchmarks/program_scale.py).
        if node.host_key:
            self.host_key: pulumi.Input[str] = node.host_key
            ssh_opts: pulumi.Input[list[str]] = args.ssh_access.docker_ssh_opts(node, node.host_key)
        else:
            scanned = self._scan_host_key(name, node)
            self.host_key = scanned
            ssh_opts = scanned.apply(lambda key: args.ssh_access.docker_ssh_opts(node, key))
        self.provider = docker.Provider(
            f"{name}-docker",
            host=docker_host_url(node),
            ssh_opts=ssh_opts,
            opts=pulumi.ResourceOptions(parent=self),
        )
        self.connection = command.remote.ConnectionArgs(
            host=node.host,
            port=node.ssh_port,
            user=node.user,
            private_key=args.private_key,
            host_key=self.host_key,
            # A reboot or a busy sshd should not fail the whole deployment at once (ssh.dialErrorLimit).
            dial_error_limit=args.dial_error_limit,
        )
        self.fabric_network = self._create_fabric_network(name, args) if args.network.manage else None
        self.docker_host = docker_host_url(node)
        self.register_outputs({"docker_host": self.docker_host, "host_key": self.host_key})

    def _scan_host_key(self, name: str, node: NodeConfig) -> pulumi.Output[str]:
        """Trust on first use: the key is read once, when this resource is created, and then kept;
        a node that later shows another key is refused by both transports."""
        scan = command.local.Command(
            f"{name}-host-key",
            create=keyscan_command(node),
            opts=pulumi.ResourceOptions(parent=self),
        )
        return scan.stdout

    def _create_fabric_network(self, name: str, args: NodeHostArgs) -> command.remote.Command:
        """The fabric address as a netplan drop-in: written (mode 600) and applied only when it
        changed; removed again on destroy. The management link is never touched."""
        node, sudo = args.node, args.node.user != "root"
        content = node_netplan_yaml(node, args.network)
        apply_script = script("netplan_apply.sh")
        return remote_step(
            f"{name}-fabric-network",
            self.connection,
            with_script(shell_line(netplan_apply_argv(content, sudo)), apply_script),
            delete=with_script(shell_line(netplan_apply_argv(None, sudo)), apply_script),
            parent=self,
        )
