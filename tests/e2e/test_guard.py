"""network.guard through the real CLI and engine on two simulated nodes.

Each simulated node is a network namespace with a management link (on a bridge this machine sits
on: the management side) and a fabric link. With the guard on, the cluster forms and serves over
the fabric as before, every port anything of the stack listens on outside loopback is sshd's,
vLLM's or guarded, Ray's GCS and raylet ports do not answer from the management side, the rules
come back after what a reboot does to them, and destroy leaves no rule behind.
"""

from __future__ import annotations

import socket
import sys
import time

import pytest

from components.config import load_cluster_config
from components.resources.guard import guard_spec
from tests.e2e.rehearsal import chat, rehearsal_config
from tests.waiting import wait_until

pytestmark = pytest.mark.e2e


def reachable(address: str, port: int, timeout: float = 1.0) -> bool:
    try:
        socket.create_connection((address, port), timeout=timeout).close()
        return True
    except OSError:
        return False


def reachable_from(cluster, node, address: str, port: int) -> bool:
    probe = f"import socket; socket.create_connection(({address!r}, {port}), timeout=1).close()"
    return cluster.run_in(node, [sys.executable, "-c", probe], check=False).returncode == 0


def raylet_ports(cluster, node) -> set[int]:
    """The ports the node's raylet listens on (Ray picks them): its node manager and object manager."""
    out = cluster.run_in(node, ["ss", "-Hltnp"]).stdout
    return {int(line.split()[3].rsplit(":", 1)[1]) for line in out.splitlines() if '"raylet"' in line}


def listeners(cluster, node, protocol: str = "t") -> set[tuple[str, int]]:
    """(address, port) of every TCP (`t`) or UDP (`u`) listener in the node's network namespace."""
    out = cluster.run_in(node, ["ss", f"-Hl{protocol}n"]).stdout
    found = set()
    for line in out.splitlines():
        local = line.split()[3]
        address, port = local.rsplit(":", 1)
        found.add((address.strip("[]"), int(port)))
    return found


def table(cluster, node) -> str:
    result = cluster.run_in(node, ["nft", "list", "table", "inet", "spark_vllm_guard"], check=False)
    return result.stdout if result.returncode == 0 else ""


def ephemeral(cluster, node) -> tuple[int, int]:
    low, high = cluster.run_in(node, ["cat", "/proc/sys/net/ipv4/ip_local_port_range"]).stdout.split()
    return int(low), int(high)


@pytest.fixture(scope="module")
def stack(sim_cluster, image, model_dir, new_stack):
    created = new_stack("guard")
    config, secrets = rehearsal_config(sim_cluster, image.ref, model_dir, network={"guard": True})
    created.configure(config, secrets)
    run = created.up()
    cfg = load_cluster_config({**config, "apiKey": secrets["apiKey"]})
    return {"stack": created, "run": run, "config": cfg, "secrets": secrets}


def test_the_cluster_forms_over_the_fabric_and_serves_with_the_guard_on(sim_cluster, stack):
    outputs = stack["run"].outputs
    assert chat(outputs["endpoint"], stack["secrets"]["apiKey"], outputs["servedModelName"])
    for node in sim_cluster.nodes:
        rules = table(sim_cluster, node)
        assert "tcp dport @guarded drop" in rules, node.name
        peer = next(other for other in sim_cluster.nodes if other is not node)
        assert peer.fabric_ip in rules and f'iifname "{node.fabric_interface}"' in rules
    assert "applied (nft)" in stack["run"].output or "in place (nft)" in stack["run"].output


def test_from_the_management_side_ray_does_not_answer_but_ssh_and_the_api_do(sim_cluster, stack):
    head, worker = sim_cluster.nodes
    ray = stack["config"].ray
    assert not reachable(head.mgmt_ip, ray.port)  # the GCS
    for node in (head, worker):
        ports = raylet_ports(sim_cluster, node)
        assert len(ports) >= 2, node.name  # the node manager and the object manager
        for port in ports:
            assert not reachable(node.mgmt_ip, port), (node.name, port)  # the raylet
        assert reachable(node.mgmt_ip, 22), node.name  # SSH is never touched
    assert reachable(head.mgmt_ip, stack["config"].vllm.port)
    # Over the fabric, from the other node, the same ports answer.
    assert reachable_from(sim_cluster, worker, head.fabric_ip, ray.port)
    for port in raylet_ports(sim_cluster, worker):
        assert reachable_from(sim_cluster, head, worker.fabric_ip, port)


def test_every_listener_outside_loopback_is_sshd_vllm_or_guarded(sim_cluster, stack):
    cfg = stack["config"]
    for index, node in enumerate(sim_cluster.nodes):
        spec = guard_spec(cfg, cfg.nodes[index])
        ranges = [tuple(r) for r in spec.guarded] + [ephemeral(sim_cluster, node)]
        found = listeners(sim_cluster, node)
        outside = {(a, p) for a, p in found if not a.startswith("127.") and a != "::1"}
        loose = [(a, p) for a, p in outside if p not in spec.public and not any(lo <= p <= hi for lo, hi in ranges)]
        assert loose == [], f"{node.name}: listeners neither public nor guarded: {loose} (all: {sorted(found)})"
        # UDP too (the rules match it since #58): whatever binds a UDP port outside loopback is in a guarded range
        datagrams = {(a, p) for a, p in listeners(sim_cluster, node, "u") if not a.startswith("127.") and a != "::1"}
        loose = [(a, p) for a, p in datagrams if not any(lo <= p <= hi for lo, hi in ranges)]
        assert loose == [], f"{node.name}: UDP sockets outside the guarded ranges: {loose}"
        assert "udp dport @guarded drop" in table(sim_cluster, node)
        assert raylet_ports(sim_cluster, node) <= {p for _, p in outside}  # Ray's own picks, guarded too
        print(f"{node.name}: {len(outside)} listeners outside loopback: {sorted(outside, key=lambda x: x[1])}")


def test_a_second_preview_changes_nothing(stack):
    assert stack["stack"].preview().changed == {}


STALE_MARKER = """
import json, sys
path = "/var/lib/spark-vllm-guard/applied.json"
marker = json.load(open(path))
marker["boot_id"] = "0" * 8 + marker["boot_id"][8:]  # what a reboot leaves: the boot before's
json.dump(marker, open(path, "w"))
"""


def held_back_guard(cluster, node) -> str:
    """What a reboot leaves the guard's volume (a marker of the boot before), with the guard's container not
    started again by Docker, so that what waits for it can be seen waiting: its restart policy, to put back."""
    policy = cluster.docker(node, "inspect", "-f", "{{.HostConfig.RestartPolicy.Name}}", "spark-vllm.guard")
    cluster.docker(node, "update", "--restart=no", "spark-vllm.guard")
    cluster.docker(node, "exec", "spark-vllm.guard", "python3", "-c", STALE_MARKER)
    return policy.stdout.strip()


def let_the_guard_go(cluster, node, policy: str) -> None:
    cluster.docker(node, "update", f"--restart={policy}", "spark-vllm.guard")
    cluster.docker(node, "start", "spark-vllm.guard")


def test_after_a_reboot_of_a_worker_nothing_listens_before_the_rules_and_it_serves_again(sim_cluster, stack):
    worker = sim_cluster.nodes[1]
    # A reboot: the kernel's rules are gone, the daemon and its containers go and come back, the guard's marker
    # names the boot before. The guard checks its rules every 10 s and would put them back under the probe below:
    # it is paused first (frozen, as a node going down is), and the daemon's stop ends it paused. Docker does not
    # start it again until the test lets it (#58: nothing that listens may start before it).
    policy = held_back_guard(sim_cluster, worker)
    sim_cluster.docker(worker, "pause", "spark-vllm.guard")
    sim_cluster.run_in(worker, ["nft", "delete", "table", "inet", "spark_vllm_guard"])
    raylet = min(raylet_ports(sim_cluster, worker))
    assert reachable(worker.mgmt_ip, raylet)  # what the guard keeps off: open without it
    sim_cluster.stop_dockerd(worker)
    sim_cluster.start_dockerd(worker)
    node_container = f"spark-vllm-{worker.name}"
    wait_until(lambda: "waiting for network.guard's rules" in sim_cluster.docker(worker, "logs", node_container).stdout,
               60, "the worker's supervisor waiting for the guard after its dockerd restarted", every=0.5)  # fmt: skip
    time.sleep(5)  # long enough for Ray to have started, were anything starting it
    assert raylet_ports(sim_cluster, worker) == set() and table(sim_cluster, worker) == ""
    let_the_guard_go(sim_cluster, worker, policy)
    outputs, key = stack["run"].outputs, stack["secrets"]["apiKey"]
    deadline = time.monotonic() + 180
    wait_until(lambda: table(sim_cluster, worker) and raylet_ports(sim_cluster, worker), 180,
               "the worker's guard table and its raylet's ports after its dockerd restarted", every=0.5)  # fmt: skip
    assert "tcp dport @guarded drop" in table(sim_cluster, worker)
    for port in raylet_ports(sim_cluster, worker):
        assert not reachable(worker.mgmt_ip, port), port
    wait_until(lambda: chat(outputs["endpoint"], key, outputs["servedModelName"]),
               max(1.0, deadline - time.monotonic()), "a chat answered again after the worker's restart", every=1,
               errors=(Exception,))  # fmt: skip
    log = sim_cluster.docker(worker, "logs", "spark-vllm.guard").stdout
    assert log.count("applied (nft)") >= 2  # at the deploy, and again when Docker started it


def test_the_edge_waits_for_the_rules_in_this_boot_before_it_listens(sim_cluster, stack):
    """Its own port (edge.metricsPort) is fenced: after a reboot the edge starts only once the guard's rules are
    back (guard_gate.sh). A restart of its container under a marker of the boot before stands for the reboot."""
    head = sim_cluster.nodes[0]
    cfg, outputs, key = stack["config"], stack["run"].outputs, stack["secrets"]["apiKey"]
    policy = held_back_guard(sim_cluster, head)
    sim_cluster.docker(head, "stop", "spark-vllm.guard")  # the rules stay: the guard leaves them when it stops
    sim_cluster.run_in(head, ["nft", "delete", "table", "inet", "spark_vllm_guard"])  # as a reboot leaves them
    sim_cluster.docker(head, "restart", "spark-vllm.edge")
    wait_until(lambda: "waiting for network.guard's rules in this boot" in
               sim_cluster.docker(head, "logs", "spark-vllm.edge").stdout + sim_cluster.docker(head, "logs", "spark-vllm.edge").stderr,
               30, "the edge's gate waiting for the guard", every=0.5)  # fmt: skip
    time.sleep(3)
    ports = {port for _, port in listeners(sim_cluster, head)}
    assert cfg.edge.metrics_port not in ports and cfg.vllm.port not in ports  # nothing of the edge's listens yet
    let_the_guard_go(sim_cluster, head, policy)
    wait_until(lambda: chat(outputs["endpoint"], key, outputs["servedModelName"]), 60,
               "a chat through the edge once the guard's rules are back", every=1, errors=(Exception,))  # fmt: skip
    assert "tcp dport @guarded drop" in table(sim_cluster, head)
    assert not reachable(head.mgmt_ip, cfg.edge.metrics_port)  # it listens on the fabric address, fenced there
    assert reachable_from(sim_cluster, sim_cluster.nodes[1], head.fabric_ip, cfg.edge.metrics_port)


def test_destroy_leaves_no_rule_container_or_volume(sim_cluster, stack):
    stack["stack"].destroy()
    for node in sim_cluster.nodes:
        assert table(sim_cluster, node) == "", node.name
        assert "spark_vllm_guard" not in sim_cluster.run_in(node, ["nft", "list", "tables"]).stdout
        assert sim_cluster.docker(node, "ps", "-aq").stdout.strip() == ""
        volumes = sim_cluster.docker(node, "volume", "ls", "-q").stdout.split()
        assert "spark-vllm-guard" not in volumes, node.name
    assert reachable(sim_cluster.nodes[0].mgmt_ip, 22)
