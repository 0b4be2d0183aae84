# Runs inside the head's Ray container through a quoted heredoc: stops vLLM gracefully
# (SIGTERM to its process group, wait, then SIGKILL). Safe to run when nothing runs.
import os
import signal
import sys
import time

PID_FILE, GRACE = sys.argv[1], float(sys.argv[2])


def alive(pid):
    try:
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as stat:
            return not stat.read().split(") ", 1)[1].startswith("Z")
    except OSError:
        return False


try:
    pid = int(open(PID_FILE).read().strip())
except (OSError, ValueError):
    print("vLLM is not running")
    sys.exit(0)


def signal_group(signum):
    try:
        os.killpg(pid, signum)
    except ProcessLookupError:
        pass


if alive(pid):
    signal_group(signal.SIGTERM)
    deadline = time.monotonic() + GRACE
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.5)
    if alive(pid):
        print(f"vLLM (pid {pid}) ignored SIGTERM for {GRACE:g} s: killing it")
        signal_group(signal.SIGKILL)
os.remove(PID_FILE)
print(f"vLLM (pid {pid}) stopped")
