"""The memory plan's model of vLLM 0.25's hybrid cache, against what vLLM itself reported on an H200.

Measured (GPU lane, vLLM 0.25.0, mp, TP 1, maxModelLen 32768, dummy weights; reports in tests/gpu/results).
2026-12-02, with
Qwen3.5-35B-A3B's shape whose config had no `mamba_ssm_dtype` (so the recurrent state in bf16):
  gpuMemoryUtilization 0.9:  "Setting attention block size to 544 tokens to ensure that attention
    page size is >= mamba page size", "Padding mamba page size by 1.49%", "Available KV cache memory:
    55.26 GiB", "Maximum concurrency for 32,768 tokens per request: 83.20x"; the plan's KV room 56.4 GiB.
  gpuMemoryUtilization 0.55: "Available KV cache memory: 6.33 GiB", then "ValueError: max_num_seqs (1024)
    exceeds available Mamba cache blocks (609)"; the plan's KV room 7.26 GiB, and it said the model fits.
2026-12-03, Qwen's own config (`mamba_ssm_dtype: float32`): "Setting attention block size to 1056 tokens",
"Padding mamba page size by 0.76%"; bf16 at 0.9: 56.24 GiB, 79.77x; at 0.55 with --max-num-seqs 594:
8.70 GiB, "max_num_seqs (594) exceeds available Mamba cache blocks (432)"; the fp8 variant at 0.9:
87.40 GiB, 123.97x.
"""

from __future__ import annotations

import pytest

from components.plan.hybrid_cache import group_layout
from components.plan.memory import GIB, MIB, EngineKnobs, NodeMemory, engine_knobs, message, model_shape, plan_memory

H200 = NodeMemory("h200", 1, 143_771 * MIB, unified=False)  # nvidia-smi's memory.total on the lane's H200
SPARK = NodeMemory("spark-01", 1, 125_000_000 * 1024, unified=True)
WEIGHTS_35B = int(66.96 * GIB)  # the lane's sparse files for Qwen3.5-35B-A3B (the plan's weights figure)
LENGTH = 32768

QWEN35_35B_A3B = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"],
    "model_type": "qwen3_5_moe",
    "text_config": {
        "num_hidden_layers": 40,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "hidden_size": 2048,
        "full_attention_interval": 4,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "max_position_embeddings": 262144,
        "torch_dtype": "bfloat16",
    },
}
# As Qwen's own config.json has it: the recurrent state in float32.
QWEN35_35B_A3B_REAL = {**QWEN35_35B_A3B, "text_config": {**QWEN35_35B_A3B["text_config"], "mamba_ssm_dtype": "float32"}}


def plan(config=QWEN35_35B_A3B, utilization=0.9, nodes=(H200,), extra=(), max_num_seqs=None, tp=1, weights=WEIGHTS_35B):
    knobs = engine_knobs(list(extra))
    return plan_memory(
        list(nodes), weights, model_shape(config, knobs=knobs), tp, 1, LENGTH, utilization, 8 * GIB,
        knobs=knobs, max_num_seqs=max_num_seqs,
    )  # fmt: skip


def test_the_layout_is_what_vllm_logged_on_the_h200():
    cache = plan().hybrid
    assert cache.block_tokens == 544  # "Setting attention block size to 544 tokens"
    assert round(cache.padding_percent, 2) == 1.49  # "Padding mamba page size by 1.49%"
    assert (cache.group_size, cache.attention_groups, cache.state_groups) == (10, 1, 3)
    assert cache.page_bytes == 544 * 2 * 2 * 256 * 2  # K and V, 2 KV heads, head 256, bf16


def test_vllms_own_kv_room_gives_its_own_concurrency_and_block_count():
    cache = plan().hybrid
    blocks = cache.blocks(55.26 * GIB)  # vLLM's "Available KV cache memory" at 0.9
    assert blocks / cache.blocks_per_sequence(LENGTH) == pytest.approx(83.20, abs=0.01)  # vLLM: 83.20x
    assert cache.blocks(6.33 * GIB) == pytest.approx(609, abs=1)  # vLLM: "available Mamba cache blocks (609)"


@pytest.mark.parametrize(
    ("config", "room_gib", "concurrency", "blocks"),
    [(QWEN35_35B_A3B_REAL, 56.24, 79.77, None), (QWEN35_35B_A3B_REAL, 8.70, None, 432),
     (QWEN35_35B_A3B_REAL, 87.40, 123.97, None)],
)  # fmt: skip
def test_the_real_configs_layout_gives_vllms_own_figures_from_its_own_room(config, room_gib, concurrency, blocks):
    cache = plan(config).hybrid
    assert (cache.block_tokens, round(cache.padding_percent, 2)) == (1056, 0.76)  # as vLLM logged
    if concurrency is not None:
        assert cache.blocks(room_gib * GIB) / cache.blocks_per_sequence(LENGTH) == pytest.approx(concurrency, abs=0.01)
    if blocks is not None:
        assert cache.blocks(room_gib * GIB) == pytest.approx(blocks, abs=1)


def test_at_0_55_with_the_real_config_auto_sets_what_vllm_then_served_with():
    result = plan(QWEN35_35B_A3B_REAL, utilization=0.55)
    # vLLM started with it and served (2026-12-03, 51.7 s to ready); 594, the figure of a plan that read
    # the state as bf16, was refused: "max_num_seqs (594) exceeds available Mamba cache blocks (432)"
    assert result.set_max_num_seqs == 306 <= 432


def test_at_0_9_the_default_fits_and_nothing_is_set():
    result = plan(utilization=0.9)
    assert result.fits and result.set_max_num_seqs is None
    node = result.nodes[0]
    assert node.kv_room_gib == pytest.approx(56.4, abs=0.01) and node.cache_blocks == 5435
    assert node.max_sequences == 84  # vLLM: 83.20x from its own (2 % smaller) room
    assert result.seqs.wanted == 1024 and result.seqs.fits
    assert result.output()["hybridCache"]["blockTokens"] == 544


def test_at_0_55_auto_sets_what_the_blocks_hold_below_what_vllm_found():
    result = plan(utilization=0.55)
    assert result.fits
    assert result.nodes[0].cache_blocks == 699  # from the plan's 7.26 GiB
    assert result.set_max_num_seqs == 594 <= 609  # kept under what vLLM found (609): it starts
    assert result.output()["maxNumSeqs"] == {
        "wanted": 1024, "source": "vLLM 0.25.0's default max_num_seqs", "cacheBlocks": 699, "kept": 594, "checked": True,
        "set": 594,
    }  # fmt: skip
    (note,) = result.notes()
    assert "vLLM 0.25.0's default max_num_seqs is 1024, more than the 594 sequences" in note
    assert "--max-num-seqs=594" in note


@pytest.mark.parametrize(
    ("number", "extra", "source"),
    [(1024, (), "vllm.maxNumSeqs 1024"), (None, ("--max-num-seqs", "1024"), "--max-num-seqs in vllm.extraArgs 1024"),
     (None, ("--max_num_seqs=700",), "--max-num-seqs in vllm.extraArgs 700")],
)  # fmt: skip
def test_at_0_55_a_number_set_by_hand_is_refused_with_the_blocks_and_the_ways_out(number, extra, source):
    result = plan(utilization=0.55, max_num_seqs=number, extra=extra)
    assert not result.fits and result.set_max_num_seqs is None
    (problem,) = result.problems
    assert problem.startswith(f"h200: {source} exceeds the 699 Mamba cache blocks")
    assert "set vllm.maxNumSeqs to 594 or less" in problem and "--enforce-eager" in problem
    assert message(result).startswith("spark-vllm: the model does not fit (memoryCheck: enforce)")


def test_without_cuda_graphs_vllm_does_not_check_and_neither_does_the_plan():
    result = plan(utilization=0.55, max_num_seqs=1024, extra=("--enforce-eager",))
    assert result.fits and not result.seqs.checked and result.set_max_num_seqs is None


def test_the_real_config_keeps_its_recurrent_state_in_float32():
    cache = plan(QWEN35_35B_A3B_REAL).hybrid
    assert cache.state_page_bytes == 8192 * 3 * 2 + 32 * 128 * 128 * 4  # conv (kernel-1) bf16 + state fp32
    assert cache.block_tokens == 1056
    assert plan(QWEN35_35B_A3B_REAL, extra=("--mamba-ssm-cache-dtype", "bfloat16")).hybrid.block_tokens == 544


def test_tensor_parallel_splits_the_state_and_a_bigger_block_size_raises_the_alignment():
    assert plan(tp=2, nodes=(H200, H200)).hybrid.state_page_bytes == (8192 // 2) * 3 * 2 + 16 * 128 * 128 * 2
    assert plan(extra=("--block-size", "64")).hybrid.block_tokens == 576  # 64 × ceil(page / (64 × 2048))


def test_prefix_caching_takes_two_state_blocks_a_sequence():
    cache = plan(extra=("--enable-prefix-caching",)).hybrid
    assert cache.blocks_per_sequence(LENGTH) == 61 + 3 * 2


@pytest.mark.parametrize(
    ("memory", "extra", "default"),
    [(143_771 * MIB, (), 1024), (24 * GIB, (), 256), (125_000_000 * 1024, (), 1024),
     (143_771 * MIB, ("--performance-mode", "throughput"), 2048)],
)  # fmt: skip
def test_vllms_default_max_num_seqs_follows_the_gpus_memory(memory, extra, default):
    node = NodeMemory("n", 1, memory, unified=False)
    result = plan(nodes=(node,), extra=extra, weights=1 * GIB, utilization=0.5)
    assert result.seqs.wanted == default


def test_the_seed_recipe_on_two_sparks_fits_with_vllms_default():
    from tests.unit.test_memory import QWEN35_122B_FP8, QWEN35_122B_FP8_BYTES

    sparks = [SPARK, NodeMemory("spark-02", 1, 125_000_000 * 1024, unified=True)]
    result = plan(QWEN35_122B_FP8, nodes=sparks, tp=2, weights=QWEN35_122B_FP8_BYTES)
    assert result.fits and result.set_max_num_seqs is None
    assert result.hybrid.group_size == 12 and result.nodes[0].cache_blocks > 1024


@pytest.mark.parametrize(
    ("attention", "state", "layout"),
    [(10, 30, (10, 1, 3)), (12, 36, (12, 1, 3)), (13, 12, (13, 1, 1)), (8, 0, (8, 1, 0)), (15, 45, (15, 1, 3))],
)
def test_layers_are_grouped_as_vllm_groups_them(attention, state, layout):
    assert group_layout(attention, state) == layout


def test_the_knobs_are_read_in_any_spelling():
    knobs = engine_knobs(["--kv_cache_dtype=fp8", "--max_num_seqs", "64", "--enforce_eager", "--block_size=32"])
    assert knobs == EngineKnobs(kv_cache_dtype="fp8", block_size=32, enforce_eager=True, max_num_seqs=64)


def test_a_dense_models_plan_output_is_unchanged():
    from tests.unit.test_memory import LLAMA_31_8B, LLAMA_31_8B_BYTES

    result = plan(LLAMA_31_8B, weights=LLAMA_31_8B_BYTES)
    assert result.hybrid is None and result.seqs is None
    output = result.output()
    assert "hybridCache" not in output and "maxNumSeqs" not in output
    assert "cache_blocks" not in output["nodes"]["h200"]


def test_the_model_fingerprint_carries_what_the_hybrid_plan_reads(tmp_path):
    """Found on the H200: the fingerprint left out `mamba_ssm_dtype`, so the plan laid the cache out for a
    bf16 state (blocks of 544 tokens) where vLLM used float32 (1056): the plan's 594 was refused at 432."""
    import json
    import subprocess
    import sys

    from components.plan.programs import script

    (tmp_path / "config.json").write_text(json.dumps(QWEN35_35B_A3B_REAL))
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 64)
    out = subprocess.run(
        [sys.executable, "-", str(tmp_path)], input=script("model_fingerprint.py"), capture_output=True, text=True
    ).stdout
    facts = json.loads(out.strip().splitlines()[-1])
    shape = model_shape(facts["config"])
    assert shape.linear.ssm_bytes == 4 and shape.linear.conv_kernel == 4
    assert plan(facts["config"]).hybrid.block_tokens == 1056
