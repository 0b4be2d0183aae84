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


def listeners(cluster, node) -> set[tuple[str, int]]:
    """(address, port) of every TCP listener in the node's network namespace."""
    out = cluster.run_in(node, ["ss", "-Hltn"]).stdout
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
        assert raylet_ports(sim_cluster, node) <= {p for _, p in outside}  # Ray's own picks, guarded too
        print(f"{node.name}: {len(outside)} listeners outside loopback: {sorted(outside, key=lambda x: x[1])}")


def test_a_second_preview_changes_nothing(stack):
    assert stack["stack"].preview().changed == {}


def test_after_a_reboot_of_a_worker_the_rules_come_back_and_it_serves_again(sim_cluster, stack):
    worker = sim_cluster.nodes[1]
    # A reboot: the kernel's rules are gone, the daemon and its containers go and come back. The guard checks its
    # rules every 10 s and would put them back under the probe below: it is paused first (frozen, as a node going
    # down is), and the daemon's stop ends it paused.
    sim_cluster.docker(worker, "pause", "spark-vllm.guard")
    sim_cluster.run_in(worker, ["nft", "delete", "table", "inet", "spark_vllm_guard"])
    raylet = min(raylet_ports(sim_cluster, worker))
    assert reachable(worker.mgmt_ip, raylet)  # what the guard keeps off: open without it
    sim_cluster.stop_dockerd(worker)
    sim_cluster.start_dockerd(worker)
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


def test_destroy_leaves_no_rule_container_or_volume(sim_cluster, stack):
    stack["stack"].destroy()
    for node in sim_cluster.nodes:
        assert table(sim_cluster, node) == "", node.name
        assert "spark_vllm_guard" not in sim_cluster.run_in(node, ["nft", "list", "tables"]).stdout
        assert sim_cluster.docker(node, "ps", "-aq").stdout.strip() == ""
        volumes = sim_cluster.docker(node, "volume", "ls", "-q").stdout.split()
        assert "spark-vllm-guard" not in volumes, node.name
    assert reachable(sim_cluster.nodes[0].mgmt_ip, 22)
