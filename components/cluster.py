"""The whole deployment: every node in parallel, then the Ray cluster, then vLLM on the head."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional

import pulumi
import pulumi_command as command

from components import fabric
from components.checks import NodeChecks, NodeChecksArgs, fabric_gate_probe
from components.config import ClusterConfig, NodeConfig
from components.depot import Depot, DepotArgs, download_model, snapshot_of, sync_model
from components.guard import NodeGuard, NodeGuardArgs
from components.image import CopyFrom, NodeImage, NodeImageArgs
from components.memory import MemoryPlanError
from components.memory import message as memory_message
from components.metrics import Prometheus, prometheus_config, prometheus_url, targets
from components.node import NodeHost, NodeHostArgs
from components.node_container import NodeContainer, NodeContainerArgs
from components.preflight import (
    compare_fingerprints,
    image_problems,
    image_warnings,
    memory_plan,
    parse_fingerprint,
)
from components.release import ReleaseSource, release_record
from components.render import ray_address, script_program, shell_line, with_script
from components.serve import VllmServer, VllmServerArgs, log_follow_command, status_command
from components.ssh import SshAccess


class ImageMismatchError(Exception):
    pass


class PreflightError(Exception):
    pass


class ImageCheckError(Exception):
    """The image on one or more nodes lacks what the config needs; one line a problem, each with its fix."""


def image_fit(cfg: ClusterConfig, stdouts_by_node: dict[str, str]) -> bool:
    """True when every node's image holds what the config needs; ImageCheckError listing every problem."""
    problems = [line for node in cfg.nodes for line in image_problems(cfg, node, stdouts_by_node[node.name])]
    if problems:
        raise ImageCheckError("\n".join(problems))
    for node in cfg.nodes:
        for warning in image_warnings(node, stdouts_by_node[node.name]):
            pulumi.log.warn(warning)
    return True


def same_model(stdouts_by_node: dict[str, str]) -> str:
    """The fingerprint every node found for the model; PreflightError naming the differences."""
    found = {node: parse_fingerprint(out) for node, out in stdouts_by_node.items()}
    problems = compare_fingerprints(found)
    if problems:
        raise PreflightError("\n".join(problems))
    return next(iter(found.values())).get("fingerprint", "")


def model_directory(cfg: ClusterConfig, model: str) -> str:
    """The model as modelSync copies it: a directory, or a repo id's repository in container.hfCacheDir
    (a promoted release may name a repo id where this stack has no such directory)."""
    try:
        return cfg.synced_model_dir(model)
    except ValueError:
        raise PreflightError(
            f"modelSync.enabled copies the model, but it is {model!r}, a Hugging Face repo id, and "
            "container.hfCacheDir is not set: set it to a host directory (the copy source downloads the model "
            "there once and the other nodes receive it there)"
        ) from None


def gate_line(nodes: int, image_id: str, model_fingerprint: str) -> str:
    """The gate's command: it only records, on the deploying machine, what every node agreed on."""
    model = f"model {model_fingerprint[:16]}" if model_fingerprint else "model by repo id"
    return shell_line(["echo", f"{nodes} node(s) checked: image {image_id}, {model}"])


def same_image(ids_by_node: dict[str, str]) -> str:
    """The one image id every node runs, or an error naming the nodes that differ."""
    distinct = sorted(set(ids_by_node.values()))
    if len(distinct) > 1:
        listing = ", ".join(f"{node}: {image}" for node, image in sorted(ids_by_node.items()))
        raise ImageMismatchError(
            f"the image differs between nodes ({listing}); the tag moved between pulls or a node has a "
            "locally built image: pin `image` by digest (name@sha256:…) or re-pull on every node"
        )
    return distinct[0]


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
        cfg = args.config
        secrets = _secrets(cfg)
        self._hf_token = secrets.get("hfToken")
        self.hosts = self._create_hosts(cfg, args, secrets)
        images = self._create_images(cfg, args)
        names = list(images)
        same_image_id = pulumi.Output.all(*[images[n].image_id for n in names]).apply(
            lambda ids: same_image(dict(zip(names, ids, strict=True)))
        )
        self.checks_passed = self._create_checks(cfg, args, images, same_image_id)
        self.nodes = self._create_node_containers(cfg, args, images, self._secret_env(cfg, secrets))
        head = cfg.head_node
        self.containers = {name: node.container_name for name, node in self.nodes.items()}
        self.server = VllmServer(
            name,
            VllmServerArgs(
                config=cfg,
                containers=self.containers,
                container_ids={name: node.container.id for name, node in self.nodes.items()},
                model=args.release.model,
                engine=args.release.engine,
                connections={name: host.connection for name, host in self.hosts.items()},
                api_key=secrets.get("apiKey"),
                # with Ray: every worker joined; with mp: every container runs
                depends_on=[n.joined or n.supervisor for n in self.nodes.values()],
                max_num_seqs=data_only(self.memory_plan.apply(lambda plan: (plan.get("maxNumSeqs") or {}).get("set"))),
            ),
            opts=pulumi.ResourceOptions(parent=self),
        )
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
        self.release = self._release(args, images[cfg.copy_source.name], same_image_id)
        api_key = secrets.get("apiKey")
        self.prometheus_config = (
            pulumi.Output.secret(api_key.apply(lambda key: prometheus_config(cfg, key)))
            if api_key
            else prometheus_config(cfg, None)
        )
        self.metrics = {"targets": targets(cfg), "prometheus": prometheus_url(cfg)}
        self.prometheus = self._create_prometheus(cfg)
        self.memory_plan_output = self.memory_plan
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

    def _create_hosts(self, cfg: ClusterConfig, args: VllmClusterArgs, secrets: dict) -> dict[str, NodeHost]:
        return {
            node.name: NodeHost(
                node.name,
                NodeHostArgs(
                    node=node,
                    ssh_access=args.ssh_access,
                    private_key=secrets.get("sshPrivateKey"),
                    network=cfg.network,
                    dial_error_limit=cfg.ssh.dial_error_limit,
                ),
                opts=pulumi.ResourceOptions(parent=self),
            )
            for node in cfg.nodes
        }

    def _create_images(self, cfg: ClusterConfig, args: VllmClusterArgs) -> dict[str, NodeImage]:
        """Every node's image. The copy source's is pulled (or found); with imageTransfer.method copy
        the others receive that image id from the source's depot over the fabric."""
        source = cfg.copy_source

        def node_image(node: NodeConfig, copy_from: Optional[CopyFrom] = None) -> NodeImage:
            return NodeImage(
                node.name,
                NodeImageArgs(
                    node=node,
                    reference=args.release.image,
                    keep_locally=cfg.container.keep_image,
                    transfer=cfg.image_transfer,
                    provider=self.hosts[node.name].provider,
                    connection=self.hosts[node.name].connection,
                    copy_from=copy_from,
                ),
                opts=pulumi.ResourceOptions(parent=self),
            )

        images = {source.name: node_image(source)}
        self.guards: dict[str, NodeGuard] = {}
        self._guard(cfg, source, images[source.name])
        self.depot = None
        self.download = None
        if cfg.uses_depot:
            networks = [h.fabric_network for h in self.hosts.values() if h.fabric_network is not None]
            guarded = [self.guards[source.name].ready] if source.name in self.guards else []
            if cfg.downloads_once:
                # A repo id: fetched once here, then served like a directory (the depot mounts it).
                self.download = download_model(
                    source.name,
                    cfg,
                    source,
                    images[source.name].image_id,
                    args.release.model,
                    self._hf_token,
                    self.hosts[source.name].connection,
                    after=guarded,
                    parent=self,
                )
            synced = args.release.model
            if cfg.model_sync.enabled:
                synced = args.release.model.apply(lambda model: model_directory(cfg, model))
            self.synced_model = synced  # what the depot serves and every other node's sync writes
            self.depot = Depot(
                "spark-vllm-copy",
                DepotArgs(
                    config=cfg,
                    image_id=images[source.name].image_id,
                    model=synced,
                    provider=self.hosts[source.name].provider,
                    start_after=(*networks, *guarded, *([self.download] if self.download else [])),
                ),
                opts=pulumi.ResourceOptions(parent=self),
            )
        copy_from = None
        if self.depot is not None and cfg.image_transfer.method == "copy":
            copy_from = CopyFrom(config=cfg, depot=self.depot, image_id=images[source.name].image_id)
        for node in cfg.nodes:
            if node.name != source.name:
                images[node.name] = node_image(node, copy_from)
                self._guard(cfg, node, images[node.name])
        return {node.name: images[node.name] for node in cfg.nodes}

    def _guard(self, cfg: ClusterConfig, node: NodeConfig, image: NodeImage) -> None:
        """network.guard on `node`: its rules in place before anything of the stack listens there."""
        if not cfg.network.guard:
            return
        host = self.hosts[node.name]
        self.guards[node.name] = NodeGuard(
            node.name,
            NodeGuardArgs(
                config=cfg, node=node, image_id=image.image_id, provider=host.provider, connection=host.connection
            ),
            opts=pulumi.ResourceOptions(parent=self),
        )

    def _create_node_containers(
        self, cfg: ClusterConfig, args: VllmClusterArgs, images: dict, secret_env
    ) -> dict[str, NodeContainer]:
        nodes: dict[str, NodeContainer] = {}
        head = cfg.head_node
        for node in [head, *cfg.workers]:
            host = self.hosts[node.name]
            nodes[node.name] = NodeContainer(
                node.name,
                NodeContainerArgs(
                    config=cfg,
                    node=node,
                    image_id=images[node.name].image_id,
                    model=args.release.model,
                    provider=host.provider,
                    connection=host.connection,
                    secret_env=secret_env,
                    # Only the head waits on the cross-node gate (checks, same image and model): workers
                    # start after the head anyway (and are stopped before it on destroy), and one gate
                    # per container would make N² dependencies.
                    start_after=[
                        self.checks_passed if node is head else nodes[head.name].container,
                        *([self.guards[node.name].ready] if node.name in self.guards else []),
                    ],
                ),
                opts=pulumi.ResourceOptions(parent=self),
            )
        return nodes

    def _release(self, args: VllmClusterArgs, head_image: NodeImage, image_id: pulumi.Output) -> pulumi.Output:
        """What this stack runs, pinned by digest (the pulling node's; with a copy, the source's) or,
        for an image no registry holds, by id; validated once the smoke test (and, when enabled, the
        benchmark) passed; the benchmark's figures and the fabric's go with it."""
        steps = [step for step in (self.server.smoke, self.server.benchmark) if step is not None]
        validated = (
            pulumi.Output.all(*[step.stdout for step in steps]).apply(lambda _: True) if self.server.smoke else False
        )
        pinned = pulumi.Output.all(head_image.repo_digest, image_id).apply(lambda p: p[0] or p[1])
        # The fabric's figures (a dict per node) join by apply: Output.all would unwrap them into an Output
        # per key, and the release is an output, whose dependencies nothing reads.
        return pulumi.Output.all(pinned, args.release.model, args.release.engine, validated, self.benchmark).apply(
            lambda p: self.fabric.apply(
                lambda figures: release_record(
                    p[0], p[1], p[2], p[3], args.release.origin, fabric=figures, benchmark=p[4]
                )
            )
        )

    def _create_prometheus(self, cfg: ClusterConfig) -> Optional[Prometheus]:
        """metrics.prometheusNode: its Prometheus starts once the node's guard holds (Ray's ports are
        fenced before anything scrapes them) and the nodes passed their checks."""
        name = cfg.metrics.prometheus_node
        if name is None:
            return None
        guard = self.guards.get(name)
        return Prometheus(
            f"{name}-metrics",
            cfg,
            self.hosts[name].provider,
            self.prometheus_config,
            depends_on=[guard.ready if guard else self.checks_passed],
            opts=pulumi.ResourceOptions(parent=self),
        )

    def _create_checks(
        self, cfg: ClusterConfig, args: VllmClusterArgs, images: dict, same_image_id: pulumi.Output
    ) -> command.local.Command:
        """Every node's checks, and the gate the head's Ray container waits for: it exists only once
        every node passed its checks and all agree on the image and the model.

        The gate is a resource of its own, so the head container depends on it without taking data
        from it: in a preview where a node is added (its checks not run yet) the head's inputs stay
        known and the preview shows the head as it will be, untouched.
        """
        networks = [h.fabric_network for h in self.hosts.values() if h.fabric_network is not None]
        source = cfg.copy_source
        syncing = cfg.model_sync.enabled and self.depot is not None
        checks: dict[str, NodeChecks] = {}
        source_model = None
        # What the checks read on each node: the model, or a downloaded repo id's snapshot directory
        # (the same path on every node once synced), so it is fingerprinted and compared like a directory.
        local_model = args.release.model
        if self.download is not None:
            local_model = self.download.stdout.apply(snapshot_of)
        self.fabric, fabric_passed = self._fabric_gate(cfg, args, networks, local_model)
        for node in [source, *(n for n in cfg.nodes if n.name != source.name)]:
            after: list[pulumi.Resource] = list(networks)  # peers must have their fabric address before we ping them
            if fabric_passed is not None:
                after.append(fabric_passed)  # nothing else runs on a node (no check container) on a bad fabric
            reread: list[pulumi.Input] = []
            if node is source and self.download is not None:
                after.append(self.download)
            if syncing and source_model is not None:
                after.append(
                    sync_model(
                        node.name,
                        cfg,
                        node,
                        self.depot,
                        self.synced_model,
                        source_model,
                        self.hosts[node.name].connection,
                        parent=self,
                    )
                )
                reread.append(source_model)  # a new copy: check and fingerprint it again
            checks[node.name] = NodeChecks(
                node.name,
                NodeChecksArgs(
                    config=cfg,
                    node=node,
                    connection=self.hosts[node.name].connection,
                    image_id=images[node.name].image_id,
                    model=local_model,
                    after=after,
                    reread=reread,
                ),
                opts=pulumi.ResourceOptions(parent=self),
            )
            if syncing and node is source and checks[node.name].fingerprint is not None:
                source_model = checks[node.name].fingerprint.apply(
                    lambda out: parse_fingerprint(out).get("fingerprint", "")
                )
        self.checks = {node.name: checks[node.name] for node in cfg.nodes}
        gates = [checks.passed for checks in self.checks.values()]
        fingerprints = {name: c.fingerprint for name, c in self.checks.items() if c.fingerprint is not None}
        model_id = pulumi.Output.from_input("")
        if fingerprints:
            names = list(fingerprints)
            model_id = pulumi.Output.all(*fingerprints.values()).apply(
                lambda outs: same_model(dict(zip(names, outs, strict=True)))
            )
        self.memory_plan = self._memory_plan(cfg, args, fingerprints)
        nccl_passed = pulumi.Output.from_input(True)
        if fabric.nccl_test(cfg):
            self.fabric, nccl_passed = self._nccl_test(cfg, args, images, local_model)
        node_names = [node.name for node in cfg.nodes]
        images_fit = pulumi.Output.all(*[self.checks[n].image_facts for n in node_names]).apply(
            lambda outs: image_fit(cfg, dict(zip(node_names, outs, strict=True)))
        )
        # The plan only has to have passed (it raises when it does not fit): a bool joins the gate, not
        # the plan, whose per-node dict Output.all would unwrap into an Output per key.
        planned = self.memory_plan.apply(lambda _: True)
        verdict = pulumi.Output.all(same_image_id, model_id, planned, images_fit, nccl_passed, *gates).apply(
            lambda parts: gate_line(len(cfg.nodes), parts[0], parts[1])
        )
        return command.local.Command(
            "spark-vllm-checks-passed",
            create=verdict,
            opts=pulumi.ResourceOptions(parent=self),
        )

    def _fabric_gate(
        self, cfg: ClusterConfig, args: VllmClusterArgs, networks: list, model: pulumi.Input[str]
    ) -> tuple[pulumi.Output, Optional[command.local.Command]]:
        """Every node's fabric probe, judged together by `spark-vllm-fabric-passed`: with fabric.gate
        enforce its input fails listing every problem, so it never exists and nothing after it (the
        checks, the containers) runs. (The figures, the resource or None when the gate is off.)"""
        if cfg.fabric.gate == "off":
            return pulumi.Output.from_input({"checked": False, "reason": "fabric.gate: off"}), None
        names = [node.name for node in cfg.nodes]
        # a new release runs on a freshly checked fabric; the image as named is known before any pull
        triggers = [args.release.image, model]
        probes = [
            fabric_gate_probe(cfg, node, self.hosts[node.name].connection, triggers, networks, self)
            for node in cfg.nodes
        ]

        def judge(outs: list[str]) -> dict:
            facts = {}
            for name, out in zip(names, outs, strict=True):
                try:
                    facts[name] = parse_fingerprint(out)
                except ValueError as error:
                    facts[name] = {"error": f"{error}: {out.strip()[:200]!r}"}
            problems, figures = fabric.judge(cfg, facts)
            fabric.enforce(cfg, problems, pulumi.log.warn)
            return {**figures, "problems": problems}

        figures = pulumi.Output.all(*[probe.stdout for probe in probes]).apply(judge)
        passed = command.local.Command(
            "spark-vllm-fabric-passed",
            create=figures.apply(lambda f: shell_line(["echo", f"fabric: {fabric.describe(f)}"])),
            opts=pulumi.ResourceOptions(parent=self),
        )
        return figures, passed

    def _nccl_test(
        self, cfg: ClusterConfig, args: VllmClusterArgs, images: dict, model: pulumi.Input[str]
    ) -> tuple[pulumi.Output, pulumi.Output]:
        """fabric.bandwidthTest: nccl: `<node>-fabric-nccl` on every node at once, in its image on its
        GPUs, once every node passed its checks (the GPU visible in a container, the image pulled);
        judged with the gate's figures. (The fabric figures with the test's, and its verdict.)"""
        checked = [r for c in self.checks.values() for r in (c.preflight, c.gpu) if r is not None]
        image_ids = [images[node.name].image_id for node in cfg.nodes]
        tests = []
        for index, node in enumerate(cfg.nodes):
            program = script_program("nccl_bandwidth.py", fabric.nccl_params(cfg, node))
            tests.append(
                command.remote.Command(
                    f"{node.name}-fabric-nccl",
                    create=image_ids[index].apply(
                        lambda image, node=node, program=program: with_script(
                            shell_line(fabric.nccl_argv(cfg, node, image)), program
                        )
                    ),
                    # every node's test must run together: any node's new image runs them all again
                    triggers=[*image_ids, model],
                    connection=self.hosts[node.name].connection,
                    add_previous_output_in_env=False,
                    opts=pulumi.ResourceOptions(parent=self, depends_on=checked),
                )
            )
        names = [node.name for node in cfg.nodes]

        def judge(parts: list) -> dict:
            gate, *outs = parts
            facts = {}
            for name, out in zip(names, outs, strict=True):
                lines = [line for line in out.splitlines() if line.strip()]
                try:
                    facts[name] = json.loads(lines[-1])
                except (IndexError, ValueError):
                    facts[name] = {"error": f"the test printed no result: {out.strip()[-300:]!r}"}
            problems, figures = fabric.judge_nccl(cfg, facts, gate.get("links") or {})
            fabric.enforce(cfg, problems, pulumi.log.warn)
            return fabric.with_nccl(gate, figures, problems)

        merged = pulumi.Output.all(self.fabric, *[test.stdout for test in tests]).apply(judge)
        return merged, merged.apply(lambda _: True)

    def _memory_plan(self, cfg: ClusterConfig, args: VllmClusterArgs, fingerprints: dict) -> pulumi.Output:
        """The memory plan from the head's model fingerprint and every node's memory; with
        memoryCheck enforce, an error (before any container) when it does not fit."""
        if cfg.memory_check == "off":
            return pulumi.Output.from_input({"checked": False, "reason": "memoryCheck: off"})
        if cfg.head_node.name not in fingerprints:
            return pulumi.Output.from_input(
                {"checked": False, "reason": "the model is a repo id: its size is known only once downloaded"}
            )
        memories = [checks.memory for checks in self.checks.values()]

        def judge(parts: list) -> dict:
            fingerprint, engine, *found = parts
            plan = memory_plan(cfg, fingerprint, found, engine)
            for note in plan.notes():
                pulumi.log.info(note)
            if not plan.fits:
                if cfg.memory_check == "enforce":
                    raise MemoryPlanError(memory_message(plan))
                pulumi.log.warn(
                    memory_message(plan).replace("(memoryCheck: enforce); nothing was started", "(memoryCheck: warn)")
                )
            return {"checked": True, **plan.output()}

        return pulumi.Output.all(fingerprints[cfg.head_node.name], args.release.engine, *memories).apply(judge)

    def _secret_env(self, cfg: ClusterConfig, secrets: dict) -> pulumi.Output:
        parts: list[pulumi.Input[str]] = []
        if "hfToken" in secrets:
            parts.append(secrets["hfToken"].apply(lambda token: f"HF_TOKEN={token}"))
        if cfg.executor == "ray" and cfg.ray.auth == "token":
            parts.append(self._ray_auth_token().apply(lambda token: f"RAY_AUTH_TOKEN={token.strip()}"))
        return pulumi.Output.secret(pulumi.Output.all(*parts)) if parts else pulumi.Output.from_input([])

    def _ray_auth_token(self) -> pulumi.Output[str]:
        """One random token per stack, made once on the machine running Pulumi and kept (as a
        secret) in the stack's state: every Ray node must present the same one."""
        token = command.local.Command(
            "ray-auth-token",
            create="python3 -c 'import secrets; print(secrets.token_hex(32))'",
            logging=command.local.Logging.NONE,
            opts=pulumi.ResourceOptions(parent=self, additional_secret_outputs=["stdout", "stderr"]),
        )
        return pulumi.Output.secret(token.stdout)


def _secrets(cfg: ClusterConfig) -> dict[str, pulumi.Output[str]]:
    values = {"apiKey": cfg.api_key, "hfToken": cfg.hf_token, "sshPrivateKey": cfg.ssh_private_key}
    return {key: pulumi.Output.secret(value.get_secret_value()) for key, value in values.items() if value is not None}
