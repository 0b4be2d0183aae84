"""The model copy's receiver trusts nothing of the depot it did not check (components/scripts/node_copy_tree.py
offer_problems; node_fabric_copy.py sync_model, fetch_file): the depot is a peer on the fabric, and a node taken
must not take the others. The spellings are ours: each row one way a manifest can reach out of the target.
Then a hostile depot for real (the depot's own program with its manifest replaced), as a node taken would run it."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from components.plan.programs import ENTRY, node_modules, script_program
from components.scripts import node_copy_tree
from tests.unit.test_fabric_copy import TOKEN, client, needs_root, wait_listening, write
from tests.waiting import free_port

ROOT = "/srv/models/Qwen3-0.6B"
GIB = 1 << 30


def problems(entries, free=100 * GIB) -> list[str]:
    return node_copy_tree.offer_problems(ROOT, entries, free)


FILE = {"type": "file", "size": 10, "mtime_ns": 1_700_000_000 * 10**9, "mode": 0o644}

HOSTILE = [
    ("a parent directory", {"../../../outside/pwned.sh": FILE}, "leaves the target"),
    ("a parent directory inside", {"sub/../../x": FILE}, "leaves the target"),
    ("an absolute path", {"/root/.ssh/authorized_keys": FILE}, "leaves the target"),
    ("a doubled slash", {"sub//x": FILE}, "leaves the target"),
    ("a dot segment", {"./x": FILE}, "leaves the target"),
    ("a trailing slash", {"sub/": FILE}, "leaves the target"),
    ("the root itself", {"": FILE}, "leaves the target"),
    ("a NUL", {"x\x00y": FILE}, "leaves the target"),
    ("a hidden name (the copy's own partial files are hidden)", {".x.partial": FILE}, "a hidden name"),
    ("a hidden directory", {".git/config": FILE}, "a hidden name"),
    ("a link to an absolute path", {"evil": {"type": "link", "target": "/etc/shadow"}}, "a link out of the target"),
    ("a link out by parents", {"evil": {"type": "link", "target": "../../../etc"}}, "a link out of the target"),
    ("a link out from a subdirectory", {"sub": {"type": "dir"}, "sub/e": {"type": "link", "target": "../../x"}},
     "a link out of the target"),
    ("a link with a NUL", {"evil": {"type": "link", "target": "a\x00b"}}, "a link out of the target"),
    ("a path through a link", {"d": {"type": "link", "target": "sub"}, "sub": {"type": "dir"}, "d/x": FILE},
     "through the link d"),
    ("a device", {"dev": {"type": "char", "size": 0}}, "a file, a directory or a link"),
    ("a negative size", {"x": {**FILE, "size": -1}}, "a size"),
    ("a size that is text", {"x": {**FILE, "size": "10"}}, "a size"),
    ("no mode", {"x": {k: v for k, v in FILE.items() if k != "mode"}}, "a mode"),
    ("a mode beyond a file's bits", {"x": {**FILE, "mode": 0o170777}}, "a mode"),
    ("not a manifest", ["x"], "a manifest"),
    ("an entry that is not one", {"x": "file"}, "a file, a directory or a link"),
]  # fmt: skip


@pytest.mark.parametrize(("name", "entries", "expected"), HOSTILE, ids=[row[0] for row in HOSTILE])
def test_a_hostile_manifest_is_refused_before_anything_is_written(name, entries, expected):
    found = problems(entries)
    assert found and any(expected in line for line in found), found


def test_more_than_the_disk_holds_is_refused_before_anything_is_written():
    entries = {"a": {**FILE, "size": 60 * GIB}, "b": {**FILE, "size": 50 * GIB}}
    (found,) = problems(entries, free=100 * GIB)
    assert "110.0 GiB to write, the disk has 100.0 GiB free" in found


def test_more_entries_than_a_model_has_are_refused():
    entries = {f"f{n}": FILE for n in range(node_copy_tree.MAX_ENTRIES + 1)}
    assert any("entries" in line for line in problems(entries))


def test_what_a_model_and_a_snapshot_hold_passes():
    snapshot = {
        "blobs": {"type": "dir"},
        "blobs/ab12": FILE,
        "snapshots": {"type": "dir"},
        "snapshots/c0ffee": {"type": "dir"},
        "snapshots/c0ffee/config.json": {"type": "link", "target": "../../blobs/ab12"},
        "snapshots/c0ffee/sub": {"type": "dir"},
        "snapshots/c0ffee/sub/t.jinja": {"type": "link", "target": "../../../blobs/ab12"},
        "template.jinja": {"type": "link", "target": "sub/chat_template.jinja"},
        "model-00001.safetensors": {**FILE, "mode": 0o4755},  # a setuid bit is masked, not refused
    }
    assert problems(snapshot) == []
    assert node_copy_tree.file_mode(0o4755) == 0o755 and node_copy_tree.file_mode(0o2777) == 0o755


# --- a hostile depot, for real -------------------------------------------------------------------------

HOSTILE_DEPOT = """
_real_manifest = manifest


def manifest(model_dir):  # what a node taken would serve: its own entries beside the model's
    entries, problems = _real_manifest(model_dir)
    entries.update(EXTRA)
    return entries, problems
"""


def hostile_depot(source: Path, at: Path, extra: dict, processes: list) -> int:
    """The depot's own program with EXTRA added to its manifest, seeing `source` at `at` (a bind mount in a mount
    namespace of its own, as the source node's copy is at the receiver's path)."""
    port = free_port()
    params = {"role": "serve", "node": "node-1", "source": "node-1", "address": "127.0.0.1", "port": port,
              "model_dir": str(at), "image_id": None}  # fmt: skip
    sources = dict(node_modules("node_fabric_copy.py"))
    marker = "sys.exit(main())"
    assert sources[ENTRY].count(marker) == 1
    sources[ENTRY] = sources[ENTRY].replace(marker, f"EXTRA = {extra!r}\n{HOSTILE_DEPOT}\n{marker}")
    program = script_program("node_fabric_copy.py", params, sources)
    at.mkdir(parents=True, exist_ok=True)
    bind = 'mount --bind "$1" "$2" && shift 2 && exec "$@"'
    argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", bind, "sh", str(source), str(at),
            sys.executable, "-u", "-c", program]  # fmt: skip
    process = subprocess.Popen(argv, env={**os.environ, "SPARK_VLLM_COPY_TOKEN": TOKEN}, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)  # fmt: skip
    processes.append(process)
    wait_listening(port, process)
    return port


@pytest.fixture
def processes():
    found: list = []
    yield found
    for process in found:
        process.kill()
        process.wait()


def listing(root: Path) -> list[str]:
    return sorted(str(path) for path in root.rglob("*"))


@needs_root
def test_a_hostile_depot_gets_nothing_written_outside_nor_inside(tmp_path, processes):
    """Beside the model, a file two levels up, an absolute path and a link to /etc/shadow: the receiver refuses the
    whole offer before it writes a byte, and says what it refused."""
    source, target = tmp_path / "source", tmp_path / "models" / "tiny"
    write(source / "config.json", "{}")
    write(tmp_path / "outside" / "pwned.sh", "#!/bin/sh\necho pwned\n")  # what the depot sends for ../../outside
    extra = {
        "../../outside/pwned.sh": {"type": "file", "size": 23, "mtime_ns": 0, "mode": 0o4755},
        f"{tmp_path}/abs.sh": {"type": "file", "size": 1, "mtime_ns": 0, "mode": 0o755},
        "shadow": {"type": "link", "target": "/etc/shadow"},
    }
    port = hostile_depot(source, target, extra, processes)
    before = listing(tmp_path)
    result, _ = client("model", port, model_dir=str(target))
    assert result.returncode == 1, result.stdout
    said = result.stdout
    assert "the depot's offer is refused" in said and "../../outside/pwned.sh" in said and "shadow" in said, said
    assert listing(tmp_path) == before  # not even the model's own config.json


@needs_root
def test_a_setuid_mode_from_the_depot_arrives_without_it(tmp_path, processes):
    source, target = tmp_path / "source", tmp_path / "models" / "tiny"
    write(source / "run.sh", "#!/bin/sh\n")
    os.chmod(source / "run.sh", 0o6775)  # setuid, setgid, group-writable
    port = hostile_depot(source, target, {}, processes)
    result, _ = client("model", port, model_dir=str(target))
    assert result.returncode == 0, result.stdout
    assert stat.S_IMODE(os.stat(target / "run.sh").st_mode) == 0o755
