"""The attack table, shared by the edge's own tests (a real HAProxy on loopback, tests/unit/test_edge.py) and the
rehearsal (the deployed endpoint from the management network, tests/e2e): spellings of the same few intents —
reach vllm-router's admin API or vLLM's routes that its key does not guard, get a completion without the key,
smuggle a request past the edge — each of which must be refused."""

from __future__ import annotations

from tests.edge_harness import exchange, statuses

CHAT_BODY = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":4}'

# What must never reach an upstream: vllm-router's admin API (unauthenticated in 0.1.17) and vLLM's routes that
# its --api-key does not guard (vllm/entrypoints/serve/utils/server_utils.py GUARDED_PREFIX: /v1, /v2, /inference
# only) or that are not the endpoint's to serve (REFERENCE.md, "Who gets in without a key").
FORBIDDEN = (
    "/workers", "/add_worker?url=http://127.0.0.1:9", "/remove_worker?url=http://x", "/list_workers",
    "/flush_cache", "/get_loads", "/invocations", "/tokenize", "/detokenize", "/pooling", "/classify", "/score",
    "/rerank", "/v1/rerank", "/metrics", "/pause", "/resume", "/sleep", "/wake_up", "/reset_prefix_cache",
    "/collective_rpc", "/v1/load_lora_adapter", "/server_info", "/v2/rerank", "/inference/v1/generate",
)  # fmt: skip
REFUSED = (400, 401, 404, 405)


def spellings(path: str, host: str) -> list[str]:
    """One target written the ways an HTTP/1.1 parser might read as `path`."""
    bare = path.split("?", 1)[0]
    name = bare.lstrip("/")
    return [
        path,
        f"http://{host}{path}",  # absolute-form, the Host header agreeing
        f"http://x{path}",  # absolute-form, the Host header disagreeing
        f"/{path}",  # a doubled slash
        f"/v1/..{path}",  # dot segments
        f"/v1/chat/completions/../..{path}",
        f"/v1/./.{path}",
        f"/v1/models/%2e%2e/%2e%2e{path}",  # encoded dot segments
        "/%" + format(ord(name[0]), "02x") + name[1:],  # a percent-encoded first letter
        "/%" + format(ord(name[0]), "02X") + name[1:],
        "/" + name.upper(),  # another case
        f"{bare};x",  # a `;` parameter
        f"/v1/chat/completions;/../..{path}",
        f"/v1/chat/completions%2F..%2F..{bare}",
        f"/v1/chat/completions/..%2F..{bare}",
    ]


def request(method: str, target: str, host: str, key: str | None, body: bytes = b"", version="HTTP/1.1") -> bytes:
    head = f"{method} {target} {version}\r\nHost: {host}\r\nConnection: close\r\n"
    if key is not None:
        head += f"Authorization: Bearer {key}\r\n"
    if body or method == "POST":
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    return head.encode("latin-1") + b"\r\n" + body


HIDDEN = b"GET /workers HTTP/1.1\r\nHost: x\r\n\r\n"


def smuggled(key: str, framing: bytes, body: bytes) -> bytes:
    return (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: h\r\nAuthorization: Bearer " + key.encode() + b"\r\n" + framing
        + b"\r\n" + body
    )  # fmt: skip


def smuggling(key: str) -> dict[str, bytes]:
    """Requests whose framing two HTTP parsers may read differently, each hiding GET /workers after a chat."""
    hidden = b"0\r\n\r\n" + HIDDEN
    return {
        "Transfer-Encoding and Content-Length": smuggled(key, b"Content-Length: 44\r\nTransfer-Encoding: chunked\r\n", hidden),
        "Content-Length then Transfer-Encoding": smuggled(key, b"Transfer-Encoding: chunked\r\nContent-Length: 5\r\n", hidden),
        "a header line ended by a bare LF": smuggled(key, b"X-A: 1\nTransfer-Encoding: chunked\r\nContent-Length: 44\r\n", hidden),
        "Transfer-Encoding with an obs-fold": smuggled(key, b"Transfer-Encoding:\r\n chunked\r\nContent-Length: 44\r\n", hidden),
        "Transfer-Encoding not chunked": smuggled(key, b"Transfer-Encoding: identity\r\nContent-Length: 44\r\n", hidden),
        "two Content-Lengths": smuggled(key, b"Content-Length: 0\r\nContent-Length: 44\r\n", HIDDEN),
        "a space before the colon": smuggled(key, b"Transfer-Encoding : chunked\r\nContent-Length: 44\r\n", hidden),
        "a chunk size with garbage": smuggled(key, b"Transfer-Encoding: chunked\r\n", b"0x\r\n\r\n" + HIDDEN),
    }  # fmt: skip


def refusals(host: str, port: int, key: str, paths=FORBIDDEN, tls=None) -> list[str]:
    """Every spelling of every path, with no key, a wrong one and the right one, by GET, POST and DELETE: what
    was not refused (an empty list when all were). `tls`: the endpoint speaks HTTPS, verified with this context."""
    let_through = []
    for path in paths:
        for target in spellings(path, f"{host}:{port}"):
            for who in (None, "wrong-key", key):
                for method in ("GET", "POST", "DELETE"):
                    raw = request(method, target, f"{host}:{port}", who, b"{}")
                    answer = exchange(port, raw, host=host, tls=tls)
                    found = statuses(answer)
                    if not found or found[0] not in REFUSED:
                        let_through.append(f"{method} {target} (key {who!r}): {answer[:120]!r}")
    return let_through
