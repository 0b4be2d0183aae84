"""What vLLM 0.25 leaves in its torch.compile cache that matters here: `cache_key_factors.json`.

vllm/compilation/backends.py hashes the environment (vllm/envs.py compile_factors: every variable vLLM
knows but its `ignored_factors`) into the cache directory's name,
`<VLLM_CACHE_ROOT>/torch_compile_cache/<hash>/rank_<rank>_<dp rank>/backbone`, and writes the raw values
it hashed there once, in `cache_key_factors.json`, if the file is not there yet. VLLM_API_KEY is not
ignored: a worker that has it leaves the key in plain text in its node's cache. Written by the process
that compiles: the engine core (uniproc, each mp node) or each Ray worker. The stand-in hashes only the
VLLM_* variables it is given (real vLLM also hashes its defaults and the model's config).
"""

from __future__ import annotations

import hashlib
import json
import os

# A part of vllm/envs.py compile_factors' ignored_factors: those a node of this project can have.
IGNORED = frozenset(
    {"VLLM_HOST_IP", "VLLM_PORT", "VLLM_CACHE_ROOT", "VLLM_RPC_BASE_PATH", "VLLM_LOGGING_LEVEL",
     "VLLM_LOGGING_PREFIX", "VLLM_ENGINE_ITERATION_TIMEOUT_S", "VLLM_NO_USAGE_STATS", "VLLM_DO_NOT_TRACK",
     "VLLM_WORKER_MULTIPROC_METHOD", "VLLM_ENABLE_V1_MULTIPROCESSING"}
)  # fmt: skip


def cache_root(environ=os.environ) -> str:
    """VLLM_CACHE_ROOT, else $XDG_CACHE_HOME/vllm, else ~/.cache/vllm (vllm/envs.py)."""
    if environ.get("VLLM_CACHE_ROOT"):
        return os.path.expanduser(environ["VLLM_CACHE_ROOT"])
    return os.path.join(environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "vllm")


def write_factors(rank: int, environ=os.environ) -> str:
    """The factors file of `rank`, written as vLLM does (only when absent); returns its path."""
    factors = {k: v for k, v in sorted(environ.items()) if k.startswith("VLLM_") and k not in IGNORED}
    digest = hashlib.sha256(json.dumps(factors, sort_keys=True).encode()).hexdigest()[:10]
    folder = os.path.join(cache_root(environ), "torch_compile_cache", digest, f"rank_{rank}_0", "backbone")
    path = os.path.join(folder, "cache_key_factors.json")
    if not os.path.exists(path):
        os.makedirs(folder, exist_ok=True)
        with open(path, "w") as handle:
            json.dump({"env": factors, "config_hash": "standin"}, handle, indent=2, sort_keys=True)
    return path
