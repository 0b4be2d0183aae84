"""Wall time of the real `pulumi preview` (nothing changed) and `pulumi up` on simulated nodes.

    sudo venv/bin/python -m benchmarks.cli_timing [--nodes 2 8] [--previews 3]

For each node count N: simulated nodes (tests/e2e/nodes.py) pulling from one registry, a stack
driven by the real Pulumi CLI, engine, language host and provider plugins (tests/e2e/cli_stack.py),
`pulumi up` once (a first deployment: pull, checks, Ray, vLLM, smoke test), then `pulumi preview
--diff` with nothing changed `--previews` times, then `--ups` pairs of `pulumi up --yes` with nothing
changed, one as the README types it (a preview first) and one with `--skip-preview` (as the Automation API
and the rehearsal's tests run it), alternating, then `pulumi destroy`. Printed per N:

* wall: the whole command as a user runs it (CLI start, plugins, program, engine; `up` previews first);
* engine: the duration the engine itself reports (its summary event): the CLI's own breakdown of
  how much of the wall time the update took, the rest being the CLI's and plugins' start-up;
* the two kinds of `up` with nothing changed: wall and CPU seconds (the CLI, plugins, program and SSH
  sessions it started: this process's children), medians;
* stages of the `up`, from the moments the engine reported each resource done (as ./rehearse
  prints them), and the slowest resource operations.

Numbers are printed, nothing is asserted: this machine is shared and has 2 cores; quote medians.
Needs root (namespaces, one dockerd per node) and the toolchain built by scripts/toolchain.sh.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tests.e2e import nodes as simnodes
from tests.e2e.cli_stack import RehearsalStack, cli_missing
from tests.e2e.image.build import publish
from tests.e2e.rehearsal import CACHE_DIR, make_model, rehearsal_config, stage_times


def children_cpu() -> float:
    """CPU seconds of this process's reaped children (each `pulumi` command and what it started)."""
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    return used.ru_utime + used.ru_stime


def timed_up(stack: RehearsalStack, preview_first: bool) -> tuple[float, float]:
    """(wall, CPU) seconds of one `pulumi up` that must change nothing."""
    cpu = children_cpu()
    run = stack.up(preview_first=preview_first)
    assert run.changed == {}, f"an up with nothing changed changed {run.changed}"
    return run.seconds, children_cpu() - cpu


def measure(count: int, previews: int, workdir: Path, registry, ups: int = 2) -> dict:
    started = time.monotonic()
    with simnodes.simulated_nodes(count, workdir / f"nodes-{count}", registry=registry) as cluster:
        image = publish(CACHE_DIR, registry.address, cluster.nodes[0].docker_host)
        bring_up = time.monotonic() - started
        stack = RehearsalStack(workdir / f"deployer-{count}", f"bench-{count}")
        stack.init()
        config, secrets = rehearsal_config(cluster, image.ref, make_model(workdir), smokeTest=True)
        stack.configure(config, secrets)
        try:
            up = stack.up(preview_first=True)
            runs = [stack.preview() for _ in range(previews)]
            assert all(run.changed == {} for run in runs), "a preview with nothing changed showed changes"
            pairs = [(timed_up(stack, True), timed_up(stack, False)) for _ in range(ups)]
        finally:
            destroyed = stack.destroy(preview_first=True)
    slowest, slowest_deletes = (
        sorted(
            (
                (e.finished - e.started, e.name)
                for e in run.resources.values()
                if e.finished is not None and not e.type.startswith("spark-vllm:")  # components do no work
            ),
            reverse=True,
        )[:5]
        for run in (up, destroyed)
    )
    return {
        "nodes": count,
        "resources": len(up.resources),
        "bring_up": bring_up,
        "up": up,
        "previews": runs,
        "ups": pairs,
        "destroy": destroyed,
        "slowest": slowest,
        "slowest_deletes": slowest_deletes,
    }


def report(result: dict) -> None:
    up, previews = result["up"], result["previews"]
    walls = [run.seconds for run in previews]
    engines = [run.engine_seconds for run in previews if run.engine_seconds is not None]
    nodes, resources, ready = result["nodes"], result["resources"], result["bring_up"]
    print(f"\n{nodes} nodes, {resources} resources (nodes and image ready in {ready:.1f} s)")
    engine = up.engine_seconds if up.engine_seconds is not None else float("nan")
    print(f"  pulumi up (first deployment)   wall {up.seconds:6.1f} s   engine {engine:6.1f} s")
    for stage, seconds in stage_times(up).items():
        print(f"    {stage:<48} {'-' if seconds is None else f'{seconds:6.1f} s'}")
    print("    slowest operations: " + ", ".join(f"{name} {seconds:.1f} s" for seconds, name in result["slowest"]))
    if walls:  # none with --previews 0
        print(
            f"  pulumi preview, no change      wall median {statistics.median(walls):5.1f} s "
            f"(min {min(walls):.1f}, max {max(walls):.1f}, {len(walls)} runs)   "
            f"engine median {statistics.median(engines) if engines else float('nan'):5.1f} s"
        )
    if result["ups"]:
        typed, skipped = ([pair[i] for pair in result["ups"]] for i in (0, 1))
        for label, found in (("pulumi up --yes, no change", typed), ("  … --skip-preview", skipped)):
            wall, cpu = (statistics.median(value[i] for value in found) for i in (0, 1))
            print(f"  {label:<30} wall median {wall:5.1f} s   CPU median {cpu:5.1f} s ({len(found)} runs)")
    destroy = result["destroy"].seconds
    ratio = destroy / up.seconds
    print(
        f"  pulumi destroy                 wall {destroy:6.1f} s   {ratio:.2f} of the up "
        f"(target at most 0.5: {'met' if ratio <= 0.5 else 'MISSED'})"
    )
    print("    slowest deletes: " + ", ".join(f"{name} {seconds:.1f} s" for seconds, name in result["slowest_deletes"]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--previews", type=int, default=3)
    parser.add_argument("--ups", type=int, default=2, help="pairs of no-change ups, with and without a preview")
    args = parser.parse_args(argv)
    problem = simnodes.skip_reason() or cli_missing()
    if problem:
        print(f"cli_timing: cannot run here: {problem}", file=sys.stderr)
        return 2
    simnodes.cleanup_stale()
    workdir = Path(tempfile.mkdtemp(prefix="spark-vllm-cli-timing-"))
    with simnodes.create_registry(workdir, CACHE_DIR / "registry") as registry:
        for count in args.nodes:
            report(measure(count, args.previews, workdir, registry, args.ups))
    return 0


if __name__ == "__main__":
    sys.exit(main())
