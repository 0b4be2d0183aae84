"""vLLM's cache for hybrid models (Gated DeltaNet or Mamba layers beside full attention), as vLLM 0.25
lays it out. Pure arithmetic, no I/O; each rule names the vLLM 0.25 source it follows.

A hybrid model keeps two kinds of state: full-attention layers a KV cache that grows with the
sequence, linear-attention layers a fixed recurrent + convolution state per sequence. vLLM puts both
in one pool of blocks of one size:

* the state of one linear layer for one sequence is one "mamba page": the convolution state,
  (2 × key heads × key dim + value heads × value dim) / TP channels × (conv kernel − 1) entries in
  the conv dtype, plus the recurrent state, value heads / TP × value dim × key dim in the SSM dtype
  (vllm/model_executor/layers/mamba/mamba_utils.py `gated_delta_net_state_shape`; dtypes from
  `_mamba_state_dtype`: the model's dtype unless --mamba-cache-dtype / --mamba-ssm-cache-dtype, and
  for Qwen3.5 the config's `mamba_ssm_dtype`: vllm/model_executor/models/config.py
  `Qwen3_5ForConditionalGenerationConfig`);
* the attention block is raised until one layer's block of K and V is at least a mamba page:
  block = alignment × ceil(mamba page / (alignment × attention bytes a token)), the alignment being
  the kernel's smallest block and at least --block-size (16 by default, CacheConfig.DEFAULT_BLOCK_SIZE);
  the mamba page is then padded to the attention page (vllm/platforms/interface.py
  `_align_hybrid_block_size`: "Setting attention block size to N tokens …", "Padding mamba page size
  by X% …");
* layers of one kind are grouped so every group has as many layers: the group size is the smaller
  layer count, or the larger when it is under 1.5 × the smaller (vllm/v1/core/kv_cache_utils.py
  `_get_kv_cache_groups_uniform_page_size`); there are group-size tensors, each of `blocks` pages,
  so blocks = KV room // (page × group size) (`get_num_blocks`);
* a sequence of L tokens holds ceil(L / block) blocks in each attention group and one block in each
  state group (two with --enable-prefix-caching, mamba cache mode "align": vllm/v1/kv_cache_interface.py
  `MambaSpec.max_memory_usage_bytes`), and one more per speculative token (`num_speculative_blocks`,
  vllm/model_executor/layers/mamba/abstract.py), whose convolution state is also one entry longer a
  token; vLLM's "Maximum concurrency for L tokens" is blocks over that;
* with FULL CUDA graphs (the default for hybrid models: vllm/model_executor/models/config.py
  `MambaModelConfig`) vLLM refuses to start when max_num_seqs exceeds the blocks
  (vllm/config/compilation.py: "max_num_seqs (N) exceeds available Mamba cache blocks (M)"). The API
  server's default max_num_seqs is 1024 on a GPU of 70 GiB or more (not an A100), else 256, doubled
  with --performance-mode throughput (vllm/engine/arg_utils.py `get_batch_defaults`).

Hybrid models do not use prefix caching unless asked (vllm/config/model.py `is_prefix_caching_supported`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

GIB = 1024**3
DEFAULT_BLOCK_TOKENS = 16  # vllm/config/cache.py CacheConfig.DEFAULT_BLOCK_SIZE
LARGE_GPU_BYTES = 70 * GIB  # vllm/engine/arg_utils.py get_batch_defaults: ≥ 70 GiB gets the larger defaults
DEFAULT_MAX_NUM_SEQS = {True: 1024, False: 256}  # the API server's, on a large GPU or not
# The plan's KV room ran above vLLM's own by 2 % (gpuMemoryUtilization 0.9) and 15 % (0.55) for a
# Qwen3.5-MoE shape on an H200 (2026-12-02): a block count from it is kept to this share of itself
# before max_num_seqs is held against it, so that what the plan lets through vLLM does not refuse.
BLOCK_MARGIN = 0.85


@dataclass(frozen=True)
class LinearAttention:
    """A Gated DeltaNet layer's state, from config.json (Qwen3-Next, Qwen3.5)."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int
    conv_bytes: int  # per element of the convolution state
    ssm_bytes: int  # per element of the recurrent state

    def page_bytes(self, tensor_parallel: int, drafts: int = 0) -> int:
        """One layer's state for one sequence on one rank (vLLM's mamba page before padding); `drafts`:
        speculative tokens, each one more entry of convolution state (conv kernel − 1 + num_spec)."""
        conv_dim = self.key_dim * self.key_heads * 2 + self.value_dim * self.value_heads
        conv = (conv_dim // tensor_parallel) * (self.conv_kernel - 1 + drafts) * self.conv_bytes
        recurrent = (self.value_heads // tensor_parallel) * self.value_dim * self.key_dim * self.ssm_bytes
        return conv + recurrent


@dataclass(frozen=True)
class HybridCache:
    block_tokens: int  # the attention block, raised to hold a mamba page
    page_bytes: int  # one layer's block: attention block of K and V = padded mamba page
    state_page_bytes: int  # the mamba page before padding
    group_size: int  # layers per KV-cache group
    attention_groups: int
    state_groups: int
    state_blocks_per_sequence: int  # 1, or 2 with prefix caching ("align"), 3 with its prefill checkpoint (0.33 on)

    @property
    def block_bytes(self) -> int:
        """What one block id takes across the group-size tensors."""
        return self.page_bytes * self.group_size

    @property
    def padding_percent(self) -> float:
        return 100 * (self.page_bytes - self.state_page_bytes) / self.state_page_bytes

    def blocks_per_sequence(self, tokens: int) -> int:
        return self.attention_groups * math.ceil(tokens / self.block_tokens) + (
            self.state_groups * self.state_blocks_per_sequence
        )

    def blocks(self, room_bytes: float) -> int:
        return max(0, int(room_bytes // self.block_bytes))

    def output(self) -> dict:
        return {
            "blockTokens": self.block_tokens,
            "pageMiB": round(self.page_bytes / 2**20, 3),
            "statePaddingPercent": round(self.padding_percent, 2),
            "groupSize": self.group_size,
            "attentionGroups": self.attention_groups,
            "stateGroups": self.state_groups,
            "stateBlocksPerSequence": self.state_blocks_per_sequence,
        }


def group_layout(attention_layers: int, state_layers: int) -> tuple[int, int, int]:
    """(group size, attention groups, state groups), as _get_kv_cache_groups_uniform_page_size groups them."""
    counts = [count for count in (attention_layers, state_layers) if count > 0]
    smallest, largest = min(counts), max(counts)
    size = largest if largest < smallest * 1.5 else smallest
    return size, math.ceil(attention_layers / size), math.ceil(state_layers / size)


def hybrid_cache(
    linear: LinearAttention,
    attention_layers: int,
    state_layers: int,
    attention_bytes_per_token: int,
    tensor_parallel: int,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    prefix_caching: bool = False,
    drafts: int = 0,
    checkpoints: int = 0,
) -> HybridCache:
    """The layout vLLM gives a hybrid model on one rank (`attention_bytes_per_token`: one layer's K and V
    for one token on this rank; `block_tokens`: --block-size or the default, the alignment)."""
    state_page = linear.page_bytes(tensor_parallel, drafts)
    alignment = max(DEFAULT_BLOCK_TOKENS, block_tokens)
    block = max(block_tokens, alignment * math.ceil(state_page / (alignment * attention_bytes_per_token)))
    page = block * attention_bytes_per_token
    size, attention_groups, state_groups = group_layout(attention_layers, state_layers)
    # a sequence keeps 1 state block (2 with prefix caching, and `checkpoints` more for its prefill checkpoints:
    # vLLM 0.33 on, v1/kv_cache_interface.py MambaSpec.max_memory_usage_bytes) and one more a speculative token
    state_blocks = (2 + checkpoints if prefix_caching else 1) + drafts
    return HybridCache(block, page, state_page, size, attention_groups, state_groups, state_blocks)


def default_max_num_seqs(gpu_bytes: int, throughput: bool = False, small_tier: bool = False) -> int:
    """vLLM's max_num_seqs for the API server when none is given; `small_tier`: a GPU vLLM keeps on the smaller
    defaults whatever its memory (an A100; a GB10 from vLLM 0.33: components/config/vllm_versions.py)."""
    value = DEFAULT_MAX_NUM_SEQS[gpu_bytes >= LARGE_GPU_BYTES and not small_tier]
    return value * 2 if throughput else value


@dataclass(frozen=True)
class SeqsVerdict:
    """max_num_seqs against the Mamba cache blocks of the smallest node."""

    wanted: int  # what vLLM would run with: the configured number, or its default
    source: str  # where `wanted` comes from
    blocks: int  # the plan's blocks on the smallest node
    kept: int  # blocks × BLOCK_MARGIN: the most the plan lets through
    checked: bool  # False with --enforce-eager (no CUDA graphs, no check in vLLM)

    @property
    def fits(self) -> bool:
        return not self.checked or self.wanted <= self.kept


def seqs_verdict(wanted: int, source: str, blocks: int, checked: bool) -> SeqsVerdict:
    return SeqsVerdict(wanted, source, blocks, int(blocks * BLOCK_MARGIN), checked)


def describe(cache: HybridCache, blocks: Optional[int] = None) -> str:
    text = (
        f"hybrid cache: blocks of {cache.block_tokens} tokens ({cache.page_bytes / 2**20:.2f} MiB a layer, the "
        f"recurrent state padded by {cache.padding_percent:.2f} %), {cache.attention_groups} attention and "
        f"{cache.state_groups} state group(s) of {cache.group_size} layers"
    )
    return text if blocks is None else f"{text}, {blocks} blocks"
