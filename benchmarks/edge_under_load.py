"""A keyed client's requests through the edge while one address attacks it (#64), beside the same with no attack.

    sudo venv/bin/python -m benchmarks.edge_under_load [--tls] [--requests 200] [--attacks NAME,…]

A real HAProxy (Debian's, as the rehearsal's) runs the configuration the program renders (components/plan/edge.py),
with the stack's default limits unless told otherwise, in front of an upstream on loopback that answers at once
(tests/edge_harness.py Recorder), so what is measured is the edge. Each attack of tests/edge_load.py runs from an
address of its own (127.0.0.3 and up) with enough connections to fill maxConnections; meanwhile a keyed client on
127.0.0.2 sends --requests chat completions on new connections, then as many on one kept-alive connection. Prints,
per attack, the client's requests, failures and latency at p50 and p99 (to the whole answer), and what the
attacker did. Nothing is asserted
(tests/unit/test_edge_load.py holds the edge to the rules); the figures go in docs/measurements.md.
"""

from __future__ import annotations

import argparse
import json
import resource
import ssl
import tempfile
from dataclasses import replace
from pathlib import Path

from components.plan.edge import EdgeSpec, Timeouts, key_digest
from tests import edge_load
from tests.edge_harness import Edge, Recorder
from tests.tls_ca import TestCa
from tests.waiting import free_port

KEY = "sk-benchmark-key-000000000001"
BODY = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":8}'


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tls", action="store_true", help="the endpoint over TLS (a test CA's certificate)")
    parser.add_argument("--requests", type=int, default=200, help="the keyed client's requests, each way")
    parser.add_argument("--attacks", default="", help="comma-separated names (default: every attack)")
    parser.add_argument("--max-connections", type=int, default=EdgeSpec.max_connections)
    parser.add_argument("--per-source", type=int, default=EdgeSpec.per_source_connections)
    parser.add_argument("--settle", type=float, default=3.0, help="seconds an attack runs before the client starts")
    args = parser.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 65536)), hard))
    upstream = Recorder().start()
    ca = TestCa()
    issued = ca.issue("127.0.0.1")
    spec = EdgeSpec(host="127.0.0.1", port=free_port(), upstream_host="127.0.0.1", upstream_port=upstream.port,
                    metrics_host="127.0.0.2", metrics_port=free_port(), clients=(("client", key_digest(KEY)),),
                    max_connections=args.max_connections, per_source_connections=args.per_source,
                    tls_pem=issued.certificate + issued.key if args.tls else None, timeouts=Timeouts())  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="edge-under-load-") as scratch:
        edge = Edge(replace(spec), Path(scratch)).start()
        try:
            target = edge_load.Target("127.0.0.1", spec.port, ssl.create_default_context(cadata=ca.pem) if args.tls
                                      else None)  # fmt: skip
            names = [name for name in args.attacks.split(",") if name] or None
            attackers = [f"127.0.0.{3 + n}" for n in range(len(edge_load.attacks(0)))]  # one an attack
            found = edge_load.under_attacks(target, attackers, "127.0.0.2", KEY, BODY, slots=args.max_connections,
                                            names=names, requests=args.requests, settle=args.settle)  # fmt: skip
        finally:
            edge.close()
            upstream.close()
    limits = {"maxConnections": spec.max_connections, "perSourceConnections": spec.per_source_connections,
              "keylessPerSource": spec.keyless_per_source, "tls": args.tls}  # fmt: skip
    print(f"edge under load, limits {json.dumps(limits)}")
    for line in edge_load.report(found):
        print("  " + line)


if __name__ == "__main__":
    main()
