# Runs inside the head's container (`docker exec -i … python3 -`), its parameters in the
# program (node_params.py). Waits until /health answers 200 and /v1/models lists the
# served model; prints a progress line regularly; when the container's supervisor gives up on
# vLLM (it kept exiting) or the time runs out, prints the log tail and a hint for the known
# causes, and exits 1. While vLLM restarts after an exit, it keeps waiting.
import json
import os
import re
import sys
import time
import urllib.error
import urllib.request

from components.scripts.node_contract import ReadyParams, ReadyResult, SupervisorStatus, VllmState
from components.scripts.node_params import given
from components.scripts.node_timing import Every

P = ReadyParams.from_json(given())

HINTS = [
    (
        "No available node types can fulfill resource request",
        "Ray and vLLM disagree on addresses: VLLM_HOST_IP must be the node's fabric address on every node "
        "(check nodes[].fabricAddress and that Ray shows those addresses).",
    ),
    (
        "NET/Socket",
        "NCCL fell back to TCP sockets (slow or failing): check nodes[].rdmaDevices, the RoCE link and "
        "nccl.ibDisable; NCCL_DEBUG=INFO shows NET/IB when RDMA works.",
    ),
    (
        "exceeds available Mamba cache blocks",
        "A hybrid model's cache holds fewer sequences than max_num_seqs: vllm.maxNumSeqs auto (the default) sets "
        "what the memory plan finds; or a lower vllm.maxNumSeqs, or a higher vllm.gpuMemoryUtilization.",
    ),
    (
        "To serve at least one request with the model's max seq len",
        "The KV cache cannot hold one maxModelLen-long sequence: lower maxModelLen (vLLM's message names the "
        "longest that fits) or raise vllm.gpuMemoryUtilization.",
    ),
    ("out of memory", "Out of memory: lower vllm.gpuMemoryUtilization or maxModelLen, or use more GPUs."),
    ("OutOfMemoryError", "Out of memory: lower vllm.gpuMemoryUtilization or maxModelLen, or use more GPUs."),
    (
        "placement group",
        "Ray could not place TP×PP GPU bundles: every node must be in Ray with its GPUs "
        "(`ray status` on the head) and tensorParallelSize × pipelineParallelSize must match them.",
    ),
]


# What vLLM is doing while its log says nothing, read from its last lines (vLLM's own messages, 0.25 to 0.34,
# the latest that matches decides). A first start sits minutes in some of these without a line.
STEPS = [
    (re.compile(r"Loading safetensors checkpoint shards:\s*(\d+)%"), "loading the weights ({} % of the shards)"),
    (re.compile(r"Capturing CUDA graphs[^:]*:\s*(\d+)%"), "capturing CUDA graphs ({} %)"),
    ("Kernel JIT monitor activated", "warming up: kernels JIT-compile on a first start"),
    ("Graph capturing finished", "warming up after CUDA graph capture: FlashInfer's and Triton's kernels JIT-compile"),
    ("Available KV cache memory", "allocating the KV cache, then capturing CUDA graphs"),
    ("torch.compile took", "profiling memory after torch.compile, JIT-compiling kernels (FlashInfer, Triton)"),
    ("Dynamo bytecode transform time", "compiling the model (torch.compile, Inductor)"),
    ("Compiling a graph for", "compiling the model (torch.compile, Inductor)"),
    ("Model loading took", "compiling the model (torch.compile)"),
    # every release's line as it starts loading (components/config/vllm_versions.py loading_lines: 0.34 has only
    # the second)
    ("Starting to load model", "loading the weights"),
    ("Loading model from scratch", "loading the weights"),
]
GDN_JIT = "Using FlashInfer GDN prefill kernel"  # vllm/model_executor/layers/mamba/gdn/qwen_gdn_linear_attn.py


def long_step(text):
    """What vLLM is busy with, judged from its output since it started (None when nothing matches)."""
    lines = [line for line in text.replace("\r", "\n").splitlines() if line.strip()]
    for line in reversed(lines[-200:]):
        for needle, what in STEPS:
            if isinstance(needle, str):
                if needle in line:
                    return with_gdn_note(what, text)
            else:
                found = needle.search(line)
                if found:
                    return what.format(found.group(1))
    return None


def with_gdn_note(what, text):
    if GDN_JIT in text and ("JIT" in what or "torch.compile" in what):
        return (
            f"{what}; this model's GDN prefill kernel is FlashInfer's, JIT-compiled on a first start for minutes "
            "without a log line (kept in container.compileCache; --gdn-prefill-backend triton skips it)"
        )
    return what


def since_start(text):
    """vLLM's output since the supervisor last started it (its `=== spark-vllm: … starting …` line)."""
    found = [match.start() for match in re.finditer(r"^=== spark-vllm: \S+ \S+ starting ", text, re.M)]
    return text[found[-1] :] if found else text


def log_text(limit=1_000_000):
    try:
        with open(P.log_file, "rb") as handle:
            handle.seek(max(0, os.path.getsize(P.log_file) - limit))
            return handle.read().decode(errors="replace")
    except OSError:
        return ""


def log_size():
    try:
        return os.path.getsize(P.log_file)
    except OSError:
        return -1


def log_lines(count):
    try:
        with open(P.log_file, errors="replace") as handle:
            return handle.readlines()[-count:]
    except OSError:
        return []


def supervisor():
    """What the container's supervisor says of vLLM (RUN_DIR/status.json)."""
    return SupervisorStatus.read(P.status_file) or SupervisorStatus(node="", executor="", state=VllmState.UNKNOWN)


def get(path, key=None):
    request = urllib.request.Request(P.base_url + path)
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=P.poll_seconds + 1) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, b""
    except (OSError, ValueError):
        return None, b""


def fail(reason):
    lines = log_lines(100)
    print(f"vLLM is not serving: {reason}", flush=True)
    print(f"--- last {len(lines)} lines of {P.log_file} ---")
    print("".join(lines), end="")
    text = "".join(lines)
    hints = []
    for needle, hint in HINTS:
        if needle.lower() in text.lower() and hint not in hints:
            hints.append(hint)
    for hint in hints:
        print(f"hint: {hint}")
    return 1


def main():
    start = time.monotonic()
    progress = Every(P.progress_seconds, first=start + P.progress_seconds)
    size, grew = log_size(), start  # when vLLM's log last grew
    key = P.api_key
    health = None
    while True:
        elapsed = time.monotonic() - start
        health, _ = get("/health")
        if health == 200:
            status, body = get("/v1/models", key)
            if status == 200:
                served = [m.get("id") for m in json.loads(body).get("data", [])]
                if P.model in served:
                    print(f"vLLM ready after {elapsed:.1f} s: {P.base_url}/v1 serves {P.model}", flush=True)
                    print(json.dumps(ReadyResult(ready_seconds=round(elapsed, 1)).to_json()))
                    return 0
                return fail(f"/v1/models lists {served}, not {P.model!r}")
            if status in (401, 403):
                return fail(f"/v1/models refused the API key (HTTP {status})")
        status = supervisor()
        if status.failed:
            return fail(status.failed)
        if elapsed >= P.timeout_seconds:
            return fail(f"not ready after {P.timeout_seconds} s (last /health: {health})")
        now = time.monotonic()
        if log_size() != size:
            size, grew = log_size(), now
        if progress.due(now):
            last = (log_lines(1) or ["(log empty)"])[-1].strip()
            state = status.state
            if state == VllmState.WAITING_TURN and status.turn:
                state += f" ({status.turn}: replicas sharing a GPU start one at a time)"
            line = f"waiting for vLLM: {elapsed:.0f} s, /health {health or 'no answer'}, supervisor: {state}; "
            silent = now - grew
            step = long_step(since_start(log_text())) if silent >= P.silent_seconds else None
            if step:
                line += f"its log has been silent for {silent:.0f} s: vLLM is {step} (a healthy first start waits here)"
            else:
                line += f"log: {last[-200:]}"
            print(line, flush=True)
        time.sleep(P.poll_seconds)


sys.exit(main())
