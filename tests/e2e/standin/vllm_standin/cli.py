"""``vllm serve`` stand-in: start-up sequence, serving loop, failure and shutdown handling.

Exit codes: 0 after SIGTERM/SIGINT, 1 for start-up failures and engine death,
2 for command-line errors (argparse).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from . import __version__, log
from .api import ServerState, make_server
from .args import StandinError, parse_cli, redacted_args, validate

WHERE_API = "api_server.py:1839"
WHERE_CORE = "core_client.py:564"
WHERE_LOADER = "default_loader.py:267"


def _env_float(environ, name: str, default: float) -> float:
    raw = environ.get(name)
    if raw in (None, ""):
        return default
    try:
        return float(raw)
    except ValueError:
        raise StandinError(f"{name} must be a number, got {raw!r}") from None


def _fail(msg: str) -> int:
    log.error(WHERE_API, "%s", msg)
    return 1


def _force_exit_after(seconds: float, code: int) -> None:
    t = threading.Timer(seconds, lambda: (sys.stdout.flush(), os._exit(code)))
    t.daemon = True
    t.start()


def main(argv: list[str] | None = None, environ=os.environ) -> int:
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        return _main(argv, environ)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _main(argv: list[str] | None, environ) -> int:
    ns = parse_cli(list(sys.argv[1:] if argv is None else argv))
    log.info(WHERE_API, "vLLM API server version %s", __version__)
    log.info(WHERE_API, "args: %s", redacted_args(ns))
    try:
        cfg = validate(ns, environ)
        load_s = _env_float(environ, "STANDIN_LOAD_SECONDS", 2.0)
        placement_s = _env_float(environ, "VLLM_PLACEMENT_TIMEOUT_S", 60.0)
        ping_timeout_s = _env_float(environ, "STANDIN_PING_TIMEOUT_S", 5.0)
        linger_s = _env_float(environ, "STANDIN_DEAD_LINGER_S", 2.0)
        local_gpus = int(_env_float(environ, "STANDIN_LOCAL_GPUS", 1))
    except StandinError as e:
        return _fail(str(e))

    stop = threading.Event()
    reason = {"why": None}

    def on_signal(signum, _frame):
        if reason["why"] is None:
            reason["why"] = signal.Signals(signum).name
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    world = cfg.world_size
    engine = None
    try:
        if cfg.data_parallel_size > 1:
            raise StandinError("stand-in: --data-parallel-size > 1 is not simulated")
        if cfg.backend == "ray":
            log.info(
                WHERE_API,
                "Using the Ray distributed executor: world size %d (TP %d x PP %d)",
                world,
                cfg.tensor_parallel_size,
                cfg.pipeline_parallel_size,
            )
            from .engine import RayEngine

            engine = RayEngine(cfg, environ)
            engine.start(stop, placement_s)
            # ray.init may install handlers of its own; ours decide the exit code.
            signal.signal(signal.SIGTERM, on_signal)
            signal.signal(signal.SIGINT, on_signal)
        elif cfg.nnodes > 1:
            per_node = world // cfg.nnodes
            if per_node > local_gpus:
                raise StandinError(
                    f"World size ({world}) over {cfg.nnodes} nodes needs {per_node} GPUs on each node; "
                    f"this node has {local_gpus}."
                )
            log.info(
                WHERE_API,
                "Using the multiprocessing executor across %d nodes: node rank %d of world size %d (TP %d x PP %d)%s",
                cfg.nnodes,
                cfg.node_rank,
                world,
                cfg.tensor_parallel_size,
                cfg.pipeline_parallel_size,
                ", headless" if cfg.headless else "",
            )
            from .mp import MpEngine

            engine = MpEngine(cfg, environ)
            engine.start(stop, _env_float(environ, "STANDIN_JOIN_TIMEOUT_S", 120.0))
        else:
            if world > local_gpus:
                raise StandinError(
                    f"World size ({world}) is larger than the number of available GPUs ({local_gpus}) in this "
                    "node. If this is intentional and you are using:\n"
                    "- ray, set '--distributed-executor-backend ray'.\n"
                    "- multiprocessing, set '--nnodes' appropriately."
                )
            log.info(
                WHERE_API,
                "Using the %s executor: world size %d on this node",
                cfg.backend or ("mp" if world > 1 else "uni"),
                world,
            )
    except StandinError as e:
        code = _fail(str(e))
        if engine is not None:
            engine.shutdown()
        return code

    if stop.is_set():
        return _shutdown(None, engine, 0)

    if cfg.headless:
        return _headless(engine, stop, reason, ping_timeout_s)

    log.info(WHERE_LOADER, "Starting to load model %s...", cfg.model)
    t0 = time.monotonic()
    if stop.wait(load_s):
        return _shutdown(None, engine, 0)
    took = time.monotonic() - t0
    log.info(WHERE_LOADER, "Loading weights took %.2f seconds", took)
    log.info("gpu_model_runner.py:2007", "Model loading took 0.0000 GiB and %.6f seconds", took)
    log.info("kv_cache_utils.py:1087", "GPU KV cache size: %d tokens", cfg.max_model_len * 4)
    log.info("kv_cache_utils.py:1091", "Maximum concurrency for %d tokens per request: 4.00x", cfg.max_model_len)

    state = ServerState(cfg)
    try:
        server = make_server(state)
    except OSError as e:
        code = _fail(
            f"[Errno {e.errno}] error while attempting to bind on address ({cfg.host!r}, {cfg.port}): {e.strerror}"
        )
        if engine is not None:
            engine.shutdown()
        return code

    log.info(WHERE_API, "Starting vLLM API server 0 on http://%s:%d", cfg.host, cfg.port)
    log.info(
        "launcher.py:29", "Available routes are: /health, /ping, /version, /metrics, /v1/models, /v1/chat/completions"
    )
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, name="http", daemon=True).start()
    log.uvicorn("Started server process [%d]", os.getpid())
    log.uvicorn("Waiting for application startup.")
    log.uvicorn("Application startup complete.")
    log.uvicorn("Uvicorn running on http://%s:%d (Press CTRL+C to quit)", cfg.host, cfg.port)

    if engine is not None:
        threading.Thread(
            target=_monitor, args=(engine, state, stop, reason, ping_timeout_s), name="engine-monitor", daemon=True
        ).start()

    while not stop.wait(0.5):
        pass
    if reason["why"] == "engine-dead":
        state.engine_alive = False
        time.sleep(linger_s)  # let health pollers observe 503 before the port closes
        return _shutdown(server, engine, 1)
    return _shutdown(server, engine, 0)


def _headless(engine, stop: threading.Event, reason: dict, timeout_s: float) -> int:
    """A node rank above 0: no API server; lives while rank 0 does (exit 1 when it goes away)."""
    log.info(WHERE_API, "headless worker running (no API server on this node)")
    while not stop.wait(1.0):
        try:
            engine.ping(timeout_s)
        except Exception as e:  # noqa: BLE001 - rank 0 gone
            log.error(WHERE_CORE, "Engine core proc died unexpectedly on this node: %s", e)
            reason["why"] = "engine-dead"
            return _shutdown(None, engine, 1)
    return _shutdown(None, engine, 0)


def _monitor(engine, state: ServerState, stop: threading.Event, reason: dict, timeout_s: float) -> None:
    failures = 0
    while not stop.wait(1.0):
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
        state.engine_alive = False
        what = "a RayWorkerWrapper actor" if engine.__class__.__name__ == "RayEngine" else "a worker node"
        log.error("core.py:708", "EngineCore encountered a fatal error: %s died or stopped responding.", what)
        log.error(WHERE_CORE, "Engine core proc EngineCore_DP0 died unexpectedly, shutting down client.")
        if reason["why"] is None:
            reason["why"] = "engine-dead"
        stop.set()
        return


def _shutdown(server, engine, code: int) -> int:
    _force_exit_after(10.0, code)
    log.info(WHERE_API, "Shutting down")
    if server is not None:
        log.uvicorn("Shutting down")
        server.shutdown()
        server.server_close()
        log.uvicorn("Finished server process [%d]", os.getpid())
    if engine is not None:
        engine.shutdown()
    return code
