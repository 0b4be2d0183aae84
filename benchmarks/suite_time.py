"""Where the suite's time goes: the whole `./run-tests` (or its --fast lane), timed, with the split.

    sudo venv/bin/python -m benchmarks.suite_time [--fast] [-- PYTEST-ARGS]
    sudo venv/bin/python -m benchmarks.suite_time --rounds 3 --hog 1 -- tests/e2e   (the stress run)

Runs ./run-tests with a JUnit report and SPARK_VLLM_TEST_TIMINGS (one line per `pulumi` command the rehearsal
runs: tests/e2e/cli_stack.py), then prints the wall time against the target (12 minutes for the whole suite
warm, 90 s for --fast), the seconds of each test module (their sum is more than the wall time: 4 processes run
side by side), and the `pulumi` commands by kind (count, seconds, the slowest). Numbers are printed, nothing is
asserted: this machine is shared and has 2 cores. `--rounds N --hog K`: the stress run, the same command N
times in a row beside K processes that each keep a core busy; each round's wall time and the tests that failed
or errored, then the total of them (the suite's steadiness: it should be none). With --cpu, the machine's CPU
seconds during the run by kind of process (the CLI, the provider plugins, the program, pytest, Ray, dockerd and
containerd, sshd, the stand-in vLLM…), sampled from /proc every second: what a change must cut for the suite to be
faster on a machine whose CPU is the limit. Processes that live less than a sample are counted as "short-lived".
With --cpu each test file's CPU seconds too (tests/conftest.py, SPARK_VLLM_TEST_CPU): its tests' own and those of
the processes they started and reaped.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
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


def cpu_lines(cpu: Path) -> list[dict]:
    """SPARK_VLLM_TEST_CPU's lines (tests/conftest.py), a test each; none where the file is not there."""
    return [json.loads(line) for line in cpu.read_text().splitlines()] if cpu.exists() else []


def file_cpu(cpu: Path) -> dict[str, tuple[float, float]]:
    """CPU seconds per test file from SPARK_VLLM_TEST_CPU's lines: (the tests' own, the processes they started
    and reaped)."""
    totals: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for entry in cpu_lines(cpu):
        found = totals[entry["test"].split("::", 1)[0]]
        found[0] += entry["own"]
        found[1] += entry["children"]
    return {name: (own, children) for name, (own, children) in totals.items()}


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


def slowest_tests(junit: Path, count: int = 20) -> list[tuple[float, str]]:
    """The slowest tests in a JUnit report (setup, call and teardown together: a module's shared nodes and first
    `up` count in its first test)."""
    found = [
        (float(case.get("time") or 0), f"{case.get('classname')}::{case.get('name')}")
        for case in ElementTree.parse(junit).getroot().iter("testcase")
    ]
    return sorted(found, reverse=True)[:count]


def failed_tests(junit: Path) -> list[str]:
    """The tests that failed or errored in a JUnit report, as module::name."""
    found = []
    for case in ElementTree.parse(junit).getroot().iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            found.append(f"{case.get('classname')}::{case.get('name')}")
    return found


def worker_spans(cpu: Path) -> dict[str, dict]:
    """Each test process's span from SPARK_VLLM_TEST_CPU's lines: its first test's start and last test's end
    (seconds since the first test anywhere), the seconds its tests took, and the file it ended with. The processes
    that end early leave the cores to the others: the tail the run waits on."""
    lines = [line for line in cpu_lines(cpu) if "worker" in line]
    if not lines:
        return {}
    zero = min(line["start"] for line in lines)
    spans: dict[str, dict] = {}
    for line in sorted(lines, key=lambda line: line["end"]):
        span = spans.setdefault(line["worker"], {"start": line["start"] - zero, "tests": 0.0})
        span["tests"] += line["end"] - line["start"]
        span["end"], span["last"] = line["end"] - zero, line["test"].split("::", 1)[0]
    return spans


# Kinds of process, first match wins: (kind, words looked for in the command line or the name).
CPU_KINDS = (
    ("provider plugins (command, docker)", ("pulumi-resource-",)),
    ("the program (language host, __main__.py)", ("pulumi-language-python",)),
    ("pulumi CLI and engine", ("/.toolchain/bin/pulumi",)),
    ("Ray (gcs, raylet, agents, workers)", ("gcs_server", "raylet", "ray/", "ray::", "ray_", "default_worker")),
    ("stand-in vLLM", ("vllm_standin", "vllm serve", "vllm-router")),
    ("node supervisors and scripts", ("spark-vllm", "supervisor", "node_")),
    ("dockerd, containerd and shims", ("dockerd", "containerd", "docker-proxy", "runc", "docker ")),
    ("sshd and ssh", ("sshd", "ssh ", "ssh-")),
    ("pytest workers (the tests)", ("pytest", "xdist", "exec(eval(sys.stdin")),
    ("other Python (on the nodes and in tests)", ("python",)),
)


def _kind(command: str) -> str:
    for kind, words in CPU_KINDS:
        if any(word in command for word in words):
            return kind
    return "other"


def _machine_busy_seconds() -> float:
    with open("/proc/stat") as handle:
        fields = [int(value) for value in handle.readline().split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle and iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


class CpuSampler(threading.Thread):
    """CPU seconds by kind of process while it runs: each process's utime+stime, the last value seen before it
    exits (read every `interval` s), against the whole machine's busy time over the same span."""

    def __init__(self, interval: float = 1.0):
        super().__init__(daemon=True)
        self.interval, self.done = interval, threading.Event()
        self.seen: dict[tuple[int, str], tuple[str, float]] = {}  # (pid, start time) -> (kind, seconds)
        self.commands: dict[tuple[int, str], str] = {}  # (pid, start time) -> its command line, shortened
        self.sample()
        self.before = {key: seconds for key, (_, seconds) in self.seen.items()}  # what ran before the start
        self.busy_start = _machine_busy_seconds()
        self.busy = 0.0
        self.idle_by_minute: list[float] = []  # the cores' idle CPU-s in each minute of the run

    def sample(self) -> None:
        tick = os.sysconf("SC_CLK_TCK")
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat") as handle:
                    stat = handle.read()
                fields = stat[stat.rindex(")") + 2 :].split()
                key = (int(entry.name), fields[19])
                seconds = (int(fields[11]) + int(fields[12])) / tick
                known = self.seen.get(key)
                if known is None:
                    with open(f"/proc/{entry.name}/cmdline", "rb") as handle:
                        command = handle.read().replace(b"\0", b" ").decode(errors="replace")
                    command = command or stat[stat.index("(") + 1 : stat.rindex(")")]
                    known = (_kind(command), 0.0)
                    self.commands[key] = re.sub(r"\d+", "N", " ".join(command.split()[:4]))[:90]
                self.seen[key] = (known[0], seconds)
            except (OSError, ValueError, IndexError):
                continue  # gone meanwhile

    def run(self) -> None:
        started = last = time.monotonic()
        last_busy = self.busy_start
        while not self.done.wait(self.interval):
            self.sample()
            now, busy = time.monotonic(), _machine_busy_seconds()
            minute = int((now - started) // 60)
            while len(self.idle_by_minute) <= minute:
                self.idle_by_minute.append(0.0)
            self.idle_by_minute[minute] += max(0.0, (now - last) * os.cpu_count() - (busy - last_busy))
            last, last_busy = now, busy

    def stop(self) -> dict[str, float]:
        self.done.set()
        self.join()
        self.sample()
        self.busy = _machine_busy_seconds() - self.busy_start
        kinds: dict[str, float] = collections.defaultdict(float)
        for key, (kind, seconds) in self.seen.items():
            kinds[kind] += seconds - self.before.get(key, 0.0)
        kinds["short-lived (under a sample)"] = self.busy - sum(kinds.values())
        return dict(kinds)

    def busiest(self, count: int = 15) -> list[tuple[float, int, str]]:
        """The command lines (first words, numbers as N) that took the most CPU: (seconds, processes, command)."""
        totals: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
        for key, (_, seconds) in self.seen.items():
            found = totals[self.commands.get(key, "?")]
            found[0] += seconds - self.before.get(key, 0.0)
            found[1] += 1
        return sorted(((seconds, n, command) for command, (seconds, n) in totals.items()), reverse=True)[:count]


def run_once(args, work: Path) -> dict:
    junit, timings, cpu_lines = work / "junit.xml", work / "timings.jsonl", work / "cpu.jsonl"
    for stale in (junit, timings, cpu_lines):
        stale.unlink(missing_ok=True)
    command = ["./run-tests", *(["--fast"] if args.fast else []), "-p", "no:cacheprovider", "-q",
               f"--junitxml={junit}", *args.pytest_args]  # fmt: skip
    sampler = CpuSampler() if args.cpu else None
    if sampler:
        sampler.start()
    started = time.monotonic()
    env = {
        **os.environ,
        "SPARK_VLLM_TEST_TIMINGS": str(timings),
        **({"SPARK_VLLM_TEST_CPU": str(cpu_lines)} if sampler else {}),
    }
    result = subprocess.run(command, cwd=ROOT, env=env)
    wall = time.monotonic() - started
    cpu = sampler.stop() if sampler else {}  # before busy and busiest: stop takes the last sample
    return {
        "cpu": cpu,
        "cpu_busy": sampler.busy if sampler else 0.0,
        "busiest": sampler.busiest() if sampler else [],
        "file_cpu": file_cpu(cpu_lines),
        "spans": worker_spans(cpu_lines),
        "idle_by_minute": sampler.idle_by_minute if sampler else [],
        "wall": wall,
        "exit": result.returncode,
        "modules": module_seconds(junit) if junit.exists() else {},
        "slowest": slowest_tests(junit) if junit.exists() else [],
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
    if run["slowest"]:
        print("  slowest tests:")
        for seconds, name in run["slowest"]:
            print(f"    {seconds:7.1f} s  {name}")
    if kinds:
        print("  pulumi commands (the rehearsal):")
        for kind, found in sorted(kinds.items(), key=lambda item: -item[1]["seconds"]):
            seconds, test = found["slowest"]
            line = f"    {kind:<9} {found['count']:4d} commands {found['seconds']:8.1f} s"
            print(f"{line}; slowest {seconds:.1f} s ({test})")
    if run["cpu"]:
        busy = run["cpu_busy"]
        print(f"  CPU, by kind of process ({busy:.0f} CPU-s busy of {wall * os.cpu_count():.0f} on "
              f"{os.cpu_count()} cores):")  # fmt: skip
        for kind, seconds in sorted(run["cpu"].items(), key=lambda item: -item[1]):
            print(f"    {seconds:8.1f} s  {100 * seconds / busy if busy else 0:5.1f} %  {kind}")
        print("  the busiest command lines (CPU seconds, processes):")
        for seconds, count, command in run["busiest"]:
            print(f"    {seconds:8.1f} s {count:5d}  {command}")
    if run.get("spans"):
        print("  test processes (seconds from the first test: start, end, in tests; the file each ended with):")
        for worker, span in sorted(run["spans"].items(), key=lambda item: item[1]["end"]):
            print(f"    {worker:<5} {span['start']:6.0f} {span['end']:6.0f} {span['tests']:7.0f}  {span['last']}")
    if run.get("idle_by_minute"):
        idle = " ".join(f"{seconds:.0f}" for seconds in run["idle_by_minute"])
        print(f"  the cores' idle CPU-s, minute by minute: {idle}")
    if run.get("file_cpu"):
        files = sorted(run["file_cpu"].items(), key=lambda item: -sum(item[1]))
        own, children = sum(o for _, (o, _) in files), sum(c for _, (_, c) in files)
        print(f"  CPU by test file ({own:.0f} s in the tests' processes, {children:.0f} s in what they started and "
              "reaped; a daemon counts where it is reaped):")  # fmt: skip
        for name, (own, children) in files[:25]:
            print(f"    {own + children:7.1f} s  ({own:6.1f} own, {children:6.1f} children)  {name}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fast", action="store_true", help="the --fast lane (no simulated nodes)")
    parser.add_argument("--rounds", type=int, default=1, help="run it this many times in a row (the stress run)")
    parser.add_argument("--hog", type=int, default=0, help="beside this many processes each keeping a core busy")
    parser.add_argument("--cpu", action="store_true", help="the CPU seconds by kind of process, sampled each second")
    parser.add_argument("--keep", metavar="DIR", help="keep the JUnit report and the commands' timings in DIR")
    parser.add_argument("pytest_args", nargs="*")
    args = parser.parse_args(argv)
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.hog)]
    runs = []
    try:
        with tempfile.TemporaryDirectory() as temporary:
            work = Path(args.keep or temporary)
            work.mkdir(parents=True, exist_ok=True)
            for number in range(1, args.rounds + 1):
                runs.append(run_once(args, work))
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
