"""Log lines in vLLM's format: ``INFO 11-29 16:00:00 [api_server.py:1839] message``.

Everything goes to stdout and is flushed at once, so that ``docker logs`` and
``docker exec`` callers see lines while the process runs.
"""

from __future__ import annotations

import sys
import threading
import time

_lock = threading.Lock()
_prefix = ""


def set_prefix(prefix: str) -> None:
    """What vLLM puts before each line of a child process, e.g. ``(EngineCore pid=812) `` (vLLM 0.25; the API server's ``(APIServer pid=7) ``)."""
    global _prefix
    _prefix = prefix


def _emit(line: str) -> None:
    with _lock:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def log(level: str, where: str, msg: str, *args: object, inner: str = "") -> None:
    """``where`` is the source location shown in brackets, e.g. ``api_server.py:1839``; ``inner`` goes
    after this process's prefix: a Ray worker's line as its driver prints it, which vLLM 0.25 shows as
    ``(EngineCore pid=12) \x1b[36m(RayWorkerProc pid=13)\x1b[0m (Worker pid=13) INFO …`` (seen on the H200)."""
    if args:
        msg = msg % args
    prefix = _prefix + inner
    stamp = time.strftime("%m-%d %H:%M:%S", time.localtime())
    for i, part in enumerate(msg.splitlines() or [""]):
        _emit(f"{prefix}{level} {stamp} [{where}] {part}" if i == 0 else f"{prefix}{part}")


def info(where: str, msg: str, *args: object) -> None:
    log("INFO", where, msg, *args)


def warning(where: str, msg: str, *args: object) -> None:
    log("WARNING", where, msg, *args)


def error(where: str, msg: str, *args: object) -> None:
    log("ERROR", where, msg, *args)


def uvicorn(msg: str, *args: object) -> None:
    """Uvicorn's own lines (``INFO:     Uvicorn running on ...``)."""
    if args:
        msg = msg % args
    _emit(f"INFO:     {msg}")
