"""The fabric gate's cost on a good 2-node fabric: what it adds to a deploy.

    sudo venv/bin/python -m benchmarks.fabric_gate [--runs 5]

Two simulated nodes (tests/e2e/nodes.py: network namespaces with their own sshd, joined by the
fabric bridge). Each run does what `pulumi up` does for the gate: the command the program renders
for each node (`python3 -` with components/scripts/node_fabric_gate.py and its PARAMS, as
components/resources/checks/fabric_gate.py sends it) over SSH to both nodes at once, then the judge on what they
printed.
It prints, per run, the wall time until both answered, each probe's own seconds and the bandwidth it
measured; then the median. Beside it, the same two SSH sessions running `true` (what any command of
the deploy costs): the difference is the gate's own share.

Target: under 5 s added to a deploy. The gate runs beside the image pull and the other checks (it
waits for nothing but the nodes' SSH), so this is an upper bound of what it adds. Numbers are
printed, nothing is asserted. Needs root.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

from components.config import load_cluster_config
from components.plan import fabric
from components.plan.programs import script_program
from components.plan.shell import shell_line, with_script
from tests.e2e import nodes as simnodes


def config_for(cluster) -> dict:
    return {
        "nodes": [
            {"name": n.name, "host": n.mgmt_ip, "fabricAddress": n.fabric_ip, "fabricInterface": n.fabric_interface}
            for n in cluster.nodes
        ],
        "image": "rehearsal:latest",
        "model": "/models/m",
        "tensorParallelSize": 2,
        "apiKey": "bench-key-0123456789",
        "nccl": {"ibDisable": True},  # the simulated links have no RDMA
    }


def both(cluster, commands: dict[str, str]) -> tuple[float, dict[str, str]]:
    """Run one command per node over SSH at once; (wall seconds until both ended, stdout by node)."""
    out: dict[str, str] = {}

    def one(name: str) -> None:
        out[name] = cluster.ssh(name, commands[name], timeout=120).stdout

    started = time.monotonic()
    threads = [threading.Thread(target=one, args=(name,)) for name in commands]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.monotonic() - started, out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="spark-vllm-gate-bench-"))
    with simnodes.simulated_nodes(2, work / "nodes") as cluster:
        cfg = load_cluster_config(config_for(cluster))
        gate = {
            node.name: with_script(
                shell_line(["python3", "-"]), script_program("node_fabric_gate.py", fabric.gate_params(cfg, node))
            )
            for node in cfg.nodes
        }
        bare = {node.name: "true" for node in cfg.nodes}
        walls, bares = [], []
        for run in range(args.runs):
            baseline, _ = both(cluster, bare)
            wall, out = both(cluster, gate)
            facts = {name: json.loads(text.strip().splitlines()[-1]) for name, text in out.items()}
            problems, figures = fabric.judge(cfg, facts)
            walls.append(wall)
            bares.append(baseline)
            probes = ", ".join(f"{name} {f['seconds']:.2f} s" for name, f in facts.items())
            print(
                f"run {run + 1}: gate {wall:.2f} s (ssh `true` {baseline:.2f} s); probes {probes}; "
                f"{fabric.describe(figures)}; {len(problems)} problem(s)"
            )
        gate_s, bare_s = statistics.median(walls), statistics.median(bares)
        print(
            f"median: the gate on 2 nodes {gate_s:.2f} s, of which SSH {bare_s:.2f} s: it adds at most "
            f"{gate_s:.2f} s to a deploy (target < 5 s), {gate_s - bare_s:.2f} s over any other command"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
