"""The rollout client for asyncio: ``await client.sample_async(...)``, fanned out with ``asyncio.gather``.

An RL loop in the Loops / Tinker style samples a whole group at once (one task per
completion, ``asyncio.gather`` over them), so a client that blocks a thread per
request does not fit it. :class:`AsyncRolloutClient` does what
:class:`loader.client.RolloutClient` does, on one event loop and one pooled
``httpx.AsyncClient``: 408 (``min_policy_version`` not reached yet), 502-504 and
unreachable replicas are retried with exponential backoff and jitter until
``ready_timeout``, its last try made at the deadline; ``affinity_key`` pins a group
to one replica, the same one the sync client picks for the key; ``hotload`` moves
the whole fleet to one version. Other errors raise at once, with the replica's own
message.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from typing import Any, Sequence

import httpx

from delta.errors import (HotLoadConflictError, HotLoadError, HotLoadTimeoutError,
                          ReplicaError, SnapshotNotFoundError)

from .client import RolloutClient, SampleTries, _error_of, _summary, _with_states, sample_request

log = logging.getLogger("ckptdelta.client")


class AsyncRolloutClient:
    """Round-robin (or affinity-pinned) sampling over replicas, and fleet-wide hot-loads, for asyncio.

    ``max_connections`` bounds the requests in flight to all replicas together (httpx's pool); a
    ``gather`` of more waits for a connection, it does not fail."""

    # the sync client's own choice of replica and backoff, shared: a key lands on the same replica from
    # either client (a group sampled async and scored sync shares a replica's prefix cache and version)
    replica_for = RolloutClient.replica_for
    _delay = RolloutClient._delay

    def __init__(self, replica_urls: Sequence[str], *, api_key: str | None = None, timeout: float = 60.0,
                 ready_timeout: float = 300.0, backoff_base: float = 0.1, backoff_max: float = 5.0,
                 max_connections: int = 256):
        if not replica_urls:
            raise ValueError("AsyncRolloutClient needs at least one replica URL")
        self.replicas = [u.rstrip("/") for u in replica_urls]
        self.ready_timeout = ready_timeout
        self.backoff_base, self.backoff_max = backoff_base, backoff_max
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(timeout=timeout, headers=headers,
                                       limits=httpx.Limits(max_connections=max_connections,
                                                           max_keepalive_connections=max_connections))
        self._rr = itertools.count()
        self._rr_lock = threading.Lock()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> "AsyncRolloutClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # --- sampling ------------------------------------------------------------------------

    async def sample_async(self, prompt: str | Sequence[int] | Sequence[dict[str, str]], *, n: int = 1,
                           min_policy_version: int | None = None, affinity_key: str | None = None,
                           return_engine_data: bool = True, **sampling: Any) -> dict[str, Any]:
        """One completion request (a list of ``{"role", "content"}`` messages goes to the chat endpoint), as
        :meth:`loader.client.RolloutClient.sample`: ``sampling`` passes through (max_tokens, temperature,
        seed, logprobs, ...); 408, 502-504 and unreachable replicas are retried until ``ready_timeout``
        (PolicyVersionTimeoutError when no replica reached ``min_policy_version`` by then)."""
        path, body = sample_request(prompt, n, min_policy_version, return_engine_data, sampling)
        tries = SampleTries(self, path, min_policy_version)
        for attempt in itertools.count():
            url = self.replica_for(affinity_key)
            try:
                answer = tries.judge(url, await self._http.post(url + path, json=body))
            except httpx.TransportError as e:
                answer = tries.judge(url, e)
            if answer is not None:
                return answer
            await asyncio.sleep(tries.delay(attempt))
        raise AssertionError("unreachable")

    # --- hot-loads ---------------------------------------------------------------------------

    async def hotload(self, snapshot: str | int = "latest", *, wait: bool = True, timeout: float = 600.0,
                      poll_interval: float = 0.1) -> dict[str, dict[str, Any]]:
        """Hot-load ``snapshot`` on every replica, as :meth:`loader.client.RolloutClient.hotload`: "latest" is
        resolved by the first replica and the others asked for that exact version; with ``wait``, until each
        is READY at it. Raises HotLoadError (FAILED somewhere), HotLoadTimeoutError, HotLoadConflictError or
        SnapshotNotFoundError, each carrying ``.states`` (replica -> its answer)."""
        states: dict[str, dict[str, Any]] = {}
        first = await self._post_hotload(self.replicas[0], snapshot, states)
        target = first["target_version"]
        await asyncio.gather(*(self._post_hotload(u, target, states) for u in self.replicas[1:]))
        if not wait:
            return states
        deadline = time.monotonic() + timeout
        pending = {u for u, s in states.items() if s.get("state") != "READY"}
        while pending:
            answers = await asyncio.gather(*(self._get(u, f"/v1/hotload/{states[u]['id']}") for u in sorted(pending)))
            for url, r in zip(sorted(pending), answers):
                states[url] = r
                if r.get("state") == "READY" and r.get("target_version") == target:
                    pending.discard(url)
                elif r.get("state") == "FAILED":
                    raise _with_states(HotLoadError(
                        f"hot-load of version {target} FAILED on {url}: {r.get('reason')} "
                        f"(states: {_summary(states)})"), states)
            if pending:
                if time.monotonic() > deadline:
                    raise _with_states(HotLoadTimeoutError(
                        f"hot-load of version {target} not READY within {timeout}s on {sorted(pending)} "
                        f"(states: {_summary(states)})"), states)
                await asyncio.sleep(poll_interval)
        return states

    async def _post_hotload(self, url: str, snapshot: str | int, states: dict[str, dict[str, Any]]) -> dict[str, Any]:
        try:
            r = await self._http.post(url + "/v1/hotload", json={"snapshot": snapshot})
        except httpx.TransportError as e:
            raise _with_states(ReplicaError(f"replica {url} unreachable for hot-load: {e}"), states) from None
        body = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
        if r.status_code in (200, 202):
            states[url] = body
            return body
        err = body.get("error", {}) if isinstance(body, dict) else {}
        states[url] = {"state": "REJECTED", "status": r.status_code, "error": err}
        msg = f"replica {url} refused hot-load of {snapshot!r}: {r.status_code} {err.get('message', r.text[:300])}"
        if r.status_code == 404:
            raise _with_states(SnapshotNotFoundError(msg), states)
        if r.status_code == 409:
            raise _with_states(HotLoadConflictError(msg), states)
        raise _with_states(ReplicaError(msg), states)

    # --- status -----------------------------------------------------------------------------------

    async def status(self) -> dict[str, dict[str, Any]]:
        """``GET /v1/status`` of every replica, at once; an unreachable one maps to ``{"error": ...}``."""
        async def one(url: str) -> dict[str, Any]:
            try:
                return await self._get(url, "/v1/status")
            except ReplicaError as e:
                return {"error": str(e)}
        return dict(zip(self.replicas, await asyncio.gather(*(one(u) for u in self.replicas))))

    async def _get(self, url: str, path: str) -> dict[str, Any]:
        try:
            r = await self._http.get(url + path)
        except httpx.TransportError as e:
            raise ReplicaError(f"replica {url} unreachable ({path}): {e}") from None
        if r.status_code != 200:
            raise ReplicaError(f"replica {url} answered {path} with {r.status_code}: "
                               f"{_error_of(r).get('message') or r.text[:300]}")
        return r.json()
