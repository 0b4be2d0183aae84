"""components/scripts/router_keeper.py against a stand-in for vllm-router's HTTP API (the part the keeper
speaks: GET/POST /workers, DELETE /workers/<url>, /health, /v1/chat/completions; its behaviour as
vllm-router 0.1.17 showed it here: registrations in memory only, gone when it restarts) and stand-in
vLLMs' /metrics. The real vllm-router is run by the rehearsal (tests/e2e/test_deployments.py)."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from components.plan.edge import EdgeSpec, key_digest
from components.plan.programs import script_program
from components.scripts.node_watch import HealthWatch
from tests.edge_harness import Edge
from tests.fake_vllm_http import FakeVllm
from tests.waiting import free_port, wait_for

FAKE_ROUTER = """
import json, select, socket, sys, time, urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

def main():
    args = sys.argv[1:]
    port = int(args[args.index("--port") + 1])
    workers = {}  # url -> model: in memory, as vllm-router keeps them

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as vllm-router (hyper) answers

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
            if self.path == "/v1/models":  # vllm-router 0.1.17's own shape
                return self.reply(200, {"models": sorted(set(workers.values()))})
            return self.reply(200, {"ok": True})

        def do_POST(self):
            if self.headers.get("Transfer-Encoding") == "chunked":  # a client streaming its request body
                data = b""
                while True:
                    size = int(self.rfile.readline().strip(), 16)
                    if size == 0:
                        self.rfile.readline()
                        break
                    data += self.rfile.read(size)
                    self.rfile.readline()
                body = json.loads(data)
            else:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path == "/v1/chat/completions" and body.get("stream"):  # SSE, a chunk at a time
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for n in range(3):
                    event = f"data: {json.dumps({'n': n})}\\n\\n".encode()
                    self.wfile.write(b"%x\\r\\n%s\\r\\n" % (len(event), event))
                    self.wfile.flush()
                    time.sleep(0.4)
                self.wfile.write(b"0\\r\\n\\r\\n")
                return
            if self.path == "/workers":
                workers[body["url"]] = body["model_id"]
                return self.reply(200, {"success": True})
            if self.path == "/v1/chat/completions":
                # hyper (vllm-router) drops a request whose client hung up before the answer: so does this
                ready, _, _ = select.select([self.connection], [], [], 0.3)
                if ready and self.connection.recv(1, socket.MSG_PEEK) == b"":
                    self.close_connection = True
                    return
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


# What the program renders for the edge from the declared workers (components/resources/cluster.py): every model,
# drained or not
CATALOGUE = [{"id": "big", "root": "/models/big", "max_model_len": 4096},
             {"id": "small", "root": "/models/small", "max_model_len": 4096}]  # fmt: skip


@pytest.fixture
def router(tmp_path):
    """A keeper in serve mode, on a stand-in vllm-router importable as the image's own (version 0.1.17), behind
    the edge (a real HAProxy with the configuration the program renders) on the endpoint's port."""
    site = tmp_path / "site"
    (site / "vllm_router").mkdir(parents=True)
    (site / "vllm_router" / "__init__.py").write_text("")
    (site / "vllm_router" / "launch_router.py").write_text(FAKE_ROUTER)
    dist = site / "vllm_router-0.1.17.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-router\nVersion: 0.1.17\n")
    port = free_port()
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(site), "SPARK_VLLM_ROUTER_RUN_DIR": str(tmp_path / "run")}
    inner = free_port()
    base = {"host": "127.0.0.1", "port": port, "inner_port": inner, "metrics_host": "127.0.0.1", "metrics_port": free_port(),
            "policy": "round_robin", "version": "0.1.17", "index_url": None, "health_interval": 5}  # fmt: skip

    def keeper(mode, **params):
        program = script_program("router_keeper.py", {**base, "mode": mode, **params})
        return subprocess.run([sys.executable, "-"], input=program, capture_output=True, text=True, env=env, timeout=60)

    log = open(tmp_path / "keeper.log", "w")
    served = subprocess.Popen(
        [sys.executable, "-c", script_program("router_keeper.py", {**base, "mode": "serve"})],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    # its own port off the default (29003, a node's): two processes' edges both took it, and a port handed out here
    # could be it (a fake vllm-router on 29003 failed to bind, 2026-12-07)
    spec = EdgeSpec("127.0.0.1", port, "127.0.0.1", inner, metrics_port=free_port(), clients=(("client", key_digest(KEY)),),
                    models=CATALOGUE)  # fmt: skip
    edge = Edge(spec, tmp_path).start()
    try:
        assert keeper("ready", timeout=20).returncode == 0, (tmp_path / "keeper.log").read_text()
        # the keeper's steps reach vllm-router's admin API on loopback (its inner port); clients the edge
        served.front = f"http://127.0.0.1:{port}"
        yield keeper, f"http://127.0.0.1:{inner}", tmp_path / "keeper.log", served
    finally:
        edge.close()
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
    """A vLLM's /metrics (how many requests it runs, the tokens it generated) and /health."""

    def __init__(self):
        self.running = 0
        self.generated = 0
        self.health = 200
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                if self.path == "/health":
                    self.send_response(outer.health)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                body = (f'vllm:num_requests_running{{model_name="m"}} {float(outer.running)}\n'
                        f'vllm:generation_tokens_total{{model_name="m"}} {float(outer.generated)}\n').encode()  # fmt: skip
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


def test_a_replica_that_serves_no_more_is_taken_out_until_it_serves_again(router):
    """Declared with its vllm.stallSeconds (as the program declares every replica): stalled with requests
    running, or /health not 200, it gets nothing new; moving and healthy again, it is back."""
    keeper, base, log, _ = router
    stuck, other = Metrics(), Metrics()
    workers = [
        {**worker(stuck.url, "small", "a"), "stall_seconds": 3},
        {**worker(other.url, "small", "b"), "stall_seconds": 3},
    ]
    assert keeper("workers", timeout=20, workers=workers).returncode == 0
    assert registered(base) == {stuck.url: "small", other.url: "small"}
    stuck.running = 2  # requests running, no token comes
    assert wait_for(lambda: registered(base) == {other.url: "small"}, 15), log.read_text()
    assert (
        f"{stuck.url} out of the router: 2 request(s) running or waiting and none of vLLM's progress" in log.read_text()
    )
    stuck.running, stuck.generated = 0, 50  # restarted by its supervisor: serving again
    assert wait_for(lambda: registered(base) == {stuck.url: "small", other.url: "small"}, 15), log.read_text()
    other.health = 503  # restarting
    assert wait_for(lambda: registered(base) == {stuck.url: "small"}, 15)
    assert f"{other.url} out of the router: /health does not answer 200" in log.read_text()
    other.health = 200
    assert wait_for(lambda: registered(base) == {stuck.url: "small", other.url: "small"}, 15)


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
    smoke = keeper(
        "smoke", models=["big", "small"], api_key=KEY, prompt="hi", max_tokens=4, timeout=10, wait_served_seconds=5
    )
    assert smoke.returncode == 0, smoke.stderr
    found = json.loads(smoke.stdout.strip().splitlines()[-1])["models"]
    assert set(found) == {"big", "small"} and found["big"]["completionTokens"] == 2
    missing = keeper(
        "smoke", models=["nope"], api_key=KEY, prompt="hi", max_tokens=4, timeout=10, wait_served_seconds=5
    )
    assert missing.returncode != 0 and "router: nope answered 404" in missing.stderr
    with FakeVllm(health=503) as endpoint:  # an endpoint whose /health is not 200: no model is asked
        unserved = keeper("smoke", models=["big"], api_key=KEY, prompt="hi", max_tokens=4, timeout=10,
                          wait_served_seconds=1, port=endpoint.port)  # fmt: skip
    assert unserved.returncode != 0 and endpoint.requests == ["/health"] * len(endpoint.requests)
    said = f"router: the endpoint's /health (http://127.0.0.1:{endpoint.port}) still answered HTTP 503 after 1 s"
    assert said in unserved.stderr, unserved.stderr


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
    params = {"mode": "serve", "host": "127.0.0.1", "port": free_port(), "inner_port": free_port(), "metrics_host": "127.0.0.1",
              "metrics_port": free_port(), "policy": "round_robin", "version": "9.9.9",
              "index_url": "https://pypi.mirror.example/simple", "health_interval": 5}  # fmt: skip
    result = subprocess.run(
        [sys.executable, "-c", script_program("router_keeper.py", params)],
        capture_output=True, text=True, timeout=60, env={"PATH": os.environ["PATH"], "PYTHONPATH": str(fake.parent),
             "SPARK_VLLM_ROUTER_RUN_DIR": str(tmp_path / "r")},
    )  # fmt: skip
    assert result.returncode != 0
    assert "could not install vllm-router 9.9.9" in result.stderr and "router.indexUrl" in result.stderr
    argv = record.read_text()
    assert "vllm-router==9.9.9" in argv and "--index-url https://pypi.mirror.example/simple" in argv
    assert "/opt/spark-vllm-router/9.9.9.partial" in argv


def test_the_keeper_installs_where_the_router_container_mounts_its_volume():
    from components.plan.names import ROUTER_INSTALL_DIR
    from components.plan.programs import script

    assert f'INSTALL_DIR = "{ROUTER_INSTALL_DIR}"' in script("router_keeper.py")


# --- through the edge: the stack's endpoint ------------------------------------------------------------------

KEY = "sk-front-test-key"


def ask(front, method, path, key=None, body=None, connection=None):
    """(status, parsed body) from the front; `connection` keeps one connection open across requests."""
    host, port = front[len("http://") :].split(":")
    own = connection is None
    connection = connection or http.client.HTTPConnection(host, int(port), timeout=10)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    data = None
    if body is not None:
        data, headers["Content-Type"] = json.dumps(body), "application/json"
    connection.request(method, path, body=data, headers=headers)
    response = connection.getresponse()
    payload = response.read()
    if own:
        connection.close()
    return response.status, json.loads(payload) if payload else None


def declare(keeper, *entries):
    workers = [
        dict(worker(url, model, name), root=f"/models/{model}", max_model_len=4096) for url, model, name in entries
    ]
    assert keeper("workers", timeout=20, workers=workers).returncode == 0
    return workers


def test_the_endpoint_lists_every_declared_model_as_openai_does_with_the_key(router):
    keeper, _, _, served = router
    workers = declare(
        keeper,
        ("http://10.9.0.1:8000", "big", "big"),
        ("http://10.9.0.3:8001", "small", "small"),
        ("http://10.9.0.3:8002", "small", "small-2"),
    )
    status, listing = ask(served.front, "GET", "/v1/models", KEY)
    assert status == 200 and listing["object"] == "list"
    assert [(m["id"], m["object"], m["owned_by"], m["root"], m["max_model_len"]) for m in listing["data"]] == [
        ("big", "model", "vllm", "/models/big", 4096),
        ("small", "model", "vllm", "/models/small", 4096),
    ]
    assert (
        ask(served.front, "GET", "/v1/models")[0] == 401 and ask(served.front, "GET", "/v1/models", "sk-no")[0] == 401
    )
    assert ask(served.front, "GET", "/v1/models/small", KEY) == (200, listing["data"][1])
    status, missing = ask(served.front, "GET", "/v1/models/nope", KEY)
    assert status == 404 and missing["error"]["message"] == "The model does not exist."
    # a drained (or down) replica's model is still served: the listing stays whole
    assert keeper("drain", timeout=20, worker=workers[0]).returncode == 0
    assert [m["id"] for m in ask(served.front, "GET", "/v1/models", KEY)[1]["data"]] == ["big", "small"]


def test_the_endpoint_keeps_vllm_routers_admin_api_off_the_network(router):
    keeper, inner, _, served = router
    declare(keeper, ("http://10.9.0.1:8000", "big", "big"))
    for method, path in (
        ("GET", "/workers"),
        ("POST", "/workers"),
        ("POST", "/add_worker?url=http://x:1"),
        ("GET", "/list_workers"),
        ("POST", "/remove_worker?url=http://10.9.0.1:8000"),
    ):
        assert (
            ask(served.front, method, path, KEY, body={"url": "http://203.0.113.9:8000", "model_id": "big"})[0] == 404
        )
    assert registered(inner) == {"http://10.9.0.1:8000": "big"}  # the keeper's own way in still works


def test_requests_pass_through_on_one_connection_between_local_answers(router):
    keeper, _, _, served = router
    declare(keeper, ("http://10.9.0.1:8000", "big", "big"))
    host, port = served.front[len("http://") :].split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=10)
    chat = {"model": "big", "messages": [{"role": "user", "content": "hi"}]}
    for _ in range(3):  # a client's keep-alive connection: listing, a request, listing again
        assert ask(served.front, "GET", "/v1/models", KEY, connection=connection)[0] == 200
        status, answer = ask(served.front, "POST", "/v1/chat/completions", KEY, chat, connection=connection)
        assert status == 200 and answer["key"] == f"Bearer {KEY}"  # passed on for vLLM to check
    connection.close()


def test_a_streamed_answer_comes_through_chunk_by_chunk_and_a_chunked_request_body_goes_in(router):
    keeper, _, _, served = router
    declare(keeper, ("http://10.9.0.1:8000", "big", "big"))
    host, port = served.front[len("http://") :].split(":")
    body = json.dumps({"model": "big", "messages": [], "stream": True}).encode()
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(part), part) for part in (body[:10], body[10:])) + b"0\r\n\r\n"
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n").encode()  # fmt: skip
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        started = time.monotonic()
        sock.sendall(head + chunked)
        seen, first_at = b"", None
        while not seen.endswith(b"0\r\n\r\n"):
            data = sock.recv(65536)
            if not data:
                break
            seen += data
            if first_at is None and b"data:" in seen:
                first_at = time.monotonic() - started
    assert seen.startswith(b"HTTP/1.1 200") and seen.count(b"data:") == 3
    # the first event arrives as vllm-router sends it, not after the last (0.4 s apart at the fake)
    assert first_at is not None and first_at < 0.35 and time.monotonic() - started > 0.8, first_at


def test_a_client_that_asks_to_close_the_connection_still_gets_its_answer(router):
    """urllib (and the router's own smoke step) sends `Connection: close`: the front must not hang up on
    vllm-router before the answer came back (seen in the rehearsal: 'Remote end closed connection')."""
    keeper, _, _, served = router
    declare(keeper, ("http://10.9.0.1:8000", "big", "big"))
    request = urllib.request.Request(served.front + "/v1/chat/completions", method="POST",
                                      data=json.dumps({"model": "big", "messages": []}).encode())  # fmt: skip
    request.add_header("Authorization", f"Bearer {KEY}")
    request.add_header("Content-Type", "application/json")
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200 and json.load(response)["model"] == "big"


def test_one_slow_health_answer_is_not_a_replica_gone_two_in_a_row_are():
    """On a loaded node one /health answer past its timeout took the replica out: with the other drained for a
    rolling change the model had none in the router (vllm-router's 404 to every request until the next pass)."""
    health = HealthWatch(2)
    assert [health.see(ok) for ok in (True, False, True, False, False, False, True)] == [
        False, False, False, False, True, True, False,
    ]  # fmt: skip
