"""A real HAProxy (Debian's, unpacked: tests/e2e/image/build.py haproxy_command) running the edge's rendered
configuration on loopback, in front of an upstream that records every byte it receives: what the edge lets
through is what that upstream saw."""

from __future__ import annotations

import contextlib
import json
import socket
import ssl
import subprocess
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from components.plan.edge import CHECK_HOST, CONFIG_DIR, CONFIG_FILE, EdgeSpec, files
from tests.e2e.cache import CACHE_DIR
from tests.e2e.image.build import haproxy_command
from tests.waiting import free_port


@dataclass
class Recorder:
    """An upstream on loopback that answers every request with 200 and its own request line (after X-Delay
    seconds), and keeps each connection's bytes as they came; the edge's own checks of its /health are only
    counted (`checks`). `reset()` starts a test afresh on the same upstream."""

    port: int = field(default_factory=free_port)
    received: list[bytes] = field(default_factory=list)
    checks: int = 0

    def start(self) -> Recorder:
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", self.port))
        self.sock.listen(64)
        threading.Thread(target=self._accept, daemon=True).start()
        return self

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def reset(self) -> None:
        """What was received is forgotten and the checks counted from 0; bytes that come later on a connection opened
        before (HAProxy keeps its connections to the upstream alive) are kept as a new entry: none is lost to a test
        that asks what reached the upstream."""
        self.received = []
        self.checks = 0

    def _serve(self, conn: socket.socket) -> None:
        index = None  # where this connection's bytes are kept: none for the edge's own checks of /health
        kept: list[bytes] = self.received  # the list index is in: the one of the test the bytes came in
        buf = b""
        with conn:
            while True:
                try:
                    data = conn.recv(65536)
                except OSError:
                    return
                if not data:
                    return
                buf += data
                if index is None:
                    if b"\r\n\r\n" in buf and CHECK_HOST.encode() in buf.split(b"\r\n\r\n", 1)[0].lower():
                        self.checks += 1
                    else:
                        kept, index = self.received, len(self.received)
                        kept.append(buf)
                elif kept is not self.received:  # reset since: these bytes belong to the test now running
                    kept, index = self.received, len(self.received)
                    kept.append(data)
                else:
                    kept[index] += data
                while b"\r\n\r\n" in buf:
                    head, _, rest = buf.partition(b"\r\n\r\n")
                    body_len = _content_length(head)
                    if body_len is None:  # chunked: to its last chunk
                        end = rest.find(b"0\r\n\r\n")
                        if end < 0:
                            break
                        buf = rest[end + 5 :]
                    else:
                        if len(rest) < body_len:
                            break
                        buf = rest[body_len:]
                    line = head.split(b"\r\n", 1)[0].decode("latin-1")
                    time.sleep(_delay(head))
                    answer = json.dumps({"upstream": line}).encode()
                    try:
                        conn.sendall(
                            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                            + str(len(answer)).encode()
                            + b"\r\n\r\n"
                            + answer
                        )
                    except OSError:  # the edge closed it meanwhile (a client gone, a limit): nothing to answer
                        return

    def request_lines(self) -> list[str]:
        lines = []
        for raw in self.received:
            for head in raw.split(b"\r\n\r\n"):
                first = head.split(b"\r\n", 1)[0].decode("latin-1")
                if first.split(" ")[0] in ("GET", "POST", "HEAD", "PUT", "DELETE", "PATCH", "OPTIONS"):
                    lines.append(first)
        return lines

    def close(self) -> None:
        self.sock.close()


def _delay(head: bytes) -> float:
    """X-Delay: seconds the Recorder waits before it answers (an upstream busy with a long completion)."""
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"x-delay":
            return float(value.strip())
    return 0.0


def _content_length(head: bytes) -> int | None:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"transfer-encoding":
            return None
        if name.strip().lower() == b"content-length":
            return int(value.strip())
    return 0


def write_files(spec: EdgeSpec, directory: Path) -> Path:
    """files(spec) into `directory` in place of CONFIG_DIR, as the edge's step writes them; haproxy.cfg's path."""
    for path, text in files(spec).items():
        (directory / path.rsplit("/", 1)[1]).write_text(text.replace(CONFIG_DIR + "/", f"{directory}/"))
    return directory / CONFIG_FILE.rsplit("/", 1)[1]


@dataclass
class Edge:
    """HAProxy with `spec` (host and upstream filled in), its log in `log`."""

    spec: EdgeSpec
    directory: Path

    def start(self) -> Edge:
        self.config = write_files(self.spec, self.directory)
        self.log = self.directory / "haproxy.log"
        self.process = subprocess.Popen(
            [*haproxy_command(CACHE_DIR), "-W", "-db", "-f", str(self.config)],
            stdout=self.log.open("wb"),
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # listening, and the master past its start (a reload's signal is heard)
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.spec.port), timeout=1):
                if b"Loading success" in self.log.read_bytes():
                    return self
            if self.process.poll() is not None:
                raise RuntimeError(f"haproxy exited: {self.log.read_text()}")
            time.sleep(0.05)
        raise RuntimeError(f"haproxy did not listen: {self.log.read_text()}")

    def workers(self) -> set[int]:
        """HAProxy's workers: the master's children."""
        found = set()
        for stat in Path("/proc").glob("[0-9]*/stat"):
            with contextlib.suppress(OSError):
                fields = stat.read_text().rsplit(")", 1)[1].split()
                if int(fields[1]) == self.process.pid:
                    found.add(int(stat.parent.name))
        return found

    def reload(self, spec: EdgeSpec) -> None:
        """The new configuration, as the edge's step applies it (components/scripts/edge_apply.sh): written, then
        SIGUSR2 to the master until a new worker is there."""
        self.spec = spec
        write_files(spec, self.directory)
        before = self.workers()
        for _ in range(6):
            self.process.send_signal(12)  # SIGUSR2
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                if self.workers() - before:
                    return
                time.sleep(0.05)
        raise RuntimeError(f"haproxy did not reload: {self.log.read_text()[-2000:]}")

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()


def edge_spec(upstream: Recorder, **changes) -> EdgeSpec:
    """A spec on loopback: its own port's metrics on 127.0.0.2 (a node's fabric address in the tests: the
    watchdog's check takes 127.0.0.1 at that port), no limit on keyless connections from one address unless
    asked (the attack tables send thousands of refused requests from one)."""
    base = EdgeSpec(host="127.0.0.1", port=free_port(), upstream_host="127.0.0.1", upstream_port=upstream.port,
                    metrics_host="127.0.0.2", metrics_port=free_port(), keyless_per_source=1000000)  # fmt: skip
    return replace(base, **changes)


def exchange(
    port: int,
    raw: bytes,
    wait: float = 2.0,
    host: str = "127.0.0.1",
    tls: ssl.SSLContext | None = None,
    first: bool = True,
) -> bytes:
    """`raw` sent on one connection; everything answered until the edge closes it or `wait` passes quietly.
    `tls`: over TLS, verified for `host` with that context; then the first whole answer is enough unless `first`
    is False (a TLS client cannot half-close as a plain one does, which lets the edge answer and close)."""
    with socket.create_connection((host, port), timeout=wait) as plain:
        sock = tls.wrap_socket(plain, server_hostname=host) if tls is not None else plain
        sock.sendall(raw)
        if tls is None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_WR)
        answer = b""
        while True:
            try:
                data = sock.recv(65536)
            except (TimeoutError, OSError):
                return answer
            if not data:
                return answer
            answer += data
            if tls is not None and first and _whole(answer):
                return answer


def _whole(answer: bytes) -> bool:
    """Whether `answer` holds one whole HTTP answer (its head and Content-Length's body)."""
    head, found, body = answer.partition(b"\r\n\r\n")
    if not found:
        return False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(body) >= int(value.strip())
    return False


def statuses(answer: bytes) -> list[int]:
    """The status codes of every answer on a connection, in order."""
    found = []
    for line in answer.split(b"\r\n"):
        if line.startswith(b"HTTP/1."):
            parts = line.split(b" ")
            if len(parts) > 1 and parts[1].isdigit():
                found.append(int(parts[1]))
    return found
