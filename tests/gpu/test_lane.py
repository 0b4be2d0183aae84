"""The GPU lane's parts (tests/gpu/lane.py, nccl.py), and the lane for real on a GPU machine (opt-in:
`SPARK_VLLM_GPU_LANE=1`, through tests/gpu/device.sh; docs/measurements.md's "GPU lane" says how).

Every call of the lane's recipe runs with the stand-in vLLM in CI: tests/e2e/test_gpu_recipe.py (the full run:
minutes of processes). Here what runs in seconds: the restart timeline, caches, keys, the NCCL test's ranks.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import time
from pathlib import Path

import pytest

from tests.gpu import lane


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
    assert report["contract_reads"] and all(read["read"] for read in report["contract_reads"])


def test_the_restart_timeline_places_the_supervisor_and_vllm_s_first_lines_after_the_kill():
    killed = time.mktime((2026, 12, 1, 20, 44, 0, 0, 0, -1)) + 0.4
    log = "\n".join([
        "(APIServer pid=7) INFO 12-01 20:43:59 [api_server.py:616] Starting vLLM server on http://0.0.0.0:8000",
        "=== spark-vllm: 12-01 20:44:00 vLLM's main process is gone; ending what it left running: pid 9",
        "(APIServer pid=7) INFO 12-01 20:44:01 [launcher.py:46] a line of the dead server, flushed late",
        "=== spark-vllm: 12-01 20:44:04 vLLM started (pid 11)",
        "(APIServer pid=11) INFO 12-01 20:44:25 [api_utils.py:339] version 0.25.0",
        "(APIServer pid=11) INFO 12-01 20:44:25 [model.py:619] Resolved architecture: Qwen3ForCausalLM",
        "(EngineCore pid=12) INFO 12-01 20:44:42 [core.py:114] Initializing a V1 LLM engine (v0.25.0)",
        "(EngineCore pid=12) \x1b[36m(RayWorkerProc pid=13)\x1b[0m WARNING 12-01 20:45:11 [worker_base.py:306] x",
        "(EngineCore pid=12) INFO 12-01 20:45:35 [core.py:337] init engine (profile, create kv cache) took 20.16 s",
        "(APIServer pid=11) INFO 12-01 20:45:37 [api_server.py:616] Starting vLLM server on http://0.0.0.0:8000",
    ])  # fmt: skip
    timeline = lane.restart_timeline(log, killed)
    assert [(event["at"], event["what"].split(":")[0]) for event in timeline] == [
        (-0.4, "supervisor"),  # the log's whole seconds: the same second as the kill
        (3.6, "supervisor"),
        (24.6, "api server's first line"),
        (41.6, "engine core's first line"),
        (70.6, "Ray worker's first line"),
        (94.6, "engine initialised"),
        (96.6, "API server listening"),
    ]
    assert timeline[1]["what"] == "supervisor: vLLM started (pid 11)"
    assert lane.restart_timeline(log, killed + 3600) == []


def test_forgetting_caches_keeps_only_the_named_ones_under_dot_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    for path in (".cache/vllm/torch_compile_cache/x", ".cache/flashinfer/jit/y", ".cache/huggingface/hub/z",
                 ".triton/cache/k"):  # fmt: skip
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text("")
    (tmp_path / ".cache" / "stray").write_text("")
    removed = lane.forget_caches(("vllm", "huggingface"))
    assert {Path(p).relative_to(tmp_path).as_posix() for p in removed if p.startswith(str(tmp_path))} == {
        ".triton",
        ".cache/flashinfer",
        ".cache/stray",
    }
    assert (tmp_path / ".cache/vllm/torch_compile_cache/x").exists() and (tmp_path / ".cache/huggingface").exists()


def test_a_stable_key_is_made_once_kept_private_and_reused(tmp_path):
    path = tmp_path / "lane" / "api-key"
    first = lane.stable_api_key(path)
    assert first.startswith("lane-") and len(first) == 21
    assert lane.stable_api_key(path) == first  # the next run's containers: the same key, a compile cache hit
    assert path.stat().st_mode & 0o777 == 0o600


def test_the_nccl_lane_runs_the_rendered_test_per_rank_and_judges_it(tmp_path):
    """tests/gpu/nccl.py here, where torch is missing as in an image without it: each case's ranks run
    the program `<node>-fabric-nccl` feeds `docker run`, in its environment, and the judge names them."""
    from tests.gpu import nccl

    if importlib.util.find_spec("torch") is not None:
        pytest.skip("torch is installed here: the opt-in GPU lane runs this for real")
    assert nccl.main(["--out", str(tmp_path), "--fabric", "127.0.0.1:lo"]) == 1
    report = json.loads((tmp_path / "nccl.json").read_text())
    for case in ("two nodes", "two ranks of one host"):
        two = report["cases"][case]
        assert [facts["rank"] for facts in two["facts"].values()] == [0, 1]
        assert [problem.split(":", 1)[0] for problem in two["problems"]] == [
            "fabric gate gpu-1 (NCCL test)",
            "fabric gate gpu-2 (NCCL test)",
        ]
        assert all("the image has no torch" in problem for problem in two["problems"])
    hosts = {name: env.get("NCCL_HOSTID") for name, env in report["cases"]["two nodes"]["emulated"].items()}
    assert None not in hosts.values() and len(set(hosts.values())) == 2  # a host of its own each, to NCCL
    assert not any(env for env in report["cases"]["two ranks of one host"]["emulated"].values())


def test_the_lane_serves_tensor_parallel_on_that_many_gpus_of_its_one_node():
    from components.config import load_cluster_config
    from components.plan.serving import serve_argv

    raw = lane.stack_config("mp", "/models/m", 4096, 0.9, [], ("10.1.2.3", "eth0"), tensor_parallel=2)
    cfg = load_cluster_config(raw)
    assert cfg.nodes[0].gpus == 2 and "--tensor-parallel-size=2" in serve_argv(cfg, "/models/m")
    report = {"executor": "mp", "model": "qwen3-8b", "tensor_parallel_size": 2}
    assert lane.report_path(report, Path("/o")).name == "lane-mp-qwen3-8b-tp2.json"
    assert lane.report_path({**report, "tensor_parallel_size": 1}, Path("/o")).name == "lane-mp-qwen3-8b.json"


def test_ranks_stand_for_nodes_with_a_gpu_and_a_host_of_their_own_where_the_machine_allows():
    from tests.gpu.nccl import as_nodes

    two = as_nodes(["gpu-1", "gpu-2"], gpus=2, hosts=True)
    assert [env["CUDA_VISIBLE_DEVICES"] for env in two.values()] == ["0", "1"]
    assert two["gpu-1"]["NCCL_HOSTID"] != two["gpu-2"]["NCCL_HOSTID"]
    one_gpu = as_nodes(["gpu-1", "gpu-2"], gpus=1, hosts=True)  # both ranks on the one GPU, apart to NCCL
    assert not any("CUDA_VISIBLE_DEVICES" in env for env in one_gpu.values())
    assert as_nodes(["gpu-1"], gpus=2, hosts=False) == {"gpu-1": {}}  # one node: the machine as it is
    assert as_nodes(["gpu-1", "gpu-2"], gpus=2, hosts=False)["gpu-2"] == {"CUDA_VISIBLE_DEVICES": "1"}


@pytest.mark.skipif(os.environ.get("SPARK_VLLM_GPU_LANE") != "1", reason="the GPU lane is opt-in: "
                    "SPARK_VLLM_GPU_LANE=1 on a GPU machine with torch (tests/gpu/device.sh nccl)")  # fmt: skip
def test_the_nccl_test_on_a_real_gpu_all_reduces_correctly_and_says_its_network(tmp_path):
    from tests.gpu import nccl

    assert nccl.main(["--out", str(tmp_path)]) == 0
    cases = json.loads((tmp_path / "nccl.json").read_text())["cases"]
    one = cases["one node"]["facts"]["gpu-1"]
    assert one["correct"] is True and one["network"] in ("IB", "Socket") and one["seconds"] > 0
    two = cases["two nodes"]  # apart to NCCL: the sum crosses its network, as between two Sparks
    assert all(facts["correct"] is True for facts in two["facts"].values()), two
    assert two["figures"]["busBandwidthGbps"] > 0


def test_the_lane_reads_each_result_as_the_program_does_and_says_what_it_could_not_read(tmp_path):
    """A script's last JSON line through its contract (the router keeper's and the handover's through printed()):
    the vllm-router keeper's ready line as the H200 printed it (2026-12-04) after a log line, then lines the
    contract refuses."""
    ready = '[router-keeper] 16:12:21 router up\n{"router": "http://127.0.0.1:8080", "workers": {}}\n'
    assert lane.read_result("router_keeper.py", ready) == {"router": "http://127.0.0.1:8080", "workers": {}}
    unknown = lane.read_result("wait_ready.py", '{"ready_seconds": 1.5, "readySeconds": 1.5}\n')
    assert unknown["error"].startswith("TypeError") and "readySeconds" in unknown["error"]
    assert lane.read_result("smoke.py", "no JSON at all")["error"].startswith("ValueError")
    node = lane.Node.__new__(lane.Node)
    node.reads = []
    node.record("router_keeper.py", ready)
    node.record("wait_ready.py", "{}")
    node.record("supervisor.py", "{}")  # no result contract: not a read
    assert [(each["script"], each["read"]) for each in node.reads] == [
        ("router_keeper.py", True),
        ("wait_ready.py", False),
    ]


def test_the_same_shape_twice_is_two_deployments():
    """Two of the 8B fit one 80 GiB GPU where the 8B and the 30B do not: the co-tenant phase names them apart."""
    from tests.gpu.lane_cotenants import deployment_names

    shapes = [("qwen3-8b", 0.4), ("qwen3-8b", 0.4), ("qwen3-30b-a3b", 0.1), ("qwen3-8b", 0.1)]
    assert deployment_names(shapes) == ["qwen3-8b", "qwen3-8b-2", "qwen3-30b-a3b", "qwen3-8b-3"]
