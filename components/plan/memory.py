"""The memory plan: will this model and context fit on these nodes? Pure arithmetic, no I/O.

Inputs are facts read on the nodes before anything starts: each node's memory (unified memory on a
GB10: the whole of /proc/meminfo's MemTotal, shared by CPU and GPU; else the GPUs' own memory), the
model's weight files (sizes from the model fingerprint) and its config.json. The estimate follows
how vLLM spends memory on each GPU:

* weights: every weight file, divided over the TP × PP ranks (vLLM shards tensors over TP and
  layers over PP; the small replicated parts are ignored);
* KV cache: per token, 2 (K and V) × KV heads on this rank (heads / TP, at least 1) × head size ×
  bytes per element, for the layers on this rank that keep a KV cache. Hybrid models (Qwen3.5,
  Qwen3-Next: linear attention with a full-attention layer every few) share one pool of blocks
  between their full-attention layers and their linear layers' fixed state, laid out as vLLM lays
  it out (components/plan/hybrid_cache.py); their max_num_seqs is held against the pool's blocks.
  vLLM needs room for at least one sequence of `maxModelLen` tokens;
* an allowance for the rest: CUDA context and NCCL buffers, activations of the largest batch, CUDA
  graphs (`ALLOWANCE_BYTES`, a round figure: vLLM measures the real one when it starts).

vLLM may use `gpuMemoryUtilization` × the memory. On unified memory that pool is also the operating
system's: what it leaves must cover `memory.osReserveGib`, or the box swaps and freezes.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from components.config.vllm_args import read_extra_args
from components.config.vllm_versions import OLDEST, VllmRules
from components.config.vllm_versions import rules as vllm_rules
from components.plan.engine import Speculation
from components.plan.hybrid_cache import (
    HybridCache,
    LinearAttention,
    SeqsVerdict,
    default_max_num_seqs,
    hybrid_cache,
    seqs_verdict,
)
from components.plan.speculation import mtp_layers

GIB = 1024**3
MIB = 1024**2
ALLOWANCE_BYTES = 3 * GIB  # per GPU: runtime (~1 GiB), activations (~1 GiB), CUDA graphs (~1 GiB)
# A KV cache set in bytes (a replica sharing its GPU) is not sized by profiling, so what vLLM holds besides it
# is on top of it: its CUDA context (taken before vLLM's start snapshot, so outside gpuMemoryUtilization even when
# profiled), the sampler's and activations' peak, CUDA graphs' pool. Seen on the H200 (2026-12-03, vLLM 0.25.0,
# --enforce-eager, a Qwen3-8B and a Qwen3-30B-A3B shape at 0.30 + 0.55 pinned to the 3 GiB allowance alone):
# 121.95 GiB in use against 119.34 GiB of budgets, 1.3 GiB a vLLM over; CUDA graphs add their pool (~0.6 GiB
# for the 8B: vLLM's own "0.9 behaves as 0.8954"). So pinned, the allowance is 2 GiB more.
PINNED_OUTSIDE_BYTES = 2 * GIB
# A hybrid model (Gated DeltaNet beside attention) profiles a larger peak than the allowance, growing with
# max_num_seqs × the vocabulary: what vLLM held besides its weights and KV cache on the H200 (vLLM 0.25.0, a
# Qwen3.5-35B-A3B shape, vocabulary 248,320: tests/gpu/results/2026-12-03 and -04) was 5.43 GiB (bf16) and
# 5.55 GiB (fp8) at max_num_seqs 1024, 2.28 GiB at 256: about HYBRID_PROFILE_BASE plus HYBRID_PROFILE_BYTES a
# sequence and vocabulary entry. Without it the plan came 2.2 % (H200) and 5.6 % (H100, 2026-12-06) above vLLM's KV
# cache for the fp8 shape: the unsafe side. Dense and MoE models stay within the allowance (Qwen3-8B 2.05 GiB,
# Qwen3-30B-A3B 4.10 GiB: 1.7 % under the plan's KV).
HYBRID_PROFILE_BASE = int(1.33 * GIB)
HYBRID_PROFILE_BYTES = 16.0
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
    linear: Optional[LinearAttention] = None  # a hybrid model's linear-attention layers (components.plan.hybrid_cache)
    mtp_layers: int = 0  # the checkpoint's multi-token-prediction layers (each one more full-attention layer)
    vocab_size: int = 0

    @property
    def linear_layers(self) -> int:
        return self.layers - self.kv_layers


@dataclass(frozen=True)
class EngineKnobs:
    """The engine settings in vllm.extraArgs that change how vLLM spends memory."""

    kv_cache_dtype: str = "auto"
    mamba_cache_dtype: str = "auto"
    mamba_ssm_cache_dtype: str = "auto"
    block_size: Optional[int] = None
    prefix_caching: Optional[bool] = None
    mamba_cache_mode: Optional[str] = None
    enforce_eager: bool = False
    max_num_seqs: Optional[int] = None
    throughput: bool = False
    speculative: Optional[Speculation] = None  # vllm.speculative (the release's), not extraArgs
    # the rules of the vLLM the image holds (its defaults: block size, hybrid prefix caching, max_num_seqs' tier)
    vllm: VllmRules = field(default_factory=lambda: vllm_rules(OLDEST))

    @property
    def hybrid_prefix_caching(self) -> bool:
        """Whether a hybrid model runs with prefix caching (its state in "align" mode): as extraArgs say, else that
        vLLM's default (0.26 on: on). `--mamba-cache-mode align`/`all` asks for it too (0.25–0.33)."""
        if self.prefix_caching is not None:
            return self.prefix_caching
        return self.vllm.hybrid_prefix_caching or self.mamba_cache_mode in ("align", "all")

    @property
    def drafts(self) -> int:
        """Tokens proposed a step: vLLM gives each its own state block a sequence (any method)."""
        return self.speculative.tokens if self.speculative is not None else 0


def engine_knobs(
    extra_args: list[str], speculative: Optional[Speculation] = None, vllm: Optional[VllmRules] = None
) -> EngineKnobs:
    """EngineKnobs from extraArgs, in any spelling vLLM reads (`--kv_cache_dtype=fp8`), the release's
    vllm.speculative settings, and `vllm`: the rules of the image's vLLM (default: the oldest supported)."""
    read = read_extra_args(extra_args)

    def value(flag: str) -> Optional[str]:
        return read.value_of(flag, extra_args)

    def number(flag: str) -> Optional[int]:
        text = value(flag)
        return int(text) if text is not None and text.isdigit() else None

    prefix = read.switch("prefix_caching")
    return EngineKnobs(
        kv_cache_dtype=value("--kv-cache-dtype") or "auto",
        mamba_cache_dtype=value("--mamba-cache-dtype") or "auto",
        mamba_ssm_cache_dtype=value("--mamba-ssm-cache-dtype") or "auto",
        block_size=number("--block-size"),
        prefix_caching=prefix,
        mamba_cache_mode=value("--mamba-cache-mode"),
        enforce_eager=read.has("--enforce-eager"),
        max_num_seqs=number("--max-num-seqs"),
        throughput=value("--performance-mode") == "throughput",
        speculative=speculative,
        vllm=vllm or vllm_rules(OLDEST),
    )


def kv_cache_dtype(extra_args: list[str]) -> str:
    """`--kv-cache-dtype` from vllm.extraArgs in any spelling vLLM reads (`--kv_cache_dtype=fp8`), else "auto"."""
    return engine_knobs(extra_args).kv_cache_dtype


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    """Multimodal models (Qwen3.5, Qwen3-VL) keep the language model's settings under text_config."""
    inner = config.get("text_config") or config.get("llm_config") or {}
    return {**config, **inner}


def _dtype_bytes(name: Any, default: int = 2) -> int:
    return DTYPE_BYTES.get(str(name), default)


def model_shape(
    config: dict[str, Any], kv_cache_dtype: str = "auto", knobs: Optional[EngineKnobs] = None
) -> ModelShape:
    """The KV-relevant facts of a config.json; ValueError naming what is missing."""
    knobs = knobs or EngineKnobs(kv_cache_dtype=kv_cache_dtype)
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
    # An fp8-quantized checkpoint still computes (and caches) in 16 bits unless told otherwise: vLLM's
    # model dtype is the config's torch_dtype, and the "auto" cache dtypes follow it.
    compute_bytes = max(2, _dtype_bytes(model_dtype))
    dtype_bytes = compute_bytes if knobs.kv_cache_dtype == "auto" else _dtype_bytes(knobs.kv_cache_dtype)
    linear = None
    if kv_layers < layers and text.get("linear_num_value_heads"):
        value_heads = int(text["linear_num_value_heads"])
        conv_bytes = compute_bytes if knobs.mamba_cache_dtype == "auto" else _dtype_bytes(knobs.mamba_cache_dtype)
        ssm = knobs.mamba_ssm_cache_dtype
        if ssm == "auto":
            ssm = text.get("mamba_ssm_dtype") or "auto"  # Qwen3.5's config names its recurrent state's dtype
        linear = LinearAttention(
            key_heads=int(text.get("linear_num_key_heads") or value_heads),
            value_heads=value_heads,
            key_dim=int(text.get("linear_key_head_dim") or 128),
            value_dim=int(text.get("linear_value_head_dim") or 128),
            conv_kernel=int(text.get("linear_conv_kernel_dim") or 4),
            conv_bytes=conv_bytes,
            ssm_bytes=conv_bytes if ssm == "auto" else _dtype_bytes(ssm, 4),
        )
    max_position = text.get("max_position_embeddings")
    return ModelShape(
        layers,
        kv_layers,
        kv_heads,
        head_dim,
        dtype_bytes,
        int(max_position) if max_position else None,
        linear,
        mtp_layers=mtp_layers(config),
        vocab_size=int(text.get("vocab_size") or 0),
    )


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
    cache_blocks: Optional[int] = None  # a hybrid model: the blocks of vLLM's shared pool the room holds

    def output(self) -> dict[str, Any]:
        # cache_blocks only where there is one: a dense model's plan reads as it always did
        return {k: v for k, v in asdict(self).items() if k != "node" and (k != "cache_blocks" or v is not None)}


@dataclass(frozen=True)
class Plan:
    nodes: list[NodePlan]
    max_model_len: int
    problems: list[str]
    suggestions: list[str]
    hybrid: Optional[HybridCache] = None
    seqs: Optional[SeqsVerdict] = None
    set_max_num_seqs: Optional[int] = None  # vllm.maxNumSeqs auto: what --max-num-seqs the plan sets
    kv_cache_bytes: Optional[int] = None  # pinned (--kv-cache-memory-bytes): a replica that shares its GPU
    speculation: Optional[SpeculationCost] = None  # vllm.speculative on: what drafting adds

    @property
    def fits(self) -> bool:
        return not self.problems

    def output(self) -> dict[str, Any]:
        """The `memoryPlan` stack output."""
        output = {
            "fits": self.fits,
            "maxModelLen": self.max_model_len,
            "nodes": {plan.node: plan.output() for plan in self.nodes},
            "suggestions": self.suggestions,
        }
        if self.hybrid is not None:
            output["hybridCache"] = self.hybrid.output()
        if self.speculation is not None:
            output["speculative"] = self.speculation.output()
        if self.kv_cache_bytes is not None:
            output["kvCache"] = {"pinnedBytes": self.kv_cache_bytes, "pinnedGib": _gib(self.kv_cache_bytes)}
        if self.seqs is not None:
            output["maxNumSeqs"] = {
                "wanted": self.seqs.wanted,
                "source": self.seqs.source,
                "cacheBlocks": self.seqs.blocks,
                "kept": self.seqs.kept,
                "checked": self.seqs.checked,
                "set": self.set_max_num_seqs,
            }
        return output

    def notes(self) -> list[str]:
        """What the plan decided that the user should see in `pulumi up` (not a problem)."""
        found = []
        if self.kv_cache_bytes is not None:
            found.append(
                f"memory plan: this replica shares its GPU with another, so its KV cache is pinned at "
                f"{_gib(self.kv_cache_bytes)} GiB (--kv-cache-memory-bytes={self.kv_cache_bytes}, the plan's KV room): "
                "vLLM then skips the memory profiling that a neighbour starting or stopping beside it would upset"
            )
        if self.set_max_num_seqs is not None and self.seqs is not None:
            found.append(
                f"memory plan: {self.seqs.source} is {self.seqs.wanted}, more than the {self.seqs.kept} sequences the "
                f"hybrid cache's {self.seqs.blocks} blocks keep (vLLM would refuse to start: max_num_seqs exceeds "
                f"available Mamba cache blocks), so vllm.maxNumSeqs auto sets --max-num-seqs={self.set_max_num_seqs}"
            )
        return found


def _gib(value: float) -> float:
    return round(value / GIB, 2)


@dataclass(frozen=True)
class _Cost:
    """What sequences cost on one rank: dense (per token) or hybrid (blocks of the shared pool)."""

    per_token: float
    hybrid: Optional[HybridCache]

    def one_sequence(self, tokens: int) -> float:
        if self.hybrid is None:
            return self.per_token * tokens
        return self.hybrid.blocks_per_sequence(tokens) * self.hybrid.block_bytes

    def sequences(self, room: float, tokens: int) -> int:
        if self.hybrid is None:
            cost = self.one_sequence(tokens)
            return max(0, int(room // cost)) if cost > 0 else 0
        return self.hybrid.blocks(room) // self.hybrid.blocks_per_sequence(tokens)

    def longest(self, room: float) -> int:
        """The longest sequence the room holds (0: none)."""
        if self.hybrid is None:
            return int(room // self.per_token) if self.per_token > 0 else 0
        cache = self.hybrid
        spare = cache.blocks(room) - cache.state_groups * cache.state_blocks_per_sequence
        return max(0, spare // cache.attention_groups) * cache.block_tokens


def _rank_cost(
    shape: ModelShape, knobs: EngineKnobs, tensor_parallel: int, pipeline_parallel: int, drafting: SpeculationCost
) -> _Cost:
    """What a sequence costs on the rank that holds the most layers: per token, or a hybrid model's blocks."""
    # the MTP head's layers sit on the last rank: counted on every rank, the most any rank holds
    kv_layers_per_rank = math.ceil(shape.kv_layers / pipeline_parallel) + drafting.attention_layers
    kv_heads_per_rank = max(1, shape.kv_heads // tensor_parallel)
    layer_token = 2 * kv_heads_per_rank * shape.head_dim * shape.dtype_bytes  # one layer's K and V, one token
    cache = None
    if shape.linear is not None and kv_layers_per_rank > 0:
        cache = hybrid_cache(
            shape.linear,
            kv_layers_per_rank,
            math.ceil(shape.linear_layers / pipeline_parallel),
            layer_token,
            tensor_parallel,
            block_tokens=knobs.block_size or knobs.vllm.default_block_tokens,
            # prefix caching keeps two states a sequence (mamba cache mode "align"; "all", which vLLM 0.26-0.27 picks
            # where the model supports it, is counted the same: the plan's figure is then approximate), and from
            # 0.33 one more for a prefill checkpoint (Qwen's Gated DeltaNet layers): counted where it may be
            prefix_caching=knobs.hybrid_prefix_caching,
            drafts=knobs.drafts,
            checkpoints=knobs.vllm.align_checkpoint_blocks,
        )
    return _Cost(layer_token * kv_layers_per_rank, cache)


def _node_plan(
    node: NodeMemory,
    weights: float,
    allowance_bytes: int,
    cost: _Cost,
    length: int,
    gpu_memory_utilization: float,
    os_reserve_bytes: int,
) -> tuple[NodePlan, list[str]]:
    """One node's plan and what of it stops the deploy."""
    one_sequence = cost.one_sequence(length)
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
        kv_per_token_mib=round(cost.per_token / MIB, 6),
        kv_one_sequence_gib=_gib(one_sequence),
        allowance_gib=_gib(allowance_bytes),
        kv_room_gib=_gib(room),
        max_sequences=cost.sequences(room, length),
        headroom_gib=_gib(headroom),
        os_left_gib=None if os_left is None else _gib(os_left),
        fits=headroom >= 0 and not starved and not busy,
        free_gib=None if node.free_bytes is None else _gib(node.free_bytes),
        cache_blocks=None if cost.hybrid is None else cost.hybrid.blocks(room),
    )
    need = _gib(weights + one_sequence + allowance_bytes)
    flags = (headroom < 0, busy, starved)
    return plan, _node_problems(node, plan, need, length, gpu_memory_utilization, os_reserve_bytes, *flags)


def _node_problems(
    node: NodeMemory,
    plan: NodePlan,
    need_gib: float,
    length: int,
    gpu_memory_utilization: float,
    os_reserve_bytes: int,
    short: bool,
    busy: bool,
    starved: bool,
) -> list[str]:
    """What of a node's plan stops the deploy: too little memory, memory held by something else, an OS
    starved of its unified memory."""
    problems = []
    if short:
        problems.append(
            f"{node.name}: needs {need_gib} GiB per GPU (weights {plan.weights_gib} + KV for one {length}-token "
            f"sequence {plan.kv_one_sequence_gib} + allowance {plan.allowance_gib}), has {plan.budget_gib} GiB "
            f"({plan.memory_gib} GiB × gpuMemoryUtilization {gpu_memory_utilization})"
        )
    if busy:
        where = "of its unified memory (MemAvailable)" if node.unified else "of GPU memory"
        problems.append(
            f"{node.name}: {plan.free_gib} GiB {where} is free now, and vLLM's start-up check needs "
            f"gpuMemoryUtilization {gpu_memory_utilization} × {plan.memory_gib} GiB = {plan.budget_gib} GiB "
            "free (something else holds it: `nvidia-smi` on the node shows what; stop it, or lower "
            "vllm.gpuMemoryUtilization)"
        )
    if starved and os_reserve_bytes >= node.memory_bytes * node.gpus:
        problems.append(
            f"{node.name}: memory.osReserveGib {_gib(os_reserve_bytes):g} is the whole of its "
            f"{_gib(node.memory_bytes * node.gpus):g} GiB of unified memory or more: nothing would be left for "
            "vLLM at any gpuMemoryUtilization or maxModelLen; set it to what the operating system needs (the "
            "default is 8 GiB)"
        )
    elif starved:
        problems.append(
            f"{node.name}: gpuMemoryUtilization {gpu_memory_utilization} leaves the operating system "
            f"{plan.os_left_gib} GiB of its {plan.memory_gib} GiB unified memory, less than "
            f"memory.osReserveGib {_gib(os_reserve_bytes)} (the box would swap and freeze)"
        )
    return problems


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
    knobs: Optional[EngineKnobs] = None,
    max_num_seqs: Optional[int] = None,
    pin_kv_cache: bool = False,
) -> Plan:
    """The plan for every node, the problems that stop the deploy, and the ways out. `knobs`: the engine
    settings of extraArgs; `max_num_seqs`: vllm.maxNumSeqs when a number (None: auto); `pin_kv_cache`: the
    replica shares a GPU with another, so its KV cache is set in bytes (the KV room on its smallest node)
    rather than profiled, which a neighbour's start would disturb (vLLM issue 55827)."""
    knobs = knobs or EngineKnobs()
    if pin_kv_cache:
        allowance_bytes += PINNED_OUTSIDE_BYTES
    wanted = _seqs_wanted(nodes, knobs, max_num_seqs)[0]
    drafting = speculation_cost(shape, knobs, wanted)
    if shape.linear is not None:  # a hybrid model's profiled peak (HYBRID_PROFILE_*), where above the allowance
        peak = HYBRID_PROFILE_BASE + int(HYBRID_PROFILE_BYTES * wanted * shape.vocab_size)
        allowance_bytes += max(0, peak - ALLOWANCE_BYTES)
    allowance_bytes += drafting.sampler_bytes
    ranks = tensor_parallel * pipeline_parallel
    length = max_model_len or shape.max_position or 0
    weights = weight_bytes / ranks
    cost = _rank_cost(shape, knobs, tensor_parallel, pipeline_parallel, drafting)
    cache = cost.hybrid
    plans, problems = [], []
    for node in nodes:
        plan, found = _node_plan(node, weights, allowance_bytes, cost, length, gpu_memory_utilization, os_reserve_bytes)
        plans.append(plan)
        problems += found
    seqs, set_seqs = None, None
    if cache is not None and not problems:
        seqs, set_seqs, problem = _max_num_seqs(plans, nodes, knobs, max_num_seqs)
        problems += [problem] if problem else []
    suggestions = _ways_out(
        nodes, weights, cost, allowance_bytes, gpu_memory_utilization, os_reserve_bytes, weight_bytes, ranks
    ) if problems else []  # fmt: skip
    pinned = None
    if pin_kv_cache and not problems:
        room = min(node.memory_bytes * gpu_memory_utilization for node in nodes) - weights - allowance_bytes
        pinned = int(room // MIB) * MIB
    return Plan(plans, length, problems, suggestions, cache, seqs, set_seqs, pinned, drafting if knobs.drafts else None)


@dataclass(frozen=True)
class SpeculationCost:
    """What speculative decoding adds to the plan (vLLM 0.25, each rule's source named):

    * `attention_layers`: with mtp, the MTP head's layers, each a full-attention layer with its own KV
      cache in the target's pool (vllm/v1/spec_decode/llm_base_proposer.py `_draft_attn_layer_names`; for a
      hybrid model one more layer in the attention groups, which can change the group size);
    * a hybrid model's state: each proposed token one more state block a sequence
      (vllm/v1/kv_cache_interface.py MambaSpec.max_memory_usage_bytes: 1 + num_speculative_blocks) and one
      more entry of convolution state a layer (mamba_utils.py gated_delta_net_state_shape: conv_kernel − 1
      + num_spec), any method (vllm/model_executor/layers/mamba/abstract.py) — counted in hybrid_cache;
    * `sampler_bytes`: the rejection sampler's warm-up in vLLM's memory profiling
      (vllm/v1/worker/gpu_model_runner.py `_dummy_sampler_run`: target logits for a draft and a bonus
      token a sequence, gathered, in float32, cloned, turned into probabilities) peaks above the plain
      sampler's by SPECULATIVE_SAMPLER_BYTES a sequence and vocabulary entry, for max_num_seqs sequences;
      vLLM's profiling then leaves the KV cache that much less.

    The MTP head's weights are in the checkpoint's files, which the plan counts whole already."""

    method: Optional[str] = None
    tokens: int = 0
    attention_layers: int = 0
    sampler_bytes: int = 0
    sequences: int = 0  # the max_num_seqs the sampler's warm-up is sized for

    def output(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "tokens": self.tokens,
            "draftAttentionLayers": self.attention_layers,
            "samplerGib": _gib(self.sampler_bytes),
            "samplerSequences": self.sequences,
        }


# Fit to the H200 (2026-12-03, vLLM 0.25.0, Qwen3.5-35B-A3B shape with its MTP layer, vocabulary 248,320,
# max_num_seqs 1024): memory outside weights and KV cache grew by 3.79 GiB with mtp and 3 tokens, i.e.
# 16.0 bytes a sequence and vocabulary entry (tests/gpu/results, docs/measurements.md).
SPECULATIVE_SAMPLER_BYTES = 16


def speculation_cost(shape: ModelShape, knobs: EngineKnobs, sequences: int) -> SpeculationCost:
    if not knobs.drafts:
        return SpeculationCost()
    return SpeculationCost(
        method=knobs.speculative.method,
        tokens=knobs.drafts,
        attention_layers=shape.mtp_layers if knobs.speculative.method == "mtp" else 0,
        sampler_bytes=SPECULATIVE_SAMPLER_BYTES * shape.vocab_size * sequences,
        sequences=sequences,
    )


def _seqs_wanted(nodes: list[NodeMemory], knobs: EngineKnobs, configured: Optional[int]) -> tuple[int, str]:
    """The max_num_seqs vLLM runs (and profiles) with, and where it comes from: vllm.maxNumSeqs, extraArgs', or
    vLLM's default on the smallest GPU."""
    if configured is not None:
        return configured, "vllm.maxNumSeqs"
    if knobs.max_num_seqs is not None:
        return knobs.max_num_seqs, "--max-num-seqs in vllm.extraArgs"
    small_tier = knobs.vllm.unified_small_tier and any(node.unified for node in nodes)  # a GB10, vLLM 0.33 on
    wanted = default_max_num_seqs(min((node.memory_bytes for node in nodes), default=0), knobs.throughput, small_tier)
    source = f"vLLM {knobs.vllm.label}'s default max_num_seqs" + (" on a GB10" if small_tier else "")
    return wanted, source + (" (doubled by --performance-mode throughput)" if knobs.throughput else "")


def _max_num_seqs(
    plans: list[NodePlan], nodes: list[NodeMemory], knobs: EngineKnobs, configured: Optional[int]
) -> tuple[SeqsVerdict, Optional[int], Optional[str]]:
    """max_num_seqs against the hybrid cache's blocks on the smallest node: (the verdict, what auto sets,
    the problem when a number set by hand does not fit)."""
    smallest = min(plans, key=lambda p: p.cache_blocks or 0)
    wanted, source = _seqs_wanted(nodes, knobs, configured)
    verdict = seqs_verdict(wanted, source, smallest.cache_blocks or 0, checked=not knobs.enforce_eager)
    if verdict.fits:
        return verdict, None, None
    by_hand = configured is not None or knobs.max_num_seqs is not None
    if not by_hand and verdict.kept >= 1:
        return verdict, verdict.kept, None
    return (
        verdict,
        None,
        (
            f"{smallest.node}: {source} {wanted} exceeds the {verdict.blocks} Mamba cache blocks of this hybrid "
            f"model's cache ({verdict.kept} kept: the plan's KV room runs up to 15 % above vLLM's), and vLLM "
            f"refuses to start with more sequences than blocks ('max_num_seqs ({wanted}) exceeds available Mamba "
            f"cache blocks'): set vllm.maxNumSeqs to {verdict.kept} or less (auto does), raise "
            "vllm.gpuMemoryUtilization (maxModelLen does not change the block count), or add --enforce-eager to "
            "extraArgs (no CUDA graphs, no such check: slower)"
        ),
    )


def _ways_out(
    nodes: list[NodeMemory],
    weights: float,
    cost: _Cost,
    allowance: int,
    utilization: float,
    os_reserve: int,
    weight_bytes: int,
    ranks: int,
) -> list[str]:
    ways = []
    whole = [node for node in nodes if node.unified and os_reserve >= node.memory_bytes * node.gpus]
    if whole:  # no setting of vLLM's is a way out of a reserve that takes the whole node
        memory = min(node.memory_bytes * node.gpus for node in whole)
        return [f"memory.osReserveGib under {_gib(memory):g} GiB ({whole[0].name}'s memory)"]
    smallest = min(nodes, key=lambda n: n.memory_bytes)
    budget = smallest.memory_bytes * utilization
    longest = cost.longest(budget - weights - allowance)
    if longest >= 1:
        ways.append(f"maxModelLen {longest} or less fits at gpuMemoryUtilization {utilization}")
    most = 1 - os_reserve / smallest.memory_bytes if smallest.unified else 0.95
    need = weights + allowance + cost.one_sequence(1)
    wanted = need / smallest.memory_bytes
    if wanted <= most:
        ways.append(
            f"gpuMemoryUtilization {math.ceil(wanted * 100) / 100:.2f} would fit one token of context; "
            f"at most {most:.2f} leaves the OS memory.osReserveGib"
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
