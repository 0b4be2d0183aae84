"""The GPU lane's figures against its targets: `venv/bin/python -m benchmarks.gpu_lane [DIR]`.

Reads the JSON reports tests/gpu/lane.py wrote on the GPU machine (DIR: a folder of them, as the lane names
them or as a recipe call brings them back, tests/gpu/recipe.py; default the newest folder under tests/gpu/results/,
where measured runs are kept with their date and GPU) and prints, per
run, the times (handover, ready, serving again after a SIGKILL of vLLM's API server, stop) and the
memory figures (vLLM's "Available KV cache memory" beside the memory plan's KV room, the GPU memory
left after the stop), each against its target:

* serving again after a SIGKILL of the API server, no `pulumi up`: within 100 s (the Qwen3-8B shape);
* the memory plan's KV room within 5 % of vLLM's available KV cache memory;
* a stop leaves the GPU free (under 1 GiB in use);
* with Ray, no idle worker once vLLM serves (Ray starts one per CPU for its first driver unless told not to);
* the deploy's benchmark (--phases bench): no failed request, and the project's own load agrees with
  `vllm bench serve` on output tokens/s within 10 % (the same server, one after the other).

Exit code 1 when a target is missed. The figures are the GPU machine's; nothing here runs vLLM.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "tests" / "gpu" / "results"
RECOVERY_TARGET_SECONDS = 100.0
PLAN_TOLERANCE = 0.05
GPU_FREE_MIB = 1024.0
TOOLS_AGREE = 0.10


def judge(report: dict) -> list[tuple[str, str, bool | None]]:
    """(what, figure, met) rows of one run; met None where the run has no such figure."""
    rows = []
    steps = report.get("steps", {})
    for name in ("cluster_ready", "handover", "ready", "smoke"):
        if name in steps:
            rows.append((f"{name} (s)", f"{steps[name]['seconds']:.1f}", None if steps[name]["ok"] else False))
    for key in sorted(key for key in report if key.startswith("after_kill")):  # after_kill, after_kill_2, …
        kill = report[key]
        again = kill.get("serving_again_seconds")
        target = report.get("model") == "qwen3-8b"
        met = (again is not None and again <= RECOVERY_TARGET_SECONDS) if target else again is not None
        rows.append(
            (
                f"SIGKILL {key.removeprefix('after_kill').lstrip('_') or '1'} of the API server -> serving again (s)"
                f"{' <= 100' if target else ''}",
                "never" if again is None else f"{again:.1f} (restarted after {kill.get('restarted_seconds')})",
                met,
            )
        )
    kv, plan = report.get("kv", {}), report.get("memory_plan", {})
    room = next(iter(plan.get("nodes", {}).values()), {}).get("kv_room_gib")
    if kv.get("available_kv_cache_gib") and room is not None:
        vllm = kv["available_kv_cache_gib"]
        off = (room - vllm) / vllm
        rows.append((f"KV cache: plan {room} GiB vs vLLM {vllm} GiB (within 5 %)", f"{off * 100:+.1f} %",
                     abs(off) <= PLAN_TOLERANCE))  # fmt: skip
    bench = report.get("benchmark") or {}
    for tool, figures in bench.items():
        if "error" in figures:
            rows.append((f"benchmark {tool}", "failed", False))
            continue
        ttft, itl = figures["ttftMs"], figures["itlMs"]
        rows.append((f"benchmark {tool}: tok/s, TTFT p50/p99, ITL p50/p99 (ms), 0 errors",
                     f"{figures['outputTokensPerSecond']:.0f}, {ttft['p50']:.0f}/{ttft['p99']:.0f}, "
                     f"{itl['p50']:.2f}/{itl['p99']:.2f}", figures["errors"] == 0))  # fmt: skip
    if all(tool in bench and "error" not in bench[tool] for tool in ("spark-vllm", "vllm")):
        own, theirs = bench["spark-vllm"]["outputTokensPerSecond"], bench["vllm"]["outputTokensPerSecond"]
        off = (own - theirs) / theirs
        rows.append(("benchmark: own load vs vllm bench serve, tok/s (within 10 %)", f"{off * 100:+.1f} %",
                     abs(off) <= TOOLS_AGREE))  # fmt: skip
    ray = report.get("ray_processes")
    if ray:  # reports since 2026-12-07: Ray's processes once vLLM served
        idle = ray["by_name"].get("ray::IDLE", 0)
        rows.append((f"Ray's idle workers once serving (none; {ray['cpus']} CPUs)", str(idle), idle == 0))
    reads = report.get("contract_reads")
    if reads:  # reports since 2026-12-04: each script's output read as the program reads it
        read = sum(1 for each in reads if each["read"])
        failed = sorted({each["script"] for each in reads if not each["read"]})
        said = f"{read}/{len(reads)}" + (f" ({', '.join(failed)} not)" if failed else "")
        rows.append(("scripts' results read through their contracts (all)", said, read == len(reads)))
    stop = report.get("stop")
    if stop:
        used = max(stop.get("gpu_used_mib_after") or [0.0])
        rows.append((f"stop (s), GPU in use after (MiB, < {GPU_FREE_MIB:.0f})", f"{stop['seconds']:.1f}, {used:.0f}",
                     used < GPU_FREE_MIB and stop.get("exit_code") == 0))  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dir", nargs="?", type=Path, default=None)
    args = parser.parse_args(argv)
    folder = args.dir or max((p for p in RESULTS.iterdir() if p.is_dir()), key=lambda p: p.name)
    missed = 0
    for path in sorted(folder.glob("*.json")):  # lane-*.json as the lane names them, RUN.json as a recipe call
        report = json.loads(path.read_text())
        if not isinstance(report, dict) or "executor" not in report or "steps" not in report:
            continue  # the co-tenants' and the NCCL test's reports: read in docs/measurements.md, not judged here
        tp = report.get("tensor_parallel_size", 1)
        shape = f"{report['model']} TP={tp}" if tp > 1 else report["model"]
        gpus = ", ".join(report.get("gpu") or ["?"])
        print(f"{report['executor']:4} {shape:14} vLLM {report.get('vllm_version')} on {gpus}, {report.get('date')}")
        for what, figure, met in judge(report):
            mark = {True: "met", False: "MISSED", None: ""}[met]
            missed += met is False
            print(f"    {what:62} {figure:>28}  {mark}")
    print(f"{missed} target(s) missed" if missed else "every target met")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
