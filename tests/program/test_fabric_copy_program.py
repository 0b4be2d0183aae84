"""Copies over the fabric under Pulumi's mocks: the depot on the copy source, what each receiving
node runs, the order of it all, secrets, and what a change touches."""

import json

import pytest

from components.config import ConfigError
from components.resources.depot import sync_root
from tests.harness import CONTAINER, HF_CACHE, REMOTE_COMMAND, changed_inputs, run_program, shared_run, strip_secrets
from tests.program.test_program import SECRETS, prod

TOKEN = "1e" * 32  # what the fake cloud's fabric-copy-token prints
SOURCE_ID = "sha256:" + "ab" * 32  # the fake cloud's image id


def copying(**changes) -> dict:
    return prod(imageTransfer={"method": "copy"}, modelSync={"enabled": True}, **changes)


@pytest.fixture(scope="module")
def run():
    return shared_run(copying(), SECRETS, stack="prod")


def own_mounts(container) -> list[dict]:
    """The depot's mounts but the guard's marker (the prod stack has the guard: test_program covers that mount)."""
    return [m for m in container.inputs["mounts"] if m["source"] != "spark-vllm-guard"]


def entrypoint_params(container) -> dict:
    program = container.inputs["entrypoints"][-1]  # the last: behind the guard's gate or not
    return json.loads(json.loads(program.split("\n", 1)[0].removeprefix("PARAMS = ")))


def test_the_depot_runs_on_the_head_bound_to_its_fabric_address(run):
    depot = run.named("spark-vllm-depot")
    assert depot.typ == CONTAINER and depot.provider.startswith(run.named("spark-01-docker").urn)
    assert depot.inputs["name"] == "spark-vllm.depot" and depot.inputs["networkMode"] == "host"
    assert depot.inputs["image"] == SOURCE_ID and depot.inputs["restart"] == "unless-stopped"
    assert entrypoint_params(depot) == {
        "role": "serve",
        "node": "spark-01",
        "source": "spark-01",
        "address": "192.168.200.12",
        "port": 29650,
        "image_id": SOURCE_ID,
        "model_dir": "/models/Qwen3.5-122B-A10B-FP8",
    }
    mounts = {(m["source"], m["target"], m.get("readOnly", False)) for m in own_mounts(depot)}
    assert mounts == {
        ("/var/run/docker.sock", "/var/run/docker.sock", False),
        ("/models/Qwen3.5-122B-A10B-FP8", "/models/Qwen3.5-122B-A10B-FP8", True),
    }
    # the token reaches the depot as secret env, the clients in their secret stdin; never in plain
    assert depot.inputs["envs"] == [f"SPARK_VLLM_COPY_TOKEN={TOKEN}"] and "envs" in depot.secret_paths()
    assert "stdout" in run.named("fabric-copy-token").additional_secret_outputs
    plain = json.dumps([strip_secrets(r.wire) for r in run.registrations]) + json.dumps(run.exports)
    assert TOKEN not in plain


def test_the_head_pulls_and_the_worker_receives_that_image_id(run):
    names = {r.name for r in run.registrations}
    assert {"spark-01-pull", "spark-01-image", "spark-02-image-copy", "spark-02-image"} <= names
    assert "spark-02-pull" not in names and "spark-01-image-copy" not in names
    copy = run.named("spark-02-image-copy")
    assert copy.typ == REMOTE_COMMAND and copy.inputs["triggers"] == [SOURCE_ID]
    assert run.named("spark-vllm-depot").urn in copy.dependencies
    assert copy.inputs["create"] == "timeout --kill-after=10 3630 python3 -" and "stdin" in copy.secret_paths()
    params = json.loads(json.loads(copy.inputs["stdin"].split("\n", 1)[0].removeprefix("PARAMS = ")))
    assert params == {
        "role": "image",
        "node": "spark-02",
        "source": "spark-01",
        "address": "192.168.200.12",
        "port": 29650,
        "token": TOKEN,
        "image_id": SOURCE_ID,
        "reference": copying()["image"],
        "progress_seconds": 10,
    }
    image = run.named("spark-02-image")
    assert image.inputs["name"] == SOURCE_ID and copy.urn in image.dependencies  # the id, never a tag


def test_the_worker_checks_its_model_only_after_the_copy_and_again_after_a_new_one(run):
    sync = run.named("spark-02-model-sync")
    assert run.named("spark-vllm-depot").urn in sync.dependencies
    assert sync.inputs["triggers"] == ["/models/Qwen3.5-122B-A10B-FP8", "f" * 64]  # the source's fingerprint
    assert sync.urn in run.named("spark-02-preflight").dependencies
    assert "f" * 64 in run.named("spark-02-model-fingerprint").inputs["triggers"]
    assert "spark-01-model-sync" not in {r.name for r in run.registrations}
    params = json.loads(json.loads(sync.inputs["stdin"].split("\n", 1)[0].removeprefix("PARAMS = ")))
    assert params["role"] == "model" and params["model_dir"] == "/models/Qwen3.5-122B-A10B-FP8"


def test_another_copy_source_moves_the_depot_and_the_direction():
    run = run_program(copying(fabricCopy={"source": "spark-02", "port": 29700}), SECRETS, stack="prod")
    depot = run.named("spark-vllm-depot")
    assert depot.provider.startswith(run.named("spark-02-docker").urn)
    assert entrypoint_params(depot)["address"] == "192.168.200.13" and entrypoint_params(depot)["port"] == 29700
    names = {r.name for r in run.registrations}
    assert {"spark-02-pull", "spark-01-image-copy", "spark-01-model-sync"} <= names
    assert not {"spark-01-pull", "spark-02-image-copy", "spark-02-model-sync"} & names


def test_only_a_model_sync_serves_no_image_and_mounts_no_docker_socket():
    run = run_program(prod(modelSync={"enabled": True}), SECRETS, stack="prod")
    depot = run.named("spark-vllm-depot")
    assert entrypoint_params(depot)["image_id"] is None
    assert [m["source"] for m in own_mounts(depot)] == ["/models/Qwen3.5-122B-A10B-FP8"]
    names = {r.name for r in run.registrations}
    assert {"spark-01-pull", "spark-02-pull", "spark-02-model-sync"} <= names and "spark-02-image-copy" not in names


def test_nothing_copied_means_no_depot_and_no_token():
    names = {r.name for r in shared_run(prod(), SECRETS, stack="prod").registrations}
    assert not {"spark-vllm-depot", "fabric-copy-token"} & names
    assert not any(name.endswith(("-image-copy", "-model-sync")) for name in names)


def test_one_node_copies_nothing():
    config = copying(nodes=prod()["nodes"][:1], tensorParallelSize=1, memoryCheck="off")
    names = {r.name for r in run_program(config, SECRETS, stack="prod").registrations}
    assert "spark-vllm-depot" not in names and "spark-01-pull" in names


def test_a_hugging_face_snapshot_is_served_with_its_repository():
    model = "/data/hub/models--Qwen--Qwen3-0.6B/snapshots/c1899de2"
    assert sync_root(model) == "/data/hub/models--Qwen--Qwen3-0.6B"
    assert sync_root("/models/snapshots/x") == "/models/snapshots/x" and sync_root("/models/Qwen/") == "/models/Qwen"
    run = run_program(prod(modelSync={"enabled": True}, model=model), SECRETS, stack="prod")
    mounts = own_mounts(run.named("spark-vllm-depot"))
    assert [(m["source"], m["target"]) for m in mounts] == [("/data/hub/models--Qwen--Qwen3-0.6B",) * 2]


def test_the_scripts_rule_for_the_sync_root_is_the_programs():
    from components.scripts import node_copy_tree

    for model in ("/data/hub/models--Qwen--Qwen3-0.6B/snapshots/c1899de2", "/models/Qwen", "/a/snapshots/b"):
        assert node_copy_tree.sync_root(model) == sync_root(model)


def test_a_vllm_only_change_touches_no_copy():
    result = changed_inputs(
        shared_run(copying(), SECRETS, stack="prod"), shared_run(copying(maxModelLen=16384), SECRETS, stack="prod")
    )
    assert set(result) <= {"spark-vllm-serve", "spark-vllm-ready", "spark-vllm-smoke", "spark-vllm-benchmark",
                           "spark-vllm-cluster-ready"}  # fmt: skip


def test_turning_the_copy_on_for_a_running_stack_keeps_its_containers():
    result = changed_inputs(shared_run(prod(), SECRETS, stack="prod"), shared_run(copying(), SECRETS, stack="prod"))
    assert result["spark-vllm-depot"] == "create" and result["spark-02-image-copy"] == "create"
    assert result["spark-02-pull"] == "delete" and result["spark-02-model-sync"] == "create"
    # the worker's image is named by id now (the same image), and its model is checked again
    assert result["spark-02-image"] == {"name"}
    assert not any(name.endswith("-container") for name in result)


def test_a_repo_id_without_a_cache_directory_cannot_be_synced():
    with pytest.raises(ConfigError) as caught:
        run_program(prod(modelSync={"enabled": True}, model="Qwen/Qwen3-0.6B"), SECRETS, stack="prod")
    assert "container.hfCacheDir: None — a host directory, because modelSync copies model" in str(caught.value)


REPO = "Qwen/Qwen3-0.6B"
REPO_DIR = f"{HF_CACHE}/hub/models--Qwen--Qwen3-0.6B"
SNAPSHOT = f"{REPO_DIR}/snapshots/{'c' * 40}"


@pytest.fixture(scope="module")
def repo_run():
    cfg = copying(model=REPO, container={"hfCacheDir": HF_CACHE, "hfEndpoint": "https://hf-mirror.example"})
    return run_program(cfg, SECRETS, stack="prod")


def test_a_repo_id_is_downloaded_once_on_the_source_with_the_token_as_a_secret(repo_run):
    names = {r.name for r in repo_run.registrations}
    assert "spark-01-model-download" in names and "spark-02-model-download" not in names
    download = repo_run.named("spark-01-model-download")
    assert download.inputs["create"] == (
        "mkdir -p /srv/hf && timeout --kill-after=10 14430 docker run --rm -i --network host "
        '--user "$(id -u):$(id -g)" --mount type=bind,source=/srv/hf,target=/spark-vllm-hf '
        f"--entrypoint python3 {SOURCE_ID} -"
    )
    params = json.loads(json.loads(download.inputs["stdin"].split("\n", 1)[0].removeprefix("PARAMS = ")))
    assert params == {
        "node": "spark-01",
        "repo": REPO,
        "hf_home": "/spark-vllm-hf",
        "host_cache": HF_CACHE,
        "endpoint": "https://hf-mirror.example",
        "token": SECRETS["hfToken"],
        "progress_seconds": 10,
    }
    assert "stdin" in download.secret_paths() and download.inputs["triggers"] == [REPO]
    plain = json.dumps([strip_secrets(r.wire) for r in repo_run.registrations])
    assert SECRETS["hfToken"] not in plain


def test_the_depot_serves_the_repos_cache_directory_and_the_worker_syncs_it(repo_run):
    depot, download = repo_run.named("spark-vllm-depot"), repo_run.named("spark-01-model-download")
    assert download.urn in depot.dependencies
    mounts = {(m["source"], m["target"], m.get("readOnly", False)) for m in own_mounts(depot)}
    assert (REPO_DIR, REPO_DIR, True) in mounts
    assert entrypoint_params(depot)["model_dir"] == REPO_DIR
    sync = repo_run.named("spark-02-model-sync")
    params = json.loads(json.loads(sync.inputs["stdin"].split("\n", 1)[0].removeprefix("PARAMS = ")))
    assert params["model_dir"] == REPO_DIR


def test_every_node_checks_and_fingerprints_the_snapshot_and_asks_the_hub_nothing(repo_run):
    for node in ("spark-01", "spark-02"):
        fingerprint = repo_run.named(f"{node}-model-fingerprint")
        assert fingerprint.inputs["create"].startswith(f"python3 - {SNAPSHOT} <<")
        assert f"MODEL={SNAPSHOT}" in repo_run.named(f"{node}-preflight").inputs["create"]
        env = dict(e.split("=", 1) for e in repo_run.named(f"{node}-container").inputs["envs"])
        assert env["HF_HUB_OFFLINE"] == "1" and env["HF_ENDPOINT"] == "https://hf-mirror.example"
    source_checks = repo_run.named("spark-01-preflight")
    assert repo_run.named("spark-01-model-download").urn in source_checks.dependencies
    assert repo_run.exports["memoryPlan"]["checked"] is True  # the size is known once downloaded
    assert f"--served-model-name={REPO}" in repo_run.named("spark-vllm-serve").inputs["stdin"]  # vLLM gets the id


def test_a_promoted_repo_id_without_a_cache_directory_stops_with_the_fix():
    from tests.harness import FakeCloud

    release = {"image": "hellohal2064/vllm-qwen3.5-gb10@sha256:" + "ab" * 32, "model": REPO,
               "engine": {"maxModelLen": 4096}, "validated": True, "fingerprint": "0" * 16}  # fmt: skip
    cloud = FakeCloud(stack_outputs={"organization/spark-vllm/staging": {"release": release}})
    cfg = copying(promoteFrom="organization/spark-vllm/staging")
    del cfg["image"], cfg["model"]
    with pytest.raises(Exception, match="container.hfCacheDir is not set: set it to a host directory"):
        run_program(cfg, SECRETS, stack="prod", mocks=cloud)


def test_with_copies_on_a_node_added_gets_its_copies_and_the_others_keep_theirs():
    three = copying(tensorParallelSize=3)
    three["nodes"] = [
        *three["nodes"],
        {**three["nodes"][1], "name": "spark-03", "host": "spark-03.lan", "fabricAddress": "192.168.200.14"},
    ]
    result = changed_inputs(shared_run(copying(), SECRETS, stack="prod"), shared_run(three, SECRETS, stack="prod"))
    assert result["spark-03-image-copy"] == result["spark-03-model-sync"] == "create"
    assert "spark-03-pull" not in result
    touched = {name for name in result if not name.startswith("spark-03")}
    assert not {"spark-vllm-depot", "fabric-copy-token", "spark-02-image-copy", "spark-02-model-sync"} & touched
    assert not any(name.endswith(("-image", "-container", "-docker")) for name in touched)
