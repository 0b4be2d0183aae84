# Everything a process started, and ending all of it (the supervisor's): vLLM is several processes (the API server,
# an engine core, workers) and only the last to go frees the GPU. Standard library only, no side effects.
import collections
import os
import signal
import subprocess
import time

from components.scripts.node_log import say


def proc_stat(pid):
    """(ppid, pgid, sid, start time) of a process, or None when it is gone (or a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] == "Z":
        return None
    return int(fields[1]), int(fields[2]), int(fields[3]), int(fields[19])


def all_processes():
    """{pid: (ppid, pgid, sid, start time)} of every live process this container sees."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = proc_stat(int(entry))
            if stat is not None:
                found[int(entry)] = stat
    return found


def process_name(pid):
    """A process's name (/proc/PID/comm: its first 15 characters, `VLLM::EngineCor`); "" when it is gone."""
    try:
        with open(f"/proc/{pid}/comm") as handle:
            return handle.read().strip()
    except OSError:
        return ""


def describe(pid):
    """`pid 812 VLLM::EngineCore` (its name, else the start of its command line)."""
    name = process_name(pid)
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            line = handle.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return f"pid {pid}"
    if line and name.lower() in ("python", "python3", "python3.12", "python3.11", "python3.10"):
        name = line[:80]
    return f"pid {pid} {name}"


def descendants(roots, processes):
    """`roots` and every process below them."""
    children = collections.defaultdict(list)
    for pid, (ppid, *_rest) in processes.items():
        children[ppid].append(pid)
    found, todo = set(), list(roots)
    while todo:
        pid = todo.pop()
        if pid in found:
            continue
        found.add(pid)
        todo.extend(children.get(pid, ()))
    return found


class Tree:
    """Everything one start of vLLM made: its process group and session (the API server leads both),
    every process below it, and those seen below it earlier (a SIGKILLed parent's children are
    re-parented away, but they keep the session, and the supervisor remembers them)."""

    def __init__(self, leader):
        self.leader = leader
        self.seen = {}  # pid -> start time: processes once below the leader

    def remember(self):
        """Keeps every process of it now in `seen`; returns them (what alive() would say)."""
        processes = all_processes()
        members = self._members(processes)
        for pid in members:
            self.seen.setdefault(pid, processes[pid][3])
        return members

    def _members(self, processes):
        mine = {pid for pid, (_, pgid, sid, _) in processes.items() if self.leader in (pgid, sid)}
        mine |= {pid for pid, start in self.seen.items() if pid in processes and processes[pid][3] == start}
        if self.leader in processes:
            mine.add(self.leader)
        return descendants(mine, processes) & set(processes)

    def alive(self):
        return self._members(all_processes())

    def signal(self, signum):
        for pid in self.alive():
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    def gone_within(self, seconds, reap=None):
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if reap:
                reap()  # our own child must be waited for, or it lingers as a zombie
            if not self.alive():
                return True
            time.sleep(0.2)
        return False

    def end(self, grace, reap=None):
        """SIGTERM to all of it, up to `grace` seconds, SIGKILL to what is left; True once all is gone."""
        if not self.alive():
            return True
        self.signal(signal.SIGTERM)
        self.signal(signal.SIGCONT)  # a stopped process (SIGSTOP, a stalled vLLM's) takes its SIGTERM once it runs
        if self.gone_within(grace, reap):
            return True
        left = sorted(self.alive())
        say(f"SIGKILL to what is left of vLLM after {grace:g} s: {', '.join(describe(pid) for pid in left)}")
        self.signal(signal.SIGKILL)
        return self.gone_within(10, reap)


def stop_group(process, grace):
    """Ray's `ray start --block` and its children: SIGTERM to its process group, `grace`, SIGKILL."""
    if process is None or process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        process.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        say(f"Ray did not stop within {grace:g} s of SIGTERM: SIGKILL to its processes")
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()


def largest_processes(count=3):
    """The `count` processes holding the most memory here (resident), as "pid name (X GiB)"."""
    sizes = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/statm") as handle:
                resident = int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            continue
        sizes.append((resident, int(entry)))
    sizes.sort(reverse=True)
    return [f"{describe(pid)} ({resident / 2**30:.1f} GiB)" for resident, pid in sizes[:count]] or ["none readable"]
