"""Replicas that share a node's GPU start in turn, and a start refused for memory is told apart: another process's
doing (start again, not a crash) or a refusal of its settings (it repeats with the GPU otherwise quiet). The
supervisors run for real (tests/unit/test_supervisor.py's NodeSim: fake vllm and nvidia-smi on PATH), two of them
in one test being two containers of one node."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from components.scripts import node_gpu_turn
from components.scripts.node_contract import VllmState
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
    assert VllmState(status["state"]) is VllmState.WAITING_TURN and status["vllm_pid"] is None
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
    assert small.state() is VllmState.WAITING_TURN
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
    assert wait_for(lambda: coder.state() is VllmState.RUNNING, 10)
    # the first start sees a neighbour take 42 GiB meanwhile; every start after it is refused with the GPU quiet
    sim.start(FAKE_VLLM_MEMORY_REFUSE="1", FAKE_VLLM_FREE_AT_EXIT="100000")
    sim.serve(tenancy=TENANCY, gpu_memory_utilization=0.5, timeout=5)
    assert wait_for(lambda: sim.state() is VllmState.FAILED, 30)
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
    assert wait_for(lambda: sim.state() is VllmState.FAILED, 30)
    failed = sim.status()["failed"]
    assert "alone on the GPU, its weights and activations take all of gpuMemoryUtilization 0.5" in failed
    assert "raise vllm.gpuMemoryUtilization" in failed
    assert sim.log().count("vLLM started (pid") == 2


def test_new_settings_start_the_count_of_quiet_refusals_again(node_pair):
    sim, _ = node_pair
    sim.start(FAKE_VLLM_MEMORY_REFUSE="1")
    sim.serve(gpu_memory_utilization=0.5, timeout=5)
    assert wait_for(lambda: sim.state() is VllmState.FAILED, 30)
    sim.serve(gpu_memory_utilization=0.6, fingerprint="f2", timeout=5)
    # two starts again under the new settings before they too are called a refusal
    assert wait_for(lambda: sim.log().count("vLLM started (pid") == 4 and sim.state() is VllmState.FAILED, 30)
    assert "gpuMemoryUtilization 0.6" in sim.status()["failed"]


@pytest.fixture
def node_pair(tmp_path):
    sim = NodeSim(tmp_path, "small", ready_file=tmp_path / "never")  # it never serves: each start is refused
    yield sim, tmp_path
    sim.close()


def test_the_turn_answers_who_holds_it_and_directories_can_be_kept_apart(tmp_path):
    directory = os.environ["SPARK_VLLM_GPU_TURN"]
    holder, waiter = node_gpu_turn.GpuTurn(directory), node_gpu_turn.GpuTurn(directory)
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
    assert node_gpu_turn.describe_holder(answer).startswith("coder (node spark-03) since ")
    holder.give_back()
    assert not os.path.exists(holder.listener.name)  # its socket goes with it
    assert waiter.take({"node": "spark-03", "replica": "small"})
    waiter.give_back()
    other_node = tempfile.mkdtemp(prefix="svturn-", dir="/tmp")  # another node: another volume, another turn
    try:
        other = node_gpu_turn.GpuTurn(other_node)
        assert holder.take({}) and other.take({})
    finally:
        holder.give_back()
        other.give_back()
        shutil.rmtree(other_node)


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


# --- the turn and the neighbours live where only the stack's supervisors reach -------------------------

NOBODY = 65534
OTHER_USER = pytest.mark.skipif(
    os.geteuid() != 0 or not os.path.exists("/usr/bin/python3"),
    reason="another user's process needs root to become it, and a python3 that user may run",
)


def squat(name: str, answer: bytes, uid: int | None) -> subprocess.Popen:
    """A process that binds the Unix socket `name` (a path, or an abstract name with its NUL) as `uid` and answers
    each connection with `answer`; it prints what binding it did."""
    program = (
        "import socket, sys\n"
        "s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
        "try:\n"
        "    s.bind(sys.argv[1].replace('@', '\\0', 1) if sys.argv[1].startswith('@') else sys.argv[1])\n"
        "except OSError as e:\n"
        "    print('refused', e.errno, flush=True); sys.exit(0)\n"
        "s.listen(8); print('bound', flush=True)\n"
        "while True:\n"
        "    c, _ = s.accept(); c.sendall(bytes.fromhex(sys.argv[2])); c.close()\n"
    )
    drop = (lambda: os.setuid(uid)) if uid is not None else None  # noqa: E731
    shown = "@" + name[1:] if name.startswith("\0") else name
    python = "/usr/bin/python3" if uid is not None else sys.executable  # one another user may run
    process = subprocess.Popen([python, "-c", program, shown, answer.hex()], preexec_fn=drop,
                               stdout=subprocess.PIPE, text=True)  # fmt: skip
    process.said = process.stdout.readline().strip()
    return process


@pytest.fixture
def volume():
    """A directory as Docker makes a volume's: root's, 0755, in a parent any user may enter (tmp_path's is not: the
    permission tested must be the directory's own)."""
    parent = tempfile.mkdtemp(prefix="svvol-", dir="/tmp")
    os.chmod(parent, 0o755)
    path = Path(parent) / "_data"
    path.mkdir(mode=0o755)
    yield path
    shutil.rmtree(parent, ignore_errors=True)


def ended(process: subprocess.Popen) -> None:
    process.kill()
    process.wait()


@OTHER_USER
def test_another_user_can_neither_take_the_turn_nor_pose_as_a_neighbour(volume):
    """What #58 found: the turn was an abstract socket, which any process of the host's network namespace could bind
    first, so no vLLM of the node would ever start again. Now it is a lock in the stack's volume (root's, 0755)."""
    looked = subprocess.run(["/usr/bin/python3", "-c", "import os, sys; os.listdir(sys.argv[1])", str(volume)],
                            preexec_fn=lambda: os.setuid(NOBODY))  # fmt: skip
    assert looked.returncode == 0  # another user reaches the directory: the refusals below are its mode's doing
    turn, tenant = node_gpu_turn.GpuTurn(str(volume)), node_gpu_turn.Tenant(str(volume))
    for name in ("turn.sock", "tenant.big.0000.sock"):
        squatter = squat(str(volume / name), b'{"replica": "big", "state": "starting"}\n', NOBODY)
        assert squatter.said == f"refused {errno.EACCES}", squatter.said
        ended(squatter)
    old_name = squat("\0spark-vllm-gpu-turn", b'{"replica": "coder"}\n', NOBODY)  # the name it had before
    try:
        assert turn.take({"replica": "small"})  # the abstract name is nobody's business any more
        tenant.tell({"replica": "small", "state": "running"})
        assert tenant.neighbours() == []
    finally:
        ended(old_name)
        turn.give_back()
        tenant.close()
    dropped = subprocess.run(["/usr/bin/python3", "-c", f"open({str(volume / 'turn.lock')!r}, 'a')"],
                             preexec_fn=lambda: os.setuid(NOBODY), capture_output=True, text=True)  # fmt: skip
    assert "PermissionError" in dropped.stderr  # the lock file is root's, 0600: another user cannot even open it


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o757, 0o1777])
def test_a_turn_directory_others_may_write_in_is_refused_and_no_vllm_starts(tmp_path, mode):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(mode)
    with pytest.raises(node_gpu_turn.TurnDirectoryError, match=r"is not a directory that only uid \d+ may write in"):
        node_gpu_turn.GpuTurn(str(shared))
    sim = NodeSim(tmp_path, "small")
    try:
        sim.start(SPARK_VLLM_GPU_TURN=str(shared))
        sim.serve(tenancy=TENANCY, gpu_memory_utilization=0.2, timeout=5)
        assert wait_for(lambda: sim.state() is VllmState.FAILED, 20)
        assert "another user could take the node's GPU turn" in sim.status()["failed"]
        assert sim.status()["vllm_pid"] is None
    finally:
        sim.close()


def test_a_link_where_the_turn_directory_should_be_is_refused(tmp_path):
    target = tmp_path / "elsewhere"
    target.mkdir(mode=0o700)
    (tmp_path / "turn").symlink_to(target)
    with pytest.raises(node_gpu_turn.TurnDirectoryError, match="mode lrwxrwxrwx"):
        node_gpu_turn.GpuTurn(str(tmp_path / "turn"))


@OTHER_USER
def test_a_neighbour_of_another_user_saying_it_is_starting_is_not_a_neighbour(volume):
    """Defence in depth: were another user's socket in the directory (placed while it was open to all, say), what
    it says is not believed: the kernel says whose it is."""
    volume.chmod(0o777)
    liar = squat(str(volume / "tenant.big.0000.sock"), b'{"replica": "big", "state": "starting"}\n', NOBODY)
    volume.chmod(0o755)
    honest = squat(str(volume / "tenant.side.0001.sock"), b'{"replica": "side", "state": "starting"}\n', None)
    tenant = node_gpu_turn.Tenant(str(volume))
    try:
        assert liar.said == honest.said == "bound"
        tenant.tell({"replica": "small", "state": "running"})
        assert [n["replica"] for n in tenant.neighbours()] == ["side"]  # root's, as the stack's supervisors are
    finally:
        for process in (liar, honest):
            ended(process)
        tenant.close()


def test_a_neighbour_that_died_without_a_word_is_tidied_once_its_socket_is_old(tmp_path):
    directory = os.environ["SPARK_VLLM_GPU_TURN"]
    dead = squat(os.path.join(directory, "tenant.big.0000.sock"), b"{}\n", None)
    ended(dead)  # a SIGKILL: its socket stays behind, nobody listening
    young = squat(os.path.join(directory, "tenant.new.0001.sock"), b"{}\n", None)
    ended(young)
    tenant = node_gpu_turn.Tenant(directory)
    hour_ago = time.time() - 3600
    os.utime(os.path.join(directory, "tenant.big.0000.sock"), (hour_ago, hour_ago), follow_symlinks=False)
    assert tenant.neighbours() == []
    assert sorted(os.listdir(directory)) == ["tenant.new.0001.sock"]  # a young one may be a socket being opened


@pytest.mark.parametrize("answer", [b"[1]\n", b"1\n", b'"x"\n', b"null\n", b"{\n", b"\xff\xfe\n", b"x" * 40000])
def test_whatever_a_holder_answers_the_supervisor_says_a_line_and_goes_on(answer):
    turn = node_gpu_turn.GpuTurn(os.environ["SPARK_VLLM_GPU_TURN"])
    crasher = squat(turn.listener.name, answer, None)
    try:
        holder = turn.holder()
        assert holder == {} and node_gpu_turn.describe_holder(holder) == "another supervisor on this node"
        assert node_gpu_turn.describe_holder({"replica": ["x"], "node": {"a": 1}, "why": 3}).startswith("['x'] (node ")
        assert (
            node_gpu_turn.hold_limit({"hold_seconds": True}) is None
            and node_gpu_turn.hold_limit({"hold_seconds": 1e9}) is None
        )
    finally:
        ended(crasher)


HOLD_FOR_EVER = """
import fcntl, os, sys, time
lock = os.open(os.path.join(sys.argv[1], "turn.lock"), os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(lock, fcntl.LOCK_EX)
print("holding", flush=True)
time.sleep(3600)
"""


def test_a_holder_that_keeps_the_turn_past_its_limit_is_waited_for_no_longer(sims, tmp_path):
    """A supervisor stopped (SIGSTOP) or hung while holding the turn never gives it back: the others wait its limit
    and as long again (at most a minute), then start without it, and status.json says so."""
    directory = os.environ["SPARK_VLLM_GPU_TURN"]
    stuck = subprocess.Popen([sys.executable, "-c", HOLD_FOR_EVER, directory], stdout=subprocess.PIPE, text=True)
    try:
        assert stuck.stdout.readline().strip() == "holding"
        small = sims("small", ready_file=tmp_path / "small-serves")
        small.start()
        started = time.monotonic()
        small.serve(tenancy={"replica": "small", "turn_hold_seconds": 2}, gpu_memory_utilization=0.2, timeout=3)
        assert small.state() is VllmState.WAITING_TURN
        assert wait_for(lambda: small.status().get("vllm_pid") is not None, 30)
        assert time.monotonic() - started >= 3.5  # 2 s and as long again
        turn = small.status()["turn"]
        assert turn.startswith("without: another supervisor on this node kept the node's GPU turn over 4 s")
        assert "vLLM starts without it" in small.log()
    finally:
        ended(stuck)
