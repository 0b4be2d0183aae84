"""The node containers' supervisor (components/scripts/supervisor.py), run for real as a process,
with the serve step's scripts (serve_spec.py, serve_stop.py) talking to it, fake `vllm` and `ray`
programs on PATH, and a fake `ray` Python module for the head's wait for the cluster."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from components.plan.programs import script, script_program
from components.scripts.node_contract import SupervisorStatus, VllmState
from tests.waiting import holds_for, wait_for, wait_until

PYTHON = sys.executable

FAKE_VLLM = """
import json, os, signal, subprocess, sys, time
# like vLLM's engine core: a child that outlives a SIGKILL of its parent (FAKE_VLLM_SETSID: in a session of its own)
child = subprocess.Popen([sys.executable, "-c", "import signal, time; time.sleep(600)"],
                         start_new_session=bool(os.environ.get("FAKE_VLLM_SETSID")))
open(os.environ["CHILD_PID_FILE"], "a").write(f"{child.pid}\\n")
open(os.environ["VLLM_PID_FILE"], "a").write(f"{os.getpid()}\\n")  # reaped by the test, its supervisor killed or not
if os.environ.get("FAKE_VLLM_GPU_BUSY"):
    print("ValueError: Free memory on device cuda:0 (10.2/139.8 GiB) on startup is less than desired GPU memory "
          "utilization (0.9, 125.82 GiB). Decrease GPU memory utilization or reduce GPU memory used by other processes.",
          flush=True)
    sys.exit(1)
print("fake vllm", sys.argv[1:], "key set" if os.environ.get("VLLM_API_KEY") else "no key", flush=True)
if os.environ.get("FAKE_VLLM_FACTORS"):  # what vLLM 0.25's worker writes while it compiles (its env's raw values)
    folder = os.path.join(os.environ["VLLM_CACHE_ROOT"], "torch_compile_cache", "3f8484553b", "rank_0_0", "backbone")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "cache_key_factors.json"), "w") as handle:
        handle.write(json.dumps({"env": {"VLLM_API_KEY": os.environ.get("VLLM_API_KEY"), "VLLM_PP": None}}, indent=2))
# what vLLM 0.25 prints at every start on a host with a low fd limit: a warning, not why it exits
print("(APIServer pid=1) WARNING 12-01 20:42:04 [system_utils.py:299] Found ulimit of 20000 and failed to "
      "automatically increase with error current limit exceeds maximum limit. This can cause fd limit errors "
      "like `OSError: [Errno 24] Too many open files`.", flush=True)
if os.environ.get("FAKE_VLLM_MEMORY_REFUSE"):  # vLLM 0.25 finding no memory for its KV cache after profiling
    time.sleep(float(os.environ.get("FAKE_VLLM_PROFILE_SECONDS", "0.3")))
    if os.environ.get("FAKE_VLLM_FREE_AT_EXIT"):  # a neighbour took (or gave back) memory meanwhile
        open(os.environ["FAKE_GPU_FREE_MIB"], "w").write(os.environ["FAKE_VLLM_FREE_AT_EXIT"])
    print("(EngineCore pid=1) ERROR 12-03 10:11:12 [core.py:1100] ValueError: No available memory for the cache "
          "blocks. Try increasing `gpu_memory_utilization` when initializing the engine.", flush=True)
    sys.exit(1)
if os.environ.get("FAKE_VLLM_REFUSE"):  # vLLM 0.25 refusing its settings at start (after loading, compiling)
    time.sleep(0.3)
    print("(EngineCore pid=1) ERROR 12-02 10:11:12 [core.py:1100] ValueError: max_num_seqs (1024) exceeds available "
          "Mamba cache blocks (609). Each decode sequence requires one Mamba cache block, so CUDA graph capture cannot "
          "proceed. Please lower max_num_seqs to at most 609 or increase gpu_memory_utilization.", flush=True)
    sys.exit(1)
if os.environ.get("FAKE_VLLM_KV_LINE"):  # a worker's line once its KV cache is allocated (vLLM 0.25's gpu_worker.py)
    print("(Worker pid=2) INFO 12-03 10:11:12 [gpu_worker.py:436] Available KV cache memory: 56.24 GiB", flush=True)
if os.environ.get("FAKE_VLLM_ENGINE_DIES"):  # vLLM 0.25 on two H200s: the engine core fails, the API server waits on
    subprocess.Popen([sys.executable, "-c", "import sys, time\\n"  # for good
                      "open('/proc/self/comm', 'w').write('VLLM::EngineCore')\\n"
                      f"time.sleep({float(os.environ['FAKE_VLLM_ENGINE_DIES'])})\\n"
                      "print('(EngineCore pid=1789) ERROR 12-04 18:16:25 [core.py:1231] RuntimeError: Worker failed "
                      "with error CUBLAS_STATUS_INTERNAL_ERROR', flush=True)\\n"
                      "sys.exit(1)"])  # fmt: skip
if os.environ.get("FAKE_VLLM_CRASH_AFTER"):
    time.sleep(float(os.environ["FAKE_VLLM_CRASH_AFTER"]))
    print(os.environ.get("FAKE_VLLM_CRASH_LINE", "ERROR EngineCore failed: out of memory"), flush=True)
    sys.exit(1)
if os.environ.get("FAKE_VLLM_IGNORE_TERM"):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
else:
    signal.signal(signal.SIGTERM, lambda *a: (print("Shutting down", flush=True), sys.exit(0)))
print("fake vllm waiting", flush=True)  # its signal handling in place
time.sleep(600)
"""
FAKE_RAY = """
import os, signal, sys, time
if os.environ.get("FAKE_RAY_IGNORE_TERM"):  # as a Ray head draining for up to 30 s
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
open(os.environ["RAY_STARTS"], "a").write(" ".join(sys.argv[1:]) + "\\n")
time.sleep(float(os.environ.get("FAKE_RAY_LIVES", "600")))
sys.exit(3)
"""
FAKE_NVIDIA_SMI = """
import os, sys
unified = bool(os.environ.get("FAKE_UNIFIED"))  # a GB10: its memory is the system's, and nvidia-smi says [N/A]
if sys.argv[1:] == ["--query-gpu=memory.total", "--format=csv,noheader,nounits"]:
    print("[N/A]" if unified else "143771")
    sys.exit(0)
assert sys.argv[1:] == ["--query-gpu=index,memory.total,memory.free", "--format=csv,noheader,nounits"], sys.argv
print("0, [N/A], [N/A]" if unified else f"0, 143771, {open(os.environ['FAKE_GPU_FREE_MIB']).read().strip()}")
"""
FAKE_RAY_MODULE = """
import json, os
def init(address=None, **kwargs):
    pass
def nodes():
    count = json.load(open(os.environ["FAKE_RAY_NODES"]))["alive"]
    return [{"Alive": True, "Resources": {"GPU": 1}} for _ in range(count)]
"""


class Health(BaseHTTPRequestHandler):
    """vLLM's /health: 200 once the file the server names exists (always, when it names none)."""

    def do_GET(self):  # noqa: N802
        ready = self.server.ready_file is None or self.server.ready_file.exists()
        self.send_response(200 if ready else 503)
        self.end_headers()

    def log_message(self, *args):
        pass


class NodeSim:
    """A node's container, as far as the supervisor sees it: a run directory, PATH with fake vllm, ray and
    nvidia-smi, a health endpoint; `start()` runs the supervisor, `close()` stops it. Several of them in one
    test are containers of one node: they share its GPU turn (the test's) and its fake GPU (`gpu-free`)."""

    def __init__(self, tmp_path: Path, name: str = "node-1", ready_file: Path | None = None):
        self.tmp_path, self.name = tmp_path, name
        self.run_dir = tmp_path / f"run-{name}" if name != "node-1" else tmp_path / "run"
        bin_dir = tmp_path / "bin"
        if not bin_dir.exists():
            bin_dir.mkdir()
            for program, source in (("vllm", FAKE_VLLM), ("ray", FAKE_RAY), ("nvidia-smi", FAKE_NVIDIA_SMI)):
                (bin_dir / program).write_text(f"#!{PYTHON}\n{source}")
                (bin_dir / program).chmod(0o755)
            module = tmp_path / "site"
            (module / "ray").mkdir(parents=True)
            (module / "ray" / "__init__.py").write_text(FAKE_RAY_MODULE)
            (tmp_path / "nodes.json").write_text(json.dumps({"alive": 2}))
            (tmp_path / "gpu-free").write_text("143000")
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Health)
        self.server.ready_file = ready_file
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.health_url = f"http://127.0.0.1:{self.server.server_address[1]}/health"
        self.env = {
            **os.environ,
            "PATH": f"{bin_dir}:{os.environ['PATH']}",
            "PYTHONPATH": str(tmp_path / "site"),
            "CHILD_PID_FILE": str(tmp_path / "children"),
            "VLLM_PID_FILE": str(tmp_path / "vllms"),
            "RAY_STARTS": str(tmp_path / "ray-starts"),
            "FAKE_RAY_NODES": str(tmp_path / "nodes.json"),
            "FAKE_GPU_FREE_MIB": str(tmp_path / "gpu-free"),
        }
        self.process = None

    def start(self, ray_argv=None, guard_marker=None, stop_grace=2, **extra_env):
        params = {"node": "node-1", "executor": "ray" if ray_argv else "mp", "run_dir": str(self.run_dir),
                  "ray_argv": ray_argv, "stop_grace_seconds": stop_grace}  # fmt: skip
        if guard_marker:
            params["guard_marker"] = str(guard_marker)
        program = self.tmp_path / "supervisor.py"  # a file, as the container has it (too long for an argument)
        program.write_text(script("supervisor.py"))
        self.process = subprocess.Popen(
            [PYTHON, "-u", str(program), json.dumps(params)],
            env={**self.env, **extra_env},
            stdout=open(self.tmp_path / f"supervisor-{self.name}.log", "w"),
            stderr=subprocess.STDOUT,
        )
        return self.process

    def status(self) -> dict:
        try:
            return json.loads((self.run_dir / "status.json").read_text())
        except (OSError, ValueError):
            return {}

    def state(self) -> VllmState | None:
        """The supervisor's state by name (status.json read through its contract), None before it wrote one."""
        found = SupervisorStatus.read(str(self.run_dir / "status.json"))
        return found.state if found else None

    def log(self) -> str:
        try:
            return (self.run_dir / "vllm.log").read_text()
        except OSError:
            return ""

    def serve(
        self, argv=("vllm", "serve", "m"), fingerprint="f1", timeout=20, watch=None, **spec
    ) -> subprocess.CompletedProcess:
        params = {
            "node": "node-1",
            "argv": list(argv),
            "env": {"VLLM_API_KEY": "secret-key"},
            "spec": {
                "recovery": {
                    "max_restarts": 3,
                    "window_seconds": 60,
                    "backoff_seconds": 0.5,
                    "max_backoff_seconds": 1,
                    "gpu_wait_seconds": 6,
                },
                "gpu_memory_utilization": 0.9,
                "health_url": self.health_url,
                "ray_ready": None,
                **spec,
            },  # fmt: skip
            "fingerprint": fingerprint,
            "run_dir": str(self.run_dir),
            "timeout_seconds": timeout,
            **({"watch": watch} if watch else {}),
        }
        return subprocess.run(
            [PYTHON, "-"], input=script_program("serve_spec.py", params), capture_output=True, text=True,
            timeout=timeout + 30,
        )  # fmt: skip

    def stop_vllm(self) -> subprocess.CompletedProcess:
        return subprocess.run(
            [PYTHON, "-", str(self.run_dir), "2"], input=script("serve_stop.py"), capture_output=True,
            text=True, timeout=60,
        )  # fmt: skip

    def close(self) -> None:
        self.server.shutdown()
        process = self.process
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                process.kill()
        for line in [*pids_in(self.tmp_path / "children"), *pids_in(self.tmp_path / "vllms")]:
            try:
                os.kill(int(line), signal.SIGKILL)
            except ProcessLookupError:
                pass


def pids_in(path: Path) -> list[str]:
    """The pids a fake process wrote to `path`, one a line (none yet: no file)."""
    return path.read_text().split() if path.exists() else []


@pytest.fixture
def node(tmp_path):
    sim = NodeSim(tmp_path)
    yield sim
    sim.close()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return "Z" not in Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][:1]
    except OSError:
        return False


def test_settings_start_vllm_once_and_the_same_settings_leave_it_alone(node):
    node.start()
    first = node.serve()
    assert first.returncode == 0, first.stdout + first.stderr
    pid = node.status()["vllm_pid"]
    assert f"vLLM started (pid {pid})" in first.stdout and alive(pid)
    assert wait_for(lambda: node.status().get("serving") is True)
    assert node.state() is VllmState.RUNNING
    assert wait_for(lambda: "key set" in node.log())  # the fake's own output: it may start slowly under load
    assert "secret-key" not in node.log() + first.stdout
    assert oct((node.run_dir / "spec.json").stat().st_mode & 0o777) == "0o600"  # it carries the key
    again = node.serve()
    assert f"vLLM already running with these settings (pid {pid})" in again.stdout
    assert node.status()["vllm_pid"] == pid


def test_new_settings_stop_the_old_vllm_and_start_the_new(node):
    node.start()
    node.serve()
    old = node.status()["vllm_pid"]
    changed = node.serve(argv=("vllm", "serve", "m", "--max-model-len=2048"), fingerprint="f2")
    new = node.status()["vllm_pid"]
    assert changed.returncode == 0 and new != old and f"vLLM started (pid {new})" in changed.stdout
    assert wait_for(lambda: not alive(old), 5)
    assert "stopping vLLM" in node.log() and "new settings" in node.log()


def test_a_vllm_that_dies_is_started_again_by_itself(node):
    node.start()
    node.serve()
    pid = node.status()["vllm_pid"]
    os.killpg(pid, signal.SIGKILL)
    assert wait_for(lambda: node.status().get("vllm_pid") not in (None, pid))
    status = node.status()
    assert status["restarts_total"] == 1 and status["last_exit"]["code"] == -9
    assert "starting it again in 0.5 s (1 of 3 restarts within 60 s)" in node.log()


def test_a_crash_loop_stops_after_max_restarts_and_says_why(node):
    process = node.start(FAKE_VLLM_CRASH_AFTER="0.2")
    result = node.serve(timeout=30)
    # the serve step may see the first start, or already the supervisor giving up
    assert wait_for(lambda: node.state() is VllmState.FAILED, 30)
    status = node.status()
    assert "vLLM exited 4 times within 60 s (recovery.maxRestarts 3): not starting it again" in status["failed"]
    assert "ERROR EngineCore failed: out of memory" in status["failed"]
    assert process.poll() is None  # the supervisor (the container) stays up
    again = node.serve(timeout=10)
    # handed over (the state must hold what the node holds); the readiness step fails `pulumi up`
    assert again.returncode == 0 and "does not start: vLLM exited 4 times" in again.stdout
    assert json.loads(again.stdout.strip().splitlines()[-1])["vllm_pid"] is None
    assert "out of memory" in again.stdout  # the log tail
    del result


def test_an_engine_core_gone_while_the_api_server_waits_on_is_vllms_exit(node):
    """The API server outliving its engine core would never serve nor exit: after the stop grace (2 s here) the
    supervisor ends it, says why, and restarts vLLM as after any exit, the engine's error as the reason."""
    node.start(FAKE_VLLM_ENGINE_DIES="1")
    node.serve(timeout=5, health_url=None)
    first = node.status()["vllm_pid"]
    assert wait_for(lambda: node.status().get("restarts_total", 0) >= 1, 20)
    assert "did not follow: ending what is left of vLLM" in node.log()
    exit_ = node.status()["last_exit"]
    assert exit_["error"].startswith("its engine core exited and its API server did not follow; its log's last error:")
    assert "RuntimeError: Worker failed with error" in exit_["error"]
    assert node.status()["vllm_pid"] != first


def test_a_live_engine_core_is_left_alone(node):
    node.start(FAKE_VLLM_ENGINE_DIES="600")
    node.serve(timeout=5, health_url=None)
    holds_for(lambda: node.status().get("restarts_total") == 0, 4, "vLLM with its engine core, not restarted")
    assert "did not follow" not in node.log()


def test_a_start_vllm_refuses_for_its_own_settings_ends_the_loop_at_once(node):
    process = node.start(FAKE_VLLM_REFUSE="1")
    node.serve(timeout=5, health_url=None)  # it never serves
    assert wait_for(lambda: node.state() is VllmState.FAILED, 20)
    status = node.status()
    assert status["failed"].startswith("vLLM refused its settings while starting, and would refuse them again")
    assert "max_num_seqs (1024) exceeds available Mamba cache blocks (609)" in status["failed"]
    assert status["restarts_total"] == 0 and status["restarts_in_window"] == 0  # one start, no restart
    assert node.log().count("vLLM started (pid") == 1
    assert process.poll() is None  # the container stays up, saying why
    again = node.serve(timeout=10, health_url=None)
    # handed over, saying why it does not start; the readiness step fails `pulumi up` with it
    assert again.returncode == 0 and "exceeds available Mamba cache blocks" in again.stdout


def test_a_crash_after_serving_is_restarted_even_with_a_refusal_like_line(node):
    node.start(
        FAKE_VLLM_CRASH_AFTER="1.5", FAKE_VLLM_CRASH_LINE="pydantic_core.ValidationError: 1 validation error for X"
    )
    node.serve(timeout=10)  # the fixture's /health answers: it served before it crashed
    assert wait_for(lambda: node.status().get("restarts_total", 0) >= 1, 20)
    assert "vLLM refused its settings" not in (node.status().get("failed") or "")


def test_stopping_is_graceful_takes_the_whole_group_and_is_safe_twice(node, tmp_path):
    node.start()
    node.serve()
    pid = node.status()["vllm_pid"]
    assert wait_for(lambda: (tmp_path / "children").exists())
    child = int((tmp_path / "children").read_text().split()[0])
    assert wait_for(lambda: "fake vllm waiting" in node.log())
    stopped = node.stop_vllm()
    assert stopped.returncode == 0 and f"vLLM (pid {pid}) stopped" in stopped.stdout
    assert "Shutting down" in node.log()  # SIGTERM first
    assert wait_for(lambda: not alive(pid) and not alive(child), 5)
    assert node.state() is VllmState.NO_SETTINGS
    second = node.stop_vllm()
    assert second.returncode == 0 and "nothing to stop" in second.stdout


def test_a_vllm_that_ignores_sigterm_is_killed_after_the_grace(node):
    node.start(FAKE_VLLM_IGNORE_TERM="1")
    node.serve()
    pid = node.status()["vllm_pid"]
    stopped = node.stop_vllm()
    assert stopped.returncode == 0
    assert not alive(pid)


def test_ray_is_kept_running_and_the_head_waits_for_the_cluster(node, tmp_path):
    (tmp_path / "nodes.json").write_text(json.dumps({"alive": 1}))  # a worker has not joined yet
    process = node.start(ray_argv=["ray", "start", "--block", "--head"], FAKE_RAY_LIVES="1")
    assert wait_for(lambda: len((tmp_path / "ray-starts").read_text().splitlines()) >= 2
                    if (tmp_path / "ray-starts").exists() else False, 20)  # fmt: skip
    assert "Ray exited with code 3; starting it again in 2 s" in (node.run_dir / "vllm.log").read_text()
    result = node.serve(ray_ready={"address": "10.0.0.1:6379", "nodes": 2, "gpus": 2}, timeout=5)
    assert result.returncode == 0 and "vLLM starts once Ray shows every node" in result.stdout
    assert node.state() is VllmState.WAITING_RAY and node.status()["vllm_pid"] is None
    (tmp_path / "nodes.json").write_text(json.dumps({"alive": 2}))
    assert wait_for(lambda: node.status().get("vllm_pid") is not None, 20)
    process.send_signal(signal.SIGTERM)  # docker stop
    assert process.wait(timeout=30) == 0
    assert node.state() is VllmState.STOPPED


def test_a_stop_gives_ray_a_short_grace_not_vllms(node, tmp_path):
    process = node.start(ray_argv=["ray", "start", "--block", "--head"], stop_grace=30, FAKE_RAY_IGNORE_TERM="1")
    assert wait_for(lambda: (tmp_path / "ray-starts").exists(), 10)
    wait_until(lambda: node.status().get("ray_restarts") is not None, 10, "the supervisor's status with Ray in it")
    started = time.monotonic()
    process.send_signal(signal.SIGTERM)  # docker stop
    assert process.wait(timeout=20) == 0
    assert time.monotonic() - started < 10  # 5 s for Ray, not vLLM's 30
    assert "Ray did not stop within 5 s of SIGTERM: SIGKILL to its processes" in node.log()


def test_with_the_guard_nothing_starts_before_its_rules_are_in_place_in_this_boot(node, tmp_path):
    marker = tmp_path / "guard" / "applied.json"
    marker.parent.mkdir()
    marker.write_text(json.dumps({"boot_id": "a-boot-before-the-last-reboot", "hash": "h"}))
    node.start(ray_argv=["ray", "start", "--block", "--head"], guard_marker=marker)
    assert wait_for(lambda: node.state() is VllmState.WAITING_GUARD)
    holds_for(lambda: not (tmp_path / "ray-starts").exists(), 1.5, "no Ray start on a stale marker (another boot)")
    boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    marker.write_text(json.dumps({"boot_id": boot, "hash": "h"}))  # the guard applied its rules
    assert wait_for(lambda: (tmp_path / "ray-starts").exists())
    assert "network.guard's rules are in place" in (tmp_path / "supervisor-node-1.log").read_text()


def children(tmp_path) -> list[int]:
    return [int(line) for line in (tmp_path / "children").read_text().split()]


@pytest.mark.parametrize("own_session", [False, True], ids=["in-its-group", "in-a-session-of-its-own"])
def test_a_sigkilled_vllm_leaves_nothing_behind_before_it_starts_again(node, tmp_path, own_session):
    """The API server alone is killed (as the OOM killer does); its engine core would keep the GPU."""
    node.start(**({"FAKE_VLLM_SETSID": "1"} if own_session else {}))
    node.serve()
    pid = node.status()["vllm_pid"]
    assert wait_for(lambda: (tmp_path / "children").exists())
    (core,) = children(tmp_path)
    time.sleep(1)  # the supervisor has seen it (it looks twice a second)
    os.kill(pid, signal.SIGKILL)  # only it
    assert wait_for(lambda: node.status().get("vllm_pid") not in (None, pid))
    assert not alive(core)
    assert "ending what it left running: pid" in node.log()
    assert node.status()["restarts_total"] == 1
    assert node.status()["last_exit"]["error"] == "killed by SIGKILL"  # not the warning vLLM printed


def test_a_start_waits_until_the_gpu_has_what_vllm_asks_for_and_names_what_holds_it(node, tmp_path):
    (tmp_path / "gpu-free").write_text("10445")  # 10.2 GiB free: an old engine core still holds the rest
    node.start()
    node.serve(timeout=5)
    assert wait_for(lambda: node.state() is VllmState.WAITING_MEMORY)
    status = node.status()
    assert status["vllm_pid"] is None and status["restarts_total"] == 0
    assert "GPU 0 has 10.2 of 140.4 GiB free, vLLM asks for 126.4 (gpuMemoryUtilization 0.9)" in status["gpu_busy"]
    assert "held by nothing in this container" in status["gpu_busy"]
    (tmp_path / "gpu-free").write_text("143000")  # freed
    assert wait_for(lambda: node.status().get("vllm_pid") is not None)
    assert "GPU memory is free again after" in node.log()


def test_a_gpu_that_stays_busy_is_given_up_on_with_what_holds_it(node, tmp_path):
    (tmp_path / "gpu-free").write_text("10445")
    node.start()
    node.serve(timeout=5)
    assert wait_for(lambda: node.state() is VllmState.FAILED, 20)
    failed = node.status()["failed"]
    assert re.match(
        r"the GPU stayed busy for [67] s \(recovery.gpuWaitSeconds 6\): GPU 0 has 10.2 of 140.4 GiB", failed
    )
    assert "held by nothing in this container" in failed and "vllm.restartGeneration" in failed
    assert node.status()["restarts_total"] == 0  # no crash was counted


def test_a_start_vllm_refuses_for_lack_of_gpu_memory_is_not_a_crash(node, tmp_path):
    """Without nvidia-smi to read (a GB10, the rehearsal), vLLM's own check is what says the GPU is busy."""
    (tmp_path / "bin" / "nvidia-smi").unlink()
    node.start(FAKE_VLLM_GPU_BUSY="1")
    node.serve(timeout=5, health_url=None)  # (the fixture's /health would answer for a vLLM that never serves)
    assert wait_for(lambda: node.state() is VllmState.FAILED, 30)
    status = node.status()
    assert status["failed"].startswith("the GPU stayed busy for")
    assert "on startup is less than desired GPU memory utilization" in status["failed"]
    assert len(status.get("last_exit") or {}) and status["restarts_in_window"] == 0  # max_restarts 3 untouched
    assert "not counted as a crash" in node.log()


def test_the_api_key_is_taken_out_of_vllms_compile_cache_metadata(node, tmp_path):
    """vLLM 0.25 writes the raw values of its environment, VLLM_API_KEY among them, into
    cache_key_factors.json beside its compiled graphs; the supervisor puts a mark in their place."""
    cache = tmp_path / "vllm-cache"
    node.start(VLLM_CACHE_ROOT=str(cache), FAKE_VLLM_FACTORS="1")
    # the supervisor's first rounds (and a scan, with no vLLM yet) before the settings come: a vLLM started
    # then is scanned within seconds all the same, not at the idle cadence (seen in CI, under load)
    assert wait_for(lambda: node.status().get("state"), 10)
    time.sleep(1)
    node.serve()
    factors = cache / "torch_compile_cache" / "3f8484553b" / "rank_0_0" / "backbone" / "cache_key_factors.json"
    assert wait_for(lambda: factors.exists() and "redacted" in factors.read_text(), 10), factors.read_text()
    assert "secret-key" not in factors.read_text()
    assert json.loads(factors.read_text())["env"] == {"VLLM_API_KEY": "<redacted by spark-vllm>", "VLLM_PP": None}
    # the supervisor says so once the file is written: the test may read the file in between
    assert wait_for(lambda: "took the secrets out of vLLM's compile cache metadata" in node.log(), 5)


def test_a_factors_file_read_before_vllm_wrote_it_is_redacted_once_written(tmp_path):
    """vLLM creates cache_key_factors.json, then writes it: a scan between the two must not mark the file
    as looked at when the write keeps its mtime (the kernel's timestamps are coarse)."""
    from components.scripts.node_compile_cache import redact_compile_factors

    env = {"VLLM_CACHE_ROOT": str(tmp_path / "cache"), "VLLM_API_KEY": "sk-secret-key-0123"}
    folder = tmp_path / "cache" / "torch_compile_cache" / "0123456789" / "rank_0_0" / "backbone"
    folder.mkdir(parents=True)
    factors = folder / "cache_key_factors.json"
    factors.write_text("")
    seen: dict = {}
    assert redact_compile_factors(env, seen) == []  # empty: nothing to take out yet
    created = factors.stat().st_mtime_ns
    factors.write_text(json.dumps({"env": {"VLLM_API_KEY": "sk-secret-key-0123"}}))
    os.utime(factors, ns=(created, created))  # written within the same tick
    assert redact_compile_factors(env, seen) == [str(factors)]
    assert json.loads(factors.read_text()) == {"env": {"VLLM_API_KEY": "<redacted by spark-vllm>"}}
    assert redact_compile_factors(env, seen) == []  # looked at: not read again


def test_the_contract_renders_what_the_container_and_the_supervisor_read():
    """components/scripts/node_contract.py is both sides' one definition: what the program writes parses back."""
    from components.config import load_cluster_config
    from components.plan.container import supervisor_params, supervisor_spec
    from components.scripts.node_contract import SupervisorParams, VllmSpec
    from tests.unit.test_config import config

    cfg = load_cluster_config(config(network__guard=True))
    params = supervisor_params(cfg, cfg.nodes[0])
    assert SupervisorParams.from_json(params).guard_marker == params["guard_marker"]
    assert "guard_marker" not in supervisor_params(load_cluster_config(config()), cfg.nodes[0])  # no container change
    spec = VllmSpec.from_json(
        {**supervisor_spec(cfg, cfg.nodes[0]).to_json(), "argv": ["vllm"], "env": {}, "fingerprint": "f"}
    )
    assert spec.recovery.max_restarts == cfg.recovery.max_restarts and spec.ray_ready.gpus == cfg.world_size


def meminfo(path, available_gib, total_gib=119.2):
    """A /proc/meminfo, replaced whole as the kernel's reads are (never seen half written: the supervisor
    takes an unreadable one as nothing to check, seen in CI when this wrote in place)."""
    text = f"MemTotal:       {int(total_gib * 2**20)} kB\nMemFree:  1 kB\nMemAvailable:   {int(available_gib * 2**20)} kB\n"
    path.with_suffix(".tmp").write_text(text)
    os.replace(path.with_suffix(".tmp"), path)


def test_on_unified_memory_a_start_waits_for_memavailable_and_gives_up_saying_why(node, tmp_path):
    """A GB10 after crashed vLLMs kept memory: the supervisor does not start another on top (eugr #257)."""
    meminfo(tmp_path / "meminfo", available_gib=20)
    node.start(FAKE_UNIFIED="1", SPARK_VLLM_MEMINFO=str(tmp_path / "meminfo"))
    node.serve(timeout=5, health_url=None)
    assert wait_for(lambda: node.state() is VllmState.FAILED, 30)
    status = node.status()
    assert status["failed"].startswith("the GPU stayed busy for")
    assert "unified memory: 20.0 of 119.2 GiB available (MemAvailable), vLLM asks for 107.3" in status["failed"]
    assert "reboot the node, then bump vllm.restartGeneration" in status["failed"]
    assert "vLLM started" not in node.log()  # never started on top of the missing memory


def test_on_unified_memory_a_start_goes_ahead_once_the_memory_is_back(node, tmp_path):
    meminfo(tmp_path / "meminfo", available_gib=20)
    node.start(FAKE_UNIFIED="1", SPARK_VLLM_MEMINFO=str(tmp_path / "meminfo"))
    node.serve(timeout=3, health_url=None)
    assert wait_for(lambda: node.state() is VllmState.WAITING_MEMORY, 10)
    meminfo(tmp_path / "meminfo", available_gib=115)
    assert wait_for(lambda: node.status().get("vllm_pid"), 15)
    assert "unified memory is free again after" in node.log()


def test_the_oom_guard_ends_vllm_first_and_the_restart_waits_for_the_memory(node, tmp_path):
    meminfo(tmp_path / "meminfo", available_gib=115)
    node.start(FAKE_UNIFIED="1", SPARK_VLLM_MEMINFO=str(tmp_path / "meminfo"))
    node.serve(timeout=10, oom_guard_mib=8 * 1024)
    first = node.status()["vllm_pid"]
    assert wait_for(lambda: alive(first), 5)
    meminfo(tmp_path / "meminfo", available_gib=3)  # under memory.osReserveGib 8: the kernel would pick soon
    assert wait_for(lambda: not alive(first), 15)
    assert "memory.oomGuard: MemAvailable 3.0 GiB is under the OS's reserve (8.0 GiB" in node.log()
    assert wait_for(lambda: node.status().get("oom_guarded") == 1, 5)
    assert wait_for(lambda: node.state() is VllmState.WAITING_MEMORY, 15)  # not on top of it
    meminfo(tmp_path / "meminfo", available_gib=115)
    assert wait_for(lambda: node.status().get("vllm_pid") not in (None, first), 20)
    status = node.status()
    assert status["restarts_total"] == 1 and status["restarts_in_window"] == 1  # counted as a restart


@pytest.mark.parametrize(
    "status, expected",
    [
        (
            {"state": "running", "serving": True, "restarts_total": 0, "restarts_in_window": 0},
            "vLLM: running, serving: yes, restarts: 0 (0 in the window), last exit: - ",
        ),
        (
            {
                "state": "waiting for GPU memory",
                "restarts_total": 1,
                "restarts_in_window": 1,
                "last_exit": {"code": -9},
                "gpu_busy": "unified memory: 4.0 of 128.0 GiB available (MemAvailable)",
            },
            "vLLM: waiting for GPU memory, serving: no, restarts: 1 (1 in the window), last exit: -9 ; waiting: "
            "unified memory: 4.0 of 128.0 GiB available (MemAvailable)",
        ),
        (
            {
                "state": "failed",
                "restarts_total": 2,
                "restarts_in_window": 0,
                "failed": "the GPU stayed busy",
                "gpu_busy": "unified memory: 4.0 of 128.0 GiB",
            },
            "vLLM: failed, serving: no, restarts: 2 (0 in the window), last exit: - ; GAVE UP: the GPU stayed busy",
        ),
        (
            {
                "state": "waiting for the GPU turn",
                "restarts_total": 0,
                "restarts_in_window": 0,
                "turn": "waiting: held by coder (node spark-03) since 2026-12-03T10:00:00Z, starting vLLM",
            },
            "vLLM: waiting for the GPU turn, serving: no, restarts: 0 (0 in the window), last exit: - ; GPU turn: "
            "waiting: held by coder (node spark-03) since 2026-12-03T10:00:00Z, starting vLLM",
        ),
        (
            {
                "state": "running",
                "serving": True,
                "restarts_total": 1,
                "restarts_in_window": 1,
                "last_exit": {"code": 0, "error": "stalled: 1 request(s) running or waiting"},
                "last_fault": {"kind": "stalled", "at": "2026-12-05T13:15:14Z", "detail": "1 request(s) running"},
            },
            "vLLM: running, serving: yes, restarts: 1 (1 in the window), last exit: 0 stalled: 1 request(s) running or "
            "waiting\nlast ended while /health answered: stalled at 2026-12-05T13:15:14Z: 1 request(s) running",
        ),
    ],
)
def test_the_status_line_says_what_a_supervisor_waits_for_or_why_it_gave_up(tmp_path, status, expected):
    from components.resources.serve import STATUS_SUMMARY

    path = tmp_path / "status.json"
    path.write_text(json.dumps(status))
    result = subprocess.run(
        [sys.executable, "-c", STATUS_SUMMARY.format(path=str(path))], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == expected.strip()
