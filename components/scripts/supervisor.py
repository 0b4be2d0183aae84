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
import collections
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

from components.scripts.node_compile_cache import redact_compile_factors
from components.scripts.node_contract import SupervisorParams, SupervisorStatus, VllmSpec, VllmState
from components.scripts.node_gpu_turn import (
    GpuTurn,
    Tenant,
    TurnDirectoryError,
    describe_holder,
    hold_limit,
    turn_directory,
    turn_wait_bound,
)
from components.scripts.node_gpus import gpu_memory, unified_memory, visible_gpus
from components.scripts.node_log import speak_with
from components.scripts.node_memory_waits import MemoryWaits
from components.scripts.node_metrics import serve_node_metrics
from components.scripts.node_processes import Tree, describe, process_name, stop_group
from components.scripts.node_vllm_output import GPU_BUSY_MESSAGE, error_line, exit_reason, memory_refusal, start_refusal
from components.scripts.node_vllm_watch import VllmWatch

P = SupervisorParams.from_json(json.loads(sys.argv[1]))  # what the container is (node_contract.py)
RUN = P.run_dir
SPEC, STATUS, LOG = f"{RUN}/spec.json", f"{RUN}/status.json", f"{RUN}/vllm.log"
# What vLLM is, from the serve step's spec: argv, env, fingerprint, recovery (max_restarts,
# window_seconds, backoff_seconds, max_backoff_seconds, gpu_wait_seconds: the stack's `recovery` keys,
# every one rendered by components.plan.container.supervisor_spec, so their defaults live in the config alone),
# health_url (the head), ray_ready (the Ray head: {address, nodes, gpus}). In the spec, not the
# container, so that changing them (a node added, another port) touches no container.
# Ray's `ray start --block` drains "for up to 30 s" on SIGTERM. By then vLLM is stopped and there is
# nothing to drain; a head whose workers were already gone waited the whole 30 s in the rehearsal
# (its container's delete took 31.7 s of a 39.7 s destroy). A single node drains in 0.5 s (H200).
RAY_STOP_GRACE_SECONDS = 5
LEFTOVER_GRACE_SECONDS = 2  # after vLLM exited: what it left behind gets SIGTERM, then SIGKILL after this
# The GPU's other processes changing their memory by more than this while vLLM started: its memory refusal is
# theirs to answer for (a neighbour starting, stopping or growing), not a refusal of its own settings.
DISTURBED_MIB = 1024
ENGINE_CORE = "VLLM::EngineCor"  # vLLM's engine core (VLLM::EngineCore, VLLM::EngineCore_DP0…) as /proc's comm has it
TURN_HOLD_SECONDS = 1800  # vllm.readyTimeoutSeconds' default, for a single-model stack's spec that names none
# A rank without an API server (mp, --headless) has what the turn protects once its workers have their KV cache
KV_CACHE_LINES = ("Available KV cache memory", "memory for KV Cache as specified", "GPU KV cache size")
RAY_CHECK = """
import json, ray
ray.init(address={address!r}, logging_level="ERROR", log_to_driver=False)
alive = [n for n in ray.nodes() if n.get("Alive")]
print(json.dumps({{"nodes": len(alive), "gpus": sum(n.get("Resources", {{}}).get("GPU", 0) for n in alive)}}))
"""


def mark(message):
    """A line of vLLM's log from the supervisor, with the time as vLLM's own lines have it (local time:
    UTC in a container): `=== spark-vllm: 12-02 03:04:05 vLLM started (pid 7)`."""
    return f"=== spark-vllm: {time.strftime('%m-%d %H:%M:%S')} {message}\n"


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


class Supervisor(MemoryWaits, VllmWatch):
    def __init__(self):
        self.params, self.run_dir = P, RUN  # what VllmWatch (node_vllm_watch.py) reads
        self.stopping = False
        self.ray = None
        self.ray_restarts = 0
        self.ray_next = 0.0
        self.vllm = None
        self.tree = None  # everything the running (or last) vLLM started
        self.log_start = 0  # where the running vLLM's output begins in LOG
        self.next_remember = 0.0
        self.gpu_busy_since = None  # since when the GPUs lack what vLLM asks for
        self.gpu_busy = None  # what is short and who holds it, for status.json
        self.next_gpu_check = 0.0
        self.gpu_note = 0.0
        self.fingerprint = None  # the settings vLLM runs (or should run) with
        self.exits = collections.deque()  # times of exits within the window
        self.restarts_total = 0
        self.next_start = 0.0
        self.failed = None
        self.last_exit = None
        self.started_at = None
        self.serving = False
        self.served_since_start = False  # a refusal at start is told from a crash after serving
        self.next_oom_check = 0.0
        self.oom_guarded = 0  # times memory.oomGuard ended vLLM
        self.next_probe = 0.0
        self.next_ray_check = 0.0
        self.spec = None
        self.ray_ready = False
        self.state = VllmState.NO_SETTINGS
        self.written = None
        self.guard_seen = False
        self.guard_note = 0.0
        self.factors_seen = {}  # vLLM's compile cache metadata looked at: path -> (mtime, size)
        self.next_redact = 0.0
        self.turn_problem = None  # the turn's directory refused: no vLLM starts (status.json says why)
        directory = turn_dir()
        try:
            turn_directory(directory)
        except TurnDirectoryError as refused:
            self.turn_problem, directory = str(refused), f"{RUN}/gpu-turn-refused"  # a turn of its own, never taken
        self.turn = GpuTurn(directory)
        self.tenant = Tenant(directory)  # what this supervisor tells its neighbours on the node
        self.turn_waiting = None  # since when this supervisor waits for the node's GPU turn
        self.turn_holder = None  # who holds it meanwhile, as it answered
        self.turn_holder_limit = None  # how long it may hold it, as it answered
        self.turn_overdue = None  # started without the turn: its holder kept it past its limit (why, for status.json)
        self.turn_note = 0.0
        self.turn_kept = False  # the turn held from vLLM's start until now (not given back at the hold limit)
        self.next_turn_check = 0.0
        self.others_at_start = None  # MiB the GPU's other processes held when vLLM started (None: unknown)
        self.quiet_refusals = 0  # memory refusals in a row with the GPU otherwise quiet
        self.started_wall = None  # wall-clock time of vLLM's last start
        self.engine_seen = False  # this start of vLLM has had an engine core (a headless rank never has)
        self.engine_gone_at = None  # since when it has none
        self.ended_why = None  # why the supervisor itself ended vLLM, for its exit record
        self.faults = {}  # Fault kind -> times vLLM was ended for it (node_vllm_watch.py)
        self.last_fault = None
        self.watch_reset()

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
        elif now >= self.guard_note:
            say("waiting for network.guard's rules (container spark-vllm.guard) before starting anything")
            self.guard_note = now + 30
        return self.guard_seen

    @property
    def recovery(self):
        return self.spec.recovery  # read only while there are settings

    # -- Ray -----------------------------------------------------------------------------------
    def keep_ray(self, now):
        if not P.ray_argv:
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
            self.ray = subprocess.Popen(P.ray_argv, stdin=subprocess.DEVNULL, start_new_session=True)
            say(f"Ray started (pid {self.ray.pid}): {' '.join(P.ray_argv[:3])} …")

    def cluster_formed(self, now):
        """The Ray head waits for every node and the GPUs before it starts vLLM."""
        wanted = self.spec.ray_ready if self.spec else None
        if self.ray_ready or not wanted:
            return True
        if now < self.next_ray_check:
            return False
        self.next_ray_check = now + 2
        try:
            result = subprocess.run(
                [sys.executable, "-c", RAY_CHECK.format(address=wanted.address)],
                capture_output=True,
                text=True,
                timeout=60,
            )
            found = json.loads(result.stdout.strip().splitlines()[-1])
        except (subprocess.TimeoutExpired, ValueError, IndexError, OSError):
            return False
        self.ray_ready = found["nodes"] >= wanted.nodes and found["gpus"] >= wanted.gpus
        return self.ray_ready

    # -- vLLM ----------------------------------------------------------------------------------
    def start_vllm(self, spec, now):
        env = dict(os.environ)
        env.update(spec.env)
        try:
            self.log_start = os.path.getsize(LOG)
        except OSError:
            self.log_start = 0
        with open(LOG, "ab", buffering=0) as log:
            log.write(mark(f"starting {' '.join(spec.argv)}").encode())
            self.vllm = subprocess.Popen(
                spec.argv,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd="/",
                start_new_session=True,  # its own process group: stopped as a whole
            )
        self.tree = Tree(self.vllm.pid)
        self.next_remember = now
        self.engine_seen, self.engine_gone_at, self.ended_why = False, None, None
        self.watch_reset()
        with open(f"{RUN}/vllm.pid", "w") as handle:
            handle.write(str(self.vllm.pid))
        self.started_at = now
        self.started_wall = time.time()  # what its neighbours are told: a start of theirs meanwhile disturbs this one
        self.next_redact = min(self.next_redact, now + 2)  # vLLM writes the metadata while it starts
        self.serving = False
        self.served_since_start = False
        self.state = VllmState.STARTING
        self.turn_kept = self.turn.held
        say(f"vLLM started (pid {self.vllm.pid})")

    # -- the node's GPU turn --------------------------------------------------------------------
    def tenancy(self):
        return self.spec.tenancy if self.spec else None

    def take_turn(self, now):
        """Whether vLLM may start now: this supervisor holds the node's GPU turn (node_gpu_turn.py), or its holder
        kept it past the longest any supervisor of the stack may (a holder stopped or hung: not worth waiting for)."""
        if self.turn_problem:
            self.failed, self.state = f"vLLM is not started: {self.turn_problem}", VllmState.FAILED
            say(self.failed)
            return False
        tenancy = self.tenancy()
        limit = tenancy.turn_hold_seconds if tenancy else TURN_HOLD_SECONDS
        identity = {"node": P.node, "replica": tenancy.replica if tenancy else None, "why": "starting vLLM",
                    "hold_seconds": limit}  # fmt: skip
        if self.turn.take(identity):
            if self.turn_waiting is not None:
                say(f"took the node's GPU turn after waiting {now - self.turn_waiting:.0f} s for {self.turn_holder}")
            self.turn_waiting, self.turn_holder, self.turn_overdue = None, None, None
            return True
        if self.turn_waiting is None:
            self.turn_waiting, self.turn_note = now, 0.0
        self.gpu_busy_since, self.gpu_busy = None, None  # memory a neighbour takes while it starts is not a busy GPU
        if now >= self.turn_note:
            holder = self.turn.holder()
            self.turn_holder = describe_holder(holder)
            self.turn_holder_limit = hold_limit(holder)
            say(
                f"waiting for the node's GPU turn ({now - self.turn_waiting:.0f} s): held by {self.turn_holder}; "
                "vLLMs sharing a GPU start one at a time, so that none counts another's memory as its own"
            )
            self.turn_note = now + 30
        bound = turn_wait_bound(max(limit, self.turn_holder_limit or 0))
        if now - self.turn_waiting > bound:
            if self.turn_overdue is None:
                self.turn_overdue = (
                    f"{self.turn_holder} kept the node's GPU turn over {bound:.0f} s, longer than any supervisor of "
                    "this stack may: vLLM starts without it"
                )
                say(self.turn_overdue)
            return True
        self.state = VllmState.WAITING_TURN
        return False

    def keep_turn(self, now):
        """Answers who holds the turn; gives it back once vLLM serves (a rank without an API server: once its
        KV cache is allocated), when it is gone, or at the hold limit."""
        if not self.turn.held:
            return
        self.turn.answer()
        if self.vllm is None:
            self.give_turn_back("vLLM is not running")
            return
        if now < self.next_turn_check:
            return
        self.next_turn_check = now + 1
        tenancy = self.tenancy()
        limit = tenancy.turn_hold_seconds if tenancy else TURN_HOLD_SECONDS
        if self.serving:
            self.give_turn_back("vLLM serves")
        elif not (self.spec and self.spec.health_url) and any(
            line in self.output_since_start() for line in KV_CACHE_LINES
        ):
            self.give_turn_back("this rank has its KV cache")
        elif now - self.turn.since > limit:
            self.turn_kept = False
            self.give_turn_back(f"vLLM did not serve within {limit:g} s of taking it (vllm.readyTimeoutSeconds)")

    def tell_neighbours(self):
        """What the node's other supervisors learn of this one when the GPU's memory is in question."""
        tenancy = self.tenancy()
        self.tenant.tell(
            {
                "node": P.node,
                "replica": tenancy.replica if tenancy else None,
                "gpu_memory_utilization": self.spec.gpu_memory_utilization if self.spec else None,
                "state": self.state,
                "started": self.started_wall,
            }
        )

    def give_turn_back(self, why):
        if self.turn.held:
            self.turn.give_back()
            say(f"gave the node's GPU turn back: {why}")

    def turn_said(self):
        """status.json's `turn`: held, waiting (for whom), started without it (why), or None."""
        if self.turn.held:
            return "held"
        if self.turn_overdue:
            return f"without: {self.turn_overdue}"
        return f"waiting: held by {self.turn_holder}" if self.turn_waiting is not None else None

    def others_memory(self):
        """MiB that processes other than this vLLM hold of the GPUs it uses (of a GB10's memory: MemTotal less
        MemAvailable), with none of this vLLM's running; None where nothing can tell."""
        gpus = gpu_memory(visible_gpus({**os.environ, **(self.spec.env if self.spec else {})}))
        if gpus:
            return sum(total - free for _, total, free in gpus)
        unified = unified_memory()
        return None if unified is None else unified[0] - unified[1]

    def memory_refused(self, now, refused):
        """vLLM did not get its memory while it started (MEMORY_REFUSALS). Another process on the GPU that changed
        its memory meanwhile caused it: start again once the turn is free, not counted. With the GPU otherwise
        quiet, once more; a second time is a refusal of these settings, said with what the neighbours hold."""
        others = self.others_memory()
        changed = None if others is None or self.others_at_start is None else others - self.others_at_start
        recovery = self.recovery
        busy = self.busy_neighbours()
        if not self.turn_kept or busy or (changed is not None and abs(changed) > DISTURBED_MIB):
            self.quiet_refusals = 0
            if changed is not None and abs(changed) > DISTURBED_MIB:
                was, now_gib = self.others_at_start / 1024, others / 1024
                what = f"the GPU's other processes went from {was:.1f} to {now_gib:.1f} GiB"
            elif busy:
                what = f"{', '.join(busy)} meanwhile"
            else:
                what = "it started without the node's GPU turn for all of its start"
            self.next_start = now + recovery.backoff_seconds
            self.state = VllmState.BACKOFF
            say(
                f"vLLM did not get its memory while it started, and {what}: that is another process's doing, not a "
                f"refusal of its settings; starting it again once the GPU turn is free, not counted as a crash "
                f"({refused})"
            )
            return
        self.quiet_refusals += 1
        if self.quiet_refusals < 2:
            self.next_start = now + recovery.backoff_seconds
            self.state = VllmState.BACKOFF
            say(
                "vLLM did not get its memory while it started, with the GPU otherwise quiet; once more before "
                f"calling it a refusal of its settings ({refused})"
            )
            return
        self.failed = self.quiet_refusal_reason(refused, others)
        self.state = VllmState.FAILED
        say(self.failed)

    def busy_neighbours(self):
        """The node's other replicas that started, or were starting, stopping or waiting, while this vLLM started:
        their memory moved under its profiling (what they tell: node_gpu_turn.py Tenant)."""
        found = []
        for neighbour in self.tenant.neighbours():
            who = neighbour.get("replica") or "another vLLM"
            started = neighbour.get("started")
            if self.started_wall is not None and started is not None and started >= self.started_wall - 1:
                found.append(f"{who} started")
            elif neighbour.get("state") in (VllmState.STARTING, VllmState.BACKOFF):  # loading, or just gone: it moved
                found.append(f"{who} was {neighbour['state']}")
        return found

    def quiet_refusal_reason(self, refused, others):
        """Why vLLM will not start, said so that no advice takes memory a neighbour holds (or would need)."""
        fraction = self.spec.gpu_memory_utilization if self.spec else None
        neighbours = [n for n in self.tenant.neighbours() if n.get("gpu_memory_utilization")]
        head = f"vLLM refused to start twice in a row with the GPU otherwise quiet: {refused} — "
        gpus = gpu_memory(visible_gpus({**os.environ, **(self.spec.env if self.spec else {})}))
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

    def stop_vllm(self, why, grace=None):
        """SIGTERM to everything vLLM started, the grace, SIGKILL to what is left."""
        if self.vllm is not None:
            if self.vllm.poll() is None:
                say(f"stopping vLLM (pid {self.vllm.pid}): {why}")
            self.tree.remember()
            if not self.tree.end(P.stop_grace_seconds if grace is None else grace, reap=self.vllm.poll):
                say(f"vLLM's processes outlived SIGKILL: {', '.join(describe(p) for p in sorted(self.tree.alive()))}")
            self.vllm.poll()
        self.vllm = None
        self.serving = False

    def end_leftovers(self):
        """After vLLM's main process exited: what it started may live on (the engine core keeps the
        GPU when the API server is SIGKILLed); end all of it before anything starts again."""
        left = sorted(self.tree.alive()) if self.tree is not None else []
        if not left:
            return
        say(f"vLLM's main process is gone; ending what it left running: {', '.join(describe(p) for p in left)}")
        if not self.tree.end(LEFTOVER_GRACE_SECONDS):
            say(f"still running after SIGKILL: {', '.join(describe(p) for p in sorted(self.tree.alive()))}")

    def watch_engine(self, now, alive):
        """Ends vLLM once its engine core has been gone for stop_grace_seconds while the API server lives on
        (`alive`: vLLM's processes now): the next step reads that as vLLM's exit (its reason from the log, a
        restart, the crash-loop count)."""
        if any(process_name(pid).startswith(ENGINE_CORE) for pid in alive):
            self.engine_seen, self.engine_gone_at = True, None
            return
        if not self.engine_seen:
            return
        if self.engine_gone_at is None:
            self.engine_gone_at = now
        elif now - self.engine_gone_at >= P.stop_grace_seconds:
            say(
                f"vLLM's engine core exited {now - self.engine_gone_at:.0f} s ago and its API server (pid "
                f"{self.vllm.pid}) did not follow: ending what is left of vLLM"
            )
            self.engine_seen, self.ended_why = False, "its engine core exited and its API server did not follow"
            self.tree.end(P.stop_grace_seconds, reap=self.vllm.poll)

    def output_since_start(self):
        try:
            with open(LOG, "rb") as handle:
                handle.seek(self.log_start)
                return handle.read().decode(errors="replace")
        except OSError:
            return ""

    def vllm_exited(self, now):
        code = self.vllm.returncode
        self.vllm = None
        self.serving = False
        self.end_leftovers()
        # A node of the group may be what went away: the next start waits for Ray to be whole again.
        self.ray_ready = False
        output = self.output_since_start()
        error = exit_reason(code, output)
        if self.ended_why:  # the supervisor ended it
            error, self.ended_why = f"{self.ended_why}; its log's last error: {error_line(output) or 'none'}", None
        self.last_exit = {"code": code, "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "error": error}
        recovery = self.recovery
        if GPU_BUSY_MESSAGE in output:
            self.give_turn_back("vLLM exited")
            # Not a crash: the GPU was not free yet (a process still releasing it). Wait and try again.
            self.next_start = now + recovery.backoff_seconds
            self.gpu_busy = f"vLLM refused to start: {error}"
            say(f"vLLM could not start because the GPU is still busy; not counted as a crash ({error})")
            self.gpu_wait(now, self.gpu_busy)
            return
        refused = "" if self.served_since_start else memory_refusal(output)
        self.give_turn_back("vLLM exited")
        if refused:
            self.memory_refused(now, refused)
            return
        refusal = "" if self.served_since_start else start_refusal(output)
        if refusal:
            # Not a crash to recover from: vLLM refuses these settings and would refuse them again.
            self.failed = (
                f"vLLM refused its settings while starting, and would refuse them again at every restart, so it "
                f"is not restarted: {refusal} — change the setting it names (`pulumi up` hands vLLM the new "
                "settings and it starts again)"
            )
            self.state = VllmState.FAILED
            say(self.failed)
            return
        window = recovery.window_seconds
        self.exits.append(now)
        while self.exits and now - self.exits[0] > window:
            self.exits.popleft()
        if len(self.exits) > recovery.max_restarts:
            self.failed = (
                f"vLLM exited {len(self.exits)} times within {window} s (recovery.maxRestarts "
                f"{recovery.max_restarts}): not starting it again. Last exit code {code}: {error}"
            )
            self.state = VllmState.FAILED
            say(self.failed)
            return
        delay = min(recovery.backoff_seconds * 2 ** (len(self.exits) - 1), recovery.max_backoff_seconds)
        self.next_start = now + delay
        self.restarts_total += 1
        self.state = VllmState.BACKOFF
        say(
            f"vLLM exited with code {code} ({error}); starting it again in {delay:g} s "
            f"({len(self.exits)} of {recovery.max_restarts} restarts within {window} s)"
        )

    def follow_spec(self, now):
        spec = read_spec()
        self.spec = spec
        wanted = spec.fingerprint if spec else None
        if wanted != self.fingerprint:
            if self.fingerprint is not None:
                self.stop_vllm("new settings" if wanted else "settings removed")
            self.fingerprint = wanted
            self.exits.clear()
            self.failed = None
            self.quiet_refusals = 0
            self.gpu_busy_since, self.gpu_busy = None, None
            self.next_start = now
            self.state = VllmState.NO_SETTINGS if wanted is None else VllmState.STARTING
        return spec

    def probe(self, now):
        url = self.spec.health_url if self.spec else None
        if not url or self.vllm is None or now < self.next_probe:
            return
        self.next_probe = now + (1 if self.turn.held else 5)  # the node's other replicas wait on this one serving
        try:
            with urllib.request.urlopen(url, timeout=3) as response:
                self.serving = response.status == 200
        except (urllib.error.URLError, OSError, ValueError):
            self.serving = False
        if self.serving:
            self.served_since_start = True
            self.quiet_refusals = 0
            if not self.pending_fault:  # a vLLM found stalled answers /health until it is ended
                self.state = VllmState.RUNNING
            self.gpu_busy_since, self.gpu_busy = None, None

    def step(self):
        now = time.monotonic()
        if not self.guarded(now):
            self.state = VllmState.WAITING_GUARD
            self.write_status()
            return
        self.keep_ray(now)
        spec = self.follow_spec(now)
        if self.vllm is not None and self.vllm.poll() is not None:
            self.vllm_exited(now)
        elif self.vllm is not None and now >= self.next_remember:
            alive = self.tree.remember()  # so that a SIGKILLed API server's children are still known
            self.next_remember = now + (0.5 if now - self.started_at < 60 else 2)
            self.watch_engine(now, alive)
        if spec and self.vllm is None and not self.failed:
            formed = self.cluster_formed(now)  # asked during the backoff too: the query overlaps the wait
            now = time.monotonic()
            if now >= self.next_start:
                if not formed:
                    self.state = VllmState.WAITING_RAY
                elif self.take_turn(now):
                    if self.gpu_ready(spec, now):
                        self.others_at_start = self.others_memory()
                        self.start_vllm(spec, now)
                    else:  # waiting for memory held elsewhere: the turn is another replica's meanwhile
                        self.turn.give_back()
        if (
            self.vllm is not None
            and not (spec and spec.health_url)
            and now - (self.started_at or now) > 5
            and not self.pending_fault
        ):
            self.state = VllmState.RUNNING  # a headless rank: alive is all it can say
        self.probe(now)
        self.watch_vllm(now)
        self.keep_turn(now)
        self.tell_neighbours()
        self.oom_guard(now)
        self.redact(now)
        self.write_status()

    def redact(self, now):
        """vLLM's compile cache metadata without this node's secrets: often while vLLM starts (it writes
        them while it compiles), then now and then."""
        if now < self.next_redact:
            return
        starting = self.vllm is not None and now - (self.started_at or now) < 900
        self.next_redact = now + (2 if starting else 30)
        env = {**os.environ, **(self.spec.env if self.spec else {})}
        for path in redact_compile_factors(env, self.factors_seen):
            say(f"took the secrets out of vLLM's compile cache metadata: {path}")

    def write_status(self):
        status = SupervisorStatus(
            node=P.node,
            executor=P.executor,
            state=self.state,
            spec_fingerprint=self.fingerprint,
            vllm_pid=self.vllm.pid if self.vllm is not None else None,
            serving=self.serving,
            restarts_in_window=len(self.exits),
            restarts_total=self.restarts_total,
            last_exit=self.last_exit,
            failed=self.failed,
            gpu_busy=self.gpu_busy,
            ray_restarts=self.ray_restarts if P.ray_argv else None,
            oom_guarded=self.oom_guarded,
            turn=self.turn_said(),
            faults=dict(self.faults),
            last_fault=self.last_fault,
        )
        if status == self.written:
            return
        tmp = f"{STATUS}.tmp"
        with open(tmp, "w") as handle:
            stamped = dataclasses.replace(status, updated=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
            json.dump(stamped.to_json(), handle)
        os.replace(tmp, STATUS)
        self.written = status

    def run(self):
        os.makedirs(RUN, mode=0o700, exist_ok=True)
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, lambda *_: setattr(self, "stopping", True))
        say(f"supervisor up ({P.executor} executor)")
        if P.metrics_port:
            serve_node_metrics(os.environ.get("VLLM_HOST_IP", "127.0.0.1"), P.metrics_port, P.node, self)
        while not self.stopping:
            self.step()
            time.sleep(0.5)
        self.stop_vllm("the container is stopping")
        self.turn.give_back()
        self.tenant.close()
        if self.ray is not None:
            stop_group(self.ray, min(P.stop_grace_seconds, RAY_STOP_GRACE_SECONDS))
        self.state = VllmState.STOPPED
        self.write_status()
        return 0


sys.exit(Supervisor().run())
