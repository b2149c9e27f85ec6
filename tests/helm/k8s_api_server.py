"""A loopback HTTP server that answers like the Kubernetes API from recorded responses.

Routes map ``(method, path)`` to ``(status, fixture file)``; every request is recorded
(method, path, headers, JSON body) so tests can check what the real ``kubernetes`` client sent.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).parent / "fixtures" / "k8s_api"


@dataclass
class Recorded:
    method: str
    path: str
    headers: dict[str, str]
    body: Any


@dataclass
class RecordedApi:
    routes: dict[tuple[str, str], tuple[int, str]] = field(default_factory=dict)
    requests: list[Recorded] = field(default_factory=list)
    server: ThreadingHTTPServer | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        host, port = self.server.server_address[:2]
        return f"http://{host}:{port}"

    def route(self, method: str, path: str, status: int, fixture: str) -> None:
        self.routes[(method, path)] = (status, fixture)

    def start(self) -> RecordedApi:
        api = self

        class Handler(BaseHTTPRequestHandler):
            def _serve(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                body = json.loads(raw) if raw else None
                path = self.path.split("?", 1)[0]
                api.requests.append(
                    Recorded(self.command, path, {k.lower(): v for k, v in self.headers.items()}, body)
                )
                status, fixture = api.routes.get((self.command, path), (404, "not-found.json"))
                data = (FIXTURES / fixture).read_bytes()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_PATCH = do_PUT = _serve  # noqa: N815 - http.server naming

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                return

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
