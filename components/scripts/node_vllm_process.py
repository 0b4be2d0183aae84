"""vLLM's processes as the supervisor runs them, and its restarts.

VllmProcess: one start of vLLM at a time, its output appended to RUN_DIR/vllm.log after a `=== spark-vllm: …` line.
vLLM is several processes (the API server, an engine core `VLLM::EngineCore`, workers) and only the last of them to
go frees the GPU: a SIGKILL of the API server (the OOM killer, a crash) leaves the engine core holding the GPU
memory. So whenever vLLM exits, or is stopped, everything it started is ended (its process group and session, and
every process descended from it: node_processes.py Tree), SIGTERM first, SIGKILL after a grace. vLLM's engine core
gone while its API server lives on is vLLM's exit too: after the stop grace without it the rest is ended (the API
server does not always follow: on two H200s the engine core failed at start, its workers hung in CUDA's abort, and
the API server waited on them for good).

Restarts: recovery's crash-loop count, written once for every way vLLM ends that counts (an exit, memory.oomGuard):
max_restarts exits within window_seconds end the loop, each restart after a doubling backoff. Standard library
only."""

import os
import subprocess
import time

from components.scripts.node_log import say
from components.scripts.node_processes import Tree, describe, process_name
from components.scripts.node_timing import Backoff, Every, Window

LEFTOVER_GRACE_SECONDS = 2  # after vLLM exited: what it left behind gets SIGTERM, then SIGKILL after this
ENGINE_CORE = "VLLM::EngineCor"  # vLLM's engine core (VLLM::EngineCore, VLLM::EngineCore_DP0…) as /proc's comm has it


def mark(message):
    """A line of vLLM's log from the supervisor, with the time as vLLM's own lines have it (local time: UTC in a
    container): `=== spark-vllm: 12-02 03:04:05 vLLM started (pid 7)`."""
    return f"=== spark-vllm: {time.strftime('%m-%d %H:%M:%S')} {message}\n"


class VllmProcess:
    def __init__(self, run_dir, log, stop_grace):
        self.run_dir, self.log, self.stop_grace = run_dir, log, stop_grace
        self.popen = None
        self.tree = None  # everything the running (or last) vLLM started
        self.log_start = 0  # where the running vLLM's output begins in the log
        self.started_at = None  # monotonic time of the last start
        self.started_wall = None  # wall-clock time of it: what the node's other replicas are told
        self.remembering = Every(2)
        self.engine_seen = False  # this start has had an engine core (a headless rank never has)
        self.engine_gone_at = None  # since when it has none
        self.ended_why = None  # why the supervisor itself ended vLLM, for its exit record

    @property
    def running(self):
        """Started and not yet seen gone (`exited()` says when it goes)."""
        return self.popen is not None

    @property
    def pid(self):
        return self.popen.pid if self.popen is not None else None

    def start(self, spec, now):
        env = dict(os.environ)
        env.update(spec.env)
        try:
            self.log_start = os.path.getsize(self.log)
        except OSError:
            self.log_start = 0
        with open(self.log, "ab", buffering=0) as log:
            log.write(mark(f"starting {' '.join(spec.argv)}").encode())
            self.popen = subprocess.Popen(
                spec.argv,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd="/",
                start_new_session=True,  # its own process group: stopped as a whole
            )
        self.tree = Tree(self.popen.pid)
        self.remembering.now()
        self.engine_seen, self.engine_gone_at, self.ended_why = False, None, None
        with open(f"{self.run_dir}/vllm.pid", "w") as handle:
            handle.write(str(self.popen.pid))
        self.started_at, self.started_wall = now, time.time()
        say(f"vLLM started (pid {self.popen.pid})")

    def exited(self):
        """The exit code once vLLM's main process is gone (what it left running ended too), else None."""
        if self.popen is None or self.popen.poll() is None:
            return None
        code = self.popen.returncode
        self.popen = None
        self.end_leftovers()
        return code

    def remember(self, now):
        """Knows every process vLLM started (so that a SIGKILLed API server's children are still known): often in
        its first minute, then every 2 s; and ends it once its engine core is gone while the API server lives on."""
        if self.popen is None or not self.remembering.due(now, 0.5 if now - self.started_at < 60 else 2):
            return
        alive = self.tree.remember()
        if any(process_name(pid).startswith(ENGINE_CORE) for pid in alive):
            self.engine_seen, self.engine_gone_at = True, None
            return
        if not self.engine_seen:
            return
        if self.engine_gone_at is None:
            self.engine_gone_at = now
        elif now - self.engine_gone_at >= self.stop_grace:
            say(
                f"vLLM's engine core exited {now - self.engine_gone_at:.0f} s ago and its API server (pid "
                f"{self.popen.pid}) did not follow: ending what is left of vLLM"
            )
            self.engine_seen = False
            self.end("its engine core exited and its API server did not follow")

    def end(self, why):
        """Ends all of vLLM for a reason of the supervisor's own; its exit, seen next, is recorded with `why`."""
        self.ended_why = why
        self.tree.end(self.stop_grace, reap=self.popen.poll)

    def stop(self, why, grace=None):
        """SIGTERM to everything vLLM started, the grace, SIGKILL to what is left."""
        if self.popen is not None:
            if self.popen.poll() is None:
                say(f"stopping vLLM (pid {self.popen.pid}): {why}")
            self.tree.remember()
            if not self.tree.end(self.stop_grace if grace is None else grace, reap=self.popen.poll):
                say(f"vLLM's processes outlived SIGKILL: {', '.join(describe(p) for p in sorted(self.tree.alive()))}")
            self.popen.poll()
        self.popen = None

    def end_leftovers(self):
        """After vLLM's main process exited: what it started may live on (the engine core keeps the GPU when the
        API server is SIGKILLed); all of it ended before anything starts again."""
        left = sorted(self.tree.alive()) if self.tree is not None else []
        if not left:
            return
        say(f"vLLM's main process is gone; ending what it left running: {', '.join(describe(p) for p in left)}")
        if not self.tree.end(LEFTOVER_GRACE_SECONDS):
            say(f"still running after SIGKILL: {', '.join(describe(p) for p in sorted(self.tree.alive()))}")

    def alive(self):
        """vLLM's processes that live now (for the fault record)."""
        return sorted(self.tree.alive()) if self.tree is not None else []

    def output(self):
        """What this start of vLLM wrote so far."""
        try:
            with open(self.log, "rb") as handle:
                handle.seek(self.log_start)
                return handle.read().decode(errors="replace")
        except OSError:
            return ""


class Restarts:
    """recovery's crash-loop count: exits within recovery.windowSeconds, restarts in all, when the next start is."""

    def __init__(self):
        self.window = Window()
        self.total = 0
        self.next_start = 0.0

    def crashed(self, now, recovery):
        """One exit that counts: the delay before the restart, or None once recovery.maxRestarts is passed."""
        count = self.window.add(now, recovery.window_seconds)
        if count > recovery.max_restarts:
            return None
        delay = Backoff(recovery.backoff_seconds, recovery.max_backoff_seconds).delay(count)
        self.next_start = now + delay
        self.total += 1
        return delay

    def again(self, now, delay):
        """A start that did not count (the GPU busy, a neighbour's doing): the next after `delay`."""
        self.next_start = now + delay

    def reset(self, now):
        """New settings: counted afresh, started at once."""
        self.window.clear()
        self.next_start = now

    def __len__(self):
        return len(self.window)
