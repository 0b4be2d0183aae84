"""Where the suite's time goes: the whole `./run-tests` (or its --fast lane), timed, with the split.

    sudo venv/bin/python -m benchmarks.suite_time [--fast] [-- PYTEST-ARGS]
    sudo venv/bin/python -m benchmarks.suite_time --rounds 3 --hog 1 -- tests/e2e   (the stress run)

Runs ./run-tests with a JUnit report and SPARK_VLLM_TEST_TIMINGS (one line per `pulumi` command the rehearsal
runs: tests/e2e/cli_stack.py), then prints the wall time against the target (12 minutes for the whole suite
warm, 90 s for --fast), the seconds of each test module (their sum is more than the wall time: 3 processes run
side by side), and the `pulumi` commands by kind (count, seconds, the slowest). Numbers are printed, nothing is
asserted: this machine is shared and has 2 cores. `--rounds N --hog K`: the stress run, the same command N
times in a row beside K processes that each keep a core busy; each round's wall time and the tests that failed
or errored, then the total of them (the suite's steadiness: it should be none).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGETS = {"full": 12 * 60, "fast": 90}


def module_seconds(junit: Path) -> dict[str, float]:
    """Seconds per test module, from pytest's JUnit report (setup, call and teardown together)."""
    totals: dict[str, float] = collections.defaultdict(float)
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        parts = (case.get("classname") or "").split(".")
        while parts and parts[-1][:1].isupper():  # a test class: its module is the file
            parts.pop()
        totals["/".join(parts) + ".py"] += float(case.get("time") or 0)
    return dict(totals)


def command_kinds(timings: Path) -> dict[str, dict]:
    """The rehearsal's `pulumi` commands by kind: how many, their seconds, the slowest (with its test)."""
    kinds: dict[str, dict] = {}
    if not timings.exists():
        return kinds
    for line in timings.read_text().splitlines():
        entry = json.loads(line)
        kind = entry["command"].split()[0]
        found = kinds.setdefault(kind, {"count": 0, "seconds": 0.0, "slowest": (0.0, "")})
        found["count"] += 1
        found["seconds"] += entry["seconds"]
        if entry["seconds"] > found["slowest"][0]:
            found["slowest"] = (entry["seconds"], entry.get("test", ""))
    return kinds


def failed_tests(junit: Path) -> list[str]:
    """The tests that failed or errored in a JUnit report, as module::name."""
    found = []
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            found.append(f"{case.get('classname')}::{case.get('name')}")
    return found


def run_once(args, work: Path) -> dict:
    junit, timings = work / "junit.xml", work / "timings.jsonl"
    for stale in (junit, timings):
        stale.unlink(missing_ok=True)
    command = ["./run-tests", *(["--fast"] if args.fast else []), "-p", "no:cacheprovider", "-q",
               f"--junitxml={junit}", *args.pytest_args]  # fmt: skip
    started = time.monotonic()
    result = subprocess.run(command, cwd=ROOT, env={**os.environ, "SPARK_VLLM_TEST_TIMINGS": str(timings)})
    return {
        "wall": time.monotonic() - started,
        "exit": result.returncode,
        "modules": module_seconds(junit) if junit.exists() else {},
        "failed": failed_tests(junit) if junit.exists() else ["(no report)"],
        "kinds": command_kinds(timings),
    }


def report(args, run: dict) -> None:
    wall, modules, kinds = run["wall"], run["modules"], run["kinds"]
    target = TARGETS["fast" if args.fast else "full"]
    print(f"\nsuite_time: {'--fast' if args.fast else 'full'} run {wall:.0f} s ({wall / 60:.1f} min), exit "
          f"{run['exit']}; target {target} s: {'met' if wall <= target else 'NOT met'}")  # fmt: skip
    print(f"  modules (their sum {sum(modules.values()):.0f} s; processes overlap):")
    for name, seconds in sorted(modules.items(), key=lambda item: -item[1])[:25]:
        print(f"    {seconds:7.1f} s  {name}")
    if kinds:
        print("  pulumi commands (the rehearsal):")
        for kind, found in sorted(kinds.items(), key=lambda item: -item[1]["seconds"]):
            seconds, test = found["slowest"]
            line = f"    {kind:<9} {found['count']:4d} commands {found['seconds']:8.1f} s"
            print(f"{line}; slowest {seconds:.1f} s ({test})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fast", action="store_true", help="the --fast lane (no simulated nodes)")
    parser.add_argument("--rounds", type=int, default=1, help="run it this many times in a row (the stress run)")
    parser.add_argument("--hog", type=int, default=0, help="beside this many processes each keeping a core busy")
    parser.add_argument("pytest_args", nargs="*")
    args = parser.parse_args(argv)
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.hog)]
    runs = []
    try:
        with tempfile.TemporaryDirectory() as work:
            for number in range(1, args.rounds + 1):
                runs.append(run_once(args, Path(work)))
                if args.rounds > 1:
                    print(
                        f"\nsuite_time: round {number} of {args.rounds} (beside {args.hog} busy core(s)): "
                        f"{runs[-1]['wall']:.0f} s, exit {runs[-1]['exit']}, failed: {runs[-1]['failed'] or 'none'}"
                    )
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    for run in runs:
        report(args, run)
    if args.rounds > 1:
        failed = [name for run in runs for name in run["failed"]]
        walls = ", ".join(f"{run['wall']:.0f}" for run in runs)
        print(f"\nsuite_time: {args.rounds} rounds beside {args.hog} busy core(s): {walls} s; "
              f"{len(failed)} failed or errored: {failed or 'none'}")  # fmt: skip
    return max(run["exit"] for run in runs)


if __name__ == "__main__":
    sys.exit(main())
