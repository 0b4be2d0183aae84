"""The fabric gate: its probe (components/scripts/fabric_gate.py) run for real on this machine's
loopback, two "nodes" at once (127.0.0.1 and 127.0.0.2) measuring towards each other, with a fake
RDMA tree; and the judge (components/fabric.py) on the facts it reports, one rule at a time."""

from __future__ import annotations

import copy
import json
import socket
import subprocess
import sys

import pytest

from components import fabric
from components.config import load_cluster_config as parse_config
from components.render import script_program
from tests.fake_sysfs import add_device
from tests.harness import FakeCloud

PYTHON = sys.executable


def _raw():
    return {
        "nodes": [
            {"name": "node-1", "host": "10.0.0.1", "fabricAddress": "10.1.0.1", "fabricInterface": "fab0"},
            {"name": "node-2", "host": "10.0.0.2", "fabricAddress": "10.1.0.2", "fabricInterface": "fab0"},
        ],
        "image": "vllm/vllm-openai:v0.25.0",
        "model": "/models/m",
        "tensorParallelSize": 2,
        "apiKey": "k",
    }


def config(**fabric_settings):
    """Two nodes; node-1 names both RoCE twins in rdmaDevices."""
    raw = _raw()
    raw["nodes"][0]["rdmaDevices"] = ["rocep1s0f1", "roceP2p1s0f1"]
    return parse_config({**raw, **({"fabric": fabric_settings} if fabric_settings else {})})


def good(cfg) -> dict[str, dict]:
    """Facts as the probe reports a good fabric (the program tests' FakeCloud.fabric_facts: MTU 9000,
    200 Gb/s, both twins ACTIVE), with node-1 measuring 21 Gb/s to node-2 in a 1.3 s probe."""
    facts = {node.name: FakeCloud().fabric_facts(fabric.gate_params(cfg, node)) for node in cfg.nodes}
    facts["node-1"]["bandwidth"]["node-2"] = {"gbps": 21.0}
    for node in facts.values():
        node["seconds"] = 1.3
    return facts


def problems_with(cfg, change) -> list[str]:
    facts = good(cfg)
    change(facts)
    problems, _ = fabric.judge(cfg, facts)
    return problems


def test_a_good_fabric_passes_and_its_figures_are_kept():
    cfg = config()
    problems, figures = fabric.judge(cfg, good(cfg))
    assert problems == []
    assert figures["bandwidthGbps"] == {"node-1->node-2": 21.0}
    assert figures["floorGbps"] == 10.0  # 5 % of 200 Gb/s
    assert figures["links"]["node-1"] == {"interface": "fab0", "mtu": 9000, "speedGbps": 200.0,
                                          "rdma": ["roceP2p1s0f1:1", "rocep1s0f1:1"], "probeSeconds": 1.3}  # fmt: skip
    assert "node-1->node-2 21 Gb/s (floor 10 Gb/s)" in fabric.describe(figures)


def test_an_mtu_mismatch_names_both_ends_and_a_full_size_packet_that_does_not_pass():
    def change(facts):
        facts["node-2"]["interface"]["mtu"] = 1500
        facts["node-1"]["peers"]["node-2"]["full_size"] = False
        facts["node-1"]["peers"]["node-2"]["full_size_said"] = "1 packets transmitted, 0 received, 100% packet loss"

    problems = problems_with(config(), change)
    assert "the MTU differs between the nodes (node-1 fab0 9000, node-2 fab0 1500)" in problems[0]
    assert "network.mtu: 9000" in problems[0]
    assert any(p.startswith("fabric gate node-1 (fab0): a full-size packet (9000 bytes, don't fragment) does not "
                            "reach node-2 (10.1.0.2)") for p in problems)  # fmt: skip


def test_a_network_mtu_the_interface_does_not_have_says_the_command():
    cfg = parse_config({**json.loads(json.dumps(_raw())), "network": {"mtu": 9000}})
    problems = problems_with(cfg, lambda f: [f[n]["interface"].update(mtu=1500) for n in f])
    assert any("MTU 1500, network.mtu says 9000 — `ip link set dev fab0 mtu 9000`" in p for p in problems)


@pytest.mark.parametrize(
    "link, expected",
    [
        ({"up": False, "operstate": "down", "carrier": None}, "the interface is down — `ip link set dev fab0 up`"),
        ({"up": True, "operstate": "down", "carrier": 0}, "no carrier (no link) — check the cable"),
        ({"addresses": []}, "fabricAddress 10.1.0.2 is not on the interface"),
    ],
)
def test_the_interface_itself(link, expected):
    problems = problems_with(config(), lambda f: f["node-2"]["interface"].update(link))
    assert any(p.startswith("fabric gate node-2 (fab0): " + expected) for p in problems), problems


def test_a_missing_interface_says_where_the_address_is():
    def change(facts):
        facts["node-2"]["interface"] = {"exists": False, "present": ["lo", "enp1s0f0np0"]}
        facts["node-2"]["address_on"] = ["enp1s0f0np0"]

    problems = problems_with(config(), change)
    assert "fabric gate node-2 (fab0): the interface does not exist — 10.1.0.2 is on enp1s0f0np0" in problems[0]


def test_a_slow_or_mismatched_link_speed():
    cfg = config(minLinkSpeedGbps=200)
    problems = problems_with(cfg, lambda f: f["node-2"]["interface"].update(speed_mbps=100000))
    assert any("node-2 (fab0): the link runs at 100 Gb/s, fabric.minLinkSpeedGbps is 200" in p for p in problems)
    assert any("the link speed differs between the nodes (node-1 200 Gb/s, node-2 100 Gb/s)" in p for p in problems)


def test_bandwidth_below_the_floor_and_a_peer_that_never_measured():
    def change(facts):
        facts["node-1"]["bandwidth"]["node-2"] = {"gbps": 0.05}

    problems = problems_with(config(), change)
    assert any("node-1 (fab0): 0.05 Gb/s to node-2 over the fabric, below the floor of 10 Gb/s (5% of the link" in p
               for p in problems)  # fmt: skip
    assert problems_with(config(minBandwidthGbps=25), lambda f: None)[0].endswith(
        "(fabric.minBandwidthGbps) — a throttled or degraded link: `ethtool fab0` (speed, errors), "
        "`tc qdisc show dev fab0`, the cable"
    )

    def absent(facts):
        facts["node-1"]["bandwidth"] = {}
        facts["node-2"]["served"], facts["node-2"]["not_served"] = [], ["node-1"]

    assert any("node-1 never measured towards this node within 30 s" in p for p in problems_with(config(), absent))


def test_reachability_over_the_fabric_only():
    def management(facts):
        facts["node-1"]["peers"]["node-2"]["route_dev"] = "enP7s7"

    assert (
        "the route to node-2 (10.1.0.2) goes through enP7s7, not the fabric" in problems_with(config(), management)[0]
    )

    def silent(facts):
        facts["node-2"]["peers"]["node-1"]["reach"] = False

    assert "node-1 (10.1.0.1) does not answer a ping over the fabric" in problems_with(config(), silent)[0]


def test_rdma_devices_named_present_active_on_the_fabric_with_a_rocev2_gid():
    def missing(facts):
        facts["node-1"]["rdma"] = facts["node-1"]["rdma"][:1]

    assert problems_with(config(), missing) == [
        "fabric gate node-1 (fab0): RDMA device roceP2p1s0f1 (nodes[].rdmaDevices) does not exist (present: "
        "rocep1s0f1 on fab0) — set rdmaDevices to the devices `ibdev2netdev` lists for the fabric"
    ]

    def down(facts):
        facts["node-1"]["rdma"][0]["state"] = "DOWN"

    assert "RDMA device rocep1s0f1 port 1 is DOWN, not ACTIVE" in problems_with(config(), down)[0]

    def no_gid(facts):
        facts["node-2"]["rdma"][0]["rocev2_gid_index"] = None

    assert "node-2 (fab0): rocep1s0f1 has no RoCE v2 GID for 10.1.0.2" in problems_with(config(), no_gid)[0]

    def none(facts):
        facts["node-2"]["rdma"] = []

    assert (
        "no RDMA device sits on the interface (present: none), so NCCL would fall back to TCP sockets"
        in (problems_with(config(), none)[0])
    )
    sockets = parse_config({**_raw(), "nccl": {"ibDisable": True}})
    assert problems_with(sockets, none) == []  # NCCL over sockets by choice: RDMA is not looked at


def test_a_twin_left_out_of_rdma_devices_is_half_the_bandwidth():
    raw = _raw()
    raw["nodes"][0]["rdmaDevices"] = ["rocep1s0f1"]
    problems = problems_with(parse_config(raw), lambda f: None)
    assert problems == [
        "fabric gate node-1 (fab0): roceP2p1s0f1 (the twin of rocep1s0f1, on enP2p1s0f1np1) is ACTIVE but not in "
        "rdmaDevices: one twin alone gives about half the bandwidth — add it to rdmaDevices"
    ]


def test_rdma_devices_that_name_none_of_the_fabric_ones():
    raw = _raw()
    raw["nodes"][1]["rdmaDevices"] = ["roceP2p1s0f1"]
    problems = problems_with(parse_config(raw), lambda f: None)
    assert (
        "rdmaDevices ['roceP2p1s0f1'] names none of the interface's RDMA devices (rocep1s0f1) — add rocep1s0f1"
        in (problems[0])
    )


def test_gate_params_measure_each_pair_once_and_a_ring_above_four_nodes():
    cfg = config()
    one, two = (fabric.gate_params(cfg, node) for node in cfg.nodes)
    assert one["bandwidth"]["targets"] == ["node-2"] and one["bandwidth"]["expect"] == []
    assert two["bandwidth"]["targets"] == [] and two["bandwidth"]["expect"] == ["node-1"]
    raw = _raw()
    raw["nodes"] = [
        {"name": f"n{i}", "host": f"10.0.0.{i}", "fabricAddress": f"10.1.0.{i}", "fabricInterface": "fab0"}
        for i in range(1, 7)
    ]
    raw["tensorParallelSize"] = 6
    ring = parse_config(raw)
    assert [fabric.gate_params(ring, n)["bandwidth"]["targets"] for n in ring.nodes] == [
        ["n2"],
        ["n3"],
        ["n4"],
        ["n5"],
        ["n6"],
        ["n1"],
    ]
    assert fabric.gate_params(ring, ring.nodes[0])["bandwidth"]["expect"] == ["n6"]
    assert config(bandwidthTest="off").nodes and fabric.gate_params(config(bandwidthTest="off"), cfg.nodes[0])[
        "bandwidth"] is None  # fmt: skip


# --- the probe itself, on loopback ----------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _start(params: dict) -> subprocess.Popen:
    process = subprocess.Popen([PYTHON, "-"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    process.stdin.write(script_program("fabric_gate.py", params))
    process.stdin.close()
    return process


def facts_of(process: subprocess.Popen) -> dict:
    out = process.stdout.read()
    assert process.wait(timeout=60) == 0
    return json.loads(out.splitlines()[-1])


def test_the_probe_measures_between_two_nodes_at_once_and_reads_the_rdma_tree(tmp_path):
    port = free_port()
    root = tmp_path / "infiniband"
    add_device(root, "rocep1s0f1", "lo", "127.0.0.1")
    add_device(root, "mlx5_9", "eth9", "10.0.0.9", state="1: DOWN")
    common = {"interface": "lo", "rdma_root": str(root)}
    bandwidth = {"port": port, "seconds": 0.3, "streams": 2, "wait_seconds": 10}
    one = {**common, "node": "a", "address": "127.0.0.1", "peers": [{"name": "b", "address": "127.0.0.2"}],
           "bandwidth": {**bandwidth, "targets": ["b"], "expect": []}}  # fmt: skip
    two = {**common, "node": "b", "address": "127.0.0.2", "peers": [{"name": "a", "address": "127.0.0.1"}],
           "bandwidth": {**bandwidth, "targets": [], "expect": ["a"]}}  # fmt: skip
    first = _start(one)  # the measuring side first: it waits for the listener to appear
    second = _start(two)
    a, b = facts_of(first), facts_of(second)
    assert a["interface"]["exists"] and a["interface"]["mtu"] == 65536 and "127.0.0.1" in a["interface"]["addresses"]
    assert a["peers"]["b"]["route_dev"] == "lo" and a["peers"]["b"]["reach"] is True
    assert a["peers"]["b"]["full_size"] is True  # 65507 bytes, don't fragment, over lo
    result = a["bandwidth"]["b"]
    assert result["gbps"] > 0.1 and result["streams"] == 2 and result["bytes"] > 0, result
    assert b["served"] == ["a"] and b["not_served"] == []
    assert a["rdma"] == [
        {
            "device": "mlx5_9",
            "port": 1,
            "state": "DOWN",
            "link_layer": "Ethernet",
            "netdev": "eth9",
            "rocev2_gid_index": None,
        },  # fmt: skip
        {
            "device": "rocep1s0f1",
            "port": 1,
            "state": "ACTIVE",
            "link_layer": "Ethernet",
            "netdev": "lo",
            "rocev2_gid_index": 1,
        },  # fmt: skip
    ]
    assert b["rdma"][1]["rocev2_gid_index"] is None  # its GID is 127.0.0.1's, not 127.0.0.2's


def test_the_probe_says_when_a_peer_never_listens(tmp_path):
    params = {"node": "a", "interface": "lo", "address": "127.0.0.1", "rdma_root": str(tmp_path / "none"),
              "peers": [{"name": "b", "address": "127.0.0.3"}],
              "bandwidth": {"port": free_port(), "seconds": 0.2, "streams": 1, "wait_seconds": 1,
                            "targets": ["b"], "expect": []}}  # fmt: skip
    facts = facts_of(_start(copy.deepcopy(params)))
    assert facts["bandwidth"]["b"]["error"].startswith("no listener at 127.0.0.3:")
    assert facts["rdma"] == [] and facts["interface"]["exists"]
    problems, _ = fabric.judge(parse_config(_raw()), {"node-1": {**facts, "node": "node-1"}, "node-2": facts})
    assert problems  # judged, not crashed on
