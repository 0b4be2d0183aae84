"""The rehearsal: the README's `pulumi` commands, run by the real CLI and engine on simulated nodes.

Runs as root in CI with no skips (tests/e2e/conftest.py fails without the CLI). The tests in this
module share one deployment and run in order: deploy → no-op → vLLM-only change → drift → destroy
from a fresh clone; then a bad config and node faults on the same nodes.
"""

from __future__ import annotations

import ast
import contextlib
import json
import os
import re
import shutil
from pathlib import Path

import pytest

from tests.e2e.rehearsal import chat, rehearsal_config, request
from tests.e2e.stack import StackError
from tests.fake_sysfs import add_device
from tests.waiting import wait_for

pytestmark = pytest.mark.e2e

RAY_NODES = (
    "import json, ray; ray.init(address='auto', logging_level='ERROR'); "
    "print(json.dumps([n['NodeManagerAddress'] for n in ray.nodes() if n['Alive']]))"
)
SERVE_STEPS = {"spark-vllm-serve", "spark-vllm-ready", "spark-vllm-smoke"}


def container_ids(cluster) -> dict[str, str]:
    return {
        node.name: cluster.docker(node, "ps", "-q", "--no-trunc", "--filter", "label=spark-vllm.node").stdout.strip()
        for node in cluster.nodes
    }


def no_containers(cluster) -> bool:
    return all(cluster.docker(node, "ps", "-aq").stdout.strip() == "" for node in cluster.nodes)


def netns_processes(cluster, words=("raylet", "gcs_server", "vllm", "ray start", "standin")) -> list[str]:
    """Processes of any node's network namespace whose command line names Ray or vLLM."""
    inodes = {os.stat(node.netns_path).st_ino for node in cluster.nodes}
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{pid}/ns/net").st_ino not in inodes:
                continue
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(word in cmdline for word in words):
            found.append(f"{pid}: {cmdline[:120]}")
    return found


# A short benchmark after the smoke test: 8 requests, 2 at a time, 32 prompt and 16 output tokens each.
BENCHMARK = {"enabled": True, "concurrency": 2, "requests": 8, "promptTokens": 32, "outputTokens": 16}


@pytest.fixture(scope="module")
def deployed(sim_cluster, image, prometheus_image, model_dir, new_stack):
    stack = new_stack()
    config, secrets = rehearsal_config(sim_cluster, image.ref, model_dir)
    config["benchmark"] = BENCHMARK
    # a real Prometheus on the worker, scraping vLLM on the head across the fabric
    config["metrics"] = {"prometheusNode": "node-2", "prometheusImage": prometheus_image, "scrapeIntervalSeconds": 1}
    stack.configure(config, secrets)
    preview = stack.preview()
    run = stack.up()
    return {"stack": stack, "config": config, "secrets": secrets, "preview": preview, "run": run}


def test_the_first_preview_creates_everything_and_touches_nothing(sim_cluster, deployed):
    preview = deployed["preview"]
    assert set(preview.changed.values()) == {"create"}
    assert {"node-1-container", "node-2-container", "spark-vllm-serve"} <= set(preview.changed)
    assert set(deployed["run"].changed) == set(preview.changed)  # up did what the preview said


def test_the_pull_shows_its_progress_per_node(deployed):
    output = deployed["run"].output
    for node in ("node-1", "node-2"):
        assert f"{node}-pull" in output and f"[{node}] pulled " in output  # streamed by the pull step


def test_the_memory_plan_is_an_output(deployed):
    plan = deployed["run"].outputs["memoryPlan"]
    assert plan["checked"] is True and plan["fits"] is True and plan["maxModelLen"] == 4096
    assert set(plan["nodes"]) == {"node-1", "node-2"}
    assert plan["nodes"]["node-1"]["kv_per_token_mib"] > 0


def test_the_fabric_gate_passed_and_its_figures_are_an_output_and_in_the_release(sim_cluster, deployed):
    fabric = deployed["run"].outputs["fabric"]
    assert fabric["checked"] is True and fabric["problems"] == []
    for node in sim_cluster.nodes:
        link = fabric["links"][node.name]
        assert link["interface"] == node.fabric_interface and link["mtu"] == 1500 and link["speedGbps"] == 10.0
    assert fabric["floorGbps"] == 0.5  # 5 % of the veth's 10 Gb/s
    assert fabric["bandwidthGbps"]["node-1->node-2"] > fabric["floorGbps"]
    assert deployed["run"].outputs["release"]["fabric"]["bandwidthGbps"] == fabric["bandwidthGbps"]


def test_the_benchmark_measured_the_stand_ins_pace_and_is_part_of_the_release(deployed):
    bench = deployed["run"].outputs["benchmark"]
    assert bench["tool"] == "spark-vllm"  # the stand-in has no `vllm bench serve`: the project's own load
    assert bench["completed"] == 8 and bench["errors"] == 0 and bench["outputTokens"] == 8 * 16
    # 2 streams at the stand-in's 100 tokens/s each (STANDIN_TOKENS_PER_SECOND): at most 200 output tokens/s
    assert 50 < bench["outputTokensPerSecond"] <= 205
    assert 9.5 <= bench["itlMs"]["p50"] < 60 and bench["ttftMs"]["p50"] >= 10
    assert bench["settings"] == {"concurrency": 2, "requests": 8, "promptTokens": 32, "outputTokens": 16}
    release = deployed["run"].outputs["release"]
    assert release["benchmark"]["outputTokensPerSecond"] == bench["outputTokensPerSecond"]
    assert release["validated"] is True


def prometheus_api(cluster, node, path: str) -> dict:
    out = cluster.docker(node, "exec", "spark-vllm.prometheus", "curl", "-s", f"http://127.0.0.1:9090{path}").stdout
    return json.loads(out or "{}")


def test_a_real_prometheus_on_the_worker_scrapes_every_target(sim_cluster, deployed):
    worker = sim_cluster.nodes[1]
    metrics = deployed["run"].outputs["metrics"]
    assert metrics["prometheus"] == f"http://{worker.mgmt_ip}:9090"
    expected = {*[t for targets in metrics["targets"].values() for t in targets], "127.0.0.1:9090"}
    assert metrics["targets"]["vllm"] == [f"{sim_cluster.nodes[0].fabric_ip}:8000"]
    seen: dict = {}

    def all_up() -> bool:
        active = prometheus_api(sim_cluster, worker, "/api/v1/targets").get("data", {}).get("activeTargets", [])
        seen.update({t["labels"]["instance"]: t["health"] for t in active})
        return set(seen) == expected and set(seen.values()) == {"up"}

    assert wait_for(all_up, timeout=60), seen
    query = prometheus_api(sim_cluster, worker, "/api/v1/query?query=vllm:generation_tokens_total")
    values = [float(row["value"][1]) for row in query["data"]["result"]]
    assert values and values[0] >= 8 * 16  # the benchmark's tokens, counted by the stand-in, scraped across nodes
    assert deployed["stack"].outputs()["prometheusConfig"] == "[secret]"  # it holds the API key


def test_two_node_deploy_forms_ray_on_the_fabric_and_serves_with_the_key(sim_cluster, deployed):
    head = sim_cluster.nodes[0]
    alive = json.loads(sim_cluster.docker(head, "exec", "spark-vllm-node-1", "python3", "-c", RAY_NODES).stdout)
    assert sorted(alive) == sorted(node.fabric_ip for node in sim_cluster.nodes)
    assert not {node.mgmt_ip for node in sim_cluster.nodes} & set(alive)

    outputs, key = deployed["run"].outputs, deployed["secrets"]["apiKey"]
    endpoint = outputs["endpoint"]
    assert endpoint == f"http://{head.mgmt_ip}:8000/v1"
    status, models = request(f"{endpoint}/models", key)
    assert status == 200 and [m["id"] for m in models["data"]] == [outputs["servedModelName"]]
    answer = chat(endpoint, key, outputs["servedModelName"])
    assert answer["choices"][0]["message"]["content"]
    assert request(f"{endpoint}/models")[0] == 401
    assert request(f"{endpoint}/models", "wrong-key")[0] == 401
    assert outputs["smoke"]["completionTokens"] > 0
    assert outputs["release"]["validated"] is True
    # pulled from the registry: the release names the image by its repo digest
    assert outputs["release"]["image"].startswith(f"{sim_cluster.registry.address}/spark-vllm-rehearsal@sha256:")


def test_the_worker_joined_through_its_fabric_address_and_vllm_placed_a_bundle_on_it(sim_cluster, deployed):
    head = sim_cluster.nodes[0]
    log = sim_cluster.docker(head, "exec", "spark-vllm-node-1", "cat", "/run/spark-vllm/vllm.log").stdout
    for node in sim_cluster.nodes:
        assert node.fabric_ip in log  # one actor per GPU bundle, reported with its node's address


def test_each_ray_worker_keeps_its_own_nodes_interface_and_hca_names(sim_cluster, deployed):
    """node-2 names its fabric interface enp1s0f1np1 and has no RDMA device; the head names fab0 and
    rocep1s0f1. vLLM's Ray executor hands the driver's environment to every worker unless a name is in
    ray_non_carry_over_env_vars.json (vLLM 0.25; the stand-in does the same): listed, each keeps its own."""
    head, worker = sim_cluster.nodes
    log = sim_cluster.docker(head, "exec", "spark-vllm-node-1", "cat", "/run/spark-vllm/vllm.log").stdout
    ranks = {}
    for line in log.splitlines():
        match = re.search(r"rank \d+: node_id=\S+ node_ip=(\S+) .* env=(\{.*\})$", line)
        if match:
            ranks[match.group(1)] = ast.literal_eval(match.group(2))
    assert ranks[head.fabric_ip]["NCCL_SOCKET_IFNAME"] == "fab0"
    assert ranks[head.fabric_ip]["NCCL_IB_HCA"] == "rocep1s0f1"
    assert ranks[worker.fabric_ip]["NCCL_SOCKET_IFNAME"] == "enp1s0f1np1"
    assert ranks[worker.fabric_ip]["UCX_NET_DEVICES"] == "enp1s0f1np1"
    assert ranks[worker.fabric_ip]["NCCL_IB_HCA"] is None  # not the head's HCA
    listed = sim_cluster.docker(
        head, "exec", "spark-vllm-node-1", "cat", "/run/spark-vllm/vllm-config/ray_non_carry_over_env_vars.json"
    ).stdout
    assert json.loads(listed) == ["NCCL_IB_HCA", "NCCL_SOCKET_IFNAME", "UCX_NET_DEVICES"]


def test_ray_refuses_a_client_without_the_token(sim_cluster, deployed):
    head = sim_cluster.nodes[0]
    probe = f"import ray; ray.init(address='{head.fabric_ip}:6379', logging_level='ERROR'); print('joined')"
    without = sim_cluster.docker(
        head, "exec", "spark-vllm-node-1", "env", "-u", "RAY_AUTH_TOKEN", "timeout", "60", "python3", "-c", probe,
        check=False,
    )  # fmt: skip
    assert without.returncode != 0 and "joined" not in without.stdout
    env = sim_cluster.docker(head, "exec", "spark-vllm-node-1", "env").stdout
    assert "RAY_AUTH_MODE=token" in env


def test_no_secret_is_on_any_command_line_in_any_output_or_in_the_stored_state(deployed):
    stack, values = deployed["stack"], deployed["secrets"]
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        for secret in values.values():
            assert secret.strip() not in cmdline, f"pid {pid}: {cmdline[:80]}"
    exported = stack.export()
    config_file = stack.config_file.read_text()
    outputs = json.dumps(stack.outputs())
    cli_output = deployed["run"].output + deployed["preview"].output
    key_body = values["sshPrivateKey"].strip().splitlines()[1]
    for secret in (values["apiKey"], values["hfToken"], key_body):
        assert secret not in exported
        assert secret not in config_file
        assert secret not in outputs
        assert secret not in cli_output
    assert "ciphertext" in exported  # the secrets are there, encrypted


def test_a_second_preview_and_up_with_nothing_changed_change_nothing(sim_cluster, deployed):
    stack = deployed["stack"]
    before = container_ids(sim_cluster)
    preview = stack.preview()
    assert preview.changed == {}, preview.changed
    assert set(preview.change_summary) == {"same"}
    run = stack.up()
    assert run.changed == {}, run.changed
    assert container_ids(sim_cluster) == before


def test_a_max_model_len_edit_previews_exactly_the_serve_steps_and_keeps_every_ray_container(sim_cluster, deployed):
    stack = deployed["stack"]
    before = container_ids(sim_cluster)
    stack.configure({**deployed["config"], "maxModelLen": 2048}, deployed["secrets"])
    preview = stack.preview()
    assert preview.changed == {
        "spark-vllm-serve": "update",
        "spark-vllm-ready": "replace",
        "spark-vllm-smoke": "replace",
        "spark-vllm-benchmark": "replace",
    }  # no container, and not the Prometheus either
    run = stack.up()
    assert run.changed == preview.changed
    assert container_ids(sim_cluster) == before
    status, models = request(f"{run.outputs['endpoint']}/models", deployed["secrets"]["apiKey"])
    assert status == 200 and models["data"][0]["max_model_len"] == 2048
    deployed["config"]["maxModelLen"] = 2048


def test_another_model_directory_replaces_the_containers_and_the_new_one_is_served(sim_cluster, deployed, model_dir):
    """The bind mount of the model is part of what a container is: a changed path makes new containers."""
    stack = deployed["stack"]
    moved = model_dir.parent / f"{model_dir.name}-moved"
    shutil.copytree(model_dir, moved, dirs_exist_ok=True)
    before = container_ids(sim_cluster)
    stack.configure({**deployed["config"], "model": str(moved)}, deployed["secrets"])
    preview = stack.preview()
    assert preview.changed["node-1-container"] == "replace" and preview.changed["node-2-container"] == "replace"
    assert not any(name.endswith(("-image", "-docker", "-pull")) for name in preview.changed)
    run = stack.up()
    after = container_ids(sim_cluster)
    assert all(after[node] != before[node] for node in before)
    for node in sim_cluster.nodes:
        mounts = sim_cluster.docker(node, "inspect", "-f", "{{json .Mounts}}", f"spark-vllm-{node.name}").stdout
        assert str(moved) in mounts and f'"{model_dir}"' not in mounts
    status, models = request(f"{run.outputs['endpoint']}/models", deployed["secrets"]["apiKey"])
    assert status == 200 and models["data"][0]["root"] == str(moved)
    assert run.outputs["release"]["model"] == str(moved)
    deployed["config"]["model"] = str(moved)


def test_refresh_shows_a_container_removed_by_hand_and_the_next_up_repairs_it(sim_cluster, deployed):
    stack = deployed["stack"]
    worker = sim_cluster.nodes[1]
    sim_cluster.docker(worker, "rm", "-f", "spark-vllm-node-2")
    refreshed = stack.refresh()
    assert refreshed.changed.get("node-2-container") == "delete", refreshed.changed  # gone from the state
    assert "node-2-container" not in stack.export()
    preview = stack.preview()
    assert preview.changed.get("node-2-container") == "create"
    assert "node-1-container" not in preview.changed  # the head stays
    run = stack.up()
    assert run.changed.get("node-2-container") == "create"
    assert run.changed.get("spark-vllm-serve") == "replace"  # its Ray workers died with the container
    assert container_ids(sim_cluster)["node-2"]
    chat(run.outputs["endpoint"], deployed["secrets"]["apiKey"], run.outputs["servedModelName"])


def test_destroy_from_a_fresh_clone_leaves_no_container_or_process(sim_cluster, deployed, tmp_path):
    """Another machine: the repository and the stack's config file, the same backend and passphrase,
    and none of the files the program wrote where it ran (gone here, as on any other machine). The
    SSH key is the sshPrivateKey secret, so `--run-program` writes its file first (README)."""
    stack = deployed["stack"]
    shutil.rmtree(stack.spark_vllm_home)
    clone = stack.fresh_clone(tmp_path / "other-machine")
    destroyed = clone.destroy(run_program=True)
    names = sorted(destroyed.changed, key=lambda name: destroyed.resources[name].finished or 0)
    # vLLM first, then the worker, then the head
    assert names.index("spark-vllm-serve") < names.index("node-2-container") < names.index("node-1-container")
    assert no_containers(sim_cluster)
    assert netns_processes(sim_cluster) == []
    assert clone.destroy().changed == {}  # a second destroy is safe and does nothing


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
    """Deploy expecting a failure; nothing may have started on any node. Always destroys; the message."""
    stack.configure(config, secrets)
    try:
        with pytest.raises(StackError) as caught:
            stack.up()
        assert no_containers(cluster), "a container started"
    finally:
        stack.destroy()
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
    config["ssh"] = {"dialErrorLimit": 3}  # the default 20 retries for about a minute first
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
    config["ssh"] = {"dialErrorLimit": 3}  # the default 20 retries for about a minute first
    message = failed_deploy(sim_cluster, new_stack(), config, secrets)
    # the first step on the node: pulumi-command retries, then names the mismatch
    assert "error: after 3 failed attempts: ssh: handshake failed: ssh: host key mismatch" in message


def vllm_pid(cluster) -> str:
    head = cluster.nodes[0]
    return cluster.docker(head, "exec", "spark-vllm-node-1", "cat", "/run/spark-vllm/vllm.pid").stdout.strip()


def test_three_nodes_the_dev_way_node_added_then_pipeline_parallel_with_hostile_extra_args(
    sim_cluster3, image3, model_dir, new_stack, ssh_agent3
):
    """No host keys in the config and the SSH key in an ssh-agent, on a machine that never connected
    to the nodes (empty ~/.ssh): the first `up` pins what each node shows, on both transports. Two
    nodes first; then a third is added, and its preview shows the first two untouched."""
    stack = new_stack("staging", agent_socket=ssh_agent3)
    marker = f"/tmp/spark-vllm-pwned-{os.getpid()}"
    hostile = ["--revision", f"$(touch {marker}); `touch {marker}`; touch {marker} #'\""]
    config, secrets = rehearsal_config(
        sim_cluster3, image3.ref, model_dir, pipeline_parallel=True, pin_host_keys=False, key_secret=False
    )
    config["vllm"]["extraArgs"] = hostile
    config["benchmark"] = BENCHMARK  # staging validates how fast it serves; prod's floors read the figures
    two = {**config, "nodes": config["nodes"][:2], "pipelineParallelSize": 2}
    stack.configure(two, secrets)
    first = stack.up()
    assert {"node-1-host-key", "node-2-host-key"} <= set(first.changed)
    assert any("no hostKey, so the first `pulumi up` trusts the key" in d for d in first.diagnostics)
    before = container_ids(sim_cluster3)

    stack.configure(config, secrets)
    preview = stack.preview()
    assert {name for name in preview.changed if name.startswith("node-3-")} == {
        f"node-3-{r}"
        for r in (
            "host-key", "docker", "pull", "image", "fabric-gate", "preflight", "model-fingerprint", "image-check",
            "container", "supervisor", "joined",
        )
    }  # fmt: skip
    # the head and node-2 keep their containers and images: nothing of theirs shows as replaced
    assert not {"node-1-container", "node-2-container", "node-1-image", "node-2-image", "node-1-docker"} & set(
        preview.changed
    )
    run = stack.up()
    assert set(run.changed) == set(preview.changed)
    after = container_ids(sim_cluster3)
    assert after["node-1"] == before["node-1"] and after["node-2"] == before["node-2"] and after["node-3"]

    state = stack.export()
    for node in sim_cluster3.nodes:
        assert node.host_key in state  # pinned in the stack's state
    head = sim_cluster3.nodes[0]
    alive = json.loads(sim_cluster3.docker(head, "exec", "spark-vllm-node-1", "python3", "-c", RAY_NODES).stdout)
    assert sorted(alive) == sorted(node.fabric_ip for node in sim_cluster3.nodes)
    log = sim_cluster3.docker(head, "exec", "spark-vllm-node-1", "cat", "/run/spark-vllm/vllm.log").stdout
    assert "--pipeline-parallel-size=3" in log and "--tensor-parallel-size=1" in log
    answer = chat(run.outputs["endpoint"], secrets["apiKey"], run.outputs["servedModelName"])
    assert answer["usage"]["completion_tokens"] > 0
    # the hostile value reached vLLM as one argument, and nothing ran
    assert f"touch {marker}" in log
    assert not Path(marker).exists()
    in_container = sim_cluster3.docker(head, "exec", "spark-vllm-node-1", "test", "-e", marker, check=False)
    assert in_container.returncode != 0
    staging_release.update(run.outputs["release"], stack=stack, config=config, secrets=secrets)


def test_a_rotated_ssh_credential_re_runs_the_commands_and_changes_nothing(sim_cluster3):
    """The credential moves from the agent to the sshPrivateKey secret: every remote command's
    connection changes, so pulumi-command runs each `create` again. Nothing may restart."""
    if not staging_release:
        pytest.fail("the staging deployment above did not run")
    stack = staging_release["stack"]
    before, pid = container_ids(sim_cluster3), vllm_pid(sim_cluster3)
    secrets = {**staging_release["secrets"], "sshPrivateKey": sim_cluster3.client_key_private}
    stack.configure(staging_release["config"], secrets)
    run = stack.up()
    commands = {name for name, event in run.resources.items() if event.type == "command:remote:Command"}
    assert {name for name, op in run.changed.items() if op == "update"} >= commands - {
        "spark-vllm-ready",
        "spark-vllm-smoke",
        "spark-vllm-benchmark",
    }
    assert not {op for name, op in run.changed.items() if name.endswith(("-container", "-image"))}
    assert container_ids(sim_cluster3) == before
    assert vllm_pid(sim_cluster3) == pid  # the serve step found it running with the same settings
    assert "vLLM already running with these settings" in run.output
    assert "is already on this node" in run.output  # the pull step found the image
    # and back to the agent (the prod test destroys staging from another machine with it)
    stack.configure(staging_release["config"], staging_release["secrets"])  # no sshPrivateKey any more
    back = stack.up()
    assert "spark-vllm-serve" in back.changed and container_ids(sim_cluster3) == before
    assert vllm_pid(sim_cluster3) == pid


staging_release: dict = {}


def test_prod_on_other_nodes_deploys_what_staging_validated(
    sim_cluster, sim_cluster3, image, model_dir, new_stack, ssh_agent3, tmp_path
):
    """staging (the tests above, 3 nodes) validated a release; prod (2 other nodes, the same registry)
    takes exactly that image and model, through `promoteFrom`, read from staging's stack outputs."""
    if not staging_release:
        pytest.fail("the staging deployment above did not run")
    staging = staging_release.pop("stack")
    prod = new_stack("prod", backend=staging.backend)
    config, secrets = rehearsal_config(sim_cluster, image.ref, model_dir)
    del config["image"], config["model"]
    config["promoteFrom"] = "organization/spark-vllm/staging"
    staged = staging.outputs()["release"]["benchmark"]  # as staging's latest `up` measured it
    # a floor the release misses: refused in preview, with its figure and the floor, before any resource
    config["release"] = {"minOutputTokensPerSecond": 100000}
    prod.configure(config, secrets)
    with pytest.raises(StackError) as refused:
        prod.preview()
    message = str(refused.value)
    assert f"release.minOutputTokensPerSecond: its release made {staged['outputTokensPerSecond']} output tokens/s, " \
        "below the floor 100000.0" in message  # fmt: skip
    assert no_containers(sim_cluster)
    # floors it meets: the preview shows the figures of the release it would deploy
    config["release"] = {"minOutputTokensPerSecond": 10, "maxP99TtftMs": 60000}
    prod.configure(config, secrets)
    preview = prod.preview()
    assert set(preview.changed.values()) == {"create"}
    assert f"it served: {staged['outputTokensPerSecond']} output tokens/s" in "\n".join(preview.diagnostics)
    run = prod.up()
    release = run.outputs["release"]
    assert release["image"] == staging_release["image"]
    assert release["model"] == staging_release["model"]
    assert release["engine"] == staging_release["engine"]
    assert release["promotedFrom"] == "organization/spark-vllm/staging" and release["validated"] is True
    images = {
        node.name: sim_cluster.docker(node, "image", "inspect", "-f", "{{.Id}}", release["image"]).stdout.strip()
        for node in sim_cluster.nodes
    }
    assert set(images.values()) == {image.image_id}
    chat(run.outputs["endpoint"], secrets["apiKey"], run.outputs["servedModelName"])
    prod.destroy()
    assert netns_processes(sim_cluster) == []
    # staging logs in with the agent, which the other machine has too: a plain `pulumi destroy` there
    clone = staging.fresh_clone(tmp_path / "other-machine", agent_socket=ssh_agent3)
    clone.destroy()
    assert no_containers(sim_cluster3) and netns_processes(sim_cluster3) == []
