"""The fabric gate's NCCL test (fabric.bandwidthTest: nccl): what each node's `docker run` of
components/scripts/nccl_bandwidth.py is given, and how the all-reduce's figures are judged beside the
gate's own (components/plan/fabric.py)."""

from __future__ import annotations

import re
from typing import Any

from components.config import ClusterConfig, NodeConfig
from components.plan.container import node_env, node_rank
from components.scripts.node_contract import NcclFacts, NcclParams, params_of

# The NCCL test's default floor for the all-reduce's bus bandwidth, of the slower link's speed: two
# Sparks with both HCAs and MTU 9000 measure 19-24 GB/s (150-190 Gb/s of 200), one HCA about half,
# NCCL's socket fallback a few; NVIDIA's playbooks warn below 21.875 GB/s (175 Gb/s).
NCCL_FLOOR_FRACTION = 0.55
NCCL_MEGABYTES = 256  # per all-reduce: large enough to be bandwidth-bound, as all_reduce_perf's top sizes
NCCL_WARMUP, NCCL_ITERATIONS = 5, 20
NCCL_TIMEOUT_SECONDS = 180  # for every node's test to start (each starts its image) and finish
NCCL_FIGURE = "nccl all-reduce"


def nccl_params(cfg: ClusterConfig, node: NodeConfig) -> dict[str, Any]:
    """PARAMS of nccl_bandwidth.py on `node`: its rank (the head is 0) and the head's rendezvous."""
    return params_of(
        NcclParams,
        node=node.name,
        rank=node_rank(cfg, node),
        world=len(cfg.nodes),
        master_address=str(cfg.head_node.fabric_address),
        port=cfg.fabric.test_port,
        megabytes=NCCL_MEGABYTES,
        warmup=NCCL_WARMUP,
        iterations=NCCL_ITERATIONS,
        timeout_seconds=NCCL_TIMEOUT_SECONDS,
    )


def rdma_in_container(cfg: ClusterConfig, node: NodeConfig) -> bool:
    """Whether a node's containers get the RDMA devices (/dev/infiniband and IPC_LOCK)."""
    return bool(node.rdma_devices) and not cfg.nccl.ib_disable


def nccl_argv(cfg: ClusterConfig, node: NodeConfig, image: str) -> list[str]:
    """`docker run` of the NCCL test in the node's image, as its Ray container runs: every GPU, the
    host's network and IPC, the same ulimits, RDMA devices and NCCL environment; no secret. The
    script comes on stdin; `timeout` ends a client that outlives the script's own watchdog."""
    limits = cfg.container.ulimits
    argv = ["timeout", "--kill-after=10", str(NCCL_TIMEOUT_SECONDS + 60), "docker", "run", "--rm", "-i"]
    argv += ["--gpus", "all", "--network", "host", "--ipc", "host"]
    for name, value in (("memlock", limits.memlock), ("stack", limits.stack), ("nofile", limits.nofile)):
        argv += ["--ulimit", f"{name}={value}:{value}"]
    if cfg.container.privileged:
        argv.append("--privileged")
    if rdma_in_container(cfg, node):
        argv += ["--cap-add", "IPC_LOCK"]
        if not cfg.container.privileged:
            argv += ["--device", "/dev/infiniband:/dev/infiniband"]
    for item in node_env(cfg, node):
        if item.startswith(("NCCL_", "GLOO_", "UCX_")):
            argv += ["-e", item]
    argv += ["--label", "spark-vllm.check=nccl", "--entrypoint", "python3", image, "-"]
    return argv


def nccl_error(error: str) -> str:
    """An NCCL test's error in one line: torch's DistBackendError carries NCCL's own reason after
    "Last error:" (e.g. `Duplicate GPU detected : rank 0 and rank 1 both on CUDA device 60`)."""
    lines = [line.strip() for line in error.splitlines() if line.strip()]
    if "Last error:" in lines and lines.index("Last error:") + 1 < len(lines):
        kind = re.search(r"\b(invalid usage|unhandled system error|remote process exited|internal error)\b", error)
        reason = lines[lines.index("Last error:") + 1]
        return f"NCCL {kind.group(1) if kind else 'error'}: {reason}"
    return lines[0][:300] if lines else "?"


def _nccl_hint(facts: NcclFacts) -> str:
    error = facts.error or ""
    if "No module named" in error and "torch" in error:
        return "the image has no torch: fabric.bandwidthTest: nccl runs in vLLM's image (or set it to tcp)"
    if "no result within" in error or "timed out" in error.lower() or "Timeout" in error:
        return (
            "a node's test did not start, or NCCL hung setting up its channels: every node's test must run at once; "
            "the head's fabric.testPort and NCCL's ports (32768-60999) open between the fabric addresses; "
            "NCCL_SOCKET_IFNAME is the fabric interface"
        )
    warn = [line.split(" WARN ", 1)[-1] for line in facts.log_tail or [] if " WARN " in line]
    if warn and warn[-1] not in error:
        return f"NCCL's last warning: {warn[-1]}"
    return "nccl.debug: INFO shows NCCL's log in vLLM's too; the node's GPU and driver (`nvidia-smi`)"


def judge_nccl(
    cfg: ClusterConfig, facts_by_node: dict[str, NcclFacts], links: dict[str, Any]
) -> tuple[list[str], dict[str, Any]]:
    """(problems, figures) from every node's NCCL test; `links` are the gate's per-node figures (the
    link speeds give the default floor)."""
    problems = []
    world = len(cfg.nodes)
    for node in cfg.nodes:
        facts = facts_by_node[node.name]
        where = f"fabric gate {node.name} (NCCL test)"
        if facts.error is not None:
            problems.append(f"{where}: {nccl_error(facts.error)} — {_nccl_hint(facts)}")
            continue
        if facts.correct is False:
            problems.append(
                f"{where}: the all-reduce summed to the wrong value — a broken transport or GPU: rerun with "
                "nccl.debug: INFO and check `dmesg` for GPU or RDMA errors"
            )
        if facts.network == "Socket" and not cfg.nccl.ib_disable:
            listed = facts.devices.get("Socket")
            found = f" ({listed})" if listed else ""
            problems.append(
                f"{where}: NCCL fell back to TCP sockets{found} instead of RDMA — it found no usable RDMA device in "
                "the container: nodes[].rdmaDevices names the fabric's devices (`ibdev2netdev`; the containers get "
                "/dev/infiniband only then), their driver is loaded (`ibv_devinfo`); or set nccl.ibDisable: true to "
                "accept sockets"
            )
    measured = [facts_by_node[n.name] for n in cfg.nodes if facts_by_node[n.name].seconds is not None]
    figures: dict[str, Any] = {
        "world": world,
        "network": {n.name: facts_by_node[n.name].network for n in cfg.nodes},
        "transports": sorted({t for f in facts_by_node.values() for t in f.transports}),
        "nccl": next((f.nccl for f in facts_by_node.values() if f.nccl), None),
        "seconds": max((f.total_seconds or 0 for f in facts_by_node.values()), default=None),
    }
    if len(measured) != world:
        return problems, figures
    seconds = max(f.seconds for f in measured)  # the slowest rank's: a collective ends with its last
    size = measured[0].bytes
    algorithm = size * 8 / seconds / 1e9
    bus = algorithm * 2 * (world - 1) / world  # nccl-tests' busbw for all-reduce
    speeds = [link.get("speedGbps") for link in links.values() if link.get("speedGbps")]
    floor = cfg.fabric.min_bandwidth_gbps
    if floor is None and speeds:
        floor = round(min(speeds) * NCCL_FLOOR_FRACTION, 3)
    figures.update(busBandwidthGbps=round(bus, 2), algBandwidthGbps=round(algorithm, 2), bytes=size, floorGbps=floor)
    if floor is not None and bus < floor:
        source = (
            "fabric.minBandwidthGbps"
            if cfg.fabric.min_bandwidth_gbps is not None
            else f"{NCCL_FLOOR_FRACTION:.0%} of the link speed"
        )
        networks = ", ".join(f"{name} {net or '?'}" for name, net in figures["network"].items())
        problems.append(
            f"fabric gate (NCCL test): the all-reduce's bus bandwidth across the {world} nodes is {bus:.1f} Gb/s "
            f"({bus / 8:.1f} GB/s), below the floor of {floor:g} Gb/s ({source}); NCCL used: {networks} — both RDMA "
            "twins in rdmaDevices (one alone gives about half), the same MTU (9000) everywhere, the link speed "
            "(`ethtool`), no slower switch port on the path"
        )
    return problems, figures


def with_nccl(gate: dict[str, Any], nccl: dict[str, Any], problems: list[str]) -> dict[str, Any]:
    """The gate's figures with the NCCL test's: its bus bandwidth is the fabric's measured figure."""
    merged = {**gate, "nccl": nccl, "problems": [*(gate.get("problems") or []), *problems]}
    if "busBandwidthGbps" in nccl:
        merged["bandwidthGbps"] = {NCCL_FIGURE: nccl["busBandwidthGbps"]}
        merged["floorGbps"] = nccl.get("floorGbps")
    return merged
