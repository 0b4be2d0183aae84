"""The vLLM the image holds, under mocks (#65): the release records it and the rules the program held it to, a
promotion validated under other rules is refused before any container, the memory plan follows that vLLM's
defaults (block size, hybrid prefix caching, a GB10's max_num_seqs tier), and a replica behind vllm-router's
cache_aware gets --enable-scale-out where its vLLM has it."""

from __future__ import annotations

import json

import pytest

from components.config.vllm_versions import rules
from tests.harness import CONTAINER, FakeCloud, run_program
from tests.program.test_deployments_program import Models, fleet, run_fleet
from tests.program.test_preflight_program import GUARDS_ONLY
from tests.program.test_program import SECRETS, prod
from tests.program.test_promotion import STAGING, promoted, release
from tests.unit.test_hybrid_cache import QWEN35_35B_A3B, WEIGHTS_35B

VLLM_034 = {"vllm": "0.34.0", "vllm_scale_out": True}


def cloud_with(**facts) -> FakeCloud:
    cloud = FakeCloud()
    cloud.image_facts = {**FakeCloud.image_facts, **facts}
    return cloud


def serve_argv(run, name: str) -> list[str]:
    stdin = run.named(name).inputs["stdin"]
    return json.loads(json.loads(stdin.split("\n", 1)[0].split("=", 1)[1]))["argv"]


@pytest.mark.parametrize("said", ["0.25.0", "0.31.0+nv26.10", "0.34.0"])
def test_the_release_records_the_images_vllm_and_the_rules_it_was_held_to(said):
    run = run_program(prod(), SECRETS, stack="prod", mocks=cloud_with(vllm=said))
    held = rules(tuple(int(p) for p in said.split("+")[0].split(".")))
    assert run.exports["release"]["vllm"] == {"version": said, "heldTo": held.label, "rules": held.fingerprint()}


def test_a_release_validated_under_other_rules_for_its_vllm_is_refused_before_any_container():
    staging = release(vllm={"version": "0.34.0", "heldTo": "0.34.0", "rules": "0123456789abcdef"})
    cloud = FakeCloud(stack_outputs={STAGING: {"release": staging}})
    cloud.image_facts = {**FakeCloud.image_facts, **VLLM_034}
    with pytest.raises(Exception, match="validated under this program's rules for vLLM 0.34.0 as they were then"):
        run_program(promoted(), SECRETS, stack="prod", mocks=cloud)
    assert set(cloud.containers) <= GUARDS_ONLY


def test_a_release_validated_under_these_rules_is_promoted_and_one_that_recorded_none_too():
    current = rules((0, 34, 0)).fingerprint()
    for recorded in ({"version": "0.34.0", "heldTo": "0.34.0", "rules": current}, None):
        staging = release(**({"vllm": recorded} if recorded else {}))
        cloud = FakeCloud(stack_outputs={STAGING: {"release": staging}})
        cloud.image_facts = {**FakeCloud.image_facts, **VLLM_034}
        run = run_program(promoted(), SECRETS, stack="prod", mocks=cloud)
        assert run.exports["release"]["vllm"]["rules"] == current
        assert any(r.typ == CONTAINER for r in run.registrations)


class HybridSparks(FakeCloud):
    """Two Sparks holding a Qwen3.5 shape (Gated DeltaNet beside attention: the seed's family)."""

    def fingerprint(self, node):
        facts = super().fingerprint(node)
        facts["files"] = {"config.json": 700, "model.safetensors": WEIGHTS_35B}
        facts["config"] = QWEN35_35B_A3B
        return facts


def test_the_memory_plan_follows_the_images_vllm_for_the_seeds_hybrid_family():
    """vLLM 0.25 keeps one state block a sequence in 16-token-aligned blocks; 0.34 has prefix caching on by default
    (align: 2 state blocks and a prefill checkpoint) in 64-token-aligned blocks, and a GB10 on the small tier of
    defaults (max_num_seqs 256)."""
    plans = {}
    for facts in ({"vllm": "0.25.0"}, VLLM_034):
        cloud = HybridSparks()
        cloud.image_facts = {**FakeCloud.image_facts, **facts}
        plans[facts["vllm"]] = run_program(prod(), SECRETS, stack="prod", mocks=cloud).exports["memoryPlan"]
    old, new = plans["0.25.0"], plans["0.34.0"]
    assert old["hybridCache"]["stateBlocksPerSequence"] == 1 and new["hybridCache"]["stateBlocksPerSequence"] == 3
    assert old["hybridCache"]["blockTokens"] % 16 == 0 and new["hybridCache"]["blockTokens"] % 64 == 0
    assert old["maxNumSeqs"]["wanted"] == 1024 and new["maxNumSeqs"]["wanted"] == 256
    assert new["maxNumSeqs"]["source"] == "vLLM 0.34.0's default max_num_seqs on a GB10"


@pytest.mark.parametrize(
    ("facts", "policy", "expected"),
    [(VLLM_034, "cache_aware", True), (VLLM_034, "round_robin", False),
     ({"vllm": "0.25.0", "vllm_scale_out": False}, "cache_aware", False)],
)  # fmt: skip
def test_a_replica_behind_cache_aware_gets_enable_scale_out_where_its_vllm_has_it(facts, policy, expected):
    """vllm-router 0.1.17's cache_aware asks each replica's /v1/chat/completions/render (vLLM 0.30 on: only with
    --enable-scale-out); without it the router routes by load alone."""
    cloud = Models()
    cloud.image_facts = {**FakeCloud.image_facts, **facts}
    run = run_fleet(fleet(router={"policy": policy}), mocks=cloud)
    for name in ("big-serve", "coder-serve", "small-serve"):
        assert ("--enable-scale-out" in serve_argv(run, name)) is expected, name


@pytest.mark.parametrize(
    ("said", "refused"), [("0.25.0", False), ("0.27.1", False), ("0.28.0", True), ("0.34.0", True)]
)
def test_a_setting_the_images_vllm_refuses_at_start_stops_before_any_container(said, refused):
    """--mamba-cache-mode all: vLLM 0.28 on takes only align and none (config/cache.py MambaCacheMode)."""
    cfg = prod(vllm={**prod()["vllm"], "extraArgs": ["--mamba-cache-mode", "all"]})
    cloud = cloud_with(vllm=said)
    if not refused:
        run_program(cfg, SECRETS, stack="prod", mocks=cloud)
        return
    with pytest.raises(Exception, match=f"vllm.extraArgs: --mamba-cache-mode all — one of none, align: the image's vLLM "
                                        f"{said} refuses 'all' at start"):  # fmt: skip
        run_program(cfg, SECRETS, stack="prod", mocks=cloud)
    assert set(cloud.containers) <= GUARDS_ONLY
