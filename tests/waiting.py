"""Small helpers the tests share: polling for a condition, a free local port."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable


def wait_for(check: Callable[[], object], timeout: float = 20.0) -> bool:
    """Whether `check()` turned true within `timeout` seconds (polled every 0.1 s)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.1)
    return False


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
