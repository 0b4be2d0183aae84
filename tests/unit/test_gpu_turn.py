"""Replicas that share a node's GPU start in turn, and a start refused for memory is told apart: another process's
doing (start again, not a crash) or a refusal of its settings (it repeats with the GPU otherwise quiet). The
supervisors run for real (tests/unit/test_supervisor.py's NodeSim: fake vllm and nvidia-smi on PATH), two of them
in one test being two containers of one node."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest

from components.plan.programs import script
from tests.unit.test_supervisor import NodeSim
from tests.waiting import wait_for

TENANCY = {"replica": "small", "turn_hold_seconds": 60}


@pytest.fixture
def sims(tmp_path):
    made = []

    def make(name, ready_file=None):
        sim = NodeSim(tmp_path, name, ready_file)
        made.append(sim)
        return sim

    yield make
    for sim in made:
        sim.close()


def test_two_replicas_handed_their_settings_at_once_start_one_after_the_other(sims, tmp_path):
    coder = sims("coder", ready_file=tmp_path / "coder-serves")
    small = sims("small", ready_file=tmp_path / "small-serves")
    coder.start()
    small.start()
    first = coder.serve(tenancy={**TENANCY, "replica": "coder"}, gpu_memory_utilization=0.5)
    assert first.returncode == 0 and "vLLM started" in first.stdout
    second = small.serve(tenancy=TENANCY, gpu_memory_utilization=0.2, timeout=10)
    # handed over all the same: it starts once the turn is free, which `pulumi up`'s readiness then waits for
    assert second.returncode == 0, second.stdout + second.stderr
    assert "the node's GPU turn" in second.stdout and "coder" in second.stdout
    status = small.status()
    assert status["state"] == "waiting for the GPU turn" and status["vllm_pid"] is None
    assert status["turn"].startswith("waiting: held by coder (node node-1)")
    assert coder.status()["turn"] == "held"
    (tmp_path / "coder-serves").touch()  # coder's vLLM serves: it gives the turn back, small starts
    assert wait_for(lambda: small.status().get("vllm_pid") is not None, 20)
    assert "gave the node's GPU turn back: vLLM serves" in coder.log()
    assert "took the node's GPU turn after waiting" in small.log()
    assert coder.status()["turn"] is None and small.status()["turn"] == "held"


def test_the_turn_is_free_the_moment_its_holder_dies(sims, tmp_path):
    coder = sims("coder", ready_file=tmp_path / "never")
    small = sims("small", ready_file=tmp_path / "never")
    holder = coder.start()
    small.start()
    coder.serve(tenancy={**TENANCY, "replica": "coder"}, gpu_memory_utilization=0.5)
    small.serve(tenancy=TENANCY, gpu_memory_utilization=0.2, timeout=5)
    assert small.status()["state"] == "waiting for the GPU turn"
    holder.send_signal(signal.SIGKILL)  # a container killed, a node's crash: no goodbye
    assert wait_for(lambda: small.status().get("vllm_pid") is not None, 15)


def test_a_rank_without_an_api_server_gives_the_turn_back_once_it_has_its_kv_cache(sims, tmp_path):
    rank = sims("rank")
    other = sims("other", ready_file=tmp_path / "never")
    rank.start(FAKE_VLLM_KV_LINE="1")
    other.start()
    rank.serve(health_url=None, tenancy={**TENANCY, "replica": "big"}, gpu_memory_utilization=0.5)
    assert wait_for(lambda: "gave the node's GPU turn back: this rank has its KV cache" in rank.log(), 15)
    other.serve(tenancy=TENANCY, gpu_memory_utilization=0.2, timeout=10)
    assert wait_for(lambda: other.status().get("vllm_pid") is not None, 10)


def test_a_memory_refusal_while_a_neighbour_changed_its_memory_is_started_again_not_counted(node_pair, sims):
    sim, tmp_path = node_pair
    coder = sims("coder")  # a neighbour that serves, with its share of the GPU
    coder.start()
    coder.serve(tenancy={**TENANCY, "replica": "coder"}, gpu_memory_utilization=0.2)
    assert wait_for(lambda: coder.status().get("state") == "running", 10)
    # the first start sees a neighbour take 42 GiB meanwhile; every start after it is refused with the GPU quiet
    sim.start(FAKE_VLLM_MEMORY_REFUSE="1", FAKE_VLLM_FREE_AT_EXIT="100000")
    sim.serve(tenancy=TENANCY, gpu_memory_utilization=0.5, timeout=5)
    assert wait_for(lambda: sim.status().get("state") == "failed", 30)
    log, status = sim.log(), sim.status()
    assert "went from 0.8 to 42.7 GiB: that is another process's doing, not a refusal of its settings" in log
    assert "once more before calling it a refusal of its settings" in log
    assert log.count("vLLM started (pid") == 3 and status["restarts_total"] == 0  # none counted as a crash
    failed = status["failed"]
    assert failed.startswith("vLLM refused to start twice in a row with the GPU otherwise quiet: ")
    assert "No available memory for the cache blocks" in failed
    assert (
        "other processes hold 42.7 GiB of the GPU's 140.4 GiB (the replicas beside it ask coder 0.2 (running)" in failed
    )
    assert "They hold more than the replicas beside it ask for" in failed
    assert "raise vllm.gpuMemoryUtilization" not in failed  # that would take from the neighbours


def test_a_memory_refusal_alone_on_the_gpu_is_a_refusal_of_its_settings_the_second_time(node_pair):
    sim, _ = node_pair
    sim.start(FAKE_VLLM_MEMORY_REFUSE="1")
    sim.serve(gpu_memory_utilization=0.5, timeout=5)
    assert wait_for(lambda: sim.status().get("state") == "failed", 30)
    failed = sim.status()["failed"]
    assert "alone on the GPU, its weights and activations take all of gpuMemoryUtilization 0.5" in failed
    assert "raise vllm.gpuMemoryUtilization" in failed
    assert sim.log().count("vLLM started (pid") == 2


def test_new_settings_start_the_count_of_quiet_refusals_again(node_pair):
    sim, _ = node_pair
    sim.start(FAKE_VLLM_MEMORY_REFUSE="1")
    sim.serve(gpu_memory_utilization=0.5, timeout=5)
    assert wait_for(lambda: sim.status().get("state") == "failed", 30)
    sim.serve(gpu_memory_utilization=0.6, fingerprint="f2", timeout=5)
    # two starts again under the new settings before they too are called a refusal
    assert wait_for(lambda: sim.log().count("vLLM started (pid") == 4 and sim.status().get("state") == "failed", 30)
    assert "gpuMemoryUtilization 0.6" in sim.status()["failed"]


@pytest.fixture
def node_pair(tmp_path):
    sim = NodeSim(tmp_path, "small", ready_file=tmp_path / "never")  # it never serves: each start is refused
    yield sim, tmp_path
    sim.close()


def test_the_turn_answers_who_holds_it_and_names_can_be_kept_apart():
    program = script("supervisor.py").split("P = SupervisorParams")[0]  # the helpers, without the main program
    space: dict = {}
    exec(compile(program, "supervisor-helpers", "exec"), space)  # noqa: S102 - our own script's helpers
    holder, waiter = space["GpuTurn"](), space["GpuTurn"]()
    assert waiter.holder() is None  # nobody holds it
    assert holder.take({"node": "spark-03", "replica": "coder", "why": "starting vLLM"})
    assert not waiter.take({"node": "spark-03", "replica": "small"})
    answer = {}

    def ask():
        answer.update(waiter.holder() or {})

    asking = threading.Thread(target=ask)
    asking.start()
    assert wait_for(lambda: (holder.answer(), not asking.is_alive())[1], 5)
    assert answer["replica"] == "coder" and answer["why"] == "starting vLLM"
    assert space["describe_holder"](answer).startswith("coder (node spark-03) since ")
    holder.give_back()
    assert waiter.take({"node": "spark-03", "replica": "small"})
    waiter.give_back()
    os.environ["SPARK_VLLM_GPU_TURN"] += "-other"  # another node: another name, another turn
    try:
        other = space["GpuTurn"]()
        assert holder.take({}) and other.take({})
    finally:
        holder.give_back()
        other.give_back()


def test_a_memory_refusal_while_a_neighbour_is_starting_is_never_called_a_refusal_of_its_settings(sims, tmp_path):
    """No nvidia-smi figure moved (the fake GPU stays put), but the neighbour says it is starting: this one waits
    and starts again, as often as that takes, and none of it counts as a crash."""
    coder = sims("coder", ready_file=tmp_path / "never")
    small = sims("small", ready_file=tmp_path / "never")
    coder.start()
    # its start outlasts its hold of the turn (1 s): it stays "starting", the turn is free for small
    coder.serve(tenancy={"replica": "coder", "turn_hold_seconds": 1}, gpu_memory_utilization=0.2)
    small.start(FAKE_VLLM_MEMORY_REFUSE="1")
    small.serve(tenancy=TENANCY, gpu_memory_utilization=0.5, timeout=10)
    assert wait_for(lambda: small.log().count("vLLM started (pid") >= 3, 30)
    assert "coder was starting meanwhile: that is another process's doing" in small.log()
    status = small.status()
    assert status["failed"] is None and status["restarts_total"] == 0


# --- the turn's and the neighbours' names are abstract: anyone may bind them ----------------------------

NOBODY = 65534


def helpers_space() -> dict:
    program = script("supervisor.py").split("P = SupervisorParams")[0]
    space: dict = {}
    exec(compile(program, "supervisor-helpers", "exec"), space)  # noqa: S102 - our own script's helpers
    return space


def squat(name: str, answer: bytes, uid: int | None) -> subprocess.Popen:
    """A process that binds the abstract `name` first (as `uid`) and answers each connection with `answer`."""
    program = (
        "import socket, sys\n"
        "s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM); s.bind('\\0' + sys.argv[1]); s.listen(8)\n"
        "print('bound', flush=True)\n"
        "while True:\n"
        "    c, _ = s.accept(); c.sendall(bytes.fromhex(sys.argv[2])); c.close()\n"
    )
    drop = (lambda: os.setuid(uid)) if uid is not None else None  # noqa: E731
    assert name.startswith("\0")
    python = "/usr/bin/python3" if uid is not None else sys.executable  # one another user may run
    process = subprocess.Popen([python, "-c", program, name[1:], answer.hex()], preexec_fn=drop,
                               stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert process.stdout.readline().strip() == "bound"
    return process


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/usr/bin/python3"),
                    reason="another user's squatter needs root to become it, and a python3 that user may run")  # fmt: skip
def test_a_squatter_of_another_user_is_named_for_what_it_is_not_believed(monkeypatch):
    monkeypatch.setenv("SPARK_VLLM_GPU_TURN", f"spark-vllm-gpu-turn-test-{os.getpid()}-squat")
    space = helpers_space()
    turn = space["GpuTurn"]()
    squatter = squat(turn.listener.name, b'{"replica": "coder", "why": "starting vLLM"}\n', NOBODY)
    try:
        assert not turn.take({"replica": "small"})  # it holds the name: nobody of the stack can take it
        holder = turn.holder()
        assert holder == {"impostor": {"pid": squatter.pid, "uid": NOBODY}}  # the kernel's word, not its own
        said = space["describe_holder"](holder)
        assert f"process {squatter.pid} (uid {NOBODY}), not a supervisor of this stack" in said
    finally:
        squatter.kill()
        squatter.wait()
    assert wait_for(lambda: turn.take({"replica": "small"}), 5)  # gone: the name is free again
    turn.give_back()


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/usr/bin/python3"),
                    reason="another user's liar needs root to become it, and a python3 that user may run")  # fmt: skip
def test_a_neighbour_of_another_user_saying_it_is_starting_is_not_a_neighbour(monkeypatch):
    monkeypatch.setenv("SPARK_VLLM_GPU_TURN", f"spark-vllm-gpu-turn-test-{os.getpid()}-liar")
    space = helpers_space()
    tenant = space["Tenant"]()
    tenant.tell({"replica": "small", "state": "running"})
    liar = squat(tenant.prefix + "big.0000", b'{"replica": "big", "state": "starting"}\n', NOBODY)
    honest = squat(tenant.prefix + "side.0001", b'{"replica": "side", "state": "starting"}\n', None)
    try:
        assert [n["replica"] for n in tenant.neighbours()] == ["side"]  # root's, as the stack's supervisors are
    finally:
        for process in (liar, honest):
            process.kill()
            process.wait()
        tenant.close()


@pytest.mark.parametrize("answer", [b"[1]\n", b"1\n", b'"x"\n', b"null\n", b"{\n", b"\xff\xfe\n", b"x" * 40000])
def test_whatever_a_holder_answers_the_supervisor_says_a_line_and_goes_on(monkeypatch, answer):
    monkeypatch.setenv("SPARK_VLLM_GPU_TURN", f"spark-vllm-gpu-turn-test-{os.getpid()}-crash")
    space = helpers_space()
    turn = space["GpuTurn"]()
    crasher = squat(turn.listener.name, answer, None)
    try:
        holder = turn.holder()
        assert holder == {} and space["describe_holder"](holder) == "another supervisor on this node"
        assert space["describe_holder"]({"replica": ["x"], "node": {"a": 1}, "why": 3}).startswith("['x'] (node ")
    finally:
        crasher.kill()
        crasher.wait()
