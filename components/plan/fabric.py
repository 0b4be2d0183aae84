"""The fabric gate: what each node's probe is asked (components/scripts/node_fabric_gate.py) and how the
facts that every node reports are judged, per node and across the nodes.

Pure functions, no Pulumi and no I/O. Every problem is one line naming the node and the interface,
what was found and the fix; `figures` is what the gate measured, kept as a stack output and in the
release record.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, Optional

from components.config import ClusterConfig, NodeConfig
from components.plan.fabric_nccl import (  # the NCCL test's half, where callers have always found it
    NCCL_FIGURE,
    NCCL_FLOOR_FRACTION,
    NCCL_ITERATIONS,
    NCCL_MEGABYTES,
    NCCL_TIMEOUT_SECONDS,
    NCCL_WARMUP,
    judge_nccl,
    nccl_argv,
    nccl_error,
    nccl_params,
    rdma_in_container,
    with_nccl,
)
from components.scripts.node_contract import FabricFacts, FabricGateParams, RdmaPort, params_of

RDMA_ROOT = "/sys/class/infiniband"
STREAMS = 4
ALL_PAIRS_UP_TO = 4  # nodes; above, each node measures towards the next one (a ring covers every port)
DEFAULT_FLOOR_FRACTION = 0.05  # of the slower link's speed, for the TCP test
IP_LINK_UP = "ip link set dev {interface} up"


class FabricGateError(Exception):
    """The fabric is not right on one or more nodes; one line a problem, each with its fix."""


def bandwidth_targets(cfg: ClusterConfig, node: NodeConfig) -> list[str]:
    """The nodes `node` measures towards: every later node with up to ALL_PAIRS_UP_TO nodes (each
    pair once), else the next node in the list (the last one towards the first)."""
    names = [n.name for n in cfg.nodes]
    index = names.index(node.name)
    if len(names) <= ALL_PAIRS_UP_TO:
        return names[index + 1 :]
    return [names[(index + 1) % len(names)]]


def tcp_test(cfg: ClusterConfig) -> bool:
    return cfg.fabric.bandwidth_test == "tcp" and len(cfg.nodes) > 1


def nccl_test(cfg: ClusterConfig) -> bool:
    return cfg.fabric.bandwidth_test == "nccl" and len(cfg.nodes) > 1 and cfg.fabric.gate != "off"


def gate_params(cfg: ClusterConfig, node: NodeConfig) -> dict[str, Any]:
    """PARAMS of node_fabric_gate.py on `node`."""
    bandwidth = None
    if tcp_test(cfg):
        expect = [other.name for other in cfg.nodes if node.name in bandwidth_targets(cfg, other)]
        bandwidth = {
            "port": cfg.fabric.test_port,
            "seconds": cfg.fabric.bandwidth_seconds,
            "streams": STREAMS,
            "targets": bandwidth_targets(cfg, node),
            "expect": expect,
            "wait_seconds": cfg.fabric.peer_wait_seconds,
        }
    return params_of(
        FabricGateParams,
        node=node.name,
        interface=node.fabric_interface,
        address=str(node.fabric_address),
        peers=[{"name": o.name, "address": str(o.fabric_address)} for o in cfg.nodes if o.name != node.name],
        rdma_root=RDMA_ROOT,
        bandwidth=bandwidth,
    )


def twin_key(device: str) -> str:
    """DGX Spark shows each QSFP port as two PCIe functions, `rocep1s0f1` and its twin `roceP2p1s0f1`
    (domain 2): the same name once the domain part is taken out."""
    return re.sub(r"P\d+(?=p\d)", "", device)


def _gbps(mbps: int | None) -> float | None:
    return None if mbps is None else mbps / 1000


def _node_problems(cfg: ClusterConfig, node: NodeConfig, facts: FabricFacts) -> list[str]:
    where = f"fabric gate {node.name} ({node.fabric_interface})"
    interface = node.fabric_interface
    link = facts.interface
    problems = []
    if not link.exists:
        elsewhere = ", ".join(facts.address_on)
        fix = (
            f"{node.fabric_address} is on {elsewhere}: set nodes[].fabricInterface to it"
            if elsewhere
            else f"set nodes[].fabricInterface to one of {', '.join(link.present or []) or 'the interfaces'}"
        )
        return [f"{where}: the interface does not exist — {fix}"]
    down = link.up is False or (link.up is None and link.operstate == "down")
    if down:
        problems.append(
            f"{where}: the interface is down — `{IP_LINK_UP.format(interface=interface)}` (network.manage: true keeps "
            "it up through netplan)"
        )
    elif link.carrier == 0 or link.operstate in ("lowerlayerdown", "notpresent"):
        problems.append(f"{where}: no carrier (no link) — check the cable and that the peer's port is up")
    if str(node.fabric_address) not in link.addresses:
        elsewhere = ", ".join(facts.address_on)
        fix = (
            f"it is on {elsewhere}: set nodes[].fabricInterface to {elsewhere}, or move the address"
            if elsewhere
            else "add it (network.manage: true writes the netplan drop-in) or correct nodes[].fabricAddress"
        )
        problems.append(f"{where}: fabricAddress {node.fabric_address} is not on the interface — {fix}")
    mtu, wanted = link.mtu, cfg.network.mtu
    if wanted is not None and mtu is not None and mtu != wanted:
        problems.append(
            f"{where}: MTU {mtu}, network.mtu says {wanted} — `ip link set dev {interface} mtu {wanted}` "
            f"(network.manage: true writes `mtu: {wanted}` into the netplan drop-in)"
        )
    speed = _gbps(link.speed_mbps)
    floor = cfg.fabric.min_link_speed_gbps
    if floor is not None and (speed is None or speed < floor):
        found = "an unknown speed" if speed is None else f"{speed:g} Gb/s"
        problems.append(
            f"{where}: the link runs at {found}, fabric.minLinkSpeedGbps is {floor} — reseat or replace the cable, "
            f"check both ports (`ethtool {interface}` shows the speed it negotiated)"
        )
    if facts.listen_error and str(node.fabric_address) in link.addresses:
        problems.append(f"{where}: {facts.listen_error} — free fabric.testPort or set it to a free port")
    if not cfg.nccl.ib_disable:
        problems += _rdma_problems(node, facts.rdma, where)
    return problems


def _rdma_problems(node: NodeConfig, ports: list[RdmaPort], where: str) -> list[str]:
    interface, problems = node.fabric_interface, []
    by_device = {p.device: p for p in ports}
    present = ", ".join(f"{p.device} on {p.netdev or '?'}" for p in ports) or "none"
    on_fabric = [p for p in ports if p.netdev == interface]
    for name in node.rdma_devices:
        port = by_device.get(name)
        if port is None:
            problems.append(
                f"{where}: RDMA device {name} (nodes[].rdmaDevices) does not exist (present: {present}) — set "
                "rdmaDevices to the devices `ibdev2netdev` lists for the fabric"
            )
        elif port.state != "ACTIVE":
            problems.append(
                f"{where}: RDMA device {name} port {port.port} is {port.state or 'in no state'}, not "
                f"ACTIVE — its link ({port.netdev or '?'}) must be up with a cable; "
                f"`ibv_devinfo -d {name}` shows it"
            )
    if not on_fabric:
        problems.append(
            f"{where}: no RDMA device sits on the interface (present: {present}), so NCCL would fall back to TCP "
            "sockets (slow) — load the RDMA driver and check `ibdev2netdev`, or set nccl.ibDisable: true to accept "
            "sockets"
        )
        return problems
    fabric_devices = [p.device for p in on_fabric]
    if node.rdma_devices and not set(fabric_devices) & set(node.rdma_devices):
        problems.append(
            f"{where}: rdmaDevices {node.rdma_devices} names none of the interface's RDMA devices "
            f"({', '.join(fabric_devices)}) — add {fabric_devices[0]}"
        )
    for port in on_fabric:
        if port.link_layer == "Ethernet" and port.state == "ACTIVE" and port.rocev2_gid_index is None:
            problems.append(
                f"{where}: {port.device} has no RoCE v2 GID for {node.fabric_address} — NCCL would use another GID "
                "type or address: the address must be configured on the interface (the kernel then adds the GID; "
                f"`show_gids {port.device}` lists them) and the device must run RoCE v2"
            )
    if node.rdma_devices:  # with none named NCCL takes every ACTIVE device, the twins too
        for port in ports:
            twin_of = [d for d in fabric_devices if d != port.device and twin_key(d) == twin_key(port.device)]
            if twin_of and port.device not in node.rdma_devices and port.state == "ACTIVE":
                problems.append(
                    f"{where}: {port.device} (the twin of {twin_of[0]}, on {port.netdev or '?'}) is ACTIVE "
                    "but not in rdmaDevices: one twin alone gives about half the bandwidth — add it to rdmaDevices"
                )
    return problems


def floor_gbps(cfg: ClusterConfig, facts_by_node: dict[str, FabricFacts]) -> float | None:
    """The bandwidth test's floor: fabric.minBandwidthGbps, else a fraction of the slowest link."""
    if cfg.fabric.min_bandwidth_gbps is not None:
        return cfg.fabric.min_bandwidth_gbps
    speeds = [f.interface.speed_mbps for f in facts_by_node.values()]
    known = [s for s in speeds if s]
    return round(min(known) / 1000 * DEFAULT_FLOOR_FRACTION, 3) if known else None


def _pair_problems(cfg: ClusterConfig, facts_by_node: dict[str, FabricFacts]) -> list[str]:
    problems = []
    nodes = {n.name: n for n in cfg.nodes}
    mtus = {n.name: facts_by_node[n.name].interface.mtu for n in cfg.nodes}
    known = {name: mtu for name, mtu in mtus.items() if mtu is not None}
    if len(set(known.values())) > 1:
        listing = ", ".join(f"{name} {nodes[name].fabric_interface} {mtu}" for name, mtu in known.items())
        top = max(known.values())
        problems.append(
            f"fabric gate: the MTU differs between the nodes ({listing}) — the same on every node: network.mtu: {top} "
            f"(with network.manage: true), or `ip link set dev IF mtu {top}` on the others"
        )
    speeds = {n.name: facts_by_node[n.name].interface.speed_mbps for n in cfg.nodes}
    known_speeds = {name: s for name, s in speeds.items() if s}
    if len(set(known_speeds.values())) > 1:
        listing = ", ".join(f"{name} {s / 1000:g} Gb/s" for name, s in known_speeds.items())
        slow = min(known_speeds, key=known_speeds.get)
        problems.append(
            f"fabric gate: the link speed differs between the nodes ({listing}) — {slow}'s "
            f"{nodes[slow].fabric_interface} negotiated less: reseat the cable, check the port (`ethtool`)"
        )
    floor = floor_gbps(cfg, facts_by_node)
    for node in cfg.nodes:
        problems += _reach_problems(node, facts_by_node[node.name], nodes, mtus[node.name])
        problems += _bandwidth_problems(cfg, node, facts_by_node, floor)
    return problems


def _reach_problems(node: NodeConfig, facts: FabricFacts, nodes: dict[str, NodeConfig], mtu: Any) -> list[str]:
    """What `node` said of reaching each peer over the fabric: the route, a ping, a full-size packet."""
    where = f"fabric gate {node.name} ({node.fabric_interface})"
    problems = []
    for peer, seen in facts.peers.items():
        other = nodes.get(peer)
        label = f"{peer} ({seen.address})"
        if seen.route_dev is None:
            problems.append(
                f"{where}: no route to {label}: {seen.route_error or '?'} — every fabric address in one "
                "subnet (network.prefixLength) on the fabric interfaces"
            )
        elif seen.route_dev != node.fabric_interface:
            problems.append(
                f"{where}: the route to {label} goes through {seen.route_dev}, not the fabric — every fabric "
                "address in one subnet (network.prefixLength) on the fabric interfaces, and no other interface "
                "in that subnet"
            )
        elif seen.reach is False:
            problems.append(
                f"{where}: {label} does not answer a ping over the fabric — check the cable, that "
                f"{other.fabric_interface if other else 'its interface'} is up on {peer} and its fabricAddress "
                "(or a firewall dropping ICMP)"
            )
        elif seen.full_size is False:
            problems.append(
                f"{where}: a full-size packet ({mtu} bytes, don't fragment) does not reach {label} "
                f"({seen.full_size_said or ''}) — {peer} or a switch port in between has a smaller MTU: set "
                "the same MTU everywhere on the path"
            )
    return problems


def _bandwidth_problems(
    cfg: ClusterConfig, node: NodeConfig, facts_by_node: dict[str, FabricFacts], floor: Optional[float]
) -> list[str]:
    """What `node`'s bandwidth tests said: a failed test, a pair under the floor, a peer that never measured."""
    facts = facts_by_node[node.name]
    where = f"fabric gate {node.name} ({node.fabric_interface})"
    problems = []
    for peer, result in (facts.bandwidth or {}).items():
        if result.skipped is not None:
            continue  # the peer did not answer: said with the reach problems
        if result.error is not None:
            problems.append(
                f"{where}: the bandwidth test to {peer} failed: {result.error} — the gate runs on every node at "
                "once: check that fabric.testPort is free and not filtered on the fabric"
            )
        elif floor is not None and result.gbps < floor:
            source = "fabric.minBandwidthGbps" if cfg.fabric.min_bandwidth_gbps is not None else (
                f"{DEFAULT_FLOOR_FRACTION:.0%} of the link speed")  # fmt: skip
            problems.append(
                f"{where}: {result.gbps:g} Gb/s to {peer} over the fabric, below the floor of {floor:g} Gb/s "
                f"({source}) — a throttled or degraded link: `ethtool {node.fabric_interface}` (speed, errors), "
                f"`tc qdisc show dev {node.fabric_interface}`, the cable"
            )
    for peer in facts.not_served or []:
        if peer not in facts_by_node or node.name not in (facts_by_node[peer].bandwidth or {}):
            problems.append(
                f"{where}: {peer} never measured towards this node within {cfg.fabric.peer_wait_seconds:g} s "
                "(fabric.peerWaitSeconds) — its gate did not run at the same time (pulumi up --parallel below the "
                "node count?)"
            )
    return problems


def judge(cfg: ClusterConfig, facts_by_node: dict[str, FabricFacts]) -> tuple[list[str], dict[str, Any]]:
    """(problems, figures) from every node's probe facts, in config order."""
    problems = []
    for node in cfg.nodes:
        facts = facts_by_node[node.name]
        if facts.error is not None:
            problems.append(f"fabric gate {node.name}: the probe said nothing readable: {facts.error}")
    if problems:
        return problems, {}
    for node in cfg.nodes:
        problems += _node_problems(cfg, node, facts_by_node[node.name])
        if not facts_by_node[node.name].ping and len(cfg.nodes) > 1:
            problems.append(
                f"fabric gate {node.name}: ping (iputils-ping) is not installed — install it: the gate sends a "
                "full-size packet to every peer"
            )
    problems += _pair_problems(cfg, facts_by_node)
    return problems, figures(cfg, facts_by_node)


def figures(cfg: ClusterConfig, facts_by_node: dict[str, FabricFacts]) -> dict[str, Any]:
    """What the gate found, for the stack output and the release record."""
    links = {}
    for node in cfg.nodes:
        facts = facts_by_node[node.name]
        rdma = [p for p in facts.rdma if p.state == "ACTIVE"]
        links[node.name] = {
            "interface": node.fabric_interface,
            "mtu": facts.interface.mtu,
            "speedGbps": _gbps(facts.interface.speed_mbps),
            "rdma": sorted(f"{p.device}:{p.port}" for p in rdma),
            "probeSeconds": facts.seconds,
        }
    bandwidth = {
        f"{node.name}->{peer}": result.gbps
        for node in cfg.nodes
        for peer, result in (facts_by_node[node.name].bandwidth or {}).items()
        if result.gbps is not None
    }
    return {
        "checked": True,
        "gate": cfg.fabric.gate,
        "links": links,
        "bandwidthTest": cfg.fabric.bandwidth_test if len(cfg.nodes) > 1 else "off",
        "bandwidthGbps": bandwidth,
        "floorGbps": floor_gbps(cfg, facts_by_node) if bandwidth else None,
    }


def describe(figures: dict[str, Any]) -> str:
    """One line of the figures, e.g. `node-1 fab0 MTU 9000 200 Gb/s; node-1->node-2 23.5 Gb/s (floor 10)`."""
    if not figures or not figures.get("checked"):
        return "not checked"
    links = "; ".join(
        f"{name} {link.get('interface')} MTU {link.get('mtu')} "
        f"{'?' if link.get('speedGbps') is None else format(link['speedGbps'], 'g')} Gb/s"
        + (f" RDMA {','.join(link['rdma'])}" if link.get("rdma") else "")
        for name, link in (figures.get("links") or {}).items()
    )
    pairs = "; ".join(f"{pair} {gbps:g} Gb/s" for pair, gbps in (figures.get("bandwidthGbps") or {}).items())
    networks = sorted({net for net in ((figures.get("nccl") or {}).get("network") or {}).values() if net})
    if pairs and networks:
        pairs += f" over {'/'.join(networks)}"
    floor = figures.get("floorGbps")
    return links + (f"; {pairs}" if pairs else "") + (f" (floor {floor:g} Gb/s)" if floor is not None else "")


def enforce(cfg: ClusterConfig, problems: list[str], warn: Callable[[str], None]) -> None:
    """fabric.gate enforce: the problems stop the deploy (FabricGateError); warn: they are said."""
    if problems and cfg.fabric.gate == "enforce":
        raise FabricGateError(message(problems))
    if problems:
        warn(message(problems).replace("(fabric.gate: enforce); nothing was started", "(fabric.gate: warn)"))


def message(problems: list[str]) -> str:
    return "the fabric gate found problems (fabric.gate: enforce); nothing was started:\n" + "\n".join(
        f"  - {line}" for line in problems
    )


__all__ = [
    "FabricGateError", "describe", "enforce", "figures", "floor_gbps", "gate_params", "judge", "judge_nccl",
    "message", "nccl_argv", "nccl_error", "nccl_params", "nccl_test", "rdma_in_container", "tcp_test", "twin_key",
    "with_nccl", "NCCL_FIGURE", "NCCL_FLOOR_FRACTION", "NCCL_ITERATIONS", "NCCL_MEGABYTES", "NCCL_TIMEOUT_SECONDS",
    "NCCL_WARMUP",
]  # fmt: skip
