"""The rehearsal: deploy, change and destroy the real program on simulated nodes.

Runs as root in CI with no skips (tests/e2e/conftest.py skips with the reason elsewhere). The
tests in this module share one deployment and run in order: deploy → no-op → vLLM-only change →
destroy; then a bad config and a node fault on the same nodes.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from components.config import ConfigError
from tests.e2e.engine import Deployment, ResourceError
from tests.e2e.rehearsal import chat, rehearsal_config, request

pytestmark = pytest.mark.e2e

RAY_NODES = (
    "import json, ray; ray.init(address='auto', logging_level='ERROR'); "
    "print(json.dumps([n['NodeManagerAddress'] for n in ray.nodes() if n['Alive']]))"
)


def container_ids(cluster) -> dict[str, str]:
    return {
        node.name: cluster.docker(node, "ps", "-q", "--no-trunc", "--filter", "label=spark-vllm.node").stdout.strip()
        for node in cluster.nodes
    }


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


@pytest.fixture(scope="module")
def deployed(sim_cluster, rehearsal, model_dir):
    deployment, image = rehearsal
    config, secrets = rehearsal_config(sim_cluster, image.ref, model_dir)
    run, operations = deployment.up(config, secrets)
    return {"config": config, "secrets": secrets, "run": run, "operations": operations}


def test_two_node_deploy_forms_ray_on_the_fabric_and_serves_with_the_key(sim_cluster, deployed):
    head = sim_cluster.nodes[0]
    alive = json.loads(sim_cluster.docker(head, "exec", "spark-vllm-ray-node-1", "python3", "-c", RAY_NODES).stdout)
    assert sorted(alive) == sorted(node.fabric_ip for node in sim_cluster.nodes)
    assert not {node.mgmt_ip for node in sim_cluster.nodes} & set(alive)

    run, key = deployed["run"], deployed["secrets"]["apiKey"]
    endpoint = run.exports["endpoint"]
    assert endpoint == f"http://{head.mgmt_ip}:8000/v1"
    status, models = request(f"{endpoint}/models", key)
    assert status == 200 and [m["id"] for m in models["data"]] == [run.exports["servedModelName"]]
    answer = chat(endpoint, key, run.exports["servedModelName"])
    assert answer["choices"][0]["message"]["content"]
    assert request(f"{endpoint}/models")[0] == 401
    assert request(f"{endpoint}/models", "wrong-key")[0] == 401
    assert run.exports["smoke"]["completionTokens"] > 0
    assert run.exports["release"]["validated"] is True


def test_the_worker_joined_through_its_fabric_address_and_vllm_placed_a_bundle_on_it(sim_cluster, deployed):
    head = sim_cluster.nodes[0]
    log = sim_cluster.docker(head, "exec", "spark-vllm-ray-node-1", "cat", "/run/spark-vllm/vllm.log").stdout
    for node in sim_cluster.nodes:
        assert node.fabric_ip in log  # one actor per GPU bundle, reported with its node's address


def test_ray_refuses_a_client_without_the_token(sim_cluster, deployed):
    head = sim_cluster.nodes[0]
    probe = f"import ray; ray.init(address='{head.fabric_ip}:6379', logging_level='ERROR'); print('joined')"
    without = sim_cluster.docker(
        head, "exec", "spark-vllm-ray-node-1", "env", "-u", "RAY_AUTH_TOKEN", "timeout", "60", "python3", "-c", probe,
        check=False,
    )  # fmt: skip
    assert without.returncode != 0 and "joined" not in without.stdout
    env = sim_cluster.docker(head, "exec", "spark-vllm-ray-node-1", "env").stdout
    assert "RAY_AUTH_MODE=token" in env


def test_no_secret_is_on_any_command_line(deployed):
    secrets = [deployed["secrets"]["apiKey"], deployed["secrets"]["hfToken"]]
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        for secret in secrets:
            assert secret not in cmdline, f"pid {pid}: {cmdline[:80]}"
    assert all(secret not in json.dumps(deployed["run"].exports) for secret in secrets)


def test_a_second_up_with_nothing_changed_does_nothing(sim_cluster, rehearsal, deployed):
    deployment, _ = rehearsal
    before = container_ids(sim_cluster)
    _, operations = deployment.up(deployed["config"], deployed["secrets"])
    assert {op.action for op in operations} == {"same"}, [op for op in operations if op.action != "same"]
    assert container_ids(sim_cluster) == before


def test_a_vllm_only_change_keeps_every_ray_container(sim_cluster, rehearsal, deployed):
    deployment, _ = rehearsal
    before = container_ids(sim_cluster)
    config = {**deployed["config"], "maxModelLen": 2048}
    run, operations = deployment.up(config, deployed["secrets"])
    changed = {op.name: op.action for op in operations if op.action != "same"}
    # vLLM restarted in place; readiness and smoke test ran again; nothing else was touched
    assert changed == {"spark-vllm-serve": "update", "spark-vllm-ready": "replace", "spark-vllm-smoke": "replace"}
    assert container_ids(sim_cluster) == before
    status, models = request(f"{run.exports['endpoint']}/models", deployed["secrets"]["apiKey"])
    assert status == 200 and models["data"][0]["max_model_len"] == 2048


def test_destroy_leaves_no_container_or_process(sim_cluster, rehearsal, deployed):
    deployment, _ = rehearsal
    operations = deployment.destroy()
    names = [op.name for op in operations]
    # vLLM first, then the worker, then the head
    assert names.index("spark-vllm-serve") < names.index("node-2-ray") < names.index("node-1-ray")
    for node in sim_cluster.nodes:
        assert sim_cluster.docker(node, "ps", "-aq").stdout.strip() == ""
    assert netns_processes(sim_cluster) == []
    assert deployment.destroy() == []  # a second destroy is safe and does nothing


def test_a_bad_config_creates_nothing_on_any_node(sim_cluster, rehearsal, model_dir):
    deployment, image = rehearsal
    config, secrets = rehearsal_config(sim_cluster, image.ref, model_dir, tensorParallelSize=3)
    config["nodes"][1]["fabricInterface"] = "fab0;reboot"
    with pytest.raises(ConfigError) as caught:
        deployment.up(config, secrets)
    assert "tensorParallelSize × pipelineParallelSize" in str(caught.value)
    assert "nodes[1].fabricInterface" in str(caught.value)
    for node in sim_cluster.nodes:
        assert sim_cluster.docker(node, "ps", "-aq").stdout.strip() == ""
    assert not deployment.state_path.exists() or json.loads(deployment.state_path.read_text()) == []


def failed_deploy(cluster, deployment, config, secrets, error: type[Exception] = Exception) -> str:
    """Deploy expecting `error`; nothing may have started on any node. Always destroys; the message."""
    try:
        with pytest.raises(error) as caught:
            deployment.up(config, secrets)
        for node in cluster.nodes:
            assert cluster.docker(node, "ps", "-aq").stdout.strip() == "", f"{node.name} runs a container"
    finally:
        deployment.destroy()
    return str(caught.value)


def test_a_fabric_address_not_on_the_node_is_caught_before_any_container(sim_cluster, rehearsal, model_dir):
    deployment, image = rehearsal
    config, secrets = rehearsal_config(sim_cluster, image.ref, model_dir)
    wrong = sim_cluster.nodes[1].fabric_ip.rsplit(".", 1)[0] + ".99"
    config["nodes"][1]["fabricAddress"] = wrong
    message = failed_deploy(sim_cluster, deployment, config, secrets, ResourceError)
    assert "preflight node-" in message
    assert f"{wrong}" in message


def test_a_node_whose_tag_points_at_other_bytes_stops_every_container(sim_cluster, rehearsal, model_dir):
    """node-2 has the same tag on a different image (a tag moved, or a local build): caught before Ray."""
    deployment, image = rehearsal
    node2 = sim_cluster.nodes[1]
    original = sim_cluster.docker(node2, "image", "inspect", "-f", "{{.Id}}", image.ref, check=False).stdout.strip()
    sim_cluster.docker(node2, "run", "--name", "drift", "--network", "none", image.ref, "touch", "/drift")
    sim_cluster.docker(node2, "commit", "drift", image.ref)
    sim_cluster.docker(node2, "rm", "drift")
    drifted = sim_cluster.docker(node2, "image", "inspect", "-f", "{{.Id}}", image.ref).stdout.strip()
    config, secrets = rehearsal_config(sim_cluster, image.ref, model_dir)
    try:
        message = failed_deploy(sim_cluster, deployment, config, secrets)
    finally:
        sim_cluster.docker(node2, "rmi", "-f", image.ref, check=False)
        if original:  # back to the archive's image, as the other tests expect
            sim_cluster.docker(node2, "tag", original, image.ref, check=False)
    assert "the image differs between nodes" in message
    assert f"node-2: {drifted}" in message


def test_a_model_missing_on_one_node_stops_every_container(sim_cluster, rehearsal, model_dir, tmp_path):
    """node-2 has no model directory (the copy never reached it): its preflight names it, nothing starts."""
    deployment, image = rehearsal
    empty = tmp_path / "empty"
    empty.mkdir()
    config, secrets = rehearsal_config(sim_cluster, image.ref, model_dir)
    with sim_cluster.node_local_view("node-2", model_dir.parent, empty):
        message = failed_deploy(sim_cluster, deployment, config, secrets, ResourceError)
    assert "(node-2-preflight)" in message
    assert f"model directory {model_dir} does not exist" in message


def test_a_model_that_differs_on_one_node_stops_every_container(sim_cluster, rehearsal, model_dir, tmp_path):
    """node-2 holds another revision of the model at the same path: the fingerprints disagree."""
    deployment, image = rehearsal
    other = tmp_path / "other-revision"
    shutil.copytree(model_dir, other)
    (other / "config.json").write_text(json.dumps({**json.loads((model_dir / "config.json").read_text()), "rev": 2}))
    config, secrets = rehearsal_config(sim_cluster, image.ref, model_dir)
    with sim_cluster.node_local_view("node-2", model_dir, other):
        message = failed_deploy(sim_cluster, deployment, config, secrets)
    assert "model differs: node-2 vs node-1: config.json" in message


@pytest.mark.parametrize("daemon", ["dockerd", "sshd"])
def test_a_worker_without_its_daemon_fails_the_deploy_naming_that_node(sim_cluster, rehearsal, model_dir, daemon):
    deployment, image = rehearsal
    config, secrets = rehearsal_config(sim_cluster, image.ref, model_dir)
    getattr(sim_cluster, f"stop_{daemon}")("node-2")
    try:
        with pytest.raises(ResourceError, match=r"\(node-2-image\): error: docker .* on ssh://root@\S+ failed"):
            deployment.up(config, secrets)
    finally:
        getattr(sim_cluster, f"start_{daemon}")("node-2")
        deployment.destroy()
    for node in sim_cluster.nodes:
        assert sim_cluster.docker(node, "ps", "-aq").stdout.strip() == ""


def test_three_nodes_with_pipeline_parallelism_and_hostile_extra_args(sim_cluster3, rehearsal3, model_dir):
    deployment, image = rehearsal3
    marker = f"/tmp/spark-vllm-pwned-{os.getpid()}"
    hostile = ["--revision", f"$(touch {marker}); `touch {marker}`; touch {marker} #'\""]
    config, secrets = rehearsal_config(
        sim_cluster3, image.ref, model_dir, pipeline_parallel=True, vllm={"port": 8000, "extraArgs": hostile}
    )
    run, _ = deployment.up(config, secrets)
    try:
        head = sim_cluster3.nodes[0]
        alive = json.loads(
            sim_cluster3.docker(head, "exec", "spark-vllm-ray-node-1", "python3", "-c", RAY_NODES).stdout
        )
        assert sorted(alive) == sorted(node.fabric_ip for node in sim_cluster3.nodes)
        log = sim_cluster3.docker(head, "exec", "spark-vllm-ray-node-1", "cat", "/run/spark-vllm/vllm.log").stdout
        assert "--pipeline-parallel-size=3" in log and "--tensor-parallel-size=1" in log
        answer = chat(run.exports["endpoint"], secrets["apiKey"], run.exports["servedModelName"])
        assert answer["usage"]["completion_tokens"] > 0
        # the hostile value reached vLLM as one argument, and nothing ran
        assert f"touch {marker}" in log
        assert not Path(marker).exists()
        in_container = sim_cluster3.docker(head, "exec", "spark-vllm-ray-node-1", "test", "-e", marker, check=False)
        assert in_container.returncode != 0
    finally:
        deployment.destroy()
    assert netns_processes(sim_cluster3) == []
    rehearsal3_release.update(run.exports["release"])


rehearsal3_release: dict = {}


def test_a_second_stack_deploys_the_first_stacks_validated_release(sim_cluster3, rehearsal3, model_dir, tmp_path):
    """staging (the test above) validated a release; prod takes exactly that image and model."""
    if not rehearsal3_release:
        pytest.fail("the staging deployment above did not run")
    deployment, image = rehearsal3
    staging = "organization/spark-vllm/rehearsal"
    prod = Deployment(tmp_path, deployment.image_archives, stack="prod")
    config, secrets = rehearsal_config(sim_cluster3, image.ref, model_dir, pipeline_parallel=True)
    del config["image"], config["model"]
    config["promoteFrom"] = staging
    run, operations = prod.up(config, secrets, stack_outputs={staging: {"release": rehearsal3_release}})
    try:
        assert run.exports["release"]["image"] == rehearsal3_release["image"]
        assert run.exports["release"]["model"] == rehearsal3_release["model"]
        assert run.exports["release"]["engine"] == rehearsal3_release["engine"]
        assert run.exports["release"]["promotedFrom"] == staging and run.exports["release"]["validated"] is True
        images = {op.name for op in operations if op.typ.endswith("RemoteImage")}
        assert images == {"node-1-image", "node-2-image", "node-3-image"}
        chat(run.exports["endpoint"], secrets["apiKey"], run.exports["servedModelName"])
    finally:
        prod.destroy()
