"""The rehearsal on three simulated nodes: the dev way (a node added, then pipeline parallel with hostile
extra args), a rotated SSH credential, prod deploying on other nodes what staging validated, and last
vLLM's own multi-node executor (mp) with pipeline parallelism over the three (the image is already on
them: the other stacks are gone, and a destroy keeps it, as container.keepImage says).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.e2e.cli_stack import StackError
from tests.e2e.observe import RAY_NODES, container_ids, netns_processes, no_containers
from tests.e2e.rehearsal import BENCHMARK, chat, rehearsal_config

pytestmark = pytest.mark.e2e


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
            "host-check", "container", "supervisor", "joined",
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
        "spark-vllm-endpoint-smoke",  # runs again after the benchmark does
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


def test_three_nodes_mp_pipeline_parallel(sim_cluster3, image3, model_dir, new_stack):
    created = new_stack("mp-three")
    config, secrets = rehearsal_config(sim_cluster3, image3.ref, model_dir, pipeline_parallel=True, executor="mp")
    created.configure(config, secrets)
    run = created.up()
    chat(run.outputs["endpoint"], secrets["apiKey"], run.outputs["servedModelName"])
    log = sim_cluster3.docker(sim_cluster3.nodes[0], "exec", "spark-vllm-node-1", "cat", "/run/spark-vllm/vllm.log")
    assert "--pipeline-parallel-size=3" in log.stdout and "all 3 node(s) joined" in log.stdout
