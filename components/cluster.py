"""The whole deployment, in the order DESIGN.md draws it: every node's host, the image and model on every
node, the gate (every node checked, all agreeing, the memory plan), the containers, vLLM on them, and
what the stack outputs. Each step is a function that returns what the next one takes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import pulumi
import pulumi_command as command

from components.config import ClusterConfig
from components.dashboard import dashboard
from components.diagnostics import diagnose_command, diagnostics_output
from components.gate import Gate, create_gate
from components.metrics import Prometheus, prometheus_config, prometheus_url, targets
from components.node import NodeHost, NodeHostArgs
from components.node_container import NodeContainer, NodeContainerArgs
from components.release import ReleaseSource, release_record
from components.render import ray_address
from components.serve import VllmServer, VllmServerArgs, log_follow_command, status_command
from components.ssh import SshAccess
from components.transfer import Transfer, create_transfer


def data_only(value: pulumi.Output) -> pulumi.Output:
    """`value` without the resources it came from as dependencies. The memory plan reads every node's
    checks; vLLM's arguments take one number from it, and whatever takes those arguments (the serve
    steps, their triggers on every node) would otherwise list every node's checks again: N² edges for
    the SDK's cycle check, for an order the head container's gate already enforces."""
    return pulumi.Output(set(), value.future(with_unknowns=True), value.is_known(), value.is_secret())


@dataclass(frozen=True)
class VllmClusterArgs:
    config: ClusterConfig
    release: ReleaseSource
    ssh_access: SshAccess


class VllmCluster(pulumi.ComponentResource):
    def __init__(self, name: str, args: VllmClusterArgs, opts: Optional[pulumi.ResourceOptions] = None):
        super().__init__("spark-vllm:index:VllmCluster", name, None, opts)
        cfg, release = args.config, args.release
        secrets = _secrets(cfg)
        self.hosts = create_hosts(self, cfg, args.ssh_access, secrets)
        transfer = create_transfer(self, cfg, release, self.hosts, secrets.get("hfToken"))
        gate = create_gate(self, cfg, release, self.hosts, transfer)
        self.nodes = create_containers(self, cfg, release, self.hosts, transfer, gate, _secret_env(self, cfg, secrets))
        self.server = create_server(self, name, cfg, release, self.hosts, self.nodes, gate, secrets.get("apiKey"))
        self._outputs(cfg, release, transfer, gate, secrets.get("apiKey"))
        self.diagnostics = diagnostics_output(
            cfg,
            pulumi.get_stack(),
            self.containers,
            {name: host.host_key for name, host in self.hosts.items()},
            args.ssh_access.identity,
        )
        self.diagnose_command = diagnose_command(pulumi.get_stack())
        self.dashboard = dashboard(cfg, pulumi.get_stack())

    def _outputs(
        self,
        cfg: ClusterConfig,
        release: ReleaseSource,
        transfer: Transfer,
        gate: Gate,
        api_key: Optional[pulumi.Output[str]],
    ) -> None:
        head = cfg.head_node
        self.containers = {name: node.container_name for name, node in self.nodes.items()}
        self.endpoint = pulumi.Output.from_input(f"http://{head.host}:{cfg.vllm.port}/v1")
        self.served_model_name = self.server.served_model_name
        self.head_node = head.name
        self.executor = cfg.executor
        self.ray_address = ray_address(cfg) if cfg.executor == "ray" else None
        self.log_commands = {
            "vllm": log_follow_command(cfg, head.name, self.containers[head.name], vllm=True),
            **{name: log_follow_command(cfg, name, c, vllm=False) for name, c in self.containers.items()},
        }
        if cfg.executor == "mp":  # every node runs a vLLM rank with a log of its own
            self.log_commands |= {
                f"vllm:{name}": log_follow_command(cfg, name, c, vllm=True)
                for name, c in self.containers.items()
                if name != head.name
            }
        self.status_command = status_command(cfg, self.containers)
        self.smoke = self.server.smoke_result
        self.benchmark = self.server.benchmark_result
        self.fabric = gate.fabric
        self.release = _release(self.server, release, transfer.images[cfg.copy_source.name], gate)
        self.prometheus_config = (
            pulumi.Output.secret(api_key.apply(lambda key: prometheus_config(cfg, key)))
            if api_key
            else prometheus_config(cfg, None)
        )
        self.metrics = {"targets": targets(cfg), "prometheus": prometheus_url(cfg)}
        self.prometheus = create_prometheus(self, cfg, self.hosts, transfer, gate, self.prometheus_config)
        self.memory_plan = gate.memory_plan
        self.register_outputs(
            {
                "endpoint": self.endpoint,
                "served_model_name": self.served_model_name,
                "head_node": self.head_node,
                "ray_address": self.ray_address,
                "containers": self.containers,
                "log_commands": self.log_commands,
                "smoke": self.smoke,
                "benchmark": self.benchmark,
                "release": self.release,
                "metrics": self.metrics,
                "memory_plan": self.memory_plan,
                "fabric": self.fabric,
                "status_command": self.status_command,
            }
        )


def create_hosts(
    parent: pulumi.Resource, cfg: ClusterConfig, ssh_access: SshAccess, secrets: dict
) -> dict[str, NodeHost]:
    """Every node's Docker provider over SSH, its host key and, when managed, its fabric network."""
    return {
        node.name: NodeHost(
            node.name,
            NodeHostArgs(
                node=node,
                ssh_access=ssh_access,
                private_key=secrets.get("sshPrivateKey"),
                network=cfg.network,
                dial_error_limit=cfg.ssh.dial_error_limit,
            ),
            opts=pulumi.ResourceOptions(parent=parent),
        )
        for node in cfg.nodes
    }


def create_containers(
    parent: pulumi.Resource,
    cfg: ClusterConfig,
    release: ReleaseSource,
    hosts: dict[str, NodeHost],
    transfer: Transfer,
    gate: Gate,
    secret_env: pulumi.Output,
) -> dict[str, NodeContainer]:
    """Every node's long-lived container: the head once the gate exists, the workers after the head."""
    nodes: dict[str, NodeContainer] = {}
    head = cfg.head_node
    for node in [head, *cfg.workers]:
        host = hosts[node.name]
        nodes[node.name] = NodeContainer(
            node.name,
            NodeContainerArgs(
                config=cfg,
                node=node,
                image_id=transfer.images[node.name].image_id,
                model=release.model,
                provider=host.provider,
                connection=host.connection,
                secret_env=secret_env,
                # Only the head waits on the cross-node gate (checks, same image and model): workers
                # start after the head anyway (and are stopped before it on destroy), and one gate
                # per container would make N² dependencies.
                start_after=[
                    gate.passed if node is head else nodes[head.name].container,
                    *([transfer.guards[node.name].ready] if node.name in transfer.guards else []),
                ],
            ),
            opts=pulumi.ResourceOptions(parent=parent),
        )
    return nodes


def create_server(
    parent: pulumi.Resource,
    name: str,
    cfg: ClusterConfig,
    release: ReleaseSource,
    hosts: dict[str, NodeHost],
    nodes: dict[str, NodeContainer],
    gate: Gate,
    api_key: Optional[pulumi.Output[str]],
) -> VllmServer:
    """vLLM on the containers: the cluster wait, the handover, readiness, smoke test and benchmark."""
    return VllmServer(
        name,
        VllmServerArgs(
            config=cfg,
            containers={name: node.container_name for name, node in nodes.items()},
            container_ids={name: node.container.id for name, node in nodes.items()},
            model=release.model,
            engine=release.engine,
            connections={name: host.connection for name, host in hosts.items()},
            api_key=api_key,
            # with Ray: every worker joined; with mp: every container runs
            depends_on=[n.joined or n.supervisor for n in nodes.values()],
            max_num_seqs=data_only(gate.memory_plan.apply(lambda plan: (plan.get("maxNumSeqs") or {}).get("set"))),
        ),
        opts=pulumi.ResourceOptions(parent=parent),
    )


def _release(server: VllmServer, release: ReleaseSource, source_image, gate: Gate) -> pulumi.Output:
    """What this stack runs, pinned by digest (the pulling node's; with a copy, the source's) or, for an
    image no registry holds, by id; validated once the smoke test (and, when enabled, the benchmark)
    passed; the benchmark's figures and the fabric's go with it."""
    steps = [step for step in (server.smoke, server.benchmark) if step is not None]
    validated = pulumi.Output.all(*[step.stdout for step in steps]).apply(lambda _: True) if server.smoke else False
    pinned = pulumi.Output.all(source_image.repo_digest, gate.image_id).apply(lambda p: p[0] or p[1])
    # The fabric's figures (a dict per node) join by apply: Output.all would unwrap them into an Output
    # per key, and the release is an output, whose dependencies nothing reads.
    return pulumi.Output.all(pinned, release.model, release.engine, validated, server.benchmark_result).apply(
        lambda p: gate.fabric.apply(
            lambda figures: release_record(p[0], p[1], p[2], p[3], release.origin, fabric=figures, benchmark=p[4])
        )
    )


def create_prometheus(
    parent: pulumi.Resource,
    cfg: ClusterConfig,
    hosts: dict[str, NodeHost],
    transfer: Transfer,
    gate: Gate,
    config: pulumi.Input[str],
) -> Optional[Prometheus]:
    """metrics.prometheusNode: its Prometheus starts once the node's guard holds (Ray's ports are fenced
    before anything scrapes them) and the nodes passed their checks."""
    name = cfg.metrics.prometheus_node
    if name is None:
        return None
    guard = transfer.guards.get(name)
    return Prometheus(
        f"{name}-metrics",
        cfg,
        hosts[name].provider,
        config,
        depends_on=[guard.ready if guard else gate.passed],
        opts=pulumi.ResourceOptions(parent=parent),
    )


def _secret_env(parent: pulumi.Resource, cfg: ClusterConfig, secrets: dict) -> pulumi.Output:
    parts: list[pulumi.Input[str]] = []
    if "hfToken" in secrets:
        parts.append(secrets["hfToken"].apply(lambda token: f"HF_TOKEN={token}"))
    if cfg.executor == "ray" and cfg.ray.auth == "token":
        parts.append(_ray_auth_token(parent).apply(lambda token: f"RAY_AUTH_TOKEN={token.strip()}"))
    return pulumi.Output.secret(pulumi.Output.all(*parts)) if parts else pulumi.Output.from_input([])


def _ray_auth_token(parent: pulumi.Resource) -> pulumi.Output[str]:
    """One random token per stack, made once on the machine running Pulumi and kept (as a secret) in the
    stack's state: every Ray node must present the same one."""
    token = command.local.Command(
        "ray-auth-token",
        create="python3 -c 'import secrets; print(secrets.token_hex(32))'",
        logging=command.local.Logging.NONE,
        opts=pulumi.ResourceOptions(parent=parent, additional_secret_outputs=["stdout", "stderr"]),
    )
    return pulumi.Output.secret(token.stdout)


def _secrets(cfg: ClusterConfig) -> dict[str, pulumi.Output[str]]:
    values = {"apiKey": cfg.api_key, "hfToken": cfg.hf_token, "sshPrivateKey": cfg.ssh_private_key}
    return {key: pulumi.Output.secret(value.get_secret_value()) for key, value in values.items() if value is not None}
