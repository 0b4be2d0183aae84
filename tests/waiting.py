"""Small helpers the tests share: polling for a condition, free local ports."""

from __future__ import annotations

import os
import random
import socket
import time
from collections.abc import Callable


def wait_for(check: Callable[[], object], timeout: float = 20.0) -> bool:
    """Whether `check()` turned true within `timeout` seconds (polled every 0.1 s): `wait_until` as a bool, for
    `assert wait_for(...)` one-liners."""
    try:
        wait_until(check, timeout, "a condition")
    except AssertionError:
        return False
    return True


def wait_until(
    check: Callable[[], object],
    timeout: float,
    what: str,
    every: float = 0.1,
    errors: tuple[type[BaseException], ...] = (),
    seen: Callable[[], object] | None = None,
):
    """`check()`'s first true value within `timeout` seconds; else an AssertionError that says what the test
    waited for, how long, and what it saw last (`seen()`, or check's last value or error). `errors`: exceptions
    that mean "not yet" (a daemon coming back), not a failure."""
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            last = check()
        except errors as error:  # noqa: PERF203 - a poll
            last = f"{type(error).__name__}: {error}"
        else:
            if last:
                return last
        if time.monotonic() >= deadline:
            shown = seen() if seen is not None else last
            raise AssertionError(f"waited {timeout:g} s for {what}; last seen: {str(shown)[-1500:]}")
        time.sleep(every)


def holds_for(check: Callable[[], object], seconds: float, what: str, every: float = 0.1) -> None:
    """That something does NOT happen is a window of time by nature: `check()` stays true for `seconds`, or an
    AssertionError says when it stopped holding."""
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        if not check():
            raise AssertionError(f"{what} stopped holding after {time.monotonic() - started:.1f} s of {seconds:g}")
        time.sleep(every)


# Ports handed out go below the kernel's ephemeral range (net.ipv4.ip_local_port_range), which every outgoing
# connection on the machine draws its source port from: a port picked there (bind to port 0) and bound a few
# seconds later by a server the test starts can meanwhile be an SSH dial's or an HTTP probe's, and the server
# fails with "Address already in use" (CI, 2026-12-03: a co-tenant lane's second vLLM restarted until its
# readiness timed out). Below the range only a listener can hold a port, and the probe sees a listener.
LOWEST_PORT = 20000
_handed_out: set[int] = set()


def ephemeral_range(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int]:
    try:
        low, high = (int(part) for part in open(path).read().split())
        return low, high
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def bindable(port: int) -> bool:
    """Whether nothing on this machine (any address) holds `port` for TCP now."""
    for host in ("0.0.0.0", "127.0.0.1"):
        with socket.socket() as probe:
            try:
                probe.bind((host, port))
            except OSError:
                return False
    return True


def port_span() -> range:
    """Where test ports come from: below the ephemeral range, or above it where it starts too low for that;
    under pytest-xdist, this process's own slice of it (`worker_slice`)."""
    low, high = ephemeral_range()
    span = range(LOWEST_PORT, low) if low - LOWEST_PORT >= 1000 else range(high + 1, 65536)
    return worker_slice(span, os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT"))


def worker_slice(span: range, worker: str | None, count: str | None) -> range:
    """Worker gwN of `count` gets the N-th of `count` equal slices of `span`: a port is picked, then bound
    seconds later by the server the test starts, and two processes picking from one span could pick the same
    port in between (the second server fails to bind, and the test talks to the other test's server)."""
    if not worker or not count or not worker.removeprefix("gw").isdigit() or not count.isdigit():
        return span
    index, total = int(worker.removeprefix("gw")), max(int(count), 1)
    size = len(span) // total
    return range(span.start + index * size, span.start + (index + 1) * size)


def free_ports(count: int = 1, consecutive: bool = False) -> list[int]:
    """`count` TCP ports that nothing holds now, outside the ephemeral range, none handed out before by this
    process (`consecutive`: port, port + 1, …)."""
    span = port_span()
    for _ in range(200):
        if consecutive:
            start = random.randrange(span.start, span.stop - count + 1)
            ports = list(range(start, start + count))
        else:
            ports = random.sample(span, count)
        if any(port in _handed_out for port in ports) or not all(bindable(port) for port in ports):
            continue
        _handed_out.update(ports)
        return ports
    raise RuntimeError(f"no {count} free port(s) in {span.start}..{span.stop - 1}")


def free_port() -> int:
    """A TCP port that nothing listens on now and no outgoing connection can take before the test binds it."""
    return free_ports()[0]
