"""A fault-injecting HTTP proxy between a replica and a real vLLM server.

The replica attaches to the proxy's URL instead of vLLM's (``--attach``); every
request is forwarded as is, except the one a :class:`Fault` names: the n-th call
of a control endpoint (``/pause``, ``/resume``, ``/reset_prefix_cache``,
``/update_weight_version``) or of a worker method through ``/collective_rpc``
(``rpc:ckptdelta_swap``, ``rpc:ckptdelta_check``, ...). What happens to it:

- ``fail``: answered 500 without reaching vLLM (vLLM refused: nothing happened);
- ``lost``: forwarded, vLLM does it, and the answer never comes (the replica's
  client times out: it cannot know it happened);
- ``kill``: the replica process is SIGKILLed right there (the call is not
  forwarded), as a crash or an OOM kill would.

Nothing of vLLM or of the replica is mocked; only the wire between them is.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
from dataclasses import dataclass, field

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from tests.replicas import LiveServer

ACTIONS = ("fail", "lost", "kill")


@dataclass
class Fault:
    point: str             # "/pause", "/resume", ..., or "rpc:METHOD"
    action: str            # one of ACTIONS
    nth: int = 1           # which call of ``point`` (counted from when the fault is armed)
    times: int = 1         # how many calls from the n-th on
    pid: int | None = None  # the replica process to kill ("kill")
    seen: int = 0
    fired: int = 0

    def matches(self, point: str) -> bool:
        if point != self.point or self.fired >= self.times:
            return False
        self.seen += 1
        if self.seen < self.nth:
            return False
        self.fired += 1
        return True


@dataclass
class FaultProxy:
    """Forwards to ``upstream`` (vLLM's ``http://HOST:PORT``); ``arm(fault)`` injects one fault."""

    upstream: str
    faults: list[Fault] = field(default_factory=list)
    log: list[str] = field(default_factory=list)   # every control point seen, in order

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._closing = threading.Event()
        app = Starlette(routes=[Route("/{path:path}", self._forward, methods=["GET", "POST", "PUT", "DELETE"])])
        self.server = LiveServer(app).__enter__()
        self.url = self.server.url

    def arm(self, *faults: Fault) -> None:
        with self._lock:
            self.faults = list(faults)

    def clear(self) -> None:
        with self._lock:
            self.faults = []

    def fired(self) -> int:
        with self._lock:
            return sum(f.fired for f in self.faults)

    def close(self) -> None:
        self._closing.set()           # answers held back end first, so the server stops without cancelling them
        self.server.__exit__()

    async def _hang(self) -> Response:
        """Never answer (the caller times out), until the proxy closes."""
        while not self._closing.is_set():
            await asyncio.sleep(0.2)
        return Response(b"", status_code=503)

    async def _forward(self, request: Request) -> Response:
        body = await request.body()
        point = request.url.path
        if point == "/collective_rpc":
            try:
                point = "rpc:" + json.loads(body)["method"]
            except (ValueError, KeyError, TypeError):
                pass
        with self._lock:
            if point not in ("/health", "/is_paused", "/v1/models", "/v1/completions", "/v1/chat/completions"):
                self.log.append(point)
            fault = next((f for f in self.faults if f.matches(point)), None)
        if fault is not None and fault.action == "fail":
            return Response(json.dumps({"error": f"injected: {point} failed"}), status_code=500,
                            media_type="application/json")
        if fault is not None and fault.action == "kill":
            os.kill(fault.pid, signal.SIGKILL)
            return await self._hang()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        async with httpx.AsyncClient(base_url=self.upstream, timeout=httpx.Timeout(600.0, connect=10.0)) as c:
            r = await c.request(request.method, request.url.path, params=request.query_params, content=body,
                                headers=headers)
        if fault is not None and fault.action == "lost":
            return await self._hang()      # the client gives up; vLLM has done it
        return Response(r.content, status_code=r.status_code,
                        headers={k: v for k, v in r.headers.items()
                                 if k.lower() not in ("content-length", "transfer-encoding", "content-encoding")})
