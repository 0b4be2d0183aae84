"""The whole deployment, in the order DESIGN.md draws it: every node's host, the image and model on every
node, the gate (every node checked, all agreeing, the memory plan), the containers, vLLM on them, and
what the stack outputs. Each step is a function that returns what the next one takes."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import pulumi
import pulumi_command as command

from components.config import ClusterConfig
from components.config.replicas import Replica, co_tenants, replicas_of
from components.config.tls import facts as tls_facts
from components.plan.container import ray_address, tenancy
from components.plan.dashboard import dashboard
from components.plan.endpoint import declared_models, edge_node, edge_spec, endpoint
from components.plan.programs import printed
from components.resources.diagnostics import diagnose_command, diagnostics_output
from components.resources.edge import EDGE, Edge
from components.resources.gate import Gate, create_fabric_gate, create_gate
from components.resources.grafana import Grafana, grafana_url
from components.resources.metrics import Prometheus, prometheus_config, prometheus_url, targets
from components.resources.node import NodeHost, NodeHostArgs
from components.resources.node_container import NodeContainer, NodeContainerArgs
from components.resources.placement import (
    deployment_releases,
    deployments_output,
    deployments_release,
    replica_triggers,
    served_name,
    stack_release,
    together_check,
)
from components.resources.release import ReleaseSource, release_record, speculation_record
from components.resources.router import ReplicaSteps, Router, worker
from components.resources.serve import VllmServer, VllmServerArgs, log_follow_command, status_command
from components.resources.ssh import SshAccess
from components.resources.transfer import Transfer, create_transfer
from components.scripts.node_contract import KeeperResult


def data_only(value: pulumi.Output) -> pulumi.Output:
    """`value` without the resources it came from as dependencies. The memory plan reads every node's
    checks; vLLM's arguments take one number from it, and whatever takes those arguments (the serve
    steps, their triggers on every node) would otherwise list every node's checks again: N² edges for
    the SDK's cycle check, for an order the head container's gate already enforces."""
    return pulumi.Output(set(), value.future(with_unknowns=True), value.is_known(), value.is_secret())


@dataclass(frozen=True)
class VllmClusterArgs:
    config: ClusterConfig
    ssh_access: SshAccess


@dataclass(frozen=True)
class ReplicaRun:
    """What one replica (a single-model stack's one, or a deployment's) left for the outputs."""

    replica: Replica
    release: ReleaseSource
    gate: Gate
    nodes: dict[str, NodeContainer]
    server: VllmServer
    router_steps: Optional[ReplicaSteps]

    @property
    def containers(self) -> dict[str, str]:
        return {name: node.container_name for name, node in self.nodes.items()}


class VllmCluster(pulumi.ComponentResource):
    def __init__(self, name: str, args: VllmClusterArgs, opts: Optional[pulumi.ResourceOptions] = None):
        super().__init__("spark-vllm:index:VllmCluster", name, None, opts)
        cfg = args.config
        secrets = _secrets(cfg)
        # vLLM's key: the program's own, which the edge sends in place of a client's (clients' keys change at the
        # edge alone) and the program's own steps use; one per stack, kept in its state
        api_key = _program_key(self)
        self._identity = args.ssh_access.identity
        self.hosts = create_hosts(self, cfg, args.ssh_access, secrets)
        replicas = replicas_of(cfg)  # a single-model stack's one, or every deployment's
        releases = deployment_releases(replicas)
        shared = stack_release(releases)
        transfer = create_transfer(self, cfg, shared, self.hosts, secrets.get("hfToken"))
        fabric_verdict = create_fabric_gate(self, cfg, shared, self.hosts, transfer)  # once for the stack
        sharing = {r.name: co_tenants(cfg, r) for r in replicas}  # node -> the other replicas there
        gates = {
            r.name: create_gate(
                self, r.config, releases[r.deployment], self.hosts, transfer, fabric_verdict,
                co_tenants={node: [o.name for o in others] for node, others in sharing[r.name].items()},
                key=r.key("vllm"),
            )
            for r in replicas
        }  # fmt: skip
        # the stack file lists deployments: their replicas sharing a node are checked together there
        placed = None if replicas[0].own else together_check(self, cfg, replicas, gates)
        self.router = create_router(self, cfg, self.hosts, transfer, [placed] if placed else [])
        ray_token = _ray_auth_token(self) if any(_uses_ray_token(r.config) for r in replicas) else None
        self.runs: list[ReplicaRun] = []
        last_undrain: dict[Optional[str], pulumi.Resource] = {}
        for replica in replicas:
            rcfg, release, gate = replica.config, releases[replica.deployment], gates[replica.name]
            steps, drained = None, []
            if self.router is not None:
                after = [last_undrain[replica.deployment]] if replica.deployment in last_undrain else []
                triggers = replica_triggers(rcfg, release, transfer)
                steps = self.router.drain(replica, served_name(rcfg, release), release.engine, triggers, after)
                drained = [steps.drain]
            nodes = create_containers(
                self, rcfg, release, self.hosts, transfer, gate, _secret_env(rcfg, secrets, ray_token),
                after=[*([placed] if placed else []), *drained],
            )  # fmt: skip
            server = create_server(
                self, rcfg.called(name), rcfg, release, self.hosts, nodes, gate, api_key, after=drained,
                shared={node: tenancy(rcfg, others) for node, others in sharing[replica.name].items()},
            )  # fmt: skip
            if steps is not None:
                steps = self.router.undrain(replica, steps, server.smoke or server.ready)
                last_undrain[replica.deployment] = steps.undrain
            self.runs.append(ReplicaRun(replica, release, gate, nodes, server, steps))
        self.router_smoke = self._endpoint(cfg, transfer, api_key)
        self.dashboard = dashboard(cfg, pulumi.get_stack())
        self._outputs(cfg, transfer, api_key, secrets.get("grafanaAdminPassword"))

    def _endpoint(
        self, cfg: ClusterConfig, transfer: Transfer, api_key: Optional[pulumi.Output[str]]
    ) -> Optional[command.remote.Command]:
        """The edge, in front of the router or of the one replica's vLLM (components/plan/endpoint.py), after what
        may hold its port in a stack an older version deployed: that version's router container (its keeper served
        the endpoint itself), or its vLLM (on every address, until the serve step restarts it). With the router,
        every replica declared to it and the smoke test through both, which this returns."""
        first = self.runs[0]
        self.edge_config = cfg if self.router is not None else first.replica.config
        served = pulumi.Output.all(*[run.server.served_model_name for run in self.runs])
        if self.router is None:
            self.edge = create_edge(self, self.edge_config, self.hosts, transfer, first.gate, api_key, served,
                                    after=[first.server.serve])  # fmt: skip
            # a chat through the endpoint as a client sends it (over TLS, verified), after the edge took its config,
            # and again after every start of vLLM (the head's smoke runs again): `up` ends once the edge serves it
            self.endpoint_smoke = first.server.through_endpoint(
                [self.edge.container.id, first.server.serve.id], after=[self.edge.config]
            )
            return None
        workers = self._workers()
        self.edge = create_edge(self, self.edge_config, self.hosts, transfer, first.gate, api_key, served,
                                workers.apply(declared_models), after=[self.router.container])  # fmt: skip
        undrains = [run.router_steps.undrain for run in self.runs]
        return self.router.declare(workers, undrains, api_key, self.edge.config)[1]

    def _workers(self) -> pulumi.Output:
        """Every replica as the router's keeper declares it: its served name, model and max_model_len, each as the
        replica deploys it (the release's, with promoteFrom)."""

        def declared(run: ReplicaRun, found: dict[str, Any]) -> dict[str, Any]:
            # with the replica's vllm.stallSeconds: the keeper takes a replica that stalled out of the router
            return {**worker(run.replica, found["served"], found["engine"].max_model_len, found["root"]),
                    "stall_seconds": run.replica.config.vllm.stall_seconds}  # fmt: skip

        return pulumi.Output.all(
            *[
                pulumi.Output.all(
                    served=run.server.served_model_name, root=run.release.model, engine=run.release.engine
                ).apply(lambda found, run=run: declared(run, found))
                for run in self.runs
            ]
        )

    def _outputs(
        self,
        cfg: ClusterConfig,
        transfer: Transfer,
        api_key: Optional[pulumi.Output[str]],
        grafana_password: Optional[pulumi.Output[str]],
    ) -> None:
        on_nodes = {node.name: [c for run in self.runs for n, c in run.containers.items() if n == node.name]
                    for node in cfg.nodes}  # fmt: skip
        self.fabric = self.runs[0].gate.fabric  # the stack's fabric (the same for every replica)
        # The edge: a single-model stack's outputs keep the shape they had before deployments.
        if self.runs[0].replica.own:
            self._single_model_outputs(cfg, self.runs[0], transfer)
        else:
            self._deployment_outputs(cfg, transfer, on_nodes)
        # the certificate the endpoint serves (its fingerprint, names, end of validity): public facts, not secret
        self.tls = tls_facts(cfg.tls.certificate).to_output() if cfg.tls is not None else None
        self.prometheus_config = prometheus_config(cfg)
        self.metrics = {"targets": targets(cfg), "prometheus": prometheus_url(cfg)}
        self.prometheus = create_prometheus(self, cfg, self.hosts, transfer, self.runs[0].gate, self.prometheus_config)
        self.grafana = create_grafana(
            self, cfg, self.hosts, transfer, self.prometheus, self.dashboard, grafana_password
        )
        if self.grafana is not None:
            self.metrics["grafana"] = grafana_url(cfg)
        self.diagnostics = diagnostics_output(
            cfg,
            pulumi.get_stack(),
            on_nodes,
            {node: host.host_key for node, host in self.hosts.items()},
            self._identity,
        )
        self.diagnose_command = diagnose_command(pulumi.get_stack())
        self.register_outputs(
            {
                "endpoint": self.endpoint,
                "tls": self.tls,
                "containers": self.containers,
                "release": self.release,
                "metrics": self.metrics,
                "memory_plan": self.memory_plan,
                "fabric": self.fabric,
                "status_command": self.status_command,
            }
        )

    def _single_model_outputs(self, cfg: ClusterConfig, run: ReplicaRun, transfer: Transfer) -> None:
        head = cfg.head_node
        self.containers = run.containers
        self.status_command = status_command(cfg, self.containers)
        self.endpoint = pulumi.Output.from_input(endpoint(self.edge_config))
        self.served_model_name = run.server.served_model_name
        self.head_node = head.name
        self.executor = cfg.executor
        self.ray_address = ray_address(cfg) if cfg.executor == "ray" else None
        self.log_commands = {**log_commands(cfg, self.containers), "edge": edge_log_command(self.edge_config)}
        self.smoke = run.server.smoke_result
        self.benchmark = run.server.benchmark_result
        self.release = _release(run.server, run.release, transfer.images[cfg.copy_source.name], run.gate)
        self.memory_plan = run.gate.memory_plan
        self.deployments = None

    def _deployment_outputs(self, cfg: ClusterConfig, transfer: Transfer, on_nodes: dict[str, list[str]]) -> None:
        runs = self.runs
        self.containers = {run.replica.name: run.containers for run in runs}
        self.status_command = status_command(cfg, on_nodes)
        self.endpoint = pulumi.Output.from_input(endpoint(self.edge_config))
        self.served_model_name = pulumi.Output.all(*[run.server.served_model_name for run in runs]).apply(
            lambda names: sorted(set(names))
        )
        self.head_node = None
        self.executor = None
        self.ray_address = None
        self.log_commands = {
            f"{run.replica.name}:{key}": command
            for run in runs
            for key, command in log_commands(run.replica.config, run.containers).items()
        } | {"edge": edge_log_command(self.edge_config)}
        self.smoke = {run.replica.name: run.server.smoke_result for run in runs}
        self.benchmark = {run.replica.name: run.server.benchmark_result for run in runs}
        self.memory_plan = {run.replica.name: run.gate.memory_plan for run in runs}
        source = transfer.images[cfg.copy_source.name]
        self.release = deployments_release(
            {run.replica.deployment: _release(run.server, run.release, source, run.gate, with_fabric=False)
             for run in runs if run.replica.index == 0},
            self.fabric,
        )  # fmt: skip
        self.deployments = deployments_output(cfg, runs)


def router_smoke_summary(stdout: str) -> dict:
    """What the router's smoke test found: each model's latency through the router and who answered."""
    return KeeperResult.from_json(printed(stdout)).models or {}


def edge_log_command(cfg: ClusterConfig) -> str:
    """How to follow the edge's log (HAProxy's, one line a request; the watchdog's) on its node."""
    return log_follow_command(cfg, edge_node(cfg).name, EDGE.container, vllm=False)


def log_commands(cfg: ClusterConfig, containers: dict[str, str]) -> dict[str, str]:
    """How to follow vLLM's log (with mp each rank's) and each container's, over SSH."""
    head = cfg.head_node
    found = {
        "vllm": log_follow_command(cfg, head.name, containers[head.name], vllm=True),
        **{name: log_follow_command(cfg, name, c, vllm=False) for name, c in containers.items()},
    }
    if cfg.executor == "mp":  # every node runs a vLLM rank with a log of its own
        found |= {
            f"vllm:{name}": log_follow_command(cfg, name, c, vllm=True)
            for name, c in containers.items()
            if name != head.name
        }
    return found


def node_resource_name(cfg: ClusterConfig, node: str) -> str:
    """A node's components in `cfg` (a replica's view: prefixed with its name)."""
    return cfg.named(node)


def create_router(
    parent: pulumi.Resource,
    cfg: ClusterConfig,
    hosts: dict[str, NodeHost],
    transfer: Transfer,
    after: Sequence[pulumi.Resource],
) -> Optional[Router]:
    """router.enabled: vllm-router on router.node, in the stack's image, once that node's guard holds."""
    if not cfg.router.enabled:
        return None
    name = cfg.router.node
    guard = transfer.guards.get(name)
    return Router(
        "spark-vllm",
        cfg,
        hosts[name].provider,
        hosts[name].connection,
        transfer.images[name].image_id,
        depends_on=[*after, *([guard.ready] if guard else [])],
        opts=pulumi.ResourceOptions(parent=parent),
    )


def create_edge(
    parent: pulumi.Resource,
    cfg: ClusterConfig,
    hosts: dict[str, NodeHost],
    transfer: Transfer,
    gate: Gate,
    program_key: pulumi.Output[str],
    served: pulumi.Output[list],
    models: Optional[pulumi.Input[list]] = None,
    after: Sequence[pulumi.Resource] = (),
) -> Edge:
    """The edge on the endpoint's node (the router's, or the one replica's head), once the nodes passed their
    checks and that node's guard holds; `cfg`: the stack's config with the router, the replica's view without;
    `served`: the models' served names."""
    node = edge_node(cfg).name
    guard = transfer.guards.get(node)
    checked = [gate.passed, *([guard.ready] if guard else [])]
    spec = pulumi.Output.all(program_key=program_key, served=served, models=models).apply(
        lambda found: edge_spec(cfg, **found)
    )
    return Edge(
        "spark-vllm",
        cfg,
        spec,
        hosts[node].provider,
        hosts[node].connection,
        depends_on=[*checked, *after],
        pull_after=checked,  # the image comes meanwhile: only its container waits for `after`
        opts=pulumi.ResourceOptions(parent=parent),
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
    after: Sequence[pulumi.Resource] = (),
) -> dict[str, NodeContainer]:
    """Every node's long-lived container: the head once the gate exists (and what `after` names: the
    check of the replicas sharing nodes, the replica out of the router), the workers after the head."""
    nodes: dict[str, NodeContainer] = {}
    head = cfg.head_node
    for node in [head, *cfg.workers]:
        host = hosts[node.name]
        nodes[node.name] = NodeContainer(
            node_resource_name(cfg, node.name),
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
                    *(after if node is head else []),
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
    after: Sequence[pulumi.Resource] = (),
    shared: Optional[dict] = None,
) -> VllmServer:
    """vLLM on the containers: the cluster wait, the handover, readiness, smoke test and benchmark (after
    `after`: the replica out of the router, when only vLLM's settings change; `shared`: node -> its tenancy
    where it shares the node with other replicas)."""
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
            depends_on=[*[n.joined or n.supervisor for n in nodes.values()], *after],
            max_num_seqs=data_only(gate.memory_plan.apply(lambda plan: (plan.get("maxNumSeqs") or {}).get("set"))),
            scale_out=data_only(gate.vllm.apply(lambda found: bool(found.get("scaleOut")))),
            kv_cache_bytes=data_only(
                gate.memory_plan.apply(lambda plan: (plan.get("kvCache") or {}).get("pinnedBytes"))
            ),
            tenancy=shared or {},
            kept_baseline=release.baseline,
        ),
        opts=pulumi.ResourceOptions(parent=parent),
    )


def _release(
    server: VllmServer, release: ReleaseSource, source_image, gate: Gate, with_fabric: bool = True
) -> pulumi.Output:
    """What this stack runs, pinned by digest (the pulling node's; with a copy, the source's) or, for an
    image no registry holds, by id; validated once the smoke test (and, when enabled, the benchmark)
    passed; the benchmark's figures and the fabric's go with it (with deployments, the fabric goes once
    with the stack's release: components/resources/placement.py)."""
    steps = [step for step in (server.smoke, server.benchmark) if step is not None]
    validated = pulumi.Output.all(*[step.stdout for step in steps]).apply(lambda _: True) if server.smoke else False
    pinned = pulumi.Output.all(digest=source_image.repo_digest, image_id=gate.image_id).apply(
        lambda found: found["digest"] or found["image_id"]
    )
    # The fabric's figures (a dict per node) join by apply: Output.all would unwrap them into an Output
    # per key, and the release is an output, whose dependencies nothing reads.
    parts = pulumi.Output.all(
        image=pinned, model=release.model, engine=release.engine, validated=validated,
        benchmark=server.benchmark_result, validation=server.validation, baseline=server.baseline_result,
        vllm=gate.vllm, hosts=gate.hosts,
    )  # fmt: skip

    def record(p: dict, figures: Optional[dict] = None) -> dict:
        speculation = speculation_record(p["engine"], p["validation"], p["baseline"], p["benchmark"])
        return release_record(
            p["image"], p["model"], p["engine"], p["validated"], release.origin, fabric=figures,
            benchmark=p["benchmark"], speculation=speculation, vllm=p["vllm"], hosts=p["hosts"],
        )  # fmt: skip

    if not with_fabric:
        return parts.apply(record)
    return parts.apply(lambda p: gate.fabric.apply(lambda figures: record(p, figures)))


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


def create_grafana(
    parent: pulumi.Resource,
    cfg: ClusterConfig,
    hosts: dict[str, NodeHost],
    transfer: Transfer,
    prometheus: Optional[Prometheus],
    board: dict,
    password: Optional[pulumi.Output[str]],
) -> Optional[Grafana]:
    """metrics.grafanaNode: its Grafana starts once the Prometheus it reads runs and its node's guard holds."""
    name = cfg.metrics.grafana_node
    if name is None or prometheus is None or password is None:
        return None
    guard = transfer.guards.get(name)
    after = [prometheus.container, *([guard.ready] if guard else [])]
    opts = pulumi.ResourceOptions(parent=parent)
    return Grafana(f"{name}-dashboards", cfg, hosts[name].provider, board, password, after, opts)


def _uses_ray_token(cfg: ClusterConfig) -> bool:
    return cfg.executor == "ray" and cfg.ray.auth == "token"


def _secret_env(cfg: ClusterConfig, secrets: dict, ray_token: Optional[pulumi.Output[str]]) -> pulumi.Output:
    parts: list[pulumi.Input[str]] = []
    if "hfToken" in secrets:
        parts.append(secrets["hfToken"].apply(lambda token: f"HF_TOKEN={token}"))
    if _uses_ray_token(cfg) and ray_token is not None:
        parts.append(ray_token.apply(lambda token: f"RAY_AUTH_TOKEN={token.strip()}"))
    return pulumi.Output.secret(pulumi.Output.all(*parts)) if parts else pulumi.Output.from_input([])


def _program_key(parent: pulumi.Resource) -> pulumi.Output[str]:
    """vLLM's API key: the program's own, made once on the machine running Pulumi and kept (as a secret) in the
    stack's state. No client is given it; the edge puts it in place of the client's key it accepted."""
    key = command.local.Command(
        "vllm-api-key",
        create="python3 -c 'import secrets; print(\"sk-spark-vllm-\" + secrets.token_urlsafe(32))'",
        logging=command.local.Logging.NONE,
        opts=pulumi.ResourceOptions(parent=parent, additional_secret_outputs=["stdout", "stderr"]),
    )
    return pulumi.Output.secret(key.stdout.apply(lambda text: text.strip()))


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
    values = {"apiKey": cfg.api_key, "hfToken": cfg.hf_token, "sshPrivateKey": cfg.ssh_private_key,
              "grafanaAdminPassword": cfg.grafana_admin_password}  # fmt: skip
    return {key: pulumi.Output.secret(value.get_secret_value()) for key, value in values.items() if value is not None}
