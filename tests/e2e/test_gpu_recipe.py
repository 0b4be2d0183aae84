"""Every call of the GPU lane's recipe (tests/gpu/recipe.py) with the stand-in vLLM: the same runs with the same
arguments the GPU machine gets, and only this machine's own added (directories, the fabric on loopback, the
stand-in's GPU and pace). Each call's runs go through `recipe.call`, as `tests/gpu/device.sh call NAME` makes them
there, packed; the checks read what comes back. The lane broke three times in code no test ran (the router phase,
the same shape twice, the edge's harness importing the rehearsal); now every path of it runs here first.

Also here, as processes: `--kills 2` (two recoveries, a timeline each) and device.sh itself (its parts, its
install, its call). Minutes of processes, not simulated nodes: in the full run, beside the rehearsal.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from tests.gpu import pack, recipe
from tests.gpu.pack import split
from tests.waiting import free_ports

ROOT = Path(__file__).resolve().parents[2]
STANDIN = ROOT / "tests" / "e2e" / "standin"
# The node's fabric address on loopback, but not 127.0.0.1: Ray takes that (and "localhost") for "this machine" and
# registers the node under the address of its first interface instead (ray._common.network_utils.is_localhost), so
# the cluster wait would never see the node it expects.
FABRIC = "127.0.0.2:lo"
NO_APT = "#!/bin/sh\necho 'apt-get: the GPU machine has no apt sources' >&2\nexit 100\n"
GPU_MIB = 79.6 * 1024  # the stand-in plays an 80 GiB GPU (an H100's): the plan is not this machine's memory


def standin_env(tmp_path: Path) -> dict[str, str]:
    """`vllm` on PATH is the stand-in, as the rehearsal image installs it; and, as on the GPU machine, no apt
    sources and none of the rehearsal's cache: what the lane runs besides Python (the edge's haproxy) is what
    tests/gpu/pack.py carries, where device.sh points the lane (SPARK_VLLM_HAPROXY_ROOT). The router phase
    fetched haproxy with `apt-get download` there on 2026-12-06 and failed: nothing here had shown it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "vllm").write_text(f'#!/bin/sh\nPYTHONPATH={STANDIN} exec {sys.executable} -m vllm_standin "$@"\n')
    (bin_dir / "vllm").chmod(0o755)
    (bin_dir / "apt-get").write_text(NO_APT)
    (bin_dir / "apt-get").chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}",
            "SPARK_VLLM_REHEARSAL_CACHE": str(tmp_path / "no-rehearsal-cache"),
            "SPARK_VLLM_HAPROXY_ROOT": str(pack.edge_tree())}  # fmt: skip


def machine_args(tmp_path: Path) -> dict[str, list[str]]:
    """What this machine adds to each run: nothing the recipe sets, only where things are here."""
    lane_args = [
        "--models", str(tmp_path / "models"), "--run-dir", str(tmp_path / "run"), "--fabric", FABRIC,
        "--env", f"STANDIN_GPU_DIR={tmp_path / 'gpus'}", "--env", "STANDIN_LOAD_SECONDS=1",
        "--env", "STANDIN_DEAD_LINGER_S=0.2", "--env", f"VLLM_CACHE_ROOT={tmp_path / 'vllm-cache'}",
        "--env", f"PYTHONPATH={STANDIN}",  # the stand-in importable in the node, Ray's workers too (the image's site)
        "--port-base", str(free_ports(7, consecutive=True)[0]),  # lanes beside it: ports of their own
        "--gpu-memory-mib", str(GPU_MIB), "--ready-timeout", "120",
    ]  # fmt: skip
    return {"lane": lane_args, "nccl": ["--fabric", FABRIC]}


def unpacked(out: Path, run: str) -> tuple[dict, Path]:
    """A run's report (RUN.json) and its packed folder, opened."""
    with tarfile.open(out / f"{run}.tar.gz") as tar:
        tar.extractall(out / "unpacked", filter="data")
    return json.loads((out / f"{run}.json").read_text()), out / "unpacked" / run


def made(tmp_path: Path, name: str, capsys) -> tuple[int, Path, str]:
    out = tmp_path / "out"
    extra = machine_args(tmp_path)
    gpus = recipe.find(name).gpus
    extra["lane"] += ["--env", f"STANDIN_LOCAL_GPUS={gpus}"]  # a machine of as many GPUs as the call asks
    code = recipe.call(name, out, extra=extra, environ=standin_env(tmp_path))
    return code, out, capsys.readouterr().out


def steps_ok(report: dict, *names: str) -> None:
    for name in names:
        assert report["steps"][name]["ok"], (name, report["steps"].get(name))


def the_machine_is_named(report: dict) -> None:
    machine = report["machine"]
    assert {"gpus", "driver", "kernel", "python", "torch", "vllm", "ray", "vllm-router"} <= set(machine)
    assert machine["ray"] == "2.60.0" and machine["vllm-router"] == "0.1.17"  # requirements-dev, as the GPU's


def test_the_mp_call_runs_every_phase_of_one_start(tmp_path, capsys):
    code, out, said = made(tmp_path, "mp", capsys)
    assert code == 0, said[-4000:]
    report, folder = unpacked(out, "mp")
    the_machine_is_named(report)
    assert report["phases"] == ["answers", "router", "bench", "metrics", "stall"]
    steps_ok(report, "handover", "ready", "smoke", "answers", "router_ready", "router_workers", "router_smoke",
             "router_drain", "router_undrain", "benchmark_spark-vllm", "benchmark_vllm")  # fmt: skip
    assert report["api_key_enforced"] is True
    # the validation's greedy answers, twice and agreeing
    assert report["answers"]["answers"] and report["answers_repeat_agreement"]["agreed"] == 5
    # the router behind the edge: the key checked, drained and back, the hop measured
    router = report["router"]
    assert (router["without_key"], router["wrong_key"], router["with_key"]) == (401, 401, 200)
    assert router["while_drained"][0] == 503 and router["after_undrain"] == 200
    assert router["hop_ms_p50"] is not None and router["models"][0] == 200
    # the benchmark with both tools (the stand-in's `vllm bench serve`, as vLLM's image has it), /metrics kept
    for tool, name in (("spark-vllm", "spark-vllm"), ("vllm", "vllm bench serve")):
        figures = report["benchmark"][tool]
        assert figures["tool"] == name and figures["errors"] == 0 and figures["outputTokensPerSecond"] > 0, figures
    assert "vllm:num_requests_running" in (folder / "metrics.txt").read_text()
    # the engine core SIGSTOPped mid-stream: /health 200 and nothing moving, found after stallSeconds, served again
    stall = report["stall"]
    assert stall["target"] == "engine" and stall["health_while_stopped"] == 200
    assert stall["chunks_while_stopped"] == 0 and stall["stream_finished"] is False
    assert 30 <= stall["found_seconds"] < 45 and stall["serving_again_seconds"] is not None
    assert stall["last_fault"]["kind"] == "stalled" and stall["last_exit"]["error"].startswith("stalled: ")
    assert stall["restarts_total"] == 1 and stall["canary"]["answer"]["tokenIds"]
    # what came back is whole: the whole vLLM log, each step's output, the console
    assert "vLLM stalled" in (folder / "vllm.log").read_text()
    assert {"console.log", "ready.out", "router_smoke.out", "router-keeper.log"} <= {p.name for p in folder.iterdir()}
    assert report["stop"]["exit_code"] == 0 and report["stop"]["processes_left"] == []
    assert "recipe: mp/mp: exit 0" in said


def test_the_ray_call_stalls_a_ray_worker_and_recovers_from_a_sigkill(tmp_path, capsys):
    code, out, said = made(tmp_path, "ray", capsys)
    assert code == 0, said[-4000:]
    report, folder = unpacked(out, "ray")
    the_machine_is_named(report)
    steps_ok(report, "cluster_ready", "handover", "ready", "smoke", "recovery")
    assert set(report["import_seconds"]) == {"torch", "vllm.entrypoints.cli.main"}  # timed (failing here: no torch)
    ray = report["ray_processes"]  # real Ray: vLLM's driver connected, and Ray started no idle worker for it
    assert ray["cpus"] == os.cpu_count() and ray["by_name"] and "ray::IDLE" not in ray["by_name"], ray
    stall = report["stall"]
    assert stall["target"] == "worker" and stall["stopped"]  # the actor's process (gone once vLLM was ended)
    assert stall["found_seconds"] is not None and 30 <= stall["found_seconds"] < 45
    assert stall["health_while_stopped"] == 200 and stall["chunks_while_stopped"] == 0
    assert stall["serving_again_seconds"] is not None and stall["last_fault"]["kind"] == "stalled"
    after = report["after_kill"]
    assert after["serving_again_seconds"] is not None and after["restarts_total"] == 2  # the stall's, the kill's
    said_lines = [event["what"] for event in after["timeline"]]
    assert any(what.startswith("supervisor: vLLM started") for what in said_lines)
    assert report["stop"]["exit_code"] == 0 and report["stop"]["processes_left"] == []


def test_the_cotenants_call_runs_one_shape_twice_and_the_nccl_test(tmp_path, capsys):
    """Two deployments of one shape, named apart, each served under its own name: in turn on the node's GPU turn,
    each KV cache as its plan pinned, one SIGKILLed while the other answers. The NCCL test here has no torch: its
    run fails as an image without torch does, named by the judge, and the call says so."""
    code, out, said = made(tmp_path, "cotenants", capsys)
    assert code == 1 and "recipe: cotenants: failed: nccl" in said, said[-4000:]
    report, folder = unpacked(out, "cotenants")
    the_machine_is_named(report)
    assert sorted(report["replicas"]) == ["qwen3-8b", "qwen3-8b-2"]
    for entry in report["replicas"].values():
        assert entry["ready"] == 0 and entry["smoke"] == 0 and entry["vllm_starts"] == 1
        pinned = entry["plan"]["kvCache"]["pinnedBytes"]
        assert f"--kv-cache-memory-bytes={pinned}" in entry["argv"]
        assert entry["kv_gib"] == pytest.approx(pinned / 1024**3, abs=0.01)  # vLLM's (the stand-in's) own line
    turns = [line for entry in report["replicas"].values() for line in entry["turn"]]
    assert sum("took the node's GPU turn after waiting" in line for line in turns) == 1  # one waited for the other
    assert sum("gave the node's GPU turn back: vLLM serves" in line for line in turns) == 2
    kill = report["kill"]
    assert kill["serving_again_seconds"] is not None and kill["kv_gib_after"] == kill["kv_gib_before"]
    assert kill["others_health"]["qwen3-8b-2"]["failed"] == 0 and kill["others_health"]["qwen3-8b-2"]["ok"] > 0
    nccl, _ = unpacked(out, "nccl")
    the_machine_is_named(nccl)
    for case in ("two nodes", "two ranks of one host"):
        assert all("the image has no torch" in problem for problem in nccl["cases"][case]["problems"])


def test_the_tp2_call_serves_tensor_parallel_over_two_gpus_of_its_node(tmp_path, capsys):
    code, out, said = made(tmp_path, "tp2", capsys)
    assert "recipe: tp2/tp2: exit 0" in said, said[-4000:]
    report, folder = unpacked(out, "tp2")
    assert report["tensor_parallel_size"] == 2 and (out / "tp2.json").exists()
    steps_ok(report, "handover", "ready", "smoke", "benchmark_spark-vllm", "benchmark_vllm", "recovery")
    assert "--tensor-parallel-size=2" in (folder / "vllm.log").read_text()
    assert sorted(p.name for p in (tmp_path / "gpus").iterdir()) == ["gpu0", "gpu1"]  # a rank a GPU


def test_two_sigkills_in_one_run_each_recover_with_a_timeline(tmp_path):
    """`--kills 2` (recovery timings twice in one start, as docs/measurements.md's recovery table was measured):
    the engine core outlives its API server and is ended by the supervisor before each new start."""
    out = tmp_path / "out"
    extra = machine_args(tmp_path)["lane"]
    result = subprocess.run([sys.executable, "-m", "tests.gpu.lane", "--executor", "mp", "--kills", "2", "--out",
                             str(out), *extra], cwd=ROOT, env=standin_env(tmp_path), capture_output=True, text=True,
                            timeout=400)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((out / "lane-mp-qwen3-8b.json").read_text())
    assert list(report["steps"]) == ["handover", "ready", "smoke", "recovery", "recovery_2"]
    steps_ok(report, *report["steps"])
    after = report["after_kill"]
    assert after["serving_again_seconds"] is not None and after["restarts_total"] == 1
    assert any("VLLM::EngineCor" in line for line in after["group_before"])
    assert any("ending what it left running" in line for line in after["supervisor_said"])
    said = [event["what"] for event in after["timeline"]]
    gone = next(i for i, what in enumerate(said) if what.startswith("supervisor: vLLM's main process is gone"))
    started = next(i for i, what in enumerate(said) if what.startswith("supervisor: vLLM started"))
    assert gone < started < said.index("engine core's first line")
    assert said.index("engine core's first line") < said.index("model loaded") < said.index("API server listening")
    assert report["after_kill_2"]["restarts_total"] == 2 and report["after_kill_2"]["timeline"]
    assert report["kv"]["kv_cache_tokens"] == 32768 * 4  # what the stand-in says, parsed as vLLM's lines
    assert report["memory_plan"]["maxModelLen"] == 32768
    assert report["image_probe"]["vllm"] == "0.25.0" and report["image_probe"]["vllm_nnodes"] is True
    assert report["gpu_turn"].startswith("/tmp/svturn-") and not os.path.exists(report["gpu_turn"])  # gone with it
    reads = report["contract_reads"]
    assert [read["script"] for read in reads][:3] == ["serve_spec.py", "wait_ready.py", "smoke.py"]
    assert all(read["read"] for read in reads), reads


def test_cotenants_of_two_shapes_start_in_turn_and_one_recovers_while_the_other_answers(tmp_path):
    """`--cotenants qwen3-8b:0.3,qwen3-30b-a3b:0.55` (an H200's 140 GiB: both fit; the recipe's call is one shape twice,
    which fits an H100 too): each deployment's plan pinned for its own shape, one waiting for the other's turn."""
    out = tmp_path / "out"
    extra = machine_args(tmp_path)["lane"]
    extra[extra.index("--gpu-memory-mib") + 1] = str(139.8 * 1024)
    result = subprocess.run([sys.executable, "-m", "tests.gpu.lane", "--cotenants", "qwen3-8b:0.3,qwen3-30b-a3b:0.55",
                             "--max-model-len", "4096", "--out", str(out), *extra], cwd=ROOT, env=standin_env(tmp_path), capture_output=True,
                            text=True, timeout=400)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((out / "lane-cotenants.json").read_text())
    small, big = report["replicas"]["qwen3-8b"], report["replicas"]["qwen3-30b-a3b"]
    assert small["plan"]["kvCache"]["pinnedBytes"] != big["plan"]["kvCache"]["pinnedBytes"]
    for entry in (small, big):
        assert entry["ready"] == 0 and entry["smoke"] == 0 and entry["vllm_starts"] == 1
        assert entry["kv_gib"] == pytest.approx(entry["plan"]["kvCache"]["pinnedBytes"] / 1024**3, abs=0.01)
    turns = small["turn"] + big["turn"]
    assert sum("took the node's GPU turn after waiting" in line for line in turns) == 1
    kill = report["kill"]
    assert kill["others_health"]["qwen3-30b-a3b"]["failed"] == 0 and kill["others_health"]["qwen3-30b-a3b"]["ok"] > 0
    assert "lane cotenants (pinned)" in result.stdout
    assert report["gpu_turn"].startswith("/tmp/svturn-") and not os.path.exists(report["gpu_turn"])  # gone with it


def test_device_sh_takes_its_parts_installs_once_and_makes_a_call(tmp_path):
    """tests/gpu/device.sh as the GPU machine runs it: `receive` keeps a part, `call` takes the last, checks the
    sha256, installs the wheels once, and makes the recipe's call with the machine's own arguments passed on."""
    wheels = tmp_path / "pack" / "wheels"
    wheels.mkdir(parents=True)
    with zipfile.ZipFile(wheels / "lane_probe-1.0-py3-none-any.whl", "w") as wheel:  # a wheel as pip reads one
        files = {"lane_probe/__init__.py": "MARK = 'installed'\n",
                 "lane_probe-1.0.dist-info/METADATA": "Metadata-Version: 2.1\nName: lane-probe\nVersion: 1.0\n",
                 "lane_probe-1.0.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                                   "Tag: py3-none-any\n"}  # fmt: skip
        for name, text in files.items():
            wheel.writestr(name, text)
        wheel.writestr("lane_probe-1.0.dist-info/RECORD", "".join(f"{name},,\n" for name in files) +
                       "lane_probe-1.0.dist-info/RECORD,,\n")  # fmt: skip
    haproxy = tmp_path / "pack" / "haproxy" / "usr" / "sbin" / "haproxy"  # the edge's, as pack.py adds it
    haproxy.parent.mkdir(parents=True)
    haproxy.write_text("#!/bin/sh\necho haproxy\n")
    haproxy.chmod(0o755)
    archive = tmp_path / "wheels.tar"
    with tarfile.open(archive, "w") as tar:
        tar.add(wheels, arcname="wheels")
        tar.add(tmp_path / "pack" / "haproxy", arcname="haproxy")
    work = tmp_path / "tree"  # the copy of the repository the device tool runs in
    parts = work / ".gpu" / "parts"
    split(archive, parts, part_bytes=max(1, archive.stat().st_size // 2 + 1))
    (parts / "SHA256").write_text(f"{hashlib.sha256(archive.read_bytes()).hexdigest()}  wheels.tar\n")
    (work / "tests").symlink_to(ROOT / "tests")
    (work / "components").symlink_to(ROOT / "components")
    env = {**standin_env(tmp_path), "SPARK_VLLM_LANE_DIR": str(tmp_path / "lane"), "SPARK_VLLM_LANE_COMPILE": "site"}
    first = subprocess.run(["bash", "tests/gpu/device.sh", "receive", "0"], cwd=work, env=env, capture_output=True,
                           text=True, timeout=60)  # fmt: skip
    assert first.returncode == 0 and "1 part(s) here" in first.stdout, first.stdout + first.stderr
    extra = " ".join(machine_args(tmp_path)["lane"])
    result = subprocess.run(["bash", "tests/gpu/device.sh", "call", "cotenants", "--out", str(tmp_path / "out"),
                             "--with", f"lane={extra}", "--with", f"nccl=--fabric {FABRIC}"], cwd=work, env=env,
                            capture_output=True, text=True, timeout=500)  # fmt: skip
    said = result.stdout + result.stderr
    assert "device: installed 1 wheels" in said and "recipe: cotenants/cotenants: exit 0" in said, said[-4000:]
    assert f"device: the edge's haproxy from {tmp_path / 'lane' / 'haproxy'}" in said, said[-4000:]
    assert (tmp_path / "lane" / "site" / "lane_probe" / "__init__.py").exists()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["cotenants.json", "cotenants.tar.gz",
                                                                    "nccl.json", "nccl.tar.gz"]  # fmt: skip
