"""What an image receiver lets through to `docker load` (components/scripts/node_image_archive.py): the depot's
`docker save` of one image id and nothing else. #58: a depot (or anyone holding the copy token) could hand a
receiver an archive that loads other images too and names any of them as this node's images are named
(`haproxy:3.0`, the router's image), which `docker load` does from the archive's manifest.json, index.json or
repositories; the id check after the load came too late. Each hostile spelling below is refused before
`docker load` has the archive's metadata; Docker's own archives (both layouts, any chunking) pass unchanged."""

from __future__ import annotations

import io
import json
import os
import tarfile

import pytest

from components.scripts import node_image_archive as archive_check
from tests.image_archives import config_for, image_id, legacy, loaded, oci
from tests.unit.test_fabric_copy import client, depot, dockers  # noqa: F401 - the fixtures, used by name

CONFIG = config_for("vllm")
WANTED = image_id(CONFIG)
LAYER = os.urandom(300_000)
OTHER = config_for("evil")
REG, LNK, SYM, DIR = tarfile.REGTYPE, tarfile.LNKTYPE, tarfile.SYMTYPE, tarfile.DIRTYPE


def through(archive: bytes, chunk: int) -> bytes:
    check, out = archive_check.ArchiveCheck(WANTED), bytearray()
    for at in range(0, len(archive), chunk):
        out += b"".join(check.feed(archive[at : at + chunk]))
    check.finish()
    return bytes(out)


def another_manifest(digest_name: str, tags=()) -> bytes:
    return json.dumps([{"Config": digest_name, "RepoTags": list(tags), "Layers": []}]).encode()


def end_of(archive: bytes) -> bytes:
    """The archive up to its end (two empty blocks), as `docker load` reads it."""
    with tarfile.open(fileobj=io.BytesIO(archive)) as opened:
        opened.getmembers()
        return archive[: opened.offset + 1024]


def with_extra(*extra, format=tarfile.USTAR_FORMAT, **given) -> bytes:  # noqa: A002 - tarfile's own name
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=format) as archive:
        with tarfile.open(fileobj=io.BytesIO(legacy(CONFIG, LAYER, **given))) as plain:
            for member in plain.getmembers():
                if member.name == "manifest.json":
                    for name, data, kind, fields in extra:
                        info = tarfile.TarInfo(name)
                        info.type, info.size = kind, len(data) if kind == REG else 0
                        for key, value in fields.items():
                            setattr(info, key, value)
                        archive.addfile(info, io.BytesIO(data) if info.size else None)
                archive.addfile(member, plain.extractfile(member) if member.isfile() else None)
    return buffer.getvalue()


def replaced(archive: bytes, name: str, data: bytes) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT) as out:
        with tarfile.open(fileobj=io.BytesIO(archive)) as plain:
            for member in plain.getmembers():
                content = plain.extractfile(member).read() if member.isfile() else None
                if member.name == name:
                    member.size, content = len(data), data
                out.addfile(member, io.BytesIO(content) if content is not None else None)
    return buffer.getvalue()


@pytest.mark.parametrize("chunk", [1, 7, 511, 512, 513, 65536, 1 << 30])
@pytest.mark.parametrize("layout", ["legacy", "oci", "oci-pax"])
def test_dockers_own_archives_pass_unchanged_however_they_arrive(layout, chunk):
    archive = {"legacy": lambda: legacy(CONFIG, LAYER), "oci": lambda: oci(CONFIG, LAYER),
               "oci-pax": lambda: oci(CONFIG, LAYER, pax=True)}[layout]()  # fmt: skip
    if chunk == 1 and layout != "legacy":
        pytest.skip("one byte at a time is slow: the legacy layout stands for it")
    assert through(archive, chunk) == end_of(archive)
    assert loaded(end_of(archive)) == ([WANTED], [])


OTHER_NAME = f"{image_id(OTHER)[7:]}.json"
TWO_IMAGES = [
    {"Config": f"{WANTED[7:]}.json", "RepoTags": None, "Layers": []},
    {"Config": OTHER_NAME, "RepoTags": None, "Layers": []},
]
HOSTILE = {
    # names docker load would give
    "RepoTags": (lambda: legacy(CONFIG, LAYER, repo_tags=["haproxy:3.0"]), "names its image ['haproxy:3.0']"),
    "RepoTags, a registry's": (lambda: legacy(CONFIG, LAYER, repo_tags=["registry.lan:5000/vllm:gb10"]), "names its image"),
    "repositories": (lambda: legacy(CONFIG, LAYER, repositories={"haproxy": {"3.0": "x"}}), "names images in repositories"),
    "index.json's containerd name": (lambda: oci(CONFIG, LAYER, annotations={"io.containerd.image.name": "docker.io/library/haproxy:3.0"}), "names its image in index.json"),
    "index.json's OCI ref name": (lambda: oci(CONFIG, LAYER, annotations={"org.opencontainers.image.ref.name": "3.0"}), "names its image in index.json"),
    # more images, or another
    "two images": (lambda: legacy(CONFIG, LAYER, manifest=TWO_IMAGES, extra=[(OTHER_NAME, OTHER, REG, {})]), "holds 2 images"),
    "no image": (lambda: legacy(CONFIG, LAYER, manifest=[]), "holds 0 images"),
    "another image": (lambda: legacy(OTHER, LAYER), "holds the image"),
    "a manifest that is no list": (lambda: legacy(CONFIG, LAYER, manifest={"Config": "x"}), "images, not the one asked for"),
    # a second manifest.json, under another spelling of its path
    "manifest.json twice": (lambda: with_extra(("manifest.json", another_manifest(f"{WANTED[7:]}.json"), REG, {})), "holds manifest.json twice"),
    "./manifest.json": (lambda: with_extra(("./manifest.json", another_manifest(f"{WANTED[7:]}.json"), REG, {})), "holds manifest.json twice"),
    "x/../manifest.json": (lambda: with_extra(("x/../manifest.json", b"[]", REG, {})), "a path outside the archive"),
    "//manifest.json": (lambda: with_extra(("//manifest.json", b"[]", REG, {})), "an absolute path"),
    "../outside": (lambda: with_extra(("../outside", b"x", REG, {})), "a path outside the archive"),
    "a link named manifest.json": (lambda: with_extra(("manifest.json", b"", SYM, {"linkname": "evil.json"})), "holds manifest.json twice, as other than a file"),
    "a hard link named repositories": (lambda: with_extra(("repositories", b"", LNK, {"linkname": "evil.json"})), "as other than a file"),
    "a directory named index.json": (lambda: with_extra(("index.json", b"", DIR, {})), "as other than a file"),
    "a path through a link": (lambda: with_extra(("up", b"", SYM, {"linkname": "."}), ("up/manifest.json", b"[]", REG, {})), "a path through a link"),
    "a path through a link, two deep": (lambda: with_extra(("a", b"", DIR, {}), ("a/b", b"", SYM, {"linkname": ".."}), ("a/b/x/manifest.json", b"[]", REG, {})), "a path through a link"),
    # PAX and GNU spellings of a name
    "PAX path": (lambda: with_extra(("harmless", another_manifest(f"{WANTED[7:]}.json"), REG, {"pax_headers": {"path": "manifest.json"}}), format=tarfile.PAX_FORMAT), "holds manifest.json twice"),
    "GNU long name": (lambda: with_extra(("./" * 60 + "manifest.json", another_manifest(f"{WANTED[7:]}.json"), REG, {}), format=tarfile.GNU_FORMAT), "holds manifest.json twice"),
    # what docker save never writes
    "a device": (lambda: with_extra(("dev", b"", tarfile.CHRTYPE, {"devmajor": 1, "devminor": 3})), "a device, a FIFO"),
    "a FIFO": (lambda: with_extra(("pipe", b"", tarfile.FIFOTYPE, {})), "a device, a FIFO"),
    "a manifest over 1 MiB": (lambda: legacy(CONFIG, LAYER, manifest=[{"Config": f"{WANTED[7:]}.json", "RepoTags": None, "Layers": ["x" * (1 << 20)]}]), "over 1 MiB"),
    "a manifest that is not JSON": (lambda: replaced(legacy(CONFIG, LAYER), "manifest.json", b"[{\xff"), "is not JSON"),
}  # fmt: skip


@pytest.mark.parametrize("spelling", HOSTILE)
def test_a_hostile_archive_is_refused_before_docker_load_has_its_metadata(spelling):
    make, said = HOSTILE[spelling]
    archive = make()
    for chunk in (512, 4096, 1 << 30):
        check, passed = archive_check.ArchiveCheck(WANTED), bytearray()
        with pytest.raises(archive_check.ArchiveError) as refused:
            for at in range(0, len(archive), chunk):
                passed += b"".join(check.feed(archive[at : at + chunk]))
            check.finish()
        assert said in str(refused.value), str(refused.value)
        try:  # what docker load had by then: nothing it can load, or the image asked for with no name
            assert loaded(bytes(passed)) == ([WANTED], [])
        except (tarfile.TarError, KeyError, ValueError):
            pass


def test_what_follows_the_archives_end_is_not_sent_and_a_block_after_one_empty_one_is_refused():
    archive = legacy(CONFIG, LAYER)
    appended = archive + legacy(OTHER, b"evil", repo_tags=["haproxy:3.0"])
    assert through(appended, 4096) == end_of(archive)
    end = end_of(archive)
    manifest_at = end.index(b"manifest.json\0")
    gap = end[:manifest_at] + bytes(512) + end[manifest_at:]
    with pytest.raises(archive_check.ArchiveError, match="goes on after an empty block"):
        through(gap, 4096)


@pytest.mark.parametrize(
    ("cut", "said"),
    [
        (lambda a: a[: len(end_of(a)) - 1024 - 700], "ends inside an entry"),
        (lambda a: end_of(a)[:1024] + bytes(1024), "has no manifest.json"),
    ],
)
def test_an_archive_cut_short_is_refused_at_its_end(cut, said):
    archive = cut(legacy(CONFIG, LAYER))
    with pytest.raises(archive_check.ArchiveError, match=said):
        through(archive, 4096)


def test_a_global_pax_header_naming_paths_is_refused():
    buffer = io.BytesIO()
    with tarfile.open(
        fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT, pax_headers={"path": "manifest.json"}
    ) as archive:
        info = tarfile.TarInfo("x")
        archive.addfile(info)
    with pytest.raises(archive_check.ArchiveError, match="global PAX header"):
        through(buffer.getvalue(), 512)


def test_sizes_past_8_gib_are_read_as_docker_reads_them():
    """GNU's base-256 number (Go's archive/tar writes it for a layer over 8 GiB without PAX)."""
    field = bytes([0x80]) + (20 << 30).to_bytes(11, "big")
    assert archive_check.octal_or_binary(field) == 20 << 30
    assert archive_check.octal_or_binary(b"00000001750\0") == 1000


@pytest.mark.parametrize("spelling", ["RepoTags", "two images", "a path through a link", "PAX path"])
def test_the_receiver_loads_nothing_of_a_hostile_archive_and_names_the_depot(depot, dockers, spelling):  # noqa: F811
    source, receiver = dockers({WANTED: HOSTILE[spelling][0]()}), dockers({})
    port = depot(image_id=WANTED, docker_socket=source.server_address)
    result, _ = client("image", port, docker_socket=receiver.server_address, image_id=WANTED, reference="")
    assert result.returncode == 1
    assert "[node-2] image copy from node-1 failed: the depot on node-1 sent an image archive that " in result.stdout
    assert "refused before `docker load` had it whole, nothing was loaded" in result.stdout
    assert receiver.images == {} and receiver.tags == []  # the fake Docker loads what a real one would


def index_digest(archive: bytes) -> str:
    with tarfile.open(fileobj=io.BytesIO(archive)) as opened:
        return json.load(opened.extractfile("index.json"))["manifests"][0]["digest"]


def test_where_docker_keeps_images_in_containerd_the_id_is_the_digest_index_json_names():
    """With the containerd image store (Docker 29's default on a new install) an image's id is its manifest's (or
    index's) digest, and `docker save <id>` writes it as index.json's one descriptor, names stripped (moby
    daemon/containerd/image_exporter.go): that archive passes for that id on such a Docker, and for no other id,
    nor for that id on a Docker of the other store (which would load the config's)."""
    archive = oci(CONFIG, LAYER)
    stored_as = index_digest(archive)
    check = archive_check.ArchiveCheck(stored_as, by_index=True)
    assert b"".join(b"".join(check.feed(archive[at : at + 65536])) for at in range(0, len(archive), 65536))
    check.finish()
    for wanted, by_index in ((stored_as, False), (WANTED, True), ("sha256:" + "e" * 64, True)):
        with pytest.raises(archive_check.ArchiveError, match="holds the image "):
            archive_check.ArchiveCheck(wanted, by_index=by_index).feed(archive)


@pytest.mark.parametrize("annotations", [["io.containerd.image.name"], "x", 3])
def test_an_index_whose_annotations_are_not_a_mapping_is_read_not_tripped_on(annotations):
    archive = replaced(
        oci(CONFIG, LAYER), "index.json", json.dumps({"manifests": [{"annotations": annotations}]}).encode()
    )
    assert through(archive, 4096)  # no name in it to give: docker load would give none either


def test_an_index_of_two_or_of_no_mapping_is_refused():
    for index in ({"manifests": [{}, {}]}, {"manifests": ["x"]}, {"manifests": {}}, []):
        with pytest.raises(archive_check.ArchiveError, match="not one image's"):
            through(replaced(oci(CONFIG, LAYER), "index.json", json.dumps(index).encode()), 4096)
