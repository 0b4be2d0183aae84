"""Images and models carried between nodes over the fabric, through the real CLI and engine.

Two simulated nodes. The image exists on node-1 only, under a local tag no registry serves; the
model directory exists on node-1 only (node-2's SSH sessions see an empty directory at the same
path), with a symlink and a multi-GB sparse weight file beside a 256 MiB dense one. The first `pulumi
up` is cut: node-2's copy process is killed mid-copy, and the up fails naming node-2. The next `up`
finishes: node-2 receives the image id and the model over the fabric, its fingerprint matches, and
the stack serves. A second `up` copies nothing.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from pathlib import Path

import pytest

from tests.e2e.cli_stack import StackError
from tests.e2e.image.build import ensure_image, load_into
from tests.e2e.rehearsal import CACHE_DIR, chat, make_model, rehearsal_config

pytestmark = pytest.mark.e2e
NODES_WITHOUT_IMAGE = True  # the copy brings the image to node-2 (tests/e2e/seed.py: other modules' nodes hold it)

SPARSE = 4 << 30  # apparent size of the sparse weight file
# The dense one: long enough a copy to be cut (the test catches it within 20 ms of its partial file appearing). Its
# bytes are one random block over and over (a period of 16 MiB, beyond any compressor's window): 1 GiB of fresh
# randomness, written and hashed, cost this module about 10 CPU-s of its 14 (2026-12-07) and proved nothing more.
DENSE = 256 << 20
BLOCK = 16 << 20


def tree(root: Path) -> dict:
    found = {}
    for path in sorted(root.rglob("*")):
        relative = str(path.relative_to(root))
        if relative.startswith(".") or "/." in relative:
            continue
        if path.is_symlink():
            found[relative] = ("link", os.readlink(path))
        elif path.is_file():
            found[relative] = ("file", path.stat().st_size, int(path.stat().st_mtime))
        else:
            found[relative] = ("dir",)
    return found


def digest(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 22):
            sha.update(chunk)
    return sha.hexdigest()


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    model = make_model(tmp_path_factory.mktemp("copy-models"), "copied-model")
    with open(model / "model-00001-of-00002.safetensors", "wb") as handle:
        handle.truncate(SPARSE)
        for offset in (0, SPARSE // 2, SPARSE - (1 << 20)):
            handle.seek(offset)
            handle.write(os.urandom(1 << 20))
    block = os.urandom(BLOCK)
    with open(model / "model-00002-of-00002.safetensors", "wb") as handle:
        for _ in range(DENSE // BLOCK):
            handle.write(block)
    (model / "tokenizer.json").symlink_to("tokenizer_config.json")
    return model


@pytest.fixture(scope="module")
def local_image(sim_cluster):
    """The rehearsal image on node-1 only, under its local tag (no registry has that name)."""
    head = sim_cluster.nodes[0]
    info = ensure_image(CACHE_DIR, head.docker_host)
    load_into(info.archive, head.docker_host, info.image_id)
    missing = sim_cluster.docker(sim_cluster.nodes[1], "image", "inspect", info.image_id, check=False)
    assert missing.returncode != 0, "node-2 must start without the image"
    return info


@pytest.fixture(scope="module")
def node2_view(sim_cluster, model, tmp_path_factory):
    """node-2's own, empty directory at the model's path (as seen over SSH on node-2)."""
    own = tmp_path_factory.mktemp("node-2-model")
    with sim_cluster.node_local_view(sim_cluster.nodes[1], model, own):
        yield own


@pytest.fixture(scope="module")
def stack(sim_cluster, local_image, model, node2_view, new_stack):
    created = new_stack("copy")
    config, secrets = rehearsal_config(
        sim_cluster,
        local_image.ref,
        model,
        imageTransfer={"method": "copy", "progressSeconds": 1},
        modelSync={"enabled": True, "progressSeconds": 1},
        memoryCheck="off",  # a 5 GB model in this machine's memory is not the point here
        executor="mp",  # the subject is the copy, not the executor (Ray's: test_rehearsal.py, test_recovery.py)
    )
    created.configure(config, secrets)
    return {"stack": created, "config": config, "secrets": secrets}


def copy_process(node, marker: str) -> int | None:
    """The pid of `python3 -` in `node`'s network namespace whose parent is `marker` (the `timeout`
    wrapper of one remote command), or None."""
    netns = f"net:[{os.stat(node.netns_path).st_ino}]"
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            if len(argv) < 2 or not argv[0].endswith(b"python3") or argv[1] != b"-":
                continue
            if os.readlink(entry / "ns" / "net") != netns:
                continue
            status = (entry / "status").read_text()
            parent = next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:"))
            if marker.encode() in (Path("/proc") / parent / "cmdline").read_bytes().replace(b"\0", b" "):
                return int(entry.name)
        except OSError:
            continue
    return None


def test_a_worker_killed_mid_copy_fails_naming_it_and_the_next_up_finishes(
    sim_cluster, stack, model, node2_view, local_image
):
    killed, seen, argvs = {}, [], stack.setdefault("copy_argvs", set())

    def kill_when_copying():
        marker = f"timeout --kill-after=10 {14400 + 30} python3 -"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            pid = copy_process(sim_cluster.nodes[1], marker)
            partial = node2_view / ".model-00002-of-00002.safetensors.spark-vllm-partial"
            seen.append((pid, partial.exists()))
            if pid:
                try:
                    argvs.add((Path("/proc") / str(pid) / "cmdline").read_bytes())
                except OSError:
                    pass
            if pid and partial.exists():
                os.kill(pid, 9)
                killed["pid"] = pid
                return
            time.sleep(0.02)

    killer = threading.Thread(target=kill_when_copying, daemon=True)
    killer.start()
    try:
        stack["stack"].up()
        failed = None
    except StackError as error:
        failed = error
    killer.join(5)
    assert killed, f"the model copy was never caught in flight: {sorted(set(seen), key=str)}"
    assert failed is not None, "the up went through although node-2's copy was killed"
    failure = str(failed)
    # the image went over in the same up, beside the model
    assert "[node-2] copying image" in failed.output and "loaded, image id checked" in failed.output
    assert "(node-2-model-sync): error:" in failure and "[node-2] model" in failure
    assert not (node2_view / "model-00002-of-00002.safetensors").exists()  # no half file in place

    run = stack["stack"].up()
    stack["run"] = run
    assert "[node-2] model " in run.output and "nothing to copy" not in run.output
    image = sim_cluster.docker(sim_cluster.nodes[1], "image", "inspect", "-f", "{{.Id}}", local_image.ref)
    assert image.stdout.strip() == local_image.image_id  # received, checked, and tagged as configured
    assert run.outputs["release"]["image"] == local_image.image_id  # no registry holds it: named by id
    assert tree(node2_view) == tree(model)
    assert digest(node2_view / "model-00002-of-00002.safetensors") == digest(model / "model-00002-of-00002.safetensors")
    assert (node2_view / "model-00001-of-00002.safetensors").stat().st_blocks * 512 < 64 << 20  # still sparse
    assert os.readlink(node2_view / "tokenizer.json") == "tokenizer_config.json"
    outputs = run.outputs
    assert chat(outputs["endpoint"], stack["secrets"]["apiKey"], outputs["servedModelName"])


def test_the_copy_token_is_on_no_command_line_and_the_depots_environment_is_roots_alone(sim_cluster, stack):
    """#58: the token is in the state (a secret), the depot's environment and each receiver's program on stdin —
    nowhere a node's other users can read: no process's argv (the receiver's, caught mid-copy above, included),
    and the depot's /proc environ is its owner's (root's) alone."""
    head = sim_cluster.nodes[0]
    env = sim_cluster.docker(head, "inspect", "-f", "{{range .Config.Env}}{{println .}}{{end}}", "spark-vllm.depot")
    token = next(line.split("=", 1)[1] for line in env.stdout.splitlines() if line.startswith("SPARK_VLLM_COPY_TOKEN="))
    assert len(token) == 64 and stack["copy_argvs"], "the receiver's command line was never seen"
    assert not [argv for argv in stack["copy_argvs"] if token.encode() in argv]
    pid = int(sim_cluster.docker(head, "inspect", "-f", "{{.State.Pid}}", "spark-vllm.depot").stdout)
    leaking = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and token.encode() in (entry / "cmdline").read_bytes():
                leaking.append(entry.name)
        except OSError:
            continue
    assert leaking == []
    environ = os.stat(f"/proc/{pid}/environ")
    assert environ.st_uid == 0 and environ.st_mode & 0o077 == 0


def test_a_second_up_copies_nothing(sim_cluster, stack):
    preview = stack["stack"].preview()
    assert preview.changed == {}
    run = stack["stack"].up()
    assert run.changed == {} and "copying" not in run.output
