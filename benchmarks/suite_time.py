"""Where the suite's time goes: the whole `./run-tests` (or its --fast lane), timed, with the split.

    sudo venv/bin/python -m benchmarks.suite_time [--fast] [-- PYTEST-ARGS]

Runs ./run-tests with a JUnit report and SPARK_VLLM_TEST_TIMINGS (one line per `pulumi` command the rehearsal
runs: tests/e2e/cli_stack.py), then prints the wall time against the target (12 minutes for the whole suite
warm, 90 s for --fast), the seconds of each test module (their sum is more than the wall time: 3 processes run
side by side), and the `pulumi` commands by kind (count, seconds, the slowest). Numbers are printed, nothing is
asserted: this machine is shared and has 2 cores.
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fast", action="store_true", help="the --fast lane (no simulated nodes)")
    parser.add_argument("pytest_args", nargs="*")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as work:
        junit, timings = Path(work) / "junit.xml", Path(work) / "timings.jsonl"
        command = ["./run-tests", *(["--fast"] if args.fast else []), "-p", "no:cacheprovider", "-q",
                   f"--junitxml={junit}", *args.pytest_args]  # fmt: skip
        started = time.monotonic()
        result = subprocess.run(command, cwd=ROOT, env={**os.environ, "SPARK_VLLM_TEST_TIMINGS": str(timings)})
        wall = time.monotonic() - started
        modules = module_seconds(junit) if junit.exists() else {}
        kinds = command_kinds(timings)
    target = TARGETS["fast" if args.fast else "full"]
    print(f"\nsuite_time: {'--fast' if args.fast else 'full'} run {wall:.0f} s ({wall / 60:.1f} min), exit "
          f"{result.returncode}; target {target} s: {'met' if wall <= target else 'NOT met'}")  # fmt: skip
    print(f"  modules (their sum {sum(modules.values()):.0f} s; processes overlap):")
    for name, seconds in sorted(modules.items(), key=lambda item: -item[1])[:25]:
        print(f"    {seconds:7.1f} s  {name}")
    if kinds:
        print("  pulumi commands (the rehearsal):")
        for kind, found in sorted(kinds.items(), key=lambda item: -item[1]["seconds"]):
            seconds, test = found["slowest"]
            line = f"    {kind:<9} {found['count']:4d} commands {found['seconds']:8.1f} s"
            print(f"{line}; slowest {seconds:.1f} s ({test})")
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
