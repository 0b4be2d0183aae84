"""The remote scripts run for real here (python3, local processes, a local HTTP server on 127.0.0.1)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest

from components.plan.programs import script_program
from tests.fake_vllm_http import FakeVllm

PYTHON = sys.executable


def run_script(name: str, params: dict, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PYTHON, "-"], input=script_program(name, params), capture_output=True, text=True, timeout=timeout
    )


def run_script_until(name: str, params: dict, wanted, timeout: float = 30) -> str:
    """Run a script until a line of its output satisfies ``wanted`` (the event the test waits for), then end it;
    returns its output so far. Fails naming the output if the script ends or ``timeout`` passes first."""
    process = subprocess.Popen(
        [PYTHON, "-"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    process.stdin.write(script_program(name, params))
    process.stdin.close()
    lines: list[str] = []
    timer = threading.Timer(timeout, process.kill)
    timer.start()
    try:
        for line in process.stdout:
            lines.append(line)
            if wanted(line):
                return "".join(lines)
        raise AssertionError(f"{name} ended (or ran past {timeout} s) before the line waited for:\n{''.join(lines)}")
    finally:
        timer.cancel()
        process.kill()
        process.wait()
        process.stdout.close()


@pytest.fixture
def vllm_process(tmp_path):
    """vLLM's log and what its supervisor says of it (RUN_DIR/status.json): starting."""
    log = tmp_path / "vllm.log"
    log.write_text("INFO starting\n")
    status = tmp_path / "status.json"
    status.write_text(
        json.dumps({"node": "node-1", "executor": "mp", "state": "starting", "vllm_pid": 1234, "failed": None})
    )
    yield None, status, log


def ready_params(server, status_file, log, **overrides):
    params = {
        "base_url": server.base_url,
        "model": "m",
        "api_key": None,
        "timeout_seconds": 20,
        "poll_seconds": 0.2,
        "progress_seconds": 30,
        "log_file": str(log),
        "status_file": str(status_file),
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


SILENT_STARTS = [
    ("Loading safetensors checkpoint shards:  62% Completed | 5/8\r", "loading the weights (62 % of the shards)"),
    ("Capturing CUDA graphs (mixed prefill-decode, PIECEWISE):  45%|####5  | 23/51\r", "capturing CUDA graphs (45 %)"),
    ("(EngineCore pid=9) INFO 12-02 10:00:00 [monitor.py:34] torch.compile took 32.03 s in total",
     "profiling memory after torch.compile, JIT-compiling kernels"),
    ("(EngineCore pid=9) INFO 12-02 10:00:00 [gpu_model_runner.py:6708] Graph capturing finished in 41 secs",
     "warming up after CUDA graph capture"),
    ("(EngineCore pid=9) INFO 12-02 10:00:00 [gpu_model_runner.py:5210] Starting to load model /models/x...",
     "loading the weights"),
    # vLLM 0.34 has only this line as it starts loading (v1/worker/gpu/model_runner.py:412)
    ("(EngineCore pid=9) INFO 12-06 10:00:00 [model_runner.py:412] Loading model from scratch...",
     "loading the weights"),
]  # fmt: skip


def test_readiness_knows_every_supported_releases_loading_line():
    from components.config.vllm_versions import CHANGES

    for change in CHANGES["loading_lines"]:
        for line in change.value:
            assert any(line in last and step == "loading the weights" for last, step in SILENT_STARTS), line


@pytest.mark.parametrize(("last", "step"), SILENT_STARTS)
def test_wait_ready_says_which_long_step_vllm_is_in_when_its_log_is_silent(vllm_process, last, step):
    _, status, log = vllm_process
    log.write_text("=== spark-vllm: 12-02 09:59:00 starting vllm serve m\nINFO earlier\n" + last + "\n")
    with FakeVllm(health=503) as server:  # never ready: the wait's own clock, not the machine's load, decides
        output = run_script_until(
            "wait_ready.py",
            ready_params(server, status, log, progress_seconds=1, silent_seconds=1.2, timeout_seconds=60),
            lambda line: "its log has been silent for" in line,
        )
    silent = [line for line in output.splitlines() if "its log has been silent for" in line]
    assert silent and f"vLLM is {step}" in silent[-1], output
    assert "a healthy first start waits here" in silent[-1]


def test_wait_ready_names_flashinfers_gdn_jit_after_torch_compile(vllm_process):
    _, status, log = vllm_process
    log.write_text(
        "=== spark-vllm: 12-02 09:59:00 starting vllm serve m\n"
        "(EngineCore pid=9) INFO 12-02 10:00:00 [qwen_gdn_linear_attn.py:229] Using FlashInfer GDN prefill kernel "
        "(requested=auto, head_k_dim=128).\n"
        "(EngineCore pid=9) INFO 12-02 10:01:00 [monitor.py:34] torch.compile took 32.03 s in total\n"
    )
    with FakeVllm(health=503) as server:
        output = run_script_until(
            "wait_ready.py",
            ready_params(server, status, log, progress_seconds=1, silent_seconds=1, timeout_seconds=60),
            lambda line: "its log has been silent for" in line,
        )
    assert "--gdn-prefill-backend triton skips it" in output


def test_wait_ready_shows_the_last_line_while_the_log_moves(vllm_process, tmp_path):
    _, status, log = vllm_process
    log.write_text("=== spark-vllm: 12-02 09:59:00 starting vllm serve m\nStarting to load model m...\n")
    with FakeVllm(ready_after=2.5) as server:
        result = run_script("wait_ready.py", ready_params(server, status, log, progress_seconds=1, silent_seconds=60))
    assert "its log has been silent" not in result.stdout and "log: Starting to load model m..." in result.stdout


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


def test_wait_ready_fails_at_once_when_the_supervisor_gave_up(vllm_process):
    _, status, log = vllm_process
    log.write_text("ERROR No available node types can fulfill resource request {'GPU': 1.0}\n")
    reason = "vLLM exited 6 times within 600 s (recovery.maxRestarts 5): not starting it again."
    status.write_text(
        json.dumps({"node": "node-1", "executor": "mp", "state": "failed", "vllm_pid": None, "failed": reason})
    )
    with FakeVllm(ready_after=600) as server:
        started = time.monotonic()
        result = run_script("wait_ready.py", ready_params(server, status, log, timeout_seconds=60))
    assert result.returncode == 1 and time.monotonic() - started < 30
    assert f"vLLM is not serving: {reason}" in result.stdout
    assert "hint: Ray and vLLM disagree on addresses: VLLM_HOST_IP" in result.stdout


def test_wait_ready_keeps_waiting_while_the_supervisor_restarts_vllm(vllm_process):
    _, status, log = vllm_process
    status.write_text(
        json.dumps({"node": "node-1", "executor": "mp", "state": "backoff", "vllm_pid": None, "failed": None})
    )
    with FakeVllm(ready_after=1.5) as server:
        result = run_script("wait_ready.py", ready_params(server, status, log, progress_seconds=0.5))
    assert result.returncode == 0, result.stdout
    assert "supervisor: backoff" in result.stdout


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
    assert summary["generated_in"] == "content"


# vLLM 0.25 with --reasoning-parser qwen3 and a chat template that opens <think> in the prompt (Qwen3.5):
# 16 tokens are all reasoning, so the message has no content (seen on an H200, 2026-12-01).
ALL_REASONING = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "model": "m",
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": None, "reasoning": "Okay, the user wants me to reply with",
                        "tool_calls": []},
            "finish_reason": "length",
        }
    ],
    "usage": {"prompt_tokens": 18, "completion_tokens": 16, "total_tokens": 34},
}  # fmt: skip


@pytest.mark.parametrize(
    "message, finish, tokens, where",
    [
        ({"content": None, "reasoning": "Okay, the user wants"}, "length", 16, "reasoning"),
        ({"content": None, "reasoning_content": "Okay, the user"}, "length", 16, "reasoning_content"),
        ({"content": "", "reasoning": None}, "length", 16, "tokens"),  # generated, but nothing decodable
    ],
    ids=["vllm-0.25-reasoning", "older-vllm-reasoning-content", "tokens-to-the-limit"],
)
def test_smoke_passes_a_reasoning_model_whose_answer_is_all_reasoning(message, finish, tokens, where):
    answer = json.loads(json.dumps(ALL_REASONING))
    answer["choices"][0]["message"] = {"role": "assistant", **message}
    answer["choices"][0]["finish_reason"] = finish
    answer["usage"]["completion_tokens"] = tokens
    with FakeVllm(answer=answer) as server:
        params = {"base_url": server.base_url, "model": "m", "api_key": None, "prompt": "hi", "max_tokens": 16,
                  "timeout_seconds": 10}  # fmt: skip
        result = run_script("smoke.py", params)
    assert result.returncode == 0, result.stdout
    assert json.loads(result.stdout.strip())["generated_in"] == where


def test_smoke_fails_when_the_server_generated_nothing():
    answer = {"choices": [{"message": {"role": "assistant", "content": ""}, "finish_reason": "stop"}],
              "usage": {"prompt_tokens": 7, "completion_tokens": 0}}  # fmt: skip
    with FakeVllm(answer=answer) as server:
        params = {"base_url": server.base_url, "model": "m", "api_key": None, "prompt": "hi", "max_tokens": 16,
                  "timeout_seconds": 10}  # fmt: skip
        result = run_script("smoke.py", params)
    assert result.returncode == 1 and "the server generated nothing" in result.stdout
