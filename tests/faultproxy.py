"""A fault-injecting HTTP proxy on 127.0.0.1, between an S3 client (s3fs) and an S3 server (moto).

Real object stores throttle, drop connections, stall and cut responses short;
the Store must retry through all of it and never hand a reader bytes that are
not the object's. This proxy forwards every request to the upstream server and,
at the rates it is given, injects instead:

``slowdown``  a 503 with S3's ``SlowDown`` XML error body; nothing is forwarded.
``reset``     the connection is reset (RST), before forwarding the request or after
              it was applied upstream (then only the answer is lost).
``stall``     nothing comes back for ``stall_s`` seconds (past the client's read
              timeout), then the connection closes; again before or after forwarding.
``truncate``  a GET's response announces its full Content-Length, sends fewer
              bytes, and closes.

And, when told to (``hold``), requests that match wait before they are forwarded
until ``release()``: a store that does not answer yet, for as long as a test needs
(a replica held in the middle of its start).

Faults are drawn from a seeded RNG per request; ``counts`` says what was
injected. Every loop here is bounded: sockets time out, a stall ends at
``stop()``, and ``max_requests`` caps the requests one proxy serves.
"""

from __future__ import annotations

import http.client
import random
import socket
import struct
import threading
from collections import Counter
from typing import Callable
from urllib.parse import urlsplit

FAULTS = ("slowdown", "reset", "stall", "truncate")
_HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "proxy-authenticate", "proxy-authorization",
               "te", "trailer", "transfer-encoding", "upgrade", "expect"}
_MAX_HEADER_BYTES = 64 << 10
_MAX_BODY_BYTES = 256 << 20

SLOWDOWN_BODY = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
                 b"<Message>Please reduce your request rate.</Message><RequestId>faultproxy</RequestId>"
                 b"<HostId>faultproxy</HostId></Error>")


class _Closed(Exception):
    """The client went away (or a fault closed the connection)."""


class FaultProxy:
    """``with FaultProxy(upstream, rates={...}) as proxy:`` then point the client at ``proxy.url``."""

    def __init__(self, upstream: str, *, rates: dict[str, float] | None = None, seed: int = 0,
                 stall_s: float = 2.0, socket_timeout: float = 30.0, max_requests: int = 200_000) -> None:
        parts = urlsplit(upstream)
        if parts.hostname not in ("127.0.0.1", "localhost"):
            raise ValueError(f"faultproxy forwards to 127.0.0.1 only, not {upstream!r}")
        self.upstream = (parts.hostname, parts.port or 80)
        self.stall_s, self.socket_timeout, self.max_requests = stall_s, socket_timeout, max_requests
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._rates: dict[str, float] = {}
        self.set_rates(**(rates or {}))
        self.counts: Counter = Counter()      # requests, forwarded, and each fault injected
        self._script: list[list] = []         # [match, fault, after, times left]
        self._stop = threading.Event()
        self._hold: Callable[[str, str], bool] | None = None
        self._released = threading.Event()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(128)
        self._sock.settimeout(0.2)
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._conns: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._acceptor = threading.Thread(target=self._accept_loop, name="faultproxy-accept", daemon=True)

    # --- control -----------------------------------------------------------------

    def set_rates(self, **rates: float) -> None:
        """Replace the fault rates (probability per request of each kind; they must sum to <= 1)."""
        unknown = set(rates) - set(FAULTS)
        if unknown:
            raise ValueError(f"unknown faults {sorted(unknown)}; known: {FAULTS}")
        if sum(rates.values()) > 1.0 or any(r < 0 for r in rates.values()):
            raise ValueError(f"fault rates must be >= 0 and sum to <= 1: {rates}")
        with self._lock:
            self._rates = dict(rates)

    def inject(self, fault: str, *, match: Callable[[str, str], bool], after: bool = False, times: int = 1) -> None:
        """Inject ``fault`` into the next ``times`` requests for which ``match(method, path)`` holds
        (before the random draw; ``after``: once the request was applied upstream)."""
        if fault not in FAULTS:
            raise ValueError(f"unknown fault {fault!r}; known: {FAULTS}")
        with self._lock:
            self._script.append([match, fault, after, times])

    def hold(self, match: Callable[[str, str], bool]) -> None:
        """Requests for which ``match(method, path)`` holds wait, before anything is forwarded, until
        :meth:`release` (or :meth:`stop`); ``counts["held"]`` counts them."""
        with self._lock:
            self._hold = match
            self._released.clear()

    def release(self) -> None:
        with self._lock:
            self._hold = None
        self._released.set()

    @property
    def faults(self) -> int:
        with self._lock:
            return sum(self.counts[k] for k in FAULTS)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counts)

    def start(self) -> "FaultProxy":
        self._acceptor.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._released.set()
        self._acceptor.join(timeout=5)
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        for t in list(self._threads):
            t.join(timeout=5)
        self._sock.close()

    def __enter__(self) -> "FaultProxy":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --- serving -------------------------------------------------------------------

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            conn.settimeout(self.socket_timeout)
            with self._lock:
                self._conns.add(conn)
                self._threads = [t for t in self._threads if t.is_alive()]
            t = threading.Thread(target=self._serve, args=(conn,), name="faultproxy-conn", daemon=True)
            self._threads.append(t)
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        buf = bytearray()
        try:
            while not self._stop.is_set():
                with self._lock:
                    if self.counts["requests"] >= self.max_requests:
                        return
                try:
                    req = _read_request(conn, buf)
                except _Closed:
                    return
                if req is None:
                    return
                if not self._handle(conn, *req):
                    return
        except (OSError, _Closed):
            return
        finally:
            with self._lock:
                self._conns.discard(conn)
            try:
                conn.close()
            except OSError:
                pass

    def _draw(self, method: str, target: str) -> tuple[str | None, bool]:
        """(fault or None, whether it strikes after the request was forwarded)."""
        path = target.split("?", 1)[0]
        with self._lock:
            self.counts["requests"] += 1
            for rule in self._script:
                if rule[3] > 0 and rule[0](method, path):
                    rule[3] -= 1
                    return rule[1], rule[2]
            r = self._rng.random()
            after = self._rng.random() < 0.5
            acc = 0.0
            for kind in FAULTS:
                acc += self._rates.get(kind, 0.0)
                if r < acc:
                    return kind, after
        return None, after

    def _count(self, key: str) -> None:
        with self._lock:
            self.counts[key] += 1

    def _handle(self, conn: socket.socket, method: str, target: str, headers: list[tuple[str, str]],
                body: bytes) -> bool:
        """Answer one request; False when the connection must close."""
        with self._lock:
            hold = self._hold
        if hold is not None and hold(method, target.split("?", 1)[0]):
            self._count("held")
            self._released.wait()
        fault, after = self._draw(method, target)
        if fault == "slowdown":
            self._count("slowdown")
            payload = b"" if method == "HEAD" else SLOWDOWN_BODY
            _send_response(conn, 503, "Slow Down", [("Content-Type", "application/xml"),
                                                    ("x-amz-request-id", "faultproxy")],
                           payload, length=len(SLOWDOWN_BODY) if method == "HEAD" else None)
            return True
        if fault in ("reset", "stall") and not after:
            self._count(fault)
            self._break(conn, fault)
            return False
        status, reason, resp_headers, resp_body = self._forward(method, target, headers, body)
        self._count("forwarded")
        if fault in ("reset", "stall"):
            self._count(fault)
            self._break(conn, fault)
            return False
        if fault == "truncate" and method == "GET" and status in (200, 206) and len(resp_body) > 0:
            self._count("truncate")
            cut = self._rng_int(0, len(resp_body) - 1)
            _send_response(conn, status, reason, resp_headers, resp_body[:cut], length=len(resp_body))
            conn.shutdown(socket.SHUT_RDWR)
            return False
        length = None
        if method == "HEAD":
            length = next((int(v) for k, v in resp_headers if k.lower() == "content-length"), 0)
        _send_response(conn, status, reason, resp_headers, resp_body, length=length)
        return True

    def _rng_int(self, lo: int, hi: int) -> int:
        with self._lock:
            return self._rng.randint(lo, hi)

    def _break(self, conn: socket.socket, fault: str) -> None:
        if fault == "stall":
            self._stop.wait(self.stall_s)
            return
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = RST

    def _forward(self, method: str, target: str, headers: list[tuple[str, str]],
                 body: bytes) -> tuple[int, str, list[tuple[str, str]], bytes]:
        up = http.client.HTTPConnection(*self.upstream, timeout=self.socket_timeout)
        try:
            out = [(k, v) for k, v in headers if k.lower() not in _HOP_BY_HOP and k.lower() != "content-length"]
            if body or method in ("PUT", "POST"):
                out.append(("Content-Length", str(len(body))))
            up.putrequest(method, target, skip_host=True, skip_accept_encoding=True)
            for k, v in out:
                up.putheader(k, v)
            up.endheaders(body if body else None)
            resp = up.getresponse()
            data = resp.read() if method != "HEAD" else b""
            hdrs = [(k, v) for k, v in resp.getheaders() if k.lower() not in _HOP_BY_HOP]
            if method != "HEAD":
                hdrs = [(k, v) for k, v in hdrs if k.lower() != "content-length"]
            return resp.status, resp.reason, hdrs, data
        finally:
            up.close()


# --- HTTP/1.1 framing ------------------------------------------------------------------------

def _recv_more(conn: socket.socket, buf: bytearray) -> None:
    chunk = conn.recv(1 << 16)
    if not chunk:
        raise _Closed()
    buf += chunk


def _read_exact(conn: socket.socket, buf: bytearray, n: int) -> bytes:
    while len(buf) < n:
        _recv_more(conn, buf)
    out = bytes(buf[:n])
    del buf[:n]
    return out


def _read_line(conn: socket.socket, buf: bytearray) -> bytes:
    while b"\r\n" not in buf:
        if len(buf) > _MAX_HEADER_BYTES:
            raise _Closed()
        _recv_more(conn, buf)
    i = buf.index(b"\r\n")
    line = bytes(buf[:i])
    del buf[:i + 2]
    return line


def _read_request(conn: socket.socket, buf: bytearray) -> tuple[str, str, list[tuple[str, str]], bytes] | None:
    """One request off a keep-alive connection; None when the client closed it between requests."""
    while b"\r\n\r\n" not in buf:
        if len(buf) > _MAX_HEADER_BYTES:
            raise _Closed()
        try:
            chunk = conn.recv(1 << 16)
        except socket.timeout:
            return None
        if not chunk:
            return None
        buf += chunk
    end = buf.index(b"\r\n\r\n")
    head = bytes(buf[:end]).decode("latin-1").split("\r\n")
    del buf[:end + 4]
    method, target, _version = head[0].split(" ", 2)
    headers = []
    for line in head[1:]:
        k, _, v = line.partition(":")
        headers.append((k.strip(), v.strip()))
    lower = {k.lower(): v for k, v in headers}
    if lower.get("expect", "").lower() == "100-continue":
        conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
    if "chunked" in lower.get("transfer-encoding", "").lower():
        body = bytearray()
        while True:
            size = int(_read_line(conn, buf).split(b";")[0], 16)
            if size == 0:
                while _read_line(conn, buf):  # trailers
                    pass
                break
            if len(body) + size > _MAX_BODY_BYTES:
                raise _Closed()
            body += _read_exact(conn, buf, size)
            _read_line(conn, buf)
        return method, target, headers, bytes(body)
    n = int(lower.get("content-length", "0") or 0)
    if n > _MAX_BODY_BYTES:
        raise _Closed()
    return method, target, headers, _read_exact(conn, buf, n)


def _send_response(conn: socket.socket, status: int, reason: str, headers: list[tuple[str, str]], body: bytes,
                   *, length: int | None = None) -> None:
    lines = [f"HTTP/1.1 {status} {reason}"]
    lines += [f"{k}: {v}" for k, v in headers if k.lower() != "content-length"]
    lines.append(f"Content-Length: {len(body) if length is None else length}")
    lines.append("Connection: keep-alive")
    conn.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)


def s3_options_through(proxy_url: str, base: dict, *, read_timeout: float = 1.0) -> dict:
    """S3 storage_options that reach the bucket through the proxy with short timeouts and no retries
    below the Store: botocore makes one attempt and s3fs one try, so every fault the proxy injects
    reaches the Store, whose own retries (and their count in ``Store.stats``) are what is tested.

    s3fs takes its retry count from an attribute, not a constructor argument: it is set on the
    (cached) filesystem instance these options open, which every Store opened with them shares."""
    import fsspec

    opts = {**base, "client_kwargs": {**base.get("client_kwargs", {}), "endpoint_url": proxy_url},
            "config_kwargs": {"read_timeout": read_timeout, "connect_timeout": 1,
                              "retries": {"total_max_attempts": 1}},
            "use_listings_cache": False}
    fs = fsspec.filesystem("s3", **opts)
    fs.retries = 1
    return opts


__all__ = ["FAULTS", "FaultProxy", "SLOWDOWN_BODY", "s3_options_through"]
