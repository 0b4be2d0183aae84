"""network.guard: the rules the config leads to, and components/scripts/node_guard.py run for real with
nft and with iptables in network namespaces: a peer on the fabric gets through, the management side
does not, SSH and the API stay open, the rules come back when flushed, stay when the guard stops,
and go when removed."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from components.config import load_cluster_config
from components.plan.programs import script, script_program
from components.resources import guard
from tests.unit.test_config import config
from tests.waiting import wait_for

IP = shutil.which("ip")

# --- what the rules say, from the config ----------------------------------------------------------


def test_the_head_guards_every_ray_port_and_leaves_ssh_and_the_api_alone():
    cfg = load_cluster_config(config(network={"guard": True}))
    spec = guard.guard_spec(cfg, cfg.nodes[0])
    assert spec.peers == ["10.9.0.2"] and spec.interface == "enp1s0f1np1"
    assert spec.guarded == [
        [6379, 6379],
        [8265, 8265],
        [10001, 10001],
        [10002, 19999],
        [29002, 29002],
        [29003, 29003],
        [29660, 29660],
        [32768, 60999],
    ]  # fmt: skip  (29002: vLLM behind the edge; 29003: the edge's own port; 29660: the fabric gate's test)
    assert spec.public == [22, 8000] and spec.ephemeral is True and spec.api is None


def test_a_worker_guards_its_own_ray_ports_and_the_depot_is_guarded_on_the_source():
    cfg = load_cluster_config(config(network={"guard": True}, imageTransfer={"method": "copy"}))
    worker = guard.guard_spec(cfg, cfg.nodes[1])
    assert worker.peers == ["10.9.0.1"] and worker.public == [22]
    assert [6379, 6379] not in worker.guarded and [10002, 19999] in worker.guarded
    assert [29650, 29650] in guard.guard_spec(cfg, cfg.nodes[0]).guarded


def test_with_mp_the_master_port_is_guarded_and_ray_has_no_ports():
    cfg = load_cluster_config(config(executor="mp", network={"guard": True}))
    assert guard.guard_spec(cfg, cfg.nodes[0]).guarded == [
        [29002, 29002],
        [29003, 29003],
        [29501, 29501],
        [29660, 29660],
    ]
    assert guard.guard_spec(cfg, cfg.nodes[1]).guarded == [[29660, 29660]]  # the fabric gate's test port


def test_api_sources_limit_the_api_on_the_head_only():
    cfg = load_cluster_config(config(network={"guard": True, "apiSources": ["192.0.2.0/24"]}))
    assert guard.guard_spec(cfg, cfg.nodes[0]).api.to_json() == {"port": 8000, "sources": ["192.0.2.0/24"]}
    assert guard.guard_spec(cfg, cfg.nodes[1]).api is None


def test_on_the_router_node_vllm_routers_port_is_owned_by_the_keeper_and_the_edge_alone():
    raw = config(network={"guard": True}, router={"enabled": True, "node": "spark-01"}, apiKey="sk-" + "0" * 20)
    for key in ("tensorParallelSize", "executor", "vllm"):
        raw.pop(key)
    raw["deployments"] = [{"name": "m", "model": raw.pop("model"), "nodes": ["spark-01"]}]
    cfg = load_cluster_config(raw)
    assert guard.guard_spec(cfg, cfg.nodes[0]).owned == [[cfg.router.inner_port, [0, 99]]]
    assert guard.guard_spec(cfg, cfg.nodes[1]).owned is None
    assert "owned" not in guard.guard_spec(cfg, cfg.nodes[1]).to_json()  # no router: the spec (and hash) as before


def test_api_sources_without_the_guard_are_a_config_problem():
    from components.config import ConfigError

    with pytest.raises(ConfigError) as caught:
        load_cluster_config(config(network={"apiSources": ["192.0.2.0/24"]}))
    assert caught.value.problems == [
        "network.apiSources: ['192.0.2.0/24'] — network.guard: true beside it (the guard enforces it)"
    ]


def test_the_one_off_runs_keep_to_the_hosts_tools_and_the_marker_volume():
    cfg = load_cluster_config(config(network={"guard": True}))
    line = guard.host_command(cfg, cfg.nodes[0], "sha256:" + "ab" * 32, "remove")
    assert line.startswith("timeout --kill-after=10 120 docker run --rm -i --network host --cap-add NET_ADMIN ")
    assert "type=bind,source=/usr,target=/host/usr,readonly" in line and "--privileged" not in line
    assert line.rstrip().endswith("docker volume rm spark-vllm-guard >/dev/null 2>&1 || true")


# --- guard.py for real -------------------------------------------------------------------------------

needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or IP is None, reason="needs root and iproute2 to create network namespaces"
)
NODE, PEER, OUTSIDER = "10.79.1.1", "10.79.1.2", "10.78.1.2"
PORTS = {"ray": 6379, "api": 8000, "ssh": 2222, "rank": 40000, "other": 7000}


def _ip(*args):
    subprocess.run([IP, *args], check=True, capture_output=True, text=True, timeout=30)


@pytest.fixture
def net():
    """node ⟷ peer on `fab0` (the fabric), node ⟷ outsider on `mgmt0` (the management side)."""
    tag = "gd" + uuid.uuid4().hex[:6]
    names = {role: f"{tag}{role[0]}" for role in ("node", "peer", "outsider")}
    try:
        for ns in names.values():
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        for link, other, mine, theirs in (
            ("fab0", names["peer"], f"{NODE}/24", f"{PEER}/24"),
            ("mgmt0", names["outsider"], "10.78.1.1/24", f"{OUTSIDER}/24"),
        ):
            _ip("link", "add", f"{tag}{link}a", "netns", names["node"], "type", "veth", "peer", "name",
                f"{tag}{link}b", "netns", other)  # fmt: skip
            for ns, end, address in ((names["node"], "a", mine), (other, "b", theirs)):
                _ip("-n", ns, "link", "set", f"{tag}{link}{end}", "name", link)
                _ip("-n", ns, "addr", "add", address, "dev", link)
                _ip("-n", ns, "link", "set", link, "up")
        server = subprocess.Popen(
            [IP, "netns", "exec", names["node"], sys.executable, "-c", LISTEN, json.dumps(list(PORTS.values()))],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert server.stdout.readline().strip() == "listening"
        yield names
    finally:
        if "server" in locals():
            server.kill()
            server.wait()
        for ns in names.values():
            subprocess.run([IP, "netns", "del", ns], capture_output=True, timeout=30)


LISTEN = """
import json, socket, sys, threading
sockets = []
for port in json.loads(sys.argv[1]):
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("0.0.0.0", port)); s.listen()
    sockets.append(s)
def accept(s):
    while True:
        s.accept()[0].close()
def echo(u):
    while True:
        data, peer = u.recvfrom(64)
        u.sendto(data, peer)
for s in sockets:
    threading.Thread(target=accept, args=(s,), daemon=True).start()
for port in json.loads(sys.argv[1]):  # the same ports over UDP: an echo each
    u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.bind(("0.0.0.0", port))
    threading.Thread(target=echo, args=(u,), daemon=True).start()
print("listening", flush=True)
threading.Event().wait()
"""


def reaches(ns, address, port):
    probe = f"import socket; socket.create_connection(({address!r}, {port}), timeout=0.7).close()"
    return subprocess.run([IP, "netns", "exec", ns, sys.executable, "-c", probe], capture_output=True).returncode == 0


def echoes(ns, address, port):
    """Whether a datagram to `address`:`port` from namespace `ns` comes back (the listener echoes it)."""
    probe = (
        "import socket; u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.settimeout(0.7)\n"
        f"u.sendto(b'ping', ({address!r}, {port})); assert u.recvfrom(64)[0] == b'ping'"
    )
    return subprocess.run([IP, "netns", "exec", ns, sys.executable, "-c", probe], capture_output=True).returncode == 0


def params(tmp_path, backend, action, **spec_changes):
    spec = {
        "peers": [PEER],
        "interface": "fab0",
        "guarded": [[6379, 6384], [10002, 19999]],
        "ephemeral": True,
        "public": [2222, 8000],
        "api": None,
        **spec_changes,
    }
    return {
        "node": "node-1",
        "action": action,
        "spec": spec,
        "hash": json.dumps(spec, sort_keys=True),
        "host_root": "/",
        "marker": str(tmp_path / "marker" / "applied.json"),
        "check_seconds": 0.3,
        "timeout_seconds": 10,
        "backend": backend,
    }


def run_guard(ns, p, background=False):
    argv = [IP, "netns", "exec", ns, sys.executable, "-"]
    program = script_program("node_guard.py", p)
    if background:
        process = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        process.stdin.write(program)
        process.stdin.close()
        process.stdin = None  # given whole; communicate() must not flush it
        return process
    return subprocess.run(argv, input=program, capture_output=True, text=True, timeout=60)


def rules(ns, backend):
    argv = ["nft", "list", "ruleset"] if backend == "nft" else ["iptables-save"]
    text = subprocess.run([IP, "netns", "exec", ns, *argv], capture_output=True, text=True, check=True).stdout
    if backend == "iptables":
        text += subprocess.run(
            [IP, "netns", "exec", ns, "ip6tables-save"], capture_output=True, text=True, check=True
        ).stdout
    return "".join(line for line in text.splitlines(keepends=True) if not line.startswith("#"))  # no dates


BACKENDS = [
    pytest.param("nft", marks=pytest.mark.skipif(shutil.which("nft") is None, reason="nft not installed")),
    pytest.param("iptables", marks=pytest.mark.skipif(shutil.which("iptables-restore") is None, reason="no iptables")),
]


@needs_root
@pytest.mark.parametrize("backend", BACKENDS)
def test_only_the_fabric_peer_reaches_the_guarded_ports(net, tmp_path, backend):
    node, peer, outsider = net["node"], net["peer"], net["outsider"]
    assert all(reaches(outsider, "10.78.1.1", port) for port in PORTS.values())  # open before
    assert all(echoes(outsider, "10.78.1.1", port) for port in PORTS.values())
    assert run_guard(node, params(tmp_path, backend, "check")).returncode == 0
    running = run_guard(node, params(tmp_path, backend, "run"), background=True)
    try:
        assert run_guard(node, params(tmp_path, backend, "ready")).returncode == 0
        marker = json.loads((tmp_path / "marker" / "applied.json").read_text())
        assert marker["backend"] == backend
        # The peer over the fabric: everything. The management side: SSH, the API and what is not ours.
        assert all(reaches(peer, NODE, port) for port in PORTS.values())
        assert not reaches(outsider, "10.78.1.1", PORTS["ray"])
        assert not reaches(outsider, "10.78.1.1", PORTS["rank"])  # the ephemeral range
        assert not reaches(outsider, NODE, PORTS["ray"])  # the fabric address, from the wrong side
        for port in (PORTS["ssh"], PORTS["api"], PORTS["other"]):
            assert reaches(outsider, "10.78.1.1", port), port
        # UDP on the same ports (#58: only TCP was matched): the peer's datagrams answered, the outsider's dropped
        assert echoes(peer, NODE, PORTS["ray"]) and echoes(peer, NODE, PORTS["rank"])
        assert not echoes(outsider, "10.78.1.1", PORTS["ray"]) and not echoes(outsider, "10.78.1.1", PORTS["rank"])
        assert echoes(outsider, "10.78.1.1", PORTS["other"])  # not ours: untouched
        assert reaches(node, NODE, PORTS["ray"]) and reaches(node, "127.0.0.1", PORTS["ray"])  # itself
        # Flushed by some other tool: back within a check.
        if backend == "nft":
            subprocess.run(
                [IP, "netns", "exec", node, "nft", "delete", "table", "inet", "spark_vllm_guard"], check=True
            )
        else:
            subprocess.run([IP, "netns", "exec", node, "iptables", "-D", "INPUT", "-j", "SPARK-VLLM-GUARD"], check=True)
        assert wait_for(lambda: not reaches(outsider, "10.78.1.1", PORTS["ray"]), timeout=10)
        # Emptied rather than removed (the table, the chain and its jump still there): back within a check too.
        if backend == "nft":
            emptied = ["nft", "flush", "chain", "inet", "spark_vllm_guard", "input"]
        else:
            emptied = ["iptables", "-F", "SPARK-VLLM-GUARD"]
        subprocess.run([IP, "netns", "exec", node, *emptied], check=True)
        assert wait_for(lambda: not reaches(outsider, "10.78.1.1", PORTS["ray"]), timeout=10)
    finally:
        running.send_signal(signal.SIGTERM)
        output, _ = running.communicate(timeout=10)
    assert running.returncode == 0
    assert "the rules were gone" in output and "the rules were changed (emptied or edited)" in output
    assert "the rules stay" in output
    assert not reaches(outsider, "10.78.1.1", PORTS["ray"])  # stopping the guard opens nothing

    # Started again (a restart, a reboot's second start): applied on top, the same rules.
    before = rules(node, backend)
    again = run_guard(node, params(tmp_path, backend, "run"), background=True)
    try:
        assert "applied" in again.stdout.readline()
        assert rules(node, backend) == before
    finally:
        again.send_signal(signal.SIGTERM)
        again.communicate(timeout=10)

    removed = run_guard(node, params(tmp_path, backend, "remove"))
    assert removed.returncode == 0, removed.stdout + removed.stderr
    assert reaches(outsider, "10.78.1.1", PORTS["ray"])
    assert "spark_vllm_guard" not in rules(node, backend) and "SPARK-VLLM-GUARD" not in rules(node, backend)
    assert not (tmp_path / "marker" / "applied.json").exists()
    assert run_guard(node, params(tmp_path, backend, "remove")).returncode == 0  # safe to repeat


@needs_root
@pytest.mark.parametrize("backend", BACKENDS)
def test_api_sources_keep_everyone_else_off_the_api(net, tmp_path, backend):
    node, peer, outsider = net["node"], net["peer"], net["outsider"]
    p = params(tmp_path, backend, "run", api={"port": PORTS["api"], "sources": ["10.79.1.0/24"]})
    running = run_guard(node, p, background=True)
    try:
        assert run_guard(node, {**p, "action": "ready"}).returncode == 0
        assert reaches(peer, NODE, PORTS["api"]) and reaches(node, "127.0.0.1", PORTS["api"])
        assert not reaches(outsider, "10.78.1.1", PORTS["api"])
        assert reaches(outsider, "10.78.1.1", PORTS["ssh"])
    finally:
        running.send_signal(signal.SIGTERM)
        running.communicate(timeout=10)
        run_guard(node, {**p, "action": "remove"})


def test_a_host_without_nft_or_iptables_fails_naming_the_node(tmp_path):
    root = tmp_path / "host"
    (root / "usr" / "sbin").mkdir(parents=True)
    p = {**params(tmp_path, None, "check"), "host_root": str(root)}
    result = subprocess.run(
        [sys.executable, "-"], input=script_program("node_guard.py", p), capture_output=True, text=True
    )
    assert result.returncode == 1
    assert "[node-1] network.guard: FAILED: the node has neither nft nor iptables-restore" in result.stdout
    assert "sudo apt install nftables" in result.stdout


def test_the_gate_starts_its_program_only_once_the_marker_names_this_boot(tmp_path):
    """guard_gate.sh (#58): what listens outside a node's container waits for the guard's rules in this boot; a
    marker from the boot before (a reboot: the volume outlives it, the kernel's rules do not) is no marker."""
    marker = tmp_path / "applied.json"
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    gate = subprocess.Popen(
        ["bash", "-c", script("guard_gate.sh"), "guard_gate", str(marker), "bash", "-c", "echo started $0", "it"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert "waiting for network.guard's rules in this boot" in gate.stderr.readline()
        marker.write_text(json.dumps({"boot_id": "0" * 8 + boot[8:], "hash": "h"}))  # the boot before
        time.sleep(2.5)
        assert gate.poll() is None
        marker.write_text(json.dumps({"boot_id": boot, "hash": "h", "backend": "nft"}))  # as write_marker has it
        out, err = gate.communicate(timeout=10)
    finally:
        gate.kill()
    assert gate.returncode == 0 and out == "started it\n" and "rules are in place: starting" in err


def test_the_gate_stops_at_once_when_its_container_is_stopped_while_it_waits(tmp_path):
    gate = subprocess.Popen(["bash", "-c", script("guard_gate.sh"), "guard_gate", str(tmp_path / "none"), "true"],
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert "waiting" in gate.stderr.readline()
    started = time.monotonic()
    gate.send_signal(signal.SIGTERM)
    assert gate.wait(timeout=5) == 0 and time.monotonic() - started < 3


def reaches_as(ns, uid, address, port):
    """Whether a socket of user `uid` in namespace `ns` connects to `address`:`port`."""
    probe = (f"import encodings.idna, os, socket; os.setgid({uid}); os.setuid({uid}); "
             f"socket.create_connection(({address!r}, {port}), timeout=0.7).close()")  # fmt: skip
    return subprocess.run([IP, "netns", "exec", ns, sys.executable, "-c", probe], capture_output=True).returncode == 0


@needs_root
@pytest.mark.parametrize("backend", BACKENDS)
def test_an_owned_loopback_port_is_reached_by_its_users_alone(net, tmp_path, backend):
    """vllm-router's port (#64): root (the keeper) and uid 99 (the edge) connect on loopback; another local user
    is refused at once; nothing else changes (the same port from outside, another port on loopback)."""
    node, outsider = net["node"], net["outsider"]
    owned_port = PORTS["other"]
    assert reaches_as(node, 1000, "127.0.0.1", owned_port)  # before: anyone
    p = params(tmp_path, backend, "run", owned=[[owned_port, [0, 99]]])
    running = run_guard(node, p, background=True)
    try:
        assert run_guard(node, {**p, "action": "ready"}).returncode == 0
        assert reaches_as(node, 0, "127.0.0.1", owned_port) and reaches_as(node, 99, "127.0.0.1", owned_port)
        started = time.monotonic()
        assert not reaches_as(node, 1000, "127.0.0.1", owned_port)
        assert time.monotonic() - started < 5  # refused, not left to time out
        assert reaches_as(node, 1000, "127.0.0.1", PORTS["api"])  # another port: untouched
        assert reaches(outsider, "10.78.1.1", owned_port)  # not loopback: untouched
        if backend == "nft":  # edited away: put back within a check
            subprocess.run([IP, "netns", "exec", node, "nft", "flush", "chain", "inet", "spark_vllm_guard", "output"],
                           check=True)  # fmt: skip
        else:
            subprocess.run([IP, "netns", "exec", node, "iptables", "-D", "OUTPUT", "-j", "SPARK-VLLM-GUARD-OUT"],
                           check=True)  # fmt: skip
        assert wait_for(lambda: not reaches_as(node, 1000, "127.0.0.1", owned_port), timeout=10)
    finally:
        running.send_signal(signal.SIGTERM)
        running.communicate(timeout=10)
    removed = run_guard(node, {**p, "action": "remove"})
    assert removed.returncode == 0, removed.stdout + removed.stderr
    assert reaches_as(node, 1000, "127.0.0.1", owned_port)
    assert "SPARK-VLLM-GUARD" not in rules(node, backend) and "spark_vllm_guard" not in rules(node, backend)
