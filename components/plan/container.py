"""What a node's container is: its name, rank, environment, its supervisor's parameters and spec, `ray start`,
and the head's wait for the Ray cluster."""

from __future__ import annotations

from typing import Any, Optional

from components.config import ClusterConfig, NodeConfig
from components.plan.endpoint import vllm_url
from components.plan.names import (
    CONTAINER_PREFIX,
    GPU_TURN_DIR_IN_NODE,
    GUARD_MARKER_IN_NODE,
    POLL_SECONDS,
    PROGRESS_SECONDS,
    RUN_DIR,
    VLLM_STOP_GRACE_SECONDS,
)
from components.plan.programs import as_configured
from components.scripts.node_contract import (
    ClusterWaitParams,
    RayReady,
    Recovery,
    Served,
    SupervisorParams,
    Tenancy,
    Watch,
    params_of,
)

LOG_DRIVER = "json-file"  # `docker logs` reads it (the log tails on failure, diagnostics); rotated by log_options


def log_options(cfg: ClusterConfig) -> dict[str, str]:
    """Docker's log options for every container of the stack's: rotated at container.logs.maxSize, maxFiles kept."""
    logs = cfg.container.logs
    return {"max-size": logs.max_size, "max-file": str(logs.max_files)}


def container_name(cfg: ClusterConfig, node: NodeConfig) -> str:
    """A node's container; with deployments, a replica's on that node (spark-vllm-<replica>-<node>)."""
    return f"{CONTAINER_PREFIX}-{cfg.named(node.name)}"


def node_resource(cfg: ClusterConfig, node: NodeConfig, suffix: str) -> str:
    """A resource of `node` in `cfg` (a replica's view: prefixed with the replica's name)."""
    return cfg.named(f"{node.name}-{suffix}")


def node_rank(cfg: ClusterConfig, node: NodeConfig) -> int:
    """The head is rank 0; the workers follow in the order the config lists them."""
    return [cfg.head_node, *cfg.workers].index(node)


def ray_address(cfg: ClusterConfig) -> str:
    return f"{cfg.head_node.fabric_address}:{cfg.ray.port}"


def node_env(cfg: ClusterConfig, node: NodeConfig) -> list[str]:
    """Env of a node's Ray container, as Docker's `KEY=VALUE` list (secrets are added by the caller).

    vLLM forwards VLLM_*/NCCL_*/UCX_* to Ray workers itself but never VLLM_HOST_IP, GLOO_*, TP_* or
    RAY_*, so every node's container carries all of them for its own fabric address.
    """
    interface = node.fabric_interface
    env = {
        "VLLM_HOST_IP": str(node.fabric_address),
        "NCCL_SOCKET_IFNAME": interface,
        "GLOO_SOCKET_IFNAME": interface,
        "TP_SOCKET_IFNAME": interface,
        "UCX_NET_DEVICES": interface,
        "OMPI_MCA_btl_tcp_if_include": interface,
        # The raylet kills workers above 95 % memory; on GB10 CPU and GPU share it, so the monitor
        # would kill vLLM once the weights are loaded.
        "RAY_memory_monitor_refresh_ms": "0",
        "NCCL_IB_DISABLE": "1" if cfg.nccl.ib_disable else "0",
    }
    if node.rdma_devices:
        env["NCCL_IB_HCA"] = ",".join(node.rdma_devices)
    if cfg.nccl.debug:
        env["NCCL_DEBUG"] = cfg.nccl.debug
    if cfg.executor == "ray" and cfg.ray.auth == "token":
        env["RAY_AUTH_MODE"] = "token"
    if cfg.container.hf_endpoint:
        env["HF_ENDPOINT"] = cfg.container.hf_endpoint
    if cfg.downloads_once:
        # The copy source downloaded the repo and modelSync copied it: no node asks the Hub again.
        env["HF_HUB_OFFLINE"] = "1"
    return [f"{key}={value}" for key, value in env.items()]


def supervisor_params(cfg: ClusterConfig, node: NodeConfig) -> dict[str, Any]:
    """What a node's container is, for its supervisor (components/scripts/supervisor.py): the
    container's command. Only what changes the container itself belongs here; what vLLM is (its
    arguments, recovery, the cluster it waits for) comes from the serve step (`supervisor_spec`)."""
    return params_of(
        SupervisorParams,
        node=node.name,
        executor=cfg.executor,
        run_dir=RUN_DIR,
        ray_argv=["ray", *ray_start_args(cfg, node)] if cfg.executor == "ray" else None,
        stop_grace_seconds=VLLM_STOP_GRACE_SECONDS,
        guard_marker=GUARD_MARKER_IN_NODE if cfg.network.guard else None,
        metrics_port=cfg.metrics.node_port,
        gpu_turn_dir=GPU_TURN_DIR_IN_NODE,
    )


def tenancy(cfg: ClusterConfig, co_tenants: list[Any]) -> Optional[Tenancy]:
    """A replica's place on a node it shares with `co_tenants` (other replicas, as placement.co_tenants gives
    them): its name and how long it may hold the node's GPU turn (None: it shares nothing)."""
    if not co_tenants:
        return None
    return Tenancy(replica=cfg.called(), turn_hold_seconds=cfg.vllm.ready_timeout_seconds)


def supervisor_spec(cfg: ClusterConfig, node: NodeConfig, shared: Optional[Tenancy] = None) -> Served:
    """The part of vLLM's settings for a node's supervisor besides argv and env (a VllmSpec's); `shared`: its
    tenancy where the node holds other replicas too."""
    is_head = node.name == cfg.head_node.name
    ray_ready = None
    if cfg.executor == "ray" and is_head:
        ray_ready = RayReady(address=ray_address(cfg), nodes=len(cfg.nodes), gpus=cfg.world_size)
    return Served(
        recovery=Recovery(**as_configured(Recovery, cfg.recovery)),
        # What vLLM asks of each GPU (or a GB10's unified memory) at start: the supervisor waits until it is
        # free, where nvidia-smi reads it (none in a container without GPUs: then vLLM's own check decides).
        gpu_memory_utilization=cfg.vllm.gpu_memory_utilization,
        health_url=f"{vllm_url(cfg)}/health" if is_head else None,
        ray_ready=ray_ready,
        oom_guard_mib=cfg.memory.os_reserve_gib * 1024 if cfg.memory.oom_guard else None,
        tenancy=shared,
    )


def watch_spec(cfg: ClusterConfig, node: NodeConfig) -> Watch:
    """What the node's supervisor watches while vLLM serves: on the API server's node its progress and its canary;
    on a headless rank (mp across nodes) the API server's /health. With Ray the workers are Ray's actors, which
    Ray ends with the engine that owns them."""
    is_head = node.name == cfg.head_node.name
    return Watch(
        stall_seconds=cfg.vllm.stall_seconds,
        canary_seconds=cfg.vllm.canary_seconds,
        head_health_url=f"{vllm_url(cfg)}/health" if not is_head and cfg.executor == "mp" else None,
    )


def ray_start_args(cfg: ClusterConfig, node: NodeConfig) -> list[str]:
    """`ray start` for one node; the head binds the GCS on its fabric address only."""
    ray = cfg.ray
    common = [
        "start",
        "--block",  # the container lives exactly as long as its Ray node
        f"--node-ip-address={node.fabric_address}",
        f"--num-gpus={node.gpus}",
        "--disable-usage-stats",  # no phone-home; saves seconds at start
        # The worker range explicit (the config checks it); the raylet's, object manager's and agents'
        # ports are Ray's random picks from the ephemeral range, which network.guard fences as a whole.
        f"--min-worker-port={ray.min_worker_port}",
        f"--max-worker-port={ray.max_worker_port}",
    ]
    if ray.metrics_export_port is not None:
        common.append(f"--metrics-export-port={ray.metrics_export_port}")
    if node.name != cfg.head_node.name:
        return [*common, f"--address={ray_address(cfg)}"]
    dashboard = (
        ["--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={ray.dashboard_port}"]
        if ray.dashboard
        else ["--include-dashboard=false"]
    )
    # No --ray-client-server-port: `ray start` refuses it without the ray[client] extra (vLLM images
    # lack it); with the extra the client server takes Ray's fixed 10001, which the config knows.
    return [*common, "--head", f"--port={ray.port}", *dashboard]


def cluster_wait_params(cfg: ClusterConfig) -> dict[str, Any]:
    """ray_join.py on the head: every node alive in Ray and TP × PP GPUs, before vLLM is handed its settings."""
    return params_of(
        ClusterWaitParams,
        node=cfg.head_node.name,
        ray_address=ray_address(cfg),
        expected=[{"name": n.name, "fabric_address": str(n.fabric_address)} for n in cfg.nodes],
        gpus_needed=cfg.world_size,
        timeout_seconds=cfg.ray.join_timeout_seconds,
        poll_seconds=POLL_SECONDS,
        progress_seconds=PROGRESS_SECONDS,
    )
