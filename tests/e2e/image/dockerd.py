"""A private, throw-away dockerd for tests of the image (never the machine's default socket)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from .build import safe_rmtree


@contextlib.contextmanager
def private_dockerd(prefix: str = "imgtest-", data_root: Path | None = None, config: dict | None = None):
    """Start ``dockerd`` with its own data/exec roots and socket; yields ``unix://...`` and stops it by PID.
    ``data_root``: where it keeps images (kept after it stops; default: a throw-away one). ``config``: its
    daemon.json (an explicit one keeps /etc/docker/daemon.json out)."""
    base = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))  # short path: unix sockets max 107 bytes
    sock = base / "docker.sock"
    (base / "daemon.json").write_text(json.dumps(config or {}) + "\n")
    logf = open(base / "dockerd.log", "wb")
    proc = subprocess.Popen(
        [
            "dockerd",
            "--config-file",
            str(base / "daemon.json"),
            "--data-root",
            str(data_root or base / "data"),
            "--exec-root",
            str(base / "exec"),
            "--pidfile",
            str(base / "dockerd.pid"),
            "-H",
            f"unix://{sock}",
            "--bridge=none",
            "--iptables=false",
            "--ip-masq=false",
        ],
        stdout=logf,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    host = f"unix://{sock}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"dockerd exited ({proc.returncode}): {(base / 'dockerd.log').read_text()[-2000:]}")
            if sock.exists() and subprocess.run(["docker", "-H", host, "version"], capture_output=True).returncode == 0:
                break
            if time.monotonic() > deadline:
                raise RuntimeError("dockerd did not come up within 60 s")
            time.sleep(0.3)
        yield host
    finally:
        with contextlib.suppress(Exception):
            ids = subprocess.run(
                ["docker", "-H", host, "ps", "-aq"], capture_output=True, text=True, timeout=30
            ).stdout.split()
            if ids:
                subprocess.run(["docker", "-H", host, "rm", "-f", *ids], capture_output=True, timeout=60)
        stop_daemon(proc)
        logf.close()
        # safe_rmtree refuses (and we leave the directory) if something stayed mounted inside.
        with contextlib.suppress(Exception):
            safe_rmtree(base)


def stop_daemon(proc: subprocess.Popen) -> None:
    """SIGTERM to a daemon we started, 30 s to stop, then SIGKILL."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def dockerd_available() -> str | None:
    """None when the image tests can run here, else the reason to skip."""
    if os.geteuid() != 0:
        return "needs root (debootstrap and a private dockerd)"
    for tool in ("dockerd", "docker", "debootstrap"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install docker.io debootstrap)"
    return None
