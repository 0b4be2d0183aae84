# The router's front (router_keeper.py's, prepended to it by components.plan.programs.SCRIPT_HELPERS): the endpoint
# itself, on router.port, in front of vllm-router on loopback (router.innerPort). Clients discover models with
# `GET /v1/models` (the OpenAI SDK's models.list(), chat front ends, gateways) and expect OpenAI's list; vllm-router
# 0.1.17 answers its own {"models": [...]} there, and a 500 while a worker is down (its issue 135). So the front
# answers /v1/models and /v1/models/<id> itself, as vLLM does, with every model the stack declares (a drained or
# down replica's too: its model is still served), checking the API key as vLLM would; it refuses vllm-router's
# admin API (/workers, /add_worker, … : unauthenticated in 0.1.17), which the keeper reaches on loopback; and it
# passes everything else on as bytes: each request's head and body as it came, and the answer streamed back as
# vllm-router sends it, chunk by chunk, on one connection to vllm-router per client connection.
#
# The front reads requests, not answers: an answer ends where vllm-router ends it, and a client sends its next
# request on a connection only after the last answer (HTTP/1.1 clients do not pipeline: curl, httpx, requests,
# aiohttp, browsers). Standard library only.
import hashlib
import hmac
import json
import queue
import select
import socket
import threading
import time


class Threads:
    """Daemon threads kept for the connections (one a connection, both ways: Connection): started when none
    is idle and reused after, not one started a connection (a start cost 0.1-0.15 ms of the hop, measured here);
    daemons, so a stopping keeper does not wait for its clients."""

    def __init__(self):
        self.work = queue.SimpleQueue()
        self.idle = 0
        self.lock = threading.Lock()

    def submit(self, function, *args):
        with self.lock:
            start = self.idle == 0
            if not start:
                self.idle -= 1
        if start:
            threading.Thread(target=self.worker, daemon=True).start()
        self.work.put((function, args))

    def worker(self):
        while True:
            function, args = self.work.get()
            try:
                function(*args)
            except Exception:  # noqa: BLE001 - one connection's failure is its own
                pass
            with self.lock:
                self.idle += 1


THREADS = Threads()

HEAD_LIMIT = 65536
ADMIN_PATHS = ("/workers", "/add_worker", "/remove_worker", "/list_workers", "/flush_cache", "/get_loads")


class BadRequestError(Exception):
    pass


class Connection:
    """A client's connection and, once a request went on, its connection to vllm-router, served by one thread:
    while it waits for the client's next bytes it passes vllm-router's answer back as it comes (select on both),
    so an answer streams without a second thread's wake-up on its way."""

    def __init__(self, client):
        self.client, self.upstream, self.buf = client, None, b""

    def fill(self):
        """More of the client's bytes in `buf` (False at their end), relaying vllm-router's meanwhile."""
        while True:
            watched = [self.client] if self.upstream is None else [self.client, self.upstream]
            ready, _, _ = select.select(watched, [], [])
            if self.upstream is not None and self.upstream in ready:
                self.relay()
            if self.client in ready:
                data = self.client.recv(65536)
                if not data:
                    return False
                self.buf += data
                return True

    def relay(self):
        """vLLM's answer, through vllm-router, on to the client; vllm-router ending the connection ends this one."""
        data = self.upstream.recv(65536)
        if not data:
            raise ConnectionEndedError
        self.client.sendall(data)

    def finish(self):
        """The client asked to close: its answer comes to its end (vllm-router closes after it), then so does this."""
        try:
            while self.upstream is not None:
                self.relay()
        except (ConnectionEndedError, OSError):
            return

    def readline(self, limit):
        while b"\n" not in self.buf:
            if len(self.buf) > limit:
                raise BadRequestError("request head too large")
            if not self.fill():
                line, self.buf = self.buf, b""
                return line
        line, _, self.buf = self.buf.partition(b"\n")
        return line + b"\n"

    def read(self, count):
        """Up to `count` bytes (what is there, or after one wait): b"" at the client's end."""
        if not self.buf and not self.fill():
            return b""
        data, self.buf = self.buf[:count], self.buf[count:]
        return data


class ConnectionEndedError(Exception):
    pass


def read_head(reader):
    """(request line, [(name, value)], raw bytes) of the next request, or None at the end of the connection."""
    raw = b""
    while True:
        line = reader.readline(HEAD_LIMIT + 1)
        if not line:
            if raw.strip():
                raise BadRequestError("the connection ended inside a request head")
            return None
        raw += line
        if len(raw) > HEAD_LIMIT:
            raise BadRequestError("request head too large")
        if line in (b"\r\n", b"\n"):
            if raw.strip() == b"":  # a stray empty line between requests
                raw = b""
                continue
            break
    lines = raw.decode("latin-1").split("\r\n" if b"\r\n" in raw else "\n")
    headers = []
    for text in lines[1:]:
        if not text:
            continue
        name, sep, value = text.partition(":")
        if not sep:
            raise BadRequestError(f"malformed header line {text[:80]!r}")
        headers.append((name.strip().lower(), value.strip()))
    return lines[0], headers, raw


def copy_body(reader, headers, send):
    """Passes the request's body on (Content-Length or chunked), as it came."""
    fields = dict(headers)
    if "chunked" in fields.get("transfer-encoding", "").lower():
        while True:
            size_line = reader.readline(HEAD_LIMIT)
            if not size_line:
                raise BadRequestError("the connection ended inside a chunked body")
            send(size_line)
            size = int(size_line.split(b";", 1)[0].strip() or b"0", 16)
            if size == 0:
                while True:  # trailers, then the empty line
                    trailer = reader.readline(HEAD_LIMIT)
                    send(trailer)
                    if trailer in (b"\r\n", b"\n", b""):
                        return
            copy_exact(reader, size + 2, send)
        return
    length = fields.get("content-length")
    if length:
        if not length.isdigit():
            raise BadRequestError(f"Content-Length {length!r}")
        copy_exact(reader, int(length), send)


def copy_exact(reader, count, send):
    while count > 0:
        data = reader.read(min(count, 65536))
        if not data:
            raise BadRequestError("the connection ended inside a body")
        send(data)
        count -= len(data)


class Front:
    """The endpoint: answers /v1/models from `catalogue()` ([{id, root, max_model_len}], and the key's sha256 or
    None), refuses the admin API, passes the rest to vllm-router at `inner`."""

    def __init__(self, host, port, inner, catalogue, say):
        self.host, self.port, self.inner = host, port, inner
        self.catalogue, self.say = catalogue, say
        self.created = int(time.time())
        self.sock = None

    def start(self):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((self.host, self.port))
        self.sock.listen(512)
        THREADS.submit(self.accept)

    def accept(self):
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            THREADS.submit(self.serve, client)

    def serve(self, client):
        conn = Connection(client)
        try:
            while True:
                try:
                    request = read_head(conn)
                except BadRequestError as error:
                    self.reply(client, 400, {"error": {"message": str(error), "type": "BadRequest", "code": 400}})
                    return
                if request is None:
                    return
                line, headers, raw = request
                parts = line.split(" ")
                method, target = (parts[0], parts[1]) if len(parts) >= 2 else ("", "")
                path = target.split("?", 1)[0]
                keep = dict(headers).get("connection", "").lower() != "close"
                if method == "GET" and (path == "/v1/models" or path.startswith("/v1/models/")):
                    copy_body(conn, headers, lambda data: None)
                    self.models(client, path, dict(headers), keep)
                elif path.startswith(ADMIN_PATHS):
                    copy_body(conn, headers, lambda data: None)
                    self.reply(client, 404, {"error": "not found: vllm-router's admin API is not served here"}, keep)
                else:
                    if conn.upstream is None:
                        conn.upstream = self.connect(client)
                        if conn.upstream is None:
                            return
                    conn.upstream.sendall(raw)
                    copy_body(conn, headers, conn.upstream.sendall)
                    if not keep:
                        conn.finish()
                if not keep:
                    return
        except (OSError, ValueError, BadRequestError, ConnectionEndedError):
            return
        finally:
            for sock in (conn.upstream, client):
                if sock is not None:
                    try:
                        sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                    sock.close()

    def connect(self, client):
        """A connection to vllm-router for this client's requests."""
        try:
            upstream = socket.create_connection(self.inner, timeout=10)
        except OSError:
            self.reply(client, 503, {"error": {"message": "the router is starting", "type": "ServiceUnavailable",
                                               "code": 503}}, False)  # fmt: skip
            return None
        upstream.settimeout(None)
        upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return upstream

    def models(self, client, path, headers, keep):
        entries, key_sha256 = self.catalogue()
        if key_sha256 and not authorised(headers.get("authorization", ""), key_sha256):
            return self.reply(client, 401, {"error": "Unauthorized"}, keep)
        listed = [self.model_card(entry) for entry in entries]
        if path == "/v1/models":
            return self.reply(client, 200, {"object": "list", "data": listed}, keep)
        wanted = path[len("/v1/models/") :]
        found = next((card for card in listed if card["id"] == wanted), None)
        if found is None:
            message = f"The model `{wanted}` does not exist."
            return self.reply(client, 404, {"error": {"message": message, "type": "NotFoundError", "code": 404}}, keep)
        return self.reply(client, 200, found, keep)

    def model_card(self, entry):
        """One model as vLLM's /v1/models lists it (vllm/entrypoints/openai/protocol.py ModelCard)."""
        return {
            "id": entry["id"],
            "object": "model",
            "created": self.created,
            "owned_by": "vllm",
            "root": entry.get("root") or entry["id"],
            "parent": None,
            "max_model_len": entry.get("max_model_len"),
            "permission": [],
        }

    def reply(self, client, status, body, keep=True):
        data = json.dumps(body).encode()
        reason = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 503: "Service Unavailable"}
        head = (
            f"HTTP/1.1 {status} {reason.get(status, '')}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: {'keep-alive' if keep else 'close'}\r\n\r\n"
        )
        client.sendall(head.encode() + data)


def authorised(header, key_sha256):
    """Whether `Authorization: Bearer <key>` carries the stack's key (compared by its sha256)."""
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return False
    return hmac.compare_digest(hashlib.sha256(token.strip().encode()).hexdigest(), key_sha256)
