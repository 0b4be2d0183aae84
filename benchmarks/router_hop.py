"""What the endpoint adds to the time to first token, on simulated nodes.

    sudo venv/bin/python -m benchmarks.router_hop [--requests 300] [--warmup 30]
    sudo venv/bin/python -m benchmarks.router_hop --one-model    # the edge alone, in front of one model's vLLM

With --one-model: two simulated nodes and the rehearsal's single-model stack (TP 2 over both, Ray) over TLS; from
node-2's namespace, vLLM directly (node-1's fabric address, edge.vllmPort) against the endpoint (the edge on
node-1's management address, https). Without it:

Three simulated nodes (tests/e2e/nodes.py) and the rehearsal's deployments stack (tests/e2e/test_deployments.py:
`big` over node-1 and node-2, `small` with two replicas on node-3, the real vllm-router 0.1.17 on node-1),
deployed with the real CLI, its endpoint over TLS with a key per client (as it should be handed out). Then,
from a client in node-1's network namespace (vLLM listens on the fabric only, which this machine has no address
on), streamed chat completions for small-model, taking turns between a replica directly (plain HTTP to node-3's
fabric address, port 8000, with vLLM's key) and through the endpoint (https://node-1:8080, the certificate
verified: the edge, HAProxy, then vllm-router, which sends it on to a replica of small over the fabric), the
endpoint on a kept-alive connection (as SDK clients keep theirs) and on a new one per request (its TLS handshake
included): the time from sending the request to the first content chunk, per path. Printed: p50, p90 and mean
of each. Then `tls` is removed (a `pulumi up` that touches no container and no vLLM) and the same is sampled over plain
HTTP: what TLS adds is the difference of the two (target: under 1 ms at p50 on kept-alive connections). The
stand-in's own time to first token is the same on every path (its prefill pace and one decode step), and each
crosses from node-1 to node-3 once, so the difference is the endpoint's: TLS, the edge and vllm-router. Since the
stand-in schedules a request at its engine's next step (every 50 ms, as vLLM's engine core steps), the time to the
first token carries up to 50 ms of that clock's phase on every path; the time to the answer's head, which the
stand-in sends before it schedules the request, does not, and is what the added figure is computed from. Both are
printed.

Numbers are printed, nothing is asserted; this machine is shared and has 2 cores.
Needs root (namespaces, one dockerd per node) and the CLI built by scripts/toolchain.sh.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import ssl
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tests.e2e import nodes as simnodes
from tests.e2e.cli_stack import RehearsalStack, cli_missing
from tests.e2e.image.build import publish
from tests.e2e.rehearsal import CACHE_DIR, make_model, program_key, rehearsal_config
from tests.e2e.test_deployments import deployments_config


class Way:
    """One way to the model: plain HTTP to vLLM on the fabric, or the endpoint over TLS (`ca` verifies it), on a
    kept-alive connection (as the openai SDK and curl reuse theirs) or a new one per request (`fresh`)."""

    def __init__(self, host: str, port: int, key: str, ca: str | None = None, fresh: bool = False):
        self.host, self.port, self.key, self.ca, self.fresh = host, port, key, ca, fresh
        self.connection: http.client.HTTPConnection | None = None

    def connect(self) -> http.client.HTTPConnection:
        if self.ca is None:
            return http.client.HTTPConnection(self.host, self.port, timeout=30)
        return http.client.HTTPSConnection(
            self.host, self.port, timeout=30, context=ssl.create_default_context(cadata=self.ca)
        )

    def first_token_ms(self, model: str) -> tuple[float, float]:
        """One streamed chat completion: milliseconds until its answer's head, and until its first content chunk
        (a new connection's handshake included in both when there is one)."""
        body = json.dumps({"model": model, "messages": [{"role": "user", "content": "one two three"}],
                           "max_tokens": 4, "stream": True})  # fmt: skip
        started = time.perf_counter()
        if self.connection is None or self.fresh:
            self.connection = self.connect()
        headers = {"Content-Type": "application/json", "Authorization": f"Bearer {self.key}"}
        self.connection.request("POST", "/v1/chat/completions", body=body, headers=headers)
        response = self.connection.getresponse()
        head = (time.perf_counter() - started) * 1000
        if response.status != 200:
            raise RuntimeError(f"{self.host}:{self.port} answered {response.status}")
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
        if self.fresh:
            self.connection.close()
        return head, elapsed


def summary(samples: list[float]) -> dict:
    ordered = sorted(samples)
    return {
        "p50": round(statistics.median(ordered), 3),
        "p90": round(ordered[int(len(ordered) * 0.9)], 3),
        "mean": round(statistics.fmean(ordered), 3),
        "n": len(ordered),
    }


def sample(paths: dict[str, Way], model: str, requests: int, warmup: int) -> dict:
    """The samples of every path (the answer's head, the first token), taking turns in a rotating order, run where
    the client is (a node's namespace)."""
    for _ in range(warmup):
        for path in paths.values():
            path.first_token_ms(model)
    found: dict[str, dict[str, list[float]]] = {name: {"head": [], "firstToken": []} for name in paths}
    names = list(paths)
    for n in range(requests):
        for name in names[n % len(names) :] + names[: n % len(names)]:
            head, first = paths[name].first_token_ms(model)
            found[name]["head"].append(head)
            found[name]["firstToken"].append(first)
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=300, help="measured requests per path")
    parser.add_argument("--warmup", type=int, default=30, help="requests per path before measuring")
    one = "the rehearsal's single-model stack on two nodes: the edge alone in front of vLLM"
    parser.add_argument("--one-model", action="store_true", help=one)
    parser.add_argument("--sample", nargs=2, metavar=("DIRECT", "ROUTED"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.sample:  # the client's part, in a node's namespace: host:port host:port, keys and the CA in the environment
        direct, routed = (part.rsplit(":", 1) for part in args.sample)
        env = os.environ
        ca = env.get("ROUTER_HOP_CA") or None  # none: the endpoint over plain HTTP
        paths = {
            "direct": Way(direct[0], int(direct[1]), env["ROUTER_HOP_DIRECT_KEY"]),
            "endpoint": Way(routed[0], int(routed[1]), env["ROUTER_HOP_KEY"], ca),
            "endpointNewConnection": Way(routed[0], int(routed[1]), env["ROUTER_HOP_KEY"], ca, fresh=True),
        }
        print(json.dumps(sample(paths, env["ROUTER_HOP_MODEL"], args.requests, args.warmup)))
        return 0
    problem = simnodes.skip_reason() or cli_missing()
    if problem:
        print(f"router_hop: cannot run here: {problem}", file=sys.stderr)
        return 2
    found = measure(args)
    figures = {
        phase: {name: {what: summary(samples) for what, samples in kinds.items()} for name, kinds in paths.items()}
        for phase, paths in found.items()
    }
    added = {phase: _added(paths) for phase, paths in figures.items()}
    tls = round(added["tls"]["kept"] - added["plain"]["kept"], 3)
    print(json.dumps({"ms": figures, "endpointAddsP50Ms": added, "tlsAddsP50Ms": tls, "targetMs": 1.0}, indent=1))
    what = "the edge" if args.one_model else "the endpoint (the edge and vllm-router)"
    print(f"{what} adds {added['plain']['kept']} ms at p50 over HTTP and {added['tls']['kept']} ms over TLS (to the "
          f"answer's head, kept-alive connections, against vLLM directly): TLS adds {tls} ms (target < 1 ms): "
          f"{'met' if tls < 1.0 else 'NOT met'}; a new TLS connection per request (its handshake) adds "
          f"{added['tls']['new']} ms, a new plain one {added['plain']['new']} ms")  # fmt: skip
    return 0


def _added(paths: dict) -> dict:
    """What the endpoint adds at p50 to the answer's head over vLLM directly: kept-alive and new connections."""
    direct = paths["direct"]["head"]["p50"]
    return {
        "kept": round(paths["endpoint"]["head"]["p50"] - direct, 3),
        "new": round(paths["endpointNewConnection"]["head"]["p50"] - direct, 3),
    }


def measure(args: argparse.Namespace) -> dict:
    """The stack deployed over TLS and sampled, then `tls` removed (an `up` that reloads the edge) and sampled
    again: {"tls": samples, "plain": samples}."""
    workdir = Path(tempfile.mkdtemp(prefix="router-hop-"))
    simnodes.cleanup_stale()
    found = {}
    with simnodes.create_registry(workdir, CACHE_DIR / "registry") as registry:
        with simnodes.simulated_nodes(2 if args.one_model else 3, workdir / "nodes", registry=registry) as cluster:
            image = publish(CACHE_DIR, registry.address, cluster.nodes[0].docker_host)
            stack = RehearsalStack(workdir / "deployer", "router-hop")
            stack.init()
            if args.one_model:  # from node-2: vLLM on node-1's fabric address, or the edge on its management one
                config, secrets = rehearsal_config(cluster, image.ref, make_model(workdir), tls=True)
                client_node, direct = cluster.nodes[1], f"{cluster.nodes[0].fabric_ip}:29002"
                behind = (cluster.nodes[0], "spark-vllm-node-1")
            else:  # from node-1: small's replica on node-3's fabric address, or the endpoint on node-1
                config, secrets = deployments_config(cluster, image.ref, make_model(workdir))
                client_node, direct = cluster.nodes[0], f"{cluster.nodes[2].fabric_ip}:8000"
                behind = (cluster.nodes[2], "spark-vllm-small-node-3")
            try:
                for phase, values in (("tls", secrets), ("plain", {k: v for k, v in secrets.items() if k != "tls"})):
                    stack.configure(config, values)
                    outputs = stack.up().outputs
                    routed = outputs["endpoint"].split("://", 1)[1].removesuffix("/v1")
                    model = "small-model" if not args.one_model else outputs["servedModelName"]
                    client = [sys.executable, "-m", "benchmarks.router_hop", "--requests", str(args.requests),
                              "--warmup", str(args.warmup), "--sample", direct, routed]  # fmt: skip
                    env = {**os.environ, "ROUTER_HOP_KEY": secrets["apiKeys"]["alice"], "ROUTER_HOP_MODEL": model,
                           "ROUTER_HOP_CA": values.get("tls", {}).get("ca", ""),
                           "ROUTER_HOP_DIRECT_KEY": program_key(cluster, *behind)}  # fmt: skip
                    ran = cluster.run_in(client_node, client, timeout=3600, cwd=Path(__file__).resolve().parents[1],
                                         env=env)  # fmt: skip
                    found[phase] = json.loads(ran.stdout.strip().splitlines()[-1])
            finally:
                stack.destroy()
    return found


if __name__ == "__main__":
    sys.exit(main())
