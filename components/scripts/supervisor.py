# The main process of every node's container (`python3 -c <this> PARAMS_JSON`), in both executors.
# Keeps what the node runs alive without `pulumi up`, and says how it is doing:
#
# * Ray mode: `ray start --block …` (the head or a worker), restarted whenever it exits (a worker
#   whose head went away keeps trying until the head is back). On the head, vLLM too.
# * mp mode: vLLM only, one rank a node (`--headless` on the workers).
#
# vLLM runs once the serve step has written its settings (RUN_DIR/spec.json: argv, env and a
# fingerprint; the API key travels there, never on a command line). When it exits while its
# settings stand, it is started again after a backoff (backoff_seconds, doubling up to
# max_backoff_seconds); after max_restarts exits within window_seconds the supervisor stops trying
# and stays up, with the reason in RUN_DIR/status.json and the log. New settings (another
# fingerprint) stop the running vLLM, start it with them and reset the count; removed settings
# stop it. On the Ray head vLLM starts only once Ray shows every node and the GPUs it needs, so a
# cluster still forming after a reboot does not use up restarts.
#
# RUN_DIR/status.json, rewritten on every change: state (waiting for network.guard | no settings |
# waiting for Ray | starting |
# running | backoff | failed | stopped), vLLM's pid, restarts in the window and in all, the last
# exit and the last error line of the log, whether /health answers 200 (serving), Ray's restarts.
# RUN_DIR/vllm.log: vLLM's output, with a `=== spark-vllm: …` line for each start and exit.
# With network.guard (P["guard_marker"]), nothing starts until the guard container applied its
# rules in this boot (its marker names the boot id): after a reboot Ray never listens unguarded.
# SIGTERM (docker stop) stops vLLM (SIGTERM to its process group, stop_grace_seconds, SIGKILL),
# then Ray, and exits 0.
import collections
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

P = json.loads(sys.argv[1])  # what the container is: node, executor, run_dir, ray_argv, stop_grace_seconds
RUN = P["run_dir"]
SPEC, STATUS, LOG = f"{RUN}/spec.json", f"{RUN}/status.json", f"{RUN}/vllm.log"
# What vLLM is, from the serve step's spec: argv, env, fingerprint, recovery (max_restarts,
# window_seconds, backoff_seconds, max_backoff_seconds), health_url (the head), ray_ready (the Ray
# head: {address, nodes, gpus}). In the spec, not the container, so that changing them (a node added,
# another port) touches no container.
DEFAULT_RECOVERY = {"max_restarts": 5, "window_seconds": 600, "backoff_seconds": 5, "max_backoff_seconds": 60}
RAY_CHECK = """
import json, ray
ray.init(address={address!r}, logging_level="ERROR", log_to_driver=False)
alive = [n for n in ray.nodes() if n.get("Alive")]
print(json.dumps({{"nodes": len(alive), "gpus": sum(n.get("Resources", {{}}).get("GPU", 0) for n in alive)}}))
"""


def say(message):
    line = f"[spark-vllm supervisor {P['node']}] {message}"
    print(line, flush=True)
    with open(LOG, "a") as log:
        log.write(f"=== spark-vllm: {message}\n")


def read_spec():
    try:
        with open(SPEC) as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return None


def last_error(lines=200):
    try:
        with open(LOG, errors="replace") as handle:
            tail = handle.readlines()[-lines:]
    except OSError:
        return ""
    for line in reversed(tail):
        if "=== spark-vllm:" in line:
            continue
        if any(word in line for word in ("Error", "ERROR", "error:", "Traceback", "unrecognized")):
            return line.strip()[:300]
    for line in reversed(tail):
        if line.strip() and "=== spark-vllm:" not in line:
            return line.strip()[:300]
    return ""


def stop_group(process, grace):
    if process is None or process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        process.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()


class Supervisor:
    def __init__(self):
        self.stopping = False
        self.ray = None
        self.ray_restarts = 0
        self.ray_next = 0.0
        self.vllm = None
        self.fingerprint = None  # the settings vLLM runs (or should run) with
        self.exits = collections.deque()  # times of exits within the window
        self.restarts_total = 0
        self.next_start = 0.0
        self.failed = None
        self.last_exit = None
        self.started_at = None
        self.serving = False
        self.next_probe = 0.0
        self.next_ray_check = 0.0
        self.spec = None
        self.ray_ready = False
        self.state = "no settings"
        self.written = None
        self.guard_seen = False
        self.guard_note = 0.0

    # -- network.guard -------------------------------------------------------------------------
    def guarded(self, now):
        """Whether the guard's rules are in place in this boot (always, without the guard)."""
        if self.guard_seen or not P.get("guard_marker"):
            return True
        try:
            with open(P["guard_marker"]) as handle:
                marker = json.load(handle)
            with open("/proc/sys/kernel/random/boot_id") as handle:
                self.guard_seen = marker.get("boot_id") == handle.read().strip()
        except (OSError, ValueError):
            self.guard_seen = False
        if self.guard_seen:
            say("network.guard's rules are in place")
        elif now >= self.guard_note:
            say("waiting for network.guard's rules (container spark-vllm.guard) before starting anything")
            self.guard_note = now + 30
        return self.guard_seen

    @property
    def recovery(self):
        return {**DEFAULT_RECOVERY, **((self.spec or {}).get("recovery") or {})}

    # -- Ray -----------------------------------------------------------------------------------
    def keep_ray(self, now):
        if not P.get("ray_argv"):
            return
        if self.ray is not None and self.ray.poll() is None:
            return
        if self.ray is not None:
            code = self.ray.returncode
            self.ray = None
            self.ray_restarts += 1
            self.ray_ready = False
            delay = min(2 ** min(self.ray_restarts, 5), 30)
            self.ray_next = now + delay
            say(f"Ray exited with code {code}; starting it again in {delay} s")
            return
        if now >= self.ray_next:
            self.ray = subprocess.Popen(P["ray_argv"], stdin=subprocess.DEVNULL, start_new_session=True)
            say(f"Ray started (pid {self.ray.pid}): {' '.join(P['ray_argv'][:3])} …")

    def cluster_formed(self, now):
        """The Ray head waits for every node and the GPUs before it starts vLLM."""
        wanted = (self.spec or {}).get("ray_ready")
        if self.ray_ready or not wanted:
            return True
        if now < self.next_ray_check:
            return False
        self.next_ray_check = now + 2
        try:
            result = subprocess.run(
                [sys.executable, "-c", RAY_CHECK.format(address=wanted["address"])],
                capture_output=True,
                text=True,
                timeout=60,
            )
            found = json.loads(result.stdout.strip().splitlines()[-1])
        except (subprocess.TimeoutExpired, ValueError, IndexError, OSError):
            return False
        self.ray_ready = found["nodes"] >= wanted["nodes"] and found["gpus"] >= wanted["gpus"]
        return self.ray_ready

    # -- vLLM ----------------------------------------------------------------------------------
    def start_vllm(self, spec, now):
        env = dict(os.environ)
        env.update(spec.get("env") or {})
        with open(LOG, "ab", buffering=0) as log:
            log.write(f"=== spark-vllm: starting {' '.join(spec['argv'])}\n".encode())
            self.vllm = subprocess.Popen(
                spec["argv"],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd="/",
                start_new_session=True,  # its own process group: stopped as a whole
            )
        with open(f"{RUN}/vllm.pid", "w") as handle:
            handle.write(str(self.vllm.pid))
        self.started_at = now
        self.serving = False
        self.state = "starting"
        say(f"vLLM started (pid {self.vllm.pid})")

    def stop_vllm(self, why):
        if self.vllm is not None and self.vllm.poll() is None:
            say(f"stopping vLLM (pid {self.vllm.pid}): {why}")
            stop_group(self.vllm, P["stop_grace_seconds"])
        self.vllm = None
        self.serving = False

    def vllm_exited(self, now):
        code = self.vllm.returncode
        self.vllm = None
        self.serving = False
        # A node of the group may be what went away: the next start waits for Ray to be whole again.
        self.ray_ready = False
        error = last_error()
        self.last_exit = {"code": code, "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "error": error}
        recovery = self.recovery
        window = recovery["window_seconds"]
        self.exits.append(now)
        while self.exits and now - self.exits[0] > window:
            self.exits.popleft()
        if len(self.exits) > recovery["max_restarts"]:
            self.failed = (
                f"vLLM exited {len(self.exits)} times within {window} s (recovery.maxRestarts "
                f"{recovery['max_restarts']}): not starting it again. Last exit code {code}: {error}"
            )
            self.state = "failed"
            say(self.failed)
            return
        delay = min(recovery["backoff_seconds"] * 2 ** (len(self.exits) - 1), recovery["max_backoff_seconds"])
        self.next_start = now + delay
        self.restarts_total += 1
        self.state = "backoff"
        say(
            f"vLLM exited with code {code} ({error}); starting it again in {delay:g} s "
            f"({len(self.exits)} of {recovery['max_restarts']} restarts within {window} s)"
        )

    def follow_spec(self, now):
        spec = read_spec()
        self.spec = spec
        wanted = spec.get("fingerprint") if spec else None
        if wanted != self.fingerprint:
            if self.fingerprint is not None:
                self.stop_vllm("new settings" if wanted else "settings removed")
            self.fingerprint = wanted
            self.exits.clear()
            self.failed = None
            self.next_start = now
            self.state = "no settings" if wanted is None else "starting"
        return spec

    def probe(self, now):
        url = (self.spec or {}).get("health_url")
        if not url or self.vllm is None or now < self.next_probe:
            return
        self.next_probe = now + 5
        try:
            with urllib.request.urlopen(url, timeout=3) as response:
                self.serving = response.status == 200
        except (urllib.error.URLError, OSError, ValueError):
            self.serving = False
        if self.serving:
            self.state = "running"

    def step(self):
        now = time.monotonic()
        if not self.guarded(now):
            self.state = "waiting for network.guard"
            self.write_status()
            return
        self.keep_ray(now)
        spec = self.follow_spec(now)
        if self.vllm is not None and self.vllm.poll() is not None:
            self.vllm_exited(now)
        if spec and self.vllm is None and not self.failed and now >= self.next_start:
            if self.cluster_formed(now):
                self.start_vllm(spec, now)
            else:
                self.state = "waiting for Ray"
        if self.vllm is not None and not (spec or {}).get("health_url") and now - (self.started_at or now) > 5:
            self.state = "running"  # a headless rank: alive is all it can say
        self.probe(now)
        self.write_status()

    def write_status(self):
        status = {
            "node": P["node"],
            "executor": P["executor"],
            "state": self.state,
            "spec_fingerprint": self.fingerprint,
            "vllm_pid": self.vllm.pid if self.vllm is not None else None,
            "serving": self.serving,
            "restarts_in_window": len(self.exits),
            "restarts_total": self.restarts_total,
            "last_exit": self.last_exit,
            "failed": self.failed,
            "ray_restarts": self.ray_restarts if P.get("ray_argv") else None,
        }
        if status == self.written:
            return
        tmp = f"{STATUS}.tmp"
        with open(tmp, "w") as handle:
            json.dump({**status, "updated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}, handle)
        os.replace(tmp, STATUS)
        self.written = status

    def run(self):
        os.makedirs(RUN, mode=0o700, exist_ok=True)
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: setattr(self, "stopping", True))
        say(f"supervisor up ({P['executor']} executor)")
        while not self.stopping:
            self.step()
            time.sleep(0.5)
        self.stop_vllm("the container is stopping")
        if self.ray is not None:
            stop_group(self.ray, P["stop_grace_seconds"])
        self.state = "stopped"
        self.write_status()
        return 0


sys.exit(Supervisor().run())
