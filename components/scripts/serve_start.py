# Runs inside the head's Ray container (`docker exec -i … python3 -`), PARAMS prepended by
# components.render.script_program. Starts `vllm serve` detached, idempotently: the same argv
# already running is left alone; a different or dead one is replaced.
import json
import os
import signal
import subprocess
import sys
import time

P = json.loads(PARAMS)  # noqa: F821 - prepended by script_program


def running_pid():
    try:
        pid = int(open(P["pid_file"]).read().strip())
        os.kill(pid, 0)
        with open(f"/proc/{pid}/stat") as stat:
            if stat.read().split(") ", 1)[1].startswith("Z"):
                return None
        return pid
    except (OSError, ValueError):
        return None


def cmdline(pid):
    with open(f"/proc/{pid}/cmdline", "rb") as handle:
        return [part.decode() for part in handle.read().split(b"\0") if part]


def signal_group(pid, signum):
    try:
        os.killpg(pid, signum)
    except ProcessLookupError:
        pass


def stop(pid, grace):
    signal_group(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if running_pid() is None:
            return
        time.sleep(0.5)
    signal_group(pid, signal.SIGKILL)


def read(path):
    try:
        with open(path) as handle:
            return handle.read()
    except OSError:
        return None


def tail(path, lines):
    try:
        with open(path, errors="replace") as handle:
            return "".join(handle.readlines()[-lines:])
    except OSError:
        return "(no log)"


def main():
    os.makedirs(os.path.dirname(P["pid_file"]), mode=0o700, exist_ok=True)
    pid = running_pid()
    if pid is not None:
        # Compare without the program name: `vllm` runs as `python3 /usr/local/bin/vllm …` (a console
        # script), so the process's argv[0] is never the word we started.
        arguments = P["argv"][1:]
        if cmdline(pid)[-len(arguments) :] == arguments and read(P["fingerprint_file"]) == P["fingerprint"]:
            print(f"vLLM already running with these settings (pid {pid})")
            return 0
        print(f"vLLM settings changed: stopping pid {pid}", flush=True)
        stop(pid, P["stop_grace_seconds"])
    env = dict(os.environ)
    env.update(P["env"])
    with open(P["log_file"], "ab", buffering=0) as log:
        log.write(f"=== spark-vllm: starting {' '.join(P['argv'])}\n".encode())
        process = subprocess.Popen(
            P["argv"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd="/",
            start_new_session=True,  # survives this exec session; own group for killpg
        )
    with open(P["pid_file"], "w") as handle:
        handle.write(str(process.pid))
    with open(P["fingerprint_file"], "w") as handle:
        handle.write(P["fingerprint"])
    time.sleep(P["settle_seconds"])
    if process.poll() is not None:
        print(f"vLLM exited at once with code {process.returncode}; last lines of {P['log_file']}:")
        print(tail(P["log_file"], 100))
        return 1
    print(f"vLLM started (pid {process.pid}); log: {P['log_file']}")
    return 0


sys.exit(main())
