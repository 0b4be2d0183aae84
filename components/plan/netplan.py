"""The netplan drop-in for a node's fabric interface, and the command that writes or removes it.

Pure functions: no I/O. `components/scripts/netplan_apply.sh` does the writing on the node.

Only the fabric interface is described. The management link (the one SSH and Pulumi come in on)
is never named here, so a bad fabric setting cannot cut the node off.
"""

from __future__ import annotations

import base64
import ipaddress
import json
import re
from typing import Optional

from components.config import NetworkConfig, NodeConfig

# NVIDIA's connect-two-sparks guide writes /etc/netplan/40-cx7.yaml. We use a file name of our own,
# so `pulumi destroy` removes only what this program wrote and never a file the operator made by hand.
# If 40-cx7.yaml also describes the same interface, netplan merges both: the address lists add up.
NETPLAN_PATH = "/etc/netplan/40-spark-vllm-fabric.yaml"

_INTERFACE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,14}")


def netplan_yaml(interface: str, address: str, prefix_length: int, mtu: Optional[int]) -> str:
    """A netplan v2 drop-in giving `interface` the static `address/prefix_length` (and `mtu`).

    No `renderer` key: the system's default (networkd on DGX OS servers, NetworkManager on
    desktops) keeps handling the interface. Strings are double quoted (JSON is valid YAML), so an
    interface called e.g. `on` or `1e3` stays a string.
    """
    if not _INTERFACE.fullmatch(interface):
        raise ValueError(f"interface {interface!r}: expected a network interface name")
    ip = ipaddress.IPv4Address(address)
    if not 1 <= prefix_length <= 32:
        raise ValueError(f"prefix_length {prefix_length}: expected 1..32")
    if mtu is not None and not 576 <= mtu <= 9216:
        raise ValueError(f"mtu {mtu}: expected 576..9216")
    lines = [
        "# Written by spark-vllm (Pulumi): the fabric interface only. Removed by `pulumi destroy`.",
        "network:",
        "  version: 2",
        "  ethernets:",
        f"    {json.dumps(interface)}:",
        "      dhcp4: false",
        "      addresses:",
        f"        - {json.dumps(f'{ip}/{prefix_length}')}",
    ]
    if mtu is not None:
        lines.append(f"      mtu: {mtu}")
    return "\n".join(lines) + "\n"


def node_netplan_yaml(node: NodeConfig, network: NetworkConfig) -> str:
    """The drop-in for one node from the stack config."""
    return netplan_yaml(node.fabric_interface, str(node.fabric_address), network.prefix_length, network.mtu)


def netplan_apply_argv(content: Optional[str], sudo: bool, path: str = NETPLAN_PATH) -> list[str]:
    """`env … bash -s` running components/scripts/netplan_apply.sh (fed on stdin).

    `content` None removes the drop-in. With `sudo`, privileged steps run as `sudo -n`: a missing
    NOPASSWD rule fails at once instead of waiting for a password nobody can type.
    """
    action = "remove" if content is None else "apply"
    encoded = base64.b64encode((content or "").encode()).decode()
    return [
        "env",
        f"NETPLAN_PATH={path}",
        f"CONTENT_B64={encoded}",
        f"SUDO={'sudo -n' if sudo else ''}",
        f"ACTION={action}",
        "bash",
        "-s",
    ]
