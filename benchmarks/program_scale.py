"""How the program's evaluation scales with the number of nodes, next to what registration costs.

    venv/bin/python -m benchmarks.program_scale [--nodes 2 16 128] [--repeats 3]

For each node count N it runs, in one process and interleaved repeat by repeat:

* the real `__main__.py` under Pulumi's mocks, through `tests.harness.run_program` (FakeCloud,
  RecordingMonitor) with a valid N-node stack config (TP = N, one GPU a node, pinned host keys,
  an `apiKey` secret);
* the floor: `benchmarks/floor/__main__.py`, a bare program registering as many trivial
  ComponentResources and CustomResources as the real run did (customs parented to components),
  through the very same `run_program` (only the program file differs).

Times are wall-clock seconds of the whole `run_program` call, the BEST (minimum) of `--repeats`
runs, after one untimed warm-up of each program at N=2 so imports are not counted. The minimum,
not the median, because the machine may be shared: other load only ever adds time. The process
CPU time of the same runs is printed too, as a cross-check that is less sensitive to other load.

"Longest chain" is the longest path of dependent custom resources, counted in resources. An edge
A -> B exists when B lists A in its `dependencies` or uses A as its provider; a dependency on a
component stands for every custom resource under it. Parent edges are not counted: a component
does no work of its own.

Targets checked (from the issue):
* ratio: program time at the largest N is at most 1.5x its floor;
* linear resources: resources = a*N + b exactly across all N (constant resources per node);
* linear time: seconds per resource at the largest N is within 2x of that at the next N (16);
* parallel nodes: the longest chain is the same at the two largest N (16 and 128).

Exit code: 0 when every target passes, 1 when any fails (so CI can gate on it); the table is
printed either way.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from unittest import mock

from tests import harness
from tests.harness import FakeCloud, ProgramRun, Registration, run_program

FLOOR_DIR = Path(__file__).resolve().parent / "floor"
HOST_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIPinnedHostKeyForTests"
SECRETS = {"apiKey": "sk-benchmark-0000"}
MAX_RATIO = 1.5
MAX_TIME_PER_RESOURCE_GROWTH = 2.0


def cluster_config(n: int) -> dict:
    nodes = [
        {
            "name": f"node-{i + 1}",
            "host": f"10.0.{i // 250}.{i % 250 + 1}",
            "fabricAddress": f"192.168.{i // 250}.{i % 250 + 1}",
            "fabricInterface": "enp1s0f1np1",
            "gpus": 1,
            "hostKey": HOST_KEY,
        }
        for i in range(n)
    ]
    return {
        "nodes": nodes,
        "image": "vllm/vllm-openai:v0.11.0",
        "model": "/models/Qwen3-8B",
        "tensorParallelSize": n,
    }


def run_real(n: int) -> ProgramRun:
    return run_program(cluster_config(n), SECRETS, stack=f"bench-{n}", mocks=FakeCloud())


def run_floor(components: int, customs: int) -> ProgramRun:
    # Same harness, same monitor and mocks: only the program file it executes is swapped.
    with mock.patch.object(harness, "ROOT", FLOOR_DIR):
        return run_program({"floorComponents": components, "floorCustoms": customs}, stack="floor", mocks=FakeCloud())


def timed(fn: Callable[[], ProgramRun]) -> tuple[float, float, ProgramRun]:
    """(wall seconds, process CPU seconds, result)."""
    gc.collect()
    start, cpu = time.perf_counter(), time.process_time()
    result = fn()
    return time.perf_counter() - start, time.process_time() - cpu, result


def longest_chain(registrations: list[Registration]) -> tuple[int, list[str]]:
    """Longest path (in custom resources) over dependency and provider edges."""
    by_urn = {r.urn: r for r in registrations}
    children: dict[str, list[str]] = {}
    for r in registrations:
        children.setdefault(r.parent, []).append(r.urn)

    def customs_under(urn: str) -> set[str]:
        found, stack = set(), [urn]
        while stack:
            u = stack.pop()
            reg = by_urn.get(u)
            if reg is not None and reg.custom:
                found.add(u)
            else:
                stack.extend(children.get(u, []))
        return found

    def predecessors(r: Registration) -> set[str]:
        preds: set[str] = set()
        for dep in r.dependencies:
            preds |= customs_under(dep)
        if r.provider:
            preds.add(r.provider.rsplit("::", 1)[0])  # "urn::id"
        preds.discard(r.urn)
        return {p for p in preds if p in by_urn}

    best: dict[str, tuple[int, str | None]] = {}
    # A resource can only name URNs already registered, so registration order is topological;
    # still, resolve recursively in case the mocks ever reorder.
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))

    def depth(urn: str) -> int:
        if urn not in best:
            preds = predecessors(by_urn[urn])
            prev = max(preds, key=depth, default=None)
            best[urn] = ((depth(prev) if prev else 0) + 1, prev)
        return best[urn][0]

    customs = [r.urn for r in registrations if r.custom]
    if not customs:
        return 0, []
    end = max(customs, key=depth)
    path, cur = [], end
    while cur:
        path.append(by_urn[cur].name)
        cur = best[cur][1]
    return best[end][0], path[::-1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[2, 16, 128])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    sizes = sorted(args.nodes)

    home = tempfile.mkdtemp(prefix="spark-vllm-bench-")
    os.environ["SPARK_VLLM_HOME"] = home  # the program writes known_hosts here
    try:
        # Warm-up: imports, pydantic schema building, gRPC/protobuf first use.
        run_real(2)
        run_floor(2, 2)
        rows = []
        for n in sizes:
            real_times, floor_times, real_cpu, floor_cpu = [], [], [], []
            real_run = floor_run = None
            for _ in range(args.repeats):
                t, c, real_run = timed(lambda n=n: run_real(n))
                real_times.append(t)
                real_cpu.append(c)
                total = len(real_run.registrations)
                custom = sum(r.custom for r in real_run.registrations)
                t, c, floor_run = timed(lambda total=total, custom=custom: run_floor(total - custom, custom))
                floor_times.append(t)
                floor_cpu.append(c)
            floor_count = len(floor_run.registrations)
            assert floor_count == total, f"floor registered {floor_count}, program {total}"
            chain, path = longest_chain(real_run.registrations)
            program_s, floor_s = min(real_times), min(floor_times)
            rows.append(
                {
                    "n": n,
                    "resources": total,
                    "custom": custom,
                    "program": program_s,
                    "floor": floor_s,
                    "ratio": program_s / floor_s,
                    "chain": chain,
                    "path": path,
                    "spread": (min(real_times), max(real_times), min(floor_times), max(floor_times)),
                    "cpu": (min(real_cpu), min(floor_cpu)),
                    "dependencies": sum(len(r.dependencies) for r in real_run.registrations),
                }
            )
    finally:
        shutil.rmtree(home, ignore_errors=True)

    print(f"best of {args.repeats} runs each, program and floor interleaved; seconds are wall clock\n")
    header = (
        f"{'nodes':>5} | {'resources (custom)':>18} | {'program s':>9} | {'floor s':>7} | {'ratio':>5} | "
        f"{'longest chain':>13} | {'s per node':>10}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        res = f"{r['resources']} ({r['custom']})"
        print(
            f"{r['n']:>5} | {res:>18} | {r['program']:>9.3f} | {r['floor']:>7.3f} | {r['ratio']:>5.2f} | "
            f"{r['chain']:>13} | {r['program'] / r['n']:>10.4f}"
        )
    print()
    for r in rows:
        lo, hi, flo, fhi = r["spread"]
        cpu, fcpu = r["cpu"]
        print(
            f"  N={r['n']}: program runs {lo:.3f}-{hi:.3f} s (cpu {cpu:.3f}), floor runs {flo:.3f}-{fhi:.3f} s "
            f"(cpu {fcpu:.3f}), cpu ratio {cpu / fcpu:.2f}; {r['dependencies']} dependency URNs recorded"
        )
    print(f"  longest chain at N={rows[-1]['n']}: {' -> '.join(rows[-1]['path'])}")
    print()

    checks: list[tuple[bool, str]] = []
    big = rows[-1]
    checks.append(
        (
            big["ratio"] <= MAX_RATIO,
            f"ratio at {big['n']} nodes: {big['ratio']:.2f}x its floor (target <= {MAX_RATIO}x)",
        )
    )
    if len(rows) >= 2:
        slopes = [(b["resources"] - a["resources"]) / (b["n"] - a["n"]) for a, b in zip(rows, rows[1:], strict=False)]
        checks.append(
            (
                len(set(slopes)) == 1,
                "resources linear in nodes: "
                + ", ".join(f"{s:g}" for s in slopes)
                + " resources per added node between consecutive sizes (target: all equal)",
            )
        )
        mid = rows[-2]
        per_mid, per_big = mid["program"] / mid["resources"], big["program"] / big["resources"]
        growth = per_big / per_mid
        checks.append(
            (
                growth <= MAX_TIME_PER_RESOURCE_GROWTH,
                f"time linear in nodes: {per_big * 1e3:.2f} ms/resource at {big['n']} vs {per_mid * 1e3:.2f} at "
                f"{mid['n']} = {growth:.2f}x (target <= {MAX_TIME_PER_RESOURCE_GROWTH}x)",
            )
        )
        checks.append(
            (
                mid["chain"] == big["chain"],
                f"longest chain at {mid['n']} = {mid['chain']}, at {big['n']} = {big['chain']} (target: equal)",
            )
        )
    for ok, text in checks:
        print(f"{'PASS' if ok else 'FAIL'}: {text}")
    return 0 if all(ok for ok, _ in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
