"""Speculative decoding (vllm.speculative) against the model it runs on. Pure: no I/O.

vLLM 0.25 proposes tokens with the model's own multi-token-prediction (MTP) layers when the method is
`mtp`: its checkpoint must ship them (config.json's `mtp_num_hidden_layers` for Qwen3.5/3.6 and
Qwen3-Next's successors, `num_nextn_predict_layers` for DeepSeek-V3, GLM-4.5, Qwen3-Next, MiMo…,
`num_mtp_modules` for MiniMax: vllm/config/speculative.py `hf_config_override`, where each becomes
`n_predict`), and more tokens than those layers must be a multiple of them ("num_speculative_tokens:N
must be divisible by n_predict=M", vllm/config/speculative.py `__post_init__`). Both are known once the
head reported the model's config.json (its fingerprint), before any container starts.
"""

from __future__ import annotations

from typing import Any, Optional

from components.plan.engine import Speculation

# config.json's keys for the MTP layers a checkpoint ships, in the order vLLM 0.25 reads them
MTP_LAYER_KEYS = ("mtp_num_hidden_layers", "num_nextn_predict_layers", "num_mtp_modules")


class SpeculationError(Exception):
    """vllm.speculative cannot run on this model. The message names the key and the fix."""


def mtp_layers(config: dict[str, Any]) -> int:
    """The MTP layers config.json declares (0: none); a multimodal model keeps them under text_config."""
    for where in (config.get("text_config") or {}, config):
        for key in MTP_LAYER_KEYS:
            value = where.get(key) if isinstance(where, dict) else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return 0


def speculation_problems(config: dict[str, Any], speculative: Optional[Speculation], key: str) -> list[str]:
    """What vLLM would refuse of `speculative` (the release's settings) on the model of `config`, each
    with `key` (vllm.speculative, or a deployment's) and the fix."""
    if speculative is None or speculative.method != "mtp":
        return []
    tokens = speculative.tokens
    layers = mtp_layers(config)
    architecture = ", ".join(config.get("architectures") or []) or "this model"
    if layers == 0:
        return [
            f"{key}.method: 'mtp' — a model whose config.json has MTP layers ({' or '.join(MTP_LAYER_KEYS)}); "
            f"{architecture}'s has none, so vLLM has nothing to propose tokens with: use method ngram, a checkpoint "
            f"that ships its MTP head (Qwen3.5/3.6, Qwen3-Next, DeepSeek-V3…), or remove {key}"
        ]
    if tokens > layers and tokens % layers:
        fits = sorted({layers, tokens - tokens % layers, tokens - tokens % layers + layers} - {0})
        return [
            f"{key}.tokens: {tokens} — at most {layers} or a multiple of {layers}: {architecture} has {layers} MTP "
            f"layers, and vLLM runs them over again for more tokens only in whole rounds (it refuses "
            f"'num_speculative_tokens:{tokens} must be divisible by n_predict={layers}'); e.g. "
            + " or ".join(map(str, fits))
        ]
    return []


def message(problems: list[str]) -> str:
    lines = ["spark-vllm: vllm.speculative cannot run on this model; nothing was started:"]
    return "\n".join(lines + [f"  - {line}" for line in problems])
