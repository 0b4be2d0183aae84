"""The memory plan against known outcomes, with the config.json values of public models (no weights).

Sources of the values: the models' config.json on Hugging Face (Llama-3.1-8B-Instruct,
Qwen3-30B-A3B); Qwen3.5-122B-A10B: 48 layers of which every 4th is full attention (12 keep a KV
cache), 2 KV heads of size 256, as the Qwen3.5 family's configs and model card describe it;
checkpoint sizes as published (rounded). A DGX Spark reports about 119.2 GiB of unified memory.
"""

from __future__ import annotations

import pytest

from components.plan.memory import (
    GIB,
    NodeMemory,
    kv_cache_dtype,
    message,
    model_shape,
    plan_memory,
)

SPARK = 125_000_000 * 1024  # MemTotal of a DGX Spark, bytes (unified: CPU and GPU share it)
OS_RESERVE = 8 * GIB

QWEN35_122B_FP8 = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"],
    "model_type": "qwen3_5_moe",
    "text_config": {
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "hidden_size": 3072,
        "full_attention_interval": 4,
        "linear_num_value_heads": 64,
        "linear_num_key_heads": 16,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "max_position_embeddings": 262144,
        "mamba_ssm_dtype": "float32",
        "torch_dtype": "bfloat16",
    },
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
}
QWEN35_122B_FP8_BYTES = 126_000_000_000

LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"],
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "hidden_size": 4096,
    "max_position_embeddings": 131072,
    "torch_dtype": "bfloat16",
}
LLAMA_31_8B_BYTES = 16_060_000_000

QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "hidden_size": 2048,
    "max_position_embeddings": 40960,
    "torch_dtype": "bfloat16",
}
QWEN3_30B_A3B_BYTES = 61_000_000_000


def sparks(count: int) -> list[NodeMemory]:
    return [NodeMemory(f"spark-0{i + 1}", 1, SPARK, unified=True) for i in range(count)]


def plan(config, weights, nodes, tp, pp=1, length=None, utilization=0.9, kv="auto"):
    return plan_memory(nodes, weights, model_shape(config, kv), tp, pp, length, utilization, OS_RESERVE)


def test_a_hybrid_model_counts_only_its_full_attention_layers():
    shape = model_shape(QWEN35_122B_FP8)
    assert (shape.layers, shape.kv_layers, shape.kv_heads, shape.head_dim) == (48, 12, 2, 256)
    assert shape.dtype_bytes == 2  # an fp8 checkpoint caches in bf16 unless --kv-cache-dtype says otherwise
    assert shape.linear is not None and shape.linear.value_heads == 64  # the linear layers keep a state
    assert model_shape(QWEN35_122B_FP8, "fp8").dtype_bytes == 1
    dense = model_shape({**QWEN35_122B_FP8["text_config"], "full_attention_interval": None})
    assert dense.kv_layers == 48
    typed = model_shape({**LLAMA_31_8B, "layer_types": ["linear_attention", "full_attention"] * 16})
    assert typed.kv_layers == 16


def test_the_seed_recipe_fits_on_two_sparks():
    result = plan(QWEN35_122B_FP8, QWEN35_122B_FP8_BYTES, sparks(2), tp=2, length=32768)
    assert result.fits, result.problems
    node = result.nodes[0]
    assert node.weights_gib == pytest.approx(58.67, abs=0.01)
    # per rank: 12 KV layers × K,V × 1 of 2 KV heads × 256 × 2 bytes = 12 KiB a token
    assert node.kv_per_token_mib == pytest.approx(12 * 2 * 1 * 256 * 2 / 2**20, abs=1e-6)
    assert node.budget_gib == pytest.approx(107.29, abs=0.01)
    assert node.max_sequences > 20 and node.headroom_gib > 40
    assert node.os_left_gib == pytest.approx(11.92, abs=0.01)


def test_the_same_model_with_tp1_on_one_spark_does_not_fit_and_says_what_would():
    result = plan(QWEN35_122B_FP8, QWEN35_122B_FP8_BYTES, sparks(1), tp=1, length=32768)
    assert not result.fits
    assert result.problems[0].startswith("spark-01: needs 121.26 GiB per GPU (weights 117.35 + KV for one 32768-token")
    assert "has 107.29 GiB (119.21 GiB × gpuMemoryUtilization 0.9)" in result.problems[0]
    assert any(s.startswith("2 GPUs or more") for s in result.suggestions)
    text = message(result)
    assert text.startswith("spark-vllm: the model does not fit (memoryCheck: enforce)")


def test_a_utilization_that_starves_the_os_on_unified_memory_is_a_problem():
    result = plan(QWEN35_122B_FP8, QWEN35_122B_FP8_BYTES, sparks(2), tp=2, length=32768, utilization=0.97)
    assert not result.fits
    assert "leaves the operating system 3.58 GiB of its 119.21 GiB unified memory" in result.problems[0]


def test_the_largest_max_model_len_suggested_is_exactly_the_one_that_fits():
    rtx = [NodeMemory("box", 1, 24 * GIB, unified=False)]
    result = plan(LLAMA_31_8B, LLAMA_31_8B_BYTES, rtx, tp=1, length=131072)
    assert not result.fits
    suggestion = next(s for s in result.suggestions if s.startswith("maxModelLen"))
    longest = int(suggestion.split()[1])
    assert plan(LLAMA_31_8B, LLAMA_31_8B_BYTES, rtx, tp=1, length=longest).fits
    assert not plan(LLAMA_31_8B, LLAMA_31_8B_BYTES, rtx, tp=1, length=longest + 1).fits
    assert result.nodes[0].os_left_gib is None  # a discrete GPU's memory is not the OS's


def test_a_dense_8b_and_a_small_moe_fit_on_one_spark_at_full_context():
    dense = plan(LLAMA_31_8B, LLAMA_31_8B_BYTES, sparks(1), tp=1)
    assert dense.fits and dense.max_model_len == 131072
    assert dense.nodes[0].kv_one_sequence_gib == pytest.approx(16.0, abs=0.01)  # 128 KiB a token
    moe = plan(QWEN3_30B_A3B, QWEN3_30B_A3B_BYTES, sparks(1), tp=1)
    assert moe.fits and moe.nodes[0].kv_per_token_mib == pytest.approx(0.09375)


def test_pipeline_parallel_splits_the_layers_and_fp8_kv_halves_the_cache():
    bf16 = plan(LLAMA_31_8B, LLAMA_31_8B_BYTES, sparks(2), tp=1, pp=2, length=8192)
    fp8 = plan(LLAMA_31_8B, LLAMA_31_8B_BYTES, sparks(2), tp=1, pp=2, length=8192, kv="fp8")
    assert bf16.nodes[0].kv_per_token_mib == pytest.approx(0.0625)  # 16 of 32 layers
    assert fp8.nodes[0].kv_per_token_mib == pytest.approx(0.03125)


def test_kv_cache_dtype_is_read_from_extra_args():
    assert kv_cache_dtype(["--max-num-seqs", "8"]) == "auto"
    assert kv_cache_dtype(["--kv-cache-dtype", "fp8"]) == "fp8"
    assert kv_cache_dtype(["--kv-cache-dtype=fp8_e5m2"]) == "fp8_e5m2"


def test_a_config_without_the_facts_is_named():
    with pytest.raises(ValueError, match="config.json has no num_hidden_layers"):
        model_shape({"architectures": ["Unknown"]})


def test_the_output_is_plain_data():
    output = plan(LLAMA_31_8B, LLAMA_31_8B_BYTES, sparks(1), tp=1, length=8192).output()
    assert output["fits"] is True and output["maxModelLen"] == 8192
    assert set(output["nodes"]["spark-01"]) >= {"weights_gib", "kv_per_token_mib", "kv_room_gib", "max_sequences"}
