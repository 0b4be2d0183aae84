"""The supervisor's parts on their own, each with the clock the test gives it (components/scripts: node_timing,
node_ray_keeper, node_turn_keeper, node_vllm_process, node_memory_waits; the watch: test_vllm_watch.py), and the status line
the supervisor writes for the status command. test_supervisor.py runs them together, as a node does."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import pytest

from components.scripts.node_contract import (
    Fault,
    LastExit,
    LastFault,
    RayReady,
    Recovery,
    SupervisorStatus,
    Tenancy,
    VllmSpec,
    VllmState,
)
from components.scripts.node_memory_waits import MemoryWaits
from components.scripts.node_ray_keeper import RayKeeper
from components.scripts.node_timing import Backoff, Every, Window
from components.scripts.node_turn_keeper import TurnKeeper
from components.scripts.node_vllm_process import Restarts, VllmProcess
from tests.unit.test_supervisor import alive
from tests.waiting import wait_for

RECOVERY = Recovery(max_restarts=3, window_seconds=100, backoff_seconds=1, max_backoff_seconds=3, gpu_wait_seconds=10)


def spec(argv=("true",), health_url=None, fraction=0.5, env=None, tenancy=None) -> VllmSpec:
    return VllmSpec(
        recovery=RECOVERY, gpu_memory_utilization=fraction, health_url=health_url, ray_ready=None,
        tenancy=tenancy, argv=list(argv), env=env or {}, fingerprint="f1",
    )  # fmt: skip


# -- retry, backoff and timed checks -----------------------------------------------------------------------------


def test_a_timed_check_is_due_once_per_interval_and_can_be_brought_forward_or_held():
    every = Every(5)
    assert [every.due(t) for t in (0, 1, 4.9, 5, 6, 10)] == [True, False, False, True, False, True]
    every.by(11)
    assert every.due(11) and not every.due(12)
    assert every.due(16, seconds=1) and every.due(17)  # an interval of its own for once
    every.never()
    assert not every.due(10**9)
    every.now()
    assert every.due(0)


def test_a_backoff_doubles_from_its_first_delay_up_to_its_most():
    assert [Backoff(2, 30).delay(n) for n in range(1, 8)] == [2, 4, 8, 16, 30, 30, 30]
    assert Backoff(1.5, 10).delay(0) == 1.5 and Backoff(1, 30).delay(10**6) == 30  # no overflow, no zeroth attempt


def test_a_window_counts_what_happened_within_its_seconds():
    window = Window()
    assert [window.add(t, 10) for t in (0, 5, 9, 12, 30)] == [1, 2, 3, 3, 1]
    window.clear()
    assert len(window) == 0


def test_restarts_count_crashes_in_the_window_back_off_and_give_up_past_max_restarts():
    restarts = Restarts()
    assert [restarts.crashed(t, RECOVERY) for t in (0, 1, 2)] == [1, 2, 3]  # 1, 2, then capped at 3
    assert restarts.next_start == 5 and restarts.total == 3
    assert restarts.crashed(3, RECOVERY) is None and len(restarts) == 4  # the fourth within 100 s: no more
    restarts.reset(50)
    assert len(restarts) == 0 and restarts.next_start == 50 and restarts.total == 3  # the total stays
    restarts.again(60, 7)  # a start that did not count
    assert restarts.next_start == 67 and len(restarts) == 0


# -- Ray ------------------------------------------------------------------------------------------------------------


def test_ray_is_restarted_after_each_exit_with_a_doubling_delay(tmp_path):
    keeper = RayKeeper([sys.executable, "-c", "import sys; sys.exit(3)"])
    keeper.keep(0)
    assert keeper.process is not None
    keeper.process.wait()
    keeper.keep(1)
    assert keeper.process is None and keeper.restarts == 1 and keeper.next_start == 3 and keeper.said() == 1
    keeper.keep(2)
    assert keeper.process is None  # not before its delay
    keeper.keep(3)
    keeper.process.wait()
    keeper.keep(3)
    assert keeper.next_start == 7  # 4 s after the second exit
    assert RayKeeper([]).said() is None  # mp: no Ray, nothing said of it


def test_ray_starts_without_idle_workers_for_its_first_driver_unless_the_container_says_otherwise(
    tmp_path, monkeypatch
):
    """The raylet reads RAY_* from the environment `ray start` hands it: prestarting a worker per CPU for the first
    driver is off (20 idle processes on a Spark's head, about 80 MB each), and a value the container sets wins."""
    said = tmp_path / "env"
    show = f"import os; open({str(said)!r}, 'w').write(os.environ.get('RAY_prestart_worker_first_driver', '-'))"
    monkeypatch.delenv("RAY_prestart_worker_first_driver", raising=False)
    keeper = RayKeeper([sys.executable, "-c", show])
    keeper.keep(0)
    keeper.process.wait()
    assert said.read_text() == "0"
    monkeypatch.setenv("RAY_prestart_worker_first_driver", "1")
    keeper = RayKeeper([sys.executable, "-c", show])
    keeper.keep(0)
    keeper.process.wait()
    assert said.read_text() == "1"


def test_the_head_asks_ray_every_few_seconds_until_it_shows_the_cluster_then_until_vllm_exits():
    answers = iter([None, {"nodes": 1, "gpus": 1}, {"nodes": 2, "gpus": 2}])
    asked = []
    keeper = RayKeeper([], check=lambda address: asked.append(address) or next(answers))
    wanted = RayReady(address="10.0.0.1:6379", nodes=2, gpus=2)
    assert keeper.cluster_formed(0, None)  # nothing to wait for
    assert [keeper.cluster_formed(t, wanted) for t in (0, 1, 2, 3, 4, 5)] == [False, False, False, False, True, True]
    assert asked == ["10.0.0.1:6379"] * 3
    keeper.forget()  # vLLM exited: asked again
    assert not keeper.cluster_formed(5, wanted)


# -- the GPU turn ---------------------------------------------------------------------------------------------------


def test_the_turn_goes_to_one_start_the_other_waits_naming_it_and_takes_it_once_it_serves(tmp_path):
    directory = tmp_path / "turn"
    first, second = (TurnKeeper(f"node-{n}", str(directory), str(tmp_path / "no")) for n in (1, 2))
    small = Tenancy(replica="small", turn_hold_seconds=60)
    try:
        assert first.take(0, small) and first.held and first.said() == "held"
        first.started()
        assert first.kept
        stop = threading.Event()
        answering = threading.Thread(target=lambda: [first.keep(0.5, small, True, False, lambda: False)
                                                     for _ in iter(lambda: stop.wait(0.05), True)])  # fmt: skip
        answering.start()  # the holder's loop answers who holds the turn
        try:
            assert not second.take(0, Tenancy(replica="big", turn_hold_seconds=60))
        finally:
            stop.set()
            answering.join()
        assert "small" in second.said() and second.said().startswith("waiting: held by")
        first.keep(2, small, running=True, serving=True, has_kv_cache=lambda: False)
        assert not first.held
        assert second.take(3, None) and second.said() == "held"
    finally:
        first.close()
        second.close()


def test_a_turn_held_past_its_limit_is_given_back_and_a_waiter_past_the_bound_starts_without_it(tmp_path):
    directory = str(tmp_path / "turn")
    holder, waiter = TurnKeeper("n", directory, "-"), TurnKeeper("n", directory, "-")
    quick = Tenancy(replica="a", turn_hold_seconds=5)
    try:
        assert holder.take(0, quick)
        holder.started()
        assert not waiter.take(0, quick)
        assert waiter.take(11, quick) and waiter.overdue and waiter.said().startswith("without: ")  # 5 + 5 s grace
        holder.keep(holder.turn.since + 6, quick, running=True, serving=False, has_kv_cache=lambda: False)
        assert not holder.held and not holder.kept  # not held all along: its memory refusal would not be its own
    finally:
        holder.close()
        waiter.close()


def test_a_turn_directory_others_may_write_in_is_refused_and_never_taken(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    keeper = TurnKeeper("n", str(shared), str(tmp_path / "own"))
    try:
        assert keeper.problem and "another user could take the node's GPU turn" in keeper.problem
    finally:
        keeper.close()


def test_neighbours_that_started_or_were_starting_meanwhile_are_named(tmp_path):
    directory = str(tmp_path / "turn")
    me, other = TurnKeeper("n", directory, "-"), TurnKeeper("n", directory, "-")
    said = {"state": VllmState.STARTING, "started": None}
    stop = threading.Event()

    def neighbour():  # the other supervisor's loop, telling how it is doing
        while not stop.wait(0.05):
            other.tell("big", 0.4, said["state"], said["started"])

    thread = threading.Thread(target=neighbour)
    thread.start()
    try:
        me.tell("small", 0.4, VllmState.RUNNING, 1000.0)
        assert wait_for(lambda: me.busy_neighbours(1000.0) == ["big was starting"], 5)
        said.update(state=VllmState.RUNNING, started=1000.5)
        assert wait_for(lambda: me.busy_neighbours(1000.0) == ["big started"], 5)
        said.update(started=900.0)
        assert wait_for(lambda: me.busy_neighbours(1000.0) == [], 5)
    finally:
        stop.set()
        thread.join()
        me.close()
        other.close()


# -- vLLM's processes ------------------------------------------------------------------------------------------------


def test_a_start_logs_after_its_mark_and_an_exit_is_seen_once_with_its_code(tmp_path):
    log = tmp_path / "vllm.log"
    log.write_text("an earlier start's lines\n")
    process = VllmProcess(str(tmp_path), str(log), stop_grace=2)
    process.start(spec([sys.executable, "-c", "print('serving soon'); import sys; sys.exit(7)"]), now=0)
    assert (tmp_path / "vllm.pid").read_text() == str(process.pid) and process.running
    assert wait_for(lambda: process.exited() == 7, 10)
    assert not process.running and process.exited() is None and process.pid is None
    output = process.output()
    assert output.startswith("=== spark-vllm: ") and "serving soon" in output and "earlier" not in output


def test_a_stop_ends_every_process_the_start_made(tmp_path):
    process = VllmProcess(str(tmp_path), str(tmp_path / "vllm.log"), stop_grace=2)
    child = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"
    process.start(spec([sys.executable, "-c", child]), now=0)
    assert wait_for(lambda: len(process.tree.remember()) >= 2, 10)
    pids = process.alive()
    process.stop("a test")
    assert not process.running and process.alive() == []
    assert len(pids) >= 2 and not any(alive(pid) for pid in pids)


# -- memory ----------------------------------------------------------------------------------------------------------


class Node:
    """What a node's memory reads return: GPUs (index, total MiB, free MiB), unified memory, MemAvailable."""

    def __init__(self, gpus=None, unified=None, available=None):
        self.gpus_found, self.unified_found, self.available = gpus, unified, available

    def gpus(self, env):
        return self.gpus_found

    def unified(self):
        return self.unified_found

    def meminfo(self):
        return None if self.available is None else (128 * 1024, self.available)

    def holders(self):
        return ["pid 7 (python3) 40.0 GiB"]

    def largest(self):
        return ["pid 9 (vllm) 60.0 GiB"]


def test_a_start_waits_for_the_gpus_memory_naming_who_holds_it_then_gives_up_after_the_limit():
    node = Node(gpus=[(0, 80 * 1024, 30 * 1024)])
    waits = MemoryWaits(node)
    assert not waits.gpu_ready(spec(fraction=0.5), 0, limit=10)
    assert "GPU 0 has 30.0 of 80.0 GiB free, vLLM asks for 40.0" in waits.busy and "pid 7" in waits.busy
    assert not waits.gave_up
    assert not waits.gpu_ready(spec(fraction=0.5), 11, limit=10)
    assert waits.gave_up.startswith("the GPU stayed busy for 11 s (recovery.gpuWaitSeconds 10)")
    node.gpus_found = [(0, 80 * 1024, 79 * 1024)]
    waits.clear()
    assert waits.gpu_ready(spec(fraction=0.5), 20, limit=10) and waits.busy is None
    assert waits.others_hold({}) == 1024


def test_on_unified_memory_giving_up_says_an_earlier_vllm_left_it_taken():
    waits = MemoryWaits(Node(unified=(128 * 1024, 20 * 1024)))
    assert not waits.gpu_ready(spec(fraction=0.5), 0, limit=5)
    assert "unified memory: 20.0 of 128.0 GiB available" in waits.busy and "pid 9" in waits.busy
    assert not waits.gpu_ready(spec(fraction=0.5), 6, limit=5)
    assert "reboot the node, then bump vllm.restartGeneration" in waits.gave_up
    assert waits.others_hold({}) == 108 * 1024
    assert MemoryWaits(Node()).gpu_ready(spec(), 0, 5)  # nothing to read: vLLM's own check decides


def test_the_oom_guard_ends_vllm_under_the_floor_once_a_second_at_most():
    node = Node(available=2048)
    waits = MemoryWaits(node)
    assert not waits.oom_guard(0, None)  # memory.oomGuard off
    assert waits.oom_guard(0, 4096) and waits.oom_guarded == 1
    assert not waits.oom_guard(0.5, 4096)  # looked at once a second
    node.available = 8192
    assert not waits.oom_guard(2, 4096) and waits.oom_guarded == 1


# -- the status line ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "status, expected",
    [
        (
            SupervisorStatus(node="n", executor="mp", state=VllmState.RUNNING, serving=True, restarts_total=1,
                             restarts_in_window=1, last_exit=LastExit(code=-9, at="2026-12-06T10:00:00Z", error="killed")),
            "vLLM: running, serving: yes, restarts: 1 (1 in the window), last exit: -9 killed",
        ),
        (
            SupervisorStatus(node="n", executor="mp", state=VllmState.FAILED, failed="gone", gpu_busy="short"),
            "vLLM: failed, serving: no, restarts: 0 (0 in the window), last exit: - ; GAVE UP: gone",
        ),
        (
            SupervisorStatus(node="n", executor="ray", state=VllmState.WAITING_TURN, turn="waiting: held by x"),
            "vLLM: waiting for the GPU turn, serving: no, restarts: 0 (0 in the window), last exit: - ; GPU turn: "
            "waiting: held by x",
        ),
        (
            SupervisorStatus(node="n", executor="mp", state=VllmState.RUNNING,
                             last_fault=LastFault(kind="stalled", at="2026-12-06T10:00:00Z", detail="no progress")),
            "vLLM: running, serving: no, restarts: 0 (0 in the window), last exit: - \n"
            "last ended while /health answered: stalled at 2026-12-06T10:00:00Z: no progress",
        ),
    ],
)  # fmt: skip
def test_the_status_command_prints_the_summary_the_supervisor_wrote_by_the_contract(tmp_path, status, expected):
    from components.resources.serve import STATUS_SUMMARY

    assert status.summarize() == expected
    path = tmp_path / "status.json"
    written = {**status.to_json(), "summary": status.summarize()}
    path.write_text(json.dumps(written))
    assert SupervisorStatus.read(str(path)).summary == expected  # status.json carries it
    printed = subprocess.run(
        [sys.executable, "-c", STATUS_SUMMARY.format(path=str(path))], capture_output=True, text=True, check=True
    )
    assert printed.stdout.rstrip("\n") == expected
    path.write_text(json.dumps({**written, "summary": "what the supervisor said"}))
    printed = subprocess.run(
        [sys.executable, "-c", STATUS_SUMMARY.format(path=str(path))], capture_output=True, text=True, check=True
    )
    assert printed.stdout.strip() == "what the supervisor said"  # the supervisor's line, not the keys read again


def test_a_summary_is_what_the_status_command_read_of_the_keys_before(tmp_path):
    """A supervisor started before it wrote a summary: the command reads its keys as it did, to the same line."""
    from components.resources.serve import STATUS_SUMMARY

    status = SupervisorStatus(node="n", executor="mp", state=VllmState.BACKOFF, restarts_total=2, restarts_in_window=1,
                              last_exit=LastExit(code=1, at="t", error="boom"), gpu_busy="GPU 0 has 1.0 of 80.0 GiB free",
                              last_fault=LastFault(kind="wrong", at="t", detail="tokens"))  # fmt: skip
    path = tmp_path / "status.json"
    path.write_text(json.dumps(status.to_json()))
    printed = subprocess.run(
        [sys.executable, "-c", STATUS_SUMMARY.format(path=str(path))], capture_output=True, text=True, check=True
    )
    assert printed.stdout.rstrip("\n") == status.summarize()


def test_the_last_exit_and_fault_a_supervisor_wrote_read_back_typed():
    """status.json's `last_exit` and `last_fault` as every supervisor wrote them: typed by the contract on reading."""
    written = {"node": "n", "executor": "mp", "state": "backoff",
               "last_exit": {"code": -9, "at": "2026-12-06T10:00:00Z", "error": "SIGKILL"},
               "last_fault": {"kind": "stalled", "at": "2026-12-06T09:59:00Z", "detail": "d", "metrics": {"a": 1},
                              "canary": None}}  # fmt: skip
    status = SupervisorStatus.from_json(written)
    assert status.state is VllmState.BACKOFF and status.last_exit == LastExit(-9, "2026-12-06T10:00:00Z", "SIGKILL")
    assert status.last_fault.kind == Fault.STALLED and status.last_fault.metrics == {"a": 1}
    assert {k: v for k, v in status.to_json().items() if k in written} == written
