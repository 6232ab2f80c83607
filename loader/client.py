"""The trainer's view of a fleet of replicas: sample rollouts, hot-load a snapshot everywhere.

A trainer that has just published version v asks for rollouts with
``min_policy_version=v``: replicas still serving an older policy answer 408 and
this client retries, with exponential backoff and jitter, until one has
hot-loaded v or ``ready_timeout`` passes. ``affinity_key`` pins related
requests (a GRPO group, one conversation) to one replica so they share its
prefix cache and its policy version.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

import httpx

from delta.errors import (HotLoadConflictError, HotLoadError, HotLoadTimeoutError, PolicyVersionTimeoutError,
                          ReplicaError, SnapshotNotFoundError)

log = logging.getLogger("ckptdelta.client")

_RETRY_STATUS = frozenset({502, 503, 504})


class RolloutClient:
    """Round-robin (or affinity-pinned) sampling over replicas, and fleet-wide hot-loads."""

    def __init__(self, replica_urls: Sequence[str], *, api_key: str | None = None, timeout: float = 60.0,
                 ready_timeout: float = 300.0, backoff_base: float = 0.1, backoff_max: float = 5.0):
        if not replica_urls:
            raise ValueError("RolloutClient needs at least one replica URL")
        self.replicas = [u.rstrip("/") for u in replica_urls]
        self.ready_timeout = ready_timeout
        self.backoff_base, self.backoff_max = backoff_base, backoff_max
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(timeout=timeout, headers=headers)
        self._rr = itertools.count()
        self._rr_lock = threading.Lock()

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> "RolloutClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- choosing a replica -----------------------------------------------------------

    def replica_for(self, affinity_key: str | None = None) -> str:
        """The replica for a key (stable across processes: a hash, not Python's ``hash``), else the next in turn."""
        if affinity_key is not None:
            h = int.from_bytes(hashlib.blake2b(affinity_key.encode(), digest_size=8).digest(), "little")
            return self.replicas[h % len(self.replicas)]
        with self._rr_lock:
            return self.replicas[next(self._rr) % len(self.replicas)]

    def _delay(self, attempt: int) -> float:
        cap = min(self.backoff_max, self.backoff_base * 2 ** attempt)
        return random.uniform(cap / 2, cap)

    # --- sampling ------------------------------------------------------------------------

    def sample(self, prompt: str | Sequence[int] | Sequence[dict[str, str]], *, n: int = 1,
               min_policy_version: int | None = None, affinity_key: str | None = None,
               return_engine_data: bool = True, **sampling: Any) -> dict[str, Any]:
        """One completion request; a list of ``{"role", "content"}`` messages goes to the chat endpoint.

        ``sampling`` passes through (max_tokens, temperature, top_p, seed, stop,
        logprobs, top_logprobs, ...). Retries 408 (policy too old), 502-504 and
        unreachable replicas until ``ready_timeout``; any other error is raised."""
        path, body = sample_request(prompt, n, min_policy_version, return_engine_data, sampling)
        tries = SampleTries(self, path, min_policy_version)
        for attempt in itertools.count():
            url = self.replica_for(affinity_key)
            try:
                answer = tries.judge(url, self._http.post(url + path, json=body))
            except httpx.TransportError as e:
                answer = tries.judge(url, e)
            if answer is not None:
                return answer
            time.sleep(tries.delay(attempt))
        raise AssertionError("unreachable")

    # --- hot-loads ---------------------------------------------------------------------------

    def hotload(self, snapshot: str | int = "latest", *, wait: bool = True, timeout: float = 600.0,
                poll_interval: float = 0.1) -> dict[str, dict[str, Any]]:
        """Hot-load ``snapshot`` on every replica; with ``wait``, until each is READY at that version.

        "latest" is resolved by the first replica and the others are asked for
        that exact version, so a snapshot published meanwhile cannot split the
        fleet. Raises HotLoadError (FAILED somewhere), HotLoadTimeoutError,
        HotLoadConflictError (a replica runs another hot-load) or
        SnapshotNotFoundError; each carries ``.states`` (replica -> its answer)."""
        states: dict[str, dict[str, Any]] = {}
        first = self._post_hotload(self.replicas[0], snapshot, states)
        target = first["target_version"]
        if len(self.replicas) > 1:
            with ThreadPoolExecutor(max_workers=min(16, len(self.replicas) - 1)) as pool:
                list(pool.map(lambda u: self._post_hotload(u, target, states), self.replicas[1:]))
        if not wait:
            return states
        deadline = time.monotonic() + timeout
        pending = {u for u, s in states.items() if s.get("state") != "READY"}
        while pending:
            for url in sorted(pending):
                r = self._get(url, f"/v1/hotload/{states[url]['id']}")
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
                time.sleep(poll_interval)
        return states

    def _post_hotload(self, url: str, snapshot: str | int, states: dict[str, dict[str, Any]]) -> dict[str, Any]:
        try:
            r = self._http.post(url + "/v1/hotload", json={"snapshot": snapshot})
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

    def hotload_each(self, snapshot: str | int = "latest", *, wait: bool = True, timeout: float = 600.0,
                     poll_interval: float = 0.2, wait_up: bool = False) -> dict[str, dict[str, Any]]:
        """Hot-load ``snapshot`` on every replica, each on its own: a replica that fails, refuses or cannot be
        reached does not stop the others (what ``ckptdelta hotload URL... SNAPSHOT`` runs). Never raises for a
        replica; returns replica -> its last answer, whose ``state`` is READY or FAILED (the job's own
        answer), REJECTED (refused: ``status`` and ``error``), UNREACHABLE (``error``), or, without ``wait``
        or past ``timeout``, the job's state then (QUEUED, PREPARING, SWAPPING; past ``timeout`` also with
        ``error``).

        Every replica must serve the run of the first one that answers (one of another run is REJECTED, not
        hot-loaded: its versions are another run's). "latest" is resolved by the first replica that accepts the
        hot-load, the others are asked for that exact version. The newest request wins: a replica busy with a
        hot-load to another version queues this one behind it (``queue``, loader/hotload_jobs.py).
        ``wait_up``: first wait (within ``timeout``) for replicas that do not answer yet (still starting)."""
        deadline = time.monotonic() + timeout
        states: dict[str, dict[str, Any]] = {}
        with ThreadPoolExecutor(max_workers=min(16, len(self.replicas))) as pool:
            seen = dict(zip(self.replicas, pool.map(lambda u: self._status_for_hotload(u, deadline, wait_up),
                                                    self.replicas)))
            run_of = next(((u, st["run_id"]) for u, st in seen.items() if "run_id" in st), (None, None))
            todo = []
            for url, st in seen.items():
                if "error" in st:     # a transport error, or an answer that is not the replica's status (401...)
                    states[url] = {"state": "UNREACHABLE" if " unreachable " in st["error"] else "REJECTED",
                                   "error": st["error"]}
                elif st.get("run_id") != run_of[1]:
                    states[url] = {"state": "REJECTED", "status": None, "from_version": st.get("policy_version"),
                                   "error": f"serves run {st.get('run_id')}, not run {run_of[1]} of {run_of[0]}: "
                                            "not hot-loaded (its versions are another run's)"}
                else:
                    todo.append(url)
            target: str | int = snapshot
            while todo and not isinstance(target, int):   # the first replica that accepts resolves the name
                url = todo.pop(0)
                states[url] = self._post_each(url, snapshot)
                if isinstance(states[url].get("target_version"), int):
                    target = states[url]["target_version"]
            states.update(zip(todo, pool.map(lambda u: self._post_each(u, target), todo)))
            if wait:
                busy = [u for u, st in states.items() if st.get("state") in ("QUEUED", "PREPARING", "SWAPPING")]
                states.update(zip(busy, pool.map(lambda u: self._wait_job(u, states[u], deadline, poll_interval),
                                                 busy)))
        return {u: states[u] for u in self.replicas}

    def _status_for_hotload(self, url: str, deadline: float, wait_up: bool) -> dict[str, Any]:
        while True:
            try:
                return self._get(url, "/v1/status")
            except ReplicaError as e:
                if not wait_up or time.monotonic() > deadline or "unreachable" not in str(e):
                    return {"error": str(e)}
            time.sleep(0.25)

    def _post_each(self, url: str, snapshot: str | int) -> dict[str, Any]:
        try:
            r = self._http.post(url + "/v1/hotload", json={"snapshot": snapshot, "queue": True})
        except httpx.TransportError as e:
            return {"state": "UNREACHABLE", "error": f"replica {url} unreachable for hot-load: {e}"}
        if r.status_code in (200, 202):
            return r.json()
        err = _error_of(r)
        return {"state": "REJECTED", "status": r.status_code,
                "error": f"{r.status_code} {err.get('type', '')}: {err.get('message') or r.text[:300]}"}

    def _wait_job(self, url: str, job: dict[str, Any], deadline: float, poll_interval: float) -> dict[str, Any]:
        while True:
            try:
                job = self._get(url, f"/v1/hotload/{job['id']}")
            except ReplicaError as e:
                return {**job, "error": str(e)}
            if job.get("state") in ("READY", "FAILED"):
                return job
            if time.monotonic() > deadline:
                return {**job, "error": f"not READY within the timeout (still {job.get('state')})"}
            time.sleep(poll_interval)

    # --- status -----------------------------------------------------------------------------------

    def status(self) -> dict[str, dict[str, Any]]:
        """``GET /v1/status`` of every replica; an unreachable one maps to ``{"error": ...}``."""
        out = {}
        for url in self.replicas:
            try:
                out[url] = self._get(url, "/v1/status")
            except ReplicaError as e:
                out[url] = {"error": str(e)}
        return out

    def _get(self, url: str, path: str) -> dict[str, Any]:
        try:
            r = self._http.get(url + path)
        except httpx.TransportError as e:
            raise ReplicaError(f"replica {url} unreachable ({path}): {e}") from None
        if r.status_code != 200:
            raise ReplicaError(f"replica {url} answered {path} with {r.status_code}: "
                               f"{_error_of(r).get('message') or r.text[:300]}")
        return r.json()


def _error_of(r: httpx.Response) -> dict[str, Any]:
    try:
        body = r.json()
    except ValueError:
        return {}
    err = body.get("error") if isinstance(body, dict) else None
    return err if isinstance(err, dict) else {}


def _with_states(exc: Exception, states: dict[str, dict[str, Any]]) -> Exception:
    exc.states = dict(states)  # type: ignore[attr-defined]
    return exc


def _summary(states: dict[str, dict[str, Any]]) -> str:
    return ", ".join(f"{u}={s.get('state')}" for u, s in states.items())


def sample_request(prompt: "str | Sequence[int] | Sequence[dict[str, str]]", n: int, min_policy_version: int | None,
                   return_engine_data: bool, sampling: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(path, body) of one sampling request: a list of ``{"role", "content"}`` messages goes to the chat
    endpoint, anything else (text, token ids) to completions."""
    chat = isinstance(prompt, (list, tuple)) and bool(prompt) and isinstance(prompt[0], dict)
    body: dict[str, Any] = {("messages" if chat else "prompt"): list(prompt) if not isinstance(prompt, str)
                            else prompt, "n": n, "return_engine_data": return_engine_data, **sampling}
    if min_policy_version is not None:
        body["min_policy_version"] = min_policy_version
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


class SampleTries:
    """The retry rule of one sampling request, the same for the sync and the async client: 408 (policy too
    old), 502-504 and unreachable replicas are tried again, with backoff, until ``ready_timeout``; any other
    answer is raised at once."""

    def __init__(self, client: Any, path: str, min_policy_version: int | None):
        self.client, self.path, self.min_version = client, path, min_policy_version
        self.t0 = time.monotonic()
        self.deadline = self.t0 + client.ready_timeout
        self.last = ""

    def judge(self, url: str, r: "httpx.Response | httpx.TransportError") -> dict[str, Any] | None:
        """The answer's JSON on 200, None when it is worth another try; raises ReplicaError otherwise."""
        if isinstance(r, httpx.TransportError):
            self.last = f"{url}: {type(r).__name__}: {r}"
            return None
        if r.status_code == 200:
            return r.json()
        err = _error_of(r)
        if r.status_code == 408 and err.get("type") == "policy_version_too_old":
            self.last = f"{url} serves policy version {err.get('policy_version')}, needs >= {self.min_version}"
        elif r.status_code not in _RETRY_STATUS:
            raise ReplicaError(f"replica {url} answered {self.path} with {r.status_code}: "
                               f"{err.get('message') or r.text[:500]}")
        else:
            self.last = f"{url}: {r.status_code} {err.get('message', '')}"
        return None

    def delay(self, attempt: int) -> float:
        """Seconds to wait before the next try; raises once ``ready_timeout`` has passed. The last try is made
        at the deadline, not one backoff before it: the timeout said is the time tried."""
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            tried = f"{attempt + 1} tries in {time.monotonic() - self.t0:.1f}s"
            timeout = self.client.ready_timeout
            if "policy version" in self.last:
                raise PolicyVersionTimeoutError(
                    f"no replica reached policy version {self.min_version} within the ready_timeout of "
                    f"{timeout:g}s ({tried}; last: {self.last})")
            raise ReplicaError(f"{self.path} failed on every try within the ready_timeout of {timeout:g}s "
                               f"({tried}); last: {self.last}")
        delay = min(self.client._delay(attempt), remaining)
        log.debug("retrying %s in %.2fs: %s", self.path, delay, self.last)
        return delay
