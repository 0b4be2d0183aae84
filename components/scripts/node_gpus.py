# What the GPUs have free and who holds them, from nvidia-smi where there is one (the supervisor's). Standard
# library only, no side effects.
import os
import subprocess

from components.scripts.node_processes import describe


def gpu_holders():
    """Processes in this container with a GPU open (/dev/nvidiaN), named."""
    held = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            targets = [os.readlink(f"/proc/{entry}/fd/{fd}") for fd in os.listdir(f"/proc/{entry}/fd")]
        except OSError:
            continue
        if any(t.startswith("/dev/nvidia") and t[len("/dev/nvidia") :].isdigit() for t in targets):
            held.append(describe(int(entry)))
    return sorted(held)


def gpu_memory(visible):
    """[(index, total MiB, free MiB)] of the GPUs vLLM will use, from nvidia-smi; None where there is no
    nvidia-smi or it reports no sizes (a GB10's unified memory: [N/A])."""
    rows = nvidia_smi("index,memory.total,memory.free")
    if rows is None:
        return None
    gpus = []
    for line in rows:
        parts = [part.strip() for part in line.split(",")]
        if len(parts) != 3 or not all(part.replace(".", "", 1).isdigit() for part in parts):
            return None
        index, total, free = int(parts[0]), float(parts[1]), float(parts[2])
        if visible is None or str(index) in visible:
            gpus.append((index, total, free))
    return gpus or None


def visible_gpus(env):
    """The GPU indexes CUDA_VISIBLE_DEVICES names (None: all of them)."""
    value = env.get("CUDA_VISIBLE_DEVICES")
    if value is None or not all(part.strip().isdigit() for part in value.split(",") if part.strip()):
        return None
    return {part.strip() for part in value.split(",") if part.strip()}


def unified_memory():
    """(MemTotal MiB, MemAvailable MiB) where the GPU shares the system's memory (a GB10: nvidia-smi reports
    its memory as [N/A]), else None. SPARK_VLLM_MEMINFO names another meminfo (tests)."""
    rows = nvidia_smi("memory.total")
    if not rows or not all(row.startswith("[N/A]") for row in rows):
        return None
    return meminfo()


def nvidia_smi(query):
    """nvidia-smi's rows for `query` (CSV, no header, no units), stripped; None without nvidia-smi or when it fails."""
    try:
        result = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"],
                                capture_output=True, text=True, timeout=20)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    if result.returncode != 0:
        return None
    return [row.strip() for row in result.stdout.strip().splitlines()]


def meminfo():
    """(MemTotal MiB, MemAvailable MiB) from /proc/meminfo (or SPARK_VLLM_MEMINFO), or None."""
    found = {}
    try:
        with open(os.environ.get("SPARK_VLLM_MEMINFO") or "/proc/meminfo") as handle:
            for line in handle:
                key, _, value = line.partition(":")
                if key in ("MemTotal", "MemAvailable"):
                    found[key] = int(value.split()[0]) / 1024  # kB -> MiB
    except (OSError, ValueError, IndexError):
        return None
    if len(found) < 2:
        return None
    return found["MemTotal"], found["MemAvailable"]
