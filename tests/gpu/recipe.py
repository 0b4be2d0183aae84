"""The GPU lane's recipe: the calls to make on the GPU machine, in order, what each carries and the runs it makes.

    venv/bin/python -m tests.gpu.recipe                 the calls, in order (docs/measurements.md shows this listing)
    bash tests/gpu/device.sh call NAME                  on the GPU machine: the call's runs, one after the other

The machine keeps files only while it is warm (about 30 s after a call) and each call costs its start when it is
not, so the calls are made back to back and each spends its time on runs: the phases that belong together share one
vLLM start (ready takes 100 to 220 s of a call; each phase after it seconds to two minutes), and the calls are cut
to fit the 10 minutes a command may run, with room to spare. The wheels travel first, one part a call (`receive N`);
the last part travels with the first call.

What comes back is whole: each run writes under `$OUT/<run>/`, then the call packs that folder (the report, the
whole vLLM log, each step's output, metrics) into `$OUT/<run>.tar.gz` beside `$OUT/<run>.json`, the report alone
(two files a run: the device tool brings back at most 8 files, 2 folders down). A run the call's time would cut
off is stopped first (SIGINT: the lane stops its node and writes what it has), so its files are packed too. Each
report names the machine it ran on (`machine`: the GPUs, the driver, torch and its CUDA, vLLM, Ray, vllm-router).

CI runs every call here with the stand-in vLLM (tests/gpu/test_recipe.py), with the same runs and arguments and
only the machine's own added (`extra`): where the models and run directories are, the fabric address, the
stand-in's environment.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import textwrap
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CALL_SECONDS = 600  # the most one device command may run
PACK_SECONDS = 30  # kept back for stopping a run and packing it


@dataclass(frozen=True)
class Run:
    """One run of the lane (`module` lane: tests/gpu/lane.py) or of the NCCL test (nccl: tests/gpu/nccl.py)."""

    name: str
    args: tuple[str, ...]
    what: str
    module: str = "lane"


@dataclass(frozen=True)
class Call:
    """One device call: its runs in order; `seconds` what it took on a GPU machine (the measured runs it holds),
    `gpus` how many GPUs the machine must have."""

    name: str
    runs: tuple[Run, ...]
    seconds: int
    gpus: int = 1


CALLS: tuple[Call, ...] = (
    Call("mp", (
        Run("mp", ("--executor", "mp", "--phases", "answers,router,bench,metrics,stall"),
            "mp, one start: the validation's answers twice, vllm-router and the edge in front (drain, undrain, the "
            "hop), the benchmark with both tools, /metrics, the engine core SIGSTOPped mid-stream"),
    ), seconds=480),
    Call("ray", (
        Run("ray", ("--executor", "ray", "--phases", "imports,stall,kill", "--stall-target", "worker"),
            "Ray, one start: import times, a Ray worker actor SIGSTOPped mid-stream, then a SIGKILL of the API "
            "server, each until it serves again"),
    ), seconds=420),
    Call("cotenants", (
        Run("cotenants", ("--cotenants", "qwen3-8b:0.4,qwen3-8b:0.4"),
            "two deployments of one shape on the GPU, each a 32768-token sequence and more in 0.4 of 80 GiB (0.3 "
            "is short of the plan's 24.8 GiB): in turn, pinned, one SIGKILLed while the other answers"),
        Run("nccl", (), "the fabric gate's NCCL test as the program renders it", module="nccl"),
    ), seconds=300),
    Call("tp2", (
        Run("tp2", ("--executor", "mp", "--tensor-parallel", "2", "--phases", "bench,kill", "--extra-args",
                    '--load-format dummy --compilation-config {"pass_config":{"fuse_allreduce_rms":false}}'),
            "tensor-parallel over two GPUs of the one node: the benchmark, a SIGKILL; without FlashInfer's all-reduce "
            "fusion (its NVLink-multicast backend is off on shared hosts; with it vLLM failed its memory profile on "
            "two H200s, 2026-12-04)"),
        Run("nccl", (), "the NCCL test with a GPU a rank", module="nccl"),
    ), seconds=360, gpus=2),
)  # fmt: skip


def find(name: str) -> Call:
    for each in CALLS:
        if each.name == name:
            return each
    raise SystemExit(f"recipe: no call {name!r} (the calls: {', '.join(each.name for each in CALLS)})")


def listing() -> str:
    """The calls in order, as docs/measurements.md shows them."""
    lines = [
        "venv/bin/python -m tests.gpu.pack   # the wheels in parts under .gpu/parts (one travels a call)",
        "# back to back on the GPU machine (the device tool, each call's `command`):",
        "bash tests/gpu/device.sh receive N   # N = 0 … all parts but the last, one a call",
    ]
    for each in CALLS:
        carries = "the last part, " if each is CALLS[0] else ""
        two = f"; a machine of {each.gpus} GPUs" if each.gpus > 1 else ""
        lines.append(f"bash tests/gpu/device.sh call {each.name}   # {carries}about {each.seconds} s{two}:")
        for run in each.runs:
            command = "tests.gpu." + run.module + (" " + shlex.join(run.args) if run.args else "")
            lines.append(f"#   {run.name}: {command}")
            lines.extend(textwrap.wrap(run.what, 110, initial_indent="#     ", subsequent_indent="#     "))
    lines.append("venv/bin/python -m benchmarks.gpu_lane   # the reports (kept in tests/gpu/results/<date>-<gpu>/)")
    return "\n".join(lines)


def report_of(folder: Path) -> Path | None:
    """The run's report: the lane's lane-*.json, the co-tenants' or the NCCL test's."""
    found = sorted(folder.glob("lane-*.json")) + sorted(folder.glob("nccl.json"))
    return found[0] if found else None


def pack(folder: Path, out: Path, name: str) -> list[Path]:
    """`folder` into `out/name.tar.gz` (whole) and its report into `out/name.json`; the folder removed."""
    made = []
    report = report_of(folder)
    if report is not None:
        shutil.copyfile(report, out / f"{name}.json")
        made.append(out / f"{name}.json")
    with tarfile.open(out / f"{name}.tar.gz", "w:gz") as tar:
        tar.add(folder, arcname=name)
    made.append(out / f"{name}.tar.gz")
    shutil.rmtree(folder)
    return made


def call(
    name: str,
    out: Path,
    extra: Mapping[str, Sequence[str]] | None = None,
    seconds: float = CALL_SECONDS,
    environ: Mapping[str, str] | None = None,
) -> int:
    """The call's runs in order, each in `out/<run>/` then packed; `extra` adds arguments by module (the machine's
    own: directories, fabric, environment). Each run gets what is left of `seconds`, less PACK_SECONDS, and is
    stopped (SIGINT, then SIGKILL) at that. 0 when every run succeeded."""
    chosen = find(name)
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + seconds - PACK_SECONDS
    failed = []
    for run in chosen.runs:
        folder = out / run.name
        folder.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-u", "-m", f"tests.gpu.{run.module}", *run.args, "--out", str(folder),
                *(extra or {}).get(run.module, ())]  # fmt: skip
        started = time.monotonic()
        left = deadline - started
        print(f"recipe: {name}/{run.name}: {' '.join(argv[3:])} ({left:.0f} s left)", flush=True)
        with open(folder / "console.log", "w") as console:
            process = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                       env=dict(environ if environ is not None else os.environ),
                                       preexec_fn=interruptible)  # fmt: skip
            code = watch(process, console, deadline)
        took = time.monotonic() - started
        packed = pack(folder, out, run.name)
        print(f"recipe: {name}/{run.name}: exit {code} in {took:.0f} s; {', '.join(p.name for p in packed)}")
        if code != 0:
            failed.append(run.name)
    print(f"recipe: {name}: {'every run passed' if not failed else 'failed: ' + ', '.join(failed)}")
    return 1 if failed else 0


def interruptible() -> None:
    """In the run's process before it starts: SIGINT as Python takes it (KeyboardInterrupt), whatever this process
    inherited. A command started in the background by a shell without job control (`cmd &` in a script, as a CI
    job or a device call may be) ignores SIGINT, its children too, and Python leaves an ignored SIGINT ignored: the
    run would not stop at the call's time but be killed 20 s later, its log unwritten (CI, 2026-12-06)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def watch(process: subprocess.Popen, console, deadline: float) -> int:
    """The run's output to its console.log and to ours; at the deadline SIGINT (the lane's finally stops its node
    and writes its log), SIGKILL 20 s later."""

    def copy() -> None:
        for line in process.stdout:
            console.write(line)
            sys.stdout.write(line)
        sys.stdout.flush()

    reader = threading.Thread(target=copy, daemon=True)
    reader.start()
    try:
        return process.wait(timeout=max(deadline - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
        print("recipe: the call's time is nearly up: stopping the run", flush=True)
        process.send_signal(signal.SIGINT)
        try:
            return process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            return process.wait()
    finally:
        reader.join(timeout=5)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    run = sub.add_parser("call", help="make the call NAME's runs (on the GPU machine: tests/gpu/device.sh call NAME)")
    run.add_argument("name", choices=[each.name for each in CALLS])
    run.add_argument("--out", default=os.environ.get("OUT", "/var/tmp/lane/out"))
    run.add_argument("--seconds", type=float, default=CALL_SECONDS, help="the call's time (the device's limit)")
    run.add_argument(
        "--with",
        dest="extra",
        action="append",
        default=[],
        metavar="MODULE=ARGS",
        help="arguments the machine adds to each run of MODULE (lane or nccl), one string: where its directories "
        "are, its fabric (CI passes the stand-in's this way)",
    )
    sub.add_parser("list", help="the calls in order (the default)")
    sub.add_parser("json", help="the calls as JSON")
    args = parser.parse_args(argv)
    if args.command == "call":
        extra: dict[str, list[str]] = {}
        for item in args.extra:
            module, _, text = item.partition("=")
            extra.setdefault(module, []).extend(shlex.split(text))
        return call(args.name, Path(args.out), extra=extra, seconds=args.seconds)
    if args.command == "json":
        print(json.dumps([{"name": c.name, "seconds": c.seconds, "gpus": c.gpus,
                           "runs": [vars(r) for r in c.runs]} for c in CALLS], indent=1))  # fmt: skip
        return 0
    print(listing())
    return 0


if __name__ == "__main__":
    sys.exit(main())
