"""What ``ckptdelta serve`` answers while its engine starts: ``STARTING``, on the port it will serve.

A replica takes seconds (the reference engine) to minutes (vLLM) to load its
snapshot. Until it serves, its port used to be bound but not listening: every
connection was refused, which is also what a dead replica, a wrong port or a
host that is down looks like, so ``ckptdelta status`` could not tell a replica
that will answer in a minute from one that never will. Now, from the end of
``serve``'s checks (ckptdelta/cli/serve.py) until the app serves, a small HTTP server on a
thread of its own answers on the replica's own socket:

- ``GET /v1/status``: 503 with a status saying ``state: STARTING`` (the replica,
  the run and the version it is loading; ``policy_version`` null: it serves none
  yet), in the schema the fleet commands read (loader/fleet.py), so ``status``
  shows the row as STARTING, not UNREACHABLE. 503, not 200: whatever waits for a
  replica by polling ``/v1/status`` until 200 (the demo, scripts, a readiness
  probe) still waits until it serves;
- ``GET /health``: 503 ``{"ok": false, "state": "STARTING"}`` (a readiness probe
  keeps traffic away, as from a replica whose engine failed);
- anything else: 503 ``replica_starting`` with ``Retry-After``: the rollout
  clients retry 503 until their ``ready_timeout`` (loader/client.py).

The same API key as the app's is required (401 otherwise). When the engine is
ready, :meth:`StartingServer.stop` stops accepting and the socket, still listening,
goes to uvicorn: connections that arrive in between wait in its backlog and are
the app's. Connections are not kept alive (HTTP/1.0), so none held by this server
outlives it.
"""

from __future__ import annotations

import hmac
import json
import socket
import socketserver
import threading
import time
from http.server import BaseHTTPRequestHandler
from typing import Any

#: ``/v1/status`` state of a replica whose port listens while its engine still loads.
STARTING = "STARTING"
#: Seconds a 503 ``replica_starting`` asks a client to wait before it tries again.
RETRY_AFTER_S = 1
#: Seconds one connection may take to send its request before it is dropped.
_REQUEST_TIMEOUT_S = 10.0
_BACKLOG = 2048      # uvicorn's default: what it listens with once it serves


class _Server(socketserver.ThreadingMixIn, socketserver.BaseServer):
    """socketserver over a socket that is already bound (and that it must neither bind nor close)."""

    daemon_threads = True
    block_on_close = False

    def __init__(self, sock: socket.socket, handler: type, owner: "StartingServer") -> None:
        super().__init__(sock.getsockname(), handler)
        self.socket, self.owner = sock, owner

    def fileno(self) -> int:
        return self.socket.fileno()

    def get_request(self) -> tuple[socket.socket, Any]:
        return self.socket.accept()

    def shutdown_request(self, request: socket.socket) -> None:
        try:
            request.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        request.close()

    def close_request(self, request: socket.socket) -> None:
        request.close()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"      # one request per connection: nothing lingers past stop()
    timeout = _REQUEST_TIMEOUT_S
    server: _Server

    def log_message(self, *args: Any) -> None:
        pass

    def _send(self, status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _answer(self) -> None:
        owner = self.server.owner
        length = self.headers.get("Content-Length")
        if length is not None and length.isdigit() and int(length) <= 1 << 20:
            self.rfile.read(int(length))       # read what was sent, so the client sees the answer, not a reset
        else:
            self.close_connection = True
        if not owner.authorized(self.headers.get("Authorization", "")):
            self._send(401, {"error": {"type": "unauthorized", "message": "missing or invalid API key "
                                       "(Authorization: Bearer <key>)"}}, {"WWW-Authenticate": "Bearer"})
            return
        path = self.path.split("?", 1)[0]
        if self.command == "GET" and path == "/v1/status":
            self._send(503, owner.status(), {"Retry-After": str(RETRY_AFTER_S)})
        elif self.command == "GET" and path == "/health":
            self._send(503, {"ok": False, "policy_version": None, "state": STARTING})
        else:
            self._send(503, {"error": {"type": "replica_starting", "message": owner.message()}},
                       {"Retry-After": str(RETRY_AFTER_S)})
        owner.answered += 1

    do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = do_PATCH = _answer


class StartingServer:
    """Answers ``STARTING`` on ``sock`` (bound, not yet listening) from :meth:`start` until :meth:`stop`.

    ``version`` and ``run_id`` may be set while it runs (what is being loaded, once known). ``answered`` counts
    the requests answered."""

    def __init__(self, sock: socket.socket, *, replica_id: str, engine: str, api_key: str | None = None,
                 run_id: str | None = None, version: int | None = None) -> None:
        self.sock, self.replica_id, self.engine = sock, replica_id, engine
        self.run_id, self.version = run_id, version
        self._key = api_key.encode() if api_key else None
        self._since = time.time()
        self.answered = 0
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def authorized(self, header: str) -> bool:
        if self._key is None:
            return True
        scheme, _, token = header.encode("latin-1", "replace").partition(b" ")
        ok = hmac.compare_digest(token, self._key)      # as the app's Gatekeeper: constant time, whatever the scheme
        return ok and scheme.lower() == b"bearer"

    def message(self) -> str:
        what = "" if self.version is None else f" (loading policy version {self.version})"
        return (f"replica {self.replica_id} is starting{what} and serves nothing yet; retry in a moment "
                "(GET /v1/status says when it is READY)")

    def status(self) -> dict[str, Any]:
        """``/v1/status`` while starting: the app's fields, none of them claiming a version served."""
        return {"replica_id": self.replica_id, "run_id": self.run_id, "policy_version": None, "snapshot": None,
                "state": STARTING, "hotload": None, "queued_hotload": None, "last_hotload": None,
                "cache_policy": None, "model": None, "uptime_s": time.time() - self._since,
                "engine": {"kind": self.engine}, "starting": {"version": self.version,
                                                               "seconds": time.time() - self._since}}

    def start(self) -> "StartingServer":
        self.sock.listen(_BACKLOG)
        self._server = _Server(self.sock, _Handler, self)
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="ckptdelta-starting", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop answering; the socket stays open and listening for the app. Idempotent."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
