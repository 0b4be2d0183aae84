"""The stand-in's Ray executor: what vLLM's Ray backend does to the cluster, without a model.

Mirrors ``vllm/v1/executor/ray_utils.py:initialize_ray_cluster`` and
``ray_distributed_executor.py``: join the running cluster, check that
``VLLM_HOST_IP`` is a Ray node, reserve ``[{"GPU": 1}] * world`` (bundle 0
pinned to the driver's node with ``node:<ip>``) in a placement group, start one
GPU actor per bundle, and check the workers' IPs like vLLM does.
``ray`` is imported inside functions only.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time
from dataclasses import dataclass

from . import compile_cache, log
from .args import ServeConfig, StandinError

WHERE_UTILS = "ray_utils.py:323"
WHERE_EXEC = "ray_distributed_executor.py:218"

# What vLLM 0.25's Ray executor (RayExecutorV2, its default: VLLM_USE_RAY_V2_EXECUTOR_BACKEND=1) gives its
# workers of the driver's environment (v1/executor/ray_env_utils.py get_driver_env_vars): all of it but the
# worker-specific names (v1/executor/ray_utils.py WORKER_SPECIFIC_ENV_VARS) and those listed in
# VLLM_CONFIG_ROOT/ray_non_carry_over_env_vars.json (vllm/ray/ray_env.py), applied with setdefault:
# a worker keeps what its node sets, and takes the driver's value for what its node does not.
WORKER_SPECIFIC = frozenset(
    {"VLLM_HOST_IP", "VLLM_HOST_PORT", "VLLM_NIXL_SIDE_CHANNEL_HOST", "LOCAL_RANK", "CUDA_VISIBLE_DEVICES",
     "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"}
)  # fmt: skip
NON_CARRY_OVER_FILE = "ray_non_carry_over_env_vars.json"
# Shown per rank so that rehearsals can see what each node's container provides.
REPORTED_ENV = ("VLLM_HOST_IP", "NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "GLOO_SOCKET_IFNAME", "TP_SOCKET_IFNAME",
                "UCX_NET_DEVICES")  # fmt: skip


def default_route_ip() -> str:
    """The IPv4 address of the default-route interface (what vLLM's get_ip() falls back to).

    Read from /proc/net/route and ``ip -4 -o addr``: no packet is sent.
    Returns ``0.0.0.0`` when there is no default route (vLLM's last resort too).
    """
    try:
        with open("/proc/net/route", encoding="ascii") as f:
            rows = [line.split() for line in f.readlines()[1:]]
        iface = next(r[0] for r in rows if len(r) > 2 and r[1] == "00000000")
        out = subprocess.run(
            ["ip", "-4", "-o", "addr", "show", "dev", iface], capture_output=True, text=True, timeout=5
        ).stdout
        for token_line in out.splitlines():
            parts = token_line.split()
            if "inet" in parts:
                return parts[parts.index("inet") + 1].split("/")[0]
    except (OSError, StopIteration, subprocess.SubprocessError):
        pass
    return "0.0.0.0"


def vllm_host_ip(environ=os.environ) -> str:
    """vLLM's get_ip(): ``VLLM_HOST_IP`` if set, else the default-route address (with vLLM's warning)."""
    ip = environ.get("VLLM_HOST_IP", "").strip()
    if ip:
        return ip
    ip = default_route_ip()
    log.warning(
        "network_utils.py:72",
        "VLLM_HOST_IP is not set; using the default-route address %s. If this is not the address "
        "Ray uses for this node, placement fails. Set VLLM_HOST_IP on every node.",
        ip,
    )
    return ip


def non_carry_over(environ=os.environ) -> set[str]:
    """The names vLLM's config file says not to copy to the workers (none when it is absent)."""
    import json

    root = environ.get("VLLM_CONFIG_ROOT") or os.path.join(
        environ.get("XDG_CONFIG_HOME") or os.path.expanduser("~/.config"), "vllm"
    )
    try:
        with open(os.path.join(root, NON_CARRY_OVER_FILE)) as handle:
            return set(json.load(handle))
    except (OSError, ValueError):
        return set()


def forwarded_env(environ=os.environ) -> dict[str, str]:
    excluded = WORKER_SPECIFIC | non_carry_over(environ)
    return {k: v for k, v in environ.items() if k not in excluded}


@dataclass(frozen=True)
class RankInfo:
    rank: int
    bundle: int
    node_id: str
    node_ip: str  # the address Ray knows the node by
    vllm_ip: str  # what vLLM's get_ip() returns inside the worker
    gpu_ids: tuple
    env: dict


def _worker_class():
    import ray

    @ray.remote(num_gpus=1, num_cpus=0)
    class RayWorkerWrapper:
        """One per GPU rank, like vLLM's RayWorkerWrapper; holds no model, but the GPU Ray gave it
        (the lock of core.py), until the actor ends: Ray ends it once its driver, the engine core, is gone."""

        def __init__(self, utilization: float, driver_env: dict):
            from vllm_standin.core import GpuLock

            for key, value in driver_env.items():
                os.environ.setdefault(key, value)  # the node's own values win

            ids = ray.get_gpu_ids()
            self.gpu = GpuLock(int(float(ids[0])) if ids else 0, utilization)
            self.gpu.acquire()

        def info(self) -> dict:
            ip_env = os.environ.get("VLLM_HOST_IP", "").strip()
            return {
                "node_id": ray.get_runtime_context().get_node_id(),
                "node_ip": ray.util.get_node_ip_address(),
                "vllm_ip": ip_env or default_route_ip(),
                "gpu_ids": tuple(str(g) for g in ray.get_gpu_ids()),
                "env": {k: os.environ.get(k) for k in REPORTED_ENV},
                "pid": os.getpid(),
            }

        def compile(self, rank: int, model: list) -> dict:
            """The worker of `rank` compiles its graph or loads it from its node's torch.compile cache."""
            from vllm_standin.compile_cache import compile_graph

            return {**compile_graph(rank, model), "pid": os.getpid()}

        def ping(self) -> bool:
            return True

    return RayWorkerWrapper


class RayEngine:
    def __init__(self, cfg: ServeConfig, environ=os.environ):
        self.cfg = cfg
        self.environ = environ
        self.pg = None
        self.workers: list = []
        self.ranks: list[RankInfo] = []
        self._lock = threading.Lock()

    # -- start ---------------------------------------------------------------
    def start(self, stop: threading.Event, placement_timeout_s: float) -> list[RankInfo]:
        import ray

        world = self.cfg.world_size
        driver_ip = vllm_host_ip(self.environ)
        address = self.environ.get("RAY_ADDRESS") or "auto"
        log.info(WHERE_UTILS, "Connecting to existing Ray cluster at address: %s", address)
        try:
            ray.init(
                address="auto",
                ignore_reinit_error=True,
                logging_level="WARNING",
                log_to_driver=False,
                namespace="vllm-standin",
            )
        except Exception as e:  # ConnectionError and friends
            raise StandinError(f"Failed to connect to the Ray cluster (address={address}): {e}") from e

        alive = [n for n in ray.nodes() if n.get("Alive")]
        desc = ", ".join(f"{n['NodeManagerAddress']} (GPU {n.get('Resources', {}).get('GPU', 0):g})" for n in alive)
        log.info(WHERE_UTILS, "Ray cluster has %d alive node(s): %s", len(alive), desc)
        node_ips = {n["NodeManagerAddress"] for n in alive}
        request = {"GPU": 1.0, f"node:{driver_ip}": 0.001}
        if driver_ip not in node_ips:
            raise StandinError(
                f"No available node types can fulfill resource request {request}. "
                "Add suitable node types to this cluster to resolve this issue. "
                f"(VLLM_HOST_IP={driver_ip} is not the address of any alive Ray node: {sorted(node_ips)}; "
                "make sure the IP addresses used by the Ray cluster are the same as VLLM_HOST_IP on each node.)"
            )
        current_id = ray.get_runtime_context().get_node_id()
        current = next((n for n in alive if n.get("NodeID") == current_id), None)
        if current is not None:
            if current["NodeManagerAddress"] != driver_ip:
                log.warning(
                    WHERE_UTILS,
                    "VLLM_HOST_IP=%s differs from the address %s Ray uses for this node",
                    driver_ip,
                    current["NodeManagerAddress"],
                )
            if current.get("Resources", {}).get("GPU", 0) < 1:
                raise StandinError(
                    f"Current node has no GPU available. current_node_resource={current.get('Resources')}. "
                    f"vLLM engine cannot start without GPU. Make sure you have at least 1 GPU available in a "
                    f"node current_node_id={current_id!r} current_ip={driver_ip!r}."
                )

        self._place(world, driver_ip, stop, placement_timeout_s)
        if stop.is_set():
            return []
        self._start_workers(world, driver_ip)
        return self.ranks

    def _place(self, world: int, driver_ip: str, stop: threading.Event, timeout_s: float) -> None:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group

        specs = [{"GPU": 1.0} for _ in range(world)]
        specs[0][f"node:{driver_ip}"] = 0.001
        log.info(WHERE_UTILS, "Creating a placement group of %d GPU bundle(s): %s", world, specs)
        self.pg = placement_group(specs, strategy="PACK")
        ready = self.pg.ready()
        start = time.monotonic()
        next_note = start + 10
        while True:
            done, _ = ray.wait([ready], timeout=1.0)
            if done:
                break
            if stop.is_set():
                return
            now = time.monotonic()
            if now - start >= timeout_s:
                remove_placement_group(self.pg)
                self.pg = None
                raise StandinError(
                    f"Cannot provide a placement group of placement_group_specs={specs} within "
                    f"{timeout_s:g} seconds. See `ray status` and `ray list nodes` to make sure the "
                    "cluster has enough resources."
                )
            if now >= next_note:
                next_note = now + 10
                log.info(
                    WHERE_UTILS,
                    "Waiting for creating a placement group of specs for %d seconds. specs=%s. Check "
                    "`ray status` and `ray list nodes` to see if you have enough resources, and make sure "
                    "the IP addresses used by ray cluster are the same as VLLM_HOST_IP environment "
                    "variable specified in each node if you are running on a multi-node.",
                    int(now - start),
                    specs,
                )
        log.info(WHERE_UTILS, "Placement group of %d GPU bundle(s) is ready", world)

    def _start_workers(self, world: int, driver_ip: str) -> None:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        cls = _worker_class()
        env = forwarded_env(self.environ)
        for i in range(world):
            strategy = PlacementGroupSchedulingStrategy(placement_group=self.pg, placement_group_bundle_index=i)
            self.workers.append(cls.options(scheduling_strategy=strategy).remote(self.cfg.gpu_memory_utilization, env))
        try:
            infos = ray.get([w.info.remote() for w in self.workers], timeout=120)
        except Exception as e:
            raise StandinError(f"RayWorkerWrapper actors failed to start: {type(e).__name__}: {e}") from e

        order = sorted(range(world), key=lambda i: (infos[i]["vllm_ip"] != driver_ip, infos[i]["vllm_ip"], i))
        self.workers = [self.workers[i] for i in order]
        self.ranks = [
            RankInfo(
                rank=r,
                bundle=i,
                node_id=infos[i]["node_id"],
                node_ip=infos[i]["node_ip"],
                vllm_ip=infos[i]["vllm_ip"],
                gpu_ids=infos[i]["gpu_ids"],
                env=infos[i]["env"],
            )
            for r, i in enumerate(order)
        ]
        log.info(
            WHERE_EXEC, "worker ranks on nodes: %s", ", ".join(f"rank {r.rank} -> {r.node_ip}" for r in self.ranks)
        )
        for r in self.ranks:
            log.info(
                WHERE_EXEC,
                "rank %d: node_id=%s node_ip=%s vllm_ip=%s gpu_ids=%s env=%s",
                r.rank,
                r.node_id[:12],
                r.node_ip,
                r.vllm_ip,
                list(r.gpu_ids),
                r.env,
            )

        model = compile_cache.model_factors(self.cfg)
        compiled = ray.get(
            [worker.compile.remote(r.rank, model) for worker, r in zip(self.workers, self.ranks, strict=True)]
        )
        for result in compiled:  # as Ray hands a worker's lines to the driver's log (log_to_driver)
            for where, message in compile_cache.compile_lines(result):
                worker = f"\x1b[36m(RayWorkerProc pid={result['pid']})\x1b[0m (Worker pid={result['pid']}) "
                log.log("INFO", where, message, inner=worker)
        node_ids = {r.node_id for r in self.ranks}
        all_ips = {r.vllm_ip for r in self.ranks} | {driver_ip}
        if len(node_ids) != len(all_ips):
            raise StandinError(
                f"Every node should have a unique IP address. Got {len(node_ids)} nodes with node ids "
                f"{sorted(node_ids)} and {len(all_ips)} unique IP addresses {sorted(all_ips)}. Please check "
                "your network configuration. If you set `VLLM_HOST_IP` environment variable, make sure it is "
                "unique for each node."
            )
        if driver_ip not in {r.vllm_ip for r in self.ranks}:
            raise StandinError(
                "Ray does not allocate any GPUs on the driver node. Consider adjusting the Ray placement "
                "group or running the driver on a GPU node."
            )

    # -- while serving ---------------------------------------------------------
    def ping(self, timeout_s: float) -> None:
        """Raises when any worker does not answer within timeout_s."""
        import ray

        ray.get([w.ping.remote() for w in self.workers], timeout=timeout_s)

    @staticmethod
    def is_actor_death(exc: BaseException) -> bool:
        try:
            from ray.exceptions import RayActorError
        except ImportError:  # pragma: no cover
            return False
        return isinstance(exc, RayActorError)

    def shutdown(self) -> None:
        import ray

        with self._lock:
            if self.pg is not None:
                try:
                    from ray.util.placement_group import remove_placement_group

                    remove_placement_group(self.pg)
                except Exception as e:  # noqa: BLE001 - best effort at shutdown
                    log.warning(WHERE_EXEC, "removing the placement group failed: %s", e)
                self.pg = None
            self.workers = []
            try:
                ray.shutdown()
            except Exception as e:  # noqa: BLE001
                log.warning(WHERE_EXEC, "ray.shutdown failed: %s", e)
