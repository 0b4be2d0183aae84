"""A Hugging Face repo id downloaded once and copied over the fabric, through the real CLI and engine.

Two simulated nodes; a stand-in for the Hugging Face Hub (tests/e2e/hfhub.py) serves a gated repo on
this machine's management address, as the internet would. `container.hfCacheDir` is one path that
node-2's SSH sessions see as a directory of their own (empty at first). The copy source (node-1)
downloads the repo once with the stack's hfToken, using the huggingface_hub of the node's image;
node-2 receives the whole cache entry (blobs, refs, snapshot links) over the fabric; both
fingerprint the same snapshot; vLLM (the stand-in, offline like the program sets it) finds the
snapshot in its cache. The hub sees one client. A second `up` changes nothing and downloads nothing.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.e2e.hfhub import HubStandIn, Repo
from tests.e2e.rehearsal import chat, make_model, rehearsal_config

pytestmark = pytest.mark.e2e

REPO = "spark/tiny-chat"


def tree(root: Path) -> dict:
    found = {}
    for path in sorted(root.rglob("*")):
        relative = str(path.relative_to(root))
        if path.is_symlink():
            found[relative] = ("link", os.readlink(path))
        elif path.is_file():
            found[relative] = ("file", path.stat().st_size)
    return found


@pytest.fixture(scope="module")
def cache_views(sim_cluster, tmp_path_factory):
    """container.hfCacheDir: the host's directory (node-1 and the containers) and node-2's own."""
    shared = tmp_path_factory.mktemp("hf-cache")
    own = tmp_path_factory.mktemp("node-2-hf-cache")
    with sim_cluster.node_local_view(sim_cluster.nodes[1], shared, own):
        yield shared, own


@pytest.fixture(scope="module")
def stack(sim_cluster, image, cache_views, new_stack, tmp_path_factory):
    shared, _ = cache_views
    created = new_stack("hf-sync")
    config, secrets = rehearsal_config(
        sim_cluster,
        image.ref,
        Path("/unused"),
        modelSync={"enabled": True, "progressSeconds": 1},
        executor="mp",  # the subject is the model's way to the nodes, not the executor (Ray's: test_rehearsal.py)
    )
    source = make_model(tmp_path_factory.mktemp("hub-repos"), "tiny-chat")
    with open(source / "model-00001-of-00001.safetensors", "wb") as handle:
        handle.write(os.urandom(8 << 20))
    hub = HubStandIn(sim_cluster.host_mgmt_ip, {REPO: Repo(source, token=secrets["hfToken"])}).start()
    config["model"] = REPO
    config["container"] = {**config["container"], "hfCacheDir": str(shared), "hfEndpoint": hub.endpoint}
    created.configure(config, secrets)
    yield {"stack": created, "hub": hub, "secrets": secrets, "source": source}
    hub.stop()


def test_the_source_downloads_once_and_the_worker_receives_the_cache_entry(sim_cluster, stack, cache_views):
    shared, own = cache_views
    run = stack["stack"].up()
    stack["run"] = run
    hub = stack["hub"]
    head, worker = sim_cluster.nodes
    assert set(hub.downloads(REPO)) == {head.mgmt_ip}  # one client: the copy source
    assert hub.downloads(REPO)[head.mgmt_ip] == len([p for p in stack["source"].rglob("*") if p.is_file()])
    assert f"[{head.name}] downloading {REPO}" in run.output and "[node-2] model " in run.output
    entry = "hub/models--spark--tiny-chat"
    assert tree(own / entry) == tree(shared / entry) != {}
    snapshot = next((own / entry / "snapshots").iterdir())
    assert (own / entry / "refs" / "main").read_text() == snapshot.name
    assert os.readlink(snapshot / "config.json").startswith("../../blobs/")  # the links survive the copy
    assert (snapshot / "config.json").read_text() == (stack["source"] / "config.json").read_text()
    outputs = run.outputs
    assert outputs["memoryPlan"]["checked"] is True  # the size is known once downloaded
    assert chat(outputs["endpoint"], stack["secrets"]["apiKey"], outputs["servedModelName"])
    assert outputs["servedModelName"] == REPO


def test_a_second_up_changes_nothing_and_downloads_nothing(stack):
    before = dict(stack["hub"].downloads(REPO))
    assert stack["stack"].preview().changed == {}
    assert stack["stack"].up().changed == {}
    assert stack["hub"].downloads(REPO) == before
