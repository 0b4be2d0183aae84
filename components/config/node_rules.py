"""The stack config's cross-field rules about the nodes themselves: names, addresses, machines, host keys,
which node a role names, the fabric's addresses, and the parallelism against their GPUs. Registered when
components/config/rules.py imports this module (first: their problems come first in the list)."""

from __future__ import annotations

import ipaddress
from typing import Any

from components.config.errors import problem
from components.config.runner import rule

# --- the nodes ---------------------------------------------------------------------------------------


@rule("nodes[].name")
def unique_names(cfg: Any) -> list[str]:
    problems, seen = [], {}
    for node in cfg.nodes:
        if node.name in seen:
            problems.append(
                problem(f"nodes[{node.index}].name", node.name, f"a unique name (nodes[{seen[node.name]}] has it)")
            )
        else:
            seen[node.name] = node.index
    return problems


@rule("nodes[].fabricAddress")
def unique_fabric_addresses(cfg: Any) -> list[str]:
    problems, seen = [], {}
    for node in cfg.nodes:
        address = str(node.fabric_address)
        if address in seen:
            problems.append(
                problem(
                    f"nodes[{node.index}].fabricAddress", address, f"a unique address (nodes[{seen[address]}] has it)"
                )
            )
        else:
            seen[address] = node.index
    return problems


@rule("nodes[].host", "nodes[].sshPort")
def one_node_a_machine(cfg: Any) -> list[str]:
    problems, seen = [], {}
    for node in cfg.nodes:
        machine = (node.host.lower(), node.ssh_port)
        if machine not in seen:
            seen[machine] = node
            continue
        other = seen[machine]
        problems.append(
            problem(
                f"nodes[{node.index}].host",
                node.host,
                f"a machine no other node has: nodes[{other.index}] ({other.label}) is {node.host} port "
                f"{node.ssh_port} too, and two Ray nodes on one machine claim the same GPU and ports "
                "(a machine with several GPUs is one node with gpus: N)",
            )
        )
    return problems


@rule("security.requireHostKeys", "nodes[].hostKey", "nodes[].host", "nodes[].sshPort")
def host_keys_required(cfg: Any) -> list[str]:
    if not cfg.security.require_host_keys:
        return []
    return [
        problem(
            f"nodes[{node.index}].hostKey",
            None,
            "the node's public host key, because security.requireHostKeys is true "
            f"(get it with `ssh-keyscan -p {node.ssh_port} -t ed25519 {node.host}`)",
        )
        for node in cfg.nodes
        if node.host_key is None
    ]


def names_a_node(cfg: Any, key: str, value: Any) -> list[str]:
    """`value` (of `key`) names a node. A name that a node has but got refused is left to that node's message."""
    names = [node.name for node in cfg.nodes]
    if value is None or value in names or value in cfg.failed_values("nodes[].name"):
        return []
    return [problem(key, value, f"one of the node names {sorted(names)}")]


@rule("head", "nodes[].name")
def head_is_a_node(cfg: Any) -> list[str]:
    return names_a_node(cfg, "head", cfg.head)


@rule("fabricCopy.source", "nodes[].name")
def copy_source_is_a_node(cfg: Any) -> list[str]:
    return names_a_node(cfg, "fabricCopy.source", cfg.fabric_copy.source)


@rule("nodes[].fabricAddress")
def fabric_addresses_can_work(cfg: Any) -> list[str]:
    """Fabric addresses that can never carry Ray, NCCL and Gloo between the nodes."""
    problems = []
    several = cfg.node_count > 1
    for node in cfg.nodes:
        address, why = node.fabric_address, None
        if address.is_unspecified:
            why = "0.0.0.0 means every address, not one"
        elif address.is_multicast:
            why = "a multicast address (224.0.0.0/4) is no host's"
        elif address == ipaddress.IPv4Address("255.255.255.255") or address in ipaddress.IPv4Network("240.0.0.0/4"):
            why = "a reserved or broadcast address is no host's"
        elif several and address.is_loopback:
            why = "a loopback address never leaves its own machine, and the other nodes must reach it"
        elif several and address.is_link_local:
            why = (
                "a link-local address (169.254.0.0/16) is what an interface takes when no address was set; "
                "it is not the fabric's"
            )
        if why:
            problems.append(
                problem(
                    f"nodes[{node.index}].fabricAddress",
                    str(address),
                    f"the node's address on the RoCE/InfiniBand link (e.g. 192.168.100.10): {why}",
                )
            )
    return problems


@rule("network.manage", "network.prefixLength", "nodes[].fabricAddress")
def managed_fabric_is_one_subnet(cfg: Any) -> list[str]:
    """With network.manage, addresses that the netplan it writes would not put on one subnet."""
    if cfg.node_count < 2 or not cfg.network.manage:
        return []
    prefix, problems = cfg.network.prefix_length, []
    subnets: dict[ipaddress.IPv4Network, list[str]] = {}
    for node in cfg.nodes:
        subnet = ipaddress.IPv4Network(f"{node.fabric_address}/{prefix}", strict=False)
        subnets.setdefault(subnet, []).append(node.label)
        if prefix <= 30 and node.fabric_address in (subnet.network_address, subnet.broadcast_address):
            kind = "network" if node.fabric_address == subnet.network_address else "broadcast"
            problems.append(
                problem(
                    f"nodes[{node.index}].fabricAddress",
                    str(node.fabric_address),
                    f"a host address of {subnet}: with network.manage the netplan gives it prefix {prefix}, "
                    f"where it is the {kind} address",
                )
            )
    if len(subnets) > 1:
        listing = "; ".join(f"{subnet}: {', '.join(names)}" for subnet, names in subnets.items())
        problems.append(
            problem(
                "network.prefixLength",
                prefix,
                f"one subnet holding every fabricAddress, because network.manage writes each node's address with "
                f"this prefix and the nodes then reach each other only inside it; at /{prefix} they fall in "
                f"{len(subnets)} ({listing}): change the addresses or the prefix length",
            )
        )
    return problems


@rule("nodes[*].gpus", "tensorParallelSize", "pipelineParallelSize", "executor")
def parallelism_fits_the_gpus(cfg: Any) -> list[str]:
    nodes = cfg.nodes
    if cfg.executor == "mp" and len({node.gpus for node in nodes}) > 1:
        counts = ", ".join(f"{node.label}: {node.gpus}" for node in nodes)
        return [
            problem(
                "nodes[].gpus",
                counts,
                "the same number on every node with executor mp (vLLM runs TP × PP / nodes ranks on each)",
            )
        ]
    total_gpus = sum(node.gpus for node in nodes)
    world = cfg.tensor_parallel_size * cfg.pipeline_parallel_size
    if world == total_gpus:
        return []
    value = f"{cfg.tensor_parallel_size} × {cfg.pipeline_parallel_size} = {world}"
    hint = ""
    if world < total_gpus:
        kept, gpus = 0, 0
        while gpus < world:
            gpus += nodes[kept].gpus
            kept += 1
        hint = f"drop nodes {[node.label for node in nodes[kept:]]}" if gpus == world else ""
    fits = [f"TP {tp} × PP {total_gpus // tp}" for tp in range(1, total_gpus + 1) if total_gpus % tp == 0]
    advice = "; ".join(part for part in (hint, "or use " + " or ".join(fits)) if part)
    return [
        problem(
            "tensorParallelSize × pipelineParallelSize", value, f"the GPUs of the listed nodes ({total_gpus}): {advice}"
        )
    ]
