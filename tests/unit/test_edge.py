"""The edge (components/plan/edge.py): its configuration rendered, and a real HAProxy running it in front of an
upstream that records every byte. The attack table is spellings of the same few intents (reach vllm-router's
admin API or vLLM's unguarded routes, get a completion without the key, smuggle a request past the edge): each
must be refused, and the upstream must never see anything but the routes the endpoint serves."""

from __future__ import annotations

import json
import re
import socket
import ssl
import threading
import time
import urllib.error
import urllib.request

import pytest

from components.plan.edge import KEYED_ROUTES, ROUTES, EdgeSpec, Timeouts, key_digest, quoted, render
from tests.attacks import FORBIDDEN, HIDDEN, refusals, smuggling, spellings
from tests.attacks import request as attack_request
from tests.edge_harness import Edge, Recorder, edge_spec, exchange, statuses
from tests.fake_vllm_http import FakeVllm
from tests.tls_ca import TestCa
from tests.unit.test_scripts import run_script
from tests.waiting import wait_until

KEY = "sk-edge-test-key"
CHAT = b'{"model":"small","messages":[{"role":"user","content":"hi"}]}'


@pytest.fixture(scope="module")
def module_edge(tmp_path_factory):
    """One edge with the client's key, and its upstream, for every test of a process that takes `edge`: such a test
    only sends requests, and starting HAProxy for each was 80 % of an attack-table case's CPU (0.066 of 0.081 CPU-s,
    2026-12-07)."""
    recorder = Recorder().start()
    running = Edge(edge_spec(recorder, clients=(("client", key_digest(KEY)),)), tmp_path_factory.mktemp("edge")).start()
    yield running, recorder
    running.close()
    recorder.close()


@pytest.fixture
def upstream(request):
    """An upstream that has received nothing yet: the module's edge's (reset) for a test that takes `edge`, else one of
    the test's own (which may close it)."""
    if "edge" in request.fixturenames:
        _, recorder = request.getfixturevalue("module_edge")
        recorder.reset()
        yield recorder
        return
    recorder = Recorder().start()
    yield recorder
    recorder.close()


@pytest.fixture
def edge(module_edge, upstream):
    running, _ = module_edge
    assert running.process.poll() is None, running.log.read_text()[-2000:]  # an earlier test did not end it
    return running


def test_bytes_a_kept_alive_connection_sends_after_a_reset_are_the_next_tests():
    """The module's upstream is reset between tests while HAProxy keeps its connections to it open: what comes on
    such a connection afterwards is in the new test's `received`, never added to a list no test reads."""
    recorder = Recorder().start()
    try:
        with socket.create_connection(("127.0.0.1", recorder.port)) as conn:
            conn.sendall(b"GET /v1/models HTTP/1.1\r\nHost: a\r\n\r\n")
            assert b"200 OK" in conn.recv(65536)
            before = recorder.received
            recorder.reset()
            assert recorder.received == [] and recorder.checks == 0
            conn.sendall(b"POST /admin HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\n\r\n{}")
            assert b"200 OK" in conn.recv(65536)
        assert recorder.request_lines() == ["POST /admin HTTP/1.1"]
        assert len(before) == 1 and b"/admin" not in before[0]
    finally:
        recorder.close()


def request(method: str, target: str, host: str, key: str | None = KEY, body: bytes = b"") -> bytes:
    return attack_request(method, target, host, key, body)


def upstream_saw_only_routes(upstream: Recorder) -> None:
    time.sleep(0.1)  # what was forwarded has arrived
    for line in upstream.request_lines():
        method, target, _ = line.split(" ")
        assert target in ROUTES and method in ROUTES[target], f"the upstream received {line!r}"


# --- the configuration, rendered -------------------------------------------------------------------


def test_quoted_takes_every_character_literally():
    assert quoted('a"b$HOME\\c') == '"a\\"b\\$HOME\\\\c"'


@pytest.mark.parametrize("hostile", ["a\nb", "a\rb", "a\x00b", "a\x7fb"])
def test_a_control_character_cannot_reach_the_configuration(hostile):
    with pytest.raises(ValueError, match="control character"):
        quoted(hostile)


def test_the_configuration_holds_digests_never_a_key():
    text = render(EdgeSpec("0.0.0.0", 8080, "127.0.0.1", 29001, clients=(("client", key_digest(KEY)),)))
    assert KEY not in text
    assert key_digest(KEY) in text


def test_streamed_tokens_are_passed_on_as_they_come():
    """HAProxy merges small chunks by default: +32 ms to the first token measured (benchmarks/router_hop.py)."""
    assert "    option http-no-delay" in render(EdgeSpec("0.0.0.0", 8080, "127.0.0.1", 29001)).splitlines()


def test_without_keys_no_key_is_asked_for_but_routes_still_are():
    text = render(EdgeSpec("0.0.0.0", 8080, "127.0.0.1", 29001))
    assert "status 401" not in text and "authorization),sha2" not in text
    assert "status 404" in text


# --- a real HAProxy ---------------------------------------------------------------------------------


def test_a_client_with_the_key_reaches_every_route(edge, upstream):
    host = f"127.0.0.1:{edge.spec.port}"
    for target, methods in KEYED_ROUTES.items():
        answer = exchange(edge.spec.port, request(methods[0], target, host, body=CHAT if methods[0] == "POST" else b""))
        assert statuses(answer) == [200], (target, answer)
        assert json.loads(answer.split(b"\r\n\r\n", 1)[1]) == {"upstream": f"{methods[0]} {target} HTTP/1.1"}


@pytest.mark.parametrize("key", [None, KEY])
def test_health_is_answered_by_the_edge_from_its_checks_and_nothing_of_it_reaches_the_upstream(upstream, tmp_path, key):
    """/health says what the edge's own checks of the upstream's /health found; its query, headers and body stay
    at the edge, and the connection is closed after it."""
    edge = Edge(edge_spec(upstream, clients=(("client", key_digest(KEY)),)), tmp_path).start()
    try:
        wait_until(lambda: upstream.checks > 0, 10, "the edge checks the upstream")
        body = b"x" * 100000
        for raw in (request("GET", "/health", "h", key), request("HEAD", "/health", "h", key),
                    request("GET", "/health?api_key=sk-secret-0000000000", "h", key, body=body)):  # fmt: skip
            answer = exchange(edge.spec.port, raw.replace(b"Connection: close\r\n", b""))
            assert statuses(answer) == [200] and b"connection: close" in answer.lower(), answer
        assert upstream.received == []
        upstream.close()  # the upstream gone: /health says so within a few seconds, as vLLM's own would
        wait_until(lambda: statuses(exchange(edge.spec.port, request("GET", "/health", "h", key))) == [503], 15,
                   "/health is 503 once the upstream is gone")  # fmt: skip
        assert b"sk-secret" not in edge.log.read_bytes()
    finally:
        edge.close()


def test_an_absolute_form_target_reaches_the_upstream_in_origin_form(edge, upstream):
    host = f"127.0.0.1:{edge.spec.port}"
    answer = exchange(edge.spec.port, request("POST", f"http://{host}/v1/chat/completions?x=1", host, body=CHAT))
    assert statuses(answer) == [200]
    assert upstream.request_lines() == ["POST /v1/chat/completions?x=1 HTTP/1.1"]


@pytest.mark.parametrize("key", [None, "wrong", KEY.upper(), KEY + "x", ""])
@pytest.mark.parametrize("method,target", [("POST", "/v1/chat/completions"), ("POST", "/v1/completions"),
                                           ("GET", "/v1/models")])  # fmt: skip
def test_no_completion_and_no_model_list_without_the_key(edge, upstream, key, method, target):
    host = f"127.0.0.1:{edge.spec.port}"
    answer = exchange(edge.spec.port, request(method, target, host, key=key, body=CHAT if method == "POST" else b""))
    assert statuses(answer) == [401]
    assert upstream.received == []


@pytest.mark.parametrize("authorization", [f"bearer {KEY}", f"Bearer  {KEY}", KEY, f"Basic {KEY}", f"Bearer{KEY}"])
def test_the_key_counts_only_as_vllm_reads_it(edge, upstream, authorization):
    raw = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: h\r\nAuthorization: {authorization}\r\n"
        f"Content-Length: {len(CHAT)}\r\nConnection: close\r\n\r\n"
    ).encode() + CHAT
    assert statuses(exchange(edge.spec.port, raw)) == [401]
    assert upstream.received == []


def test_two_authorization_headers_are_refused_whichever_comes_first(edge, upstream):
    for first, second in ((KEY, "wrong"), ("wrong", KEY)):
        raw = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: h\r\nAuthorization: Bearer {first}\r\n"
            f"Authorization: Bearer {second}\r\nContent-Length: {len(CHAT)}\r\nConnection: close\r\n\r\n"
        ).encode() + CHAT
        assert statuses(exchange(edge.spec.port, raw)) in ([400], [401])
    assert upstream.received == []


@pytest.mark.parametrize("key", [KEY, None, "wrong"])
@pytest.mark.parametrize("path", FORBIDDEN)
def test_no_spelling_of_a_route_not_served_reaches_the_upstream(edge, upstream, path, key):
    host = f"127.0.0.1:{edge.spec.port}"
    for target in spellings(path, host):
        for method in ("GET", "POST", "DELETE"):
            answer = exchange(edge.spec.port, request(method, target, host, key=key, body=b"{}"))
            found = statuses(answer)
            assert found and found[0] in (400, 401, 404, 405), (method, target, answer[:200])
    assert upstream.received == []


@pytest.mark.parametrize("version", ["HTTP/1.0", "HTTP/1.1"])
def test_http_1_0_is_held_to_the_same_routes(edge, upstream, version):
    raw = f"GET /workers {version}\r\n\r\n".encode()
    assert statuses(exchange(edge.spec.port, raw))[0] in (400, 401, 404)
    assert upstream.received == []


@pytest.mark.parametrize("raw", [b"OPTIONS * HTTP/1.1\r\nHost: h\r\n\r\n", b"CONNECT 127.0.0.1:22 HTTP/1.1\r\nHost: h\r\n\r\n",
                                 b"TRACE / HTTP/1.1\r\nHost: h\r\n\r\n", b"GET workers HTTP/1.1\r\nHost: h\r\n\r\n",
                                 b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"])  # fmt: skip
def test_other_request_forms_are_refused(edge, upstream, raw):
    exchange(edge.spec.port, raw)
    assert upstream.received == []


SMUGGLING = smuggling(KEY)


@pytest.mark.parametrize("name", SMUGGLING)
def test_no_request_is_smuggled_past_the_edge(edge, upstream, name):
    exchange(edge.spec.port, SMUGGLING[name])
    time.sleep(0.1)
    assert not any(b"/workers" in raw for raw in upstream.received), upstream.received
    upstream_saw_only_routes(upstream)


def test_an_oversized_head_is_refused(edge, upstream):
    raw = request("POST", "/v1/chat/completions", "h", body=CHAT).replace(
        b"\r\n\r\n", b"\r\nX-Big: " + b"a" * 70000 + b"\r\n\r\n", 1
    )
    assert statuses(exchange(edge.spec.port, raw))[:1] in ([400], [431], [])
    assert upstream.received == []


# --- the model list, answered by the edge itself ------------------------------------------------------


@pytest.fixture
def catalogue_edge(upstream, tmp_path):
    models = [{"id": "Qwen/Qwen3-8B", "root": "/models/qwen", "max_model_len": 8192}, {"id": "small", "root": None}]
    running = Edge(edge_spec(upstream, clients=(("client", key_digest(KEY)),), models=models), tmp_path).start()
    yield running
    running.close()


def body_of(answer: bytes):
    return json.loads(answer.split(b"\r\n\r\n", 1)[1])


def test_the_model_list_is_openais_with_every_declared_model(catalogue_edge, upstream):
    answer = exchange(catalogue_edge.spec.port, request("GET", "/v1/models", "h"))
    listed = body_of(answer)
    assert listed["object"] == "list"
    assert [card["id"] for card in listed["data"]] == ["Qwen/Qwen3-8B", "small"]
    assert listed["data"][0]["root"] == "/models/qwen" and listed["data"][0]["max_model_len"] == 8192
    assert listed["data"][1]["root"] == "small"
    assert upstream.received == []


@pytest.mark.parametrize("target", ["/v1/models/Qwen/Qwen3-8B", "/v1/models/Qwen%2FQwen3-8B"])
def test_one_models_card_as_written_or_encoded(catalogue_edge, target):
    assert body_of(exchange(catalogue_edge.spec.port, request("GET", target, "h")))["id"] == "Qwen/Qwen3-8B"


@pytest.mark.parametrize("target", ["/v1/models/nope", "/v1/models/../../workers", "/v1/models/small/../../workers"])
def test_an_unknown_model_card_is_404_and_never_forwarded(catalogue_edge, upstream, target):
    assert statuses(exchange(catalogue_edge.spec.port, request("GET", target, "h"))) == [404]
    assert statuses(exchange(catalogue_edge.spec.port, request("GET", target, "h", key=None))) == [401]
    assert upstream.received == []


def test_a_model_id_with_every_awkward_character_round_trips(upstream, tmp_path):
    awkward = "we\"ird $HOME \\x/y#z'q"
    edge = Edge(edge_spec(upstream, models=[{"id": awkward}]), tmp_path).start()
    try:
        listed = body_of(exchange(edge.spec.port, request("GET", "/v1/models", "h", key=None)))
        assert listed["data"][0]["id"] == awkward
    finally:
        edge.close()


# --- outliving abuse ---------------------------------------------------------------------------------


def test_slow_and_idle_clients_are_dropped_and_the_endpoint_still_answers(upstream, tmp_path):
    edge = Edge(edge_spec(upstream, max_connections=8, timeouts=Timeouts(head=1, idle=1)), tmp_path).start()
    try:
        held = [socket.create_connection(("127.0.0.1", edge.spec.port)) for _ in range(8)]
        for index, sock in enumerate(held):  # half send a head that never ends, half nothing at all
            if index % 2:
                sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: h\r\n")
        started = time.monotonic()
        for sock in held:
            sock.settimeout(5)
            while sock.recv(4096):
                pass
            sock.close()
        assert time.monotonic() - started < 4
        answer = exchange(edge.spec.port, request("GET", "/health", "h", key=None))
        assert statuses(answer) == [200]
    finally:
        edge.close()


def test_a_reload_keeps_the_listener_and_applies_new_keys(upstream, tmp_path):
    edge = Edge(edge_spec(upstream, clients=(("client", key_digest(KEY)),)), tmp_path).start()
    try:
        second = "sk-second-key-0001"
        edge.reload(
            edge_spec(
                upstream,
                port=edge.spec.port,
                metrics_port=edge.spec.metrics_port,
                clients=(("client", key_digest(second)),),
            )
        )

        def applied() -> bool:  # the old process stops listening once the new one does: a moment with both
            old = exchange(edge.spec.port, request("POST", "/v1/completions", "h", body=b"{}"))
            new = exchange(edge.spec.port, request("POST", "/v1/completions", "h", key=second, body=b"{}"))
            return statuses(old) == [401] and statuses(new) == [200]

        deadline, streak = time.monotonic() + 10, 0
        while streak < 5 and time.monotonic() < deadline:
            streak = streak + 1 if applied() else 0
        assert streak == 5
    finally:
        edge.close()


def test_the_attack_table_finds_what_an_unguarded_server_lets_through(edge, upstream):
    """The rehearsal's check (tests/attacks.py refusals) can fail: the recording upstream answers everything."""
    assert refusals("127.0.0.1", edge.spec.port, KEY, paths=("/workers", "/invocations")) == []
    assert len(refusals("127.0.0.1", upstream.port, KEY, paths=("/workers",))) == 15 * 3 * 3


def test_the_model_list_names_each_served_model_once_drained_replicas_included():
    from components.plan.endpoint import declared_models

    workers = [
        {"url": "http://10.9.0.3:8000", "model": "small", "root": "/models/s", "max_model_len": 4096},
        {"url": "http://10.9.0.3:8001", "model": "small", "root": "/models/s", "max_model_len": 4096},
        {"url": "http://10.9.0.1:8000", "model": "big", "root": "/models/b", "max_model_len": None},
    ]
    assert declared_models(workers) == [
        {"id": "big", "root": "/models/b", "max_model_len": None},
        {"id": "small", "root": "/models/s", "max_model_len": 4096},
    ]


ODD_FORMS = {
    "HTTP/0.9": b"GET /workers\r\n",
    "a tab in the request line": b"GET\t/workers HTTP/1.1\r\nHost: h\r\n\r\n",
    "a fragment": b"GET /workers#x HTTP/1.1\r\nHost: h\r\n\r\n",
    "a trailing slash": b"POST /v1/completions/ HTTP/1.1\r\nHost: h\r\nContent-Length: 0\r\n\r\n",
    "no Host": b"GET /workers HTTP/1.1\r\n\r\n",
    "an Upgrade to a tunnel": b"POST /v1/chat/completions HTTP/1.1\r\nHost: h\r\nAuthorization: Bearer "
    + KEY.encode()
    + b"\r\nConnection: Upgrade\r\nUpgrade: websocket\r\nContent-Length: 0\r\n\r\n",
    "h2c upgrade": b"GET /v1/models HTTP/1.1\r\nHost: h\r\nAuthorization: Bearer "
    + KEY.encode()
    + b"\r\nConnection: Upgrade, HTTP2-Settings\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAARAAAAAAAIAAAAA\r\n\r\n",
    "Transfer-Encoding chunked, identity": b"POST /v1/completions HTTP/1.1\r\nHost: h\r\nAuthorization: Bearer "
    + KEY.encode()
    + b"\r\nTransfer-Encoding: chunked, identity\r\n\r\n0\r\n\r\n"
    + HIDDEN,
    "a NUL in a header": b"GET /v1/models HTTP/1.1\r\nHost: h\r\nX-A: a\x00b\r\n\r\n",
}


@pytest.mark.parametrize("name", ODD_FORMS)
def test_odd_request_forms_never_reach_the_upstream_with_another_route(edge, upstream, name):
    answer = exchange(edge.spec.port, ODD_FORMS[name])
    assert b'"upstream": "GET /workers' not in answer and not any(b"/workers" in raw for raw in upstream.received)
    if name.startswith(("an Upgrade", "h2c")):
        assert statuses(answer)[:1] == [400] and upstream.received == []
    upstream_saw_only_routes(upstream)


# --- clients by name, the program's key upstream, TLS --------------------------------------------------

PROGRAM = "sk-spark-vllm-program-key-0000000000000000"
ALICE, BOB = "sk-alice-000000000000000001", "sk-bob-00000000000000000002"


def clients(**keys: str) -> tuple[tuple[str, str], ...]:
    return tuple((name, key_digest(key)) for name, key in keys.items())


def edge_metrics(edge: Edge) -> dict[tuple[str, str], int]:
    """spark_vllm_edge_requests_total by (client, model), from the edge's own port."""
    with urllib.request.urlopen(
        f"http://{edge.spec.metrics_host}:{edge.spec.metrics_port}/metrics", timeout=5
    ) as answer:
        text = answer.read().decode()
    found = {}
    for client, model, count in re.findall(r'^spark_vllm_edge_requests_total\{client="([^"]*)",model="([^"]*)"\} (\d+)$',
                                           text, re.M):  # fmt: skip
        found[(client, model)] = int(count)
    return found


def test_each_client_is_known_by_name_and_vllm_gets_the_programs_key_never_theirs(upstream, tmp_path):
    spec = edge_spec(upstream, clients=clients(alice=ALICE, bob=BOB, **{"spark-vllm": PROGRAM}), upstream_key=PROGRAM,
                     model_names=("small",))  # fmt: skip
    edge = Edge(spec, tmp_path).start()
    try:
        for key, body in ((ALICE, CHAT), (ALICE, CHAT), (BOB, b'{"model":"big","messages":[]}'), (BOB, b"{}")):
            answer = exchange(spec.port, request("POST", "/v1/chat/completions", "h", key=key, body=body))
            assert statuses(answer) == [200]
        assert statuses(exchange(spec.port, request("GET", "/v1/models", "h", key=ALICE))) == [200]
        assert statuses(
            exchange(spec.port, request("POST", "/v1/completions", "h", key="sk-nobody-00000000000000"))
        ) == [401]
        time.sleep(0.2)
        forwarded = b"".join(upstream.received).decode("latin-1").lower()
        assert forwarded.count(f"authorization: bearer {PROGRAM}".lower()) == 5
        assert ALICE.lower() not in forwarded and BOB.lower() not in forwarded
        # a model the stack does not serve, or none, is `other`; the routes without one `-`
        assert edge_metrics(edge) == {("alice", "small"): 2, ("bob", "other"): 2, ("alice", "-"): 1}
        log = edge.log.read_text()
        assert "client=alice model=small" in log and "client=bob model=other" in log
        assert ALICE not in log and BOB not in log and PROGRAM not in log
    finally:
        edge.close()


def test_the_edges_own_port_serves_metrics_and_its_check_and_nothing_else(edge):
    """/metrics on the fabric address (127.0.0.2 here), the watchdog's check on loopback at the same port: each
    only where it belongs."""
    own, fabric = edge.spec.metrics_port, edge.spec.metrics_host
    assert statuses(exchange(own, request("GET", "/spark-vllm-edge/alive", "h", key=None))) == [200]
    assert statuses(exchange(own, request("GET", "/metrics", "h", key=None), host=fabric)) == [200]
    assert statuses(exchange(own, request("GET", "/spark-vllm-edge/alive", "h", key=None), host=fabric)) == [404]
    assert statuses(exchange(own, request("GET", "/metrics", "h", key=None))) == [404]
    for path in ("/v1/models", "/health", "/v1/chat/completions", "/metrics/x"):
        for host in ("127.0.0.1", fabric):
            assert statuses(exchange(own, request("GET", path, "h", key=KEY), host=host)) == [404], path


def test_over_tls_a_client_that_verifies_gets_through_and_nothing_plain_does(upstream, tmp_path):
    ca, other_ca = TestCa(), TestCa("another CA")
    issued = ca.issue("127.0.0.1", "edge.test")
    spec = edge_spec(
        upstream, clients=clients(alice=ALICE), upstream_key=PROGRAM, tls_pem=issued.certificate + issued.key
    )
    edge = Edge(spec, tmp_path).start()
    try:
        for name in ("127.0.0.1", "edge.test"):  # verified for the name the client asked for (SNI)
            context = ssl.create_default_context(cadata=ca.pem)
            with socket.create_connection(("127.0.0.1", spec.port), timeout=5) as raw:
                with context.wrap_socket(raw, server_hostname=name) as tls:
                    assert tls.version() in ("TLSv1.2", "TLSv1.3")
                    tls.sendall(request("POST", "/v1/chat/completions", name, key=ALICE, body=CHAT))
                    assert tls.recv(65536).startswith(b"HTTP/1.1 200")
        for server_name, trusted in (("127.0.0.1", other_ca), ("spark-02.lan", ca)):  # another CA, another name
            context = ssl.create_default_context(cadata=trusted.pem)
            with socket.create_connection(("127.0.0.1", spec.port), timeout=5) as raw:
                with pytest.raises(ssl.SSLCertVerificationError):
                    context.wrap_socket(raw, server_hostname=server_name)
        # plain HTTP on the endpoint's port: no HTTP answer, nothing forwarded
        before = len(upstream.request_lines())
        assert statuses(exchange(spec.port, request("POST", "/v1/chat/completions", "h", key=ALICE, body=CHAT))) == []
        assert len(upstream.request_lines()) == before
    finally:
        edge.close()


def test_a_smoke_through_the_edge_waits_until_the_edges_checks_have_seen_vllm_serve(tmp_path):
    """CI of af08edc: vLLM had just become ready, the edge still answered from its last check of it (503), and the
    endpoint's smoke test, sent at once, failed the `up`. smoke.py through the edge (wait_served_seconds) first waits
    for the edge's /health; a vLLM that does not serve in that time still fails it, naming the endpoint's /health."""
    from components.scripts.node_chat import health

    with FakeVllm() as vllm:
        vllm.health = 503
        spec = edge_spec(vllm)
        edge = Edge(spec, tmp_path).start()
        try:
            base = f"http://127.0.0.1:{spec.port}"
            wait_until(lambda: health(base, 2) == 503, 15, "the edge has seen vLLM not serving")
            params = {"base_url": base, "model": "m", "api_key": None, "prompt": "hi", "max_tokens": 4,
                      "timeout_seconds": 10}  # fmt: skip
            never = run_script("smoke.py", {**params, "wait_served_seconds": 1.5})
            assert never.returncode == 1, never.stdout + never.stderr
            assert f"the endpoint's /health ({base}) still answered HTTP 503 after 1.5 s" in never.stdout
            assert "/v1/chat/completions" not in vllm.requests  # nothing sent while the edge says it is not serving
            threading.Timer(1.0, setattr, (vllm, "health", 200)).start()  # ready while the smoke test runs
            served = run_script("smoke.py", {**params, "wait_served_seconds": 20})
            assert served.returncode == 0, served.stdout + served.stderr
            assert json.loads(served.stdout.strip().splitlines()[-1])["completion_tokens"] == 1
        finally:
            edge.close()


def test_the_programs_own_chat_verifies_the_endpoint_for_its_name_while_it_reaches_an_address(upstream, tmp_path):
    """node_chat.chat as the router's smoke uses it: to 127.0.0.1 (the edge on the node itself), the certificate
    verified for the endpoint's host name with tls.ca; another CA or another name is refused, not ignored."""
    from components.scripts.node_chat import chat

    ca, other_ca = TestCa(), TestCa("another CA")
    issued = ca.issue("spark-01.lan")
    spec = edge_spec(upstream, clients=clients(**{"spark-vllm": PROGRAM}), upstream_key=PROGRAM,
                     tls_pem=issued.certificate + issued.key)  # fmt: skip
    edge = Edge(spec, tmp_path).start()
    try:
        base = f"https://127.0.0.1:{spec.port}"
        answer = chat(base, {"model": "m", "messages": []}, PROGRAM, 10, ("spark-01.lan", ca.pem))
        assert answer["upstream"].startswith("POST /v1/chat/completions")
        for name, trusted in (("spark-01.lan", other_ca), ("spark-02.lan", ca)):
            with pytest.raises(ssl.SSLCertVerificationError):
                chat(base, {"model": "m"}, PROGRAM, 10, (name, trusted.pem))
        with pytest.raises(urllib.error.HTTPError) as refused:  # a wrong key: the edge's 401, with its body
            chat(base, {"model": "m"}, "sk-wrong-key-0000000000000", 10, ("spark-01.lan", ca.pem))
        assert refused.value.code == 401 and b"Unauthorized" in refused.value.read()
    finally:
        edge.close()


def test_over_tls_the_attack_table_is_refused_as_over_plain_http(upstream, tmp_path):
    ca = TestCa()
    issued = ca.issue("127.0.0.1")
    spec = edge_spec(
        upstream, clients=clients(alice=ALICE), upstream_key=PROGRAM, tls_pem=issued.certificate + issued.key
    )
    edge = Edge(spec, tmp_path).start()
    try:
        context = ssl.create_default_context(cadata=ca.pem)
        assert refusals("127.0.0.1", spec.port, ALICE, paths=("/workers", "/invocations"), tls=context) == []
        upstream_saw_only_routes(upstream)
    finally:
        edge.close()
