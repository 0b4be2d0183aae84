"""A hybrid model's tight case under mocks, with the shape measured on the H200 (tests/unit/test_hybrid_cache.py):
vllm.maxNumSeqs auto fixes it in vLLM's arguments; a number that does not fit stops before any container."""

import json

import pytest

from tests.harness import FakeCloud, run_program
from tests.program.test_preflight_program import GUARDS_ONLY
from tests.program.test_program import SECRETS, prod
from tests.unit.test_hybrid_cache import QWEN35_35B_A3B, WEIGHTS_35B


class H200(FakeCloud):
    """One H200 (143,771 MiB, as nvidia-smi says) holding Qwen3.5-35B-A3B's shape."""

    def new_resource(self, args):
        name, outputs = super().new_resource(args)
        if args.name.endswith("-preflight"):
            memory = json.dumps({"gpu_memory_mib": ["143771"], "gpu_free_mib": ["143000"]})
            outputs["stdout"] = f"preflight {args.name.removesuffix('-preflight')}: ok\n{memory}"
        return name, outputs

    def fingerprint(self, node):
        facts = super().fingerprint(node)
        half = WEIGHTS_35B // 2
        facts["files"] = {"config.json": 700, "model-1.safetensors": half, "model-2.safetensors": WEIGHTS_35B - half}
        facts["config"] = QWEN35_35B_A3B
        return facts


def one_h200(**vllm) -> dict:
    cfg = prod(tensorParallelSize=1, maxModelLen=32768)
    cfg["nodes"] = cfg["nodes"][:1]
    cfg["vllm"] = {**cfg["vllm"], **vllm}
    return cfg


def serve_argv(run) -> list[str]:
    stdin = run.named("spark-vllm-serve").inputs["stdin"]
    return json.loads(json.loads(stdin.split("\n", 1)[0].split("=", 1)[1]))["argv"]


def test_at_0_55_auto_sets_max_num_seqs_in_vllms_arguments_and_says_so(caplog):
    with caplog.at_level("INFO"):
        run = run_program(one_h200(gpuMemoryUtilization=0.55), SECRETS, stack="prod", mocks=H200())
    assert "--max-num-seqs=594" in serve_argv(run)
    plan = run.exports["memoryPlan"]
    assert plan["maxNumSeqs"]["set"] == 594 and plan["hybridCache"]["blockTokens"] == 544
    assert any("vllm.maxNumSeqs auto sets --max-num-seqs=594" in r.getMessage() for r in caplog.records)


def test_at_0_9_vllms_default_stands():
    run = run_program(one_h200(gpuMemoryUtilization=0.9), SECRETS, stack="prod", mocks=H200())
    assert not any(arg.startswith("--max-num-seqs") for arg in serve_argv(run))
    assert run.exports["memoryPlan"]["maxNumSeqs"]["set"] is None


def test_at_0_55_a_number_that_does_not_fit_stops_before_any_container():
    cloud = H200()
    with pytest.raises(Exception) as caught:
        run_program(one_h200(gpuMemoryUtilization=0.55, maxNumSeqs=1024), SECRETS, stack="prod", mocks=cloud)
    message = str(caught.value)
    assert "the model does not fit (memoryCheck: enforce)" in message
    assert "spark-01: vllm.maxNumSeqs 1024 exceeds the 699 Mamba cache blocks" in message
    assert set(cloud.containers) <= GUARDS_ONLY


def test_a_number_that_fits_is_passed_as_it_is():
    run = run_program(one_h200(gpuMemoryUtilization=0.55, maxNumSeqs=256), SECRETS, stack="prod", mocks=H200())
    assert "--max-num-seqs=256" in serve_argv(run)


def test_the_dev_stack_on_the_stock_image_runs_mp_and_says_why(caplog):
    from tests.program.test_program import stack_file

    with caplog.at_level("INFO"):
        run = run_program(stack_file("dev"), {}, stack="dev")
    assert run.exports["executor"] == "mp" and run.exports["rayAddress"] is None
    assert not [r for r in run.registrations if r.name == "ray-auth-token"]
    assert any(
        "executor auto: mp (vllm/vllm-openai:v0.33.0: the stock vLLM image has no Ray" in r.getMessage()
        for r in caplog.records
    )
