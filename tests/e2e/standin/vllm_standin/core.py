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
* holds "the node's GPUs": an exclusive ``flock`` on ``STANDIN_GPU_DIR/gpu<N>.lock`` for each GPU of
  this node that a rank uses (with Ray, each GPU actor holds the lock of the GPU Ray gave it,
  ``engine.py``); a lock that is held makes a new start fail with vLLM's message above;
* runs the executor (Ray, the multi-node mp executor, or none), "loads the weights", then tells
  the API server it is ready through a pipe, and keeps checking its workers;
* does not notice the API server's death (it keeps running, and the GPU held, after a SIGKILL of its
  parent, as seen); SIGTERM ends it cleanly and frees the GPU.

Environment: ``STANDIN_GPU_DIR`` (default ``/run/vllm-standin-gpus``), ``STANDIN_GPU_MEMORY_GIB``
(what one GPU is said to have, default 139.8, as torch reports an H200), and those of ``cli.py``.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import json
import os
import signal
import subprocess
import sys
import threading
import time

from . import compile_cache, log
from .args import ServeConfig, StandinError, parse_cli, validate

WHERE_CORE = "core.py:708"
WHERE_WORKER = "gpu_worker.py:239"
WHERE_LOADER = "default_loader.py:267"
PR_SET_NAME = 15
DEFAULT_GPU_DIR = "/run/vllm-standin-gpus"


def gpu_dir(environ=os.environ) -> str:
    return environ.get("STANDIN_GPU_DIR") or DEFAULT_GPU_DIR


def gpu_total_gib(environ=os.environ) -> float:
    try:
        return float(environ.get("STANDIN_GPU_MEMORY_GIB") or 139.8)
    except ValueError:
        return 139.8


class GpuLock:
    """One GPU of this node, held for as long as the process holding it lives (flock)."""

    def __init__(self, index: int, utilization: float, environ=os.environ):
        self.index = index
        self.utilization = utilization
        self.environ = environ
        self.handle = None

    def acquire(self) -> None:
        directory = gpu_dir(self.environ)
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"gpu{self.index}.lock")
        handle = open(path, "a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EACCES):
                raise
            handle.seek(0)
            try:
                holder = json.loads(handle.read() or "{}")
            except ValueError:
                holder = {}
            handle.close()
            total = gpu_total_gib(self.environ)
            used = float(holder.get("utilization", 0.9)) * total
            free = max(0.0, total - used - 0.4)
            raise StandinError(
                f"ValueError: Free memory on device cuda:{self.index} ({free:.1f}/{total:.1f} GiB) on startup is "
                f"less than desired GPU memory utilization ({self.utilization}, "
                f"{self.utilization * total:.2f} GiB). Decrease GPU memory utilization or reduce GPU memory used "
                "by other processes."
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps({"pid": os.getpid(), "utilization": self.utilization}))
        handle.flush()
        self.handle = handle

    def release(self) -> None:
        if self.handle is not None:
            self.handle.close()  # closing the last descriptor drops the flock
            self.handle = None


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
    locks: list[GpuLock] = []
    engine = None
    try:
        cfg = validate(parse_cli(argv), environ)
        load_s = _env_float(environ, "STANDIN_LOAD_SECONDS", 2.0)
        placement_s = _env_float(environ, "VLLM_PLACEMENT_TIMEOUT_S", 60.0)
        ping_timeout_s = _env_float(environ, "STANDIN_PING_TIMEOUT_S", 5.0)
        for index in range(local_gpus_used(cfg)):
            lock = GpuLock(index, cfg.gpu_memory_utilization, environ)
            lock.acquire()
            locks.append(lock)
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
        if not cfg.headless:
            log.info(WHERE_LOADER, "Starting to load model %s...", cfg.model)
            started = time.monotonic()
            if stop.wait(load_s):
                return 0
            took = time.monotonic() - started
            log.info(WHERE_LOADER, "Loading weights took %.2f seconds", took)
            log.info("gpu_model_runner.py:2007", "Model loading took 0.0000 GiB and %.6f seconds", took)
            available = max(0.0, cfg.gpu_memory_utilization * gpu_total_gib(environ) - 3.0)  # no weights here
            log.info("gpu_worker.py:436", "Available KV cache memory: %.2f GiB", available)
            log.info("kv_cache_utils.py:1087", "GPU KV cache size: %d tokens", cfg.max_model_len * 4)
            log.info(
                "kv_cache_utils.py:1091", "Maximum concurrency for %d tokens per request: 4.00x", cfg.max_model_len
            )
        if cfg.backend != "ray":  # the engine core is the worker (uniproc), or stands for its node's ranks (mp)
            rank = cfg.node_rank * max(1, cfg.world_size // cfg.nnodes)
            compiled = compile_cache.compile_graph(rank, compile_cache.model_factors(cfg), environ)
            for where, message in compile_cache.compile_lines(compiled):
                log.info(where, "%s", message)
        with os.fdopen(ready_fd, "w") as ready:
            ready.write("ready\n")
        return _run(engine, stop, ping_timeout_s)
    except StandinError as e:
        log.error(WHERE_CORE, "EngineCore failed to start.")
        log.error(WHERE_WORKER, "%s", e)
        return 1
    finally:
        if engine is not None:
            engine.shutdown()
        for lock in locks:
            lock.release()


def _run(engine, stop: threading.Event, timeout_s: float) -> int:
    """Serve until SIGTERM; exit 1 when the workers (Ray actors, another node's rank) go away."""
    failures = 0
    while not stop.wait(1.0):
        if engine is None:
            continue
        try:
            engine.ping(timeout_s)
            failures = 0
            continue
        except Exception as e:  # noqa: BLE001 - any failure of the workers counts
            failures += 1
            fatal = engine.is_actor_death(e) or failures >= 2
            log.warning(
                "ray_distributed_executor.py:551",
                "worker health check failed (%d): %s: %s",
                failures,
                type(e).__name__,
                str(e).splitlines()[0] if str(e) else "",
            )
            if not fatal or stop.is_set():
                continue
        what = "a RayWorkerWrapper actor" if engine.__class__.__name__ == "RayEngine" else "a worker node"
        log.error(WHERE_CORE, "EngineCore encountered a fatal error: %s died or stopped responding.", what)
        return 1
    return 0
