"""An ssh-agent of the test's own (as a user's login session has one), on a socket in `directory`."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path


def _accepts(sock: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(sock))
        except OSError:
            return False
    return True


@contextlib.contextmanager
def ssh_agent(directory: Path, keys: tuple[Path, ...] = ()) -> Iterator[Path]:
    """Yields the agent's socket (SSH_AUTH_SOCK) holding `keys`; the agent is stopped on exit."""
    sock = Path(directory) / "agent.sock"
    agent = subprocess.Popen(["ssh-agent", "-D", "-a", str(sock)], stdout=subprocess.DEVNULL)
    try:
        for _ in range(400):  # until it accepts: the socket file exists a moment before the agent listens
            if sock.exists() and _accepts(sock):
                break
            time.sleep(0.05)
        for key in keys:
            subprocess.run(["ssh-add", "-q", str(key)], env={**os.environ, "SSH_AUTH_SOCK": str(sock)}, check=True)
        yield sock
    finally:
        agent.terminate()
        agent.wait()
