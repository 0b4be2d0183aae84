"""Models for the GPU lane without a download: a real architecture's config.json, a small BPE tokenizer
trained here with `tokenizers`, a chat template, and sparse weight files of the real size.

vLLM serves them with `--load-format dummy` (random weights of the real shapes, so memory, kernels,
torch.compile and CUDA graphs are what the real model gets); the memory plan reads the weight files'
sizes as it would on a node (they are sparse: they take no disk). The chat template opens `<think>`
in the prompt, as Qwen3.5's does, so with `--reasoning-parser qwen3` a short answer is all reasoning.
"""

from __future__ import annotations

import json
from pathlib import Path

SHAPES = {
    # Qwen/Qwen3-8B's config.json (the keys vLLM and the memory plan read), 16.4 GB of bf16 weights
    "qwen3-8b": (
        {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "hidden_size": 4096,
            "intermediate_size": 12288,
            "num_hidden_layers": 36,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "max_position_embeddings": 40960,
            "rms_norm_eps": 1e-06,
            "rope_theta": 1000000,
            "hidden_act": "silu",
            "attention_bias": False,
            "tie_word_embeddings": False,
            "vocab_size": 151936,
            "torch_dtype": "bfloat16",
        },
        16_381_470_720,
    ),
    # Qwen/Qwen3-30B-A3B's config.json: a mixture of experts, 61.1 GB of bf16 weights
    "qwen3-30b-a3b": (
        {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "moe_intermediate_size": 768,
            "num_hidden_layers": 48,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "max_position_embeddings": 40960,
            "rms_norm_eps": 1e-06,
            "rope_theta": 1000000,
            "hidden_act": "silu",
            "attention_bias": False,
            "tie_word_embeddings": False,
            "output_router_logits": False,
            "router_aux_loss_coef": 0.001,
            "vocab_size": 151936,
            "torch_dtype": "bfloat16",
        },
        61_064_448_000,
    ),
}


def _qwen35_moe(quantized: bool) -> dict:
    """Qwen/Qwen3.5-35B-A3B's config.json (the keys vLLM and the memory plan read): a hybrid of Gated
    DeltaNet layers and a full-attention layer every 4th, a mixture of experts, registered in vLLM 0.25 as
    multimodal (served text-only with --language-model-only). Its recurrent state is float32
    (`mamba_ssm_dtype`), as in Qwen's own config. `quantized`: block-quantized fp8, as
    Qwen3.5-122B-A10B-FP8's `quantization_config` is."""
    text = {
        "model_type": "qwen3_5_moe_text",
        "hidden_size": 2048,
        "num_hidden_layers": 40,
        "layer_types": ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(40)],
        "full_attention_interval": 4,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "attn_output_gate": True,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "vocab_size": 248320,
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-06,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
        "mamba_ssm_dtype": "float32",
        "dtype": "bfloat16",
    }
    config = {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "text_config": text,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
    }
    if quantized:
        config["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
            "modules_to_not_convert": [
                "lm_head",
                "mlp.gate",
                "mlp.shared_expert_gate",
                "linear_attn.in_proj_a",
                "linear_attn.in_proj_b",
            ],  # fmt: skip
        }
    return config


# Checkpoint sizes: 71.9 GB for the bf16 weights (the size the earlier lane run's plan read, 66.96 GiB);
# for fp8, the experts and projections (33.5 B parameters) in one byte, embeddings and lm_head (1.0 B) in
# two, block scales and the vision tower besides: about 36.5 GB.
SHAPES["qwen3.5-35b-a3b"] = (_qwen35_moe(False), 71_900_000_000)
SHAPES["qwen3.5-35b-a3b-fp8"] = (_qwen35_moe(True), 36_500_000_000)
# The same with the multi-token-prediction head Qwen3.5/3.6 checkpoints ship (their config.json's
# `mtp_num_hidden_layers: 1`): vLLM 0.25 serves it as the drafter of `--speculative-config
# '{"method":"mtp",…}'` (Qwen3_5MoeMTP). The checkpoint size above already holds its weights.
SHAPES["qwen3.5-35b-a3b-mtp"] = (
    {**_qwen35_moe(False), "text_config": {**_qwen35_moe(False)["text_config"], "mtp_num_hidden_layers": 1,
                                           "mtp_use_dedicated_embeddings": False}},
    71_900_000_000,
)  # fmt: skip
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"]
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}"
)
WEIGHT_FILES = 4


def corpus() -> list[str]:
    words = ("ready reply with the single word model serve node fabric ray head worker token cache memory "
             "graph compile kernel tensor parallel pipeline quick brown fox jumps over lazy dog").split()  # fmt: skip
    return [" ".join(words[(i * 7 + j) % len(words)] for j in range(12)) for i in range(400)]


def tokenizer_files(into: Path, vocab: int = 2048) -> int:
    """tokenizer.json (byte-level BPE) and tokenizer_config.json; returns the id of <|im_end|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(corpus(), trainer)
    tokenizer.save(str(into / "tokenizer.json"))
    (into / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "model_max_length": 131072,
                "chat_template": CHAT_TEMPLATE,
            },
            indent=1,
        )
    )
    return tokenizer.token_to_id("<|im_end|>")


def make_model(kind: str, into: Path) -> Path:
    """The model directory `into/<kind>` (made once)."""
    config, weight_bytes = SHAPES[kind]
    model = into / kind
    if (model / "config.json").exists():
        return model
    model.mkdir(parents=True, exist_ok=True)
    eos = tokenizer_files(model)
    ids = {"bos_token_id": eos, "eos_token_id": eos}
    if "text_config" in config:  # multimodal: the language model's own ids too
        config = {**config, "text_config": {**config["text_config"], **ids}}
    (model / "config.json").write_text(json.dumps({**config, **ids}, indent=1))
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": eos, "do_sample": False}))
    for index in range(WEIGHT_FILES):
        with open(model / f"model-{index + 1:05d}-of-{WEIGHT_FILES:05d}.safetensors", "wb") as handle:
            handle.truncate(weight_bytes // WEIGHT_FILES)  # sparse: the size the memory plan reads, no disk
    return model
