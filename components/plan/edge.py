"""The edge: HAProxy in front of the stack's endpoint, the one way in from the network. Pure: the program
renders its configuration here and a step writes it into the edge's container (components/resources/edge.py).

What it lets through, and why a proxy built for the job does it rather than code of our own: the request
target is read by HAProxy's own HTTP parser, which refuses what it cannot read unambiguously (an
absolute-form target whose authority disagrees with Host, a bad header line, a head over its buffer) and
forwards the head it parsed, re-encoded, never the bytes as they came (so a second request hidden in a
body cannot reach the upstream unexamined); the target forwarded is rewritten to the origin-form path it
matched (`set-uri %[pathq]`), and that path must be one of ROUTES *as sent*: no percent-encoding, dot
segment, doubled slash, `;` parameter or other case of a route is let through, because what is not
exactly a route is refused, not normalised (HAProxy 2.6's normalize-uri is still experimental). The key is
checked before anything is forwarded: the whole Authorization header (`Bearer <key>`, as vLLM compares
it) hashed with sha256 and compared with the keys' digests, so the configuration holds no key and the
comparison's timing says nothing about one. Idle and slow clients time out, connections are capped, and a
failed accept pauses the listener instead of ending it.

HAProxy versions: Debian bookworm's 2.6 (the rehearsal's) and the official image's 3.0 read this the same.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

# The routes the endpoint serves, by method; anything else is refused with 404 (405 for another method).
# /health answers without a key, as vLLM's and vllm-router's do (it says only up or down); the rest needs one.
OPEN_ROUTES = {"/health": ("GET", "HEAD")}
KEYED_ROUTES = {"/v1/chat/completions": ("POST",), "/v1/completions": ("POST",), "/v1/models": ("GET", "HEAD")}
MODEL_CARD_PREFIX = "/v1/models/"  # GET /v1/models/<id>: one model's card
ROUTES = {**OPEN_ROUTES, **KEYED_ROUTES}

CONFIG_DIR = "/etc/spark-vllm-edge"  # the edge container's volume: haproxy.cfg
CONFIG_FILE = f"{CONFIG_DIR}/haproxy.cfg"
# What the edge's own watchdog asks (components/scripts/edge_entry.sh): answered by HAProxy itself, without the
# upstream, and only to the edge's own host (a request from anywhere else is held to the routes as any other).
ALIVE_PATH = "/spark-vllm-edge/alive"


@dataclass(frozen=True)
class Timeouts:
    """Seconds. `head`: a client's whole request head (slow heads are dropped: slowloris); `idle`: a kept-alive
    connection between requests; `client`: a client silent in the middle of a request or of reading its answer;
    `server`: the upstream silent (a long non-streamed completion sends nothing until it is done); `drain`: how
    long a reload's old process may finish the requests it had."""

    head: int = 10
    idle: int = 60
    client: int = 300
    server: int = 3600
    drain: int = 900


@dataclass(frozen=True)
class EdgeSpec:
    """One endpoint: where it listens, where it sends what it lets through, the keys' digests (key_digest;
    none: no key is asked for, with allowUnauthenticated), and the model cards it answers /v1/models with itself
    (None: the upstream answers, as vLLM does; vllm-router's own list is not OpenAI's)."""

    host: str
    port: int
    upstream_host: str
    upstream_port: int
    key_digests: tuple[str, ...] = ()
    models: Optional[Sequence[dict[str, Any]]] = None
    max_connections: int = 1024
    timeouts: Timeouts = field(default_factory=Timeouts)


def key_digest(api_key: str) -> str:
    """What the edge compares a client's Authorization header with: sha256 of `Bearer <key>`, hex."""
    return hashlib.sha256(f"Bearer {api_key}".encode()).hexdigest()


def quoted(text: str) -> str:
    """`text` as one word of HAProxy's configuration, taken literally: double quotes, in which HAProxy still
    expands `$NAME` and reads backslash escapes, so both are escaped; a control character cannot be written."""
    if any(ord(ch) < 32 or ord(ch) == 127 for ch in text):
        raise ValueError(f"{text!r}: a control character cannot be written into the edge's configuration")
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("$", "\\$") + '"'


def _json(value: Any) -> str:
    return quoted(json.dumps(value, separators=(",", ":"), ensure_ascii=True))


def _error(status: int, message: str, kind: str) -> str:
    return _json({"error": {"message": message, "type": kind, "code": status}})


def _answer(status: int, body: str, condition: str) -> str:
    return f"    http-request return status {status} content-type application/json string {body} {condition}"


def model_card(entry: dict[str, Any], created: int = 0) -> dict[str, Any]:
    """One model as vLLM's /v1/models lists it (vllm/entrypoints/openai/protocol.py ModelCard)."""
    return {
        "id": entry["id"],
        "object": "model",
        "created": created,
        "owned_by": "vllm",
        "root": entry.get("root") or entry["id"],
        "parent": None,
        "max_model_len": entry.get("max_model_len"),
        "permission": [],
    }


def _route_rules(with_cards: bool) -> list[str]:
    """txn.known: the path is a route (or, with cards, a model's card); txn.allowed: and the method is its."""
    lines = ["    acl open_route path -m str " + " ".join(quoted(path) for path in OPEN_ROUTES)]
    for path, methods in ROUTES.items():
        lines.append(f"    http-request set-var(txn.known) bool(1) if {{ path -m str {quoted(path)} }}")
        lines.append(
            f"    http-request set-var(txn.allowed) bool(1) if {{ path -m str {quoted(path)} }} "
            f"{{ method {' '.join(methods)} }}"
        )
    if with_cards:
        card = f"{{ path_beg {quoted(MODEL_CARD_PREFIX)} }}"
        lines.append(f"    http-request set-var(txn.known) bool(1) if {card}")
        lines.append(f"    http-request set-var(txn.allowed) bool(1) if {card} {{ method GET HEAD }}")
    return lines


def _models(models: Sequence[dict[str, Any]]) -> list[str]:
    cards = [model_card(entry) for entry in sorted(models, key=lambda entry: entry["id"])]
    lines = [_answer(200, _json({"object": "list", "data": cards}), "if { path -m str /v1/models }")]
    for card in cards:
        wanted = quoted(MODEL_CARD_PREFIX + card["id"])
        lines.append(_answer(200, _json(card), f"if {{ path,url_dec -m str {wanted} }}"))
    lines.append(
        _answer(
            404, _error(404, "The model does not exist.", "NotFoundError"), f"if {{ path_beg {MODEL_CARD_PREFIX} }}"
        )
    )
    return lines


def _local(host: str) -> str:
    """The address a request from the edge's own host comes from when it is bound to `host`."""
    return "127.0.0.1" if host == "0.0.0.0" else host


def render(spec: EdgeSpec) -> str:
    """haproxy.cfg for `spec`."""
    t = spec.timeouts
    lines = [
        "# spark-vllm's edge: rendered by the program (components/plan/edge.py); a `pulumi up` rewrites it",
        "global",
        f"    maxconn {spec.max_connections + 64}",
        "    log stdout format raw local0 info",
        f"    hard-stop-after {t.drain}s",
        "",
        "defaults",
        "    mode http",
        "    log global",
        "    option httplog",
        "    option http-keep-alive",
        # each streamed token as it comes: without it HAProxy holds small chunks back for more (MSG_MORE), which
        # added 32 ms to the time to first token in the rehearsal (benchmarks/router_hop.py)
        "    option http-no-delay",
        "    timeout connect 5s",
        f"    timeout http-request {t.head}s",
        f"    timeout http-keep-alive {t.idle}s",
        f"    timeout client {t.client}s",
        f"    timeout server {t.server}s",
        "    timeout client-fin 5s",
        "    timeout server-fin 5s",
        "",
        "frontend endpoint",
        f"    bind {spec.host}:{spec.port}",
        f"    maxconn {spec.max_connections}",
        # the target as the upstream will read it: the path HAProxy parsed, in origin-form
        "    http-request set-uri %[pathq]",
        f"    http-request return status 200 content-type text/plain string alive if {{ path -m str {ALIVE_PATH} }} "
        f"{{ src 127.0.0.0/8 {_local(spec.host)} }}",
        *_route_rules(spec.models is not None),
        _answer(400, _error(400, "one Authorization header", "BadRequest"), "if { req.hdr_cnt(authorization) gt 1 }"),
        # no protocol switch: after a 101 the connection would be a tunnel the edge no longer reads
        _answer(400, _error(400, "no Upgrade", "BadRequest"), "if { req.hdr_cnt(upgrade) gt 0 }"),
    ]
    if spec.key_digests:
        digests = " ".join(sorted(set(spec.key_digests)))
        lines.append(f"    acl keyed req.fhdr(authorization),sha2(256),hex,lower -m str {digests}")
        lines.append(_answer(401, _error(401, "Unauthorized", "Unauthorized"), "if !open_route !keyed"))
    lines.append(_answer(404, _error(404, "Not Found", "NotFoundError"), "if !{ var(txn.known) -m bool }"))
    lines.append(
        _answer(405, _error(405, "Method Not Allowed", "MethodNotAllowed"), "if !{ var(txn.allowed) -m bool }")
    )
    if spec.models is not None:
        lines.extend(_models(spec.models))
    lines += [
        "    default_backend upstream",
        "",
        "backend upstream",
        f"    server upstream {spec.upstream_host}:{spec.upstream_port}",
        "",
    ]
    return "\n".join(lines)
