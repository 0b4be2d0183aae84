"""components/scripts/router_keeper.py against a stand-in for vllm-router's HTTP API (the part the keeper
speaks: GET/POST /workers, DELETE /workers/<url>, /health, /v1/chat/completions; its behaviour as
vllm-router 0.1.17 showed it here: registrations in memory only, gone when it restarts) and stand-in
vLLMs' /metrics. The real vllm-router is run by the rehearsal (tests/e2e/test_deployments.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from components.render import script_program
from tests.waiting import free_port, wait_for

FAKE_ROUTER = """
import json, sys, urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

def main():
    args = sys.argv[1:]
    port = int(args[args.index("--port") + 1])
    workers = {}  # url -> model: in memory, as vllm-router keeps them

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def reply(self, status, body):
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/workers":
                return self.reply(200, {"workers": [{"url": u, "model_id": m} for u, m in workers.items()]})
            return self.reply(200, {"ok": True})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path == "/workers":
                workers[body["url"]] = body["model_id"]
                return self.reply(200, {"success": True})
            if self.path == "/v1/chat/completions":
                if body["model"] not in workers.values():
                    return self.reply(404, {"error": "no worker for " + body["model"]})
                key = self.headers.get("Authorization")
                return self.reply(200, {"model": body["model"], "usage": {"completion_tokens": 2}, "key": key})
            self.reply(404, {})

        def do_DELETE(self):
            url = urllib.parse.unquote(self.path[len("/workers/"):])
            workers.pop(url, None)
            self.reply(200, {"success": True})

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
"""


@pytest.fixture
def router(tmp_path):
    """A keeper in serve mode, on a stand-in vllm-router importable as the image's own (version 0.1.17)."""
    site = tmp_path / "site"
    (site / "vllm_router").mkdir(parents=True)
    (site / "vllm_router" / "__init__.py").write_text("")
    (site / "vllm_router" / "launch_router.py").write_text(FAKE_ROUTER)
    dist = site / "vllm_router-0.1.17.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-router\nVersion: 0.1.17\n")
    port = free_port()
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(site)}
    base = {"host": "127.0.0.1", "port": port, "metrics_host": "127.0.0.1", "metrics_port": free_port(),
            "policy": "round_robin", "version": "0.1.17", "index_url": None, "health_interval": 5,
            "run_dir": str(tmp_path / "run")}  # fmt: skip

    def keeper(mode, **params):
        program = script_program("router_keeper.py", {**base, "mode": mode, **params})
        return subprocess.run([sys.executable, "-"], input=program, capture_output=True, text=True, env=env, timeout=60)

    log = open(tmp_path / "keeper.log", "w")
    served = subprocess.Popen(
        [sys.executable, "-c", script_program("router_keeper.py", {**base, "mode": "serve"})],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        assert keeper("ready", timeout=20).returncode == 0, (tmp_path / "keeper.log").read_text()
        yield keeper, f"http://127.0.0.1:{port}", tmp_path / "keeper.log", served
    finally:
        os.killpg(served.pid, signal.SIGKILL)
        log.close()


def registered(base):
    with urllib.request.urlopen(base + "/workers", timeout=5) as response:
        return {w["url"]: w["model_id"] for w in json.load(response)["workers"]}


def post(base, path, body, method="POST"):
    request = urllib.request.Request(base + path, data=json.dumps(body).encode(), method=method)
    request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=5) as response:
        return json.load(response)


class Metrics:
    """A vLLM's /metrics: how many requests it runs."""

    def __init__(self):
        self.running = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                body = f'vllm:num_requests_running{{model_name="m"}} {float(outer.running)}\n'.encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def worker(url, model="m", replica="r"):
    return {"url": url, "model": model, "replica": replica}


def test_declared_workers_are_registered_and_anything_else_removed(router):
    keeper, base, _, _ = router
    done = keeper(
        "workers", timeout=20, workers=[worker("http://10.9.0.1:8000", "big"), worker("http://10.9.0.3:8001", "small")]
    )
    assert done.returncode == 0, done.stderr
    assert registered(base) == {"http://10.9.0.1:8000": "big", "http://10.9.0.3:8001": "small"}
    post(base, "/workers", {"url": "http://203.0.113.9:8000", "model_id": "big"})  # someone else's
    assert wait_for(lambda: "http://203.0.113.9:8000" not in registered(base), 5)
    assert keeper("workers", timeout=20, workers=[worker("http://10.9.0.1:8000", "big")]).returncode == 0
    assert registered(base) == {"http://10.9.0.1:8000": "big"}  # a removed deployment leaves the router


def test_a_restarted_router_gets_its_workers_back(router):
    keeper, base, log, served = router
    assert keeper("workers", timeout=20, workers=[worker("http://10.9.0.1:8000", "big")]).returncode == 0
    (pid,) = subprocess.run(["pgrep", "-P", str(served.pid)], capture_output=True, text=True).stdout.split()
    os.kill(int(pid), signal.SIGKILL)
    assert wait_for(lambda: _registered_or_none(base) == {"http://10.9.0.1:8000": "big"}, 15)
    assert "vllm-router exited with -9; starting it again" in log.read_text()


def _registered_or_none(base):
    try:
        return registered(base)
    except OSError:
        return None


def test_a_drain_takes_the_replica_out_and_waits_until_it_finished_what_it_served(router):
    keeper, base, log, _ = router
    busy, other = Metrics(), Metrics()
    workers = [worker(busy.url, "small", "small"), worker(other.url, "small", "small-2")]
    assert keeper("workers", timeout=20, workers=workers).returncode == 0
    busy.running = 1
    threading.Timer(2.0, lambda: setattr(busy, "running", 0)).start()
    started = time.monotonic()
    drained = keeper("drain", timeout=20, worker=workers[0])
    assert drained.returncode == 0, drained.stderr
    assert time.monotonic() - started >= 1.9  # waited for its request
    assert registered(base) == {other.url: "small"}  # the other replica serves meanwhile
    # a replica drained stays out, however often the workers are declared (a new `up` mid-change)
    assert keeper("workers", timeout=20, workers=workers).returncode == 0
    assert registered(base) == {other.url: "small"}
    assert keeper("undrain", timeout=20, worker=workers[0]).returncode == 0
    assert registered(base) == {busy.url: "small", other.url: "small"}
    assert "small (" in drained.stdout and "out of the router, idle after" in drained.stdout


def test_a_new_replica_is_declared_by_its_undrain(router):
    keeper, base, _, _ = router
    new = worker("http://10.9.0.3:8002", "small", "small-2")
    assert keeper("drain", timeout=20, worker=new).returncode == 0  # nothing runs there yet: done at once
    assert registered(base) == {}
    assert keeper("undrain", timeout=20, worker=new).returncode == 0
    assert registered(base) == {"http://10.9.0.3:8002": "small"}


def test_the_router_smoke_test_asks_each_model_with_the_key_and_names_a_missing_one(router):
    keeper, base, _, _ = router
    keeper(
        "workers", timeout=20, workers=[worker("http://10.9.0.1:8000", "big"), worker("http://10.9.0.3:8001", "small")]
    )
    smoke = keeper("smoke", models=["big", "small"], api_key="sk-k", prompt="hi", max_tokens=4, timeout=10)
    assert smoke.returncode == 0, smoke.stderr
    found = json.loads(smoke.stdout.strip().splitlines()[-1])["models"]
    assert set(found) == {"big", "small"} and found["big"]["completionTokens"] == 2
    missing = keeper("smoke", models=["nope"], api_key="sk-k", prompt="hi", max_tokens=4, timeout=10)
    assert missing.returncode != 0 and "router: nope answered 404" in missing.stderr


def test_without_the_version_in_the_image_it_installs_it_into_the_volume_once(tmp_path):
    """The install path: pip with --target into the volume, the index when set; a failing pip says what
    the node needs (no network here: a stand-in pip module records its argv and fails)."""
    fake = tmp_path / "site" / "pip"
    fake.mkdir(parents=True)
    record = tmp_path / "pip-argv"
    (fake / "__init__.py").write_text("")
    (fake / "__main__.py").write_text(
        f"import sys\nopen({str(record)!r}, 'w').write(' '.join(sys.argv[1:]))\nsys.exit(1)\n"
    )
    params = {"mode": "serve", "host": "127.0.0.1", "port": free_port(), "metrics_host": "127.0.0.1",
              "metrics_port": free_port(), "policy": "round_robin", "version": "9.9.9",
              "index_url": "https://pypi.mirror.example/simple", "health_interval": 5, "run_dir": str(tmp_path / "r")}  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-c", script_program("router_keeper.py", params)],
        capture_output=True, text=True, timeout=60, env={"PATH": os.environ["PATH"], "PYTHONPATH": str(fake.parent)},
    )  # fmt: skip
    assert result.returncode != 0
    assert "could not install vllm-router 9.9.9" in result.stderr and "router.indexUrl" in result.stderr
    argv = record.read_text()
    assert "vllm-router==9.9.9" in argv and "--index-url https://pypi.mirror.example/simple" in argv
    assert "/opt/spark-vllm-router/9.9.9.partial" in argv


def test_the_keeper_installs_where_the_router_container_mounts_its_volume():
    from components.names import ROUTER_INSTALL_DIR
    from components.render import script

    assert f'INSTALL_DIR = "{ROUTER_INSTALL_DIR}"' in script("router_keeper.py")
