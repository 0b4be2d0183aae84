import gc
import hashlib
import json
import logging
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Tests that expect a deployment to fail leave Pulumi's failed registration futures behind; asyncio
# reports each one again ("Future exception was never retrieved") when it is collected, long after
# the test asserted the error. Keep CI output to what matters.
logging.getLogger("asyncio").setLevel(logging.CRITICAL)


def python3_past_a_shim(path: str, interpreter: str) -> str | None:
    """A folder to put first on PATH, whose python3 is `interpreter`, where PATH's python3 is a script (pyenv's shim:
    each start ran about 35 bash processes to find the interpreter, 0.1 CPU-s, before the node program or fake the
    test started with python3 ran; 2026-12-07); None where it is the interpreter itself or absent."""
    found = shutil.which("python3", path=path)
    if not found:
        return None
    with open(found, "rb") as handle:
        if handle.read(2) != b"#!":
            return None
    folder = os.path.join(
        tempfile.gettempdir(), "spark-vllm-python3-" + hashlib.sha256(interpreter.encode()).hexdigest()[:12]
    )
    os.makedirs(folder, exist_ok=True)
    try:
        os.symlink(interpreter, os.path.join(folder, "python3"))
    except FileExistsError:  # another session's, to the same interpreter
        pass
    return folder


def pytest_configure(config):
    """One folder a pytest session for the program runs its tests share (tests/harness.py shared_run): made by the
    process that starts the session, before xdist starts its workers, which inherit the variable; removed at its
    end. A worker or a caller that set it already keeps the one it has. (The name is tests/harness.py's
    SHARED_RUNS_ENV, not imported: that would load Pulumi's SDK in every rehearsal process.) And python3 for the
    tests' processes past a version manager's shim: the interpreter this venv was made from, which PATH's python3
    runs (scripts/setup.sh makes the venv with it)."""
    folder = python3_past_a_shim(os.environ.get("PATH", ""), os.path.realpath(sys._base_executable))
    if folder and not os.environ["PATH"].startswith(folder + os.pathsep):
        os.environ["PATH"] = folder + os.pathsep + os.environ["PATH"]
    if os.environ.get("SPARK_VLLM_SHARED_RUNS"):
        return
    folder = tempfile.mkdtemp(prefix="spark-vllm-runs-")
    os.environ["SPARK_VLLM_SHARED_RUNS"] = folder
    config._spark_vllm_shared_runs = folder


def pytest_unconfigure(config):
    folder = getattr(config, "_spark_vllm_shared_runs", None)
    if folder:
        shutil.rmtree(folder, ignore_errors=True)
        os.environ.pop("SPARK_VLLM_SHARED_RUNS", None)


@pytest.fixture(autouse=True)
def _own_gpu_turn(monkeypatch):
    """Supervisors started by a test on this machine would share the node's GPU turn
    (components/scripts/node_gpu_turn.py): each test gets a directory of its own for it, so tests running side by
    side never wait for each other's. Short, under /tmp: a Unix socket's path is at most 107 bytes. (The
    rehearsal's nodes have a dockerd each, so a turn volume each.)"""
    directory = tempfile.mkdtemp(prefix="svturn-", dir="/tmp")
    monkeypatch.setenv("SPARK_VLLM_GPU_TURN", directory)
    yield
    shutil.rmtree(directory, ignore_errors=True)


# Every file of 15 s or more, longest first (seconds per file in the full run, 4 processes, 2026-12-07 at 849148e:
# 877 s). The rehearsal's modules come first: ./run-tests hands them out whole in this order (tests/scheduling.py),
# so the long ones start at once. Then the fast lane's files that wait on timers and processes more than they
# compute: both lanes hand their tests out alternating with the other files' (as whole files at the end of the full
# run's order, they ran side by side and left the cores idle, 2026-12-07; unlisted before that, in collection order,
# tests/unit/test_vllm_watch.py, 50 s, ended the run with the cores half idle for two minutes). The collection is
# sorted by this list (pytest_collection_modifyitems below); a file not listed goes after, in collection order.
LONGEST_FIRST = (
    "tests/e2e/test_deployments.py",  # 388 s
    "tests/e2e/test_gpu_recipe.py",  # 360 s
    "tests/e2e/test_rehearsal.py",  # 357 s
    "tests/e2e/test_three_nodes.py",  # 315 s
    "tests/e2e/test_recovery.py",  # 268 s
    "tests/e2e/test_stalls.py",  # 254 s
    "tests/e2e/test_refusals.py",  # 156 s
    "tests/e2e/test_speculative.py",  # 121 s
    "tests/e2e/test_fabric_copy.py",  # 119 s
    "tests/e2e/test_guard.py",  # 107 s
    "tests/unit/test_supervisor.py",  # 97 s
    "tests/e2e/standin/test_vllm_standin.py",  # 80 s
    "tests/e2e/test_one_node.py",  # 69 s
    "tests/e2e/test_hf_sync.py",  # 64 s
    "tests/e2e/image/test_image.py",  # 53 s
    "tests/unit/test_edge_load.py",  # 52 s
    "tests/unit/test_vllm_watch.py",  # 50 s
    "tests/unit/test_router_keeper.py",  # 44 s
    "tests/unit/test_edge.py",  # 43 s
    "tests/unit/test_gpu_turn.py",  # 41 s
    "tests/unit/test_scripts.py",  # 37 s
    "tests/unit/test_fabric_copy.py",  # 36 s
    "tests/e2e/test_nodes.py",  # 32 s
    "tests/unit/test_guard.py",  # 27 s
    "tests/unit/test_edge_scripts.py",  # 27 s
    "tests/unit/test_preflight.py",  # 15 s
)


# The fast lane's tests that wait 5 s or more on timers and processes, longest first (seconds each in the fast lane,
# 10 processes, 2026-12-07 at 43b8e93): they go out before anything else, to at most two fifths of its processes at
# once (tests/scheduling.py). A name without parameters stands for each of its parameters. Only where a test starts
# changes; one not listed goes out with its file's tests.
LONG_WAITS = (
    "tests/unit/test_vllm_watch.py::test_the_canary_keeps_its_first_answer_and_ends_a_vllm_that_answers_other_tokens_twice",  # 22 s
    "tests/unit/test_edge_scripts.py::test_a_listener_that_accepts_and_never_answers_ends_the_container_for_docker_to_restart",  # 15 s
    "tests/unit/test_router_keeper.py::test_a_replica_that_serves_no_more_is_taken_out_until_it_serves_again",  # 14 s
    "tests/unit/test_guard.py::test_only_the_fabric_peer_reaches_the_guarded_ports",  # 13 s each of 2
    "tests/e2e/standin/test_vllm_standin.py::test_mp_a_stopped_rank_holds_every_step_of_rank_0_without_killing_it",  # 12 s
    "tests/unit/test_edge.py::test_health_is_answered_by_the_edge_from_its_checks_and_nothing_of_it_reaches_the_upstream",  # 11 s each of 2
    "tests/e2e/standin/test_vllm_standin.py::test_two_vllms_profiling_at_once_on_one_gpu_count_each_others_memory",  # 11 s
    "tests/unit/test_vllm_watch.py::test_a_stalled_vllm_is_ended_and_started_again_as_a_crash_saying_why",  # 10 s
    "tests/unit/test_vllm_watch.py::test_a_vllm_that_served_and_stopped_answering_health_is_ended_after_stall_seconds",  # 10 s
    "tests/unit/test_edge_scripts.py::test_the_watchdog_cannot_be_turned_on_the_edge_by_crowding_its_ports",  # 9 s
    "tests/unit/test_supervisor.py::test_ray_is_kept_running_and_the_head_waits_for_the_cluster",  # 8 s
    "tests/e2e/standin/test_vllm_standin.py::test_a_stopped_engine_core_stalls_generation_mid_stream_while_health_stays_200",  # 8 s
    "tests/unit/test_vllm_watch.py::test_new_watch_settings_reach_the_supervisor_without_restarting_vllm",  # 7 s
    "tests/unit/test_fabric_copy.py::test_a_slow_handshake_is_dropped_in_seconds_and_idle_peers_cannot_shut_a_receiver_out",  # 7 s
    "tests/unit/test_supervisor.py::test_a_start_vllm_refuses_for_lack_of_gpu_memory_is_not_a_crash",  # 7 s
    "tests/unit/test_supervisor.py::test_a_gpu_that_stays_busy_is_given_up_on_with_what_holds_it",  # 7 s
    "tests/unit/test_gpu_turn.py::test_a_memory_refusal_while_a_neighbour_is_starting_is_never_called_a_refusal_of_its_settings",  # 7 s
    "tests/unit/test_supervisor.py::test_on_unified_memory_a_start_waits_for_memavailable_and_gives_up_saying_why",  # 7 s
    "tests/unit/test_gpu_turn.py::test_a_memory_refusal_while_a_neighbour_changed_its_memory_is_started_again_not_counted",  # 6 s
    "tests/unit/test_supervisor.py::test_a_start_waits_until_the_gpu_has_what_vllm_asks_for_and_names_what_holds_it",  # 6 s
    "tests/unit/test_supervisor.py::test_a_crash_loop_stops_after_max_restarts_and_says_why",  # 6 s
    "tests/unit/test_supervisor.py::test_an_engine_core_gone_while_the_api_server_waits_on_is_vllms_exit",  # 6 s
    "tests/unit/test_gpu_turn.py::test_new_settings_start_the_count_of_quiet_refusals_again",  # 6 s
    "tests/unit/test_supervisor.py::test_a_stop_gives_ray_a_short_grace_not_vllms",  # 6 s
    "tests/e2e/standin/test_vllm_standin.py::test_the_fault_file_hangs_the_engine_or_makes_it_answer_other_tokens",  # 6 s
    "tests/unit/test_gpu_turn.py::test_a_holder_that_keeps_the_turn_past_its_limit_is_waited_for_no_longer",  # 5 s
    "tests/unit/test_edge_load.py::test_an_idle_connection_that_sent_nothing_writes_no_log_line",  # 5 s
    "tests/unit/test_supervisor.py::test_a_live_engine_core_is_left_alone",  # 5 s
    "tests/unit/test_benchmark.py::test_a_tiny_run_reports_every_target",  # 5 s
)  # fmt: skip


# What ./run-tests --fast runs (its FAST): the rest is the rehearsal, whose modules go out whole, to at most
# REHEARSAL_AT_ONCE processes at once (each module brings up its simulated nodes: five at once on this machine's 2
# cores and 24 GiB, 2026-12-07); a full run's other processes run the fast lane's tests beside them.
REHEARSAL_AT_ONCE = 5
FAST_LANE = ("tests/unit", "tests/program", "tests/gpu", "tests/e2e/standin", "tests/e2e/image/test_build_unit.py")


def in_fast_lane(path: str) -> bool:
    return any(path == part or path.startswith(part + "/") for part in FAST_LANE)


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # a hook of pytest-xdist, absent under -p no:xdist
def pytest_xdist_make_scheduler(config, log):
    """--dist load (./run-tests, each lane): the rehearsal's modules whole and first, then LONG_WAITS to a few
    processes at once, the files of LONGEST_FIRST (those that wait more than they compute) alternating with the
    others (tests/scheduling.py)."""
    if config.getvalue("dist") != "load":
        return None
    from tests.scheduling import CappedWaits

    return CappedWaits(config, log, waits=LONG_WAITS, waiting_files=LONGEST_FIRST,
                       whole=lambda path: not in_fast_lane(path), whole_at_once=REHEARSAL_AT_ONCE)  # fmt: skip


def _cpu_seconds() -> tuple[float, float]:
    """This process's CPU seconds, and those of the children it reaped (and theirs, when they reaped them)."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time(), children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """SPARK_VLLM_TEST_CPU=FILE (benchmarks/suite_time.py --cpu sets it): each test's CPU seconds, setup and
    teardown included, appended to FILE as a JSON line: its own process's and its reaped children's. What the
    suite burns on a machine whose cores are the limit, test by test (a daemon a test leaves running counts where
    it is reaped, or nowhere); with the test process and when it ran, for the run's timeline."""
    path = os.environ.get("SPARK_VLLM_TEST_CPU")
    before = _cpu_seconds() if path else None
    started = time.time()
    yield
    if path:
        after = _cpu_seconds()
        line = {"test": item.nodeid, "own": round(after[0] - before[0], 3), "children": round(after[1] - before[1], 3),
                "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"), "start": started, "end": time.time()}  # fmt: skip
        with open(path, "a") as handle:  # one short write a line, appended: the workers' lines do not mix
            handle.write(json.dumps(line) + "\n")


def pytest_collection_modifyitems(items):
    rank = {path: index for index, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))  # stable: order kept within


def pytest_terminal_summary(terminalreporter):
    """Per test file: the seconds its tests took (setup, call and teardown together), slowest first;
    with several processes the files overlap, so the total is more than the run's wall time."""
    totals: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            duration, nodeid = getattr(report, "duration", None), getattr(report, "nodeid", "")
            if duration is not None and "::" in nodeid and getattr(report, "when", None):
                module = nodeid.split("::", 1)[0]
                totals[module] = totals.get(module, 0.0) + duration
    if not totals:
        return
    terminalreporter.write_sep("=", "seconds per test file")
    for module, seconds in sorted(totals.items(), key=lambda item: -item[1]):
        terminalreporter.write_line(f"{seconds:8.1f}s  {module}")


def pytest_collection_finish(session):
    """What collection left (the test modules, pulumi, pydantic, grpc: about 10^5 objects) moved out of the garbage
    collector's reach: each full collection walked all of it again, and the program under mocks makes enough
    objects to run many (2026-12-07, alternating runs: tests/program in one process 99.8 -> 86.1 CPU-s, four each
    way; the fast lane 258 -> 246 CPU-s, two each way, within this machine's noise for its wall time)."""
    gc.collect()
    gc.freeze()
