# What the supervisor waits for before it starts vLLM, and what it watches while vLLM runs (supervisor.py's
# Supervisor is a MemoryWaits): the memory vLLM's
# start-up check asks for — the GPUs' own, or a GB10's unified memory — and, with memory.oomGuard, the OS's
# reserve. Standard library only, no side effects.
import os

from components.scripts.node_contract import VllmState
from components.scripts.node_gpus import gpu_holders, gpu_memory, meminfo, unified_memory, visible_gpus
from components.scripts.node_log import say
from components.scripts.node_processes import largest_processes


class MemoryWaits:
    def gpu_ready(self, spec, now):
        """Whether the GPUs have what vLLM asks for at start (gpuMemoryUtilization x total, on each);
        while they do not, says what holds them, for at most recovery gpu_wait_seconds."""
        fraction = spec.gpu_memory_utilization
        if not fraction or now < self.next_gpu_check:
            return not fraction or self.gpu_busy_since is None
        self.next_gpu_check = now + 1
        gpus = gpu_memory(visible_gpus({**os.environ, **spec.env}))
        if gpus is None:
            unified = unified_memory()
            if unified is None:  # nothing to read: vLLM's own check decides (a refused start waits, see vllm_exited)
                return True
            return self.unified_ready(fraction, *unified, now)
        short = [(index, total, free) for index, total, free in gpus if free < fraction * total]
        if not short:
            if self.gpu_busy_since is not None:
                say(f"GPU memory is free again after {now - self.gpu_busy_since:.0f} s")
            self.gpu_busy_since, self.gpu_busy = None, None
            return True
        detail = "; ".join(
            f"GPU {index} has {free / 1024:.1f} of {total / 1024:.1f} GiB free, vLLM asks for "
            f"{fraction * total / 1024:.1f} (gpuMemoryUtilization {fraction:g})"
            for index, total, free in short
        )
        holders = gpu_holders()
        held = ", ".join(holders) if holders else "nothing in this container (another container or a host process)"
        self.gpu_busy = f"{detail}; held by {held}"
        return self.gpu_wait(now, self.gpu_busy)

    def unified_ready(self, fraction, total, available, now):
        """On unified memory (a GB10) vLLM's start-up check wants gpuMemoryUtilization x MemTotal available.
        Each crashed vLLM can leave some of it taken (eugr/spark-vllm-docker #257: after ~35 restarts SSH timed
        out and the box needed a reset), so a start waits for it and gives up, saying so, rather than pile on."""
        wanted = fraction * total
        if available >= wanted:
            if self.gpu_busy_since is not None:
                say(f"unified memory is free again after {now - self.gpu_busy_since:.0f} s")
            self.gpu_busy_since, self.gpu_busy = None, None
            return True
        largest = ", ".join(largest_processes())
        self.gpu_busy = (
            f"unified memory: {available / 1024:.1f} of {total / 1024:.1f} GiB available (MemAvailable), vLLM asks "
            f"for {wanted / 1024:.1f} (gpuMemoryUtilization {fraction:g}); largest processes: {largest}"
        )
        if not self.gpu_wait(now, self.gpu_busy):
            if self.failed:  # gave up: say what it means on unified memory
                self.failed += (
                    " — memory that does not come back after vLLM exited is memory an earlier vLLM left taken; "
                    "restarting again would take the rest: reboot the node, then bump vllm.restartGeneration"
                )
            return False
        return True

    def oom_guard(self, now):
        """memory.oomGuard: vLLM is ended first when MemAvailable falls under the OS's reserve, before the kernel's
        OOM killer picks sshd or the supervisor (the restart then waits for the memory: unified_ready)."""
        floor = self.spec.oom_guard_mib if self.spec else None
        if not floor or self.vllm is None or now < self.next_oom_check:
            return
        self.next_oom_check = now + 1
        found = meminfo()
        if found is None or found[1] >= floor:
            return
        say(
            f"memory.oomGuard: MemAvailable {found[1] / 1024:.1f} GiB is under the OS's reserve "
            f"({floor / 1024:.1f} GiB, memory.osReserveGib): ending vLLM before the kernel picks a process"
        )
        self.oom_guarded += 1
        self.stop_vllm("memory.oomGuard", grace=2)
        # Counted as an exit: a vLLM that fills the memory again at every start is a crash loop too.
        recovery = self.recovery
        self.exits.append(now)
        while self.exits and now - self.exits[0] > recovery.window_seconds:
            self.exits.popleft()
        if len(self.exits) > recovery.max_restarts:
            self.failed = (
                f"memory.oomGuard ended vLLM {len(self.exits)} times within {recovery.window_seconds:g} s "
                f"(recovery.maxRestarts {recovery.max_restarts}): not starting it again — it fills the memory at "
                "every start: lower vllm.gpuMemoryUtilization or maxModelLen, or raise memory.osReserveGib"
            )
            self.state = VllmState.FAILED
            say(self.failed)
            return
        # restarted like after a crash: after the backoff, and once the memory is back (unified_ready)
        self.next_start = now + min(recovery.backoff_seconds * 2 ** (len(self.exits) - 1), recovery.max_backoff_seconds)
        self.restarts_total += 1
        self.state = VllmState.BACKOFF

    def gpu_wait(self, now, what):
        """Waiting for GPU memory: a state of its own, not a crash; gives up after gpu_wait_seconds."""
        if self.gpu_busy_since is None:
            self.gpu_busy_since = now
            self.gpu_note = 0.0
        waited = now - self.gpu_busy_since
        limit = self.recovery.gpu_wait_seconds
        if waited > limit:
            self.failed = (
                f"the GPU stayed busy for {waited:.0f} s (recovery.gpuWaitSeconds {limit}): {what}. Free it "
                "(nvidia-smi shows the processes), then bump vllm.restartGeneration"
            )
            self.state = VllmState.FAILED
            say(self.failed)
            return False
        if now >= self.gpu_note:
            say(f"waiting for GPU memory before starting vLLM ({waited:.0f} of {limit} s): {what}")
            self.gpu_note = now + 30
        self.state = VllmState.WAITING_MEMORY
        return False
