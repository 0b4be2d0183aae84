"""How soon the readiness wait notices a server that became ready (target: within 2 s).

Runs components/scripts/wait_ready.py for real against a local server (tests/fake_vllm_http.py)
that turns ready at a known moment, several times, and prints the delay between "ready" and the
wait returning. Run: `venv/bin/python -m benchmarks.readiness_latency [--trials N]`.
Exit code 1 when the worst delay exceeds the target.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from components.plan.names import POLL_SECONDS
from components.plan.programs import script_program
from tests.fake_vllm_http import FakeVllm

TARGET_SECONDS = 2.0


def one_trial(ready_after: float, workdir: Path) -> float:
    log = workdir / "vllm.log"
    log.write_text("INFO loading\n")
    status = workdir / "status.json"  # what the container's supervisor says: vLLM starting
    status.write_text(json.dumps({"state": "starting", "vllm_pid": 1234, "failed": None}))
    with FakeVllm(ready_after=ready_after) as server:
        params = {
            "base_url": server.base_url, "model": "m", "api_key": None, "timeout_seconds": 60,
            "poll_seconds": POLL_SECONDS, "progress_seconds": 30,
            "log_file": str(log), "status_file": str(status),
        }  # fmt: skip
        subprocess.run([sys.executable, "-"], input=script_program("wait_ready.py", params), text=True,
                       capture_output=True, check=True, timeout=90)  # fmt: skip
        return time.monotonic() - server.ready_at


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=8)
    args = parser.parse_args()
    delays = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.trials):
            # ready at different phases of the poll cycle
            delays.append(one_trial(1.0 + i * POLL_SECONDS / args.trials, Path(tmp)))
    print(f"readiness wait, poll interval {POLL_SECONDS} s, {args.trials} trials")
    print(f"  delay after ready: median {statistics.median(delays):.2f} s, max {max(delays):.2f} s, "
          f"min {min(delays):.2f} s")  # fmt: skip
    ok = max(delays) <= TARGET_SECONDS
    print(f"  target ≤ {TARGET_SECONDS:.0f} s: {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
