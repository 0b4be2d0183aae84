"""The fabric gate's NCCL test (fabric.bandwidthTest: nccl) as the program renders it, on the GPU machine.

    python3 -m tests.gpu.nccl --out DIR   (tests/gpu/device.sh nccl … does this; torch is the machine's own)

No Docker there: each rank is `python3 -` fed the program `<node>-fabric-nccl` would feed `docker run`
(components/scripts/nccl_bandwidth.py with nccl_params), in the environment its `-e` options set
(nccl_argv). Cases, then what the judge (components/plan/fabric_nccl.py judge_nccl) makes of each:

- one node: world 1 (NCCL's communicator on the GPU, the all-reduce, its check and timing, what NCCL
  says of its network);
- two nodes: two ranks at once as two nodes run them (the rendezvous on the head's address), each rank a
  host of its own to NCCL (NCCL_HOSTID: NCCL tells hosts apart by that hash, and between processes of one
  host takes shared-memory and NVLink paths two nodes do not have), so the all-reduce crosses the network
  NCCL picked, as between two Sparks; on its own GPU where the machine has one a rank;
- two ranks of one host: the same without NCCL_HOSTID, which on one GPU ends in NCCL's own `Duplicate GPU
  detected`, and on two is what NCCL does between two GPUs of one host (P2P/NVLink).

Writes nccl.json to --out.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from components.config import load_cluster_config  # noqa: E402
from components.plan import fabric  # noqa: E402
from components.plan.programs import script_program  # noqa: E402
from components.scripts.node_contract import NcclFacts  # noqa: E402
from tests.gpu.lane import gpu_total_mib, machine_address, machine_facts  # noqa: E402


def stack(nodes: int, address: str, interface: str) -> dict:
    """A stack config of `nodes` nodes on this machine's interface (the others' addresses are only
    their ranks' NCCL settings: every rank runs here and meets at the head's address)."""
    base = address.rsplit(".", 1)
    names = [f"gpu-{index + 1}" for index in range(nodes)]
    addresses = [address] + [f"{base[0]}.{(int(base[1]) + index) % 254 + 1}" for index in range(1, nodes)]
    return {
        "nodes": [
            {"name": name, "host": f"127.0.0.{index + 1}", "fabricAddress": fab, "fabricInterface": interface}
            for index, (name, fab) in enumerate(zip(names, addresses, strict=True))
        ],
        "tensorParallelSize": nodes,
        "image": "lane",
        "model": "/models/none",
        "maxModelLen": 4096,
        "fabric": {"bandwidthTest": "nccl", "testPort": 29660},
        "vllm": {"allowUnauthenticated": True},  # no vLLM runs here
    }


def one_machine_config(raw: dict):
    """The config of ranks that all run on this machine. On loopback (a machine with no other interface)
    the rule against loopback fabric addresses between nodes would refuse it: validated with stand-in
    addresses, then given back the loopback ones its ranks really meet at."""
    addresses = [node["fabricAddress"] for node in raw["nodes"]]
    if not any(ipaddress.IPv4Address(address).is_loopback for address in addresses):
        return load_cluster_config(raw)
    standin = {**raw, "nodes": [{**n, "fabricAddress": f"192.0.2.{i + 1}"} for i, n in enumerate(raw["nodes"])]}
    cfg = load_cluster_config(standin)
    nodes = [
        node.model_copy(update={"fabric_address": ipaddress.IPv4Address(address)})
        for node, address in zip(cfg.nodes, addresses, strict=True)
    ]
    return cfg.model_copy(update={"nodes": nodes})


def rendered(cfg, node) -> tuple[str, dict[str, str]]:
    """The program on the test's stdin and the environment its `docker run -e` options give it."""
    argv = fabric.nccl_argv(cfg, node, "IMAGE")
    env = dict(argv[i + 1].split("=", 1) for i, word in enumerate(argv) if word == "-e")
    return script_program("nccl_bandwidth.py", fabric.nccl_params(cfg, node)), env


def as_nodes(names: list[str], gpus: int, hosts: bool) -> dict[str, dict[str, str]]:
    """What makes ranks of this one machine stand for nodes: each rank's own GPU where the machine has one for
    each (a Spark's container sees its one GPU), and with `hosts` a host of its own to NCCL (NCCL_HOSTID)."""
    env: dict[str, dict[str, str]] = {name: {} for name in names}
    for index, name in enumerate(names):
        if gpus >= len(names) > 1:
            env[name]["CUDA_VISIBLE_DEVICES"] = str(index)
        if hosts:
            env[name]["NCCL_HOSTID"] = f"spark-vllm-lane-{name}"
    return env


def run_ranks(cfg, emulated: dict[str, dict[str, str]] | None = None) -> dict[str, dict]:
    """Every node's test at once, as `pulumi up` starts them (`emulated`: a rank's environment beside the
    rendered one, as_nodes); each one's JSON line."""
    started, processes = time.monotonic(), {}
    for node in cfg.nodes:
        program, env = rendered(cfg, node)
        processes[node.name] = subprocess.Popen(
            [sys.executable, "-"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, **env, **(emulated or {}).get(node.name, {})},
        )
        processes[node.name].stdin.write(program)
        processes[node.name].stdin.close()
    facts = {}
    for name, process in processes.items():
        out = process.stdout.read()
        process.wait(timeout=fabric.NCCL_TIMEOUT_SECONDS + 60)
        lines = [line for line in out.splitlines() if line.startswith("{")]
        facts[name] = json.loads(lines[-1]) if lines else {"error": f"no result: {out[-400:]!r}"}
        facts[name]["exit"] = process.returncode
    print(f"nccl: {len(cfg.nodes)} rank(s) in {time.monotonic() - started:.1f} s", flush=True)
    return facts


def argument_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tests.gpu.nccl", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "/var/tmp/lane/out"))
    parser.add_argument("--fabric", default=None, help="ADDRESS:INTERFACE (default: the first off loopback)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = argument_parser().parse_args(argv)
    address, interface = tuple(args.fabric.split(":", 1)) if args.fabric else machine_address()
    gpus = len(gpu_total_mib())
    report: dict = {"date": time.strftime("%Y-%m-%d"), "machine": machine_facts(), "address": address,
                    "interface": interface, "gpus": gpus, "cases": {}}  # fmt: skip
    for name, nodes, hosts in (("one node", 1, False), ("two nodes", 2, True), ("two ranks of one host", 2, False)):
        cfg = one_machine_config(stack(nodes, address, interface))
        emulated = as_nodes([node.name for node in cfg.nodes], gpus, hosts)
        facts = run_ranks(cfg, emulated)
        typed = {
            node: NcclFacts.from_json({k: v for k, v in each.items() if k != "exit"}) for node, each in facts.items()
        }
        problems, figures = fabric.judge_nccl(cfg, typed, {})  # as the gate reads them (the exit code is the lane's)
        report["cases"][name] = {"emulated": emulated, "facts": facts, "problems": problems, "figures": figures}
        print(json.dumps(report["cases"][name], indent=1)[:3000], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "nccl.json").write_text(json.dumps(report, indent=1))
    one = report["cases"]["one node"]["facts"]["gpu-1"]
    return 0 if one.get("correct") and "error" not in one else 1


if __name__ == "__main__":
    sys.exit(main())
