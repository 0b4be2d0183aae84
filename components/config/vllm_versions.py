"""The vLLM versions the program drives, and what differs between them that the program relies on, as data.
Pure: no I/O.

Every fact was read in the release wheels of vLLM 0.25.0 through 0.34.0 (2026-12-06; each `source` is a file of
the release named by `since`, under vllm/). A rule keyed by version is a list of changes, each the first release
that has it; a version takes the last change at or before it. Nothing else in the program branches on a version:
it asks `rules(version)`.

Which versions: from 0.25.0, the oldest release whose rules were read and that the GPU lane runs (docs/measurements.md),
to 0.34.0, the newest release (2026-11-16). What people put on Sparks sits in that range or above it: NVIDIA's vLLM
container 26.10 carries vLLM 0.31.0 (NVIDIA's release notes), community Spark images build 0.27.1 and later, vLLM's
own images follow its releases. An older vLLM is refused before any container starts (its flags, routes and cache
layout were never read); a newer one (a nightly, 0.35.dev) runs with the newest rules read, and a warning says what
could not be checked for it.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass
from typing import Any, Optional

Version = tuple[int, int, int]

OLDEST: Version = (0, 25, 0)
NEWEST_READ: Version = (0, 34, 0)


@dataclass(frozen=True)
class Change:
    """From release `since` (major, minor) on, the rule is `value`, as `source` says."""

    since: tuple[int, int]
    value: Any
    source: str


# name -> its changes, oldest first. The rule's meaning is in its name's entry of RULE_MEANINGS.
CHANGES: dict[str, tuple[Change, ...]] = {
    # where --enable-server-load-tracking is declared (the image probe reads it there; the stall rule needs /load)
    "load_tracking_file": (
        Change(
            (0, 25), "entrypoints/openai/cli_args.py", "entrypoints/openai/cli_args.py: enable_server_load_tracking"
        ),
        Change((0, 29), "entrypoints/launchers/cli_args.py", "entrypoints/launchers/cli_args.py: moved there"),
        Change((0, 33), "entrypoints/common/cli_args.py", "entrypoints/common/cli_args.py:160"),
    ),
    # every `--enable-X` switch also takes `--disable-X` (and `--disable-X` takes `--enable-X`)
    "disable_switches": (
        Change((0, 25), False, "utils/argparse_utils.py: BooleanOptionalAction only (`--no-X`)"),
        Change((0, 33), True, "utils/argparse_utils.py:120-146 EnableDisableAction, registered for every boolean"),
    ),
    # other names of --gpu-memory-utilization
    "gpu_memory_aliases": (
        Change((0, 25), (), "engine/arg_utils.py: --gpu-memory-utilization alone"),
        Change((0, 31), ("--device-memory-utilization",), "engine/arg_utils.py:1327 (0.34: 1403-1406)"),
    ),
    # the KV cache block when --block-size is not given (tokens)
    "default_block_tokens": (
        Change((0, 25), 16, "config/cache.py CacheConfig.DEFAULT_BLOCK_SIZE = 16"),
        Change((0, 34), 64, "config/cache.py:185 CacheConfig.DEFAULT_BLOCK_SIZE = 64"),
    ),
    # whether a hybrid model (Gated DeltaNet, Mamba) gets prefix caching unless told otherwise, which puts its
    # state cache in "align" mode: 2 state blocks a sequence instead of 1
    "hybrid_prefix_caching": (
        Change((0, 25), False, "config/model.py is_prefix_caching_supported: hybrid 'still experimental'"),
        Change(
            (0, 26),
            True,
            "config/model.py is_prefix_caching_supported: 'Generative hybrid models support prefix "
            "caching'; model_executor/models/config.py MambaModelConfig: mode 'align' with it",
        ),  # fmt: skip
    ),
    # state blocks a sequence keeps in align mode for a prefill checkpoint (Qwen's Gated DeltaNet layers)
    "align_checkpoint_blocks": (
        Change((0, 25), 0, "v1/kv_cache_interface.py MambaSpec.max_memory_usage_bytes: 2 + speculative"),
        Change(
            (0, 33),
            1,
            "model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py get_kv_cache_spec: "
            "num_prefill_checkpoint_blocks=1 (v1/kv_cache_interface.py:1168-1174: 2 + speculative + it)",
        ),  # fmt: skip
    ),
    # a GB10 (DGX Spark, compute capability 12.1) gets the small tier of defaults: max_num_seqs 256
    "unified_small_tier": (
        Change((0, 25), False, "engine/arg_utils.py: ≥ 70 GiB and not an A100 gets max_num_seqs 1024"),
        Change(
            (0, 33), True, "engine/arg_utils.py: is_gb10 = is_device_capability((12, 1)) keeps it on the small tier"
        ),
    ),
    # what vLLM logs as it starts loading the weights (readiness says "loading weights" from it)
    "loading_lines": (
        Change(
            (0, 25),
            ("Starting to load model", "Loading model from scratch"),
            "v1/worker/gpu_model_runner.py 'Starting to load model %s...'; v1/worker/gpu/model_runner.py",
        ),  # fmt: skip
        Change((0, 34), ("Loading model from scratch",), "v1/worker/gpu/model_runner.py:412 (the other line is gone)"),
    ),
    # the render routes vllm-router's cache_aware policy asks each replica for (its prompt's tokens) need this flag
    "scale_out_flag": (
        Change((0, 25), None, "entrypoints/scale_out/render/api_router.py: always mounted"),
        Change(
            (0, 30),
            "--enable-scale-out",
            "entrypoints/scale_out/factories.py: mounted only with it "
            "(0.32 on: 403 without it, 0.34 factories.py:94-127)",
        ),  # fmt: skip
    ),
    # the path prefixes vLLM's --api-key guards
    "guarded_prefixes": (
        Change((0, 25), ("/v1", "/v2", "/inference"), "entrypoints/serve/utils/server_utils.py GUARDED_PREFIX"),
        Change(
            (0, 27),
            ("/v1", "/v2", "/inference", "/cohere"),
            "entrypoints/serve/utils/server_utils.py GUARDED_PREFIX (0.30 on: serve/middleware/authenticate.py:11)",
        ),  # fmt: skip
    ),
    # what --mamba-cache-mode takes (argparse's choices: another is refused at start)
    "mamba_cache_modes": (
        Change((0, 25), ("none", "align", "all"), "config/cache.py MambaCacheMode"),
        Change(
            (0, 28),
            ("none", "align"),
            "config/cache.py MambaCacheMode = Literal['align', 'none'] (0.34: deprecated, no effect: prefix caching "
            "decides)",
        ),
    ),
    # routes that answer without the key besides /health, /metrics, /version, /ping, /invocations, /tokenize …
    "keyless_routes_added": (
        Change((0, 25), (), "entrypoints/serve/instrumentator/basic.py"),
        Change((0, 31), ("/kv_event_sources",), "entrypoints/serve/instrumentator/basic.py:59"),
    ),
}


@dataclass(frozen=True)
class VllmRules:
    """The rules of one vLLM version, resolved from CHANGES."""

    version: Version
    load_tracking_file: str
    disable_switches: bool
    gpu_memory_aliases: tuple[str, ...]
    default_block_tokens: int
    hybrid_prefix_caching: bool
    align_checkpoint_blocks: int
    unified_small_tier: bool
    loading_lines: tuple[str, ...]
    scale_out_flag: Optional[str]
    guarded_prefixes: tuple[str, ...]
    mamba_cache_modes: tuple[str, ...]
    keyless_routes_added: tuple[str, ...]

    @property
    def label(self) -> str:
        return ".".join(str(part) for part in self.version)

    def fingerprint(self) -> str:
        """What the release records: the rules the program held this vLLM to (not its version alone: a new
        program that reads a version's rules otherwise changes this, and promotion says so)."""
        data = {key: value for key, value in asdict(self).items() if key != "version"}
        return hashlib.sha256(json.dumps(data, sort_keys=True, default=list).encode()).hexdigest()[:16]


def parse(text: Optional[str]) -> Optional[Version]:
    """'0.34.0', '0.25.0+cu130', '0.35.0.dev12+g1234', 'v0.31.1' → (major, minor, patch); None where it is none.
    Rules change by minor release: a patch release, a release candidate or NVIDIA's `0.31.0+nv26.10` is its minor's."""
    found = re.match(r"\s*v?(\d+)\.(\d+)(?:\.(\d+))?", text or "")
    if not found:
        return None
    return int(found.group(1)), int(found.group(2)), int(found.group(3) or 0)


def rules(version: Version) -> VllmRules:
    """The rules for `version`: each CHANGES entry's last change at or before it (the newest read for a newer one)."""
    chosen = {}
    for name, changes in CHANGES.items():
        applying = [change for change in changes if change.since <= version[:2]]
        chosen[name] = (applying or list(changes[:1]))[-1].value
    return VllmRules(version=version, **chosen)


def label(version: Version) -> str:
    return ".".join(str(part) for part in version)


@dataclass(frozen=True)
class Support:
    """What the program can say of an image's vLLM: `refused` (older than OLDEST), `unread` (newer than any
    release read: rules of NEWEST_READ, with a warning), `read`, or `unknown` (no version said)."""

    verdict: str
    rules: VllmRules
    said: Optional[str]

    def problem(self) -> Optional[str]:
        if self.verdict != "refused":
            return None
        return (
            f"vLLM {self.said} is older than the oldest this program drives ({label(OLDEST)}): its flags, routes and "
            f"cache were never read, so the memory plan and the guarantees could be wrong — use an image with vLLM "
            f"{label(OLDEST)} to {label(NEWEST_READ)} (NVIDIA's vLLM container 26.10 has 0.31.0; docs/deploy.md)"
        )

    def warning(self) -> Optional[str]:
        if self.verdict == "unread":
            return (
                f"vLLM {self.said} is newer than the newest release whose rules this program has read "
                f"({label(NEWEST_READ)}): it is held to those ({', '.join(UNCHECKED)} were not checked for it)"
            )
        if self.verdict == "unknown":
            return (
                f"vLLM says no version the program can read ({self.said!r}): it is held to {label(NEWEST_READ)}'s "
                f"rules ({', '.join(UNCHECKED)} were not checked for it)"
            )
        return None


# What a version the program has not read may do otherwise, said in the warning.
UNCHECKED = ("the flags extraArgs may not override", "the memory plan's cache layout and defaults",
             "which routes answer without the key", "the log lines readiness reads")  # fmt: skip


def support(said: Optional[str]) -> Support:
    """The verdict on an image whose vLLM says it is `said` (its package's version)."""
    version = parse(said)
    if version is None:
        return Support("unknown", rules(NEWEST_READ), said)
    if version[:2] < OLDEST[:2]:
        return Support("refused", rules(version), said)
    if version[:2] > NEWEST_READ[:2]:  # a patch release or a release candidate of one read is that one
        return Support("unread", rules(version), said)
    return Support("read", rules(version), said)
