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
    (model / "config.json").write_text(json.dumps({**config, "bos_token_id": eos, "eos_token_id": eos}, indent=1))
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": eos, "do_sample": False}))
    for index in range(WEIGHT_FILES):
        with open(model / f"model-{index + 1:05d}-of-{WEIGHT_FILES:05d}.safetensors", "wb") as handle:
            handle.truncate(weight_bytes // WEIGHT_FILES)  # sparse: the size the memory plan reads, no disk
    return model
