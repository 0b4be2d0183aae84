"""Load an attacker on the LAN can put on the edge from one address, and a keyed client's view from another:
shared by the edge's tests (a real HAProxy on loopback: tests/unit/test_edge_load.py), the rehearsal (the
deployed endpoint) and benchmarks/edge_under_load.py, which prints what the keyed client saw under each.

An attack is a loop run in a thread until `stop` is set, from `source` (an address of this machine: on loopback
any 127.x), against `target`; it counts what it did in `Tally`. None needs a key."""

from __future__ import annotations

import contextlib
import select
import socket
import ssl
import statistics
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional

# The HTTP/2 connection preface and an empty SETTINGS frame (RFC 9113 §3.4): what an h2c client with prior
# knowledge, or one inside TLS, sends first.
H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"


@dataclass(frozen=True)
class Target:
    """Where the endpoint is: host and port, and with TLS the context that verifies it and the name it is
    verified for."""

    host: str
    port: int
    tls: Optional[ssl.SSLContext] = None
    server_name: Optional[str] = None

    def connect(self, source: Optional[str] = None, timeout: float = 5.0, alpn: Optional[list[str]] = None):
        sock = socket.create_connection((self.host, self.port), timeout=timeout,
                                        source_address=(source, 0) if source else None)  # fmt: skip
        if self.tls is None:
            return sock
        context = self.tls
        if alpn is not None:
            context = ssl.create_default_context()
            context.load_verify_locations(cadata=_ca_of(self.tls))
            context.set_alpn_protocols(alpn)
        try:
            return context.wrap_socket(sock, server_hostname=self.server_name or self.host)
        except BaseException:
            sock.close()
            raise


def _ca_of(context: ssl.SSLContext) -> str:
    return "".join(ssl.DER_cert_to_PEM_cert(der) for der in context.get_ca_certs(binary_form=True))


@dataclass
class Tally:
    """What an attack did: connections it opened, the ones the edge refused at once (reset or closed without a
    byte), the answers it got by status, and the connections it held at the end."""

    opened: int = 0
    refused: int = 0
    answers: dict[int, int] = field(default_factory=dict)
    held: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def answered(self, status: int) -> None:
        with self.lock:
            self.answers[status] = self.answers.get(status, 0) + 1

    def add(self, name: str, count: int = 1) -> None:
        with self.lock:
            setattr(self, name, getattr(self, name) + count)

    def summary(self) -> dict:
        return {"opened": self.opened, "refused": self.refused, "answers": dict(sorted(self.answers.items())),
                "held": self.held}  # fmt: skip


def status_of(answer: bytes) -> Optional[int]:
    line = answer.split(b"\r\n", 1)[0]
    parts = line.split(b" ")
    if line.startswith(b"HTTP/1.") and len(parts) > 1 and parts[1].isdigit():
        return int(parts[1])
    return None


def read_answer(sock, timeout: float = 5.0) -> bytes:
    """Everything until the edge closes or `timeout` passes quietly."""
    sock.settimeout(timeout)
    answer = b""
    with contextlib.suppress(OSError, ssl.SSLError):
        while True:
            data = sock.recv(65536)
            if not data:
                break
            answer += data
    return answer


def _one(target: Target, source: str, raw: bytes, tally: Tally, alpn: Optional[list[str]] = None) -> None:
    """One connection: `raw` sent, the answer read; a connection the edge closes before a byte is `refused`."""
    try:
        sock = target.connect(source, alpn=alpn)
    except (OSError, ssl.SSLError):
        tally.add("refused")
        return
    tally.add("opened")
    with sock:
        try:
            sock.sendall(raw)
        except OSError:
            tally.add("refused")
            return
        status = status_of(read_answer(sock))
        if status is None:
            tally.add("refused")
        else:
            tally.answered(status)


def _repeat(one: Callable[[], None], stop: threading.Event, pause: float) -> None:
    while not stop.is_set():
        one()
        if pause:
            stop.wait(pause)


def http2(target: Target, source: str, stop: threading.Event, tally: Tally) -> None:
    """HTTP/2 with prior knowledge (and, over TLS, ALPN offering h2 alone): the preface, then /health streams."""
    alpn = ["h2"] if target.tls is not None else None
    _repeat(lambda: _one(target, source, H2_PREFACE, tally, alpn), stop, 0.01)


def keyless_requests(target: Target, source: str, stop: threading.Event, tally: Tally) -> None:
    """Requests without a key, a new connection each, as fast as the edge answers: a completion refused, a
    /health with a query holding a key, a route that is not one."""
    raws = [
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: h\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}",
        b"GET /health?api_key=sk-leaked-in-a-query-000 HTTP/1.1\r\nHost: h\r\n\r\n",
        b"GET /workers HTTP/1.1\r\nHost: h\r\n\r\n",
    ]  # fmt: skip
    turn = iter(range(1 << 62))
    _repeat(lambda: _one(target, source, raws[next(turn) % len(raws)], tally), stop, 0)


def _hold(target: Target, source: str, stop: threading.Event, tally: Tally, count: int, send: Callable) -> None:
    """Up to `count` connections held open, each fed by `send(sock, round)` every second; one the edge answers or
    closes is opened again. `tally.held`: the connections that lasted a whole second, at each round's start."""
    held: list = []
    round_ = 0
    while not stop.is_set():
        alive = []
        for sock in held:
            try:
                _idle(sock, round_)
                alive.append(sock)
            except (OSError, ssl.SSLError):
                sock.close()
        held = alive
        with tally.lock:
            tally.held = len(held)
        while len(held) < count and not stop.is_set():
            try:
                sock = target.connect(source, timeout=2)
            except (OSError, ssl.SSLError):
                tally.add("refused")
                break
            tally.add("opened")
            held.append(sock)
        alive = []
        for sock in held:
            try:
                send(sock, round_)
                alive.append(sock)
            except (OSError, ssl.SSLError):
                sock.close()
        held = alive
        round_ += 1
        stop.wait(1.0)
    for sock in held:
        sock.close()


def _idle(sock, round_: int) -> None:
    """Nothing sent. A connection the edge answered (its 408) or closed is given up: raises. (Over TLS a readable
    socket may hold only the server's session tickets: read without blocking to tell.)"""
    readable, _, _ = select.select([sock], [], [], 0)
    if not readable and not (isinstance(sock, ssl.SSLSocket) and sock.pending()):
        return
    sock.setblocking(False)
    try:
        sock.recv(4096)
    except (ssl.SSLWantReadError, BlockingIOError):
        return
    finally:
        with contextlib.suppress(OSError):
            sock.setblocking(True)
    raise ConnectionResetError("answered or closed by the edge")


def idle_connections(count: int) -> Callable:
    """`count` connections that send nothing, each reopened when dropped."""

    def attack(target: Target, source: str, stop: threading.Event, tally: Tally) -> None:
        _hold(target, source, stop, tally, count, lambda sock, round_: None)

    return attack


def _trickle(count: int, first: bytes, then: bytes) -> Callable:
    """An attack holding `count` connections that each send `first` at once, then `then` a byte a second."""

    def attack(target: Target, source: str, stop: threading.Event, tally: Tally) -> None:
        sent: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

        def send(sock, round_: int) -> None:
            done = sent.get(sock)
            if done is None:
                sock.sendall(first)
                sent[sock] = 0
            else:
                sock.sendall(then[done % len(then) : done % len(then) + 1])
                sent[sock] = done + 1

        _hold(target, source, stop, tally, count, send)

    return attack


def slow_heads(count: int) -> Callable:
    """`count` connections that each send a request head a byte a second (slowloris)."""
    return _trickle(count, b"G", b"ET /health HTTP/1.1\r\nHost: h\r\nX-Slow: " + b"a" * 4096)


def health_bodies(count: int) -> Callable:
    """`count` connections sending GET /health with a body announced large and trickled a byte a second (before
    #64 each held an upstream connection)."""
    return _trickle(count, b"GET /health HTTP/1.1\r\nHost: h\r\nContent-Length: 1000000\r\n\r\n", b"x")


@dataclass
class Running:
    """Attacks started in threads; `stop()` ends them and returns each one's tally."""

    stop_event: threading.Event
    threads: list[threading.Thread]
    tallies: list[Tally]

    def stop(self) -> list[Tally]:
        self.stop_event.set()
        for thread in self.threads:
            thread.join(30)
        return self.tallies


def start(attack: Callable, target: Target, source: str, threads: int = 1) -> Running:
    stop = threading.Event()
    tallies = [Tally() for _ in range(threads)]
    started = [threading.Thread(target=attack, args=(target, source, stop, tally), daemon=True) for tally in tallies]
    for thread in started:
        thread.start()
    return Running(stop, started, tallies)


@dataclass
class Served:
    """What a keyed client saw: each request's seconds to its whole answer, and the ones that failed (why)."""

    seconds: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def summary(self) -> dict:
        ordered = sorted(self.seconds)
        if not ordered:
            return {"requests": 0, "failed": len(self.failures)}
        p99 = ordered[min(len(ordered) - 1, int(round(len(ordered) * 0.99)) - 1)]
        return {"requests": len(ordered) + len(self.failures), "failed": len(self.failures),
                "p50_ms": round(statistics.median(ordered) * 1000, 3), "p99_ms": round(p99 * 1000, 3)}  # fmt: skip


def keyed_client(target: Target, source: str, key: str, body: bytes, requests: int, new_connections: bool,
                 timeout: float = 5.0) -> Served:  # fmt: skip
    """`requests` chat completions with `key` from `source`, one after the other: on one kept-alive connection, or
    a new connection each (the client that needs a free slot every time)."""
    served = Served()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {target.server_name or target.host}\r\n"
            f"Authorization: Bearer {key}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n")  # fmt: skip
    sock = None
    for _ in range(requests):
        started = time.monotonic()
        try:
            if sock is None:
                sock = target.connect(source, timeout=timeout)
                sock.settimeout(timeout)
            closing = "Connection: close\r\n" if new_connections else ""
            sock.sendall((head + closing + "\r\n").encode() + body)
            status = _read_one(sock)
            served.seconds.append(time.monotonic() - started)
            if status != 200:
                served.failures.append(f"status {status}")
        except (OSError, ssl.SSLError) as error:
            served.failures.append(f"{type(error).__name__}: {error}")
            with contextlib.suppress(OSError):
                sock.close() if sock is not None else None
            sock = None
            continue
        if new_connections:
            sock.close()
            sock = None
    if sock is not None:
        sock.close()
    return served


def _read_one(sock) -> Optional[int]:
    """One whole answer (its head and Content-Length's body) from `sock`: its status."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionResetError(f"closed after {len(data)} bytes")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionResetError("closed in the body")
        body += chunk
    return status_of(head)


# Each attack of #64 at the scale the tests and the benchmark use, by name: (the attack, threads).
def attacks(slots: int) -> dict[str, tuple[Callable, int]]:
    """`slots`: connections enough to fill the edge's maxConnections from one address."""
    return {
        "HTTP/2 with prior knowledge": (http2, 2),
        "keyless requests (a connection each)": (keyless_requests, 2),
        "idle connections": (idle_connections(slots), 1),
        "slow heads": (slow_heads(slots), 1),
        "/health with a trickled body": (health_bodies(slots), 1),
    }


def under_attacks(target: Target, attackers: list[str], client: str, key: str, body: bytes, slots: int,
                  names: Optional[list[str]] = None, requests: int = 20, settle: float = 3.0) -> dict:  # fmt: skip
    """Each attack in turn, each from an address of its own out of `attackers` (one the edge has not held to its
    limits yet; they are taken in turn), its height reached after `settle` s, and meanwhile a keyed client from
    `client`: `requests` completions on new connections, then as many on one kept-alive connection. Before the
    attacks, the same requests with no attack: `none`. {attack: {"new": Served, "kept": Served, "attack": [tally]}}."""
    found: dict = {"none": {"new": keyed_client(target, client, key, body, requests, True),
                            "kept": keyed_client(target, client, key, body, requests, False), "attack": []}}  # fmt: skip
    chosen = [(name, entry) for name, entry in attacks(slots).items() if names is None or name in names]
    for index, (name, (attack, threads)) in enumerate(chosen):
        load = start(attack, target, attackers[index % len(attackers)], threads)
        time.sleep(settle)
        new = keyed_client(target, client, key, body, requests, True)
        kept = keyed_client(target, client, key, body, requests, False)
        found[name] = {"new": new, "kept": kept, "attack": [tally.summary() for tally in load.stop()]}
    return found


def report(found: dict) -> list[str]:
    """One line an attack: what the keyed client saw, and what the attacker did."""
    lines = []
    for name, result in found.items():
        new, kept = result["new"].summary(), result["kept"].summary()
        done = {key: sum(t[key] for t in result["attack"]) for key in ("opened", "refused", "held")}
        answered = sum(sum(t["answers"].values()) for t in result["attack"])
        lines.append(f"{name}: new connections {new}; kept-alive {kept}; attacker {done}, {answered} answered")
    return lines
