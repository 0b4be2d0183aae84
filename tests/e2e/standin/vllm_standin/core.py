"""The stand-in's engine core: a second process, as real vLLM's ``VLLM::EngineCore`` is.

Real ``vllm serve`` (vLLM 0.25, ``v1/engine/core_client.py``, ``v1/engine/utils.py``) starts its engine
core as a child process in its own process group (no new session), whose command line is no longer
``vllm serve …`` (it is spawned by multiprocessing and renames itself ``VLLM::EngineCore``). The
engine core, or the workers it starts, holds the GPU memory. Seen on an H200 (2026-12-01): after a
``kill -9`` of the API server the engine core kept running with 122 GiB of the GPU, and every later
``vllm serve`` died at start with ``ValueError: Free memory on device cuda:0 (10.2/139.8 GiB) on
startup is less than desired GPU memory utilization (0.9, 125.82 GiB)``.

So this child:

* is started by the API server (``cli.py``) with another command line, stays in its process group,
  names itself ``VLLM::EngineCor`` (``/proc/PID/comm`` holds 15 characters);
* holds memory of "the node's GPUs", which every process of the node sees, whatever its container: a ledger
  ``STANDIN_GPU_DIR/gpu<N>/<pid>.json`` per process holding memory on GPU N, locked (``flock``) by that
  process for as long as it lives, so a dead holder's memory is free at once. Starting, it does what vLLM
  0.25's worker does (vllm/v1/worker/gpu_worker.py, utils.py ``request_memory``, mem_utils.py
  ``memory_profiling``): refuses when the free memory is less than ``--gpu-memory-utilization`` × total
  ("Free memory on device …"); "loads the weights" (the model's weight files' size); profiles (an
  activation peak, for ``STANDIN_PROFILE_SECONDS``), counting every change of the other processes' memory
  since its start as its own, as vLLM does (vLLM issue 55827): the KV cache is the utilization's share less
  weights, activations and that change, "No available memory for the cache blocks" when nothing is left,
  "Error in memory profiling" when the free memory grew meanwhile. With ``--kv-cache-memory-bytes`` it
  skips the profiling and takes that. With Ray, each GPU actor claims its share of the GPU Ray gave it
  (``engine.py``);
* runs the executor (Ray, the multi-node mp executor, or none), "loads the weights", then tells
  the API server it is ready through a pipe, and keeps checking its workers;
* does not notice the API server's death (it keeps running, and the GPU held, after a SIGKILL of its
  parent, as seen); SIGTERM ends it cleanly and frees the GPU.

Environment: ``STANDIN_GPU_DIR`` (default ``/dev/shm/vllm-standin-gpus-<VLLM_HOST_IP>``: with the host's IPC
namespace, as the program's containers have it, every container of a node shares /dev/shm, and the fabric
address keeps the simulated nodes of one machine apart), ``STANDIN_GPU_MEMORY_GIB`` (what one GPU is said
to have, default 139.8, as torch reports an H200), ``STANDIN_ACTIVATION_GIB`` (the profiling's peak, default
1), ``STANDIN_PROFILE_SECONDS`` (default 0.5), and those of ``cli.py``.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import signal
import subprocess
import sys
import threading
import time

from . import compile_cache, log
from .api import fault
from .args import PLAYED, ServeConfig, StandinError, parse_cli, validate

WHERE_CORE = "core.py:708"
WHERE_WORKER = "gpu_worker.py:239"
WHERE_LOADER = "default_loader.py:267"


def loading_line(model: str) -> tuple:
    """The log line (format and its argument) the release played writes as it starts loading the weights."""
    line = PLAYED.loading_line
    return (line, model) if "%s" in line else (line,)


PR_SET_NAME = 15
GIB = 1024**3


def gpu_dir(environ=os.environ) -> str:
    return environ.get("STANDIN_GPU_DIR") or f"/dev/shm/vllm-standin-gpus-{environ.get('VLLM_HOST_IP') or 'local'}"


def gpu_total_gib(environ=os.environ) -> float:
    try:
        return float(environ.get("STANDIN_GPU_MEMORY_GIB") or 139.8)
    except ValueError:
        return 139.8


class GpuShare:
    """What this process holds of one GPU of the node: its entry in the GPU's ledger, locked while it lives."""

    def __init__(self, index: int, environ=os.environ):
        self.index = index
        self.environ = environ
        self.directory = os.path.join(gpu_dir(environ), f"gpu{index}")
        self.handle = None
        self.gib = 0.0

    @property
    def total(self) -> float:
        return gpu_total_gib(self.environ)

    def others(self) -> float:
        """GiB the node's other live processes hold of this GPU (a dead holder's entry is removed)."""
        os.makedirs(self.directory, exist_ok=True)
        held = 0.0
        mine = self.handle.name if self.handle is not None else None
        for name in os.listdir(self.directory):
            path = os.path.join(self.directory, name)
            if path == mine or not name.endswith(".json"):
                continue
            try:
                with open(path) as entry:
                    try:
                        fcntl.flock(entry, fcntl.LOCK_SH | fcntl.LOCK_NB)
                    except OSError:  # its holder lives
                        held += float(json.loads(entry.read() or "{}").get("gib", 0))
                        continue
                    os.unlink(path)  # nobody holds it: a process gone
            except (OSError, ValueError):
                continue
        return held

    def free(self) -> float:
        return max(0.0, self.total - self.others() - self.gib)

    def hold(self, gib: float) -> None:
        if self.handle is None:
            os.makedirs(self.directory, exist_ok=True)
            self.handle = open(os.path.join(self.directory, f"{os.getpid()}-{id(self)}.json"), "w")
            fcntl.flock(self.handle, fcntl.LOCK_EX)
        self.gib = gib
        self.handle.seek(0)
        self.handle.truncate()
        self.handle.write(json.dumps({"pid": os.getpid(), "gib": round(gib, 3)}))
        self.handle.flush()

    def check_start(self, utilization: float) -> float:
        """vLLM's start-up check (vllm/v1/worker/utils.py request_memory): the free memory, or its refusal."""
        free, total = self.free(), self.total
        if free < utilization * total:
            raise StandinError(
                f"ValueError: Free memory on device cuda:{self.index} ({free:.1f}/{total:.1f} GiB) on startup is "
                f"less than desired GPU memory utilization ({utilization}, {utilization * total:.2f} GiB). Decrease "
                "GPU memory utilization or reduce GPU memory used by other processes."
            )
        return free

    def release(self) -> None:
        if self.handle is not None:
            name = self.handle.name
            self.handle.close()  # closing the last descriptor drops the flock
            self.handle = None
            try:
                os.unlink(name)
            except OSError:
                pass


class GpuLock(GpuShare):
    """A Ray GPU actor's share: the start check, then its utilization's share of the GPU, held while it lives."""

    def __init__(self, index: int, utilization: float, environ=os.environ):
        super().__init__(index, environ)
        self.utilization = utilization

    def acquire(self) -> None:
        self.check_start(self.utilization)
        self.hold(self.utilization * self.total)


def snapshot(cfg: ServeConfig, shares: list) -> list[tuple[float, float]]:
    """vLLM's memory snapshot at start, on each of `shares`: (free, the others' memory), or its refusal."""
    return [(share.check_start(cfg.gpu_memory_utilization), share.others()) for share in shares]


def claim_memory(
    cfg: ServeConfig, shares: list, snapshots: list, stop: threading.Event, environ, load_s: float
) -> float | None:
    """What one of vLLM's workers does with its GPU after its snapshot, on each of `shares`: the weights, the
    profiling (or --kv-cache-memory-bytes), the KV cache held. Returns the KV cache's GiB (None: stopped)."""
    utilization = cfg.gpu_memory_utilization
    ranks = max(1, cfg.world_size)
    weights = cfg.weights_gib / ranks
    for share in shares:
        share.hold(weights)
    log.info(WHERE_LOADER, *loading_line(cfg.model))
    started = time.monotonic()
    if stop.wait(load_s):
        return None
    took = time.monotonic() - started
    log.info(WHERE_LOADER, "Loading weights took %.2f seconds", took)
    log.info("gpu_model_runner.py:2007", "Model loading took %.4f GiB and %.6f seconds", weights, took)
    activation = _env_float(environ, "STANDIN_ACTIVATION_GIB", 1.0)
    for share in shares:
        share.hold(weights + activation)
    if cfg.kv_cache_memory_bytes:
        kv = cfg.kv_cache_memory_bytes / GIB
        free = snapshots[0][0]
        log.info(
            "gpu_worker.py:453",
            "Initial free memory %.2f GiB, reserved %.2f GiB memory for KV Cache as specified by kv_cache_memory_bytes "
            "config and skipped memory profiling. This does not respect the gpu_memory_utilization config. Only use "
            "kv_cache_memory_bytes config when you want manual control of KV cache memory size.",
            free,
            kv,
        )
    else:
        if stop.wait(_env_float(environ, "STANDIN_PROFILE_SECONDS", 0.5)):
            return None
        kv = None
        for share, (free_at_start, others_at_start) in zip(shares, snapshots, strict=True):
            others = share.others()
            free_now = max(0.0, share.total - others - share.gib)
            if free_now > free_at_start:  # a neighbour gave memory back while this one profiled
                raise StandinError(
                    f"AssertionError: Error in memory profiling. Initial free memory {free_at_start:.2f} GiB, current "
                    f"free memory {free_now:.2f} GiB. This happens when other processes sharing the same container "
                    "release GPU memory while vLLM is profiling during initialization. To fix this, ensure "
                    "consistent GPU memory allocation or isolate vLLM in its own container."
                )
            # every change of the others' memory since the start counts as this one's (non-torch) increase
            available = utilization * share.total - weights - activation - (others - others_at_start)
            kv = available if kv is None else min(kv, available)
        log.info("gpu_worker.py:541", "Available KV cache memory: %.2f GiB", kv)
        if kv <= 0:
            raise StandinError(
                "ValueError: No available memory for the cache blocks. Try increasing `gpu_memory_utilization` when "
                "initializing the engine."
            )
    for share in shares:
        share.hold(weights + activation + kv)
    return kv


def set_process_name(name: str) -> None:
    """What `ps -o comm` and /proc/PID/comm show, as vLLM's setproctitle does."""
    try:
        ctypes.CDLL(None).prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass


# -- the API server's side -------------------------------------------------------------------------


class EngineCoreClient:
    """What the API server holds of its engine core: the child process and the ready pipe."""

    def __init__(self, argv: list[str], environ):
        read_end, write_end = os.pipe()
        package_parent = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        bootstrap = (
            f"import sys; sys.path.insert(0, {package_parent!r}); from vllm_standin.core import main; sys.exit(main())"
        )
        # The command line as vLLM's spawned child has it (no `vllm serve`); the arguments travel in the env.
        env = {**environ, "STANDIN_CORE_FD": str(write_end), "STANDIN_CORE_ARGV": json.dumps(argv)}
        # Not a new session: the engine core stays in the API server's process group, as in vLLM.
        self.process = subprocess.Popen(
            [sys.executable, "-c", bootstrap, "--multiprocessing-fork"],
            env=env,
            pass_fds=(write_end,),
            stdin=subprocess.DEVNULL,
        )
        os.close(write_end)
        self.ready_pipe = os.fdopen(read_end, "r")

    @property
    def pid(self) -> int:
        return self.process.pid

    def wait_ready(self, stop: threading.Event) -> bool:
        """True once the engine core said it is ready; False when it died (or we were told to stop)."""
        result = {"line": ""}

        def read():
            result["line"] = self.ready_pipe.readline()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        while reader.is_alive():
            if stop.is_set():
                return False
            reader.join(0.2)
        return result["line"].strip() == "ready"

    def follow_steps(self, stepped) -> None:
        """Calls `stepped()` for each step the engine core tells (after its "ready"), from a thread of its own."""

        def read():
            while self.ready_pipe.read(1):
                stepped()

        threading.Thread(target=read, name="engine-steps", daemon=True).start()

    def alive(self) -> bool:
        return self.process.poll() is None

    def shutdown(self, grace: float = 5.0) -> None:
        if self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


# -- the engine core process -----------------------------------------------------------------------


def _env_float(environ, name: str, default: float) -> float:
    raw = environ.get(name)
    try:
        return float(raw) if raw not in (None, "") else default
    except ValueError:
        raise StandinError(f"{name} must be a number, got {raw!r}") from None


def local_gpus_used(cfg: ServeConfig) -> int:
    """GPUs this node's ranks use when the engine core (or its mp workers) holds them itself."""
    if cfg.backend == "ray":
        return 0  # the Ray actors hold theirs
    return max(1, cfg.world_size // cfg.nnodes)


def main(argv: list[str] | None = None, environ=os.environ) -> int:
    argv = json.loads(environ["STANDIN_CORE_ARGV"]) if argv is None else argv
    set_process_name("VLLM::EngineCore")
    log.set_prefix(f"(EngineCore pid={os.getpid()}) ")  # vLLM 0.25 (seen on the H200)
    ready_fd = int(environ["STANDIN_CORE_FD"])
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    shares: list[GpuShare] = []
    engine = None
    try:
        cfg = validate(parse_cli(argv), environ)
        load_s = _env_float(environ, "STANDIN_LOAD_SECONDS", 2.0)
        placement_s = _env_float(environ, "VLLM_PLACEMENT_TIMEOUT_S", 60.0)
        ping_timeout_s = _env_float(environ, "STANDIN_PING_TIMEOUT_S", 5.0)
        shares = [GpuShare(index, environ) for index in range(local_gpus_used(cfg))]
        snapshots = snapshot(cfg, shares)
        if cfg.backend == "ray":
            from .engine import RayEngine

            engine = RayEngine(cfg, environ)
            engine.start(stop, placement_s)
            signal.signal(signal.SIGTERM, lambda *_: stop.set())  # ray.init may install its own
        elif cfg.nnodes > 1:
            from .mp import MpEngine

            engine = MpEngine(cfg, environ)
            engine.start(stop, _env_float(environ, "STANDIN_JOIN_TIMEOUT_S", 120.0))
        if stop.is_set():
            return 0
        if shares and claim_memory(cfg, shares, snapshots, stop, environ, load_s if not cfg.headless else 0) is None:
            return 0
        if not shares and not cfg.headless:  # with Ray the actors hold the GPUs; the weights load as before
            log.info(WHERE_LOADER, *loading_line(cfg.model))
            started = time.monotonic()
            if stop.wait(load_s):
                return 0
            log.info(WHERE_LOADER, "Loading weights took %.2f seconds", time.monotonic() - started)
            if cfg.kv_cache_memory_bytes:  # the workers take what they are told, as on one node
                log.info(
                    "gpu_worker.py:453",
                    "Initial free memory %.2f GiB, reserved %.2f GiB memory for KV Cache as specified by "
                    "kv_cache_memory_bytes config and skipped memory profiling.",
                    gpu_total_gib(environ),
                    cfg.kv_cache_memory_bytes / GIB,
                )
            else:
                available = max(0.0, cfg.gpu_memory_utilization * gpu_total_gib(environ) - 3.0)
                log.info("gpu_worker.py:541", "Available KV cache memory: %.2f GiB", available)
        if not cfg.headless:
            log.info("kv_cache_utils.py:1087", "GPU KV cache size: %d tokens", cfg.max_model_len * 4)
            log.info(
                "kv_cache_utils.py:1091", "Maximum concurrency for %d tokens per request: 4.00x", cfg.max_model_len
            )
        if cfg.backend != "ray":  # the engine core is the worker (uniproc), or stands for its node's ranks (mp)
            rank = cfg.node_rank * max(1, cfg.world_size // cfg.nnodes)
            compiled = compile_cache.compile_graph(rank, compile_cache.model_factors(cfg), environ)
            for where, message in compile_cache.compile_lines(compiled):
                log.info(where, "%s", message)
        ready = os.fdopen(ready_fd, "w")
        ready.write("ready\n")
        ready.flush()
        if cfg.headless:  # no API server reads its steps
            ready.close()
            ready = None
        return _run(engine, stop, ping_timeout_s, ready, environ)
    except StandinError as e:
        log.error(WHERE_CORE, "EngineCore failed to start.")
        log.error(WHERE_WORKER, "%s", e)
        return 1
    finally:
        if engine is not None:
            engine.shutdown()
        for share in shares:
            share.release()


STEP_SECONDS = 0.05


def _run(engine, stop: threading.Event, timeout_s: float, steps=None, environ=os.environ) -> int:
    """Serve until SIGTERM: an engine step every STEP_SECONDS, each told to the API server (`steps`, the pipe it
    reads: its requests advance only while the engine steps, as vLLM's outputs come only from steps). With mp
    across nodes each step is a collective over every rank (mp.py MpEngine.step). With Ray the actors are asked
    every second; one that does not answer within `timeout_s` (stopped, or its node unreachable) holds every step
    until it answers or Ray says it died, as vLLM's execute_model waits on its workers with no health check of its
    own (v1/executor/ray_executor.py check_health: "Assume that the Ray workers are healthy", 0.25.0): the engine
    hangs and only the supervisor's stall watch ends it. No step while the "hang" fault is on (api.py fault), nor
    while this process is stopped. Exit 1 when the workers (Ray actors, another node's rank) go away."""
    next_ping = 0.0
    while not stop.wait(STEP_SECONDS):
        if fault(environ) == "hang":
            continue
        if getattr(engine, "collective", False):
            try:
                if not engine.step(stop):
                    continue
            except Exception as e:  # noqa: BLE001 - a rank gone
                log.error(WHERE_CORE, "EngineCore encountered a fatal error: a worker node died (%s).", e)
                return 1
        _tell(steps)
        if engine is None or getattr(engine, "collective", False) or time.monotonic() < next_ping:
            continue
        next_ping = time.monotonic() + 1.0
        if not _workers_answer(engine, stop, timeout_s):
            log.error(
                WHERE_CORE,
                "EngineCore encountered a fatal error: a RayWorkerWrapper actor died or stopped responding.",
            )
            return 1
    return 0


def _workers_answer(engine, stop: threading.Event, timeout_s: float) -> bool:
    """Ask the Ray actors until they answer (True) or one is dead (False); no step meanwhile. A SIGTERM while
    waiting ends the wait (True: the caller's loop then stops)."""
    while not stop.is_set():
        try:
            engine.ping(timeout_s)
            return True
        except Exception as e:  # noqa: BLE001 - a timeout is waited out, a death ends the engine
            if engine.is_actor_death(e):
                return False
    return True


def _tell(steps) -> None:
    """One step to the API server; one gone (a SIGKILLed API server) goes unnoticed, as in vLLM."""
    if steps is None:
        return
    try:
        steps.write(".")
        steps.flush()
    except (OSError, ValueError):
        pass
