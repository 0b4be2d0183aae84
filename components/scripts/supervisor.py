# The main process of every node's container (`python3 -c <this> PARAMS_JSON`), in both executors.
# One state machine (`state`, a VllmState) over its parts, each with its own state: RayKeeper (node_ray_keeper.py),
# TurnKeeper (node_turn_keeper.py), VllmProcess and Restarts (node_vllm_process.py), MemoryWaits
# (node_memory_waits.py), VllmWatch (node_vllm_watch.py); their timers are node_timing.py's.
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
# Replicas that share a node's GPUs start in turn: vLLM starts only while this supervisor holds the node's GPU
# turn (node_gpu_turn.py), taken just before the start and given back once vLLM serves (a rank without an API
# server: once it has its KV cache), exits, or outlasts vllm.readyTimeoutSeconds. A start that vLLM refuses for
# memory ("No available memory for the cache blocks", "Error in memory profiling") while another process on the
# GPU changed its own memory is that process's doing: it waits for the turn and starts again, not counted as a
# crash; only a refusal that repeats with the GPU otherwise quiet stops the loop, its reason naming what the
# GPU's other processes hold.
# RUN_DIR/status.json, rewritten on every change: state (waiting for network.guard | no settings |
# waiting for Ray | waiting for the GPU turn | waiting for GPU memory | starting |
# running | backoff | failed | stopped), vLLM's pid, restarts in the window and in all, the last
# exit and the last error line of the log, whether /health answers 200 (serving), Ray's restarts, the turn
# (held, or who holds it while this one waits).
# RUN_DIR/vllm.log: vLLM's output, with a `=== spark-vllm: MM-DD HH:MM:SS …` line for each start and exit.
# With network.guard (P.guard_marker), nothing starts until the guard container applied its
# rules in this boot (its marker names the boot id): after a reboot Ray never listens unguarded.
# vLLM is several processes (the API server, an engine core `VLLM::EngineCore`, workers) and only
# the last of them to go frees the GPU: a SIGKILL of the API server (the OOM killer, a crash) leaves
# the engine core holding the GPU memory. So whenever vLLM exits, or is stopped, the supervisor ends
# everything it started (its process group and session, and every process descended from it),
# SIGTERM first, SIGKILL after a grace; before a start it waits until the GPUs have the memory vLLM
# asks for at start-up (gpuMemoryUtilization x total, nvidia-smi where there is one), naming what
# still holds it, for at most recovery gpu_wait_seconds. A start that vLLM itself refuses because the
# GPU is still busy ("Free memory on device ... on startup is less than desired GPU memory
# utilization") is not a crash: it does not count against max_restarts, it waits for the GPU again.
# vLLM's engine core gone while its API server lives on is vLLM's exit too: after stop_grace_seconds
# without it the supervisor ends the rest (the API server does not always follow: on two H200s the engine
# core failed at start, its workers hung in CUDA's abort, and the API server waited on them for good).
# SIGTERM (docker stop) stops vLLM (SIGTERM to all of it, stop_grace_seconds, SIGKILL), then Ray,
# and exits 0.
import json
import os
import signal
import sys
import time
import urllib.error
import urllib.request

from components.scripts.node_compile_cache import redact_compile_factors
from components.scripts.node_contract import LastExit, SupervisorParams, SupervisorStatus, VllmSpec, VllmState
from components.scripts.node_log import speak_with
from components.scripts.node_memory_waits import MemoryWaits
from components.scripts.node_metrics import serve_node_metrics
from components.scripts.node_ray_keeper import RayKeeper
from components.scripts.node_timing import Every
from components.scripts.node_turn_keeper import TurnKeeper
from components.scripts.node_vllm_output import GPU_BUSY_MESSAGE, error_line, exit_reason, memory_refusal, start_refusal
from components.scripts.node_vllm_process import Restarts, VllmProcess, mark
from components.scripts.node_vllm_watch import FAULT_STATES, VllmWatch

P = SupervisorParams.from_json(json.loads(sys.argv[1]))  # what the container is (node_contract.py)
RUN = P.run_dir
SPEC, STATUS, LOG = f"{RUN}/spec.json", f"{RUN}/status.json", f"{RUN}/vllm.log"
# What vLLM is, from the serve step's spec: argv, env, fingerprint, recovery (max_restarts,
# window_seconds, backoff_seconds, max_backoff_seconds, gpu_wait_seconds: the stack's `recovery` keys,
# every one rendered by components.plan.container.supervisor_spec, so their defaults live in the config alone),
# health_url (the head), ray_ready (the Ray head: {address, nodes, gpus}). In the spec, not the
# container, so that changing them (a node added, another port) touches no container.
# The GPU's other processes changing their memory by more than this while vLLM started: its memory refusal is
# theirs to answer for (a neighbour starting, stopping or growing), not a refusal of its own settings.
DISTURBED_MIB = 1024
# A rank without an API server (mp, --headless) has what the turn protects once its workers have their KV cache
KV_CACHE_LINES = ("Available KV cache memory", "memory for KV Cache as specified", "GPU KV cache size")
GUARD_NOTE_SECONDS = 30


def say(message):
    line = f"[spark-vllm supervisor {P.node}] {message}"
    print(line, flush=True)
    with open(LOG, "a") as log:
        log.write(mark(message))


speak_with(say)  # what the node modules say goes to the log too


def turn_dir():
    """Where the node's GPU turn lives: the stack's volume in the container (SupervisorParams.gpu_turn_dir);
    SPARK_VLLM_GPU_TURN for tests that run several "nodes" on one host; a container from before it had none."""
    return os.environ.get("SPARK_VLLM_GPU_TURN") or P.gpu_turn_dir or f"{RUN}/gpu-turn"


def read_spec():
    """vLLM's settings as the serve step handed them over (a VllmSpec), or None."""
    try:
        with open(SPEC) as handle:
            return VllmSpec.from_json(json.load(handle))
    except (OSError, ValueError, KeyError, TypeError):
        return None


class Supervisor:
    """One state machine (`state`, a VllmState) over its parts, each with its own state: Ray (RayKeeper), the node's
    GPU turn (TurnKeeper), vLLM's processes and restarts (VllmProcess, Restarts), the memory it waits for
    (MemoryWaits), and the watch while it serves (VllmWatch)."""

    def __init__(self):
        self.stopping = False
        self.state = VllmState.NO_SETTINGS
        self.failed = None  # why the supervisor gave up on these settings (state FAILED)
        self.spec = None
        self.fingerprint = None  # the settings vLLM runs (or should run) with
        self.serving = False
        self.served_since_start = False  # a refusal at start is told from a crash after serving
        self.last_exit = None
        self.others_at_start = None  # MiB the GPU's other processes held when vLLM started (None: unknown)
        self.quiet_refusals = 0  # memory refusals in a row with the GPU otherwise quiet
        self.guard_seen = False
        self.guard_notes = Every(GUARD_NOTE_SECONDS)
        self.probes = Every(5)
        self.redactions = Every(30)
        self.factors_seen = {}  # vLLM's compile cache metadata looked at: path -> (mtime, size)
        self.written = None  # the status last written
        self.ray = RayKeeper(P.ray_argv)
        self.turn = TurnKeeper(P.node, turn_dir(), f"{RUN}/gpu-turn-refused")
        self.vllm = VllmProcess(RUN, LOG, P.stop_grace_seconds)
        self.restarts = Restarts()
        self.memory = MemoryWaits()
        self.watch = VllmWatch(RUN)

    # -- network.guard -------------------------------------------------------------------------
    def guarded(self, now):
        """Whether the guard's rules are in place in this boot (always, without the guard)."""
        if self.guard_seen or not P.guard_marker:
            return True
        try:
            with open(P.guard_marker) as handle:
                marker = json.load(handle)
            with open("/proc/sys/kernel/random/boot_id") as handle:
                self.guard_seen = marker.get("boot_id") == handle.read().strip()
        except (OSError, ValueError):
            self.guard_seen = False
        if self.guard_seen:
            say("network.guard's rules are in place")
        elif self.guard_notes.due(now):
            say("waiting for network.guard's rules (container spark-vllm.guard) before starting anything")
        return self.guard_seen

    @property
    def recovery(self):
        return self.spec.recovery  # read only while there are settings

    def tenancy(self):
        return self.spec.tenancy if self.spec else None

    def give_up(self, why):
        self.failed, self.state = why, VllmState.FAILED
        say(why)

    # -- starting vLLM --------------------------------------------------------------------------
    def try_start(self, spec, now):
        """vLLM's start, when Ray shows the cluster, the node's GPU turn is this one's and the memory is there."""
        formed = self.ray.cluster_formed(now, spec.ray_ready)  # asked during the backoff too: it overlaps the wait
        now = time.monotonic()
        if now < self.restarts.next_start:
            return
        if not formed:
            self.state = VllmState.WAITING_RAY
            return
        if self.turn.problem:
            self.give_up(f"vLLM is not started: {self.turn.problem}")
            return
        if not self.turn.take(now, self.tenancy()):
            self.memory.clear()  # memory a neighbour takes while it starts is not a busy GPU
            self.state = VllmState.WAITING_TURN
            return
        if not self.memory.gpu_ready(spec, now, self.recovery.gpu_wait_seconds):
            self.turn.give_back()  # waiting for memory held elsewhere: the turn is another replica's meanwhile
            self.memory_waited()
            return
        self.others_at_start = self.others_memory()
        self.vllm.start(spec, now)
        self.watch.reset()
        self.redactions.by(now + 2)  # vLLM writes the compile cache's metadata while it starts
        self.serving = self.served_since_start = False
        self.state = VllmState.STARTING
        self.turn.started()

    def memory_waited(self):
        """The state after a wait for memory: still waiting, or given up."""
        if self.memory.gave_up:
            self.give_up(self.memory.gave_up)
        else:
            self.state = VllmState.WAITING_MEMORY

    def env(self):
        """The environment vLLM runs in (its GPUs: CUDA_VISIBLE_DEVICES)."""
        return {**os.environ, **(self.spec.env if self.spec else {})}

    def others_memory(self):
        return self.memory.others_hold(self.env())

    # -- vLLM gone ------------------------------------------------------------------------------
    def vllm_exited(self, now, code):
        self.serving = False
        self.ray.forget()  # a node of the group may be what went away: the next start waits for Ray to be whole
        output = self.vllm.output()
        error = exit_reason(code, output)
        if self.vllm.ended_why:  # the supervisor ended it
            error = f"{self.vllm.ended_why}; its log's last error: {error_line(output) or 'none'}"
            self.vllm.ended_why = None
        self.last_exit = LastExit(code=code, at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), error=error)
        self.turn.give_back("vLLM exited")
        if GPU_BUSY_MESSAGE in output:
            # Not a crash: the GPU was not free yet (a process still releasing it). Wait and try again.
            self.restarts.again(now, self.recovery.backoff_seconds)
            say(f"vLLM could not start because the GPU is still busy; not counted as a crash ({error})")
            self.memory.wait(now, f"vLLM refused to start: {error}", self.recovery.gpu_wait_seconds)
            self.memory_waited()
            return
        refused = "" if self.served_since_start else memory_refusal(output)
        if refused:
            self.memory_refused(now, refused)
            return
        refusal = "" if self.served_since_start else start_refusal(output)
        if refusal:
            # Not a crash to recover from: vLLM refuses these settings and would refuse them again.
            self.give_up(
                f"vLLM refused its settings while starting, and would refuse them again at every restart, so it "
                f"is not restarted: {refusal} — change the setting it names (`pulumi up` hands vLLM the new "
                "settings and it starts again)"
            )
            return
        recovery = self.recovery
        delay = self.restarts.crashed(now, recovery)
        if delay is None:
            self.give_up(
                f"vLLM exited {len(self.restarts)} times within {recovery.window_seconds} s (recovery.maxRestarts "
                f"{recovery.max_restarts}): not starting it again. Last exit code {code}: {error}"
            )
            return
        self.state = VllmState.BACKOFF
        say(
            f"vLLM exited with code {code} ({error}); starting it again in {delay:g} s "
            f"({len(self.restarts)} of {recovery.max_restarts} restarts within {recovery.window_seconds} s)"
        )

    def memory_refused(self, now, refused):
        """vLLM did not get its memory while it started (MEMORY_REFUSALS). Another process on the GPU that changed
        its memory meanwhile caused it: start again once the turn is free, not counted. With the GPU otherwise
        quiet, once more; a second time is a refusal of these settings, said with what the neighbours hold."""
        others = self.others_memory()
        changed = None if others is None or self.others_at_start is None else others - self.others_at_start
        busy = self.turn.busy_neighbours(self.vllm.started_wall)
        if not self.turn.kept or busy or (changed is not None and abs(changed) > DISTURBED_MIB):
            self.quiet_refusals = 0
            if changed is not None and abs(changed) > DISTURBED_MIB:
                was, now_gib = self.others_at_start / 1024, others / 1024
                what = f"the GPU's other processes went from {was:.1f} to {now_gib:.1f} GiB"
            elif busy:
                what = f"{', '.join(busy)} meanwhile"
            else:
                what = "it started without the node's GPU turn for all of its start"
            self.restarts.again(now, self.recovery.backoff_seconds)
            self.state = VllmState.BACKOFF
            say(
                f"vLLM did not get its memory while it started, and {what}: that is another process's doing, not a "
                f"refusal of its settings; starting it again once the GPU turn is free, not counted as a crash "
                f"({refused})"
            )
            return
        self.quiet_refusals += 1
        if self.quiet_refusals < 2:
            self.restarts.again(now, self.recovery.backoff_seconds)
            self.state = VllmState.BACKOFF
            say(
                "vLLM did not get its memory while it started, with the GPU otherwise quiet; once more before "
                f"calling it a refusal of its settings ({refused})"
            )
            return
        self.give_up(self.quiet_refusal_reason(refused, others))

    def quiet_refusal_reason(self, refused, others):
        """Why vLLM will not start, said so that no advice takes memory a neighbour holds (or would need)."""
        fraction = self.spec.gpu_memory_utilization if self.spec else None
        neighbours = [n for n in self.turn.neighbours() if n.get("gpu_memory_utilization")]
        head = f"vLLM refused to start twice in a row with the GPU otherwise quiet: {refused} — "
        gpus = self.memory.node.gpus(self.env())
        total = sum(t for _, t, _ in gpus) if gpus else None
        if others is not None and others > DISTURBED_MIB and total:
            asked = " + ".join(f"{n.get('replica') or '?'} {n['gpu_memory_utilization']:g} ({n.get('state')})"
                               for n in neighbours) or "nothing"  # fmt: skip
            budgets = sum(n["gpu_memory_utilization"] for n in neighbours) * total
            held = (
                f"other processes hold {others / 1024:.1f} GiB of the GPU's {total / 1024:.1f} GiB (the replicas "
                f"beside it ask {asked} of it, {budgets / 1024:.1f} GiB), and this one asks gpuMemoryUtilization "
                f"{fraction:g} = {(fraction or 0) * total / 1024:.1f} GiB. "
            )
            if others > budgets + DISTURBED_MIB:
                advice = (
                    "They hold more than the replicas beside it ask for: one of them (or a process outside the "
                    "stack: nvidia-smi shows which) took more than its share, e.g. having started while another vLLM "
                    "profiled; restart that one (bump its vllm.restartGeneration). Raising this replica's "
                    "gpuMemoryUtilization would only take from them"
                )
            else:
                advice = (
                    "Its own share does not hold its weights and activations: lower its maxModelLen or maxNumSeqs, or "
                    "give it a larger share by first lowering a neighbour's gpuMemoryUtilization (the shares of a "
                    "node's replicas add up to at most 1)"
                )
            return head + held + advice
        return head + (
            f"alone on the GPU, its weights and activations take all of gpuMemoryUtilization {fraction}: raise "
            "vllm.gpuMemoryUtilization (where nothing else shares the GPU), or serve a smaller or quantized model; "
            "`pulumi up` hands vLLM the new settings"
        )

    def oom_guard(self, now):
        """memory.oomGuard ended vLLM: counted as an exit (a vLLM that fills the memory again at every start is a
        crash loop too), restarted after the backoff once the memory is back (MemoryWaits.unified_ready)."""
        if not self.vllm.running or not self.memory.oom_guard(now, self.spec.oom_guard_mib if self.spec else None):
            return
        self.stop_vllm("memory.oomGuard", grace=2)
        recovery = self.recovery
        if self.restarts.crashed(now, recovery) is None:
            self.give_up(
                f"memory.oomGuard ended vLLM {len(self.restarts)} times within {recovery.window_seconds:g} s "
                f"(recovery.maxRestarts {recovery.max_restarts}): not starting it again — it fills the memory at "
                "every start: lower vllm.gpuMemoryUtilization or maxModelLen, or raise memory.osReserveGib"
            )
            return
        self.state = VllmState.BACKOFF

    def stop_vllm(self, why, grace=None):
        self.vllm.stop(why, grace)
        self.serving = False

    # -- settings and serving -------------------------------------------------------------------
    def follow_spec(self, now):
        spec = read_spec()
        self.spec = spec
        wanted = spec.fingerprint if spec else None
        if wanted != self.fingerprint:
            if self.fingerprint is not None:
                self.stop_vllm("new settings" if wanted else "settings removed")
            self.fingerprint = wanted
            self.restarts.reset(now)
            self.failed = None
            self.quiet_refusals = 0
            self.memory.clear()
            self.state = VllmState.NO_SETTINGS if wanted is None else VllmState.STARTING
        return spec

    def probe(self, now):
        url = self.spec.health_url if self.spec else None
        # the node's other replicas wait on this one serving: asked every second while it holds the turn
        if not url or not self.vllm.running or not self.probes.due(now, 1 if self.turn.held else 5):
            return
        try:
            with urllib.request.urlopen(url, timeout=3) as response:
                self.serving = response.status == 200
        except (urllib.error.URLError, OSError, ValueError):
            self.serving = False
        if self.serving:
            self.served_since_start = True
            self.quiet_refusals = 0
            if not self.watch.pending:  # a vLLM found stalled answers /health until it is ended
                self.state = VllmState.RUNNING
            self.memory.clear()

    def has_kv_cache(self):
        """A rank without an API server has what the turn protects once its KV cache is allocated."""
        headless = not (self.spec and self.spec.health_url)
        return headless and any(line in self.vllm.output() for line in KV_CACHE_LINES)

    def step(self):
        now = time.monotonic()
        if not self.guarded(now):
            self.state = VllmState.WAITING_GUARD
            self.write_status()
            return
        self.ray.keep(now)
        spec = self.follow_spec(now)
        code = self.vllm.exited()
        if code is not None:
            self.vllm_exited(now, code)
        else:
            self.vllm.remember(now)
        if spec and not self.vllm.running and not self.failed:
            self.try_start(spec, now)
            now = time.monotonic()
        if (
            self.vllm.running
            and not (spec and spec.health_url)
            and now - (self.vllm.started_at or now) > 5
            and not self.watch.pending
        ):
            self.state = VllmState.RUNNING  # a headless rank: alive is all it can say
        self.probe(now)
        found = self.watch.check(
            now, spec, self.vllm, self.serving, self.served_since_start, self.fingerprint, self.tenancy() is not None
        )
        if found:
            self.state = FAULT_STATES[found]
            self.write_status()
        tenancy = self.tenancy()
        self.turn.keep(now, tenancy, self.vllm.running, self.serving, self.has_kv_cache)
        self.turn.tell(
            tenancy.replica if tenancy else None,
            spec.gpu_memory_utilization if spec else None,
            self.state,
            self.vllm.started_wall,
        )
        self.oom_guard(now)
        self.redact(now)
        self.write_status()

    def redact(self, now):
        """vLLM's compile cache metadata without this node's secrets: often while vLLM starts (it writes
        them while it compiles), then now and then."""
        starting = self.vllm.running and now - (self.vllm.started_at or now) < 900
        if not self.redactions.due(now, 2 if starting else 30):
            return
        for path in redact_compile_factors(self.env(), self.factors_seen):
            say(f"took the secrets out of vLLM's compile cache metadata: {path}")

    def status(self):
        """What status.json says now (a SupervisorStatus, its summary line included)."""
        status = SupervisorStatus(
            node=P.node,
            executor=P.executor,
            state=self.state,
            spec_fingerprint=self.fingerprint,
            vllm_pid=self.vllm.pid,
            serving=self.serving,
            restarts_in_window=len(self.restarts),
            restarts_total=self.restarts.total,
            last_exit=self.last_exit,
            failed=self.failed,
            gpu_busy=self.memory.busy,
            ray_restarts=self.ray.said(),
            oom_guarded=self.memory.oom_guarded,
            turn=self.turn.said(),
            faults=dict(self.watch.faults),
            last_fault=self.watch.last_fault,
        )
        return status.replace(summary=status.summarize())

    def write_status(self):
        status = self.status()
        if status == self.written:
            return
        tmp = f"{STATUS}.tmp"
        with open(tmp, "w") as handle:
            stamped = status.replace(updated=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
            json.dump(stamped.to_json(), handle)
        os.replace(tmp, STATUS)
        self.written = status

    def run(self):
        os.makedirs(RUN, mode=0o700, exist_ok=True)
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: setattr(self, "stopping", True))
        say(f"supervisor up ({P.executor} executor)")
        if P.metrics_port:
            serve_node_metrics(os.environ.get("VLLM_HOST_IP", "127.0.0.1"), P.metrics_port, P.node, self.status)
        while not self.stopping:
            self.step()
            time.sleep(0.5)
        self.stop_vllm("the container is stopping")
        self.turn.close()
        self.ray.stop(P.stop_grace_seconds)
        self.state = VllmState.STOPPED
        self.write_status()
        return 0


sys.exit(Supervisor().run())
