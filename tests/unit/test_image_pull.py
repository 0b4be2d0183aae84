"""components/scripts/image_pull.py run for real against a fake Docker Engine API on a unix socket:
progress lines with bytes, rate and layers; the timeout; errors; an image already there; registry
credentials from ~/.docker/config.json."""

from __future__ import annotations

import base64
import json
import os
import socketserver
import subprocess
import sys
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest

from components.plan.programs import script_program

LAYER = 40_000_000


# What GET /version says (unversioned): Docker 20.10 (Debian's docker.io, the rehearsal's) and Docker 29,
# which refuses every versioned path below its MinAPIVersion with this message (moby api/server/middleware).
DOCKER_20 = {"Version": "20.10.24", "ApiVersion": "1.41", "MinAPIVersion": "1.12"}
DOCKER_29 = {"Version": "29.0.1", "ApiVersion": "1.52", "MinAPIVersion": "1.44"}


def api_refusal(handler) -> bool:
    """Answer GET /version, or refuse a path whose /vX.Y is outside what the daemon speaks, as dockerd does."""
    api = handler.server.api
    if handler.path == "/version":
        handler.send_response(200)
        handler.end_headers()
        handler.wfile.write(json.dumps(api).encode())
        return True
    version = handler.path.split("/")[1]
    wanted = tuple(int(x) for x in version[1:].split("."))
    lowest, highest = (tuple(int(x) for x in api[k].split(".")) for k in ("MinAPIVersion", "ApiVersion"))
    if wanted < lowest or wanted > highest:
        handler.send_response(400)
        handler.end_headers()
        message = (f"client version {version[1:]} is too old. Minimum supported API version is {api['MinAPIVersion']}, "
                   "please upgrade your client to a newer version") if wanted < lowest else \
            f"client version {version[1:]} is too new. Maximum supported API version is {api['ApiVersion']}"  # fmt: skip
        handler.wfile.write(json.dumps({"message": message}).encode())
        return True
    return False


class FakeDocker(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True

    def __init__(self, path: Path, steps: list, delay: float, present: bool = False, api=DOCKER_20):
        self.steps, self.delay, self.present, self.api = steps, delay, present, api
        self.requests: list[tuple[str, str, dict]] = []
        super().__init__(str(path), Handler)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"  # the body ends when the connection closes, as a stream should

    def address_string(self):  # a unix socket has no client address
        return "unix"

    def log_message(self, *args):
        pass

    def do_GET(self):  # noqa: N802
        if self.path != "/version":  # the version handshake is not one of the calls the tests look at
            self.server.requests.append(("GET", self.path, dict(self.headers)))
        if api_refusal(self):
            return
        self.send_response(200 if self.server.present else 404)
        self.end_headers()
        self.wfile.write(b"{}")

    def do_POST(self):  # noqa: N802
        if self.path != "/version":  # the version handshake is not one of the calls the tests look at
            self.server.requests.append(("POST", self.path, dict(self.headers)))
        if api_refusal(self):
            return
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        for step in self.server.steps:
            try:
                self.wfile.write(json.dumps(step).encode() + b"\r\n")
                self.wfile.flush()
            except OSError:
                return
            time.sleep(self.server.delay)
        if not any("error" in step for step in self.server.steps):
            self.server.present = True


def download(layer: str, parts: int = 4) -> list[dict]:
    steps = [{"status": "Pulling fs layer", "id": layer}]
    for part in range(1, parts + 1):
        detail = {"current": LAYER * part // parts, "total": LAYER}
        steps.append({"status": "Downloading", "id": layer, "progressDetail": detail})
    return [*steps, {"status": "Download complete", "id": layer}, {"status": "Pull complete", "id": layer}]


@pytest.fixture
def docker(tmp_path):
    servers = []

    def start(steps, delay=0.05, present=False, api=DOCKER_20):
        server = FakeDocker(tmp_path / f"docker{len(servers)}.sock", steps, delay, present, api)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def pull(server, tmp_path, image="registry.example:5000/vllm:v1", timeout=60, progress=0.2, home=None):
    params = {"node": "node-2", "image": image, "timeout_seconds": timeout, "progress_seconds": progress}
    env = {**os.environ, "DOCKER_HOST": f"unix://{server.server_address}", "HOME": str(home or tmp_path)}
    return subprocess.run(
        [sys.executable, "-"],
        input=script_program("image_pull.py", params),
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def test_progress_shows_bytes_rate_and_layers_then_the_total(docker, tmp_path):
    server = docker(download("aaa") + download("bbb"), delay=0.06)
    result = pull(server, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "[node-2] pulling registry.example:5000/vllm:v1 (at most 60 s; Docker 20.10.24, Engine API 1.41)"
    progress = [line for line in lines if " of " in line]
    assert progress, lines
    assert all(line.startswith("[node-2] pulling registry.example:5000/vllm:v1: ") for line in progress)
    assert any("MB of 80.0 MB" in line and "/s, " in line and "layers done" in line for line in progress)
    assert (
        lines[-1].startswith("[node-2] pulled registry.example:5000/vllm:v1 in ") and "80.0 MB downloaded" in lines[-1]
    )
    method, path, _ = server.requests[1]
    assert method == "POST"
    query = urllib.parse.parse_qs(urllib.parse.urlsplit(path).query)
    assert query == {"fromImage": ["registry.example:5000/vllm"], "tag": ["v1"]}


def test_a_digest_reference_is_pulled_by_digest(docker, tmp_path):
    server = docker(download("aaa"))
    digest = "sha256:" + "ab" * 32
    assert pull(server, tmp_path, image=f"registry.example:5000/vllm@{digest}").returncode == 0
    query = urllib.parse.parse_qs(urllib.parse.urlsplit(server.requests[1][1]).query)
    assert query == {"fromImage": ["registry.example:5000/vllm"], "tag": [digest]}


def test_a_pull_slower_than_the_timeout_fails_naming_the_setting(docker, tmp_path):
    server = docker(download("aaa", parts=200), delay=0.05)
    started = time.monotonic()
    result = pull(server, tmp_path, timeout=1, progress=0.3)
    assert result.returncode == 1
    assert "[node-2] the pull did not finish within 1 s (imageTransfer.timeoutSeconds); last: pulling" in result.stdout
    assert time.monotonic() - started < 5


def test_a_registry_error_fails_with_its_message(docker, tmp_path):
    server = docker([{"status": "Pulling from vllm"}, {"error": "manifest unknown", "errorDetail": {}}])
    result = pull(server, tmp_path)
    assert result.returncode == 1
    assert "[node-2] pull failed: manifest unknown" in result.stdout


def test_an_image_already_on_the_node_is_not_pulled(docker, tmp_path):
    server = docker(download("aaa"), present=True)
    result = pull(server, tmp_path)
    assert result.returncode == 0
    assert result.stdout.strip() == "[node-2] registry.example:5000/vllm:v1 is already on this node"
    assert [method for method, _, _ in server.requests] == ["GET"]


def test_registry_credentials_come_from_the_docker_config(docker, tmp_path):
    home = tmp_path / "home"
    (home / ".docker").mkdir(parents=True)
    auth = base64.b64encode(b"robot:s3cret").decode()
    (home / ".docker" / "config.json").write_text(json.dumps({"auths": {"registry.example:5000": {"auth": auth}}}))
    server = docker(download("aaa"))
    assert pull(server, tmp_path, home=home).returncode == 0
    header = server.requests[1][2]["X-Registry-Auth"]
    decoded = json.loads(base64.urlsafe_b64decode(header))
    assert decoded == {"username": "robot", "password": "s3cret", "serveraddress": "registry.example:5000"}


def test_no_daemon_is_a_clear_failure(tmp_path):
    class Gone:
        server_address = str(tmp_path / "nothing.sock")

    result = pull(Gone(), tmp_path)
    assert result.returncode == 1
    assert f"[node-2] cannot reach the Docker daemon at {tmp_path / 'nothing.sock'}" in result.stdout


def test_an_image_id_that_is_not_on_the_node_cannot_be_pulled(docker, tmp_path):
    server = docker(download("aaa"))
    result = pull(server, tmp_path, image="sha256:" + "34" * 32)
    assert result.returncode == 1 and [m for m, _, _ in server.requests] == ["GET"]
    assert "is an image id, which no registry serves: load or build it on this node" in result.stdout


def test_a_docker_29_daemon_is_spoken_to_in_its_api_version(docker, tmp_path):
    """Docker 29 refuses API 1.41 ("client version 1.41 is too old"): the version is negotiated."""
    server = docker(download("aaa"), api=DOCKER_29)
    result = pull(server, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Docker 29.0.1, Engine API 1.52" in result.stdout
    versioned = [path for _, path, _ in server.requests]
    assert versioned and all(path.startswith("/v1.52/") for path in versioned)


def test_the_api_version_is_never_below_what_the_daemon_accepts(docker, tmp_path):
    server = docker(download("aaa"), api={"Version": "31.0.0", "ApiVersion": "1.60", "MinAPIVersion": "1.55"})
    result = pull(server, tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert server.requests and all(path.startswith("/v1.55/") for _, path, _ in server.requests)
