"""How long a vLLM that stops serving with /health green takes to serve again, and how often a healthy one is
ended for nothing under load, on simulated nodes.

    sudo venv/bin/python -m benchmarks.stall_recovery [--trials 3] [--stall-seconds 30] [--load-minutes 30]

Two simulated nodes (tests/e2e/nodes.py) and the rehearsal's stack with `executor: mp` (TP 2 over both),
deployed with the real CLI, vllm.stallSeconds as given (the config's floor, 30, by default) and
vllm.canarySeconds 30. Then, `--trials` times each: the head's engine core SIGSTOPped mid-stream, the other
node's rank SIGSTOPped mid-stream, the head answering wrong tokens (the stand-in's fault file): seconds from
the fault until the supervisor found it, and until the endpoint answered a chat request from a new vLLM on
both nodes (target: stallSeconds, or canarySeconds for wrong tokens, plus the restart's own time). Then
`--load-minutes` of the stack's benchmark load (the `benchmark` section's defaults: 4 streams at once, 256
prompt tokens, 128 output tokens with ignore_eos) through the endpoint in a loop: requests answered and
failed, and the vLLMs the supervisors ended or restarted meanwhile (target: none).

Numbers are printed, nothing is asserted; this machine is shared and has 2 cores.
Needs root (namespaces, one dockerd per node) and the CLI built by scripts/toolchain.sh.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from components.config.sections import BenchmarkConfig
from tests.e2e import nodes as simnodes
from tests.e2e.cli_stack import RehearsalStack, cli_missing
from tests.e2e.image.build import publish
from tests.e2e.rehearsal import CACHE_DIR, make_model, rehearsal_config
from tests.e2e.test_recovery import recovered, supervisor_status, vllm_pids
from tests.e2e.test_stalls import RECOVERY, faults, stall_and_recover
from tests.waiting import wait_until


def wrong_tokens(cluster, stack) -> dict:
    """The head answering other tokens until its supervisor found it: seconds to found and to serving again."""
    head = cluster.nodes[0]
    before, counted = vllm_pids(cluster, cluster.nodes), faults(cluster, head).get("wrong", 0)
    cluster.docker(head, "exec", "spark-vllm-node-1", "sh", "-c", "echo wrong > /tmp/vllm-standin-fault")
    started = time.monotonic()
    try:
        wait_until(lambda: faults(cluster, head).get("wrong", 0) > counted, 300, "the canary finding wrong tokens",
                   every=0.5, errors=(Exception,))  # fmt: skip
    finally:
        cluster.docker(head, "exec", "spark-vllm-node-1", "rm", "-f", "/tmp/vllm-standin-fault")
    found = time.monotonic() - started
    return {"found": found, "serving": recovered(cluster, stack, cluster.nodes, before, started)}


def load(endpoint: str, key: str, model: str, minutes: float) -> dict:
    """The benchmark section's load in a loop for `minutes`: answered and failed requests."""
    settings = BenchmarkConfig()
    body = json.dumps({"model": model, "prompt": " ".join(f"w{i}" for i in range(settings.prompt_tokens)),
                       "max_tokens": settings.output_tokens, "ignore_eos": True, "stream": True}).encode()  # fmt: skip
    counts, failures, lock = {"ok": 0, "failed": 0}, [], threading.Lock()
    deadline = time.monotonic() + minutes * 60

    def client():
        while time.monotonic() < deadline:
            request = urllib.request.Request(f"{endpoint}/completions", data=body, headers={
                "Content-Type": "application/json", "Authorization": f"Bearer {key}"})  # fmt: skip
            try:
                with urllib.request.urlopen(request, timeout=120) as response:
                    done = b"data: [DONE]" in response.read()
                ok = response.status == 200 and done
            except (OSError, ValueError) as error:
                ok = False
                failures.append(repr(error)[:200])
            with lock:
                counts["ok" if ok else "failed"] += 1

    threads = [threading.Thread(target=client, daemon=True) for _ in range(settings.concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {**counts, "failureSamples": failures[:3], "concurrency": settings.concurrency,
            "promptTokens": settings.prompt_tokens, "outputTokens": settings.output_tokens}  # fmt: skip


def ended_or_restarted(cluster) -> dict:
    return {node.name: {"restarts": supervisor_status(cluster, node)["restarts_total"],
                        "faults": sum(faults(cluster, node).values())} for node in cluster.nodes}  # fmt: skip


def measure(cluster, stack, trials: int, load_minutes: float) -> dict:
    head, worker = cluster.nodes
    kinds = {
        "head engine core stopped": lambda: stall_and_recover(cluster, stack, head, "engine", head, "stalled"),
        "other node's rank stopped": lambda: stall_and_recover(cluster, stack, worker, "all", head, "stalled"),
        "wrong tokens": lambda: wrong_tokens(cluster, stack),
    }
    found = {}
    for name, fault in kinds.items():
        runs = [fault() for _ in range(trials)]
        found[name] = {what: [round(run[what], 1) for run in runs] for what in ("found", "serving")}
        found[name]["servingMedian"] = round(statistics.median(found[name]["serving"]), 1)
        print(f"{name}: found after {found[name]['found']} s, serving again after {found[name]['serving']} s",
              flush=True)  # fmt: skip
    if load_minutes:
        before = ended_or_restarted(cluster)
        outputs = stack["run"].outputs
        ran = load(outputs["endpoint"], stack["secrets"]["apiKey"], outputs["servedModelName"], load_minutes)
        after = ended_or_restarted(cluster)
        falsely = {n: {k: after[n][k] - before[n][k] for k in after[n]} for n in after}
        found["load"] = {"minutes": load_minutes, **ran, "endedOrRestarted": falsely}
        print(f"load for {load_minutes:g} min: {ran['ok']} answered, {ran['failed']} failed; vLLMs ended or "
              f"restarted meanwhile: {falsely}", flush=True)  # fmt: skip
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=3, help="runs of each fault")
    parser.add_argument("--stall-seconds", type=int, default=30, help="vllm.stallSeconds (at least 30)")
    parser.add_argument("--load-minutes", type=float, default=30.0, help="minutes of load (0: none)")
    args = parser.parse_args()
    problem = simnodes.skip_reason() or cli_missing()
    if problem:
        print(f"stall_recovery: cannot run here: {problem}", file=sys.stderr)
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="stall-recovery-"))
    simnodes.cleanup_stale()
    with simnodes.create_registry(workdir, CACHE_DIR / "registry") as registry:
        with simnodes.simulated_nodes(2, workdir / "nodes", registry=registry) as cluster:
            image = publish(CACHE_DIR, registry.address, cluster.nodes[0].docker_host)
            deployer = RehearsalStack(workdir / "deployer", "stall-recovery")
            deployer.init()
            vllm = {"port": 8000, "readyTimeoutSeconds": 180, "gpuMemoryUtilization": 0.5,
                    "stallSeconds": args.stall_seconds, "canarySeconds": 30}  # fmt: skip
            config, secrets = rehearsal_config(cluster, image.ref, make_model(workdir), executor="mp",
                                               recovery=RECOVERY, vllm=vllm)  # fmt: skip
            deployer.configure(config, secrets)
            try:
                stack = {"run": deployer.up(), "secrets": secrets}
                found = measure(cluster, stack, args.trials, args.load_minutes)
            finally:
                deployer.destroy()
    print(json.dumps({"stallSeconds": args.stall_seconds, "canarySeconds": 30, **found}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
