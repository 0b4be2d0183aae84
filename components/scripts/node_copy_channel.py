# The authenticated channel of the fabric copy (node_fabric_copy.py imports it): the client proves the stack's copy
# token with an HMAC over both sides' nonces (the token never crosses the link), the depot proves it back, both
# derive per-direction keys, and every frame carries an HMAC over its sequence number, kind and payload. Standard
# library only, no side effects.
import hashlib
import hmac
import json
import os
import socket
import struct

from components.scripts.node_timing import polls

MAGIC = b"spark-vllm-copy/1\n"
FRAME = 4 << 20  # bytes of payload per data frame
MAX_FRAME = 16 << 20
HEADER = struct.Struct(">cI")  # kind, payload length


class CopyError(Exception):
    pass


# --- the authenticated channel ---------------------------------------------------------------------


def mac(key, *parts):
    digest = hmac.new(key, digestmod=hashlib.sha256)
    for part in parts:
        digest.update(part)
    return digest.digest()


def read_exact(sock, count):
    buffer = bytearray(count)
    view, got = memoryview(buffer), 0
    while got < count:
        n = sock.recv_into(view[got:], count - got)
        if n == 0:
            raise CopyError(f"the connection closed after {got} of {count} bytes")
        got += n
    return buffer


class Channel:
    """Frames (kind, payload) with an HMAC over (sequence number, kind, length, payload) each."""

    def __init__(self, sock, send_key, receive_key):
        self.sock, self.send_key, self.receive_key = sock, send_key, receive_key
        self.sent = self.received = 0

    def send(self, kind, payload=b""):
        header = HEADER.pack(kind, len(payload))
        tag = mac(self.send_key, struct.pack(">Q", self.sent), header, payload)
        self.sent += 1
        if len(payload) < 65536:
            self.sock.sendall(header + bytes(payload) + tag)
        else:  # no copy of a large payload
            for part in (header, payload, tag):
                self.sock.sendall(part)

    def send_json(self, value):
        self.send(b"J", json.dumps(value).encode())

    def receive(self):
        kind, length = HEADER.unpack(read_exact(self.sock, HEADER.size))
        if length > MAX_FRAME:
            raise CopyError(f"a frame of {length} bytes: not from a depot of this stack")
        payload = read_exact(self.sock, length)
        tag = read_exact(self.sock, 32)
        expected = mac(self.receive_key, struct.pack(">Q", self.received), HEADER.pack(kind, length), payload)
        if not hmac.compare_digest(bytes(tag), expected):
            raise CopyError("a frame failed its integrity check (corrupted, or not from this stack's depot)")
        self.received += 1
        if kind == b"X":
            raise CopyError(f"the depot says: {payload.decode(errors='replace')}")
        return kind, payload

    def receive_json(self):
        kind, payload = self.receive()
        if kind != b"J":
            raise CopyError(f"expected a message, got a frame of kind {kind!r}")
        return json.loads(payload)


def keys(token, nonce_server, nonce_client):
    return (
        mac(token, b"to-client", nonce_server, nonce_client),
        mac(token, b"to-server", nonce_server, nonce_client),
    )


def accept(sock, token):
    """The depot's side of the handshake: a Channel, or CopyError for a client without the token."""
    nonce_server = os.urandom(32)
    sock.sendall(MAGIC + nonce_server)
    answer = read_exact(sock, 64)
    nonce_client, proof = bytes(answer[:32]), bytes(answer[32:])
    if not hmac.compare_digest(proof, mac(token, b"client", nonce_server, nonce_client)):
        raise CopyError("a client without this stack's copy token")
    sock.sendall(mac(token, b"server", nonce_client, nonce_server))
    to_client, to_server = keys(token, nonce_server, nonce_client)
    return Channel(sock, to_client, to_server)


def connect(address, port, token, source, wait_seconds=30):
    """A Channel to the depot; it may still be starting, or busy with connections that have yet to prove the token
    (it closes more than it takes at once without a greeting), so a refused or closed connection is tried again.
    `source`: the node the depot serves, for the message."""
    error = None
    for _ in polls(wait_seconds, 0.5):
        try:
            sock = socket.create_connection((address, port), timeout=10)
            sock.settimeout(120)
            hello = read_exact(sock, len(MAGIC) + 32)
            break
        except (CopyError, OSError) as caught:
            error = caught
    else:
        raise CopyError(
            f"cannot reach the depot of {source} at {address}:{port} over the fabric, or it did not greet: {error}"
        ) from error
    if bytes(hello[: len(MAGIC)]) != MAGIC:
        raise CopyError(f"{address}:{port} is not a spark-vllm depot")
    nonce_server, nonce_client = bytes(hello[len(MAGIC) :]), os.urandom(32)
    sock.sendall(nonce_client + mac(token, b"client", nonce_server, nonce_client))
    try:
        proof = bytes(read_exact(sock, 32))
    except CopyError:
        proof = b""
    if not hmac.compare_digest(proof, mac(token, b"server", nonce_client, nonce_server)):
        raise CopyError(f"the depot at {address}:{port} refused this stack's copy token, or does not hold it")
    to_client, to_server = keys(token, nonce_server, nonce_client)
    return Channel(sock, to_server, to_client)


# --- the Docker Engine API over its unix socket -----------------------------------------------------
