"""The remote scripts run for real here (python3, local processes, a local HTTP server on 127.0.0.1)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from components.render import script_program
from tests.fake_vllm_http import FakeVllm

PYTHON = sys.executable


def run_script(name: str, params: dict, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PYTHON, "-"], input=script_program(name, params), capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture
def vllm_process(tmp_path):
    """A long-running process standing in for `vllm serve`, with its pid file and log."""
    log = tmp_path / "vllm.log"
    log.write_text("INFO starting\n")
    process = subprocess.Popen([PYTHON, "-c", "import time; time.sleep(600)"], start_new_session=True)
    pid_file = tmp_path / "vllm.pid"
    pid_file.write_text(str(process.pid))
    yield process, pid_file, log
    process.kill()
    process.wait()


def ready_params(server, pid_file, log, **overrides):
    params = {
        "base_url": server.base_url,
        "model": "m",
        "api_key": None,
        "timeout_seconds": 20,
        "poll_seconds": 0.2,
        "progress_seconds": 30,
        "log_file": str(log),
        "pid_file": str(pid_file),
    }
    params.update(overrides)
    return params


def test_wait_ready_returns_once_health_and_models_answer(vllm_process):
    _, pid_file, log = vllm_process
    with FakeVllm(ready_after=1.5) as server:
        result = run_script("wait_ready.py", ready_params(server, pid_file, log))
    assert result.returncode == 0, result.stdout
    assert "vLLM ready after" in result.stdout and "serves m" in result.stdout
    assert server.requests.count("/health") > 1  # it kept polling while the server was loading
    assert server.requests[-1] == "/v1/models"
    assert "ready_seconds" in json.loads(result.stdout.strip().splitlines()[-1])


def test_wait_ready_prints_progress_with_the_last_log_line(vllm_process):
    _, pid_file, log = vllm_process
    log.write_text("INFO Loading safetensors checkpoint shards: 40% Completed\n")
    with FakeVllm(ready_after=2.5) as server:
        result = run_script("wait_ready.py", ready_params(server, pid_file, log, progress_seconds=1))
    assert result.returncode == 0
    progress = [line for line in result.stdout.splitlines() if line.startswith("waiting for vLLM:")]
    assert progress and "Loading safetensors checkpoint shards: 40% Completed" in progress[0]


def test_wait_ready_times_out_on_503_with_the_log_tail_and_a_hint(vllm_process):
    _, pid_file, log = vllm_process
    log.write_text(
        "".join(f"line {i}\n" for i in range(150)) + "NCCL INFO Channel 00 : 0[0] -> 1[0] via NET/Socket/0\n"
    )
    with FakeVllm(health=503) as server:
        result = run_script("wait_ready.py", ready_params(server, pid_file, log, timeout_seconds=2))
    assert result.returncode == 1
    assert "not ready after 2 s (last /health: 503)" in result.stdout
    assert (
        "--- last 100 lines of" in result.stdout and "line 51\n" in result.stdout and "line 50\n" not in result.stdout
    )
    assert "hint: NCCL fell back to TCP sockets" in result.stdout


def test_wait_ready_notices_a_dead_server_at_once(vllm_process):
    process, pid_file, log = vllm_process
    log.write_text("ERROR No available node types can fulfill resource request {'GPU': 1.0}\n")
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    with FakeVllm(ready_after=600) as server:
        started = time.monotonic()
        result = run_script("wait_ready.py", ready_params(server, pid_file, log, timeout_seconds=60))
    assert result.returncode == 1 and time.monotonic() - started < 30
    assert "the vllm serve process exited" in result.stdout
    assert "hint: Ray and vLLM disagree on addresses: VLLM_HOST_IP" in result.stdout


def test_wait_ready_sends_the_api_key_and_reports_a_refusal(vllm_process):
    _, pid_file, log = vllm_process
    with FakeVllm(api_key="k1") as server:
        ok = run_script("wait_ready.py", ready_params(server, pid_file, log, api_key="k1"))
        refused = run_script("wait_ready.py", ready_params(server, pid_file, log, api_key="other"))
    assert ok.returncode == 0
    assert refused.returncode == 1 and "refused the API key (HTTP 401)" in refused.stdout
    assert "k1" not in ok.stdout + ok.stderr + refused.stdout + refused.stderr


def test_wait_ready_fails_when_another_model_is_served(vllm_process):
    _, pid_file, log = vllm_process
    with FakeVllm(model="other") as server:
        result = run_script("wait_ready.py", ready_params(server, pid_file, log))
    assert result.returncode == 1 and "/v1/models lists ['other'], not 'm'" in result.stdout


def test_smoke_reports_latency_and_tokens():
    with FakeVllm(api_key="k") as server:
        params = {"base_url": server.base_url, "model": "m", "api_key": "k", "prompt": "hi", "max_tokens": 4,
                  "timeout_seconds": 10}  # fmt: skip
        result = run_script("smoke.py", params)
        wrong = run_script("smoke.py", {**params, "model": "nope"})
    assert result.returncode == 0
    summary = json.loads(result.stdout.strip())
    assert summary["completion_tokens"] == 1 and summary["prompt_tokens"] == 7 and summary["latency_seconds"] >= 0
    assert wrong.returncode == 1 and "HTTP 404" in wrong.stdout


# --- starting and stopping vLLM ----------------------------------------------------------------

FAKE_VLLM = """
import os, signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open(os.environ["CHILD_PID_FILE"], "w").write(str(child.pid))
print("fake vllm", sys.argv[1:], "key set" if os.environ.get("VLLM_API_KEY") else "no key", flush=True)
signal.signal(signal.SIGTERM, lambda *a: (print("Shutting down", flush=True), sys.exit(0)))
time.sleep(600)
"""


@pytest.fixture
def serve_params(tmp_path):
    # Started as a console script is (`vllm serve …` runs as `python3 /usr/local/bin/vllm serve …`),
    # so the process's argv[0] is not the word started.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    program = bin_dir / "vllm"
    program.write_text(f"#!{PYTHON}\n{FAKE_VLLM}")
    program.chmod(0o755)
    os.environ["CHILD_PID_FILE"] = str(tmp_path / "child.pid")
    params = {
        "argv": ["vllm", "serve", "m", "--max-model-len=4096"],
        "env": {"VLLM_API_KEY": "secret-key", "PATH": f"{bin_dir}:{os.environ['PATH']}"},
        "fingerprint": "f1",
        "log_file": str(tmp_path / "run" / "vllm.log"),
        "pid_file": str(tmp_path / "run" / "vllm.pid"),
        "fingerprint_file": str(tmp_path / "run" / "vllm.fingerprint"),
        "stop_grace_seconds": 5,
        "settle_seconds": 0.5,
    }
    yield params
    stop(params)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return "Z" not in Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][:1]
    except OSError:
        return False


def stop(params) -> subprocess.CompletedProcess:
    from components.render import script

    return subprocess.run(
        [PYTHON, "-", params["pid_file"], str(params["stop_grace_seconds"])],
        input=script("serve_stop.py"),
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_serve_start_is_idempotent_and_restarts_on_change(serve_params):
    first = run_script("serve_start.py", serve_params)
    assert first.returncode == 0, first.stdout + first.stderr
    pid = int(Path(serve_params["pid_file"]).read_text())
    assert alive(pid)
    log = Path(serve_params["log_file"]).read_text()
    assert "key set" in log and "secret-key" not in log and "secret-key" not in first.stdout

    again = run_script("serve_start.py", serve_params)
    assert "already running with these settings" in again.stdout
    assert int(Path(serve_params["pid_file"]).read_text()) == pid

    changed = {**serve_params, "argv": [*serve_params["argv"][:-1], "--max-model-len=2048"], "fingerprint": "f2"}
    restarted = run_script("serve_start.py", changed)
    assert "settings changed: stopping pid" in restarted.stdout
    new_pid = int(Path(serve_params["pid_file"]).read_text())
    assert new_pid != pid and alive(new_pid)
    time.sleep(0.5)
    assert not alive(pid)


def test_serve_start_starts_again_after_a_crash(serve_params):
    run_script("serve_start.py", serve_params)
    pid = int(Path(serve_params["pid_file"]).read_text())
    os.killpg(pid, signal.SIGKILL)
    time.sleep(0.3)
    result = run_script("serve_start.py", serve_params)
    assert result.returncode == 0 and "vLLM started" in result.stdout
    assert int(Path(serve_params["pid_file"]).read_text()) != pid


def test_serve_start_reports_an_immediate_exit_with_the_log(serve_params):
    broken = {
        **serve_params,
        "argv": [PYTHON, "-c", "print('error: unrecognized arguments: --bogus'); raise SystemExit(2)"],
    }
    result = run_script("serve_start.py", broken)
    assert result.returncode == 1
    assert "exited at once with code 2" in result.stdout and "unrecognized arguments: --bogus" in result.stdout


def test_serve_stop_is_graceful_takes_the_whole_group_and_is_safe_twice(serve_params):
    run_script("serve_start.py", serve_params)
    pid = int(Path(serve_params["pid_file"]).read_text())
    time.sleep(0.5)
    child = int(Path(os.environ["CHILD_PID_FILE"]).read_text())
    result = stop(serve_params)
    assert result.returncode == 0 and f"vLLM (pid {pid}) stopped" in result.stdout
    assert "Shutting down" in Path(serve_params["log_file"]).read_text()  # SIGTERM first
    time.sleep(0.3)
    assert not alive(pid) and not alive(child)
    second = stop(serve_params)
    assert second.returncode == 0 and "not running" in second.stdout


def test_serve_stop_kills_a_server_that_ignores_sigterm(serve_params, tmp_path):
    stubborn = tmp_path / "stubborn.py"
    stubborn.write_text("import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(600)\n")
    params = {**serve_params, "argv": [PYTHON, str(stubborn)], "stop_grace_seconds": 1}
    run_script("serve_start.py", params)
    pid = int(Path(params["pid_file"]).read_text())
    result = stop(params)
    assert "ignored SIGTERM for 1 s: killing it" in result.stdout
    time.sleep(0.3)
    assert not alive(pid)
