# Runs inside a node's Ray container (`docker exec -i … python3 -`), its parameters in the
# program (node_params.py). Waits until Ray shows the expected nodes alive (and, on the
# head, the GPUs TP×PP needs); on timeout prints what is missing and `ray status`, exits 1.
import json
import subprocess
import sys
import time

from components.scripts.node_contract import ClusterSeen, ClusterWaitParams
from components.scripts.node_params import given
from components.scripts.node_timing import Every

P = ClusterWaitParams.from_json(given())


def say(message):
    print(f"[{P.node}] {message}", flush=True)


def alive_nodes(ray):
    return [n for n in ray.nodes() if n.get("Alive")]


def connect(deadline):
    import ray

    last_error = None
    while time.monotonic() < deadline:
        try:
            ray.init(address=P.ray_address, logging_level="ERROR", log_to_driver=False)
            return ray
        except Exception as error:  # GCS or local raylet not up yet
            last_error = error
            time.sleep(P.poll_seconds)
    say(f"could not connect to Ray at {P.ray_address} within {P.timeout_seconds} s: {last_error}")
    return None


def main():
    start = time.monotonic()
    deadline = start + P.timeout_seconds
    ray = connect(deadline)
    expected = {n["fabric_address"]: n["name"] for n in P.expected}
    missing, gpus = dict(expected), 0.0
    reports = Every(P.progress_seconds, first=start + P.progress_seconds)
    while ray is not None:
        nodes = alive_nodes(ray)
        seen = {n["NodeManagerAddress"] for n in nodes}
        missing = {addr: name for addr, name in expected.items() if addr not in seen}
        gpus = sum(n.get("Resources", {}).get("GPU", 0) for n in nodes)
        if not missing and gpus >= P.gpus_needed:
            say(f"Ray ready after {time.monotonic() - start:.1f} s: {len(nodes)} node(s) alive, {gpus:g} GPU")
            print(json.dumps(ClusterSeen(alive=sorted(seen), gpus=gpus).to_json()))
            return 0
        now = time.monotonic()
        if now >= deadline:
            break
        if reports.due(now):
            say(f"waiting for Ray: {len(nodes)} alive, {gpus:g}/{P.gpus_needed} GPU, missing {missing or 'none'}")
        time.sleep(P.poll_seconds)
    say(f"Ray cluster at {P.ray_address} not ready after {P.timeout_seconds} s")
    for address, name in sorted(missing.items()):
        say(f"missing node {name} (fabric address {address}): check its Ray container log and the fabric link")
    if gpus < P.gpus_needed:
        say(f"GPUs in Ray: {gpus:g}, needed for tensor x pipeline parallel: {P.gpus_needed}")
    try:
        status = subprocess.run(
            ["ray", "status", f"--address={P.ray_address}"], capture_output=True, text=True, timeout=60
        )
        print("--- ray status ---\n" + status.stdout + status.stderr, flush=True)
    except (OSError, subprocess.TimeoutExpired) as error:
        print(f"--- ray status could not run: {error} ---", flush=True)
    return 1


sys.exit(main())
