"""The GPU lane (tests/gpu/lane.py): with the stand-in vLLM here (no GPU), and for real on a GPU machine.

The stand-in run proves the lane's own steps in CI: the supervisor as the container's main process,
the handover, readiness, smoke, a SIGKILL of the API server alone (whose engine core holds the
"GPU") and the recovery, a SIGTERM stop; the same code then runs real vLLM on the GPU machine
(`SPARK_VLLM_GPU_LANE=1`, through tests/gpu/device.sh; the README's "GPU lane" says how).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gpu import lane
from tests.gpu.model import SHAPES

ROOT = Path(__file__).resolve().parents[2]
STANDIN = ROOT / "tests" / "e2e" / "standin"


def standin_bin(tmp_path: Path) -> Path:
    """`vllm` on PATH: the stand-in, as the rehearsal image installs it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "vllm").write_text(f'#!/bin/sh\nPYTHONPATH={STANDIN} exec {sys.executable} -m vllm_standin "$@"\n')
    (bin_dir / "vllm").chmod(0o755)
    return bin_dir


def test_the_lane_runs_what_the_program_renders_and_recovers_from_a_sigkill_with_the_standin(tmp_path):
    models = tmp_path / "models" / "qwen3-8b"
    models.mkdir(parents=True)
    (models / "config.json").write_text(json.dumps(SHAPES["qwen3-8b"][0]))
    bin_dir = standin_bin(tmp_path)
    out = tmp_path / "out"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    result = subprocess.run(
        [sys.executable, "-m", "tests.gpu.lane", "--executor", "mp", "--models", str(tmp_path / "models"),
         "--run-dir", str(tmp_path / "run"), "--out", str(out), "--max-model-len", "4096", "--fabric", "127.0.0.1:lo",
         "--env", f"STANDIN_GPU_DIR={tmp_path / 'gpus'}", "--env", "STANDIN_LOAD_SECONDS=1",
         "--env", "STANDIN_DEAD_LINGER_S=0.2"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((out / "lane-mp-qwen3-8b.json").read_text())
    assert [name for name in report["steps"]] == ["handover", "ready", "smoke", "recovery"]
    assert all(step["ok"] for step in report["steps"].values())
    assert report["api_key_enforced"] is True
    after = report["after_kill"]
    assert after["serving_again_seconds"] is not None and after["restarts_total"] == 1
    # the engine core outlived its API server and was ended by the supervisor before the new start
    assert any("VLLM::EngineCor" in line for line in after["group_before"])
    assert any("ending what it left running" in line for line in after["supervisor_said"])
    assert report["stop"]["exit_code"] == 0 and report["stop"]["processes_left"] == []
    assert report["kv"]["kv_cache_tokens"] == 4096 * 4  # what the stand-in says, parsed as vLLM's lines
    assert report["memory_plan"]["maxModelLen"] == 4096
    assert "lane mp qwen3-8b" in result.stdout
    assert report["image_probe"]["vllm"] == "0.0.0-standin" and report["image_probe"]["vllm_nnodes"] is True


@pytest.mark.skipif(os.environ.get("SPARK_VLLM_GPU_LANE") != "1", reason="the GPU lane is opt-in: "
                    "SPARK_VLLM_GPU_LANE=1 on a GPU machine with vLLM installed (tests/gpu/device.sh run)")  # fmt: skip
@pytest.mark.parametrize("executor", ["ray", "mp"])
def test_real_vllm_on_a_gpu_serves_recovers_from_a_sigkill_and_a_stop_frees_the_gpu(tmp_path, executor):
    if shutil.which("nvidia-smi") is None or shutil.which("vllm") is None:
        pytest.fail("SPARK_VLLM_GPU_LANE=1 but nvidia-smi or vllm is missing")
    assert lane.main(["--executor", executor, "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / f"lane-{executor}-qwen3-8b.json").read_text())
    assert report["after_kill"]["serving_again_seconds"] is not None
    assert max(report["stop"]["gpu_used_mib_after"]) < 1024
