"""network.guard: only the fabric reaches Ray (and the ranks, the master port, the copy depot).

Per node, with `network.guard: true`:

* `<node>-guard-host` (remote command): at create, checks that the node has nft or iptables and
  says what it will write; at delete (the stack destroyed, or the guard turned off) removes the
  rules. The rules outlive the guard container on purpose: replacing or restarting it never
  leaves Ray open for a moment.
* `<node>-guard` (container `spark-vllm.guard`, the node's image, host network, CAP_NET_ADMIN):
  applies the rules (components/scripts/node_guard.py), puts them back if something removes them, and,
  started by Docker after a reboot, applies them again; the marker it writes (boot id, spec hash)
  in the `spark-vllm-guard` volume lets the node's supervisor hold Ray back until then.
* `<node>-guard-ready` (remote command): waits until the container applied this spec; the node's
  Ray container (and the depot on the copy source) start after it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import pulumi
import pulumi_command as command
import pulumi_docker as docker

from components.config import ClusterConfig, NodeConfig
from components.config.replicas import on_node, stack_listeners
from components.plan.container import log_options
from components.plan.names import EDGE_USER_ID, GUARD_VOLUME, ROUTER_USER_ID
from components.plan.programs import script_program
from components.plan.shell import exec_python, fingerprint, shell_line, with_log_tail_on_failure, with_script
from components.resources.steps import remote_step, service_container
from components.scripts.node_contract import GuardApi, GuardParams, GuardSpec, params_of

GUARD_CONTAINER = "spark-vllm.guard"  # a dot: no node's container (spark-vllm-<DNS label>) can have it
MARKER_DIR = "/var/lib/spark-vllm-guard"  # the volume, in the guard's containers
MARKER_NAME = "applied.json"
HOST_ROOT = "/host"  # the host's /usr and /etc, read-only
CHECK_SECONDS = 10
READY_TIMEOUT_SECONDS = 90
# with every node's sshPort: never matched
PUBLIC_KEYS = ("vllm.port", "metrics.prometheusPort", "metrics.grafanaPort", "router.port")
API_KEYS = ("vllm.port", "router.port")  # what network.apiSources limits: the edge's port
# Behind the router vllm.port is vLLM's own, on the fabric: only the nodes reach it (the router, Prometheus).
FABRIC_ONLY = "vllm.port"


def guard_spec(cfg: ClusterConfig, node: NodeConfig) -> GuardSpec:
    """What the rules on `node` say: who the peers are, which ports only they reach."""
    index = cfg.nodes.index(node)
    listeners = stack_listeners(cfg, index)
    public = [
        item
        for item in listeners
        if (item.key.endswith(PUBLIC_KEYS) and not (cfg.router.enabled and item.key.endswith(FABRIC_ONLY)))
        or item.key.endswith(".sshPort")
    ]
    guarded = [item for item in listeners if item not in public]
    api = None
    sources = [str(source) for source in cfg.network.api_sources]
    here = on_node(cfg, node.name)
    if sources and [r.own for r in here] == [True] and node.name == cfg.head_node.name and not cfg.router.enabled:
        api = GuardApi(sources=sources, port=cfg.vllm.port)  # a single-model stack's head: its one API server
    elif sources:  # every API server on the node, the router's too
        ports = sorted({item.first for item in public if item.key.endswith(API_KEYS)})
        api = GuardApi(sources=sources, ports=ports) if ports else None
    router_here = cfg.router.enabled and cfg.router.node == node.name
    return GuardSpec(
        peers=sorted(str(other.fabric_address) for other in cfg.nodes if other.name != node.name),
        interface=node.fabric_interface,
        guarded=sorted([item.first, item.last] for item in guarded),
        ephemeral=True,  # NCCL, Gloo and torch listen on ports the kernel picks
        public=sorted({item.first for item in public}),
        api=api,
        # vllm-router on loopback: its admin API answers anyone who connects; the keeper and the edge alone may
        owned=[[cfg.router.inner_port, [ROUTER_USER_ID, EDGE_USER_ID]]] if router_here else None,
    )


def guard_params(cfg: ClusterConfig, node: NodeConfig, action: str) -> dict[str, Any]:
    spec = guard_spec(cfg, node)
    return params_of(
        GuardParams,
        node=node.name,
        action=action,
        spec=spec,
        hash=fingerprint(spec.to_json()),
        host_root=HOST_ROOT,
        marker=f"{MARKER_DIR}/{MARKER_NAME}",
        check_seconds=CHECK_SECONDS,
        timeout_seconds=READY_TIMEOUT_SECONDS,
    )


def host_mounts() -> list[tuple[str, str, bool]]:
    """(source, target, read-only): the host's tools and their config, and the marker volume."""
    return [("/usr", f"{HOST_ROOT}/usr", True), ("/etc", f"{HOST_ROOT}/etc", True)]


def one_off_argv(image_id: str) -> list[str]:
    """`docker run --rm` of guard.py in the node's image, as the guard container runs it."""
    argv = ["docker", "run", "--rm", "-i", "--network", "host", "--cap-add", "NET_ADMIN"]
    for source, target, read_only in host_mounts():
        argv += ["--mount", f"type=bind,source={source},target={target}" + (",readonly" if read_only else "")]
    argv += ["--mount", f"type=volume,source={GUARD_VOLUME},target={MARKER_DIR}"]
    return ["timeout", "--kill-after=10", "120", *argv, "--entrypoint", "python3", image_id, "-"]


def host_command(cfg: ClusterConfig, node: NodeConfig, image_id: str, action: str) -> str:
    program = script_program("node_guard.py", guard_params(cfg, node, action))
    command_line = with_script(shell_line(one_off_argv(image_id)), program)
    if action == "remove":
        # The marker's volume goes with the rules (a container still using it keeps it).
        command_line += "\n" + shell_line(["docker", "volume", "rm", GUARD_VOLUME]) + " >/dev/null 2>&1 || true"
    return command_line


@dataclass(frozen=True)
class NodeGuardArgs:
    config: ClusterConfig
    node: NodeConfig
    image_id: pulumi.Input[str]
    provider: docker.Provider
    connection: command.remote.ConnectionArgs


class NodeGuard(pulumi.ComponentResource):
    ready: command.remote.Command

    def __init__(self, name: str, args: NodeGuardArgs, opts: Optional[pulumi.ResourceOptions] = None):
        super().__init__("spark-vllm:index:NodeGuard", name, None, opts)
        cfg, node = args.config, args.node
        image_id = pulumi.Output.from_input(args.image_id)
        # A change of the rules or the image re-runs the check (an update); only destroy removes.
        host = remote_step(
            f"{name}-guard-host",
            args.connection,
            image_id.apply(lambda image: host_command(cfg, node, image, "check")),
            delete=image_id.apply(lambda image: host_command(cfg, node, image, "remove")),
            parent=self,
        )
        params = guard_params(cfg, node, "run")
        # On the host network (the node's own namespace: its rules). The old one goes before the new one
        # starts; the rules stay meanwhile (only guard-host removes them).
        self.container = service_container(
            f"{name}-guard",
            name=GUARD_CONTAINER,
            image=image_id,
            entrypoints=["python3", "-u", "-c", script_program("node_guard.py", params)],
            capabilities=docker.ContainerCapabilitiesArgs(adds=["NET_ADMIN"]),
            mounts=[
                *(
                    docker.ContainerMountArgs(type="bind", source=source, target=target, read_only=read_only)
                    for source, target, read_only in host_mounts()
                ),
                docker.ContainerMountArgs(type="volume", source=GUARD_VOLUME, target=MARKER_DIR),
            ],
            restart=cfg.container.restart,
            logs=log_options(cfg),
            init=True,
            node=node.name,
            role="guard",
            provider=args.provider,
            parent=self,
            depends_on=[host],
        )
        ready = script_program("node_guard.py", guard_params(cfg, node, "ready"))
        self.ready = remote_step(
            f"{name}-guard-ready",
            args.connection,
            with_log_tail_on_failure(exec_python(GUARD_CONTAINER, READY_TIMEOUT_SECONDS + 30), node, GUARD_CONTAINER),
            stdin=ready,
            triggers=[self.container.id],
            parent=self,
        )
        self.register_outputs({"container_id": self.container.id})
