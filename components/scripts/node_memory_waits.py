"""What the supervisor waits for before it starts vLLM, and what it watches while vLLM runs: the memory vLLM's
start-up check asks for (gpuMemoryUtilization x total) — the GPUs' own, or a GB10's unified memory — and, with
memory.oomGuard, the OS's reserve. While the memory is short it says what holds it, for at most
recovery.gpuWaitSeconds; then `gave_up` says why (the supervisor's FAILED). Standard library only, no side
effects."""

import os

from components.scripts.node_gpus import gpu_holders, gpu_memory, meminfo, unified_memory, visible_gpus
from components.scripts.node_log import say
from components.scripts.node_processes import largest_processes
from components.scripts.node_timing import Every

CHECK_SECONDS = 1
WAITING_NOTE_SECONDS = 30


class MemoryWaits:
    def __init__(self, node=None):
        self.node = node or NodeMemory()  # what the node has: gpus(env), unified(), meminfo()
        self.busy_since = None  # since when the GPUs lack what vLLM asks for
        self.busy = None  # what is short and who holds it, for status.json
        self.gave_up = None  # why the wait ended without the memory
        self.checks = Every(CHECK_SECONDS)
        self.notes = Every(WAITING_NOTE_SECONDS)
        self.oom_checks = Every(CHECK_SECONDS)
        self.oom_guarded = 0  # times memory.oomGuard ended vLLM

    def clear(self):
        """Nothing waited for (vLLM serves, new settings, a neighbour's turn)."""
        self.busy_since, self.busy, self.gave_up = None, None, None

    def gpu_ready(self, spec, now, limit):
        """Whether the GPUs have what vLLM asks for at start (gpuMemoryUtilization x total, on each); while they do
        not, says what holds them, for at most `limit` seconds (recovery.gpuWaitSeconds)."""
        fraction = spec.gpu_memory_utilization
        if not fraction or not self.checks.due(now):
            return not fraction or self.busy_since is None
        gpus = self.node.gpus({**os.environ, **spec.env})
        if gpus is None:
            unified = self.node.unified()
            if unified is None:  # nothing to read: vLLM's own check decides (a refused start waits for the GPU)
                return True
            return self.unified_ready(fraction, *unified, now, limit)
        short = [(index, total, free) for index, total, free in gpus if free < fraction * total]
        if not short:
            if self.busy_since is not None:
                say(f"GPU memory is free again after {now - self.busy_since:.0f} s")
            self.clear()
            return True
        detail = "; ".join(
            f"GPU {index} has {free / 1024:.1f} of {total / 1024:.1f} GiB free, vLLM asks for "
            f"{fraction * total / 1024:.1f} (gpuMemoryUtilization {fraction:g})"
            for index, total, free in short
        )
        holders = self.node.holders()
        held = ", ".join(holders) if holders else "nothing in this container (another container or a host process)"
        return self.wait(now, f"{detail}; held by {held}", limit)

    def unified_ready(self, fraction, total, available, now, limit):
        """On unified memory (a GB10) vLLM's start-up check wants gpuMemoryUtilization x MemTotal available.
        Each crashed vLLM can leave some of it taken (eugr/spark-vllm-docker #257: after ~35 restarts SSH timed
        out and the box needed a reset), so a start waits for it and gives up, saying so, rather than pile on."""
        wanted = fraction * total
        if available >= wanted:
            if self.busy_since is not None:
                say(f"unified memory is free again after {now - self.busy_since:.0f} s")
            self.clear()
            return True
        largest = ", ".join(self.node.largest())
        what = (
            f"unified memory: {available / 1024:.1f} of {total / 1024:.1f} GiB available (MemAvailable), vLLM asks "
            f"for {wanted / 1024:.1f} (gpuMemoryUtilization {fraction:g}); largest processes: {largest}"
        )
        if not self.wait(now, what, limit):
            if self.gave_up:  # said what it means on unified memory
                self.gave_up += (
                    " — memory that does not come back after vLLM exited is memory an earlier vLLM left taken; "
                    "restarting again would take the rest: reboot the node, then bump vllm.restartGeneration"
                )
            return False
        return True

    def wait(self, now, what, limit):
        """Waiting for GPU memory (`what` is short): a state of its own, not a crash; gives up after `limit` s
        (False either way: vLLM does not start now; `gave_up` says whether for good)."""
        self.busy = what
        if self.busy_since is None:
            self.busy_since = now
            self.notes.now()
        waited = now - self.busy_since
        if waited > limit:
            self.gave_up = (
                f"the GPU stayed busy for {waited:.0f} s (recovery.gpuWaitSeconds {limit}): {what}. Free it "
                "(nvidia-smi shows the processes), then bump vllm.restartGeneration"
            )
            say(self.gave_up)
            return False
        if self.notes.due(now):
            say(f"waiting for GPU memory before starting vLLM ({waited:.0f} of {limit} s): {what}")
        return False

    def others_hold(self, env):
        """MiB that processes hold of the GPUs `env` makes visible (of a GB10's memory: MemTotal less
        MemAvailable): what vLLM's neighbours hold while none of it runs; None where nothing can tell."""
        gpus = self.node.gpus(env)
        if gpus:
            return sum(total - free for _, total, free in gpus)
        unified = self.node.unified()
        return None if unified is None else unified[0] - unified[1]

    def oom_guard(self, now, floor):
        """memory.oomGuard: whether vLLM must be ended now, MemAvailable under the OS's reserve (`floor` MiB),
        before the kernel's OOM killer picks sshd or the supervisor (the restart then waits for the memory:
        unified_ready). Looked at every CHECK_SECONDS."""
        if not floor or not self.oom_checks.due(now):
            return False
        found = self.node.meminfo()
        if found is None or found[1] >= floor:
            return False
        say(
            f"memory.oomGuard: MemAvailable {found[1] / 1024:.1f} GiB is under the OS's reserve "
            f"({floor / 1024:.1f} GiB, memory.osReserveGib): ending vLLM before the kernel picks a process"
        )
        self.oom_guarded += 1
        return True


class NodeMemory:
    """The node's memory as node_gpus.py and node_processes.py read it (a test gives the parts another)."""

    def gpus(self, env):
        return gpu_memory(visible_gpus(env))

    def unified(self):
        return unified_memory()

    def meminfo(self):
        return meminfo()

    def holders(self):
        return gpu_holders()

    def largest(self):
        return largest_processes()
