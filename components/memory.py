"""The memory plan: will this model and context fit on these nodes? Pure arithmetic, no I/O.

Inputs are facts read on the nodes before anything starts: each node's memory (unified memory on a
GB10: the whole of /proc/meminfo's MemTotal, shared by CPU and GPU; else the GPUs' own memory), the
model's weight files (sizes from the model fingerprint) and its config.json. The estimate follows
how vLLM spends memory on each GPU:

* weights: every weight file, divided over the TP × PP ranks (vLLM shards tensors over TP and
  layers over PP; the small replicated parts are ignored);
* KV cache: per token, 2 (K and V) × KV heads on this rank (heads / TP, at least 1) × head size ×
  bytes per element, for the layers on this rank that keep a KV cache. Hybrid models (Qwen3.5,
  Qwen3-Next: linear attention with a full-attention layer every few) count only their
  full-attention layers; their linear-attention layers keep a fixed state per sequence instead,
  counted per sequence. vLLM needs room for at least one sequence of `maxModelLen` tokens;
* an allowance for the rest: CUDA context and NCCL buffers, activations of the largest batch, CUDA
  graphs (`ALLOWANCE_BYTES`, a round figure: vLLM measures the real one when it starts).

vLLM may use `gpuMemoryUtilization` × the memory. On unified memory that pool is also the operating
system's: what it leaves must cover `memory.osReserveGiB`, or the box swaps and freezes.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Optional

from components.vllm_args import read_extra_args

GIB = 1024**3
MIB = 1024**2
ALLOWANCE_BYTES = 3 * GIB  # per GPU: runtime (~1 GiB), activations (~1 GiB), CUDA graphs (~1 GiB)
DTYPE_BYTES = {
    "float32": 4, "float": 4, "fp32": 4,
    "bfloat16": 2, "float16": 2, "half": 2, "bf16": 2, "fp16": 2, "auto": 2,
    "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "fp8_inc": 1, "int8": 1,
}  # fmt: skip


class MemoryPlanError(Exception):
    """The model does not fit (memoryCheck: enforce). The message has the numbers and the ways out."""


@dataclass(frozen=True)
class ModelShape:
    """What config.json says about the KV cache and the recurrent state."""

    layers: int
    kv_layers: int  # layers that keep a KV cache
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    max_position: Optional[int]
    state_bytes_per_layer: int = 0  # linear-attention layers: recurrent + conv state per sequence

    @property
    def linear_layers(self) -> int:
        return self.layers - self.kv_layers


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    """Multimodal models (Qwen3.5, Qwen3-VL) keep the language model's settings under text_config."""
    inner = config.get("text_config") or config.get("llm_config") or {}
    return {**config, **inner}


def model_shape(config: dict[str, Any], kv_cache_dtype: str = "auto") -> ModelShape:
    """The KV-relevant facts of a config.json; ValueError naming what is missing."""
    text = _text_config(config)
    missing = [k for k in ("num_hidden_layers", "num_attention_heads") if not text.get(k)]
    if missing:
        raise ValueError(f"config.json has no {', '.join(missing)}")
    layers = int(text["num_hidden_layers"])
    heads = int(text["num_attention_heads"])
    kv_heads = int(text.get("num_key_value_heads") or heads)
    head_dim = int(text.get("head_dim") or (int(text["hidden_size"]) // heads if text.get("hidden_size") else 0))
    if not head_dim:
        raise ValueError("config.json has neither head_dim nor hidden_size")
    layer_types = text.get("layer_types")
    if isinstance(layer_types, list) and layer_types:
        kv_layers = sum(1 for kind in layer_types[:layers] if "linear" not in str(kind) and "mamba" not in str(kind))
    elif text.get("full_attention_interval"):
        kv_layers = layers // int(text["full_attention_interval"])
    else:
        kv_layers = layers
    model_dtype = str(text.get("torch_dtype") or text.get("dtype") or config.get("torch_dtype") or "bfloat16")
    if kv_cache_dtype == "auto":
        # An fp8-quantized model still computes (and caches) in 16 bits unless told otherwise.
        dtype_bytes = max(2, DTYPE_BYTES.get(model_dtype, 2))
    else:
        dtype_bytes = DTYPE_BYTES.get(kv_cache_dtype, 2)
    state = 0
    if kv_layers < layers and text.get("linear_num_value_heads"):
        value_heads = int(text["linear_num_value_heads"])
        key_dim = int(text.get("linear_key_head_dim") or 128)
        value_dim = int(text.get("linear_value_head_dim") or 128)
        conv = int(text.get("linear_conv_kernel_dim") or 4)
        key_heads = int(text.get("linear_num_key_heads") or value_heads)
        conv_channels = 2 * key_heads * key_dim + value_heads * value_dim
        state = value_heads * key_dim * value_dim * 4 + conv_channels * conv * 2  # fp32 state, 16-bit conv
    max_position = text.get("max_position_embeddings")
    return ModelShape(
        layers, kv_layers, kv_heads, head_dim, dtype_bytes, int(max_position) if max_position else None, state
    )


def kv_cache_dtype(extra_args: list[str]) -> str:
    """`--kv-cache-dtype` from vllm.extraArgs in any spelling vLLM reads (`--kv_cache_dtype=fp8`), else "auto"."""
    return read_extra_args(extra_args).value_of("--kv-cache-dtype", extra_args) or "auto"


@dataclass(frozen=True)
class NodeMemory:
    name: str
    gpus: int
    memory_bytes: int  # what vLLM's fraction is taken of, per GPU
    unified: bool  # shared with the operating system (GB10)
    free_bytes: Optional[int] = None  # free now, per GPU (None: not known, or held by this stack's vLLM)


@dataclass(frozen=True)
class NodePlan:
    node: str
    memory_gib: float
    budget_gib: float  # what vLLM may use per GPU
    weights_gib: float
    kv_per_token_mib: float
    kv_one_sequence_gib: float
    allowance_gib: float
    kv_room_gib: float  # budget − weights − allowance: what the KV cache gets
    max_sequences: int  # full-length sequences the KV room holds
    headroom_gib: float  # budget − (weights + one sequence + allowance)
    os_left_gib: Optional[float]  # unified memory: what vLLM's fraction leaves the OS
    fits: bool
    free_gib: Optional[float] = None  # free on the node now (vLLM's start-up check wants the budget free)


@dataclass(frozen=True)
class Plan:
    nodes: list[NodePlan]
    max_model_len: int
    problems: list[str]
    suggestions: list[str]

    @property
    def fits(self) -> bool:
        return not self.problems

    def output(self) -> dict[str, Any]:
        """The `memoryPlan` stack output."""
        return {
            "fits": self.fits,
            "maxModelLen": self.max_model_len,
            "nodes": {plan.node: {k: v for k, v in asdict(plan).items() if k != "node"} for plan in self.nodes},
            "suggestions": self.suggestions,
        }


def _gib(value: float) -> float:
    return round(value / GIB, 2)


def plan_memory(
    nodes: list[NodeMemory],
    weight_bytes: int,
    shape: ModelShape,
    tensor_parallel: int,
    pipeline_parallel: int,
    max_model_len: Optional[int],
    gpu_memory_utilization: float,
    os_reserve_bytes: int,
    allowance_bytes: int = ALLOWANCE_BYTES,
) -> Plan:
    """The plan for every node, the problems that stop the deploy, and the ways out."""
    ranks = tensor_parallel * pipeline_parallel
    length = max_model_len or shape.max_position or 0
    weights = weight_bytes / ranks
    kv_layers_per_rank = math.ceil(shape.kv_layers / pipeline_parallel)
    state_layers_per_rank = math.ceil(shape.linear_layers / pipeline_parallel)
    kv_heads_per_rank = max(1, shape.kv_heads // tensor_parallel)
    per_token = 2 * kv_heads_per_rank * shape.head_dim * shape.dtype_bytes * kv_layers_per_rank
    per_sequence_state = shape.state_bytes_per_layer * state_layers_per_rank / tensor_parallel
    one_sequence = per_token * length + per_sequence_state
    plans, problems = [], []
    for node in nodes:
        budget = node.memory_bytes * gpu_memory_utilization
        room = budget - weights - allowance_bytes
        headroom = room - one_sequence
        os_left = node.memory_bytes * node.gpus * (1 - gpu_memory_utilization) if node.unified else None
        starved = os_left is not None and os_left < os_reserve_bytes
        # vLLM's own start-up check (vllm/v1/worker/utils.py request_memory): free memory at start must
        # be at least gpuMemoryUtilization × total, or it exits ("Free memory on device … on startup …").
        busy = node.free_bytes is not None and node.free_bytes < budget
        plan = NodePlan(
            node=node.name,
            memory_gib=_gib(node.memory_bytes),
            budget_gib=_gib(budget),
            weights_gib=_gib(weights),
            kv_per_token_mib=round(per_token / MIB, 6),
            kv_one_sequence_gib=_gib(one_sequence),
            allowance_gib=_gib(allowance_bytes),
            kv_room_gib=_gib(room),
            max_sequences=max(0, int(room // one_sequence)) if one_sequence > 0 else 0,
            headroom_gib=_gib(headroom),
            os_left_gib=None if os_left is None else _gib(os_left),
            fits=headroom >= 0 and not starved and not busy,
            free_gib=None if node.free_bytes is None else _gib(node.free_bytes),
        )
        plans.append(plan)
        need = weights + one_sequence + allowance_bytes
        if headroom < 0:
            problems.append(
                f"{node.name}: needs {_gib(need)} GiB per GPU (weights {plan.weights_gib} + KV for one "
                f"{length}-token sequence {plan.kv_one_sequence_gib} + allowance {plan.allowance_gib}), "
                f"has {plan.budget_gib} GiB ({plan.memory_gib} GiB × gpuMemoryUtilization {gpu_memory_utilization})"
            )
        if busy:
            where = "of its unified memory (MemAvailable)" if node.unified else "of GPU memory"
            problems.append(
                f"{node.name}: {plan.free_gib} GiB {where} is free now, and vLLM's start-up check needs "
                f"gpuMemoryUtilization {gpu_memory_utilization} × {plan.memory_gib} GiB = {plan.budget_gib} GiB "
                "free (something else holds it: `nvidia-smi` on the node shows what; stop it, or lower "
                "vllm.gpuMemoryUtilization)"
            )
        if starved:
            problems.append(
                f"{node.name}: gpuMemoryUtilization {gpu_memory_utilization} leaves the operating system "
                f"{plan.os_left_gib} GiB of its {plan.memory_gib} GiB unified memory, less than "
                f"memory.osReserveGiB {_gib(os_reserve_bytes)} (the box would swap and freeze)"
            )
    suggestions = _ways_out(
        nodes, weights, per_token, per_sequence_state, allowance_bytes, gpu_memory_utilization, os_reserve_bytes,
        weight_bytes, ranks,
    ) if problems else []  # fmt: skip
    return Plan(plans, length, problems, suggestions)


def _ways_out(
    nodes: list[NodeMemory],
    weights: float,
    per_token: float,
    state: float,
    allowance: int,
    utilization: float,
    os_reserve: int,
    weight_bytes: int,
    ranks: int,
) -> list[str]:
    ways = []
    smallest = min(nodes, key=lambda n: n.memory_bytes)
    budget = smallest.memory_bytes * utilization
    if per_token > 0:
        longest = int((budget - weights - allowance - state) // per_token)
        if longest >= 1:
            ways.append(f"maxModelLen {longest} or less fits at gpuMemoryUtilization {utilization}")
    most = 1 - os_reserve / smallest.memory_bytes if smallest.unified else 0.95
    need = weights + allowance + state + per_token
    wanted = need / smallest.memory_bytes
    if wanted <= most:
        ways.append(
            f"gpuMemoryUtilization {math.ceil(wanted * 100) / 100:.2f} would fit one token of context; "
            f"at most {most:.2f} leaves the OS memory.osReserveGiB"
        )
    per_gpu = smallest.memory_bytes * min(utilization, most) - allowance
    if per_gpu > 0:
        gpus_needed = math.ceil(weight_bytes / per_gpu)
        if gpus_needed > ranks:
            ways.append(f"{gpus_needed} GPUs or more (nodes like {smallest.name}) hold the weights alone")
    return ways


def message(plan: Plan) -> str:
    lines = ["spark-vllm: the model does not fit (memoryCheck: enforce); nothing was started:"]
    lines += [f"  - {problem}" for problem in plan.problems]
    if plan.suggestions:
        lines.append("  ways out: " + "; ".join(plan.suggestions))
    return "\n".join(lines)
