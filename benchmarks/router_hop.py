"""What the endpoint adds to the time to first token, on simulated nodes.

    sudo venv/bin/python -m benchmarks.router_hop [--requests 300] [--warmup 30]
    sudo venv/bin/python -m benchmarks.router_hop --one-model    # the edge alone, in front of one model's vLLM

With --one-model: two simulated nodes and the rehearsal's single-model stack (TP 2 over both, Ray); from node-2's
namespace, vLLM directly (node-1's fabric address, edge.vllmPort) against the endpoint (the edge on node-1's
management address). Without it:

Three simulated nodes (tests/e2e/nodes.py) and the rehearsal's deployments stack (tests/e2e/test_deployments.py:
`big` over node-1 and node-2, `small` with two replicas on node-3, the real vllm-router 0.1.17 on node-1),
deployed with the real CLI. Then, from a client in node-1's network namespace (vLLM listens on the fabric only,
which this machine has no address on), streamed chat completions for small-model, alternating between a
replica directly (node-3's fabric address, port 8000) and through the endpoint (node-1:8080: the edge, HAProxy,
then vllm-router, which sends it on to a replica of small over the fabric): the time from sending the request
to the first content chunk, per path. Printed: p50, p90 and mean of each, and the p50 the router adds (target:
under 1 ms). The stand-in's own time to first token is the same on both paths (its prefill pace and one decode
step), and both cross from node-1 to node-3 once, so the difference is the endpoint's hops: the edge and
vllm-router.

Numbers are printed, nothing is asserted; this machine is shared and has 2 cores.
Needs root (namespaces, one dockerd per node) and the CLI built by scripts/toolchain.sh.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tests.e2e import nodes as simnodes
from tests.e2e.cli_stack import RehearsalStack, cli_missing
from tests.e2e.image.build import publish
from tests.e2e.rehearsal import CACHE_DIR, make_model, rehearsal_config
from tests.e2e.test_deployments import deployments_config


def first_token_ms(host: str, port: int, key: str, model: str) -> float:
    """One streamed chat completion: milliseconds until its first content chunk."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "one two three"}],
                       "max_tokens": 4, "stream": True})  # fmt: skip
    connection = http.client.HTTPConnection(host, port, timeout=30)
    started = time.perf_counter()
    connection.request("POST", "/v1/chat/completions", body=body,
                       headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})  # fmt: skip
    response = connection.getresponse()
    if response.status != 200:
        raise RuntimeError(f"{host}:{port} answered {response.status}")
    seen = b""
    while True:
        part = response.read1(65536)  # what has arrived, de-chunked
        if not part:
            raise RuntimeError("the stream ended before any content")
        seen += part
        if any(b'"content": "' in line and b'"content": ""' not in line for line in seen.split(b"\n")):
            elapsed = (time.perf_counter() - started) * 1000
            break
    response.read()
    connection.close()
    return elapsed


def summary(samples: list[float]) -> dict:
    ordered = sorted(samples)
    return {
        "p50": round(statistics.median(ordered), 3),
        "p90": round(ordered[int(len(ordered) * 0.9)], 3),
        "mean": round(statistics.fmean(ordered), 3),
        "n": len(ordered),
    }


def sample(direct: tuple[str, int], routed: tuple[str, int], key: str, model: str, requests: int, warmup: int) -> dict:
    """The alternating samples, run where the client is (a node's namespace)."""
    for _ in range(warmup):
        first_token_ms(*direct, key, model)
        first_token_ms(*routed, key, model)
    found: dict[str, list[float]] = {"direct": [], "router": []}
    for n in range(requests):
        order = [("direct", direct), ("router", routed)]
        for name, (host, port) in order if n % 2 else reversed(order):
            found[name].append(first_token_ms(host, port, key, model))
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=300, help="measured requests per path")
    parser.add_argument("--warmup", type=int, default=30, help="requests per path before measuring")
    one = "the rehearsal's single-model stack on two nodes: the edge alone in front of vLLM"
    parser.add_argument("--one-model", action="store_true", help=one)
    parser.add_argument("--sample", nargs=2, metavar=("DIRECT", "ROUTED"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.sample:  # the client's part, in node-1's namespace: host:port host:port, the key in the environment
        direct, routed = (tuple(part.rsplit(":", 1)) for part in args.sample)
        found = sample((direct[0], int(direct[1])), (routed[0], int(routed[1])), os.environ["ROUTER_HOP_KEY"],
                       os.environ["ROUTER_HOP_MODEL"], args.requests, args.warmup)  # fmt: skip
        print(json.dumps(found))
        return 0
    problem = simnodes.skip_reason() or cli_missing()
    if problem:
        print(f"router_hop: cannot run here: {problem}", file=sys.stderr)
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="router-hop-"))
    simnodes.cleanup_stale()
    with simnodes.create_registry(workdir, CACHE_DIR / "registry") as registry:
        with simnodes.simulated_nodes(2 if args.one_model else 3, workdir / "nodes", registry=registry) as cluster:
            image = publish(CACHE_DIR, registry.address, cluster.nodes[0].docker_host)
            stack = RehearsalStack(workdir / "deployer", "router-hop")
            stack.init()
            if args.one_model:  # from node-2: vLLM on node-1's fabric address, or the edge on its management one
                config, secrets = rehearsal_config(cluster, image.ref, make_model(workdir))
                client_node, direct, routed = cluster.nodes[1], f"{cluster.nodes[0].fabric_ip}:29002", None
            else:  # from node-1: small's replica on node-3's fabric address, or the endpoint on node-1
                config, secrets = deployments_config(cluster, image.ref, make_model(workdir))
                client_node, direct = cluster.nodes[0], f"{cluster.nodes[2].fabric_ip}:8000"
            stack.configure(config, secrets)
            try:
                outputs = stack.up().outputs
                routed = outputs["endpoint"].removeprefix("http://").removesuffix("/v1")
                model = "small-model" if not args.one_model else outputs["servedModelName"]
                client = [sys.executable, "-m", "benchmarks.router_hop", "--requests", str(args.requests),
                          "--warmup", str(args.warmup), "--sample", direct, routed]  # fmt: skip
                env = {**os.environ, "ROUTER_HOP_KEY": secrets["apiKey"], "ROUTER_HOP_MODEL": model}
                ran = cluster.run_in(client_node, client, timeout=3600, cwd=Path(__file__).resolve().parents[1],
                                     env=env)  # fmt: skip
                found = json.loads(ran.stdout.strip().splitlines()[-1])
            finally:
                stack.destroy()
    figures = {name: summary(samples) for name, samples in found.items()}
    added = round(figures["router"]["p50"] - figures["direct"]["p50"], 3)
    print(json.dumps({"ttftMs": figures, "routerAddsP50Ms": added, "targetMs": 1.0}, indent=1))
    what = "the edge" if args.one_model else "the endpoint (the edge and vllm-router)"
    print(f"{what} adds {added} ms to the time to first token at p50 (target < 1 ms): "
          f"{'met' if added < 1.0 else 'NOT met'}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
