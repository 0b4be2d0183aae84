"""vllm.speculative: the setting, its refusals (extraArgs in every spelling vLLM reads, a model without MTP
layers, tokens vLLM refuses), the rendered flag, the memory plan against the H200's figures, the release's
record and floors, and the validation's answers and the benchmark's acceptance against the stand-in."""

from __future__ import annotations

import copy
import json
import shlex
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from components.config import ConfigError, ReleaseConfig, load_cluster_config
from components.plan.engine import EngineSettings, Speculation
from components.plan.memory import GIB, NodeMemory, engine_knobs, model_shape, plan_memory
from components.plan.programs import script_program
from components.plan.serving import answers_params, serve_argv
from components.plan.speculation import mtp_layers, speculation_problems
from components.resources.release import (
    Promotion,
    check_promotable,
    floor_problems,
    release_record,
    speculation_record,
)
from tests.gpu.model import SHAPES

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "tests" / "gpu" / "results" / "2026-12-04"
STANDIN = ROOT / "tests" / "e2e" / "standin"
if str(STANDIN) not in sys.path:
    sys.path.insert(0, str(STANDIN))

from vllm_standin import api  # noqa: E402
from vllm_standin.args import ServeConfig, StandinError, speculative_config  # noqa: E402

BASE = {
    "nodes": [
        {"name": "spark-1", "host": "10.0.0.1", "fabricAddress": "10.1.0.1", "fabricInterface": "enp1s0f1np1"},
        {"name": "spark-2", "host": "10.0.0.2", "fabricAddress": "10.1.0.2", "fabricInterface": "enp1s0f1np1"},
    ],
    "image": "vllm/vllm-openai:v0.25.0",
    "model": "Qwen/Qwen3.5-35B-A3B",
    "tensorParallelSize": 2,
    "apiKey": "k" * 16,
}
MTP = {"method": "mtp", "tokens": 3}


def config(**vllm) -> dict:
    raw = copy.deepcopy(BASE)
    raw["vllm"] = vllm
    return raw


def problems_of(raw: dict) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        load_cluster_config(raw)
    return caught.value.problems


# --- the setting and extraArgs ---------------------------------------------------------------------------

# Every way vLLM 0.25's parser reads a speculative flag (FlexibleArgumentParser: '_' is '-' up to the first '.',
# a dotted name sets one key of the JSON flag, argparse takes a unique prefix and a short option's prefix).
SPELLINGS = [
    ["--speculative-config", '{"method":"mtp","num_speculative_tokens":3}'],
    ['--speculative-config={"method":"mtp"}'],
    ["--speculative_config", "{}"],
    ["--speculative_config={}"],
    ["-sc", "{}"],
    ["-sc={}"],
    ["-s", "{}"],
    ["--speculative-config.method", "mtp"],
    ["--speculative-config.num_speculative_tokens=3"],
    ["--speculative_config.method=mtp"],
    ["-sc.method", "mtp"],
    ["-sc.num_speculative_tokens=3"],
    ["--speculative.method", "mtp"],
    ["--speculative", "{}"],
    ["--spec-method", "mtp"],
    ["--spec_method=mtp"],
    ["--spec-tokens", "3"],
    ["--spec-t=3"],
    ["--spec-model", "org/draft"],
    ["--spec-model.x+", "a,b"],
    ["--spec", "mtp"],
    ['--speculative-config {"method": "mtp"}'],
]


@pytest.mark.parametrize("extra", SPELLINGS, ids=[" ".join(each)[:40] for each in SPELLINGS])
def test_speculation_in_extra_args_is_refused_in_every_spelling_with_the_key_to_use(extra):
    deployed = copy.deepcopy(BASE)
    del deployed["model"], deployed["tensorParallelSize"]
    deployed["deployments"] = [{"name": "big", "model": BASE["model"], "nodes": ["spark-1", "spark-2"],
                                "tensorParallelSize": 2, "vllm": {"extraArgs": extra}}]  # fmt: skip
    for raw in (config(extraArgs=extra), deployed):
        found = problems_of(raw)
        line = next(line for line in found if "extraArgs[0]" in line)
        assert "vllm.speculative" in line or "spell the flag you mean in full" in line, line


def test_the_setting_renders_one_json_argument_that_survives_the_shell_and_reads_back():
    cfg = load_cluster_config(config(speculative=MTP))
    argv = serve_argv(cfg, "/models/m")
    at = argv.index("--speculative-config")
    assert json.loads(argv[at + 1]) == {"method": "mtp", "num_speculative_tokens": 3}
    assert shlex.split(shlex.join(argv)) == argv
    ngram = load_cluster_config(config(speculative={"method": "ngram", "tokens": 4, "promptLookupMax": 4}))
    assert json.loads(serve_argv(ngram, "/m")[-1]) == {
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}  # fmt: skip
    # numbers come back from a promoted release's state as floats
    kept = Speculation.from_release({"method": "mtp", "tokens": 3.0})
    assert kept.flag_value() == '{"method":"mtp","num_speculative_tokens":3}'


HOSTILE = [
    ({"method": "mtp; rm -rf /", "tokens": 3}, "vllm.speculative.method"),
    ({"method": "mtp", "tokens": "3 --api-key x"}, "vllm.speculative.tokens"),
    ({"method": "mtp", "tokens": 0}, "vllm.speculative.tokens"),
    ({"method": "mtp", "tokens": -2}, "vllm.speculative.tokens"),
    ({"method": "mtp", "tokens": 3.5}, "vllm.speculative.tokens"),
    ({"method": "eagle3", "tokens": 3}, "vllm.speculative.method"),
    ({"method": "mtp"}, "vllm.speculative.tokens"),
    ({"method": "mtp", "tokens": 3, "model": "$(reboot)"}, "vllm.speculative.model"),
    ({"method": "ngram", "tokens": 2, "promptLookupMax": "4'"}, "vllm.speculative.promptLookupMax"),
    ({"method": "mtp", "tokens": 2, "promptLookupMin": 2}, "vllm.speculative.promptLookupMin"),
    ({"method": "ngram", "tokens": 2, "promptLookupMin": 5, "promptLookupMax": 3}, "vllm.speculative.promptLookupMax"),
    ("mtp", "vllm.speculative"),
]


@pytest.mark.parametrize("value,key", HOSTILE, ids=[key + str(i) for i, (_, key) in enumerate(HOSTILE)])
def test_bad_and_hostile_settings_fail_before_any_resource_naming_the_key(value, key):
    found = problems_of(config(speculative=value))
    assert any(line.startswith(f"{key}:") for line in found), found


def test_a_promoted_stack_takes_speculation_from_the_release_and_may_not_set_its_own():
    raw = config(speculative=MTP)
    del raw["image"], raw["model"]
    raw["promoteFrom"] = "dev"
    assert problems_of(raw)[0].startswith("vllm.speculative: 'mtp' — no value: promoteFrom 'dev' decides it")
    mine = EngineSettings.from_release({"maxModelLen": 8192, "extraArgs": [], "speculative": MTP})
    assert mine.promoted({"maxModelLen": 8192.0, "extraArgs": []}).speculative is None
    assert mine.promoted({"maxModelLen": 8192.0, "extraArgs": []}).max_model_len == 8192
    assert EngineSettings().promoted({"extraArgs": [], "speculative": MTP}).release()["speculative"] == MTP


def test_a_release_without_speculation_keeps_its_engine_settings_and_so_its_fingerprint():
    plain = EngineSettings.of(load_cluster_config(config())).release()
    assert plain == {"maxModelLen": None, "trustRemoteCode": False, "reasoningParser": None, "toolCallParser": None,
                     "enableAutoToolChoice": False, "extraArgs": []}  # the record every release had  # fmt: skip
    on = EngineSettings.of(load_cluster_config(config(speculative=MTP)))
    assert on.release()["speculative"] == MTP and EngineSettings.from_release(on.release()) == on
    assert on.without_speculation().release() == plain


# --- the model ---------------------------------------------------------------------------------------------


def test_mtp_needs_a_model_with_mtp_layers_and_tokens_vllm_takes():
    qwen35 = copy.deepcopy(SHAPES["qwen3.5-35b-a3b-mtp"][0])
    assert mtp_layers(qwen35) == 1 and mtp_layers(SHAPES["qwen3.5-35b-a3b"][0]) == 0
    assert mtp_layers({"num_nextn_predict_layers": 1}) == 1 and mtp_layers({"num_mtp_modules": 2}) == 2
    assert speculation_problems(qwen35, Speculation("mtp", 7), "vllm.speculative") == []
    dense = speculation_problems(SHAPES["qwen3-8b"][0], Speculation("mtp", 3), "vllm.speculative")
    assert dense[0].startswith("vllm.speculative.method: 'mtp' — a model whose config.json has MTP layers")
    assert "Qwen3ForCausalLM's has none" in dense[0] and "use method ngram" in dense[0]
    two = {"num_nextn_predict_layers": 2, "architectures": ["Glm4MoeForCausalLM"]}
    assert speculation_problems(two, Speculation("mtp", 4), "k") == []
    assert speculation_problems(two, Speculation("mtp", 1), "k") == []
    refused = speculation_problems(two, Speculation("mtp", 3), "k")
    assert refused[0].startswith("k.tokens: 3 — at most 2 or a multiple of 2") and "2 or 4" in refused[0]
    assert speculation_problems(SHAPES["qwen3-8b"][0], Speculation("ngram", 3), "k") == []


def test_the_standin_refuses_what_vllm_refuses():
    qwen35 = SHAPES["qwen3.5-35b-a3b-mtp"][0]
    assert speculative_config({"method": "mtp"}, qwen35) == {"method": "mtp", "num_speculative_tokens": 1}
    for given, config_json, said in (
        ({"method": "mtp", "num_speculative_tokens": 3}, SHAPES["qwen3-8b"][0], "not supported"),
        ({"method": "mtp", "num_speculative_tokens": 3}, {"num_nextn_predict_layers": 2}, "divisible by n_predict=2"),
        ({"method": "mtp", "num_speculative_tokens": 0}, qwen35, "greater than 0"),
        ({"method": "ngram"}, qwen35, "without speculative model"),
        ([1], qwen35, "valid dictionary"),
    ):
        with pytest.raises(StandinError, match=said):
            speculative_config(given, config_json)


# --- the memory plan, against what vLLM 0.25 did on the H200 (tests/gpu/results/2026-12-04) ----------------


def h200_plan(report: dict):
    """The plan of the lane run `report` from its own inputs (config, weights, the H200's 143,771 MiB)."""
    config, weights = SHAPES[report["model"]]
    extra = ["--load-format", "dummy", "--language-model-only", "--enforce-eager"]
    extra += ["--enable-prefix-caching"] if "prefix" in report["_name"] else []
    knobs = engine_knobs(extra, Speculation("mtp", 3) if "mtp3" in report["_name"] else None)
    seqs = (report.get("memory_plan", {}).get("maxNumSeqs") or {}).get("wanted")
    return plan_memory(
        [NodeMemory("gpu-1", 1, 143_771 * 2**20, False)], weights, model_shape(config, knobs=knobs), 1, 1,
        report["max_model_len"], report["gpu_memory_utilization"], 8 * GIB, knobs=knobs,
        max_num_seqs=seqs if seqs != 1024 else None,
    )  # fmt: skip


# Without speculation vLLM does not load the MTP head (64.69 GiB, not 66.26), which the plan counts with the
# checkpoint's files: the plan is then up to 2.3 GiB short (−5.5 % at 256 sequences), on the safe side.
@pytest.mark.parametrize(
    "run,within",
    [("mtp3", 0.05), ("mtp3-final", 0.05), ("mtp3-prefix-256", 0.05), ("nospec", 0.05), ("nospec-prefix-256", 0.055)],
)
def test_the_plan_is_within_5_percent_of_vllms_kv_cache_and_concurrency_with_mtp(run, within):
    report = json.loads((RESULTS / f"lane-mp-qwen3.5-35b-a3b-mtp-{run}.json").read_text())
    report["_name"] = run
    plan = h200_plan(report)
    node = plan.nodes[0]
    kv = report["kv"]
    assert abs(node.kv_room_gib - kv["available_kv_cache_gib"]) / kv["available_kv_cache_gib"] <= within
    assert abs(node.max_sequences - kv["max_concurrency"]) / kv["max_concurrency"] <= within
    assert plan.hybrid.block_tokens == kv["attention_block_tokens"]  # 1072 with mtp: the conv state's +3 entries
    # never above vLLM's own figure by more than 3 % (since #65 a hybrid model's profiled peak is counted)
    assert node.kv_room_gib <= kv["available_kv_cache_gib"] * 1.03
    if "mtp3" in run:
        assert plan.hybrid.group_size == 11  # the MTP layer is an attention layer in the groups
        assert plan.hybrid.state_blocks_per_sequence == (2 if "prefix" in run else 1) + 3
        assert plan.output()["speculative"]["draftAttentionLayers"] == 1


def test_the_sampler_allowance_follows_max_num_seqs_as_measured():
    # vLLM's memory outside weights and KV grew with mtp by 3.79 GiB at 1024 sequences, 0.95 GiB at 256
    runs = {name: json.loads((RESULTS / f"lane-mp-qwen3.5-35b-a3b-mtp-{name}.json").read_text()) for name in
            ("nospec", "mtp3", "nospec-prefix-256", "mtp3-prefix-256")}  # fmt: skip

    def outside(report):
        kv = report["kv"]
        return 0.9 * 143_771 / 1024 - kv["model_loading_gib"] - kv["available_kv_cache_gib"]

    for plain, spec, seqs in (("nospec", "mtp3", 1024), ("nospec-prefix-256", "mtp3-prefix-256", 256)):
        grew = outside(runs[spec]) - outside(runs[plain])
        shape = model_shape(SHAPES["qwen3.5-35b-a3b-mtp"][0])
        expected = 16 * shape.vocab_size * seqs / GIB
        assert abs(grew - expected) < 0.05, (plain, grew, expected)


# --- the release ------------------------------------------------------------------------------------------

BASELINE = {"answers": [{"id": "capital#1", "tokenIds": [1, 2]}], "benchmark": {"outputTokensPerSecond": 40.0,
            "tpotMs": {"p50": 25.0}}, "source": "a start without speculation"}  # fmt: skip
BENCH = {
    "tool": "spark-vllm",
    "outputTokensPerSecond": 80.0,
    "tpotMs": {"p50": 12.5},
    "errors": 0,
    "speculative": {"acceptanceRate": 0.6, "meanAcceptanceLength": 2.8, "acceptedPerPosition": [0.8, 0.6, 0.4]},
}


def test_the_release_keeps_agreement_acceptance_speedup_and_the_baseline():
    engine = EngineSettings(speculative=Speculation("mtp", 3))
    spec = speculation_record(engine, {"compared": 5, "agreed": 5}, BASELINE, BENCH)
    assert spec["speedup"] == 2.0 and spec["acceptance"]["meanAcceptanceLength"] == 2.8
    assert spec["answers"] == {"compared": 5, "agreed": 5} and spec["baseline"] == BASELINE
    assert spec["withoutSpeculation"]["tpotMs"] == {"p50": 25.0}
    record = release_record("img@sha256:" + "a" * 64, "/m", engine, True, "config", benchmark=BENCH, speculation=spec)
    assert record["speculative"]["tokens"] == 3 and record["benchmark"]["speculative"]["acceptanceRate"] == 0.6
    plain = release_record("img@sha256:" + "a" * 64, "/m", EngineSettings(), True, "config",
                           benchmark={"outputTokensPerSecond": 1.0})  # fmt: skip
    assert "speculative" not in plain and "tpotMs" not in plain["benchmark"]  # older records read as they did
    assert speculation_record(EngineSettings(), None, None, BENCH) is None


def test_promotion_floors_hold_acceptance_and_speedup():
    engine = EngineSettings(speculative=Speculation("mtp", 3))
    release = release_record(
        "img@sha256:" + "a" * 64,
        "/m",
        engine,
        True,
        "config",
        benchmark=BENCH,
        speculation=speculation_record(engine, {"compared": 5, "agreed": 5}, BASELINE, BENCH),
    )
    assert floor_problems(release, "dev", ReleaseConfig(minAcceptanceLength=2.5, minSpeculativeSpeedup=1.5)) == []
    found = floor_problems(release, "dev", ReleaseConfig(minAcceptanceLength=3, minSpeculativeSpeedup=2.5))
    assert found == [
        "promoteFrom 'dev': release.minAcceptanceLength: its release's mean acceptance length was 2.8, below the "
        "floor 3 (mtp, 3 tokens)",
        "promoteFrom 'dev': release.minSpeculativeSpeedup: its release's speed-up over the same load without it "
        "was 2, below the floor 2.5 (mtp, 3 tokens)",
    ]
    without = release_record("img@sha256:" + "a" * 64, "/m", EngineSettings(), True, "config", benchmark=BENCH)
    assert (
        "runs without speculative decoding" in floor_problems(without, "dev", ReleaseConfig(minAcceptanceLength=2))[0]
    )
    with pytest.raises(Exception, match="minSpeculativeSpeedup"):
        check_promotable(without, Promotion("dev", floors=ReleaseConfig(minSpeculativeSpeedup=1.1)))


# --- against the stand-in: the validation's answers, the benchmark's acceptance ---------------------------


@pytest.fixture
def standin(monkeypatch):
    monkeypatch.setenv("STANDIN_SPEC_ACCEPTANCE", "0.9,0.7,0.5")
    servers = {}

    def start(speculative):
        cfg = ServeConfig(model="/models/m", served_model_names=("m",), max_model_len=4096, tensor_parallel_size=1,
                          pipeline_parallel_size=1, data_parallel_size=1, backend=None, host="127.0.0.1", port=0,
                          api_key="k", vocab_size=2048, speculative=speculative)  # fmt: skip
        state = api.ServerState(cfg, api.Pace(tokens_per_second=200, prefill_tokens_per_second=20000))
        server = api.make_server(state)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers[server] = state
        return f"http://127.0.0.1:{server.server_address[1]}", state

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def run_script(name: str, params: dict) -> tuple[int, str, dict]:
    result = subprocess.run([sys.executable, "-"], input=script_program(name, params), capture_output=True,
                            text=True, timeout=120)  # fmt: skip
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    return result.returncode, result.stdout + result.stderr, json.loads(lines[-1]) if lines else {}


def test_the_validation_holds_speculative_answers_against_those_without_and_fails_on_a_difference(standin):
    cfg = load_cluster_config(config())
    plain_url, _ = standin(None)
    spec_url, _ = standin({"method": "mtp", "num_speculative_tokens": 3})
    code, _, baseline = run_script("node_answers.py", {**answers_params(cfg, "m", "k"), "base_url": plain_url})
    assert code == 0 and len(baseline["answers"]) == 5 and baseline["answers"][-1]["id"] == "colours#2"
    assert all(answer["tokenIds"] for answer in baseline["answers"])
    params = {**answers_params(cfg, "m", "k", baseline["answers"]), "base_url": spec_url}
    code, out, found = run_script("node_answers.py", params)
    assert code == 0, out
    assert found["agreement"] == {"compared": 5, "agreed": 5, "differing": []}
    changed = copy.deepcopy(baseline["answers"])
    changed[4]["tokenIds"][2] += 1
    code, out, found = run_script("node_answers.py", {**params, "baseline": changed})
    assert code == 1 and found["agreement"]["agreed"] == 4
    assert "validation failed: with vllm.speculative, 1 of 5 greedy answers differ" in out
    assert "colours#2 at token 2:" in out
    code, out, _ = run_script("node_answers.py", {**params, "baseline": []})  # nothing kept to compare: a failure
    assert code == 1 and "no answer without speculation to compare" in out


def test_the_benchmark_reads_the_acceptance_from_vllms_counters_and_a_faster_tpot(standin):
    from components.plan.serving import benchmark_params

    cfg = load_cluster_config(config())
    figures = {}
    for label, speculative in (("plain", None), ("mtp", {"method": "mtp", "num_speculative_tokens": 3})):
        url, state = standin(speculative)
        params = {**benchmark_params(cfg, "m", "/models/m", "k"), "base_url": url, "tool": "spark-vllm",
                  "requests": 8, "output_tokens": 40}  # fmt: skip
        code, out, figures[label] = run_script("node_benchmark.py", params)
        assert code == 0, out
    assert "speculative" not in figures["plain"]
    accepted = figures["mtp"]["speculative"]
    # rates 0.9, 0.7, 0.5: 2.1 accepted a step on average, so about 3.1 tokens a step
    assert 2.6 < accepted["meanAcceptanceLength"] < 3.6 and 0.55 < accepted["acceptanceRate"] < 0.85
    assert accepted["draftTokens"] == 3 * accepted["drafts"] and len(accepted["acceptedPerPosition"]) == 3
    assert accepted["acceptedPerPosition"][0] >= accepted["acceptedPerPosition"][2]
    # About 3.1 tokens a step make it about 3x faster at the stand-in's pace. The time per output token, read within
    # each request, holds that on a loaded machine; the two runs' output tokens a second do not (each request's
    # HTTP and Python time, set by the load, pulled their ratio to 0.82 and 1.31 in CI's fast lane): the speed-up
    # in output tokens a second is held where answers are long enough for the pace to outweigh them, the
    # rehearsal's tests/e2e/test_speculative.py (64-token answers, speed-up > 1.3).
    assert figures["mtp"]["tpotMs"]["p50"] < 0.9 * figures["plain"]["tpotMs"]["p50"]


def test_flags_that_only_look_alike_stay_allowed():
    # vLLM 0.25 has --specialize-active-lora beside the --spec-* flags (tests/gpu/results/2026-12-03's flags)
    cfg = load_cluster_config(config(extraArgs=["--specialize-active-lora", "--speci", "--max-num-seqs", "8"]))
    assert serve_argv(cfg, "/m")[-4:] == ["--specialize-active-lora", "--speci", "--max-num-seqs", "8"]
