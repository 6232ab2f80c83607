"""The rollout client for asyncio: ``await client.sample_async(...)``, fanned out with ``asyncio.gather``.

An RL loop in the Loops / Tinker style samples a whole group at once (one task per
completion, ``asyncio.gather`` over them), so a client that blocks a thread per
request does not fit it. :class:`AsyncRolloutClient` does what
:class:`ckptdelta.loader.client.RolloutClient` does, on one event loop and one pooled
``httpx.AsyncClient``: 408 (``min_policy_version`` not reached yet), 502-504 and
unreachable replicas are retried with exponential backoff and jitter until
``ready_timeout``, its last try made at the deadline; ``affinity_key`` pins a group
to one replica, the same one the sync client picks for the key, and moves on to the
next in the key's order (the sync client's too) when that replica cannot serve it; ``hotload`` moves
the whole fleet to one version, a replica still starting waited for until
``ready_timeout`` as the sync client and ``ckptdelta hotload --wait`` wait for it
(loader/fleet.py, StartWait). Other errors raise at once, with the replica's own
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

from ckptdelta.delta.errors import ReplicaError

from ckptdelta.loader import fleet
from ckptdelta.loader.client import (SAMPLE_TIMEOUT_S, Accept, RolloutClient, SampleTries, sample_request,
                                     sampling_timeout)

log = logging.getLogger("ckptdelta.client")


class AsyncRolloutClient:
    """Round-robin (or affinity-pinned) sampling over replicas, and fleet-wide hot-loads, for asyncio.

    ``max_connections`` bounds the requests in flight to all replicas together (httpx's pool); a
    ``gather`` of more waits for a connection, it does not fail."""

    # the sync client's own choice of replica and backoff, shared: a key lands on the same replica from
    # either client (a group sampled async and scored sync shares a replica's prefix cache and version)
    replica_for = RolloutClient.replica_for
    replica_order = RolloutClient.replica_order
    _round = RolloutClient._round
    _delay = RolloutClient._delay

    def __init__(self, replica_urls: Sequence[str], *, api_key: str | None = None, timeout: float = 60.0,
                 ready_timeout: float = 300.0, backoff_base: float = 0.1, backoff_max: float = 5.0,
                 max_connections: int = 256, sample_timeout: float | None = SAMPLE_TIMEOUT_S):
        if not replica_urls:
            raise ValueError("AsyncRolloutClient needs at least one replica URL")
        self.replicas = [u.rstrip("/") for u in replica_urls]
        self.ready_timeout = ready_timeout
        self.sample_timeout = sample_timeout
        self._sample_timeout = sampling_timeout(timeout, sample_timeout)
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
        :meth:`ckptdelta.loader.client.RolloutClient.sample`: ``sampling`` passes through (max_tokens, temperature,
        seed, logprobs, ...); 408, 502-504 and unreachable replicas are retried until ``ready_timeout``
        (PolicyVersionTimeoutError when no replica reached ``min_policy_version`` by then)."""
        path, body = sample_request(prompt, n, min_policy_version, return_engine_data, sampling)
        return await self._post_sample(path, body, min_policy_version, affinity_key)

    async def _post_sample(self, path: str, body: dict[str, Any], min_policy_version: int | None,
                           affinity_key: str | None, accept: "Accept | None" = None) -> Any:
        """As :meth:`ckptdelta.loader.client.RolloutClient._post_sample`, on this event loop."""
        tries = SampleTries(self, path, min_policy_version)
        for attempt in itertools.count():
            for url in self._round(affinity_key):
                try:
                    answer = tries.judge(url, await self._http.post(url + path, json=body,
                                                                    timeout=tries.limit(self._sample_timeout)))
                except httpx.TransportError as e:
                    answer = tries.judge(url, e)
                if answer is not None:
                    result = answer if accept is None else accept(tries, url, answer)
                    if result is not None:
                        return result
            await asyncio.sleep(tries.delay(attempt))
        raise AssertionError("unreachable")

    # --- hot-loads ---------------------------------------------------------------------------

    async def hotload(self, snapshot: str | int = "latest", *, wait: bool = True, timeout: float = 600.0,
                      poll_interval: float = 0.1, await_commit_s: float | None = None) -> dict[str, dict[str, Any]]:
        """Hot-load ``snapshot`` on every replica, as :meth:`ckptdelta.loader.client.RolloutClient.hotload`: every replica on
        its own, at once, each hot-load given ``timeout`` (one that is dead, hung, of another run or answering
        something else stops no other; one that is starting, refusing connections or answering STARTING, is
        waited for until ``ready_timeout``, as the sync client does); "latest" is resolved by the first replica
        that accepts it and the others asked for that exact version; with ``wait``, until each is READY at it.
        Unless every one is, raises (once all have ended) SnapshotNotFoundError, RunMismatchError,
        HotLoadConflictError, HotLoadError (FAILED somewhere), ReplicaError or HotLoadTimeoutError, each carrying
        ``.states`` (replica -> its answer). ``await_commit_s``: as the sync client's (a version being
        published is waited for, its objects fetched as they land)."""
        plan = fleet.FleetPlan(self.replicas, snapshot)
        cond = asyncio.Condition()

        async def one(i: int) -> dict[str, Any]:
            try:
                return await self._hotload_one(i, plan, cond, wait=wait, timeout=timeout,
                                               poll_interval=poll_interval, await_commit_s=await_commit_s)
            finally:     # whatever ended it, the others must not wait for this one's first answer or resolve
                async with cond:
                    plan.answered(i, None)
                    plan.resolved(i, None)
                    cond.notify_all()

        states = dict(zip(self.replicas, await asyncio.gather(*(one(i) for i in range(len(self.replicas))))))
        fleet.raise_for(states, snapshot, wait=wait)
        return states

    async def _hotload_one(self, i: int, plan: fleet.FleetPlan, cond: asyncio.Condition, *, wait: bool,
                           timeout: float, poll_interval: float,
                           await_commit_s: float | None = None) -> dict[str, Any]:
        url = self.replicas[i]
        up = fleet.StartWait(url, self.ready_timeout)     # the sync client's rule for a replica still starting
        while True:
            result: dict[str, Any] | ReplicaError
            try:
                result = await self._status(url)
            except ReplicaError as e:
                result = e
            if isinstance(result, dict) and not up.starting(result):
                st = result
                break
            async with cond:      # no run from this one yet: those after it do not wait for it
                plan.answered(i, None)
                cond.notify_all()
            if not up.again(result):
                return up.row(result)
            await asyncio.sleep(up.delay())
        run_id = st["run_id"]
        run = None
        async with cond:
            plan.answered(i, run_id)
            cond.notify_all()
            while run_id is not None and (run := plan.run(i, run_id)) is None:
                await cond.wait()      # for the replicas before it to answer once: each within one request
        if run is not None and run[0] != run_id:
            return fleet.other_run(st, run)
        async with cond:
            while (target := plan.take_target(i)) is None:
                await cond.wait()      # for the replica resolving the name: one request
        deadline = time.monotonic() + timeout         # its own timeout, from its own start
        # a version asked for by number is answered once its job ends (one request); a name is answered at once,
        # as the others wait for the version it resolves to
        held = fleet.long_poll_s(timeout, self._http.timeout.read) if wait and isinstance(target[0], int) else None
        job = await self._post_job(url, target[0], await_commit_s, held)
        if not isinstance(target[0], int):      # this replica was asked for the name: the others wait on it
            async with cond:
                plan.resolved(i, job["target_version"] if job["state"] in fleet.JOB_STATES else None)
                cond.notify_all()
        if not wait:
            return job
        path = f"/v1/hotload/{job['id']}" if job["state"] in fleet.BUSY else None
        while path is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                return fleet.timed_out(job, timeout)
            # answered as soon as the job ends (``wait``); an older replica, which answers at once, is polled
            wait = fleet.long_poll_s(left, self._http.timeout.read)
            t0 = time.monotonic()
            try:
                job = fleet.job_answer(url, f"GET {path}", await self._get(url, f"{path}?wait={wait:.3f}"),
                                       job["id"])
            except ReplicaError as e:
                return {**job, "error": str(e)}
            if job["state"] not in fleet.BUSY:
                break
            if time.monotonic() - t0 < wait / 2:
                await asyncio.sleep(min(poll_interval, max(0.0, deadline - time.monotonic())))
        return job

    async def _post_job(self, url: str, snapshot: str | int, await_commit_s: float | None = None,
                        wait_s: float | None = None) -> dict[str, Any]:
        what = "POST /v1/hotload"
        body = fleet.hotload_body(snapshot, await_commit_s=await_commit_s, wait_s=wait_s)
        try:
            r = await self._http.post(url + "/v1/hotload", json=body)
            if wait_s is not None and fleet.wait_refused(r):      # an older replica: its job is waited for by GETs
                r = await self._http.post(url + "/v1/hotload", json={k: v for k, v in body.items() if k != "wait"})
            return fleet.job_answer(url, what, fleet.answer(url, what, r, ok=(200, 202)))
        except httpx.TransportError as e:
            return fleet.failed_state(fleet.transport_error(url, what, e))
        except ReplicaError as e:
            return fleet.failed_state(e)

    # --- status -----------------------------------------------------------------------------------

    async def status(self) -> dict[str, dict[str, Any]]:
        """``GET /v1/status`` of every replica, at once; one that cannot be reached or answers something that is
        not a replica's status maps to ``{"state": "UNREACHABLE" or "REJECTED", "error": ...}``."""
        async def one(url: str) -> dict[str, Any]:
            try:
                return await self._status(url)
            except ReplicaError as e:
                return fleet.failed_state(e)
        return dict(zip(self.replicas, await asyncio.gather(*(one(u) for u in self.replicas))))

    async def _status(self, url: str) -> dict[str, Any]:
        """As :meth:`ckptdelta.loader.client.RolloutClient._status`."""
        try:
            r = await self._http.get(url + "/v1/status")
        except httpx.TransportError as e:
            raise fleet.transport_error(url, "GET /v1/status", e) from None
        return fleet.status_of(url, r)

    async def _get(self, url: str, path: str) -> dict[str, Any]:
        try:
            r = await self._http.get(url + path)
        except httpx.TransportError as e:
            raise fleet.transport_error(url, f"GET {path}", e) from None
        return fleet.answer(url, f"GET {path}", r)
