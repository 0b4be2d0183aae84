"""`docker save` archives made by hand: the two layouts Docker writes (legacy: <layer>/layer.tar, <config>.json,
manifest.json, repositories; OCI, Docker 25 and later: blobs/sha256/…, index.json, manifest.json, oci-layout) and
hostile ones, each an image id as Docker computes it (the sha256 of its config)."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile

ARCHIVE_TIME = 1_700_000_000


def config_for(seed: str) -> bytes:
    return json.dumps({"architecture": "amd64", "os": "linux", "config": {"Cmd": ["vllm"]}, "seed": seed}).encode()


def image_id(config: bytes) -> str:
    return "sha256:" + hashlib.sha256(config).hexdigest()


def add(archive: tarfile.TarFile, name: str, data: bytes = b"", kind: bytes = tarfile.REGTYPE, **fields) -> None:
    info = tarfile.TarInfo(name)
    info.type, info.size, info.mtime = (
        kind,
        len(data) if kind in (tarfile.REGTYPE, tarfile.AREGTYPE) else 0,
        ARCHIVE_TIME,
    )
    for key, value in fields.items():
        setattr(info, key, value)
    archive.addfile(info, io.BytesIO(data) if info.size else None)


def legacy(config: bytes, layer: bytes, repo_tags=None, extra=(), repositories=None, manifest=None) -> bytes:
    """A legacy `docker save` (what Docker 20.10 writes): `extra` is (name, data, kind, fields) added before the
    metadata; `manifest` replaces the manifest's list."""
    digest = image_id(config).split(":")[1]
    layer_dir = hashlib.sha256(layer).hexdigest()
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT) as archive:
        add(archive, f"{layer_dir}/", kind=tarfile.DIRTYPE)
        add(archive, f"{layer_dir}/VERSION", b"1.0")
        add(archive, f"{layer_dir}/json", b"{}")
        add(archive, f"{layer_dir}/layer.tar", layer)
        add(archive, f"{digest}.json", config)
        for name, data, kind, fields in extra:
            add(archive, name, data, kind, **fields)
        entries = (
            manifest
            if manifest is not None
            else [{"Config": f"{digest}.json", "RepoTags": repo_tags, "Layers": [f"{layer_dir}/layer.tar"]}]
        )
        add(archive, "manifest.json", json.dumps(entries).encode())
        if repositories is not None:
            add(archive, "repositories", json.dumps(repositories).encode())
    return buffer.getvalue()


def oci(config: bytes, layer: bytes, annotations=None, pax=False) -> bytes:
    """Docker 25's layout; `pax`: every header in PAX format (as Go's archive/tar writes a long name or a large
    size)."""
    digest = image_id(config).split(":")[1]
    layer_digest = hashlib.sha256(layer).hexdigest()
    manifest = json.dumps({"config": {"digest": f"sha256:{digest}"}, "layers": [{"digest": f"sha256:{layer_digest}"}]})
    manifest_digest = hashlib.sha256(manifest.encode()).hexdigest()
    index = {
        "schemaVersion": 2,
        "manifests": [{"digest": f"sha256:{manifest_digest}", **({"annotations": annotations} if annotations else {})}],
    }
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT if pax else tarfile.USTAR_FORMAT) as archive:
        for name in ("blobs/", "blobs/sha256/"):
            add(archive, name, kind=tarfile.DIRTYPE)
        add(archive, f"blobs/sha256/{digest}", config)
        add(archive, f"blobs/sha256/{layer_digest}", layer)
        add(archive, f"blobs/sha256/{manifest_digest}", manifest.encode())
        add(archive, "index.json", json.dumps(index).encode())
        entry = [{"Config": f"blobs/sha256/{digest}", "RepoTags": None, "Layers": [f"blobs/sha256/{layer_digest}"]}]
        add(archive, "manifest.json", json.dumps(entry).encode())
        add(archive, "oci-layout", b'{"imageLayoutVersion": "1.0.0"}')
    return buffer.getvalue()


def loaded(body: bytes, by_index: bool = False) -> tuple[list[str], list[str]]:
    """What `docker load` makes of an archive, as far as names go (moby image/tarexport/load.go): the image ids
    (each config's sha256; `by_index`, Docker keeping images in containerd: index.json's descriptors' digests) and
    the names it gives them (RepoTags, or with no manifest.json the repositories file). Raises tarfile.TarError,
    KeyError or ValueError where Docker's load fails."""
    with tarfile.open(fileobj=io.BytesIO(body), mode="r:") as archive:
        files = {member.name.lstrip("./"): member for member in archive.getmembers()}
        if "manifest.json" not in files:
            raise KeyError("manifest.json")
        entries = json.load(archive.extractfile(files["manifest.json"]))
        ids = [image_id(archive.extractfile(files[entry["Config"]]).read()) for entry in entries]
        if by_index:
            ids = [m["digest"] for m in json.load(archive.extractfile(files["index.json"]))["manifests"]]
        names = [tag for entry in entries for tag in entry.get("RepoTags") or []]
    return ids, names
