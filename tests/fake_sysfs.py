"""A fake /sys/class/infiniband for the fabric gate's RDMA part (no simulated node has RDMA): the
files the kernel's ib_core shows per device port (state, link_layer, the GID table with each entry's
type and network device), as components/scripts/node_fabric_gate.py reads them."""

from __future__ import annotations

from pathlib import Path

LINK_LOCAL_GID = "fe80:0000:0000:0000:0000:0000:0000:0001"


def mapped_gid(address: str) -> str:
    """The RoCE v2 GID of an IPv4 address, as the kernel writes it."""
    a, b, c, d = (int(octet) for octet in address.split("."))
    return f"0000:0000:0000:0000:0000:ffff:{a:02x}{b:02x}:{c:02x}{d:02x}"


def add_device(
    root: Path, device: str, netdev: str, address: str, kind: str = "RoCE v2", state: str = "4: ACTIVE"
) -> None:
    """`device` port 1 on `netdev`: GID 0 the link-local RoCE v1 one, GID 1 `address`'s of type `kind`."""
    port = root / device / "ports" / "1"
    for sub in ("gids", "gid_attrs/types", "gid_attrs/ndevs"):
        (port / sub).mkdir(parents=True, exist_ok=True)
    (port / "state").write_text(state + "\n")
    (port / "link_layer").write_text("Ethernet\n")
    for index, (gid, gid_kind) in enumerate([(LINK_LOCAL_GID, "IB/RoCE v1"), (mapped_gid(address), kind)]):
        (port / "gids" / str(index)).write_text(gid + "\n")
        (port / "gid_attrs" / "types" / str(index)).write_text(gid_kind + "\n")
        (port / "gid_attrs" / "ndevs" / str(index)).write_text(netdev + "\n")
