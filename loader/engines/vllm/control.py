"""Talking to a vLLM server: its HTTP client (TCP or a Unix socket), the control RPC into its workers
(``/collective_rpc``, pause, resume, reset), and the error a vLLM that misbehaves raises.

Shared by the replica, the applier, the LoRA engine and the liveness watch, so none of
them imports another for it.
"""

from __future__ import annotations

import json
import time
from typing import Any

import httpx

from ckptdelta.delta.errors import CkptDeltaError

CONTROL_TIMEOUT_S = 300.0


class VllmError(CkptDeltaError, RuntimeError):
    """vLLM refused or failed a control call (start, pause, reload, digests, resume)."""


UNIX_PREFIX = "unix:"


def http_client(url: str, *, asynchronous: bool = False, **kw: Any) -> "httpx.Client | httpx.AsyncClient":
    """An HTTP client for vLLM at ``url``: ``http(s)://HOST:PORT`` or ``unix:PATH`` (its ``--uds``)."""
    if url.startswith(UNIX_PREFIX):
        path = url[len(UNIX_PREFIX):]
        transport = (httpx.AsyncHTTPTransport if asynchronous else httpx.HTTPTransport)(uds=path)
        kw.update(transport=transport, base_url="http://vllm")
    else:
        kw.update(base_url=url)
    return (httpx.AsyncClient if asynchronous else httpx.Client)(**kw)


# --- control calls ------------------------------------------------------------------------------

class VllmControl:
    """vLLM's RL and dev endpoints (pause, resume, collective_rpc, prefix cache, weight version)."""

    def __init__(self, url: str, *, api_key: str | None = None, timeout: float = CONTROL_TIMEOUT_S):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.url = url.rstrip("/")
        self.http = http_client(self.url, timeout=timeout, headers=headers)

    def _post(self, path: str, **kw: Any) -> Any:
        try:
            r = self.http.post(path, **kw)
        except httpx.HTTPError as e:
            raise VllmError(f"vLLM at {self.url}: POST {path} failed: {e}") from e
        if r.status_code != 200:
            raise VllmError(f"vLLM at {self.url}: POST {path} answered {r.status_code}: {r.text[:500]}")
        return r.json() if r.content else None

    def pause(self) -> None:
        self._post("/pause", params={"mode": "keep"})

    def resume(self) -> None:
        self._post("/resume")

    def is_paused(self) -> bool:
        try:
            r = self.http.get("/is_paused")
            return bool(r.json().get("is_paused")) if r.status_code == 200 else False
        except (httpx.HTTPError, ValueError, AttributeError) as e:
            raise VllmError(f"vLLM at {self.url}: GET /is_paused failed: {e}") from e

    def reset_prefix_cache(self, *, running: bool) -> bool:
        out = self._post("/reset_prefix_cache", params={"reset_running_requests": str(running).lower()})
        return bool(out and out.get("success"))

    def set_version(self, version: int | None) -> None:
        self._post("/update_weight_version", json={"new_version": str(version)})

    def rpc(self, method: str, spec: dict[str, Any]) -> list[Any]:
        """Call a worker method on every worker; one result per worker."""
        out = self._post("/collective_rpc", json={"method": method, "args": [json.dumps(spec)]})
        results = (out or {}).get("results")
        if not isinstance(results, list) or not results:
            raise VllmError(f"vLLM at {self.url}: {method} returned {str(out)[:200]!r}, not one result per worker")
        for w, r in enumerate(results):
            if not isinstance(r, dict):
                raise VllmError(f"vLLM at {self.url}: worker {w} answered {method} with {str(r)[:200]!r}")
            if "error" in r:
                raise VllmError(f"vLLM at {self.url}: worker {w} failed {method}: {r['error']}")
        return results

    def poll(self, method: str, token: str, what: str, timeout: float = CONTROL_TIMEOUT_S) -> list[dict[str, Any]]:
        """Every worker's answer about background job ``token`` once none is running (each poll is a short
        RPC; the work itself runs in the workers' threads, beside vLLM's steps). Polls every 5 ms at first,
        backing off to 50 ms: short jobs are seen done soon, long ones cost few calls."""
        deadline, wait = time.monotonic() + timeout, 0.005
        while True:
            answers = self.rpc(method, {"token": token})
            if all(a.get("state") != "running" for a in answers):
                return answers
            if time.monotonic() > deadline:
                raise VllmError(f"{what} ({token}) took more than {timeout:.0f}s")
            time.sleep(wait)
            wait = min(0.05, wait * 1.5)

    def close(self) -> None:
        self.http.close()
