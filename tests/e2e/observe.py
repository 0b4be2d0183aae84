"""What the rehearsal's tests look at on the simulated nodes: containers, processes, Ray's nodes."""

from __future__ import annotations

import os
from pathlib import Path

RAY_NODES = (
    "import json, ray; ray.init(address='auto', logging_level='ERROR'); "
    "print(json.dumps([n['NodeManagerAddress'] for n in ray.nodes() if n['Alive']]))"
)


def container_ids(cluster) -> dict[str, str]:
    return {
        node.name: cluster.docker(node, "ps", "-q", "--no-trunc", "--filter", "label=spark-vllm.node").stdout.strip()
        for node in cluster.nodes
    }


def no_containers(cluster) -> bool:
    return all(cluster.docker(node, "ps", "-aq").stdout.strip() == "" for node in cluster.nodes)


def netns_processes(cluster, words=("raylet", "gcs_server", "vllm", "ray start", "standin")) -> list[str]:
    """Processes of any node's network namespace whose command line names Ray or vLLM."""
    inodes = {os.stat(node.netns_path).st_ino for node in cluster.nodes}
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{pid}/ns/net").st_ino not in inodes:
                continue
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(word in cmdline for word in words):
            found.append(f"{pid}: {cmdline[:120]}")
    return found
