"""The fabric gate: its probe (components/scripts/node_fabric_gate.py) run for real on this machine's
loopback, two "nodes" at once (127.0.0.1 and 127.0.0.2) measuring towards each other, with a fake
RDMA tree; and the judge (components/plan/fabric.py) on the facts it reports, one rule at a time."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from components.config import load_cluster_config as parse_config
from components.plan import fabric
from components.plan.programs import script_program
from components.scripts.node_contract import FabricFacts, NcclFacts
from tests.fake_sysfs import add_device
from tests.harness import FakeCloud
from tests.waiting import free_port

PYTHON = sys.executable
ROOT = Path(__file__).resolve().parents[2]


def _raw():
    return {
        "nodes": [
            {"name": "node-1", "host": "10.0.0.1", "fabricAddress": "10.1.0.1", "fabricInterface": "fab0"},
            {"name": "node-2", "host": "10.0.0.2", "fabricAddress": "10.1.0.2", "fabricInterface": "fab0"},
        ],
        "image": "vllm/vllm-openai:v0.25.0",
        "model": "/models/m",
        "tensorParallelSize": 2,
        "apiKey": "k" * 16,
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


def judged(cfg, facts: dict[str, dict]) -> tuple[list[str], dict]:
    """The judge over facts as the probe prints them (JSON), read through the contract as the gate reads them."""
    return fabric.judge(cfg, {name: FabricFacts.from_json(each) for name, each in facts.items()})


def problems_with(cfg, change) -> list[str]:
    facts = good(cfg)
    change(facts)
    problems, _ = judged(cfg, facts)
    return problems


def test_a_good_fabric_passes_and_its_figures_are_kept():
    cfg = config()
    problems, figures = judged(cfg, good(cfg))
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

    assert any("node-1 never measured towards this node within 30 s (fabric.peerWaitSeconds)" in p
               for p in problems_with(config(), absent))  # fmt: skip
    assert any("within 4.5 s (fabric.peerWaitSeconds)" in p for p in problems_with(config(peerWaitSeconds=4.5), absent))


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
    assert one["bandwidth"]["wait_seconds"] == 30  # fabric.peerWaitSeconds' default
    assert fabric.gate_params(config(peerWaitSeconds=5), cfg.nodes[0])["bandwidth"]["wait_seconds"] == 5
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
def _start(params: dict) -> subprocess.Popen:
    process = subprocess.Popen([PYTHON, "-"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    process.stdin.write(script_program("node_fabric_gate.py", params))
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
    problems, _ = judged(parse_config(_raw()), {"node-1": {**facts, "node": "node-1"}, "node-2": facts})
    assert problems  # judged, not crashed on


# --- the NCCL test (fabric.bandwidthTest: nccl) ----------------------------------------------------
def nccl_facts(cfg, seconds: float = 0.0143, network: str = "IB") -> dict[str, dict]:
    cloud = FakeCloud()
    cloud.nccl_seconds, cloud.nccl_network = seconds, network
    return {node.name: cloud.nccl_facts(fabric.nccl_params(cfg, node)) for node in cfg.nodes}


LINKS = {"node-1": {"speedGbps": 200.0}, "node-2": {"speedGbps": 100.0}}


def nccl_judged(cfg, facts: dict[str, dict], links: dict) -> tuple[list[str], dict]:
    """judge_nccl over what the test prints (JSON), read through the contract as the gate reads it."""
    return fabric.judge_nccl(cfg, {name: NcclFacts.from_json(each) for name, each in facts.items()}, links)


def test_nccl_params_and_the_docker_run_of_the_ray_container_without_its_secrets():
    cfg = config(bandwidthTest="nccl")
    head, worker = cfg.nodes
    assert fabric.nccl_params(cfg, worker) == {
        "node": "node-2", "rank": 1, "world": 2, "master_address": "10.1.0.1", "port": 29660, "megabytes": 256,
        "warmup": 5, "iterations": 20, "timeout_seconds": 180,
    }  # fmt: skip
    argv = fabric.nccl_argv(cfg, head, "sha256:abc")
    assert argv[:8] == ["timeout", "--kill-after=10", "240", "docker", "run", "--rm", "-i", "--gpus"]
    assert argv[-4:] == ["--entrypoint", "python3", "sha256:abc", "-"]
    env = [argv[i + 1] for i, word in enumerate(argv) if word == "-e"]
    assert "NCCL_IB_HCA=rocep1s0f1,roceP2p1s0f1" in env and "NCCL_SOCKET_IFNAME=fab0" in env
    assert not [item for item in env if item.startswith(("VLLM_", "RAY_", "HF_"))]
    assert "/dev/infiniband:/dev/infiniband" in argv and "IPC_LOCK" in argv  # the Ray container's RDMA devices
    # node-2 names no rdmaDevices: like its Ray container, no /dev/infiniband (NCCL's choice shows it)
    assert "/dev/infiniband:/dev/infiniband" not in fabric.nccl_argv(cfg, worker, "sha256:abc")
    assert "--ulimit" in argv and "memlock=-1:-1" in argv


def test_nccl_bus_bandwidth_floor_and_figures():
    cfg = config(bandwidthTest="nccl")
    problems, figures = nccl_judged(cfg, nccl_facts(cfg), LINKS)
    assert problems == []
    assert figures["busBandwidthGbps"] == pytest.approx(150.17, abs=0.01)
    assert figures["floorGbps"] == 55.0  # 55 % of the slower link
    merged = fabric.with_nccl({"checked": True, "links": {}, "problems": []}, figures, problems)
    assert "nccl all-reduce 150.17 Gb/s over IB (floor 55 Gb/s)" in fabric.describe(merged)
    # three nodes: the bus bandwidth is the algorithm bandwidth x 2(n-1)/n, the slowest rank's time
    raw = _raw()
    raw["nodes"].append({"name": "node-3", "host": "10.0.0.3", "fabricAddress": "10.1.0.3", "fabricInterface": "fab0"})
    three = parse_config({**raw, "tensorParallelSize": 3, "fabric": {"bandwidthTest": "nccl"}})
    facts = nccl_facts(three)
    facts["node-3"]["seconds"] = 0.0286
    _, figures = nccl_judged(three, facts, {})
    assert figures["algBandwidthGbps"] == pytest.approx(75.09, abs=0.01)
    assert figures["busBandwidthGbps"] == pytest.approx(100.12, abs=0.01)
    assert figures["floorGbps"] is None  # no link speed known, no floor set: measured, not judged


def test_nccl_problems_name_the_node_and_say_the_fix():
    cfg = config(bandwidthTest="nccl", minBandwidthGbps=175)
    problems, _ = nccl_judged(cfg, nccl_facts(cfg, seconds=0.0286), LINKS)
    assert problems == [
        "fabric gate (NCCL test): the all-reduce's bus bandwidth across the 2 nodes is 75.1 Gb/s (9.4 GB/s), below "
        "the floor of 175 Gb/s (fabric.minBandwidthGbps); NCCL used: node-1 IB, node-2 IB — both RDMA twins in "
        "rdmaDevices (one alone gives about half), the same MTU (9000) everywhere, the link speed (`ethtool`), "
        "no slower switch port on the path"
    ]
    facts = nccl_facts(cfg, network="Socket")
    facts["node-2"] = {"node": "node-2", "error": "no result within 180 s (a peer's test never started, or NCCL hung)"}
    facts["node-1"]["correct"] = False
    problems, figures = nccl_judged(cfg, facts, LINKS)
    assert [p.split(":", 1)[0] for p in problems] == ["fabric gate node-1 (NCCL test)"] * 2 + [
        "fabric gate node-2 (NCCL test)"
    ]
    assert (
        "summed to the wrong value" in problems[0]
        and "fell back to TCP sockets ([0]enp1s0f1np1:192.168.200.12<0>)" in problems[1]
    )
    assert "every node's test must run at once" in problems[2]
    assert "busBandwidthGbps" not in figures  # not every node measured
    # accepted sockets: no fallback problem
    accepted = parse_config({**_raw(), "fabric": {"bandwidthTest": "nccl"}, "nccl": {"ibDisable": True}})
    assert nccl_judged(accepted, nccl_facts(accepted, network="Socket"), LINKS)[0] == []


def test_nccl_config_rules_and_the_rendezvous_port_on_the_head_only():
    from components.config import ConfigError, node_listeners

    with pytest.raises(ConfigError, match=r"fabric.bandwidthTest: 'nccl' — tcp or off with container.gpus: false"):
        parse_config({**_raw(), "fabric": {"bandwidthTest": "nccl"}, "container": {"gpus": False}})
    cfg = config(bandwidthTest="nccl")
    keys = [[listener.key for listener in node_listeners(cfg, index)] for index in (0, 1)]
    assert "fabric.testPort" in keys[0] and "fabric.testPort" not in keys[1]
    assert fabric.gate_params(cfg, cfg.nodes[0])["bandwidth"] is None  # no TCP test beside it


@pytest.mark.skipif(
    __import__("importlib").util.find_spec("torch") is not None, reason="torch is installed here: the GPU lane runs it"
)
def test_the_nccl_script_in_an_image_without_torch_says_so_and_exits_zero():
    cfg = config(bandwidthTest="nccl")
    done = subprocess.run(
        [PYTHON, "-"], input=script_program("nccl_bandwidth.py", fabric.nccl_params(cfg, cfg.nodes[1])),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    facts = json.loads(done.stdout.splitlines()[-1])
    assert facts["error"] == "ModuleNotFoundError: No module named 'torch'" and facts["rank"] == 1
    problems, _ = nccl_judged(cfg, {"node-1": nccl_facts(cfg)["node-1"], "node-2": facts}, LINKS)
    assert problems == [
        "fabric gate node-2 (NCCL test): ModuleNotFoundError: No module named 'torch' — the image has no torch: "
        "fabric.bandwidthTest: nccl runs in vLLM's image (or set it to tcp)"
    ]


def test_an_nccl_error_is_one_line_with_the_reason_nccl_gave():
    """What torch said on the H200 (2026-12-02, tests/gpu/results/2026-12-02/nccl-h200.json) for two
    ranks on one GPU, and a rank that could not import torch."""
    seen = json.loads((ROOT / "tests/gpu/results/2026-12-02/nccl-h200.json").read_text())
    facts = seen["cases"]["two ranks"]["facts"]
    assert fabric.nccl_error(facts["gpu-1"]["error"]) == (
        "NCCL invalid usage: Duplicate GPU detected : rank 0 and rank 1 both on CUDA device 60"
    )
    cfg = config(bandwidthTest="nccl")
    lane = {"exit"}  # the lane records each rank's exit code beside what it printed (tests/gpu/nccl.py)
    renamed = {
        name: {k: v for k, v in facts[gpu].items() if k not in lane}
        for name, gpu in (("node-1", "gpu-1"), ("node-2", "gpu-2"))
    }
    problems, _ = nccl_judged(cfg, renamed, LINKS)
    assert problems[0] == (
        "fabric gate node-1 (NCCL test): NCCL invalid usage: Duplicate GPU detected : rank 0 and rank 1 both on CUDA "
        "device 60 — nccl.debug: INFO shows NCCL's log in vLLM's too; the node's GPU and driver (`nvidia-smi`)"
    )
    assert fabric.nccl_error("ModuleNotFoundError: No module named 'torch'") == (
        "ModuleNotFoundError: No module named 'torch'"
    )
    one = seen["cases"]["one node"]["facts"]["gpu-1"]  # the real run on one GPU: NCCL found no IB there
    assert one["correct"] is True and one["network"] == "Socket" and one["devices"]["Socket"].startswith("[0]eth0:")


def test_the_rendered_nccl_command_runs_in_a_shell_with_the_program_on_stdin(tmp_path):
    """The command line `<node>-fabric-nccl` runs on the host, through bash, with a `docker` that records
    its argv and runs the image's `python3 -` here: every word arrives as rendered, the script on stdin."""
    from components.plan.shell import shell_line, with_script

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "docker").write_text(
        f'#!/bin/sh\nprintf "%s\\n" "$@" > {tmp_path}/argv\nexec {PYTHON} -\n'
    )  # fmt: skip
    (bin_dir / "docker").chmod(0o755)
    raw = _raw()
    raw["nodes"][1]["rdmaDevices"] = ["rocep1s0f1"]
    cfg = parse_config({**raw, "fabric": {"bandwidthTest": "nccl"}})
    node = cfg.nodes[1]
    argv = fabric.nccl_argv(cfg, node, "registry.example/vllm:v0.25.0")
    line = with_script(shell_line(argv), script_program("nccl_bandwidth.py", fabric.nccl_params(cfg, node)))
    done = subprocess.run(
        ["bash", "-c", line], capture_output=True, text=True, timeout=60,
        env={"PATH": f"{bin_dir}:/usr/bin:/bin"},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "argv").read_text().splitlines() == argv[argv.index("docker") + 1 :]
    facts = json.loads(done.stdout.splitlines()[-1])
    assert (facts["node"], facts["rank"], facts["world"]) == ("node-2", 1, 2)
