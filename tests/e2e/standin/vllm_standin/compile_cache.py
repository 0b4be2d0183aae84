"""What vLLM 0.25 leaves in its torch.compile cache that matters here: `cache_key_factors.json`.

vllm/compilation/backends.py hashes the environment (vllm/envs.py compile_factors: every variable vLLM
knows but its `ignored_factors`) into the cache directory's name,
`<VLLM_CACHE_ROOT>/torch_compile_cache/<hash>/rank_<rank>_<dp rank>/backbone`, and writes the raw values
it hashed there once, in `cache_key_factors.json`, if the file is not there yet. VLLM_API_KEY is not
ignored: a worker that has it leaves the key in plain text in its node's cache. Written by the process
that compiles: the engine core (uniproc, each mp node) or each Ray worker. The stand-in hashes only the
VLLM_* variables it is given (real vLLM also hashes its defaults) and, as vllm/config/model.py
ModelConfig.compute_hash does first, the model (its path or repo id) and max_model_len: a graph
compiled for one model directory is not found for another.

And what that cache is for: a graph found there is loaded, not compiled. `compile_graph` takes
STANDIN_COMPILE_SECONDS (default 1) when the cache of its key is empty and a tenth of a second when
it holds the graph, and says which in vLLM 0.25's words (vllm/compilation/backends.py), as the GPU
lane saw them on the H200 (tests/gpu/results/2026-12-02/lane-mp-qwen3-8b-compile-{cold,warm}.json):
"Compiling a graph for compile range (1, 8192) takes 15.84 s", then with the cache kept "Directly load
the compiled graph(s) for compile range (1, 8192) from the cache, took 2.048 s". So a container that
starts on a kept cache (a Docker volume) shows it in its log, as real vLLM does.
"""

from __future__ import annotations

import hashlib
import json
import os
import time

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


COMPILE_RANGE_END = 8192  # what vLLM 0.25 compiled for in the GPU lane (Qwen3-8B on the H200)
CACHED_LOAD_SECONDS = 0.1
# where vLLM 0.25.0 logs each (seen on the H200: tests/gpu/results/2026-12-02/lane-mp-qwen3-8b-compile-*.json)
WHERE_CACHE_DIR, WHERE_COMPILED, WHERE_LOADED = "backends.py:1089", "backends.py:393", "backends.py:292"


def _factors(environ) -> dict[str, str]:
    return {k: v for k, v in sorted(environ.items()) if k.startswith("VLLM_") and k not in IGNORED}


def cache_folder(rank: int, model: list, environ=os.environ) -> str:
    """`model`: the model config's factors ([model, max_model_len])."""
    key = json.dumps({"env": _factors(environ), "model": model}, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:10]
    return os.path.join(cache_root(environ), "torch_compile_cache", digest, f"rank_{rank}_0", "backbone")


def model_factors(cfg) -> list:
    """What of the ServeConfig goes into the key, as ModelConfig.compute_hash's first factors."""
    return [cfg.model, cfg.max_model_len]


def compile_graph(rank: int, model: list, environ=os.environ) -> dict:
    """`rank`'s graph: loaded from the cache when its factors file is there, else compiled (and the
    file written). Returns what vLLM's log says of it: {"directory", "cached", "seconds"}."""
    folder = cache_folder(rank, model, environ)
    cached = os.path.exists(os.path.join(folder, "cache_key_factors.json"))
    started = time.monotonic()
    time.sleep(CACHED_LOAD_SECONDS if cached else float(environ.get("STANDIN_COMPILE_SECONDS") or 1.0))
    write_factors(rank, model, environ)
    return {"directory": folder, "cached": cached, "seconds": time.monotonic() - started}


def compile_lines(result: dict) -> list[tuple[str, str]]:
    """(where, message) of vLLM 0.25's log lines for one compiled or loaded graph."""
    lines = [(WHERE_CACHE_DIR, f"Using cache directory: {result['directory']} for vLLM's torch.compile")]
    span = f"compile range (1, {COMPILE_RANGE_END})"
    if result["cached"]:
        lines.append(
            (
                WHERE_LOADED,
                f"Directly load the compiled graph(s) for {span} from the cache, took {result['seconds']:.3f} s",
            )
        )
    else:
        lines.append((WHERE_COMPILED, f"Compiling a graph for {span} takes {result['seconds']:.2f} s"))
    return lines


def write_factors(rank: int, model: list, environ=os.environ) -> str:
    """The factors file of `rank`, written as vLLM does (only when absent); returns its path."""
    factors = _factors(environ)
    folder = cache_folder(rank, model, environ)
    path = os.path.join(folder, "cache_key_factors.json")
    if not os.path.exists(path):
        os.makedirs(folder, exist_ok=True)
        with open(path, "w") as handle:
            json.dump({"env": factors, "config_hash": "standin"}, handle, indent=2, sort_keys=True)
    return path
