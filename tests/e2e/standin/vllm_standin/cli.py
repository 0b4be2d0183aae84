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

from . import __version__, bench, log
from .api import Pace, ServerState, make_server
from .args import StandinError, parse_cli, redacted_args, validate
from .core import EngineCoreClient

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
    argv = list(sys.argv[1:] if argv is None else argv)
    ns = parse_cli(argv)
    if ns.subparser == "bench":
        return bench.run(ns)
    log.set_prefix(f"(APIServer pid={os.getpid()}) ")  # as vLLM 0.25's API server prefixes its lines
    log.info(WHERE_API, "vLLM API server version %s", __version__)
    log.info(WHERE_API, "args: %s", redacted_args(ns))
    try:
        cfg = validate(ns, environ)
        linger_s = _env_float(environ, "STANDIN_DEAD_LINGER_S", 2.0)
        local_gpus = int(_env_float(environ, "STANDIN_LOCAL_GPUS", 1))
        pace = Pace(
            _env_float(environ, "STANDIN_TOKENS_PER_SECOND", Pace.tokens_per_second),
            _env_float(environ, "STANDIN_PREFILL_TOKENS_PER_SECOND", Pace.prefill_tokens_per_second),
        )
        if min(pace.tokens_per_second, pace.prefill_tokens_per_second) <= 0:
            raise StandinError("STANDIN_TOKENS_PER_SECOND and STANDIN_PREFILL_TOKENS_PER_SECOND must be above 0")
        _check_world(cfg, local_gpus)
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

    # The engine (executor, workers, the GPUs) runs in a child process of its own, as in vLLM.
    core = EngineCoreClient(argv, environ)
    if not core.wait_ready(stop):
        if stop.is_set():
            return _shutdown(None, core, 0)
        code = core.process.wait()
        return _fail(
            "RuntimeError: Engine core initialization failed. See root cause above. "
            f"Failed core proc(s): {{'EngineCore_DP0': {code}}}"
        )

    if cfg.headless:
        return _headless(core, stop)

    state = ServerState(cfg, pace)
    state.prefill_chunk = int(_env_float(environ, "STANDIN_PREFILL_CHUNK_TOKENS", state.prefill_chunk))
    state.stepped()  # the engine core said ready: it steps from now on
    core.follow_steps(state.stepped)
    try:
        server = make_server(state)
    except OSError as e:
        code = _fail(
            f"[Errno {e.errno}] error while attempting to bind on address ({cfg.host!r}, {cfg.port}): {e.strerror}"
        )
        core.shutdown()
        return code

    log.info(WHERE_API, "Starting vLLM server on http://%s:%d", cfg.host, cfg.port)  # vLLM 0.25's words
    log.info(
        "launcher.py:29",
        "Available routes are: /health, /ping, /version, /metrics, /v1/models, /v1/chat/completions, /v1/completions",
    )
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2}, name="http", daemon=True).start()
    log.uvicorn("Started server process [%d]", os.getpid())
    log.uvicorn("Waiting for application startup.")
    log.uvicorn("Application startup complete.")
    log.uvicorn("Uvicorn running on http://%s:%d (Press CTRL+C to quit)", cfg.host, cfg.port)

    while not stop.wait(0.5):
        if not core.alive():
            log.error(WHERE_CORE, "Engine core proc EngineCore_DP0 died unexpectedly, shutting down client.")
            reason["why"] = reason["why"] or "engine-dead"
            break
    if reason["why"] == "engine-dead":
        state.engine_alive = False
        time.sleep(linger_s)  # let health pollers observe 503 before the port closes
        return _shutdown(server, core, 1)
    return _shutdown(server, core, 0)


def _check_world(cfg, local_gpus: int) -> None:
    """What vLLM's config refuses before it starts anything."""
    world = cfg.world_size
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


def _headless(core, stop: threading.Event) -> int:
    """A node rank above 0: no API server; lives while its engine does (which ends with rank 0)."""
    log.info(WHERE_API, "headless worker running (no API server on this node)")
    while not stop.wait(1.0):
        if not core.alive():
            log.error(WHERE_CORE, "Engine core proc died unexpectedly on this node; exiting.")
            return 1
    return _shutdown(None, core, 0)


def _shutdown(server, core, code: int) -> int:
    _force_exit_after(10.0, code)
    log.info(WHERE_API, "Shutting down")
    if server is not None:
        log.uvicorn("Shutting down")
        server.shutdown()
        server.server_close()
        log.uvicorn("Finished server process [%d]", os.getpid())
    if core is not None:
        core.shutdown()
    return code
