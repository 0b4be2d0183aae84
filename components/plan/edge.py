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
comparison's timing says nothing about one.

Under hostile load (docs/security.md, "What the edge promises under load"):
* HTTP/1.1 only (`proto h1` on every bind, TLS included, whatever ALPN says): an HTTP/2 preface or an h2c
  upgrade is a 400 and the connection closed. HTTP/2 would let one connection carry a hundred requests, each
  holding an upstream socket, and live past a reload with the keys it was opened under; every rule here is
  about how HTTP/1.1 is read.
* Nothing without a key reaches the upstream: /health is answered by the edge from its own checks of the
  upstream, and every refusal (400, 401, 404, 405) closes its connection, so a client without a key holds a
  connection for one request at most, and only for as long as its head may take (`timeout http-request`).
  The key is checked before a body is waited for; a body has its own timeout (`wait-for-body`).
* Per source address: at most `per_source_connections` at once, and at most `keyless_per_source` connections
  in any 10 s that carried no request with a key (refused, bad, idle or /health); past either, its new
  connections are closed at accept, unlogged. A keyed client from another address is served meanwhile.
* The watchdog's check (edge_entry.sh) has a listener of its own on loopback, which no client from the
  network reaches; the edge's own port (metrics) has its own small caps and short timeouts.
* A reload (a key removed or replaced) closes the old process's idle connections at once and the others after
  the answer in flight; that answer may take `timeouts.drain` at most (`hard-stop-after`).
* The log has no query string (a key sent as `?api_key=` is not written), and what a source without a key can
  make it write is bounded by the limits above.

Each key a client may send is known by the client's name (apiKeys; apiKey's is `default`, the program's own
`spark-vllm`): the name, never the key, goes into the log line and into the requests counted per client and
model (a few lines of Lua, EDGE_LUA, fed only by what HAProxy parsed: the name it matched and the body's
top-level `model` as vLLM's JSON reads it — a body that names it twice is refused, for vLLM would serve the
last). What reaches vLLM is the program's own key in place of the client's, so vLLM's key never changes when a
client's does. With `tls` the endpoint's port speaks only HTTPS; the edge's own port (edge.metricsPort, on its
node's fabric address) serves /metrics.

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
ALIVE_HOST = "127.0.0.1"  # where that check is answered: loopback, at the edge's own port, no client reaches it
NO_KEY_CLIENT = "anonymous"  # the client's name in the log and the counter where no key is asked for
OTHER_MODEL = "other"  # a `model` that is not one the stack serves (the counter's labels stay few)

# What the edge's Lua does, fed only by what HAProxy parsed: the requests counted per client and model, served at
# /metrics of the edge's own port, and the model a completion is counted under: its body's top-level `model` as
# Python's json reads it (vLLM's), found by a scan that knows JSON's strings and nesting. Python keeps the last of
# two `model`s, so a body that names it twice is refused (txn.model_twice); a body the buffer holds only the start
# of is counted as OTHER_MODEL (another `model` could follow). Counters live in the worker: a reload (a change of
# keys) starts them at 0, which Prometheus' rate() reads as a reset.
COUNTERS_LUA = r"""-- spark-vllm's edge: requests per client and model (components/plan/edge.py)
local counts = {}
local function label(value)
  return (value:gsub("\\", "\\\\"):gsub('"', '\\"'):gsub("\n", "\\n"))
end

local escapes = { ['"'] = '"', ["\\"] = "\\", ["/"] = "/", b = "\b", f = "\f", n = "\n", r = "\r", t = "\t" }
-- the text between a JSON string's quotes, its escapes read as Python's json reads them (nil: one it refuses)
local function decoded(raw)
  if not raw:find("\\", 1, true) then return raw end
  local out, i = {}, 1
  while true do
    local j = raw:find("\\", i, true)
    if not j then out[#out + 1] = raw:sub(i); return table.concat(out) end
    out[#out + 1] = raw:sub(i, j - 1)
    local c = raw:sub(j + 1, j + 1)
    if c == "u" then
      local hex = raw:match("^%x%x%x%x", j + 2)
      if not hex then return nil end
      local code = tonumber(hex, 16)
      i = j + 6
      local low = raw:match("^\\u(%x%x%x%x)", i)
      if code >= 0xD800 and code <= 0xDBFF and low and tonumber(low, 16) >= 0xDC00 and tonumber(low, 16) <= 0xDFFF then
        code = 0x10000 + (code - 0xD800) * 0x400 + (tonumber(low, 16) - 0xDC00)
        i = i + 6
      end
      out[#out + 1] = utf8.char(code)
    elseif escapes[c] then
      out[#out + 1] = escapes[c]
      i = j + 2
    else
      return nil
    end
  end
end

-- (model, count, whole): the top level's `model` when it is a string, how many times the top level names
-- `model` (a key spelled with escapes included), and whether the object ended within `body`
local function top_level_model(body)
  local i = body:find("[^ \t\r\n]")
  if not i or body:byte(i) ~= 123 then return nil, 0, false end
  local depth, count, model, key_next, key, value_of = 0, 0, nil, false, nil, nil
  while true do
    local j = body:find('[%[%]{}",:]', i)
    if not j then return model, count, false end
    local c = body:byte(j)
    if c == 34 then
      local k = j + 1
      while true do
        local q = body:find('["\\]', k)
        if not q then return model, count, false end
        if body:byte(q) == 92 then k = q + 2 else k = q; break end
      end
      if depth == 1 then
        local text = decoded(body:sub(j + 1, k - 1))
        if key_next then
          key, key_next = text, false
          if key == "model" then count = count + 1 end
        elseif value_of == "model" then
          model = text
        end
      end
      value_of = nil
      i = k + 1
    else
      if c == 123 or c == 91 then
        depth = depth + 1
        key_next = depth == 1
        value_of = nil
      elseif c == 125 or c == 93 then
        depth = depth - 1
        if depth == 0 then return model, count, true end
      elseif c == 44 and depth == 1 then
        key_next, value_of = true, nil
      elseif c == 58 and depth == 1 then
        value_of = key
      end
      i = j + 1
    end
  end
end

core.register_action("spark_vllm_model", { "http-req" }, function(txn)
  local model, count, whole = top_level_model(txn.sf:req_body() or "")
  if count > 1 then txn:set_var("txn.model_twice", true) end
  if whole and count == 1 and model then txn:set_var("txn.model", model) end
end, 0)

core.register_action("spark_vllm_count", { "http-req" }, function(txn)
  local key = (txn:get_var("txn.client") or "-") .. "\0" .. (txn:get_var("txn.model") or "-")
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
    local client, model = key:match("^(.-)\0(.*)$")
    lines[#lines + 1] = string.format('spark_vllm_edge_requests_total{client="%s",model="%s"} %d',
      label(client), label(model), counts[key])
  end
  local body = table.concat(lines, "\n") .. "\n"
  applet:set_status(200)
  applet:add_header("content-type", "text/plain; version=0.0.4")
  applet:add_header("content-length", tostring(#body))
  applet:start_response()
  applet:send(body)
end)
"""

# The upstream's /health as the edge checks it (the edge answers /health from this; no client's reaches it):
# every CHECK_INTERVAL s while it answers, every second once it did not or is down; down after two misses, up
# after one answer.
CHECK = "check inter 5s fastinter 1s downinter 1s fall 2 rise 1"
CHECK_HOST = "spark-vllm-edge-check"  # the Host its checks carry (the tests' upstream tells them apart by it)
# How long a step that asks through the edge (the endpoint's and the router's smoke tests) first waits for the edge's
# /health to say 200: it answers from its last check, which lags a vLLM that just became ready (or an edge just
# reloaded) by up to an interval, a check itself taking up to `inter` (no `timeout check`); four intervals leave room
# for a busy node. A request sent at once could meet the edge's 503 (CI of af08edc: test_stalls' first up).
SEES_UPSTREAM_SECONDS = 20
# The edge's own port: Prometheus' scrapes from the nodes; a few connections, short timeouts.
OWN_CONNECTIONS, OWN_PER_SOURCE = 64, 8
ALIVE_CONNECTIONS = 16  # the watchdog's listener (loopback): one check every few seconds
RATE_PERIOD = "10s"  # the period keyless_per_source counts over


@dataclass(frozen=True)
class Timeouts:
    """Seconds. `head`: a client's whole request head (slow heads are dropped: slowloris); `body`: the start of a
    keyed request's body (what the edge reads before passing it on: the whole body, or its first 16 KiB);
    `idle`: a kept-alive connection between requests; `client`: a client silent in the middle of a request or of
    reading its answer; `server`: the upstream silent (a long non-streamed completion sends nothing until it is
    done); `drain`: how long a reload's old process may finish the requests it had (a removed key's request in
    flight included)."""

    head: int = 10
    body: int = 30
    idle: int = 60
    client: int = 300
    server: int = 3600
    drain: int = 300


@dataclass(frozen=True)
class EdgeSpec:
    """One endpoint: where it listens; where it sends what it lets through; the clients it lets in, by name, each
    with its key's digest (key_digest; none: no key is asked for, with allowUnauthenticated); the key it sends
    upstream in place of theirs (the program's own: vLLM's); the model cards it answers /v1/models with itself
    (None: the upstream answers, as vLLM does; vllm-router's own list is not OpenAI's); the names of the models
    served (the counter's `model` label); the PEM it serves HTTPS with (certificate chain then key: None, plain
    HTTP); its own port (metrics on `metrics_host`, the watchdog's check on loopback); and the limits a source
    address is held to: connections at once, and connections in any 10 s that carried no keyed request."""

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
    per_source_connections: int = 256
    keyless_per_source: int = 100
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


def _answer(status: int, body: str, condition: str, close: bool = False) -> str:
    """The edge's own answer; `close`: and the connection closed after it (a refusal: the client has no
    connection left to try again on)."""
    closing = " hdr connection close" if close else ""
    return f"    http-request return status {status} content-type application/json string {body}{closing} {condition}"


def _refuse(status: int, message: str, kind: str, condition: str) -> str:
    return _answer(status, _error(status, message, kind), condition, close=True)


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
    lines.append(_refuse(404, "The model does not exist.", "NotFoundError", f"if {{ path_beg {MODEL_CARD_PREFIX} }}"))
    return lines


def _global(spec: EdgeSpec) -> list[str]:
    return [
        "global",
        # each listener's own cap, so that none can take another's room (the watchdog's in particular)
        f"    maxconn {spec.max_connections + OWN_CONNECTIONS + ALIVE_CONNECTIONS}",
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
        # HAProxy's httplog, less the cookies and the query string (a key sent as ?api_key= is never written), with
        # the client's name and the model (never the key)
        '    log-format "%ci:%cp [%tr] %ft %b/%s %TR/%Tw/%Tc/%Tr/%Ta %ST %B %tsc %ac/%fc/%bc/%sc/%rc %sq/%bq '
        'client=%[var(txn.client)] model=%[var(txn.model)] \\"%HM %HPO %HV\\""',
        # a connection that sent nothing (a port scan, an idle client dropped) writes no line
        "    option dontlognull",
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
    # HTTP/1.1 only, plain or in TLS whatever the client's ALPN says: an HTTP/2 preface is a 400, closed
    where = f"    bind {spec.host}:{spec.port} proto h1"
    if spec.tls_file is None:
        return where
    return f"{where} ssl crt {spec.tls_file} alpn http/1.1"


def _per_source(spec: EdgeSpec) -> list[str]:
    """Per source address (sc0): connections at once (conn_cur), connections accepted (gpc0) and requests passed on
    with a key (gpc1) in RATE_PERIOD. Past per_source_connections at once, or past keyless_per_source more
    connections than keyed requests in the period, a new connection is closed at accept (unlogged): a keyed client
    on its kept-alive connections is never affected, one that opens a connection a request stays well under."""
    rate = f"gpc0_rate({RATE_PERIOD}),gpc1_rate({RATE_PERIOD})"
    return [
        f"    stick-table type ipv6 size 100k expire 60s store conn_cur,gpc0,gpc1,{rate}",
        "    tcp-request connection track-sc0 src",
        "    tcp-request connection sc-inc-gpc0(0)",
        f"    tcp-request connection reject if {{ sc0_conn_cur gt {spec.per_source_connections} }}",
        "    tcp-request connection set-var(sess.keyed) sc0_gpc1_rate",
        f"    tcp-request connection reject if {{ sc0_gpc0_rate,sub(sess.keyed) gt {spec.keyless_per_source} }}",
    ]


def _clients(spec: EdgeSpec) -> list[str]:
    """txn.client: the name of the client whose key the request carries (the whole Authorization header's sha256
    compared with each digest: the configuration holds no client's key, the comparison's timing says nothing of
    one); no key asked for: every client is NO_KEY_CLIENT. The key is then replaced by the program's own."""
    lines = []
    if spec.clients:
        for name, digest in sorted(spec.clients):
            lines.append(f"    http-request set-var(txn.client) str({name}) "
                         f"if {{ req.fhdr(authorization),sha2(256),hex,lower -m str {digest} }}")  # fmt: skip
        lines.append(_refuse(401, "Unauthorized", "Unauthorized", "if !open_route !{ var(txn.client) -m found }"))
    else:
        lines.append(f"    http-request set-var(txn.client) str({NO_KEY_CLIENT})")
    return lines


def _model(spec: EdgeSpec) -> list[str]:
    """txn.model: the top-level `model` of a completion's body as vLLM reads it (COUNTERS_LUA's scan of what was
    waited for: the whole body, or its first 16 KiB), OTHER_MODEL where that is not a model the stack serves, none
    was found, or the body did not end there; a body naming it twice is refused. Unset on the other routes."""
    lines = [
        "    http-request lua.spark_vllm_model if { method POST }",
        _refuse(400, "the body names `model` more than once", "BadRequest", "if { var(txn.model_twice) -m bool }"),
    ]
    names = " ".join(quoted(name) for name in sorted(set(spec.model_names)))
    known = f"{{ var(txn.model) -m str {names} }}" if names else "FALSE"
    lines.append(f"    http-request set-var(txn.model) str({OTHER_MODEL}) if {{ method POST }} !{known}")
    return lines


def _health() -> list[str]:
    """/health, answered by the edge from its checks of the upstream (CHECK), with no key, and closed: nothing a
    client without a key sends reaches the upstream, and such a client holds no connection."""
    up = "{ srv_is_up(upstream/upstream) }"  # the server's last check (nbsrv is 0 in a reload's stopping process)
    return [
        f"    http-request return status 200 hdr connection close if open_route {up}",
        _refuse(503, "the model is not serving", "ServiceUnavailable", "if open_route"),
    ]


def _front(spec: EdgeSpec) -> list[str]:
    lines = [
        "frontend endpoint",
        _bind(spec),
        f"    maxconn {spec.max_connections}",
        *_per_source(spec),
        # the target as the upstream will read it: the path HAProxy parsed, in origin-form
        "    http-request set-uri %[pathq]",
        *_route_rules(spec.models is not None),
        # one Authorization header line, as vLLM reads one (a comma in a key: refused by the config)
        _refuse(400, "one Authorization header", "BadRequest", "if { req.fhdr_cnt(authorization) gt 1 }"),
        # no protocol switch: after a 101 the connection would be a tunnel the edge no longer reads
        _refuse(400, "no Upgrade", "BadRequest", "if { req.hdr_cnt(upgrade) gt 0 }"),
        # the key before the route: a client without one learns nothing of which routes there are
        *_clients(spec),
        _refuse(404, "Not Found", "NotFoundError", "if !{ var(txn.known) -m bool }"),
        _refuse(405, "Method Not Allowed", "MethodNotAllowed", "if !{ var(txn.allowed) -m bool }"),
        *_health(),
        # the key is known before a body is waited for; then the body has a timeout of its own
        f"    http-request wait-for-body time {spec.timeouts.body}s at-least 16k if {{ method POST }}",
        *_model(spec),
        "    http-request lua.spark_vllm_count",
        "    http-request sc-inc-gpc1(0)",
    ]
    if spec.models is not None:
        lines.extend(_models(spec.models))
    lines.append(_refuse(503, "the model is not serving", "ServiceUnavailable", "if !{ srv_is_up(upstream/upstream) }"))
    if spec.upstream_key is not None:
        lines.append(f"    http-request set-header authorization {quoted('Bearer ' + spec.upstream_key)}")
    return [*lines, "    default_backend upstream", ""]


def _own(spec: EdgeSpec) -> list[str]:
    """The edge's own port: the watchdog's check on loopback (edge_entry.sh asks the configuration's first `bind`,
    this one), which no client from the network reaches and none of the endpoint's can crowd out; /metrics for
    Prometheus on its node's fabric address (the nodes reach it; network.guard lets only them in), a few
    connections from each, short timeouts. Nothing else. Where the fabric address is loopback's own (a one-node
    stack without a fabric), one listener there serves both."""
    alive = f"    http-request return status 200 content-type text/plain string alive if {{ path -m str {ALIVE_PATH} }}"
    metrics = "    http-request use-service lua.spark_vllm_metrics if { path -m str /metrics } { method GET }"
    short = ["    timeout http-request 5s", "    timeout http-keep-alive 5s", "    timeout client 10s"]
    per_source = [
        "    stick-table type ipv6 size 1k expire 60s store conn_cur",
        "    tcp-request connection track-sc0 src",
        f"    tcp-request connection reject if {{ sc0_conn_cur gt {OWN_PER_SOURCE} }}",
    ]
    not_found = _refuse(404, "Not Found", "NotFoundError", "")
    if spec.metrics_host in (ALIVE_HOST, "0.0.0.0"):
        both = f"    maxconn {OWN_CONNECTIONS + ALIVE_CONNECTIONS}"
        return ["frontend edge-own", f"    bind {ALIVE_HOST}:{spec.metrics_port} proto h1", both, *short, alive,
                metrics, not_found, ""]  # fmt: skip
    return [
        "frontend edge-alive",
        f"    bind {ALIVE_HOST}:{spec.metrics_port} proto h1",
        f"    maxconn {ALIVE_CONNECTIONS}",
        *short,
        alive,
        not_found,
        "",
        "frontend edge-own",
        f"    bind {spec.metrics_host}:{spec.metrics_port} proto h1",
        f"    maxconn {OWN_CONNECTIONS}",
        *short,
        *per_source,
        metrics,
        not_found,
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
            "    option httpchk",
            f"    http-check send meth GET uri /health ver HTTP/1.1 hdr host {CHECK_HOST}",
            f"    server upstream {spec.upstream_host}:{spec.upstream_port} {CHECK}",
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
