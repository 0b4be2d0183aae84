"""The rehearsal image: build/caching, identical IDs across daemons, Ray + the vLLM stand-in inside it.

Skipped unless running as root with dockerd, docker and debootstrap installed: the
build runs debootstrap and the tests start private dockerd instances (own socket
under /tmp, never the machine's default daemon). The first run builds the image
(~1.5-2 min on 2 cores); the archive is cached in $REHEARSAL_IMAGE_CACHE
(default /var/tmp/spark-vllm-rehearsal) and reused while the sources are unchanged.
All containers run with ``--network none``: Ray and the stand-in talk over loopback.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from .build import archive_image_id, daemon_image_id, ensure_image, load_into
from .dockerd import dockerd_available, private_dockerd

_skip = dockerd_available()
pytestmark = pytest.mark.skipif(_skip is not None, reason=f"rehearsal image tests: {_skip}")

CACHE = Path(os.environ.get("REHEARSAL_IMAGE_CACHE", "/var/tmp/spark-vllm-rehearsal"))


@pytest.fixture(scope="module")
def daemon():
    with private_dockerd() as host:
        yield host


@pytest.fixture(scope="module")
def image(daemon):
    return ensure_image(CACHE, daemon)


def dk(host: str, *args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    r = subprocess.run(["docker", "-H", host, *args], capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)} -> {r.returncode}\n{r.stdout}\n{r.stderr}")
    return r


def test_build_is_cached_and_reused(image, daemon):
    assert re.fullmatch(r"spark-vllm-rehearsal:[0-9a-f]{12}", image.ref)
    assert image.archive.is_file() and image.archive.name == image.ref.replace(":", "-") + ".tar"
    assert image.image_id == daemon_image_id(daemon, image.ref) == archive_image_id(image.archive)
    t0 = time.monotonic()
    again = ensure_image(CACHE, daemon)
    assert not again.built and again.image_id == image.image_id
    assert time.monotonic() - t0 < 30


def test_same_image_id_on_another_daemon(image):
    with private_dockerd() as other:
        assert daemon_image_id(other, image.ref) is None
        t0 = time.monotonic()
        assert load_into(image.archive, other) == image.image_id
        print(f"load into a fresh daemon: {time.monotonic() - t0:.1f} s")
        assert load_into(image.archive, other) == image.image_id  # second time: no-op
        info = ensure_image(CACHE, other)
        assert not info.built and info.image_id == image.image_id


def test_image_contents(image, daemon):
    r = dk(
        daemon,
        "run",
        "--rm",
        "--network",
        "none",
        image.ref,
        "sh",
        "-c",
        "python3 -c 'import ray; print(ray.__version__)'; ray --version; vllm --version; "
        "command -v ps ip curl >/dev/null && echo tools-ok",
    )
    assert r.stdout.split("\n")[0] == "2.60.0"
    assert "ray, version 2.60.0" in r.stdout and "0.25.0" in r.stdout and "tools-ok" in r.stdout
    r = dk(daemon, "run", "--rm", "--network", "none", image.ref, "vllm", "serve", "m", "--bogus-flag", check=False)
    assert r.returncode == 2 and "unrecognized arguments: --bogus-flag" in r.stderr


CURL = "curl -s -o /tmp/body -w '%{http_code}' --max-time 5"


def _sh(daemon, name, script, env=(), timeout=120, check=True):
    args = ["exec"]
    for e in env:
        args += ["-e", e]
    return dk(daemon, *args, name, "sh", "-c", script, timeout=timeout, check=check)


def _http(daemon, name, path, key=None, body=None):
    cmd = CURL
    if key:
        cmd += f" -H 'Authorization: Bearer {key}'"
    if body is not None:
        cmd += " -H 'content-type: application/json' -d '" + json.dumps(body) + "'"
    r = _sh(daemon, name, f"{cmd} http://127.0.0.1:8000{path}; echo; cat /tmp/body")
    code, _, text = r.stdout.partition("\n")
    return int(code), text


def test_ray_two_nodes_and_standin_serving(image, daemon):
    """Two Ray nodes (127.0.0.1 head, 127.0.0.2 worker) in one --network none container, TP=2 over Ray."""
    name = f"standin-{uuid.uuid4().hex[:8]}"
    dk(
        daemon,
        "run",
        "-d",
        "--name",
        name,
        "--network",
        "none",
        "--shm-size",
        "512m",
        "-e",
        "VLLM_HOST_IP=127.0.0.1",
        "-e",
        "RAY_memory_monitor_refresh_ms=0",
        image.ref,
        "sleep",
        "infinity",
    )
    try:
        _sh(
            daemon,
            name,
            "ray start --head --node-ip-address=127.0.0.1 --port=6379 --num-gpus=1 "
            "--include-dashboard=false --disable-usage-stats > /tmp/ray-head.log 2>&1",
        )
        # the worker node's raylet (and so its workers) get their own VLLM_HOST_IP and their own GPU (the
        # stand-in's GPU locks), like a second container
        _sh(
            daemon,
            name,
            "ray start --address=127.0.0.1:6379 --node-ip-address=127.0.0.2 --num-gpus=1 "
            "--disable-usage-stats > /tmp/ray-worker.log 2>&1",
            env=["VLLM_HOST_IP=127.0.0.2", "STANDIN_GPU_DIR=/run/vllm-standin-gpus-of-node-2"],
        )
        _sh(daemon, name, "mkdir -p /models/m && echo '{\"num_attention_heads\": 16}' > /models/m/config.json")
        deadline = time.monotonic() + 60
        while "2.0 GPU" not in _sh(daemon, name, "ray status 2>/dev/null", check=False).stdout:
            assert time.monotonic() < deadline, "Ray cluster did not reach 2 GPUs"
            time.sleep(1)

        # wrong VLLM_HOST_IP: the known symptom, exit 1
        r = _sh(
            daemon,
            name,
            "vllm serve /models/m -tp 2 --distributed-executor-backend ray",
            check=False,
            env=["VLLM_HOST_IP=10.255.0.9"],
        )
        assert r.returncode == 1 and "No available node types can fulfill resource request" in r.stdout
        # more GPUs than the cluster has: placement group timeout, exit 1
        r = _sh(
            daemon,
            name,
            "vllm serve /models/m -tp 4 --distributed-executor-backend ray",
            check=False,
            env=["VLLM_PLACEMENT_TIMEOUT_S=3"],
        )
        assert r.returncode == 1 and "placement group" in r.stdout

        dk(
            daemon,
            "exec",
            "-d",
            "-e",
            "STANDIN_LOAD_SECONDS=1",
            name,
            "sh",
            "-c",
            "vllm serve /models/m --host 127.0.0.1 --tensor-parallel-size 2 --distributed-executor-backend ray "
            "--max-model-len 32K --served-model-name qwen --api-key sekret > /tmp/vllm.log 2>&1; "
            "echo exit=$? >> /tmp/vllm.log",
        )
        deadline = time.monotonic() + 90
        while True:
            code = _sh(daemon, name, f"{CURL} http://127.0.0.1:8000/health", check=False).stdout.strip()
            if code == "200":
                break
            log = _sh(daemon, name, "cat /tmp/vllm.log", check=False).stdout
            assert "exit=" not in log and time.monotonic() < deadline, log
            time.sleep(1)
        log = _sh(daemon, name, "cat /tmp/vllm.log").stdout
        assert "worker ranks on nodes: rank 0 -> 127.0.0.1, rank 1 -> 127.0.0.2" in log
        assert "Uvicorn running on http://127.0.0.1:8000" in log and "sekret" not in log

        assert _http(daemon, name, "/v1/models")[0] == 401
        code, text = _http(daemon, name, "/v1/models", key="sekret")
        assert code == 200
        models = json.loads(text)["data"]
        assert [(m["id"], m["root"], m["max_model_len"]) for m in models] == [("qwen", "/models/m", 32768)]
        chat = {"model": "qwen", "messages": [{"role": "user", "content": "ping from rehearsal"}], "max_tokens": 16}
        assert _http(daemon, name, "/v1/chat/completions", body=chat)[0] == 401
        code, text = _http(daemon, name, "/v1/chat/completions", key="sekret", body=chat)
        assert code == 200
        reply = json.loads(text)
        assert reply["choices"][0]["message"]["content"] == "standin reply: rehearsal from ping"
        assert reply["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}
        assert _http(daemon, name, "/v1/chat/completions", key="sekret", body=dict(chat, model="nope"))[0] == 404
        assert _http(daemon, name, "/version")[0] == 200  # open without the key

        t0 = time.monotonic()
        _sh(daemon, name, "kill -TERM $(pgrep -f '^python3 -m vllm_standin')")
        while "exit=" not in (log := _sh(daemon, name, "cat /tmp/vllm.log").stdout):
            assert time.monotonic() - t0 < 15, log
            time.sleep(0.3)
        assert "exit=0" in log and "Shutting down" in log
        # the placement group is gone: both GPUs free again
        deadline = time.monotonic() + 20
        while "0.0/2.0 GPU" not in _sh(daemon, name, "ray status 2>/dev/null", check=False).stdout:
            assert time.monotonic() < deadline, "GPUs not released after shutdown"
            time.sleep(1)
    finally:
        dk(daemon, "rm", "-f", name, check=False)
