"""The rehearsal's refusals: a bad config, a fabric at fault, a model or image that differs, a node
without its daemon or with another host key — each stopped before any container exists (or, for the
daemon, naming the node), on simulated nodes of this module's own.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
from pathlib import Path

import pytest

from tests.e2e.cli_stack import StackError
from tests.e2e.observe import no_containers
from tests.e2e.rehearsal import rehearsal_config
from tests.fake_sysfs import add_device

pytestmark = pytest.mark.e2e

# node-2 never answers SSH: give up after 3 dials (the default 20 retry for about a minute first), and
# node-1's gate waits 3 s for node-2's, which never runs (30 s by default)
NODE_2_UNREACHABLE = {"ssh": {"dialErrorLimit": 3}, "fabric": {"peerWaitSeconds": 3}}


def test_a_bad_config_creates_nothing_on_any_node(sim_cluster, image, model_dir, new_stack):
    stack = new_stack()
    config, secrets = rehearsal_config(sim_cluster, image.ref, model_dir, tensorParallelSize=3)
    config["nodes"][1]["fabricInterface"] = "fab0;reboot"
    config["image"] = ""  # `pulumi config set image ''`
    config["vllm"] = {**config.get("vllm", {}), "port": 6379}  # Ray's GCS port on the head
    config["nodes"][1]["host"] = config["nodes"][0]["host"]  # one machine listed twice
    stack.configure(config, secrets)
    # --secret forgotten: the CLI itself refuses some values that look like one, `--plaintext` (or an
    # edit of the stack file) gets any value past it; the program refuses every one.
    stack.cli("config", "set", "--plaintext", "hfToken", "hf_plain_in_the_stack_file")
    with pytest.raises(StackError) as caught:
        stack.up()
    message = str(caught.value)
    assert "tensorParallelSize × pipelineParallelSize" in message
    assert "nodes[1].fabricInterface" in message
    assert "image: '' — expected an image reference" in message
    assert "vllm.port: 6379 — a port nothing else on node node-1 listens on" in message
    assert "nodes[1].host: " in message and "a machine no other node has: nodes[0] (node-1)" in message
    assert "hfToken: '[set in plain text]' — a Pulumi secret" in message
    assert "pulumi config rm hfToken` then `pulumi config set --secret hfToken" in message
    assert "hf_plain_in_the_stack_file" not in message
    assert no_containers(sim_cluster)
    assert stack.resource_count() == 0


def test_a_stale_ssh_agent_socket_stops_the_program_before_any_resource(
    sim_cluster, image, model_dir, new_stack, tmp_path
):
    stack = new_stack(agent_socket=tmp_path / "agent-of-a-closed-session.sock")
    config, secrets = rehearsal_config(sim_cluster, image.ref, model_dir)
    stack.configure(config, secrets)
    with pytest.raises(StackError) as caught:
        stack.up()
    assert "no ssh-agent answers there" in str(caught.value) and "unset SSH_AUTH_SOCK" in str(caught.value)
    assert stack.resource_count() == 0


def failed_deploy(cluster, stack, config, secrets) -> str:
    """Deploy expecting a failure; nothing may have started on any node; the message. What the stack holds
    (host keys, checks that passed) is left in its state: nothing of it runs on a node, and the next test
    deploys another stack (a destroy of a failed deploy is test_a_worker_without_its_daemon…'s)."""
    stack.configure(config, secrets)
    with pytest.raises(StackError) as caught:
        stack.up()
    assert no_containers(cluster), "a container started"
    return str(caught.value)


def test_a_fabric_address_not_on_the_node_is_caught_before_any_container(sim_cluster, image, model_dir, new_stack):
    config, secrets = rehearsal_config(sim_cluster, image.ref, model_dir)
    wrong = sim_cluster.nodes[1].fabric_ip.rsplit(".", 1)[0] + ".99"
    config["nodes"][1]["fabricAddress"] = wrong
    message = failed_deploy(sim_cluster, new_stack(), config, secrets)
    assert f"fabric gate node-2 (enp1s0f1np1): fabricAddress {wrong} is not on the interface" in message


@contextlib.contextmanager
def fabric_fault(cluster, node, *commands):
    """Run `commands` (argv lists, `{if}` the node's fabric interface) in the node's namespace; undo with
    the same commands' `undo` counterparts on exit."""
    done = []
    try:
        for do, undo in commands:
            cluster.run_in(node, [part.format(IF=node.fabric_interface) for part in do])
            done.append(undo)
        yield
    finally:
        for undo in reversed(done):
            cluster.run_in(node, [part.format(IF=node.fabric_interface) for part in undo], check=False)


def test_the_fabric_gate_refuses_an_mtu_mismatch_before_any_container(sim_cluster, image, model_dir, new_stack):
    config, secrets = rehearsal_config(sim_cluster, image.ref, model_dir)
    node2 = sim_cluster.nodes[1]
    mtu = (["ip", "link", "set", "dev", "{IF}", "mtu", "1400"], ["ip", "link", "set", "dev", "{IF}", "mtu", "1500"])
    with fabric_fault(sim_cluster, node2, mtu):
        message = failed_deploy(sim_cluster, new_stack(), config, secrets)
    assert "the MTU differs between the nodes (node-1 fab0 1500, node-2 enp1s0f1np1 1400)" in message
    assert "fabric gate node-1 (fab0): a full-size packet (1500 bytes, don't fragment) does not reach node-2" in message


def test_the_fabric_gate_refuses_a_fabric_interface_down_naming_both_nodes(sim_cluster, image, model_dir, new_stack):
    config, secrets = rehearsal_config(sim_cluster, image.ref, model_dir)
    node2 = sim_cluster.nodes[1]
    down = (["ip", "link", "set", "dev", "{IF}", "down"], ["ip", "link", "set", "dev", "{IF}", "up"])
    with fabric_fault(sim_cluster, node2, down):
        message = failed_deploy(sim_cluster, new_stack(), config, secrets)
    assert "fabric gate node-2 (enp1s0f1np1): the interface is down — `ip link set dev enp1s0f1np1 up`" in message
    assert "fabric gate node-1 (fab0): node-2 (" in message and "does not answer a ping over the fabric" in message


def test_the_fabric_gate_refuses_a_throttled_link_with_the_figure(sim_cluster, image, model_dir, new_stack):
    config, secrets = rehearsal_config(sim_cluster, image.ref, model_dir)
    node1 = sim_cluster.nodes[0]  # it measures towards node-2: its sending side is throttled
    tbf = ["tc", "qdisc", "add", "dev", "{IF}", "root", "tbf", "rate", "40mbit", "burst", "64kbit", "latency", "50ms"]
    with fabric_fault(sim_cluster, node1, (tbf, ["tc", "qdisc", "del", "dev", "{IF}", "root"])):
        message = failed_deploy(sim_cluster, new_stack(), config, secrets)
    found = re.search(r"fabric gate node-1 \(fab0\): ([0-9.]+) Gb/s to node-2 over the fabric, below the floor of "
                      r"0.5 Gb/s \(5% of the link speed\)", message)  # fmt: skip
    assert found and float(found.group(1)) < 0.1, message


def test_the_fabric_gate_refuses_a_node_without_an_rdma_device_on_its_fabric(
    sim_cluster, image, model_dir, new_stack, tmp_path
):
    config, secrets = rehearsal_config(sim_cluster, image.ref, model_dir)
    config["nccl"] = {"ibDisable": False}  # NCCL over RDMA: the gate looks at the RDMA devices
    node1, node2 = sim_cluster.nodes
    good, other = tmp_path / "node-1", tmp_path / "node-2"
    add_device(good, "rocep1s0f1", node1.fabric_interface, node1.fabric_ip)  # rdmaDevices [rocep1s0f1], as named
    add_device(other, "mlx5_0", "eth9", "10.0.0.9")  # an RDMA device, but on no fabric interface
    with sim_cluster.node_rdma_view(node1, good), sim_cluster.node_rdma_view(node2, other):
        message = failed_deploy(sim_cluster, new_stack(), config, secrets)
    assert (
        "fabric gate node-2 (enp1s0f1np1): no RDMA device sits on the interface (present: mlx5_0 on eth9), so NCCL "
        "would fall back to TCP sockets (slow)" in message
    )
    assert "fabric gate node-1" not in message  # its device: ACTIVE, on fab0, with the RoCE v2 GID of its address


def test_a_model_too_big_for_the_nodes_memory_stops_the_deploy_with_the_numbers(
    sim_cluster, image, model_dir, tmp_path, new_stack
):
    """Weights of 40 GB (a sparse file) against this machine's memory, which each simulated node
    reports: half of it per node may go to vLLM, 20 GB of weights per node do not fit."""
    big = tmp_path / "models" / "too-big"
    shutil.copytree(model_dir, big)
    with open(big / "model-00001-of-00001.safetensors", "wb") as weights:
        weights.truncate(40 * 10**9)
    config, secrets = rehearsal_config(sim_cluster, image.ref, big)
    message = failed_deploy(sim_cluster, new_stack(), config, secrets)
    assert "the model does not fit (memoryCheck: enforce); nothing was started" in message
    assert "node-1: needs 21.6" in message and "× gpuMemoryUtilization 0.5)" in message
    assert "ways out:" in message


def test_a_node_whose_tag_points_at_other_bytes_stops_every_container(sim_cluster, image, model_dir, new_stack):
    """node-2 has the same tag on a different image (a tag moved, or a local build): caught before Ray."""
    node2 = sim_cluster.nodes[1]
    sim_cluster.docker(node2, "pull", image.ref)
    sim_cluster.docker(node2, "run", "--name", "drift", "--network", "none", image.ref, "touch", "/drift")
    sim_cluster.docker(node2, "commit", "drift", image.ref)
    sim_cluster.docker(node2, "rm", "drift")
    drifted = sim_cluster.docker(node2, "image", "inspect", "-f", "{{.Id}}", image.ref).stdout.strip()
    config, secrets = rehearsal_config(sim_cluster, image.ref, model_dir)
    try:
        message = failed_deploy(sim_cluster, new_stack(), config, secrets)
    finally:
        sim_cluster.docker(node2, "rmi", "-f", image.ref, check=False)  # the next pull restores it
    assert "the image differs between nodes" in message
    assert f"node-2: {drifted}" in message


def test_a_model_missing_on_one_node_stops_every_container(sim_cluster, image, model_dir, tmp_path, new_stack):
    """node-2 has no model directory (the copy never reached it): its preflight names it, nothing starts."""
    empty = tmp_path / "empty"
    empty.mkdir()
    config, secrets = rehearsal_config(sim_cluster, image.ref, model_dir)
    with sim_cluster.node_local_view("node-2", model_dir.parent, empty):
        message = failed_deploy(sim_cluster, new_stack(), config, secrets)
    assert "(node-2-preflight): error:" in message
    assert f"model directory {model_dir} does not exist" in message


def test_a_model_that_differs_on_one_node_stops_every_container(sim_cluster, image, model_dir, tmp_path, new_stack):
    """node-2 holds another revision of the model at the same path: the fingerprints disagree."""
    other = tmp_path / "other-revision"
    shutil.copytree(model_dir, other)
    (other / "config.json").write_text(json.dumps({**json.loads((model_dir / "config.json").read_text()), "rev": 2}))
    config, secrets = rehearsal_config(sim_cluster, image.ref, model_dir)
    with sim_cluster.node_local_view("node-2", model_dir, other):
        message = failed_deploy(sim_cluster, new_stack(), config, secrets)
    assert "model differs: node-2 vs node-1: config.json" in message


@pytest.mark.parametrize("daemon", ["dockerd", "sshd"])
def test_a_worker_without_its_daemon_fails_the_deploy_naming_that_node(
    sim_cluster, image, model_dir, daemon, new_stack
):
    stack = new_stack()
    config, secrets = rehearsal_config(sim_cluster, image.ref, model_dir)
    config.update(NODE_2_UNREACHABLE)
    stack.configure(config, secrets)
    getattr(sim_cluster, f"stop_{daemon}")("node-2")
    try:
        with pytest.raises(StackError) as caught:
            stack.up()
    finally:
        getattr(sim_cluster, f"start_{daemon}")("node-2")
    try:
        assert no_containers(sim_cluster), "a container started"
    finally:
        stack.destroy()
    message, worker = str(caught.value), sim_cluster.nodes[1]
    # the first steps on the node (its image pull; with no sshd its fabric gate as well) name it and the cause
    assert "(node-2-pull): error:" in message or (daemon == "sshd" and "(node-2-fabric-gate): error:" in message)
    if daemon == "dockerd":
        assert "[node-2] cannot reach the Docker daemon at unix://" not in message  # the socket path, not the URL
        assert f"[node-2] cannot reach the Docker daemon at {worker.docker_socket}" in message
    else:  # pulumi-command retries the dial ssh.dialErrorLimit times, then gives up
        assert f"after 3 failed attempts: dial tcp {worker.mgmt_ip}:22: connect: connection refused" in message


def test_a_node_showing_another_host_key_is_refused(sim_cluster, image, model_dir, new_stack):
    config, secrets = rehearsal_config(sim_cluster, image.ref, model_dir)
    config["nodes"][1]["hostKey"] = sim_cluster.nodes[0].host_key  # not node-2's key
    config.update(NODE_2_UNREACHABLE)
    message = failed_deploy(sim_cluster, new_stack(), config, secrets)
    # the first step on the node: pulumi-command retries, then names the mismatch
    assert "error: after 3 failed attempts: ssh: handshake failed: ssh: host key mismatch" in message


def host_tools(folder, nvidia_smi: str, kernel: str | None = None, gpu_runtime: bool = True):
    """A node's own nvidia-smi (its GPU and driver, as host_facts.py and the preflight ask them), uname, and Docker's
    NVIDIA support (`docker run --gpus all … nvidia-smi -L`, the GPU check, answered as a host with the Container
    Toolkit answers it; any other docker command is the real one), shown at /usr/local/sbin (the first of root's
    PATH) to that node's SSH sessions only."""
    folder.mkdir(parents=True, exist_ok=True)
    scripts = {"nvidia-smi": nvidia_smi}
    if kernel:
        scripts["uname"] = f'if [ "$1" = -r ]; then echo {kernel}; else exec {shutil.which("uname")} "$@"; fi\n'
    if gpu_runtime:
        scripts["docker"] = 'case " $* " in *" --gpus "*) echo "GPU 0: (claimed by the test)"; exit 0 ;; esac\n' + (
            f'exec {shutil.which("docker")} "$@"\n'
        )
    for name, body in scripts.items():
        (folder / name).write_text("#!/bin/sh\n" + body)
        (folder / name).chmod(0o755)
    return folder


def nvidia_smi(gpu: str, capability: str, driver: str, cuda: str, memory: str) -> str:
    return (
        'case "$1" in\n'
        f"--query-gpu=name,compute_cap,driver_version) echo '{gpu}, {capability}, {driver}' ;;\n"
        f"--query-gpu=memory.total,memory.free) echo '{memory}' ;;\n"
        f"*) echo '| NVIDIA-SMI {driver}   Driver Version: {driver}   CUDA Version: {cuda}   |' ;;\n"
        "esac\n"
    )


H100 = nvidia_smi("NVIDIA H100 80GB HBM3", "9.0", "580.95.05", "13.0", "81559, 81000")
GB10_OLD_DRIVER = nvidia_smi("NVIDIA GB10", "12.1", "575.57.08", "12.9", "[N/A], [N/A]")


@contextlib.contextmanager
def claimed_hosts(cluster, tmp_path, tools: dict, rdma: bool = True):
    """Each node's tools (node -> folder of host_tools) and, with `rdma`, an RDMA device on its fabric."""
    with contextlib.ExitStack() as stack:
        for node in cluster.nodes:
            stack.enter_context(cluster.node_local_view(node, Path("/usr/local/sbin"), tools[node.name]))
            if rdma:
                folder = tmp_path / f"rdma-{node.name}"
                add_device(folder, "rocep1s0f1", node.fabric_interface, node.fabric_ip)
                stack.enter_context(cluster.node_rdma_view(node, folder))
        yield


def test_hosts_that_cannot_run_the_image_are_refused_before_any_container_naming_each_node(
    sim_cluster, image, model_dir, new_stack, tmp_path
):
    """#68 on simulated nodes with GPUs claimed: an image whose torch is built for CUDA 13.0 with sm_80 and sm_90
    code only; node-1 an H100 (9.0) on the DGX OS kernel the table names, NCCL over RDMA; node-2 a GB10 (12.1) on a
    driver for CUDA 12.9. Each refused, nothing started. Then hosts without Docker's NVIDIA support: the GPU
    check's refusal."""
    from tests.e2e.image.build import publish_with_torch
    from tests.e2e.rehearsal import CACHE_DIR

    torch_image = publish_with_torch(CACHE_DIR, sim_cluster.nodes[0].docker_host, image.ref, "13.0", "sm_80 sm_90")
    config, secrets = rehearsal_config(sim_cluster, torch_image, model_dir)
    config["container"] = {**config["container"], "gpus": True}
    config["nccl"] = {"ibDisable": False}  # NCCL over RDMA: the fabric gate sees each node's device
    config["nodes"][1]["rdmaDevices"] = ["rocep1s0f1"]
    tools = {
        "node-1": host_tools(tmp_path / "tools-1", H100, kernel="7.0.0-1019-nvidia"),
        "node-2": host_tools(tmp_path / "tools-2", GB10_OLD_DRIVER),
    }
    with claimed_hosts(sim_cluster, tmp_path, tools):
        message = failed_deploy(sim_cluster, new_stack(), config, secrets)
    assert "host check node-1: kernel 7.0.0-1019-nvidia: NCCL over RoCE fails at start" in message
    assert (
        "host check node-2: the image's torch 2.11.0 is built for CUDA 13.0, which needs NVIDIA driver 580" in message
    )
    assert "the node runs driver 575.57.08 (CUDA 12.9)" in message
    assert (
        "host check node-2: the image's torch 2.11.0 carries GPU code for sm_80 sm_90 and none that runs on the "
        "node's NVIDIA GB10 (compute capability 12.1)" in message
    )
    assert "host check node-1: the image's torch" not in message  # its H100 runs sm_90, its driver CUDA 13.0
    # good hosts (an H100 each, a known kernel) without the Container Toolkit
    config["nccl"] = {"ibDisable": True}
    plain = {name: host_tools(tmp_path / f"plain-{name}", H100, gpu_runtime=False) for name in ("node-1", "node-2")}
    with claimed_hosts(sim_cluster, tmp_path, plain, rdma=False):
        message = failed_deploy(sim_cluster, new_stack(), config, secrets)
    # the engine stops at the first node whose GPU check failed: either node's
    assert re.search(r"preflight node-[12]: no GPU visible in a container \(--gpus all\)", message)
    assert "host check" not in message
