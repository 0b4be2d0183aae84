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

Each key a client may send is known by the client's name (apiKeys; apiKey's is `default`, the program's own
`spark-vllm`): the name, never the key, goes into the log line and into the requests counted per client and
model (a few lines of Lua, COUNTERS_LUA, fed only by what HAProxy parsed: the name it matched and the body's
`model` its own json_query read). What reaches vLLM is the program's own key in place of the client's, so
vLLM's key never changes when a client's does. With `tls` the endpoint's port speaks only HTTPS; the edge's
own port (edge.metricsPort, on its node's fabric address) serves /metrics and the watchdog's check.

HAProxy versions: Debian bookworm's 2.6 (the rehearsal's) and the official image's 3.0 read this the same.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import tarfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

# The routes the endpoint serves, by method; anything else is refused with 404 (405 for another method).
# /health answers without a key, as vLLM's and vllm-router's do (it says only up or down); the rest needs one.
OPEN_ROUTES = {"/health": ("GET", "HEAD")}
KEYED_ROUTES = {"/v1/chat/completions": ("POST",), "/v1/completions": ("POST",), "/v1/models": ("GET", "HEAD")}
MODEL_CARD_PREFIX = "/v1/models/"  # GET /v1/models/<id>: one model's card
ROUTES = {**OPEN_ROUTES, **KEYED_ROUTES}

CONFIG_DIR = "/etc/spark-vllm-edge"  # the edge container's volume: haproxy.cfg and the files it names
CONFIG_FILE = f"{CONFIG_DIR}/haproxy.cfg"
# What the edge's own watchdog asks (components/scripts/edge_entry.sh) at the configuration's first `bind`, the
# edge's own port: answered by HAProxy itself, without the upstream, and only to the edge's own host.
ALIVE_PATH = "/spark-vllm-edge/alive"
NO_KEY_CLIENT = "anonymous"  # the client's name in the log and the counter where no key is asked for
OTHER_MODEL = "other"  # a `model` that is not one the stack serves (the counter's labels stay few)

# The requests counted per client and model, served at /metrics of the edge's own port. Counters live in the
# worker: a reload (a change of keys) starts them at 0, which Prometheus' rate() reads as a reset.
COUNTERS_LUA = """-- spark-vllm's edge: requests per client and model (components/plan/edge.py)
local counts = {}
local function label(value)
  return (value:gsub("\\\\", "\\\\\\\\"):gsub('"', '\\\\"'):gsub("\\n", "\\\\n"))
end
core.register_action("spark_vllm_count", { "http-req" }, function(txn)
  local key = (txn:get_var("txn.client") or "-") .. "\\0" .. (txn:get_var("txn.model") or "-")
  counts[key] = (counts[key] or 0) + 1
end, 0)
core.register_service("spark_vllm_metrics", "http", function(applet)
  local lines = {
    "# HELP spark_vllm_edge_requests_total Requests the edge passed on, by client (apiKeys' name) and model",
    "# TYPE spark_vllm_edge_requests_total counter",
  }
  local keys = {}
  for key in pairs(counts) do keys[#keys + 1] = key end
  table.sort(keys)
  for _, key in ipairs(keys) do
    local client, model = key:match("^(.-)\\0(.*)$")
    lines[#lines + 1] = string.format('spark_vllm_edge_requests_total{client="%s",model="%s"} %d',
      label(client), label(model), counts[key])
  end
  local body = table.concat(lines, "\\n") .. "\\n"
  applet:set_status(200)
  applet:add_header("content-type", "text/plain; version=0.0.4")
  applet:add_header("content-length", tostring(#body))
  applet:start_response()
  applet:send(body)
end)
"""


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
    """One endpoint: where it listens; where it sends what it lets through; the clients it lets in, by name, each
    with its key's digest (key_digest; none: no key is asked for, with allowUnauthenticated); the key it sends
    upstream in place of theirs (the program's own: vLLM's); the model cards it answers /v1/models with itself
    (None: the upstream answers, as vLLM does; vllm-router's own list is not OpenAI's); the names of the models
    served (the counter's `model` label); the PEM it serves HTTPS with (certificate chain then key: None, plain
    HTTP); and its own port (metrics, the watchdog's check)."""

    host: str
    port: int
    upstream_host: str
    upstream_port: int
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 29003
    clients: tuple[tuple[str, str], ...] = ()
    upstream_key: Optional[str] = None
    models: Optional[Sequence[dict[str, Any]]] = None
    model_names: tuple[str, ...] = ()
    tls_pem: Optional[str] = None
    max_connections: int = 1024
    timeouts: Timeouts = field(default_factory=Timeouts)

    def file_named(self, stem: str, suffix: str, text: str) -> str:
        """A file beside haproxy.cfg named by its content, so a new one never replaces the one running."""
        return f"{CONFIG_DIR}/{stem}-{hashlib.sha256(text.encode()).hexdigest()[:16]}{suffix}"

    @property
    def counters_file(self) -> str:
        return self.file_named("counters", ".lua", COUNTERS_LUA)

    @property
    def tls_file(self) -> Optional[str]:
        return None if self.tls_pem is None else self.file_named("tls", ".pem", self.tls_pem)


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


def _global(spec: EdgeSpec) -> list[str]:
    return [
        "global",
        f"    maxconn {spec.max_connections + 64}",
        "    log stdout format raw local0 info",
        f"    hard-stop-after {spec.timeouts.drain}s",
        f"    lua-load {spec.counters_file}",
        "    ssl-default-bind-options ssl-min-ver TLSv1.2 no-tls-tickets",
        "",
    ]


def _defaults(t: Timeouts) -> list[str]:
    return [
        "defaults",
        "    mode http",
        "    log global",
        # HAProxy's httplog, less the cookies, with the client's name and the model (never the key)
        '    log-format "%ci:%cp [%tr] %ft %b/%s %TR/%Tw/%Tc/%Tr/%Ta %ST %B %tsc %ac/%fc/%bc/%sc/%rc %sq/%bq '
        'client=%[var(txn.client)] model=%[var(txn.model)] %{+Q}r"',
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
    ]


def _bind(spec: EdgeSpec) -> str:
    where = f"    bind {spec.host}:{spec.port}"
    if spec.tls_file is None:
        return where
    # HTTP/1.1 only, as without TLS: every rule here is about how HTTP/1.1 is read
    return f"{where} ssl crt {spec.tls_file} alpn http/1.1"


def _clients(spec: EdgeSpec) -> list[str]:
    """txn.client: the name of the client whose key the request carries (the whole Authorization header's sha256
    compared with each digest: the configuration holds no client's key, the comparison's timing says nothing of
    one); no key asked for: every client is NO_KEY_CLIENT. The key is then replaced by the program's own."""
    lines = []
    if spec.clients:
        for name, digest in sorted(spec.clients):
            lines.append(f"    http-request set-var(txn.client) str({name}) "
                         f"if {{ req.fhdr(authorization),sha2(256),hex,lower -m str {digest} }}")  # fmt: skip
        lines.append(
            _answer(401, _error(401, "Unauthorized", "Unauthorized"), "if !open_route !{ var(txn.client) -m found }")
        )
    else:
        lines.append(f"    http-request set-var(txn.client) str({NO_KEY_CLIENT})")
    return lines


def _model(spec: EdgeSpec) -> list[str]:
    """txn.model: the `model` of a completion's body as HAProxy's json_query reads it from the part it buffered
    (http-buffer-request: its first 16 KiB), OTHER_MODEL where that is not a model the stack serves or none was
    found there; unset on the other routes."""
    posted = "{ method POST } !open_route"
    lines = [f"    http-request set-var(txn.model) req.body,json_query('$.model') if {posted}"]
    names = " ".join(quoted(name) for name in sorted(set(spec.model_names)))
    known = f"{{ var(txn.model) -m str {names} }}" if names else "FALSE"
    lines.append(f"    http-request set-var(txn.model) str({OTHER_MODEL}) if {posted} !{known}")
    return lines


def _front(spec: EdgeSpec) -> list[str]:
    lines = [
        "frontend endpoint",
        _bind(spec),
        f"    maxconn {spec.max_connections}",
        "    option http-buffer-request",
        # the target as the upstream will read it: the path HAProxy parsed, in origin-form
        "    http-request set-uri %[pathq]",
        *_route_rules(spec.models is not None),
        _answer(400, _error(400, "one Authorization header", "BadRequest"), "if { req.hdr_cnt(authorization) gt 1 }"),
        # no protocol switch: after a 101 the connection would be a tunnel the edge no longer reads
        _answer(400, _error(400, "no Upgrade", "BadRequest"), "if { req.hdr_cnt(upgrade) gt 0 }"),
        *_clients(spec),
        _answer(404, _error(404, "Not Found", "NotFoundError"), "if !{ var(txn.known) -m bool }"),
        _answer(405, _error(405, "Method Not Allowed", "MethodNotAllowed"), "if !{ var(txn.allowed) -m bool }"),
    ]
    lines += _model(spec)
    lines.append("    http-request lua.spark_vllm_count if !open_route")
    if spec.models is not None:
        lines.extend(_models(spec.models))
    if spec.upstream_key is not None:
        lines.append(f"    http-request set-header authorization {quoted('Bearer ' + spec.upstream_key)}")
    return [*lines, "    default_backend upstream", ""]


def _own(spec: EdgeSpec) -> list[str]:
    """The edge's own port: /metrics for Prometheus (the nodes reach it; network.guard lets only them in), the
    watchdog's check from the edge's own host; nothing else."""
    here = f"{{ src 127.0.0.0/8 {_local(spec.metrics_host)} }}"
    return [
        "frontend edge-own",
        f"    bind {spec.metrics_host}:{spec.metrics_port}",
        "    maxconn 64",
        f"    http-request return status 200 content-type text/plain string alive if {{ path -m str {ALIVE_PATH} }} "
        f"{here}",
        "    http-request use-service lua.spark_vllm_metrics if { path -m str /metrics } { method GET }",
        _answer(404, _error(404, "Not Found", "NotFoundError"), ""),
        "",
    ]


def render(spec: EdgeSpec) -> str:
    """haproxy.cfg for `spec`."""
    return "\n".join(
        [
            "# spark-vllm's edge: rendered by the program (components/plan/edge.py); a `pulumi up` rewrites it",
            *_global(spec),
            *_defaults(spec.timeouts),
            # the edge's own port first: its `bind` is the first, which the watchdog and the configuration step ask
            # (plain HTTP, which the endpoint's port may not speak with `tls`)
            *_own(spec),
            *_front(spec),
            "backend upstream",
            f"    server upstream {spec.upstream_host}:{spec.upstream_port}",
            "",
        ]
    )


def files(spec: EdgeSpec) -> dict[str, str]:
    """Every file the edge's configuration is, by its path: haproxy.cfg and the files it names."""
    found = {CONFIG_FILE: render(spec), spec.counters_file: COUNTERS_LUA}
    if spec.tls_pem is not None:
        found[spec.tls_file] = spec.tls_pem
    return found


def archive(spec: EdgeSpec, directory: str = CONFIG_DIR) -> str:
    """files(spec) as the configuration step's stdin: a tar of their names (relative to CONFIG_DIR), base64;
    `directory`: where they will be instead of CONFIG_DIR (the tests')."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.USTAR_FORMAT) as tar:
        for path, text in sorted(files(spec).items()):
            data = text.replace(CONFIG_DIR + "/", directory.rstrip("/") + "/").encode()
            info = tarfile.TarInfo(path.rsplit("/", 1)[1])
            info.size, info.mode = len(data), 0o600
            tar.addfile(info, io.BytesIO(data))
    return base64.b64encode(buffer.getvalue()).decode() + "\n"
