"""How the program's evaluation scales with the number of nodes, next to what registration costs.

    venv/bin/python -m benchmarks.program_scale [--nodes 2 16 128] [--repeats 3]

For each node count N, in one process, interleaved repeat by repeat, all through the same
`tests.harness.run_program` (FakeCloud mocks, RecordingMonitor, runpy); only the program differs:

* program: the real `__main__.py` with a valid N-node stack config (TP = N, one GPU a node,
  pinned host keys, an `apiKey` secret);
* floor: `benchmarks/floor/__main__.py`, a bare program registering as many trivial
  ComponentResources and CustomResources (one input each, customs parented to components) as the
  program did. This is the floor the issue's targets are measured against;
* typed floor (diagnostic only): `benchmarks/typed_floor/__main__.py`, the program's resource tree
  rebuilt from the same SDK classes, names, parents and providers, with minimal inputs and no
  dependencies. program / typed floor is what the program's own code adds; typed / trivial floor
  is what the resource classes cost, which no change to the program can remove.

Times are wall-clock seconds of the whole `run_program` call, the BEST (minimum) of `--repeats`
runs, after one untimed warm-up of each program at N=2 so imports are not counted. The minimum,
not the median, because the machine may be shared: other load only ever adds time. The process
CPU time of the same runs is printed too, as a cross-check less sensitive to other load.

"Longest chain" is the longest path of dependent custom resources, counted in resources. An edge
A -> B exists when B lists A in its `dependencies` or uses A as its provider; a dependency on a
component stands for every custom resource under it. Parent edges are not counted: a component
does no work of its own.

Targets (from the issue), each printed as PASS or FAIL:
* ratio: program time at the largest N is at most 1.5x the floor's;
* linear resources: resources = a*N + b exactly across all N (constant resources per node);
* linear time: seconds per resource at the largest N within 2x of that at the next N (16);
* parallel nodes: the longest chain is the same at the two largest N (16 and 128).

Exit code: 0 when every target passes, 1 when any fails (CI can gate on it); the whole report is
printed either way. A run takes about a minute on 2 cores.
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
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from unittest import mock

from tests import harness
from tests.harness import FakeCloud, ProgramRun, Registration, run_program

HERE = Path(__file__).resolve().parent
FLOOR_DIR = HERE / "floor"
TYPED_FLOOR_DIR = HERE / "typed_floor"
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


def _run_other(program_dir: Path, config: dict, stack: str) -> ProgramRun:
    # Same harness, same monitor and mocks: only the program file it executes is swapped.
    with mock.patch.object(harness, "ROOT", program_dir):
        return run_program(config, stack=stack, mocks=FakeCloud())


def run_floor(components: int, customs: int) -> ProgramRun:
    return _run_other(FLOOR_DIR, {"floorComponents": components, "floorCustoms": customs}, "floor")


def typed_floor_spec(registrations: list[Registration]) -> dict:
    return {
        "registrations": [
            [r.typ, r.name, r.custom, r.parent, r.provider.rsplit("::", 1)[0] if r.provider else ""]
            for r in registrations
        ],
        "urns": [r.urn for r in registrations],
    }


def run_typed_floor(spec: dict) -> ProgramRun:
    return _run_other(TYPED_FLOOR_DIR, {"floorSpec": spec}, "typed-floor")


@dataclass
class Timing:
    wall: list[float]
    cpu: list[float]

    @property
    def best(self) -> float:
        return min(self.wall)


def timed(fn: Callable[[], ProgramRun], into: Timing) -> ProgramRun:
    gc.collect()
    start, cpu = time.perf_counter(), time.process_time()
    result = fn()
    into.wall.append(time.perf_counter() - start)
    into.cpu.append(time.process_time() - cpu)
    return result


def longest_chain(registrations: list[Registration]) -> tuple[int, list[str]]:
    """Longest path (in custom resources) over dependency and provider edges, and its names."""
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
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))

    def depth(urn: str) -> int:
        if urn not in best:
            prev = max(predecessors(by_urn[urn]), key=depth, default=None)
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


def measure(n: int, repeats: int) -> dict:
    program, floor, typed = Timing([], []), Timing([], []), Timing([], [])
    for _ in range(repeats):
        real_run = timed(partial(run_real, n), program)
        total = len(real_run.registrations)
        custom = sum(r.custom for r in real_run.registrations)
        floor_run = timed(partial(run_floor, total - custom, custom), floor)
        typed_run = timed(partial(run_typed_floor, typed_floor_spec(real_run.registrations)), typed)
        for other in (floor_run, typed_run):
            assert len(other.registrations) == total, f"a floor registered {len(other.registrations)}, not {total}"
    chain, path = longest_chain(real_run.registrations)
    return {
        "n": n,
        "resources": total,
        "custom": custom,
        "program": program,
        "floor": floor,
        "typed": typed,
        "ratio": program.best / floor.best,
        "chain": chain,
        "path": path,
        "dependencies": sum(len(r.dependencies) for r in real_run.registrations),
    }


def report(rows: list[dict], repeats: int) -> list[tuple[bool, str]]:
    print(f"best of {repeats} runs each, program and floors interleaved; seconds are wall clock\n")
    header = (
        f"{'nodes':>5} | {'resources (custom)':>18} | {'program s':>9} | {'floor s':>7} | {'ratio':>5} | "
        f"{'longest chain':>13} | {'s per node':>10} || {'typed floor s':>13} | {'program/typed':>13}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        res = f"{r['resources']} ({r['custom']})"
        print(
            f"{r['n']:>5} | {res:>18} | {r['program'].best:>9.3f} | {r['floor'].best:>7.3f} | {r['ratio']:>5.2f} | "
            f"{r['chain']:>13} | {r['program'].best / r['n']:>10.4f} || {r['typed'].best:>13.3f} | "
            f"{r['program'].best / r['typed'].best:>13.2f}"
        )
    print()
    for r in rows:
        p, f, t = r["program"], r["floor"], r["typed"]
        print(
            f"  N={r['n']}: wall program {min(p.wall):.3f}-{max(p.wall):.3f}, floor {min(f.wall):.3f}-{max(f.wall):.3f}"
            f", typed {min(t.wall):.3f}-{max(t.wall):.3f}; best cpu program {min(p.cpu):.3f}, floor {min(f.cpu):.3f}"
            f" (ratio {min(p.cpu) / min(f.cpu):.2f}), typed {min(t.cpu):.3f}; "
            f"{r['dependencies']} dependency URNs ({r['dependencies'] / r['resources']:.1f} per resource)"
        )
    print(f"  longest chain at N={rows[-1]['n']}: {' -> '.join(rows[-1]['path'])}")
    print()

    big = rows[-1]
    checks = [
        (
            big["ratio"] <= MAX_RATIO,
            f"ratio at {big['n']} nodes: {big['ratio']:.2f}x its floor (target <= {MAX_RATIO}x)",
        )
    ]
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
        per_mid, per_big = mid["program"].best / mid["resources"], big["program"].best / big["resources"]
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
    return checks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[2, 16, 128])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)

    home = tempfile.mkdtemp(prefix="spark-vllm-bench-")
    os.environ["SPARK_VLLM_HOME"] = home  # the program writes known_hosts here
    try:
        # Warm-up: imports, pydantic schema building, gRPC/protobuf first use.
        warm = run_real(2)
        run_floor(2, 2)
        run_typed_floor(typed_floor_spec(warm.registrations))
        rows = [measure(n, args.repeats) for n in sorted(args.nodes)]
    finally:
        shutil.rmtree(home, ignore_errors=True)
    checks = report(rows, args.repeats)
    return 0 if all(ok for ok, _ in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
