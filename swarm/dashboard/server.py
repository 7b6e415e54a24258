"""The dashboard's HTTP server: the page, its assets, ``/api/state`` and ``/metrics``.

    dashboard = Dashboard.start(dht, ViewConfig(run_id="demo", n_experts=16), host="127.0.0.1", port=8080)
    print(dashboard.url)          # http://127.0.0.1:8080/
    dashboard.close()             # stops the server and the polling thread (not the DHT: the caller owns it)

Routes (GET and HEAD): ``/`` the page; ``/static/<file>`` its CSS and JS; ``/api/state`` the JSON the page
draws; ``/metrics`` Prometheus text; ``/healthz`` "ok". The page's files are package data
(``swarm/dashboard/static``) read once at start-up: nothing is loaded from the internet, so the page works
on an air-gapped cluster. Python's threading HTTP server is enough for a status page; it binds loopback
unless told otherwise, like everything in this project.
"""

from __future__ import annotations

import contextlib
import json
import math
import socket
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from typing import Any

from swarm.dashboard.prometheus_metrics import metrics_registry, render
from swarm.dashboard.swarm_view import SwarmView, ViewConfig

STATIC_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".svg": "image/svg+xml",
}
# The page's own files only: no inline script, no outside origin.
CSP = "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; frame-ancestors 'none'"


class DashboardBindError(OSError):
    """The HTTP port could not be bound (in use, not allowed, bad address). The message is one line."""


def load_static() -> dict[str, tuple[bytes, str]]:
    """{url path: (body, content type)} for every file under static/, read from the installed package."""
    files: dict[str, tuple[bytes, str]] = {}
    for item in resources.files("swarm.dashboard").joinpath("static").iterdir():
        suffix = "." + item.name.rsplit(".", 1)[-1]
        if item.is_file() and suffix in STATIC_TYPES:
            files[f"/static/{item.name}"] = (item.read_bytes(), STATIC_TYPES[suffix])
    files["/"] = files["/static/index.html"]
    files["/favicon.ico"] = files["/static/favicon.svg"]  # browsers ask for it whatever the page says
    return files


def _json_safe(value: Any) -> Any:
    """JSON has no NaN or infinity: browsers reject them, so they become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def make_handler(view: SwarmView, static: dict[str, tuple[bytes, str]]) -> type[BaseHTTPRequestHandler]:
    registry = metrics_registry(view)

    class Handler(BaseHTTPRequestHandler):
        server_version = "swarm-dashboard"
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:  # noqa: N802 (the stdlib's naming)
            self._serve(head=False)

        def do_HEAD(self) -> None:  # noqa: N802
            self._serve(head=True)

        def _serve(self, head: bool) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/api/state":
                body = json.dumps(_json_safe(view.state()), separators=(",", ":")).encode()
                self._send(200, body, "application/json", head, cache="no-store")
            elif path == "/metrics":
                body, ctype = render(registry)
                self._send(200, body, ctype, head, cache="no-store")
            elif path == "/healthz":
                self._send(200, b"ok\n", "text/plain; charset=utf-8", head)
            elif path in static:
                body, ctype = static[path]
                self._send(200, body, ctype, head, cache="no-cache")
            else:
                self._send(404, b"not found\n", "text/plain; charset=utf-8", head)

        def _send(self, code: int, body: bytes, ctype: str, head: bool, cache: str = "no-cache") -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", cache)
            self.send_header("X-Content-Type-Options", "nosniff")
            self.send_header("Content-Security-Policy", CSP)
            self.end_headers()
            if not head:
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the tab was closed
                    self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            pass  # a page refreshing every 2 s would flood the log

    return Handler


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a browser holding a keep-alive connection must not block shutdown
    allow_reuse_address = True


class _Server6(_Server):
    address_family = socket.AF_INET6


def bind(host: str, port: int) -> ThreadingHTTPServer:
    """Take the port now, so that a taken one fails fast (before a DHT is started). Port 0: any free one.
    Nothing is served until ``Dashboard.start`` installs the real handler and runs the server."""
    try:
        return (_Server6 if ":" in host else _Server)((host, port), BaseHTTPRequestHandler)
    except (OSError, OverflowError) as e:
        why = getattr(e, "strerror", None) or str(e)
        raise DashboardBindError(f"cannot listen on {host}:{port} ({why})") from None


@dataclass
class Dashboard:
    """A running dashboard: the polling view and the HTTP server thread."""

    view: SwarmView
    server: ThreadingHTTPServer
    thread: threading.Thread

    @classmethod
    def start(
        cls,
        dht: Any,
        cfg: ViewConfig,
        host: str = "127.0.0.1",
        port: int = 8080,
        server: ThreadingHTTPServer | None = None,
    ) -> Dashboard:
        """Poll once, then serve on ``server`` (from ``bind``) or on a new one bound to host:port."""
        server = server or bind(host, port)
        view = SwarmView(dht, cfg)
        server.RequestHandlerClass = make_handler(view, load_static())
        view.start()
        thread = threading.Thread(target=server.serve_forever, name="dashboard-http", daemon=True)
        thread.start()
        return cls(view, server, thread)

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        host = f"[{host}]" if ":" in str(host) else host
        return f"http://{host}:{port}/"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)
        self.view.stop()
