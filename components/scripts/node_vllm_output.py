# Reading vLLM's output when it exits (the supervisor's):
# its last error line, whether it refused its own settings at start (which no restart mends), whether the GPU
# was still busy. Standard library only, no side effects.
import re
import signal

# vLLM's own start-up check (vllm/v1/worker/utils.py request_memory): the GPU lacks what it asks for.
GPU_BUSY_MESSAGE = "on startup is less than desired GPU memory utilization"
# vLLM refusing its own settings while it starts (vLLM 0.25's messages): the same settings are refused
# again at every start, so restarting only burns minutes (a hybrid model's refusal comes after loading
# and compiling, ~4 min on an H200). vLLM has not served in that run when one of these is its reason.
START_REFUSALS = (
    "exceeds available Mamba cache blocks",  # vllm/config/compilation.py: max_num_seqs above the blocks
    "To serve at least one request with the model's max seq len",  # vllm/v1/core/kv_cache_utils.py
    "User-specified max_model_len",  # vllm/config/model.py: above what the model allows
    "error: unrecognized arguments",  # argparse: an unknown flag in extraArgs
    "error: argument ",  # argparse: a flag's value it cannot take ("invalid choice", "expected one argument")
    "error: ambiguous option",  # argparse: a prefix of several flags
    " validation error for ",  # pydantic: a value vLLM's config dataclasses refuse
)


# vLLM not getting its memory while it starts (vLLM 0.25's messages). Alone on the GPU these refuse the settings
# (the weights and activations leave nothing of gpuMemoryUtilization); beside another process that starts, stops or
# grows meanwhile they are that process's doing (vLLM counts every change of the GPU's used memory while it
# profiles as its own: vLLM issue 55827), and a start once the GPU is quiet may well succeed. The supervisor tells
# the two apart (supervisor.py, memory_refused).
MEMORY_REFUSALS = (
    "No available memory for the cache blocks",  # vllm/v1/core/kv_cache_utils.py: nothing left for the KV cache
    "Error in memory profiling",  # vllm/v1/worker/gpu_worker.py: free memory grew while it profiled
    "CUDA out of memory",  # torch: an allocation failed while it loaded or profiled
)


def memory_refusal(text):
    """The line of vLLM's output where it did not get its memory at start (MEMORY_REFUSALS), or ""."""
    for line in reversed(text.splitlines()[-400:]):
        if "=== spark-vllm:" not in line and any(needle in line for needle in MEMORY_REFUSALS):
            return line.strip()[:400]
    return ""


# vLLM's own log lines carry their level ("(APIServer pid=7) WARNING 12-01 20:42:04 [...]"): a warning
# that mentions an error (its ulimit notice names OSError) is not why vLLM exited.
NOT_AN_ERROR = re.compile(r"\b(DEBUG|INFO|WARNING) \d\d-\d\d \d\d:\d\d:\d\d ")


def error_line(text, lines=200):
    """The last error-like line of vLLM's output (since its start), or ""."""
    tail = [line for line in text.splitlines()[-lines:] if line.strip() and "=== spark-vllm:" not in line]
    for line in reversed(tail):
        if NOT_AN_ERROR.search(line):
            continue
        if any(word in line for word in ("Error", "ERROR", "error:", "Traceback", "unrecognized")):
            return line.strip()[:300]
    return ""


def start_refusal(text):
    """The line of vLLM's output that refuses its settings at start (START_REFUSALS), or ""."""
    for line in reversed(text.splitlines()[-400:]):
        if "=== spark-vllm:" not in line and any(needle in line for needle in START_REFUSALS):
            return line.strip()[:400]
    return ""


def exit_reason(code, text):
    """Why vLLM exited, as far as it shows: the signal that ended it, else its last error line (or
    its last line when none looks like an error)."""
    error = error_line(text)
    if code is not None and code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"killed by {name}" + (f"; its log's last error: {error}" if error else "")
    if error:
        return error
    lines = [line for line in text.splitlines() if line.strip() and "=== spark-vllm:" not in line]
    return lines[-1].strip()[:300] if lines else ""


# vLLM 0.25 hashes every VLLM_* variable of a worker into its torch.compile cache key and writes their raw
# values beside the compiled graphs, once per cache directory (vllm/envs.py compile_factors,
# vllm/compilation/backends.py: <VLLM_CACHE_ROOT>/torch_compile_cache/<hash>/rank_<r>_<dp>/<part>/
# cache_key_factors.json), VLLM_API_KEY among them: with mp the workers have the API server's environment.
# The supervisor puts a mark in place of any secret it finds there (the file is only metadata: vLLM
# never reads it back; the cache stays valid).
