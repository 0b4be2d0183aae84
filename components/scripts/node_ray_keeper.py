"""The supervisor's Ray (Ray mode: `ray start --block …`, the head or a worker): started, restarted whenever it exits
after a doubling delay (a worker whose head went away keeps trying until the head is back), and, on the head, the
question the vLLM lifecycle asks before a start: does Ray show every node and the GPUs vLLM needs? (A cluster still
forming after a reboot would otherwise use up vLLM's restarts.) Standard library only."""

import json
import os
import subprocess
import sys

from components.scripts.node_log import say
from components.scripts.node_processes import stop_group
from components.scripts.node_timing import Backoff, Every

# Ray's `ray start --block` drains "for up to 30 s" on SIGTERM. By then vLLM is stopped and there is nothing to
# drain; a head whose workers were already gone waited the whole 30 s in the rehearsal (its container's delete took
# 31.7 s of a 39.7 s destroy). A single node drains in 0.5 s (H200).
RAY_STOP_GRACE_SECONDS = 5
RESTART_BACKOFF = Backoff(2, 30)  # 2, 4, 8, 16, 30 s … after each exit
CHECK_SECONDS = 2  # how often the head asks Ray whether the cluster is whole, while vLLM waits for it
# Ray's raylet starts one idle Python worker per CPU it counts (min(cores, num_cpus): 20 on a DGX Spark) the moment the
# first driver connects (this supervisor's check on the head, then vLLM), for tasks vLLM never sends: its Ray
# executor's actors get workers of their own. 16 of them held 1,246 MiB here (Ray 2.60, 2026-12-07), memory a GB10
# shares with the GPU. Ray reads its settings from the environment `ray start` hands the raylet; a container whose
# env sets it otherwise keeps its own.
RAY_ENV = {"RAY_prestart_worker_first_driver": "0"}
RAY_CHECK = """
import json, ray
ray.init(address={address!r}, logging_level="ERROR", log_to_driver=False)
alive = [n for n in ray.nodes() if n.get("Alive")]
print(json.dumps({{"nodes": len(alive), "gpus": sum(n.get("Resources", {{}}).get("GPU", 0) for n in alive)}}))
"""


class RayKeeper:
    def __init__(self, argv, check=None):
        self.argv = argv  # `ray start --block …`; empty in mp mode: nothing to keep
        self.process = None
        self.restarts = 0
        self.next_start = 0.0
        self.formed = False  # Ray showed what vLLM needs since vLLM last exited
        self.checks = Every(CHECK_SECONDS)
        self.check = check or ask_ray  # (address) -> {"nodes": n, "gpus": g}, or None

    def keep(self, now):
        """Ray running: started when due, its exit noticed and a restart planned."""
        if not self.argv or (self.process is not None and self.process.poll() is None):
            return
        if self.process is not None:
            code = self.process.returncode
            self.process, self.formed = None, False
            self.restarts += 1
            delay = RESTART_BACKOFF.delay(self.restarts)
            self.next_start = now + delay
            say(f"Ray exited with code {code}; starting it again in {delay:g} s")
            return
        if now >= self.next_start:
            env = {**RAY_ENV, **os.environ}
            self.process = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, start_new_session=True, env=env)
            say(f"Ray started (pid {self.process.pid}): {' '.join(self.argv[:3])} …")

    def cluster_formed(self, now, wanted):
        """Whether vLLM may start as far as Ray goes: `wanted` (the spec's ray_ready: address, nodes, GPUs) shown
        alive once since vLLM last exited; asked every CHECK_SECONDS. Nothing wanted: yes."""
        if self.formed or not wanted:
            return True
        if not self.checks.due(now):
            return False
        found = self.check(wanted.address)
        found = found if isinstance(found, dict) else {}
        self.formed = found.get("nodes", 0) >= wanted.nodes and found.get("gpus", 0) >= wanted.gpus
        return self.formed

    def forget(self):
        """vLLM exited: a node of the group may be what went away, so the next start asks again."""
        self.formed = False

    def stop(self, grace):
        if self.process is not None:
            stop_group(self.process, min(grace, RAY_STOP_GRACE_SECONDS))

    def said(self):
        """status.json's `ray_restarts` (None in mp mode)."""
        return self.restarts if self.argv else None


def ask_ray(address):
    """What Ray at `address` shows alive ({"nodes", "gpus"}), or None when it cannot tell (yet)."""
    try:
        result = subprocess.run(
            [sys.executable, "-c", RAY_CHECK.format(address=address)], capture_output=True, text=True, timeout=60
        )
        return json.loads(result.stdout.strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, ValueError, IndexError, OSError):
        return None
