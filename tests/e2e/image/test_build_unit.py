"""Unit tests of the image builder's logic that need neither docker nor debootstrap."""

from __future__ import annotations

import io
import json
import tarfile
import threading
import time
from pathlib import Path

from . import build


def _fake_archive(path: Path, config: str, tag: str) -> None:
    data = json.dumps([{"Config": config, "RepoTags": [tag], "Layers": []}]).encode()
    with tarfile.open(path, "w") as t:
        info = tarfile.TarInfo("manifest.json")
        info.size = len(data)
        t.addfile(info, io.BytesIO(data))


def test_ref_and_archive_name_follow_the_content_hash(tmp_path):
    h = build.content_hash()
    assert len(h) == 12 and int(h, 16) >= 0
    assert build.image_ref() == f"spark-vllm-rehearsal:{h}"
    assert build.archive_path(tmp_path) == tmp_path / f"spark-vllm-rehearsal-{h}.tar"
    assert build.content_hash() == h


def test_hash_covers_standin_sources(monkeypatch, tmp_path):
    pkg = tmp_path / "vllm_standin"
    pkg.mkdir()
    (pkg / "a.py").write_text("x = 1\n")
    monkeypatch.setattr(build, "STANDIN_PKG", pkg)
    h1 = build.content_hash()
    (pkg / "a.py").write_text("x = 2\n")
    assert build.content_hash() != h1


def test_archive_image_id_both_layouts(tmp_path):
    a = tmp_path / "a.tar"
    _fake_archive(a, "0123abcd.json", "r:1")
    assert build.archive_image_id(a) == "sha256:0123abcd"
    assert build.archive_ref(a) == "r:1"
    _fake_archive(a, "blobs/sha256/4567ef", "r:1")
    assert build.archive_image_id(a) == "sha256:4567ef"


def test_debian_mirror_override(monkeypatch):
    monkeypatch.setenv("REHEARSAL_DEBIAN_MIRROR", "http://mirror.example/debian")
    assert build.debian_mirror() == "http://mirror.example/debian"
    monkeypatch.delenv("REHEARSAL_DEBIAN_MIRROR")
    assert build.debian_mirror().startswith("http")


def test_concurrent_ensure_image_builds_once(monkeypatch, tmp_path):
    calls = []

    def fake_build(cache_dir, docker_host):
        calls.append(docker_host)
        time.sleep(0.3)
        _fake_archive(build.archive_path(cache_dir), "feed.json", build.image_ref())
        return {"debootstrap": 0.3}

    monkeypatch.setattr(build, "build_archive", fake_build)
    monkeypatch.setattr(build, "load_into", lambda archive, host, image_id=None: image_id)
    results = []
    threads = [threading.Thread(target=lambda h=h: results.append(build.ensure_image(tmp_path, h))) for h in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert sorted(r.built for r in results) == [False, True]
    assert {r.image_id for r in results} == {"sha256:feed"}


def test_safe_rmtree_removes_plain_trees(tmp_path):
    root = tmp_path / "rootfs"
    (root / "a" / "b").mkdir(parents=True)
    (root / "a" / "b" / "f").write_text("x")
    build.safe_rmtree(root)
    assert not root.exists()
