"""components/scripts/node_fabric_copy.py run for real: the depot and its clients as processes on
loopback, the model directory on real files (the depot in a mount namespace of its own, so that
source and receiver use the same path as on real nodes), the image through fake Docker Engine APIs.
A proxy between them cuts or corrupts the stream."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import socket
import socketserver
import subprocess
import sys
import tarfile
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

from components.plan.programs import script_program
from tests.image_archives import config_for, image_id, legacy, loaded, oci
from tests.unit.test_image_pull import DOCKER_20, DOCKER_29, api_refusal
from tests.waiting import free_port

TOKEN = "ab" * 32
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the depot runs in a mount namespace of its own: root")


def wait_listening(port: int, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        assert process.poll() is None, process.stdout.read() if process.stdout else ""
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise AssertionError("the depot did not listen")


@pytest.fixture
def depot():
    """start(model_dir=…, source_dir=…, image_id=…, docker_socket=…) -> port: a depot on 127.0.0.1.
    With source_dir, the depot sees source_dir at model root's path (a bind mount in its own mount
    namespace), as the source node would."""
    processes = []

    def start(model_dir=None, bind=None, image_id=None, docker_socket=None, token=TOKEN):
        port = free_port()
        params = {"role": "serve", "node": "node-1", "source": "node-1", "address": "127.0.0.1", "port": port}
        params |= {"model_dir": str(model_dir) if model_dir else None, "image_id": image_id}
        env = {**os.environ, "SPARK_VLLM_COPY_TOKEN": token}
        if docker_socket:
            env["DOCKER_HOST"] = f"unix://{docker_socket}"
        program = script_program("node_fabric_copy.py", params)
        argv = [sys.executable, "-u", "-c", program]
        if bind:  # (what the depot sees, where): the source node's copy at the receiver's path
            script = 'mount --bind "$1" "$2" && shift 2 && exec "$@"'
            argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", *map(str, bind), *argv]
        process = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        processes.append(process)
        wait_listening(port, process)
        return port

    yield start
    for process in processes:
        process.kill()
        process.wait()


def client(role, port, token=TOKEN, docker_socket=None, timeout=60, **params):
    params = {"role": role, "node": "node-2", "source": "node-1", "address": "127.0.0.1", "port": port,
              "progress_seconds": 0.2, "token": token, **params}  # fmt: skip
    env = dict(os.environ)
    if docker_socket:
        env["DOCKER_HOST"] = f"unix://{docker_socket}"
    result = subprocess.run(
        [sys.executable, "-"],
        input=script_program("node_fabric_copy.py", params),
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    summary = json.loads(result.stdout.splitlines()[-1]) if result.returncode == 0 else None
    return result, summary


# --- the model ---------------------------------------------------------------------------------------


def write(path: Path, data: bytes | str, mtime: float | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    if mtime is not None:
        os.utime(path, (mtime, mtime))
    return path


def sparse(path: Path, size: int, data_at: list[int]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as handle:
        handle.truncate(size)
        for offset in data_at:
            handle.seek(offset)
            handle.write(hashlib.sha256(str(offset).encode()).digest() * 4096)  # 128 KiB of data
    return path


BLOCK = 1 << 20


def content_digest(path: Path) -> str:
    """A digest of the file's bytes that reads only where it has data: each 1 MiB block that holds a byte other than
    zero, by its place. A hole and written zeros give the same digest, as they are the same bytes (reading the seed
    model's 256 MiB sparse file whole and hashing it took 0.9 CPU-s, twice a test)."""
    blocks: set[int] = set()
    with open(path, "rb") as handle:
        fd, size, offset = handle.fileno(), os.fstat(handle.fileno()).st_size, 0
        while offset < size:
            try:
                start = os.lseek(fd, offset, os.SEEK_DATA)
            except OSError:  # ENXIO: only a hole from here on
                break
            end = os.lseek(fd, start, os.SEEK_HOLE)
            blocks.update(range(start // BLOCK, (end - 1) // BLOCK + 1))
            offset = end
        digest = hashlib.sha256(str(size).encode())
        for index in sorted(blocks):
            data = os.pread(fd, BLOCK, index * BLOCK)
            if data.count(0) != len(data):
                digest.update(b"%d:" % index + hashlib.sha256(data).digest())
    return digest.hexdigest()


def test_the_content_digest_sees_every_byte_and_not_how_zeros_are_stored(tmp_path):
    holes = sparse(tmp_path / "holes", 8 << 20, [3 << 20])
    zeros = write(tmp_path / "zeros", holes.read_bytes())  # the same bytes, the zeros written
    assert content_digest(holes) == content_digest(zeros)
    empty = sparse(tmp_path / "empty", 8 << 20, [])
    assert content_digest(empty) == content_digest(write(tmp_path / "written", bytes(8 << 20))) != content_digest(holes)
    changed = bytearray(holes.read_bytes())
    for offset in (0, (5 << 20) + 7, len(changed) - 1):  # in a hole, past the data, the last byte
        changed[offset] ^= 1
        assert content_digest(write(tmp_path / "changed", bytes(changed))) != content_digest(holes), offset
        changed[offset] ^= 1
    assert content_digest(write(tmp_path / "longer", holes.read_bytes() + b"\0")) != content_digest(holes)


def tree(root: Path) -> dict:
    """Every entry under root: a file's size, mtime (s) and content digest, a link's target."""
    found = {}
    for path in sorted(root.rglob("*")):
        relative = str(path.relative_to(root))
        if path.is_symlink():
            found[relative] = ("link", os.readlink(path))
        elif path.is_file():
            info = path.stat()
            found[relative] = ("file", info.st_size, int(info.st_mtime), content_digest(path))
        else:
            found[relative] = ("dir",)
    return found


@pytest.fixture
def model(tmp_path):
    """A source model directory, and the empty receiving one at the path both nodes use."""
    source = tmp_path / "source" / "Qwen3-0.6B"
    write(source / "config.json", '{"num_hidden_layers": 2}', mtime=1_700_000_000)
    write(source / "tokenizer.json", "{}" * 1000, mtime=1_700_000_000)
    sparse(source / "model-00001-of-00002.safetensors", 256 << 20, [0, 100 << 20, (256 << 20) - (128 << 10)])
    write(source / "model-00002-of-00002.safetensors", os.urandom(3 << 20))
    write(source / "sub" / "chat_template.jinja", "{{ messages }}")
    os.symlink("sub/chat_template.jinja", source / "template.jinja")
    write(source / ".cache" / "huggingface" / "download.lock", "")  # download state: not copied
    (tmp_path / "models").mkdir()
    return source, tmp_path / "models" / "Qwen3-0.6B"


@needs_root
def test_an_empty_node_receives_the_model_as_it_is_on_the_source(depot, model):
    source, target = model
    target.mkdir()
    port = depot(model_dir=target, bind=(source, target))
    result, summary = client("model", port, model_dir=str(target))
    assert result.returncode == 0, result.stdout + result.stderr
    expected = {k: v for k, v in tree(source).items() if not k.startswith(".cache")}
    assert tree(target) == expected
    assert summary["files"] == 5 and summary["removed"] == 0
    # the sparse file's holes stay holes: only its data (3 × 128 KiB) crossed the link
    assert summary["copied_bytes"] == 3 * (128 << 10) + (3 << 20) + sum(
        (source / name).stat().st_size for name in ("config.json", "tokenizer.json", "sub/chat_template.jinja")
    )
    assert (target / "model-00001-of-00002.safetensors").stat().st_blocks * 512 < 1 << 20
    assert os.readlink(target / "template.jinja") == "sub/chat_template.jinja"
    assert "[node-2] model " in result.stdout and "5 file(s), 1 link(s), 0 removed" in result.stdout
    assert not [p for p in target.rglob("*") if p.name.endswith(".spark-vllm-partial")]


@needs_root
def test_only_what_differs_is_copied_and_extras_go_but_hidden_and_outside_files_stay(depot, model, tmp_path):
    source, target = model
    # a copy made by hand keeps sizes and, like rsync -t, times (and the holes: writing them out took 0.5 CPU-s)
    subprocess.run(["cp", "-a", "--sparse=always", str(source), str(target)], check=True)
    write(target / "config.json", '{"num_hidden_layers": 3}', mtime=1_700_000_000)  # same size and time: kept
    write(target / "tokenizer.json", "{}" * 999)  # another size: fetched
    write(target / "stale.safetensors", "old weights")  # not on the source: removed
    write(target / "extra" / "notes.txt", "x")  # a directory not on the source: removed
    write(target / ".cache" / "mine", "kept")  # hidden: left alone
    neighbour = write(tmp_path / "models" / "other-model" / "config.json", "{}")  # outside: never touched
    os.unlink(target / "template.jinja")
    os.symlink("config.json", target / "template.jinja")  # another target: set again
    port = depot(model_dir=target, bind=(source, target))
    result, summary = client("model", port, model_dir=str(target))
    assert result.returncode == 0, result.stdout + result.stderr
    assert summary == {"copied_bytes": 2000, "files": 1, "removed": 2, "decided_seconds": summary["decided_seconds"]}
    assert (target / "config.json").read_text() == '{"num_hidden_layers": 3}'  # the quick check, as rsync's
    assert not (target / "stale.safetensors").exists() and not (target / "extra").exists()
    assert (target / ".cache" / "mine").read_text() == "kept" and neighbour.read_text() == "{}"
    assert os.readlink(target / "template.jinja") == "sub/chat_template.jinja"
    again, summary = client("model", port, model_dir=str(target))
    assert again.returncode == 0 and summary["copied_bytes"] == 0 and "nothing to copy" in again.stdout


@needs_root
def test_a_hugging_face_snapshot_brings_the_blobs_its_links_point_at(depot, tmp_path):
    source_repo = tmp_path / "source-hub" / "models--Qwen--Qwen3-0.6B"
    blob = write(source_repo / "blobs" / ("a" * 40), '{"num_hidden_layers": 2}')
    weights = write(source_repo / "blobs" / ("b" * 64), os.urandom(1 << 20))
    write(source_repo / "blobs" / ("c" * 40), "an older revision's file")  # not referenced: not copied
    write(source_repo / "refs" / "main", "rev1")
    snapshot = source_repo / "snapshots" / "rev1"
    snapshot.mkdir(parents=True)
    os.symlink(f"../../blobs/{blob.name}", snapshot / "config.json")
    os.symlink(f"../../blobs/{weights.name}", snapshot / "model.safetensors")
    target_repo = tmp_path / "hub" / "models--Qwen--Qwen3-0.6B"
    target_repo.mkdir(parents=True)
    write(target_repo / "blobs" / ("d" * 40), "this node's own download")  # outside the snapshot: kept
    port = depot(model_dir=target_repo / "snapshots" / "rev1", bind=(source_repo, target_repo))
    result, summary = client("model", port, model_dir=str(target_repo / "snapshots" / "rev1"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert summary["files"] == 2 and summary["copied_bytes"] == blob.stat().st_size + (1 << 20)
    assert (target_repo / "snapshots" / "rev1" / "config.json").read_text() == '{"num_hidden_layers": 2}'
    assert os.readlink(target_repo / "snapshots" / "rev1" / "model.safetensors") == f"../../blobs/{weights.name}"
    assert not (target_repo / "blobs" / ("c" * 40)).exists()
    assert (target_repo / "blobs" / ("d" * 40)).read_text() == "this node's own download"


@needs_root
def test_links_that_would_dangle_after_a_copy_stop_it_and_are_named(depot, model, tmp_path):
    source, target = model
    os.symlink(str(tmp_path / "elsewhere.safetensors"), source / "outside.safetensors")
    write(tmp_path / "elsewhere.safetensors", "x")
    os.symlink("missing.json", source / "dangling.json")
    target.mkdir()
    port = depot(model_dir=target, bind=(source, target))
    result, _ = client("model", port, model_dir=str(target))
    assert result.returncode == 1
    assert "[node-2] model copy from node-1 failed: the model on node-1 cannot be copied as it is:" in result.stdout
    assert f"outside.safetensors -> {tmp_path}/elsewhere.safetensors leads out of {target}" in result.stdout
    assert "dangling.json -> missing.json is dangling" in result.stdout
    assert list(target.iterdir()) == []  # nothing was written


@needs_root
def test_a_client_without_the_token_gets_nothing(depot, model):
    source, target = model
    target.mkdir()
    port = depot(model_dir=target, bind=(source, target))
    result, _ = client("model", port, token="cd" * 32, model_dir=str(target))
    assert result.returncode == 1
    assert "refused this stack's copy token, or does not hold it" in result.stdout
    assert list(target.iterdir()) == []


def test_a_depot_without_the_token_is_not_believed(tmp_path):
    """Someone else listening at the depot's address cannot prove the token: the client stops."""
    port = free_port()
    impostor = socket.socket()
    impostor.bind(("127.0.0.1", port))
    impostor.listen()

    def pretend():
        conn, _ = impostor.accept()
        conn.sendall(b"spark-vllm-copy/1\n" + os.urandom(32))
        conn.recv(64)
        conn.sendall(os.urandom(32))
        time.sleep(1)
        conn.close()

    threading.Thread(target=pretend, daemon=True).start()
    result, _ = client("model", port, model_dir=str(tmp_path / "m"))
    impostor.close()
    assert result.returncode == 1 and "refused this stack's copy token, or does not hold it" in result.stdout


class Proxy:
    """Forwards a TCP connection to the depot; from the depot's `after`-th byte on, it cuts the
    connection or flips one bit."""

    def __init__(self, port: int, after: int, mode: str):
        self.target, self.after, self.mode = port, after, mode
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen()
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self.run, daemon=True).start()

    def run(self):
        conn, _ = self.listener.accept()
        upstream = socket.create_connection(("127.0.0.1", self.target))
        threading.Thread(target=self.pump, args=(conn, upstream, False), daemon=True).start()
        self.pump(upstream, conn, True)

    def pump(self, source, sink, tamper):
        seen = 0
        try:
            while data := source.recv(65536):
                if tamper and self.mode != "done" and seen + len(data) > self.after:
                    if self.mode == "cut":
                        sink.sendall(data[: self.after - seen])
                        break
                    data = bytearray(data)
                    data[self.after - seen] ^= 0x01
                    self.mode = "done"
                seen += len(data)
                sink.sendall(data)
        except OSError:
            pass
        for end in (source, sink):
            try:
                end.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


@needs_root
@pytest.mark.parametrize("mode", ["cut", "flip"])
def test_a_cut_or_corrupted_stream_fails_naming_the_node_and_leaves_no_half_file(depot, model, mode):
    source, target = model
    big = write(source / "model-00002-of-00002.safetensors", os.urandom(24 << 20))
    target.mkdir()
    port = depot(model_dir=target, bind=(source, target))
    proxy = Proxy(port, after=12 << 20, mode=mode)
    result, _ = client("model", proxy.port, model_dir=str(target))
    assert result.returncode == 1
    reason = "the connection closed after" if mode == "cut" else "a frame failed its integrity check"
    assert "[node-2] model copy from node-1 failed: " in result.stdout and reason in result.stdout
    assert not (target / big.name).exists()
    assert not [p for p in target.rglob("*") if p.name.endswith(".spark-vllm-partial")]
    again, summary = client("model", port, model_dir=str(target))  # the next `pulumi up`
    assert again.returncode == 0 and tree(target)[big.name] == tree(source)[big.name]


@needs_root
def test_partial_files_left_by_a_killed_copy_are_cleared(depot, model):
    source, target = model
    target.mkdir()
    write(target / ".model-00002-of-00002.safetensors.spark-vllm-partial", "left by a SIGKILL")
    port = depot(model_dir=target, bind=(source, target))
    result, _ = client("model", port, model_dir=str(target))
    assert result.returncode == 0
    assert not [p for p in target.rglob("*") if p.name.endswith(".spark-vllm-partial")]


# --- the image ---------------------------------------------------------------------------------------


class FakeDocker(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    """The few Docker Engine API calls the copy makes: inspect, save (get), load, tag."""

    daemon_threads = True

    def __init__(self, path: Path, images: dict[str, bytes], api=DOCKER_20, containerd=False):
        self.api = api
        self.containerd = containerd  # images kept in containerd: ids are index.json's digests
        self.paths: list[str] = []
        self.images = dict(images)  # id -> its `docker save` archive
        self.loads: list[bytes] = []
        self.tags: list[dict] = []
        super().__init__(str(path), DockerHandler)


class DockerHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"

    def address_string(self):
        return "unix"

    def log_message(self, *args):
        pass

    def image(self) -> str:
        return urllib.parse.unquote(self.path.split("/")[3])

    def reply(self, status: int, body: bytes = b"{}"):
        self.send_response(status)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):  # noqa: N802
        if self.path != "/version":
            self.server.paths.append(self.path)
        if api_refusal(self):
            return
        if self.path.endswith("/info"):
            status = (
                [["driver-type", "io.containerd.snapshotter.v1"]]
                if self.server.containerd
                else [["Backing Filesystem", "extfs"]]
            )
            return self.reply(200, json.dumps({"DriverStatus": status}).encode())
        image_id = self.image()
        if image_id not in self.server.images:
            return self.reply(404, b'{"message": "No such image"}')
        if self.path.endswith("/json"):
            return self.reply(200, json.dumps({"Id": image_id, "Size": len(self.server.images[image_id])}).encode())
        self.reply(200, self.server.images[image_id])

    def do_POST(self):  # noqa: N802
        self.server.paths.append(self.path)
        if api_refusal(self):
            return
        if "/load" in self.path:  # as Docker does: ids from the configs, names from RepoTags (image_archives)
            body = self.read_chunked()
            self.server.loads.append(body)
            try:
                if body.endswith(b"<cut>"):
                    raise ValueError("unexpected EOF")
                ids, names = loaded(body, by_index=self.server.containerd)
            except (tarfile.TarError, KeyError, ValueError) as error:
                failed = {"errorDetail": {"message": str(error)}, "error": str(error)}
                return self.reply(200, json.dumps(failed).encode())
            for image_id in ids:
                self.server.images[image_id] = body
            for name in names:
                repo, tag = name.rsplit(":", 1)
                self.server.tags.append({"image": ids[0], "repo": repo, "tag": tag})
            return self.reply(200, json.dumps({"stream": f"Loaded image ID: {ids[0]}\n"}).encode())
        query = urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)
        self.server.tags.append({"image": self.image(), "repo": query["repo"][0], "tag": query["tag"][0]})
        self.reply(201, b"")

    def read_chunked(self) -> bytes:
        body = bytearray()
        try:
            while True:
                size = int(self.rfile.readline().strip() or b"0", 16)
                if size == 0:
                    self.rfile.readline()
                    return bytes(body)
                body += self.rfile.read(size)
                self.rfile.readline()
        except (OSError, ValueError):
            return bytes(body) + b"<cut>"


@pytest.fixture
def dockers(tmp_path):
    servers = []

    def start(images, api=DOCKER_20, containerd=False):
        server = FakeDocker(tmp_path / f"docker{len(servers)}.sock", images, api, containerd)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


@functools.cache
def archive() -> bytes:
    """The image's archive: made when a test first asks, not when each test process imports the module (0.05 CPU-s)."""
    return legacy(config_for("vllm"), os.urandom(9 << 20))


IMAGE_ID = image_id(config_for("vllm"))


def test_the_image_arrives_whole_is_checked_by_id_and_tagged(depot, dockers):
    source, receiver = dockers({IMAGE_ID: archive()}), dockers({})
    port = depot(image_id=IMAGE_ID, docker_socket=source.server_address)
    result, summary = client("image", port, docker_socket=receiver.server_address, image_id=IMAGE_ID,
                             reference="registry.lan:5000/vllm:gb10")  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    [body] = receiver.loads  # the archive to its end (two empty blocks); tar's padding after it is not sent
    assert archive().startswith(body) and not archive()[len(body) :].strip(b"\0") and IMAGE_ID in receiver.images
    assert receiver.tags == [{"image": IMAGE_ID, "repo": "registry.lan:5000/vllm", "tag": "gb10"}]
    assert summary == {"image_id": IMAGE_ID, "copied_bytes": len(archive())}
    assert (
        f"[node-2] copying image {IMAGE_ID[:19]} from node-1 over the fabric (9.5 MB unpacked; Docker 20.10.24, Engine API 1.41)"
        in result.stdout
    )
    assert "image: 9.5 MB of 9.5 MB (100%)" in result.stdout and "loaded, image id checked" in result.stdout


def test_a_node_that_has_the_image_copies_nothing(depot, dockers):
    receiver = dockers({IMAGE_ID: archive()})
    result, summary = client("image", 1, docker_socket=receiver.server_address, image_id=IMAGE_ID, reference="")
    assert result.returncode == 0 and summary["copied_bytes"] == 0 and receiver.loads == []
    assert "is already on this node: nothing to copy" in result.stdout


def test_a_depot_serving_another_image_is_refused(depot, dockers):
    other = b"other bytes"
    source, receiver = dockers({IMAGE_ID: archive()}), dockers({})
    port = depot(image_id=IMAGE_ID, docker_socket=source.server_address)
    wanted = "sha256:" + hashlib.sha256(other).hexdigest()
    result, _ = client("image", port, docker_socket=receiver.server_address, image_id=wanted, reference="")
    assert result.returncode == 1 and f"the depot on node-1 serves {IMAGE_ID}, not {wanted}" in result.stdout
    assert receiver.loads == []


@pytest.mark.parametrize("mode", ["cut", "flip"])
def test_a_cut_or_corrupted_image_stream_loads_nothing_and_names_the_node(depot, dockers, mode):
    source, receiver = dockers({IMAGE_ID: archive()}), dockers({})
    port = depot(image_id=IMAGE_ID, docker_socket=source.server_address)
    proxy = Proxy(port, after=4 << 20, mode=mode)
    result, _ = client("image", proxy.port, docker_socket=receiver.server_address, image_id=IMAGE_ID, reference="")
    assert result.returncode == 1
    assert "[node-2] image copy from node-1 failed: the copy was cut after " in result.stdout
    assert "nothing was loaded" in result.stdout and IMAGE_ID not in receiver.images
    assert all(load != archive() for load in receiver.loads)


def test_an_archive_that_loads_another_image_is_refused(depot, dockers):
    """The depot's Docker hands out another image than the id asked for: its manifest says so before the load."""
    other = legacy(config_for("other"), b"x" * 4096)
    source, receiver = dockers({IMAGE_ID: other}), dockers({})
    port = depot(image_id=IMAGE_ID, docker_socket=source.server_address)
    result, _ = client("image", port, docker_socket=receiver.server_address, image_id=IMAGE_ID, reference="x:1")
    assert result.returncode == 1
    assert f"holds the image {image_id(config_for('other'))[7:]}.json, not {IMAGE_ID}" in result.stdout
    assert receiver.tags == [] and not [i for i in receiver.images if i != IMAGE_ID]


def test_a_docker_29_source_and_receiver_are_spoken_to_in_their_api_version(depot, dockers):
    source, receiver = dockers({IMAGE_ID: archive()}, api=DOCKER_29), dockers({}, api=DOCKER_29)
    port = depot(image_id=IMAGE_ID, docker_socket=source.server_address)
    result, summary = client("image", port, docker_socket=receiver.server_address, image_id=IMAGE_ID,
                             reference="registry.example:5000/vllm:v1")  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Docker 29.0.1, Engine API 1.52" in result.stdout
    assert all(path.startswith("/v1.52/") for path in source.paths + receiver.paths)


def test_a_source_that_cannot_serve_says_why_to_the_receiver(depot, dockers, tmp_path):
    """Its Docker socket unreachable: the receiving node's failure names the source's reason."""
    receiver = dockers({})
    port = depot(image_id=IMAGE_ID, docker_socket=tmp_path / "no-such-docker.sock")
    result, _ = client("image", port, docker_socket=receiver.server_address, image_id=IMAGE_ID, reference="")
    assert result.returncode == 1
    out = result.stdout + result.stderr
    assert "the depot says: node-1 cannot serve the image: FileNotFoundError" in out, out
    assert "connection closed after 0 of" not in out


# --- the depot: peers without the token cannot tie it up ------------------------------------------------


def greeted(sock: socket.socket, within: float) -> bytes:
    """What the depot sends first on `sock` within `within` seconds (b"": it closed the connection)."""
    sock.settimeout(within)
    try:
        return sock.recv(64)
    except TimeoutError:
        return b"(nothing yet)"


@needs_root
def test_a_slow_handshake_is_dropped_in_seconds_and_idle_peers_cannot_shut_a_receiver_out(depot, tmp_path):
    """UNPROVEN_AT_ONCE peers that connect and never prove the token hold every handshake slot: the next connection
    is closed at once, without a greeting; the idle ones are dropped after HANDSHAKE_SECONDS; a receiver that came
    meanwhile tries again and copies."""
    constants = helpers_of("node_fabric_copy.py")
    source, target = tmp_path / "source" / "tiny", tmp_path / "models" / "tiny"
    write(source / "config.json", "{}")
    target.mkdir(parents=True)
    port = depot(model_dir=target, bind=(source, target))
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(constants["UNPROVEN_AT_ONCE"])]
    try:
        for sock in idle:
            assert greeted(sock, 5).startswith(b"spark-vllm-copy/1")
        started = time.monotonic()
        with socket.create_connection(("127.0.0.1", port)) as over:
            assert greeted(over, 5) == b""  # closed at once: no thread waits on it
        assert time.monotonic() - started < 2
        result, summary = client("model", port, model_dir=str(target))  # retries until a slot is free
        assert result.returncode == 0 and summary["files"] == 1, result.stdout
        for sock in idle:  # dropped after HANDSHAKE_SECONDS, not the 300 s a slow peer held a thread before
            assert greeted(sock, constants["HANDSHAKE_SECONDS"] + 5) == b""
        assert time.monotonic() - started < constants["HANDSHAKE_SECONDS"] + 10
    finally:
        for sock in idle:
            sock.close()


def helpers_of(name: str) -> dict:
    """The module-level constants of a node script (read, not run: it would serve)."""
    found: dict = {}
    for line in (Path(__file__).resolve().parents[2] / "components" / "scripts" / name).read_text().splitlines():
        if line and line.split(" = ", 1)[0].isupper() and " = " in line and line.split(" = ", 1)[1].strip().isdigit():
            found[line.split(" = ", 1)[0]] = int(line.split(" = ", 1)[1].split("#")[0])
    return found


def test_a_docker_keeping_images_in_containerd_receives_the_image_by_its_index_digest(depot, dockers):
    """Docker 29's default store on a new install: an image's id is its manifest's digest and `docker save <id>`
    writes the OCI layout (index.json names that digest). The receiver asks its Docker which store it has."""
    archive = oci(config_for("vllm"), os.urandom(1 << 20))
    stored_as = loaded(archive, by_index=True)[0][0]
    source = dockers({stored_as: archive}, api=DOCKER_29, containerd=True)
    receiver = dockers({}, api=DOCKER_29, containerd=True)
    port = depot(image_id=stored_as, docker_socket=source.server_address)
    result, summary = client("image", port, docker_socket=receiver.server_address, image_id=stored_as,
                             reference="registry.example:5000/vllm:v1")  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert stored_as in receiver.images and summary["image_id"] == stored_as
    graphdriver = dockers({}, api=DOCKER_29)  # the same archive for a Docker of the other store: not that id
    result, _ = client("image", port, docker_socket=graphdriver.server_address, image_id=stored_as, reference="")
    assert result.returncode == 1 and f"not {stored_as}" in result.stdout and graphdriver.images == {}
