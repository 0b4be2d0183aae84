# Runs inside the head's container (`docker exec -i … python3 -`), PARAMS prepended by
# components.render.script_program. Waits until /health answers 200 and /v1/models lists the
# served model; prints a progress line regularly; when the container's supervisor gives up on
# vLLM (it kept exiting) or the time runs out, prints the log tail and a hint for the known
# causes, and exits 1. While vLLM restarts after an exit, it keeps waiting.
import json
import sys
import time
import urllib.error
import urllib.request

P = json.loads(PARAMS)  # noqa: F821 - prepended by script_program

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
    ("out of memory", "Out of memory: lower vllm.gpuMemoryUtilization or maxModelLen, or use more GPUs."),
    ("OutOfMemoryError", "Out of memory: lower vllm.gpuMemoryUtilization or maxModelLen, or use more GPUs."),
    (
        "placement group",
        "Ray could not place TP×PP GPU bundles: every node must be in Ray with its GPUs "
        "(`ray status` on the head) and tensorParallelSize × pipelineParallelSize must match them.",
    ),
]


def log_lines(count):
    try:
        with open(P["log_file"], errors="replace") as handle:
            return handle.readlines()[-count:]
    except OSError:
        return []


def supervisor():
    """What the container's supervisor says of vLLM (RUN_DIR/status.json)."""
    try:
        with open(P["status_file"]) as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return {}


def get(path, key=None):
    request = urllib.request.Request(P["base_url"] + path)
    if key:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=P["poll_seconds"] + 1) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as error:
        return error.code, b""
    except (OSError, ValueError):
        return None, b""


def fail(reason):
    lines = log_lines(100)
    print(f"vLLM is not serving: {reason}", flush=True)
    print(f"--- last {len(lines)} lines of {P['log_file']} ---")
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
    last_progress = start
    key = P.get("api_key")
    health = None
    while True:
        elapsed = time.monotonic() - start
        health, _ = get("/health")
        if health == 200:
            status, body = get("/v1/models", key)
            if status == 200:
                served = [m.get("id") for m in json.loads(body).get("data", [])]
                if P["model"] in served:
                    print(f"vLLM ready after {elapsed:.1f} s: {P['base_url']}/v1 serves {P['model']}", flush=True)
                    print(json.dumps({"ready_seconds": round(elapsed, 1)}))
                    return 0
                return fail(f"/v1/models lists {served}, not {P['model']!r}")
            if status in (401, 403):
                return fail(f"/v1/models refused the API key (HTTP {status})")
        status = supervisor()
        if status.get("failed"):
            return fail(status["failed"])
        if elapsed >= P["timeout_seconds"]:
            return fail(f"not ready after {P['timeout_seconds']} s (last /health: {health})")
        if time.monotonic() - last_progress >= P["progress_seconds"]:
            last_progress = time.monotonic()
            last = (log_lines(1) or ["(log empty)"])[-1].strip()
            state = status.get("state", "unknown")
            print(
                f"waiting for vLLM: {elapsed:.0f} s, /health {health or 'no answer'}, supervisor: {state}; "
                f"log: {last[:200]}",
                flush=True,
            )
        time.sleep(P["poll_seconds"])


sys.exit(main())
