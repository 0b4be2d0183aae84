"""The stand-in's OpenAI-compatible HTTP API (standard library only).

Pure helpers (``is_authorized``, ``chat_reply``, ``chat_completion``,
``models_payload``) are unit-tested; ``make_server`` wraps them in a
``ThreadingHTTPServer``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import socket
import threading
import time
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from . import __version__, log
from .args import ServeConfig

OPEN_PATHS = ("/health", "/version", "/metrics", "/ping")


def needs_auth(path: str) -> bool:
    """vLLM's key guards every path starting with /v1 and nothing else."""
    return path.split("?", 1)[0].startswith("/v1")


def is_authorized(path: str, authorization: str | None, api_key: str | None) -> bool:
    """True when the request may proceed (no key configured, open path, or the right bearer token)."""
    if not api_key or not needs_auth(path):
        return True
    expected = f"Bearer {api_key}"
    return authorization is not None and hmac.compare_digest(authorization.encode(), expected.encode())


def count_tokens(text: str) -> int:
    """The stand-in's tokenizer: whitespace-separated words."""
    return len(text.split())


def message_text(content: object) -> str:
    """OpenAI message content: a string, or a list of parts ``{"type": "text", "text": ...}``."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict) and p.get("type") == "text")
    return str(content)


def chat_reply(messages: list) -> str:
    """Deterministic answer: ``standin reply:`` followed by the last user message's words reversed."""
    last = ""
    for m in messages:
        if isinstance(m, dict) and m.get("role") == "user":
            last = message_text(m.get("content"))
    words = last.split()
    return " ".join(["standin", "reply:"] + list(reversed(words)))


def reasoning_words() -> list[str]:
    """What a reasoning model 'thinks' before its answer: more than 16 words, so the smoke test's 16
    tokens never reach the answer (as with Qwen3.5 on real vLLM)."""
    return "Okay, the user asks me to reply, so I will think about it first and then answer with the words reversed".split()


def error_body(message: str, type_: str, code: int, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def models_payload(cfg: ServeConfig, created: int) -> dict:
    return {
        "object": "list",
        "data": [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": cfg.model,
                "parent": None,
                "max_model_len": cfg.max_model_len,
                "permission": [],
            }
            for name in cfg.served_model_names
        ],
    }


def chat_completion(body: object, cfg: ServeConfig, created: int) -> tuple[int, dict]:
    """(status, JSON) for a non-streaming ``POST /v1/chat/completions``."""
    if not isinstance(body, dict):
        return 400, error_body("request body must be a JSON object", "BadRequestError", 400)
    model = body.get("model")
    if model is not None and model not in cfg.served_model_names:
        return 404, error_body(f"The model `{model}` does not exist.", "NotFoundError", 404, "model")
    model = model or cfg.served_model_names[0]
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return 400, error_body("'messages' must be a non-empty list", "BadRequestError", 400, "messages")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1):
        return 400, error_body("max_tokens must be a positive integer", "BadRequestError", 400, "max_tokens")
    prompt_tokens = sum(count_tokens(message_text(m.get("content"))) for m in messages if isinstance(m, dict))
    if prompt_tokens + (max_tokens or 0) > cfg.max_model_len:
        return 400, error_body(
            f"This model's maximum context length is {cfg.max_model_len} tokens. However, you requested "
            f"{prompt_tokens + (max_tokens or 0)} tokens ({prompt_tokens} in the messages, "
            f"{max_tokens or 0} in the completion). Please reduce the length of the messages or completion.",
            "BadRequestError",
            400,
        )
    words = chat_reply(messages).split()
    thinking = reasoning_words() if cfg.reasoning_parser else []
    finish = "stop"
    if max_tokens is not None and len(thinking) + len(words) > max_tokens:
        finish = "length"
        thinking, words = thinking[:max_tokens], words[: max(0, max_tokens - len(thinking))]
    # vLLM 0.25's reasoning parsers put the thinking in `reasoning`, and `content` is null when the limit
    # came before the answer (a chat template that opens <think> in the prompt, as Qwen3.5's does).
    text = " ".join(words) if words or not thinking else None
    reasoning = " ".join(thinking) if thinking else None
    digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:24]
    return 200, {
        "id": f"chatcmpl-{digest}",
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": text, "tool_calls": [], "reasoning": reasoning},
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": None,
            }
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": len(thinking) + len(words),
            "total_tokens": prompt_tokens + len(thinking) + len(words),
        },
    }


def stream_chunks(result: dict, include_usage: bool) -> list[dict]:
    """Turn a completed chat completion into OpenAI ``chat.completion.chunk`` events."""
    base = {
        "id": result["id"],
        "object": "chat.completion.chunk",
        "created": result["created"],
        "model": result["model"],
    }
    choice = result["choices"][0]
    words = (choice["message"]["content"] or "").split()
    chunks = [dict(base, choices=[{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])]
    for i, w in enumerate(words):
        piece = w if i == 0 else " " + w
        chunks.append(dict(base, choices=[{"index": 0, "delta": {"content": piece}, "finish_reason": None}]))
    chunks.append(dict(base, choices=[{"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}]))
    if include_usage:
        chunks.append(dict(base, choices=[], usage=result["usage"]))
    return chunks


class ServerState:
    """Shared between the HTTP threads and the engine monitor."""

    def __init__(self, cfg: ServeConfig):
        self.cfg = cfg
        self.created = int(time.time())
        self.engine_alive = True
        self.lock = threading.Lock()
        self.requests_total = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    def metrics_text(self) -> str:
        name = self.cfg.served_model_names[0]
        lbl = f'{{engine="0",model_name="{name}"}}'
        with self.lock:
            rows = [
                ("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.", 0),
                ("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.", 0),
                (
                    "vllm:request_success_total",
                    "counter",
                    "Count of successfully processed requests.",
                    self.requests_total,
                ),
                (
                    "vllm:prompt_tokens_total",
                    "counter",
                    "Number of prefill tokens processed.",
                    self.prompt_tokens_total,
                ),
                (
                    "vllm:generation_tokens_total",
                    "counter",
                    "Number of generation tokens processed.",
                    self.generation_tokens_total,
                ),
            ]
        out = []
        for metric, kind, help_, value in rows:
            out += [f"# HELP {metric} {help_}", f"# TYPE {metric} {kind}", f"{metric}{lbl} {float(value)}"]
        return "\n".join(out) + "\n"


def make_handler(state: ServerState):
    cfg = state.cfg

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        server_version = "uvicorn"
        sys_version = ""

        def log_message(self, format, *args):  # noqa: A002 - stdlib signature
            pass

        def _send(self, status: int, body: bytes = b"", ctype: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("content-type", ctype)
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            if body and self.command != "HEAD":
                self.wfile.write(body)
            try:
                phrase = HTTPStatus(status).phrase
            except ValueError:
                phrase = ""
            log.uvicorn(
                '%s:%s - "%s %s HTTP/1.1" %d %s',
                self.client_address[0],
                self.client_address[1],
                self.command,
                self.path,
                status,
                phrase,
            )

        def _json(self, status: int, obj: object) -> None:
            self._send(status, json.dumps(obj).encode())

        def _authorized(self) -> bool:
            if is_authorized(self.path, self.headers.get("Authorization"), cfg.api_key):
                return True
            self._json(401, {"error": "Unauthorized"})
            return False

        def do_GET(self):  # noqa: N802 - stdlib name
            path = self.path.split("?", 1)[0]
            if not self._authorized():
                return
            if path == "/health":
                self._send(200 if state.engine_alive else 503, b"")
            elif path == "/ping":
                self._send(200 if state.engine_alive else 503, b"")
            elif path == "/version":
                self._json(200, {"version": __version__})
            elif path == "/metrics":
                self._send(200, state.metrics_text().encode(), "text/plain; version=0.0.4; charset=utf-8")
            elif path == "/v1/models":
                self._json(200, models_payload(cfg, state.created))
            elif path == "/v1/chat/completions":
                self._json(405, {"detail": "Method Not Allowed"})
            else:
                self._json(404, {"detail": "Not Found"})

        def do_POST(self):  # noqa: N802 - stdlib name
            path = self.path.split("?", 1)[0]
            length = int(self.headers.get("content-length") or 0)
            raw = self.rfile.read(length) if length else b""
            if not self._authorized():
                return
            if path != "/v1/chat/completions":
                if path in ("/health", "/version", "/metrics", "/v1/models"):
                    self._json(405, {"detail": "Method Not Allowed"})
                else:
                    self._json(404, {"detail": "Not Found"})
                return
            if not state.engine_alive:
                self._json(
                    500,
                    error_body(
                        "EngineCore encountered an issue. See stack trace (above) for the root cause.",
                        "InternalServerError",
                        500,
                    ),
                )
                return
            try:
                body = json.loads(raw or b"null")
            except ValueError as e:
                self._json(400, error_body(f"invalid JSON body: {e}", "BadRequestError", 400))
                return
            status, result = chat_completion(body, cfg, int(time.time()))
            if status == 200:
                with state.lock:
                    state.requests_total += 1
                    state.prompt_tokens_total += result["usage"]["prompt_tokens"]
                    state.generation_tokens_total += result["usage"]["completion_tokens"]
            if status != 200 or not body.get("stream"):
                self._json(status, result)
                return
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            payload = (
                b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in stream_chunks(result, include_usage))
                + b"data: [DONE]\n\n"
            )
            self._send(200, payload, "text/event-stream; charset=utf-8")

    return Handler


def make_server(state: ServerState) -> ThreadingHTTPServer:
    """Bind ``--host``/``--port`` (raises OSError when the address is taken)."""
    host = state.cfg.host

    class Server(ThreadingHTTPServer):
        allow_reuse_address = True
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

    server = Server((host, state.cfg.port), make_handler(state))
    server.daemon_threads = True
    return server
