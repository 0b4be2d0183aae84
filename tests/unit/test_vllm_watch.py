"""Serving that stops while /health is green (components/scripts/node_watch.py, node_vllm_watch.py): the rules on
their own, then the supervisor run for real against a fake vLLM API whose counters, answers and /health the test
sets (a stall, a slow prefill, wrong tokens, a headless rank's head gone, new watch settings without a restart)."""

from __future__ import annotations

import json
import os
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from components.scripts.node_contract import Fault, Recovery, VllmSpec
from components.scripts.node_vllm_watch import DRAIN_GRACE_SECONDS, FAULT_STATES, WATCH_SECONDS, VllmWatch
from components.scripts.node_watch import StallWatch, canary_answer, canary_difference, read_load, read_metrics
from tests.unit.test_supervisor import NodeSim, alive
from tests.waiting import wait_for

METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
vllm:num_requests_waiting{engine="0",model_name="m"} 0.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.125
vllm:generation_tokens_total{engine="0",model_name="m"} 4096.0
vllm:prompt_tokens_total{engine="0",model_name="m"} 1.5e+06
vllm:request_success_total{engine="0",finished_reason="stop",model_name="m"} 7.0
"""


def progress(running=1.0, kv=0.1, generated=10.0, prompt=100.0, waiting=0.0):
    return {
        "vllm:num_requests_running": running,
        "vllm:num_requests_waiting": waiting,
        "vllm:kv_cache_usage_perc": kv,
        "vllm:generation_tokens_total": generated,
        "vllm:prompt_tokens_total": prompt,
    }


def test_the_counters_are_summed_over_every_engine_and_the_rest_left_out():
    found = read_metrics(METRICS)
    assert found == {
        "vllm:num_requests_running": 3.0,
        "vllm:num_requests_waiting": 0.0,
        "vllm:kv_cache_usage_perc": 0.125,
        "vllm:generation_tokens_total": 4096.0,
        "vllm:prompt_tokens_total": 1.5e6,
    }
    assert read_metrics("garbage line\nvllm:num_requests_running{} not-a-number\n") == {}


@pytest.mark.parametrize(
    "readings, stalled",
    [
        ([progress()] * 4, True),  # requests running, nothing moves: stalled
        ([progress(running=0)] * 4, False),  # idle: nothing to move
        ([progress(running=0, waiting=2)] * 4, True),  # requests waiting on an engine that does not step
        ([progress(generated=10 + i) for i in range(4)], False),  # decoding
        ([progress(kv=0.1 + i / 100) for i in range(4)], False),  # a long prefill, chunk by chunk
        ([progress(prompt=100 + i) for i in range(4)], False),  # prompts done
        ([progress(running=1 + i % 2) for i in range(4)], False),  # requests finishing and arriving
        ([progress(), progress(), progress(), progress(generated=11)], False),  # moved at the last moment
    ],
)
def test_a_stall_is_requests_waiting_on_counters_that_do_not_move_for_stall_seconds(readings, stalled):
    watch = StallWatch(30)
    verdicts = [watch.see(now, reading) for now, reading in zip((0, 10, 20, 30), readings, strict=True)]
    assert all(verdict is None for verdict in verdicts[:-1])
    assert (verdicts[-1] is not None) is stalled
    if stalled:
        assert "none of vLLM's progress counters moved for 30 s (vllm.stallSeconds 30)" in verdicts[-1]


def test_requests_the_api_server_holds_count_where_the_stuck_engine_never_saw_them():
    """An engine stuck while idle: its gauges say nothing runs; /load says the API server holds requests."""
    idle = progress(running=0)
    watch = StallWatch(30)
    assert [watch.see(now, idle, load=3) for now in (0, 10, 20)] == [None, None, None]
    assert "3 request(s) running or waiting" in watch.see(30, idle, load=3) and "server_load 3" in watch.see(
        31, idle, 3
    )
    assert StallWatch(30).see(0, idle, 0) is None and read_load('{"server_load": 2}') == 2
    assert [read_load(text) for text in ('{"server_load": true}', "[]", "nonsense", '{"x": 1}')] == [0, 0, 0, 0]


def test_a_stall_is_counted_from_the_last_move_not_the_first_reading():
    watch = StallWatch(30)
    assert watch.see(0, progress(generated=1)) is None
    assert watch.see(25, progress(generated=2)) is None
    assert watch.see(50, progress(generated=2)) is None  # 25 s since it moved
    assert watch.see(55, progress(generated=2)) is not None


def test_an_idle_pause_does_not_count_toward_a_stall():
    """The clean-clone CI of 3108aef: small's two replicas idle for 81 s, then the load's first requests, held by
    the API server (/load 2) before the engine stepped, read as a stall counted from the idle minute; the router's
    keeper took both out and small answered 404 until they came back. The clock starts with requests on it."""
    idle = progress(running=0)
    watch = StallWatch(30)
    assert [watch.see(now, idle) for now in range(0, 90, 10)] == [None] * 9  # idle: nothing to count
    assert watch.see(90, idle, load=2) is None  # requests arrived; the engine has not stepped yet
    assert watch.see(119, idle, load=2) is None  # 29 s with requests on it
    assert "moved for 30 s" in watch.see(120, idle, load=2)  # 30 s: stalled
    watch.see(125, idle, load=0)  # they were answered: idle again, the clock stops
    assert watch.see(126, idle, load=1) is None and watch.see(150, idle, load=1) is None
    assert watch.see(156, idle, load=1) is not None
    stuck = progress(running=2)  # the engine's own gauges say requests run, from the first reading on
    watch = StallWatch(30)
    assert [watch.see(now, stuck) for now in (0, 10, 29)] == [None] * 3 and watch.see(30, stuck) is not None


def answer(ids, margins=None):
    return {"tokenIds": ids, "margins": margins, "text": ""}


@pytest.mark.parametrize(
    "reference, found, at",
    [
        (answer([1, 2, 3], [5, 5, 5]), answer([1, 2, 3]), None),
        (answer([1, 2, 3], [5, 5, 5]), answer([9, 2, 3]), 0),
        (answer([1, 2, 3], [5, 5, 5]), answer([1, 2, 9]), 2),
        (answer([1, 2, 3], [5, 5, 5]), answer([1, 2]), 2),  # shorter: the missing token differs
        (answer([1, 2, 3], [5, 0.2, 5]), answer([1, 9, 9]), None),  # a near tie at 1: nothing after it counts
        (answer([1, 2, 3], [0.2, 5, 5]), answer([9, 2, 3]), None),  # a near tie at once: nothing compared
        (answer([1, 2, 3], [5, None, 5]), answer([1, 9, 3]), None),  # no margin there: as a near tie
        (answer([1, 2, 3]), answer([9, 2, 3]), 0),  # no logprobs: the first token only
        (answer([1, 2, 3]), answer([1, 9, 9]), None),
    ],
)
def test_the_canary_compares_tokens_up_to_the_first_near_tie(reference, found, at):
    difference = canary_difference(reference, found)
    assert (difference or {}).get("at") == at


def test_a_canary_answer_reads_the_ids_and_each_positions_margin():
    body = {
        "choices": [
            {
                "message": {"content": "one, two"},
                "token_ids": [5, 7],
                "logprobs": {
                    "content": [
                        {"token": "one", "top_logprobs": [{"logprob": -3.0}, {"logprob": -0.5}]},
                        {"token": ",", "top_logprobs": [{"logprob": -0.1}]},
                    ]
                },
            }
        ]
    }
    assert canary_answer(body) == {"tokenIds": [5, 7], "margins": [2.5, None], "text": "one, two"}
    assert canary_answer({"choices": [{"message": {"content": "x"}}]}) == {
        "tokenIds": None,
        "margins": None,
        "text": "x",
    }


class FakeApi(BaseHTTPRequestHandler):
    """vLLM's /health, /metrics and the canary's /v1/chat/completions, as the test sets them on the server."""

    def do_GET(self):  # noqa: N802
        state = self.server.state
        if self.path == "/health":
            self._send(state["health"], b"")
        elif self.path == "/metrics":
            if state.get("moving"):
                state["generated"] += 1
            lines = [
                f'vllm:num_requests_running{{engine="0"}} {state["running"]}',
                'vllm:num_requests_waiting{engine="0"} 0',
                'vllm:kv_cache_usage_perc{engine="0"} 0.25',
                f'vllm:generation_tokens_total{{engine="0"}} {state["generated"]}',
                'vllm:prompt_tokens_total{engine="0"} 100',
            ]
            self._send(200, ("\n".join(lines) + "\n").encode())
        else:
            self._send(404, b"")

    def do_POST(self):  # noqa: N802
        state = self.server.state
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        state["asked"].append({"body": body, "authorization": self.headers.get("Authorization")})
        top = [{"token": "t", "logprob": -0.1, "top_logprobs": [{"logprob": -0.1}, {"logprob": -4.0}]}]
        answer = {"choices": [{"message": {"content": "one, two"}, "token_ids": list(state["tokens"]),
                               "logprobs": {"content": top * len(state["tokens"])}}]}  # fmt: skip
        self._send(200, json.dumps(answer).encode())

    def _send(self, code, body):
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def api():
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeApi)
    server.state = {"health": 200, "running": 0, "generated": 0, "moving": False, "tokens": [3, 1, 4], "asked": []}
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()


@pytest.fixture
def node(tmp_path):
    sim = NodeSim(tmp_path)
    yield sim
    sim.close()


def serve_watched(node, api, stall=3, canary=0, head=False):
    url = f"http://127.0.0.1:{api.server_address[1]}/health"
    watch = {"stall_seconds": stall, "canary_seconds": canary}
    if head:
        watch["head_health_url"] = url
    argv = ["vllm", "serve", "m", "--served-model-name=my-model"]
    done = node.serve(argv=argv, health_url=None if head else url, watch=watch)
    assert done.returncode == 0, done.stdout + done.stderr
    return node.status()["vllm_pid"]


def test_a_stalled_vllm_is_ended_and_started_again_as_a_crash_saying_why(node, api):
    node.start()
    first = serve_watched(node, api, stall=3)
    assert wait_for(lambda: node.status().get("serving") is True)
    api.state.update(running=2)  # requests running, nothing moving, /health 200
    assert wait_for(lambda: (node.status().get("faults") or {}).get("stalled") == 1, 20), node.status()
    assert wait_for(lambda: node.status().get("vllm_pid") not in (None, first), 20)
    assert not alive(first)
    status = node.status()
    fault = status["last_fault"]
    assert fault["kind"] == "stalled" and "vllm.stallSeconds 3" in fault["detail"]
    assert fault["metrics"]["vllm:num_requests_running"] == 2
    assert status["restarts_total"] == 1 and status["restarts_in_window"] == 1  # counts towards the crash loop
    assert status["last_exit"]["error"].startswith("stalled: 2 request(s) running")
    assert "vllm" in (node.run_dir / "fault.txt").read_text()  # what its processes were doing
    assert "vLLM stalled: 2 request(s) running" in node.log()


def test_a_vllm_that_served_and_stopped_answering_health_is_ended_after_stall_seconds(node, api):
    """Its API server stuck (or stopped): /health gives no 200 while the processes live on."""
    node.start()
    first = serve_watched(node, api, stall=3)
    assert wait_for(lambda: node.status().get("serving") is True)
    api.state["health"] = 503
    assert wait_for(lambda: (node.status().get("faults") or {}).get("stalled") == 1, 30), node.status()
    assert "has not answered /health with 200 for" in node.status()["last_fault"]["detail"]
    api.state["health"] = 200
    assert wait_for(lambda: node.status().get("vllm_pid") not in (None, first), 20)


def test_the_canary_keeps_its_first_answer_and_ends_a_vllm_that_answers_other_tokens_twice(node, api):
    node.start()
    first = serve_watched(node, api, stall=30, canary=1)
    canary = node.run_dir / "canary.json"
    assert wait_for(lambda: canary.exists(), 20)
    kept = json.loads(canary.read_text())
    assert kept["answer"]["tokenIds"] == [3, 1, 4] and kept["answer"]["margins"] == [3.9, 3.9, 3.9]
    asked = api.state["asked"][0]
    assert asked["body"]["model"] == "my-model" and asked["body"]["temperature"] == 0
    assert asked["authorization"] == "Bearer secret-key"
    assert wait_for(lambda: len(api.state["asked"]) >= 3, 20)  # asked again, still the same: left alone
    assert node.status()["vllm_pid"] == first
    api.state["tokens"] = [3, 9, 4]
    assert wait_for(lambda: (node.status().get("faults") or {}).get("wrong") == 1, 20), node.status()
    fault = node.status()["last_fault"]
    assert fault["canary"]["at"] == 1 and fault["canary"]["expected"] == 1 and fault["canary"]["found"] == 9
    assert "twice in a row" in fault["detail"]
    assert wait_for(lambda: node.status().get("vllm_pid") not in (None, first), 20)
    assert "asking it again" in node.log()


def test_new_watch_settings_reach_the_supervisor_without_restarting_vllm(node, api):
    node.start()
    url = f"http://127.0.0.1:{api.server_address[1]}/health"
    first = node.serve(health_url=url, watch={"stall_seconds": 300, "canary_seconds": 0})
    pid = node.status()["vllm_pid"]
    assert first.returncode == 0 and pid
    again = node.serve(health_url=url, watch={"stall_seconds": 3, "canary_seconds": 0})
    assert f"vLLM already running with these settings (pid {pid})" in again.stdout
    assert json.loads((node.run_dir / "watch.json").read_text())["stall_seconds"] == 3
    assert "watch" not in json.loads((node.run_dir / "spec.json").read_text())  # a supervisor before it reads it
    api.state.update(running=1)
    assert wait_for(lambda: (node.status().get("faults") or {}).get("stalled") == 1, 20)  # the new setting holds


# -- the watch alone, on the test's clock: what must not happen for a while is looked at over that while in no time --


class Started:
    """A VllmProcess as the watch sees it: running, ended by the watch (`ended`: why, each time) or not."""

    running, ended_why = True, None

    def __init__(self):
        self.ended = []

    def alive(self):
        return []

    def end(self, why):
        self.ended.append(why)
        self.ended_why = why


def watched(tmp_path, api, stall=3, canary=0, head=False):
    """A VllmWatch of `api` with its watch.json, the spec it reads, and a look at a time: look(now) -> fault or None."""
    url = f"http://127.0.0.1:{api.server_address[1]}/health"
    settings = {"stall_seconds": stall, "canary_seconds": canary, **({"head_health_url": url} if head else {})}
    (tmp_path / "watch.json").write_text(json.dumps(settings))
    watch, vllm = VllmWatch(str(tmp_path)), Started()
    recovery = Recovery(max_restarts=3, window_seconds=60, backoff_seconds=1, max_backoff_seconds=4, gpu_wait_seconds=5)
    spec = VllmSpec(recovery=recovery, gpu_memory_utilization=None, health_url=None if head else url, ray_ready=None,
                    argv=["vllm", "serve", "m", "--served-model-name=my-model"], env={}, fingerprint="f")  # fmt: skip

    def look(now, serving=True, shared=False):
        return watch.check(now, spec, vllm, serving, True, "f", shared)

    return watch, vllm, look


def looks(look, seconds, every=WATCH_SECONDS):
    """The watch's looks over `seconds` of its clock, one every WATCH_SECONDS: the faults they found."""
    return [found for now in range(0, seconds + 1, every) if (found := look(float(now))) is not None]


def test_a_vllm_whose_counters_move_is_left_alone(tmp_path, api):
    watch, vllm, look = watched(tmp_path, api, stall=3)
    api.state.update(running=4, moving=True)  # slow, but every reading moved
    assert looks(look, 30) == [] and vllm.ended_why is None and not watch.faults
    api.state.update(moving=False)  # the same vLLM stuck: found, so the looks above could fail
    assert looks(lambda now: look(now + 32), 10) == [Fault.STALLED]


def test_the_canary_waits_while_requests_run(tmp_path, api):
    _, _, look = watched(tmp_path, api, stall=30, canary=1)
    api.state.update(running=1, moving=True)
    assert looks(look, 20) == [] and not api.state["asked"]
    api.state.update(running=0)  # idle: asked at the next look
    look(22.0)
    assert wait_for(lambda: api.state["asked"], 5)


def test_a_headless_rank_whose_head_went_away_is_ended_once_it_had_seen_it(tmp_path, api):
    watch, vllm, look = watched(tmp_path, api, head=True)
    api.state["health"] = 503  # the head not up yet: a rank waits for it
    assert looks(look, 30) == [] and vllm.ended_why is None
    api.state["health"] = 200
    assert looks(lambda now: look(now + 40), 4) == []  # a rank beside its head
    api.state["health"] = 503
    found = looks(lambda now: look(now + 50), 30)
    assert found == [Fault.HEAD_GONE] and "a rank whose head went away is ended" in watch.last_fault.detail
    look(100.0)  # the next look ends it
    assert vllm.ended_why.startswith(f"{FAULT_STATES[Fault.HEAD_GONE]}: its API server")


def test_no_canary_while_the_benchmark_measures_and_a_dead_ones_file_is_removed(tmp_path, api):
    """RUN_DIR/measuring names the benchmark's pid while it runs (node_benchmark.py): the canary waits (its tokens
    would count in the load's figures); a file whose process is gone holds nothing back and is removed."""
    _, _, look = watched(tmp_path, api, stall=30, canary=1)
    marker = tmp_path / "measuring"
    marker.write_text(str(os.getpid()))  # a live process: this test's
    assert looks(look, 12) == [] and not api.state["asked"]
    gone = subprocess.Popen(["true"])
    gone.wait()
    marker.write_text(str(gone.pid))
    look(14.0)
    assert wait_for(lambda: api.state["asked"], 5) and not marker.exists()


def test_a_vllm_that_stops_answering_health_is_found_stalled_and_ended_after_the_routers_grace(tmp_path, api):
    watch, vllm, look = watched(tmp_path, api, stall=30)
    api.state["health"] = 503
    assert look(0, False, True) is None and look(20, False, True) is None  # since 0 without /health 200
    assert look(30, False, True) == Fault.STALLED
    assert watch.faults == {Fault.STALLED: 1} and watch.last_fault.kind == Fault.STALLED
    assert "has not answered /health with 200 for 30 s" in watch.last_fault.detail
    assert (tmp_path / "fault.txt").exists() and watch.pending
    assert look(30 + DRAIN_GRACE_SECONDS - 1, False, True) is None and vllm.ended == []  # the router takes it out first
    look(30 + DRAIN_GRACE_SECONDS, False, True)
    assert len(vllm.ended) == 1 and vllm.ended[0].startswith("stalled: ") and watch.pending is None
    assert look(100, False, True) is None  # ended: nothing more until it starts again
    watch.reset()
    assert watch.faults == {Fault.STALLED: 1}  # counted across starts


def test_without_watch_settings_or_settings_nothing_is_watched(tmp_path, api):
    watch, vllm, look = watched(tmp_path, api)
    settings = (tmp_path / "watch.json").read_text()
    (tmp_path / "watch.json").unlink()
    api.state["health"] = 503
    assert all(look(t, serving=False) is None for t in (0, 100, 200))
    (tmp_path / "watch.json").write_text(settings)
    assert watch.check(300, None, vllm, False, True, "f1", False) is None and watch.faults == {}
