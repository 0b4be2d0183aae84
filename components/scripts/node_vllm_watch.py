# What the supervisor watches while vLLM serves, and how it ends one that stopped serving while its /health stays
# 200 (a part of supervisor.py's Supervisor, with state of its own; the rules themselves: node_watch.py). The
# stack's vllm.stallSeconds and vllm.canarySeconds come in RUN_DIR/watch.json
# (serve_spec.py writes it beside spec.json, outside vLLM's fingerprint: a change restarts nothing).
#
# * The API server's node: vLLM's /metrics every WATCH_SECONDS; stalled (StallWatch) → ended. While nothing runs
#   or waits, every canary_seconds the canary (in a thread, off the supervisor's loop, with stall_seconds to
#   answer): the first answer of a fingerprint is kept (RUN_DIR/canary.json, across restarts), later ones are
#   compared with it; no answer is a stall, other tokens twice in a row are wrong numerics → ended.
# * A headless rank (mp across nodes): its API server's /health; once it answered since this rank started, HEAD_GONE
#   seconds without it end this rank, which starts again and joins the next one. A rank stuck in a collective (a
#   stopped process, a fabric flap) does not notice its head going, and the next head would wait for it for good.
# Ending is the supervisor's: everything vLLM started (node_processes.py Tree), then a restart counted as a crash
# (recovery.maxRestarts). With deployments the router's keeper, which reads the same counters, takes a stalled
# replica out first: it is ended DRAIN_GRACE seconds after it was found. Before ending, what its processes are
# doing goes to RUN_DIR/fault.txt (state, kernel wait channel, and the Python stacks where the image has py-spy).
import json
import os
import shutil
import subprocess
import threading
import time
import urllib

from components.scripts.node_chat import chat
from components.scripts.node_contract import Fault, LastFault, VllmState, Watch
from components.scripts.node_log import say
from components.scripts.node_processes import describe
from components.scripts.node_timing import Every
from components.scripts.node_watch import (
    StallWatch,
    canary_answer,
    canary_difference,
    canary_request,
    http_get,
    read_load,
    read_metrics,
)

WATCH_SECONDS = 2
HEAD_GONE_SECONDS = 10
DRAIN_GRACE_SECONDS = 5
FAULT_STATES = {Fault.STALLED: VllmState.STALLED, Fault.WRONG: VllmState.WRONG, Fault.HEAD_GONE: VllmState.HEAD_GONE}


def served_name(argv):
    for arg in argv:
        if arg.startswith("--served-model-name="):
            return arg.split("=", 1)[1]
    return None


class VllmWatch:
    """The watch of one node's vLLM: its own counters and timers, the faults it found (status.json's `faults`,
    `last_fault`) and the one it will end vLLM for (`pending`)."""

    def __init__(self, run_dir):
        self.run_dir = run_dir
        self.faults = {}  # Fault kind -> times vLLM was ended for it
        self.last_fault = None
        self.reset()

    def reset(self):
        """A new start of vLLM: nothing seen of it yet."""
        self.stall = None
        self.looks = Every(WATCH_SECONDS)
        self.last_metrics = None
        self.canary_asking = None  # (thread, its result holder)
        self.canaries = Every(0)  # due: the canary may be asked (never while one is out)
        self.canary_misses = 0
        self.head_seen, self.head_failing_since = False, None
        self.pending = None  # (kind, detail, when to end)
        self.unhealthy_since = None  # since when a vLLM that served does not answer /health 200

    def check(self, now, spec, vllm, serving, served_since_start, fingerprint, shared):
        """Looks at vLLM (a VllmProcess) now and then; the kind of a fault found just now (vLLM's state is then that
        fault's: FAULT_STATES), else None. A fault found is ended after DRAIN_GRACE_SECONDS where the router takes
        the replica out first (`shared`), at once otherwise."""
        if spec is None or not vllm.running or vllm.ended_why:
            return None
        if self.pending and now >= self.pending[2]:
            kind, detail, _ = self.pending
            self.pending = None
            vllm.end(f"{FAULT_STATES[kind]}: {detail}")
            return None
        if self.pending or not self.looks.due(now):
            return None
        watch = read_watch(self.run_dir)
        if watch is None:
            return None
        if watch.head_health_url:
            found = self.watch_head(now, watch)
        elif serving and spec.health_url:
            self.unhealthy_since = None
            found = self.watch_serving(now, watch, spec, fingerprint)
        else:
            self.stall = None
            found = self.watch_health(now, watch, spec, served_since_start)
        if found is None:
            return None
        kind, detail, canary = found
        self.fault_found(now, kind, detail, canary, shared, vllm.alive())
        return kind

    def watch_health(self, now, watch, spec, served_since_start):
        """A vLLM that served and no longer answers /health 200 while its processes live on (its API server stuck
        or stopped) for stall_seconds is stalled too: nothing else would end it."""
        if not (served_since_start and spec.health_url):
            return None
        if self.unhealthy_since is None:
            self.unhealthy_since = now
        elif now - self.unhealthy_since >= watch.stall_seconds:
            silent = now - self.unhealthy_since
            why = f"its API server has not answered /health with 200 for {silent:.0f} s"
            return Fault.STALLED, f"{why} (vllm.stallSeconds {watch.stall_seconds:g})", None
        return None

    def watch_serving(self, now, watch, spec, fingerprint):
        base = spec.health_url.rsplit("/", 1)[0]
        status, text = http_get(base + "/metrics", 3)
        if status != 200:
            return None
        metrics = read_metrics(text)
        status, text = http_get(base + "/load", 3)
        load = read_load(text) if status == 200 else 0
        self.last_metrics = {**metrics, "server_load": load}
        if self.stall is None or self.stall.stall_seconds != watch.stall_seconds:
            self.stall = StallWatch(watch.stall_seconds)
        reason = self.stall.see(now, metrics, load)
        if reason:
            return Fault.STALLED, reason, None
        return self.watch_canary(now, watch, metrics, spec, fingerprint)

    def watch_head(self, now, watch):
        status, _ = http_get(watch.head_health_url, 3)
        if status == 200:
            self.head_seen, self.head_failing_since = True, None
        elif self.head_seen and self.head_failing_since is None:
            self.head_failing_since = now
        elif self.head_seen and now - self.head_failing_since >= HEAD_GONE_SECONDS:
            return (
                Fault.HEAD_GONE,
                f"its API server ({watch.head_health_url}) has not answered for {now - self.head_failing_since:.0f} s "
                f"(last: {status or 'no answer'}); a rank whose head went away is ended and joins the next one",
                None,
            )
        return None

    # -- the canary -------------------------------------------------------------------------------
    def watch_canary(self, now, watch, metrics, spec, fingerprint):
        if self.canary_asking is not None:
            thread, result = self.canary_asking
            if not thread.is_alive():
                self.canary_asking = None
                return self.canary_judged(now, watch, result, fingerprint)
            return None
        busy = metrics.get("vllm:num_requests_running", 0) + metrics.get("vllm:num_requests_waiting", 0)
        busy += self.last_metrics.get("server_load", 0)
        if not watch.canary_seconds or busy or measuring(self.run_dir) or not self.canaries.due(now, float("inf")):
            return None
        model = served_name(spec.argv)
        key = {**os.environ, **spec.env}.get("VLLM_API_KEY")
        url = spec.health_url.rsplit("/", 1)[0]
        result = {}
        thread = threading.Thread(target=ask_canary, args=(url, model, key, watch.stall_seconds, result), daemon=True)
        thread.start()
        self.canary_asking = (thread, result)
        return None

    def canary_judged(self, now, watch, result, fingerprint):
        if result.get("status") is None:  # no answer within stall_seconds, with /health answering
            return (
                Fault.STALLED,
                f"the canary got no answer within {watch.stall_seconds:g} s: {result.get('error')}",
                None,
            )
        if result.get("status") != 200 or not (result.get("answer") or {}).get("tokenIds"):
            say(f"the canary cannot be asked here (HTTP {result.get('status')}: {result.get('error', '')[:200]}); "
                "not asked again until vLLM restarts")  # fmt: skip
            return None  # the canaries stay not due: reset() at the next start
        answer = result["answer"]
        reference = read_canary(self.run_dir, fingerprint)
        if reference is None:
            write_canary(self.run_dir, fingerprint, answer)
            say(f"the canary's reference kept: {len(answer['tokenIds'])} token(s) {answer['text'][:60]!r}")
            self.canaries.by(now + watch.canary_seconds)
            return None
        difference = canary_difference(reference, answer)
        if difference is None:
            self.canary_misses = 0
            self.canaries.by(now + watch.canary_seconds)
            return None
        self.canary_misses += 1
        what = (
            f"the canary answered token {difference['found']} where it answered {difference['expected']} before, "
            f"at position {difference['at']} (of {difference['compared']} compared; {answer['text'][:60]!r} now, "
            f"{reference.get('text', '')[:60]!r} before)"
        )
        if self.canary_misses < 2:
            say(f"{what}: asking it again")
            self.canaries.now()
            return None
        return Fault.WRONG, f"{what}, twice in a row", {**difference, "answer": answer}

    # -- ending it -------------------------------------------------------------------------------
    def fault_found(self, now, kind, detail, canary, shared, pids):
        shared = shared and kind == Fault.STALLED
        self.faults[kind] = self.faults.get(kind, 0) + 1
        at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self.last_fault = LastFault(kind=kind, at=at, detail=detail, metrics=self.last_metrics, canary=canary)
        say(f"vLLM {FAULT_STATES[kind]}: {detail}; ending it" + (f" in {DRAIN_GRACE_SECONDS} s (the router takes it "
                                                                   "out)" if shared else ""))  # fmt: skip
        record_processes(self.run_dir, pids)
        self.pending = (kind, detail, now + (DRAIN_GRACE_SECONDS if shared else 0))


def ask_canary(base_url, model, key, timeout, result):
    """The canary, once (a thread's target, node_chat.py's chat): result gets status, answer or error."""
    try:
        result.update(status=200, answer=canary_answer(chat(base_url, canary_request(model), key, timeout)))
    except urllib.error.HTTPError as error:
        result.update(status=error.code, error=error.read().decode(errors="replace"))
    except (OSError, ValueError) as error:
        result.update(status=None, error=f"{type(error).__name__}: {error}")


def read_watch(run):
    """RUN_DIR/watch.json as serve_spec.py wrote it (a Watch), or None: nothing to watch (none written yet, or a
    handover from before it)."""
    try:
        with open(f"{run}/watch.json") as handle:
            return Watch.from_json(json.load(handle))
    except (OSError, ValueError, TypeError):
        return None


def measuring(run):
    """Whether the deploy's benchmark measures now (RUN_DIR/measuring holds its pid, which lives: node_benchmark.py
    hold_the_canary): no canary then, whose tokens would count in its figures. A file left by one that died is
    removed."""
    path = f"{run}/measuring"
    try:
        with open(path) as handle:
            pid = int(handle.read().strip())
        if pid > 0:
            os.kill(pid, 0)
            return True
    except ProcessLookupError:
        pass
    except PermissionError:
        return True  # alive, another user's
    except (OSError, ValueError):
        return False
    try:
        os.unlink(path)
    except OSError:
        pass
    return False


def read_canary(run, fingerprint):
    try:
        with open(f"{run}/canary.json") as handle:
            kept = json.load(handle)
    except (OSError, ValueError):
        return None
    return kept.get("answer") if kept.get("fingerprint") == fingerprint else None


def write_canary(run, fingerprint, answer):
    kept = {"fingerprint": fingerprint, "answer": answer, "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    with open(f"{run}/canary.json.tmp", "w") as handle:
        json.dump(kept, handle)
    os.replace(f"{run}/canary.json.tmp", f"{run}/canary.json")


def record_processes(run, pids):
    """RUN_DIR/fault.txt: what each of vLLM's processes is doing (its state, where the kernel has it waiting, and
    its Python stack where the image has py-spy), for the diagnostics bundle."""
    lines = [f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}: vLLM's processes when it was ended"]
    spy = shutil.which("py-spy")
    for pid in pids:
        state = wchan = "?"
        try:
            with open(f"/proc/{pid}/stat") as handle:
                state = handle.read().rsplit(")", 1)[1].split()[0]
            with open(f"/proc/{pid}/wchan") as handle:
                wchan = handle.read().strip() or "-"
        except (OSError, IndexError):
            pass
        lines.append(f"{describe(pid)}: state {state}, waiting in {wchan}")
        if spy:
            try:
                dump = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=10)
                lines.append(dump.stdout.strip() or dump.stderr.strip())
            except (OSError, subprocess.TimeoutExpired) as error:
                lines.append(f"py-spy: {error}")
    if not spy:
        lines.append("(no py-spy in the image: no Python stacks)")
    try:
        with open(f"{run}/fault.txt", "w") as handle:
            handle.write("\n".join(lines) + "\n")
    except OSError:
        pass
