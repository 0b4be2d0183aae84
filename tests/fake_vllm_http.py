"""A local HTTP server that answers like vLLM in a chosen state (for the wait and smoke scripts).

Test double only: it serves /health, /v1/models and /v1/chat/completions on 127.0.0.1.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeVllm:
    def __init__(
        self,
        model: str = "m",
        api_key: str | None = None,
        ready_after: float = 0.0,
        health: int = 200,
        answer: dict | None = None,
    ):
        self.model, self.api_key, self.health = model, api_key, health
        self.answer = answer or {
            "choices": [{"message": {"role": "assistant", "content": "ready"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 7, "completion_tokens": 1, "total_tokens": 8},
        }
        # Loading for `ready_after` seconds from the first request it gets, not from its own start: a script that
        # starts slowly on a loaded machine still finds it loading (its polls, its progress lines) as the test meant.
        self.ready_after, self.ready_at = ready_after, None
        self.requests: list[str] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code: int, body: dict | None = None):
                data = json.dumps(body).encode() if body is not None else b""
                self.send_response(code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _authorized(self) -> bool:
                return not fake.api_key or self.headers.get("Authorization") == f"Bearer {fake.api_key}"

            def do_GET(self):  # noqa: N802
                fake.requests.append(self.path)
                if fake.ready_at is None:
                    fake.ready_at = time.monotonic() + fake.ready_after
                if time.monotonic() < fake.ready_at:
                    self.close_connection = True  # like a server still loading weights: nothing useful
                    return self._send(503)
                if self.path == "/health":
                    return self._send(fake.health)
                if self.path == "/v1/models":
                    if not self._authorized():
                        return self._send(401, {"error": "Unauthorized"})
                    return self._send(200, {"object": "list", "data": [{"id": fake.model, "object": "model"}]})
                return self._send(404)

            def do_POST(self):  # noqa: N802
                fake.requests.append(self.path)
                length = int(self.headers.get("Content-Length", 0))
                request = json.loads(self.rfile.read(length) or b"{}")
                if not self._authorized():
                    return self._send(401, {"error": "Unauthorized"})
                if request.get("model") != fake.model:
                    return self._send(404, {"error": {"message": "model not found"}})
                return self._send(200, fake.answer)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeVllm:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
