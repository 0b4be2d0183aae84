"""A stand-in for the Hugging Face Hub (a test double, like the stand-in vLLM): the few HTTP endpoints
`huggingface_hub.snapshot_download` uses, serving model repositories from local directories.

- `GET /api/models/{org}/{name}[/revision/{rev}]`: the repo's commit sha and its files (siblings);
- `HEAD|GET /{org}/{name}/resolve/{rev}/{path}`: a file, with the headers the client requires
  (`X-Repo-Commit`, `ETag`, `Content-Length`).

A token can be required (as for a gated repo): requests without `Authorization: Bearer <token>` get
401. Every request is recorded, so a test can count how many nodes downloaded.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Optional
from urllib.parse import unquote

from components.scripts.node_metrics import QuietServer


@dataclass
class Repo:
    root: Path
    sha: str = ""
    token: Optional[str] = None

    def __post_init__(self) -> None:
        digest = hashlib.sha1()
        for path in self.files():
            digest.update(path.encode() + b"\0" + (self.root / path).read_bytes())
        self.sha = self.sha or digest.hexdigest()

    def files(self) -> list[str]:
        return sorted(str(p.relative_to(self.root)) for p in self.root.rglob("*") if p.is_file())


@dataclass
class HubStandIn:
    host: str
    repos: dict[str, Repo]
    port: int = 0
    requests: list[tuple[str, str, str]] = field(default_factory=list)  # (client address, method, path)

    def start(self) -> HubStandIn:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_HEAD(self) -> None:  # noqa: N802
                self._serve(body=False)

            def do_GET(self) -> None:  # noqa: N802
                self._serve(body=True)

            def _serve(self, body: bool) -> None:
                path = unquote(self.path.split("?", 1)[0])
                hub.requests.append((self.client_address[0], self.command, path))
                parts = path.strip("/").split("/")
                if parts[:2] == ["api", "models"] and len(parts) >= 4:
                    self._info(f"{parts[2]}/{parts[3]}", body)
                elif len(parts) >= 5 and parts[2] == "resolve":
                    self._file(f"{parts[0]}/{parts[1]}", "/".join(parts[4:]), body)
                else:
                    self._send(404, b'{"error": "not found"}', body)

            def _repo(self, name: str, body: bool) -> Optional[Repo]:
                repo = hub.repos.get(name)
                if repo is None:
                    self._send(404, json.dumps({"error": f"Repository {name} not found"}).encode(), body,
                               {"X-Error-Code": "RepoNotFound"})  # fmt: skip
                    return None
                if repo.token and self.headers.get("Authorization") != f"Bearer {repo.token}":
                    self._send(401, b'{"error": "Access to this model is restricted."}', body,
                               {"X-Error-Code": "GatedRepo"})  # fmt: skip
                    return None
                return repo

            def _info(self, name: str, body: bool) -> None:
                repo = self._repo(name, body)
                if repo:
                    info = {"id": name, "modelId": name, "sha": repo.sha, "private": False,
                            "siblings": [{"rfilename": f} for f in repo.files()]}  # fmt: skip
                    self._send(200, json.dumps(info).encode(), body, {"Content-Type": "application/json"})

            def _file(self, name: str, relative: str, body: bool) -> None:
                repo = self._repo(name, body)
                if not repo:
                    return
                path = repo.root / relative
                if not path.is_file():
                    self._send(404, b'{"error": "Entry not found"}', body, {"X-Error-Code": "EntryNotFound"})
                    return
                data = path.read_bytes()
                etag = hashlib.sha256(data).hexdigest()
                self._send(200, data, body, {"X-Repo-Commit": repo.sha, "ETag": f'"{etag}"'})

            def _send(self, status: int, data: bytes, body: bool, headers: Optional[dict] = None) -> None:
                self.send_response(status)
                for key, value in (headers or {}).items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if body:
                    self.wfile.write(data)

        self._server = QuietServer((self.host, self.port), Handler)  # no name lookup: no query to this machine's DNS
        self.port = self._server.server_address[1]
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def downloads(self, name: str) -> dict[str, int]:
        """How many times each client fetched a file of `name` (GET of a resolve URL)."""
        counts: dict[str, int] = {}
        for client, method, path in self.requests:
            if method == "GET" and path.startswith(f"/{name}/resolve/"):
                counts[client] = counts.get(client, 0) + 1
        return counts

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
