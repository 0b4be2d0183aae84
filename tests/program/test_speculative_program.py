"""vllm.speculative under mocks: the start without it goes first and is kept, speculation is a vLLM-only change,
the validation holds the answers to that start's (or to a promoted release's), the release keeps the figures,
and a model without MTP layers stops before any vLLM starts."""

from __future__ import annotations

import copy
import json
import logging

import pytest

from tests.harness import CONTAINER, IMAGE, PROGRAM_KEY, FakeCloud, changed_inputs, run_program
from tests.program.test_program import SECRETS, params_of, prod
from tests.program.test_promotion import STAGING, promoted, release, staging_cloud

MTP = {"method": "mtp", "tokens": 3}


def with_mtp(speculative=None, **changes) -> dict:
    cfg = prod(**changes)
    cfg["vllm"] = {**cfg["vllm"], "speculative": speculative or MTP}
    return cfg


def argv_of(run, name: str) -> list[str]:
    return params_of(run.named(name))["argv"]


def chain_steps(stdin: str) -> list:
    """The scripts (and their PARAMS) of a script_chain program."""
    line = next(line for line in stdin.splitlines() if line.startswith("STEPS = "))
    programs = json.loads(json.loads(line.split("json.loads(", 1)[1].rsplit(")", 1)[0]))
    return [(name, json.loads(json.loads(program.split("\n", 1)[0].split("=", 1)[1]))) for name, program in programs]


def test_the_start_without_speculation_goes_first_and_the_validation_holds_the_answers_to_it(caplog):
    caplog.set_level(logging.INFO)
    run = run_program(with_mtp(), SECRETS, stack="prod")
    plain, spec = argv_of(run, "spark-vllm-baseline-serve"), argv_of(run, "spark-vllm-serve")
    assert "--speculative-config" not in plain
    assert spec[spec.index("--speculative-config") + 1] == '{"method":"mtp","num_speculative_tokens":3}'
    assert [arg for arg in spec if arg not in plain] == ["--speculative-config", spec[-1]]
    handover, baseline = run.named("spark-vllm-baseline-serve"), run.named("spark-vllm-baseline")
    assert "delete" not in handover.inputs  # what stops vLLM is the serve step's delete
    assert handover.urn in baseline.dependencies and baseline.urn in run.named("spark-vllm-serve").dependencies
    steps = [name for name, _ in chain_steps(baseline.inputs["stdin"])]
    assert steps == ["wait_ready.py", "node_answers.py", "node_benchmark.py"]
    (_, smoke), (_, answers) = chain_steps(run.named("spark-vllm-smoke").inputs["stdin"])
    assert answers["baseline"] == FakeCloud.answers and answers["api_key"] == PROGRAM_KEY
    assert "stdin" in baseline.secret_paths() and "stdin" in run.named("spark-vllm-smoke").secret_paths()
    spec_record = run.exports["release"]["speculative"]
    assert spec_record["method"] == "mtp" and spec_record["tokens"] == 3
    assert spec_record["answers"] == {"compared": 1, "agreed": 1}
    assert spec_record["baseline"]["answers"] == FakeCloud.answers
    assert spec_record["speedup"] == 2.0  # 412.5 output tokens/s against the start without it, 206.25
    assert run.exports["release"]["engine"]["speculative"] == MTP
    plan = run.exports["memoryPlan"]["speculative"]
    assert plan["draftAttentionLayers"] == 1 and plan["samplerGib"] > 0
    said = " ".join(record.getMessage() for record in caplog.records)
    assert "vllm.speculative: mtp, 3 tokens: a vLLM-only change" in said


def test_with_mp_every_rank_gets_the_settings_without_speculation_first():
    run = run_program(with_mtp(executor="mp"), SECRETS, stack="prod")
    worker = run.named("spark-02-baseline-serve")
    assert "--speculative-config" not in argv_of(run, "spark-02-baseline-serve")
    assert "--headless" in argv_of(run, "spark-02-baseline-serve")
    assert worker.urn in run.named("spark-vllm-baseline").dependencies
    assert run.named("spark-vllm-baseline").urn in run.named("spark-02-serve").dependencies


def test_turning_it_on_is_a_vllm_only_change_and_its_tokens_leave_the_start_without_it_alone():
    before, on = run_program(prod(), SECRETS, stack="prod"), run_program(with_mtp(), SECRETS, stack="prod")
    result = changed_inputs(before, on)
    assert result["spark-vllm-baseline"] == result["spark-vllm-baseline-serve"] == "create"
    assert result["spark-vllm-serve"] == {"stdin"}
    assert not any(r.name in result for r in [*on.of_type(CONTAINER), *on.of_type(IMAGE)])
    assert set(result) <= {"spark-vllm-serve", "spark-vllm-ready", "spark-vllm-smoke", "spark-vllm-benchmark",
                           "spark-vllm-baseline", "spark-vllm-baseline-serve"}  # fmt: skip
    two = run_program(with_mtp({"method": "mtp", "tokens": 2}), SECRETS, stack="prod")
    tokens = changed_inputs(on, two)
    assert tokens["spark-vllm-serve"] == {"stdin"}
    assert "spark-vllm-baseline" not in tokens and "spark-vllm-baseline-serve" not in tokens
    off = changed_inputs(on, before)
    assert off["spark-vllm-baseline"] == off["spark-vllm-baseline-serve"] == "delete"
    assert off["spark-vllm-serve"] == {"stdin"}


def test_a_model_without_mtp_layers_stops_before_any_vllm_starts():
    class Dense(FakeCloud):
        def fingerprint(self, node):
            found = super().fingerprint(node)
            found["config"]["text_config"].pop("mtp_num_hidden_layers")
            found["config"]["architectures"] = ["Qwen3_5MoeForConditionalGeneration"]
            return found

    cloud = Dense()
    with pytest.raises(Exception) as caught:
        run_program(with_mtp(), SECRETS, stack="prod", mocks=cloud)
    message = str(caught.value)
    assert "vllm.speculative cannot run on this model; nothing was started" in message
    assert "vllm.speculative.method: 'mtp' — a model whose config.json has MTP layers" in message
    assert "Qwen3_5MoeForConditionalGeneration's has none" in message
    assert not any(name.startswith("spark-vllm-spark") for name in cloud.containers)


def test_a_promoted_release_with_speculation_is_held_to_the_answers_it_kept():
    kept = {"answers": [{"id": "capital#1", "tokenIds": [7]}], "source": "a start without speculation"}
    engine = {**release()["engine"], "speculative": MTP}
    run = run_program(promoted(), SECRETS, stack="prod",
                      mocks=staging_cloud(release(engine=engine, speculative={"method": "mtp", "baseline": kept})))  # fmt: skip
    assert not any(r.name.endswith(("-baseline", "-baseline-serve")) for r in run.registrations)
    assert "--speculative-config" in argv_of(run, "spark-vllm-serve")
    (_, _), (_, answers) = chain_steps(run.named("spark-vllm-smoke").inputs["stdin"])
    assert answers["baseline"] == kept["answers"]
    assert run.exports["release"]["speculative"]["baseline"] == kept  # carried on to the next stack
    assert run.exports["release"]["promotedFrom"] == STAGING


def test_a_promoted_release_without_speculation_renders_no_flag_even_where_the_stack_had_one():
    run = run_program(promoted(), SECRETS, stack="prod", mocks=staging_cloud(release()))
    assert "--speculative-config" not in argv_of(run, "spark-vllm-serve")
    assert "STEPS = " not in run.named("spark-vllm-smoke").inputs["stdin"]  # smoke.py alone, as always
    assert "speculative" not in run.exports["release"]


def test_the_two_spark_mtp_stack_file_serves_the_seed_model_with_mtp_and_fits():
    from tests.program.test_program import HOST_KEY, stack_file

    cfg = stack_file("staging-mtp")
    for node in cfg["nodes"]:
        node["hostKey"] = HOST_KEY
    run = run_program(cfg, SECRETS, stack="staging-mtp")
    assert [node["name"] for node in cfg["nodes"]] == ["spark-11", "spark-12"] and cfg["tensorParallelSize"] == 2
    spec = argv_of(run, "spark-vllm-serve")
    assert spec[2] == "/models/Qwen3.5-122B-A10B-FP8"
    assert spec[spec.index("--speculative-config") + 1] == '{"method":"mtp","num_speculative_tokens":3}'
    assert run.exports["memoryPlan"]["fits"] is True and run.exports["memoryPlan"]["speculative"]["tokens"] == 3
    assert run.exports["release"]["speculative"]["answers"] == {"compared": 1, "agreed": 1}


def test_one_deployment_with_mtp_gets_its_own_start_without_it_and_the_others_are_untouched():
    from tests.program.test_deployments_program import Models, fleet, run_fleet

    plain = fleet()
    spec = fleet()
    spec["deployments"][0]["vllm"]["speculative"] = MTP
    before, after = run_fleet(plain), run_fleet(spec)
    result = changed_inputs(before, after)
    assert result["big-baseline"] == result["big-baseline-serve"] == "create"
    assert result["big-serve"] == {"stdin"}
    assert not any(name.startswith(("coder", "small")) for name in result)
    assert not any(r.name in result for r in after.of_type(CONTAINER))
    assert "--speculative-config" in argv_of(after, "big-serve")
    assert "--speculative-config" not in argv_of(after, "big-baseline-serve")
    assert after.exports["release"]["deployments"]["big"]["speculative"]["tokens"] == 3
    assert "speculative" not in after.exports["release"]["deployments"]["coder"]
    # the small model has no MTP layers: refused before its vLLM starts, naming the deployment
    spec["deployments"][2]["vllm"]["speculative"] = MTP

    class NoMtp(Models):
        def fingerprint(self, node):
            found = super().fingerprint(node)
            if not node.startswith("big-"):
                found = copy.deepcopy(found)
                found["config"]["text_config"].pop("mtp_num_hidden_layers", None)
            return found

    with pytest.raises(Exception) as caught:
        run_fleet(spec, mocks=NoMtp())
    assert "deployments[2].vllm.speculative.method: 'mtp' — a model whose config.json has MTP layers" in str(
        caught.value
    )
