# The router's front (router_keeper.py's, prepended to it by components.render.SCRIPT_HELPERS): the stack's endpoint
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
import socket
import threading
import time

HEAD_LIMIT = 65536
ADMIN_PATHS = ("/workers", "/add_worker", "/remove_worker", "/list_workers", "/flush_cache", "/get_loads")


class BadRequestError(Exception):
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
        threading.Thread(target=self.accept, daemon=True).start()

    def accept(self):
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self.serve, args=(client,), daemon=True).start()

    def serve(self, client):
        upstream = None
        answering = False  # the last request passed on asked to close: its answer ends the connection (pump)
        reader = client.makefile("rb")
        try:
            while True:
                try:
                    request = read_head(reader)
                except BadRequestError as error:
                    self.reply(client, 400, {"error": {"message": str(error), "type": "BadRequestError", "code": 400}})
                    return
                if request is None:
                    return
                line, headers, raw = request
                parts = line.split(" ")
                method, target = (parts[0], parts[1]) if len(parts) >= 2 else ("", "")
                path = target.split("?", 1)[0]
                keep = dict(headers).get("connection", "").lower() != "close"
                if method == "GET" and (path == "/v1/models" or path.startswith("/v1/models/")):
                    copy_body(reader, headers, lambda data: None)
                    self.models(client, path, dict(headers), keep)
                elif path.startswith(ADMIN_PATHS):
                    copy_body(reader, headers, lambda data: None)
                    self.reply(client, 404, {"error": "not found: vllm-router's admin API is not served here"}, keep)
                else:
                    if upstream is None:
                        upstream = self.connect(client)
                        if upstream is None:
                            return
                    upstream.sendall(raw)
                    copy_body(reader, headers, upstream.sendall)
                    answering = not keep
                if not keep:
                    return
        except (OSError, ValueError, BadRequestError):
            return
        finally:
            reader.close()
            if upstream is not None and not answering:
                try:  # the client went: so does its connection to vllm-router (and the pump with it)
                    upstream.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            elif upstream is None:
                client.close()

    def connect(self, client):
        """A connection to vllm-router whose answers stream back to `client` (a thread copies them)."""
        try:
            upstream = socket.create_connection(self.inner, timeout=10)
        except OSError:
            self.reply(client, 503, {"error": {"message": "the router is starting", "type": "ServiceUnavailable",
                                               "code": 503}}, False)  # fmt: skip
            return None
        upstream.settimeout(None)
        upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=pump, args=(upstream, client), daemon=True).start()
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


def pump(upstream, client):
    """vLLM's answers, through vllm-router, to the client as they come."""
    try:
        while True:
            data = upstream.recv(65536)
            if not data:
                break
            client.sendall(data)
    except OSError:
        pass
    finally:
        try:
            client.shutdown(socket.SHUT_RDWR)  # the router ended the connection: so does the front
        except OSError:
            pass
        client.close()
        upstream.close()


def authorised(header, key_sha256):
    """Whether `Authorization: Bearer <key>` carries the stack's key (compared by its sha256)."""
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return False
    return hmac.compare_digest(hashlib.sha256(token.strip().encode()).hexdigest(), key_sha256)
