"""Members of a fleet that are not working replicas: small real HTTP servers on 127.0.0.1 that answer garbage or
hang, a port nobody listens on, and one whose connections never complete.

The fleet commands and clients (loader/fleet.py) must report each of them on its own row, and hot-load the
working replicas beside them as if they were not there. A :class:`BadReplica` answers each request by the first
of its routes whose method and path prefix match: a status, a content type and a body (a dict or list is sent
as JSON), or :data:`HANG`: the connection is taken and nothing is answered until the server is closed (a hung
process; the client's read timeout ends the request).
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

HANG = "hang"
HTML = (200, "text/html", b"<html><body>It works!</body></html>")
JSON_LIST = (200, "application/json", [1, 2, 3])
OTHER_SCHEMA = (200, "application/json", {"status": "ok", "version": "1.2.3"})
ERROR_500 = (500, "text/plain", b"Internal Server Error")


#: The sockets that keep dead_url()'s ports bound, for the life of the test process.
_DEAD: list[socket.socket] = []


def dead_url() -> str:
    """A port of 127.0.0.1 nobody listens on: connections are refused at once. The port stays bound (never
    listening) while the tests run, so that no server another test starts, in this process or the other
    worker's, is given it: a port merely found free was, and a test expecting a refused connection met a
    server that dropped it."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    _DEAD.append(s)
    return f"http://127.0.0.1:{s.getsockname()[1]}"


@contextlib.contextmanager
def blackholed_url() -> Iterator[str]:
    """A port of 127.0.0.1 whose connections never complete (a host whose packets are dropped): it listens,
    never accepts, and its queue of pending connections is full, so the kernel drops the next SYNs and a
    client's connect waits out its timeout."""
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(0)
        port = srv.getsockname()[1]
        fill = []
        try:
            for _ in range(3):
                c = socket.socket()
                c.setblocking(False)
                try:
                    c.connect(("127.0.0.1", port))
                except BlockingIOError:
                    pass
                fill.append(c)
            yield f"http://127.0.0.1:{port}"
        finally:
            for c in fill:
                c.close()


def replica_status(run_id: str, version: int = 1) -> dict[str, Any]:
    """What a replica of run ``run_id`` answers to GET /v1/status (the fields the fleet commands read)."""
    return {"replica_id": "impostor", "run_id": run_id, "policy_version": version, "snapshot": f"v{version:08d}",
            "state": "READY", "hotload": None, "queued_hotload": None, "last_hotload": None, "engine": {}}


class BadReplica:
    """``with BadReplica({("GET", "/v1/status"): HTML}) as bad:`` then list ``bad.url`` in the fleet."""

    def __init__(self, routes: dict[tuple[str, str], Any], default: Any = (404, "text/plain", b"not found")):
        self.routes, self.default = routes, default
        self.release = threading.Event()
        self.requests: list[tuple[str, str]] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                if length:
                    self.rfile.read(length)
                owner.requests.append((self.command, self.path))
                what = next((a for (m, p), a in owner.routes.items()
                             if m == self.command and self.path.startswith(p)), owner.default)
                if what == HANG:
                    owner.release.wait()
                    self.close_connection = True
                    return
                status, ctype, body = what
                data = json.dumps(body).encode() if isinstance(body, (dict, list)) else body
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = _answer

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                                       name="bad-replica", daemon=True)

    def __enter__(self) -> "BadReplica":
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=10)
