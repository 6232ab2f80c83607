"""The trainer's view of a fleet of replicas: sample rollouts, hot-load a snapshot everywhere.

A trainer that has just published version v asks for rollouts with
``min_policy_version=v``: replicas still serving an older policy answer 408 and
this client retries, with exponential backoff and jitter, until one has
hot-loaded v or ``ready_timeout`` passes. ``affinity_key`` pins related
requests (a GRPO group, one conversation) to one replica so they share its
prefix cache and its policy version, while that replica answers: a key orders
the whole fleet (rendezvous hashing, :meth:`RolloutClient.replica_order`), and a
try its replica cannot serve (down, starting, 502-504, below the floor) goes on
at once to the next in that order, so a dead or stale replica never holds a
group until ``ready_timeout`` while another could serve it. Each round of tries
starts again at the key's own replica.

``ready_timeout`` is how long any call waits for replicas to be ready, by one rule
for this client, the asyncio one and ``ckptdelta hotload --wait``: a replica that
refuses connections or answers STARTING (``serve`` while its engine loads) is
asked again until then, for a sample as for a hot-load (loader/fleet.py,
StartWait); one that is hung or answers garbage is not.

A sampling request's answer comes when its generation ends, so it is waited for
``sample_timeout`` (15 minutes by default, past a replica's own ``--request-timeout``),
not ``timeout``, which bounds connecting and every control call (a try of a sampling request connects and sends
within what is left of ``ready_timeout``, at least :data:`MIN_TRY_S`, so that replicas that never answer a
connection do not hold a request ``timeout`` each past it). A request that
gets no answer in that time is a :class:`SampleTimeoutError`, never sent again:
the replica took it and may still be generating it (a replica stops a generation
whose client has left, loader/server.py), and another try would end the same way.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

import httpx

from ckptdelta.delta.errors import PolicyVersionTimeoutError, ReplicaError, SampleTimeoutError

from ckptdelta.loader import fleet
from ckptdelta.loader.engines.base import ENGINE_TIMEOUT

log = logging.getLogger("ckptdelta.client")

_RETRY_STATUS = frozenset({502, 503, 504})
#: Seconds a sampling request waits for its answer (``sample_timeout``): longer than a replica's own bound on a
#: generation (``ckptdelta serve --request-timeout``, 600 s by default), so that the replica's 504 comes first.
SAMPLE_TIMEOUT_S = 900.0


def sampling_timeout(timeout: float, sample_timeout: float | None) -> httpx.Timeout:
    """The httpx timeout of a sampling request: ``timeout`` to connect and send, ``sample_timeout`` (None: no
    limit) for the answer, and no limit on waiting for a connection of the client's own pool (a ``gather`` of
    more requests than connections waits for one, it does not fail)."""
    return httpx.Timeout(timeout, read=sample_timeout, pool=None)


#: The least time a try of a sampling request is given to connect and send, however little of ``ready_timeout``
#: is left (the last round is made at the deadline, each of its replicas tried): a new TLS connection to a
#: replica in another region needs a few round trips.
MIN_TRY_S = 0.5


#: What a caller of ``_post_sample`` makes of a 200 answer: (tries, replica URL, answer) -> result, or None to
#: try again (loader/sampling.py reads tokens and logprobs out of it, and holds it to the policy floor).
Accept = Callable[["SampleTries", str, dict[str, Any]], Any]


class RolloutClient:
    """Round-robin (or affinity-pinned) sampling over replicas, and fleet-wide hot-loads."""

    def __init__(self, replica_urls: Sequence[str], *, api_key: str | None = None, timeout: float = 60.0,
                 ready_timeout: float = 300.0, backoff_base: float = 0.1, backoff_max: float = 5.0,
                 sample_timeout: float | None = SAMPLE_TIMEOUT_S):
        if not replica_urls:
            raise ValueError("RolloutClient needs at least one replica URL")
        self.replicas = [u.rstrip("/") for u in replica_urls]
        self.ready_timeout = ready_timeout
        self.sample_timeout = sample_timeout
        self._sample_timeout = sampling_timeout(timeout, sample_timeout)
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
        """The replica for a key (the first of :meth:`replica_order`), else the next in turn."""
        if affinity_key is not None:
            return self.replica_order(affinity_key)[0]
        with self._rr_lock:
            return self.replicas[next(self._rr) % len(self.replicas)]

    def replica_order(self, affinity_key: str) -> list[str]:
        """Every replica, in the order a request keyed ``affinity_key`` tries them: rendezvous (highest random
        weight) hashing of (key, URL).

        A keyed request must land where its group's prefix cache and policy version are, from any client and
        any process (so a hash of bytes, not Python's ``hash``), yet move on when that replica cannot serve it.
        Weighing each URL against the key gives both: the order does not depend on how the URLs were listed,
        a replica's failure moves its keys to their next replicas, spread over the fleet rather than all onto
        one neighbour, and adding or removing a replica moves only the keys it heads or headed."""
        key = affinity_key.encode()
        return sorted(self.replicas, key=lambda url: _weight(key, url), reverse=True)

    def _round(self, affinity_key: str | None) -> list[str]:
        """The replicas one round of a request's tries goes through: a keyed one's whole order (the next is
        asked at once when one cannot serve it), else the next replica in turn."""
        return self.replica_order(affinity_key) if affinity_key is not None else [self.replica_for(None)]

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
        return self._post_sample(path, body, min_policy_version, affinity_key)

    def _post_sample(self, path: str, body: dict[str, Any], min_policy_version: int | None,
                     affinity_key: str | None, accept: "Accept | None" = None) -> Any:
        """``body`` to ``path`` under :class:`SampleTries`' rule, in rounds (:meth:`_round`: a keyed request's
        replicas in its order, else the next in turn) with a backoff between rounds; ``accept(tries, url,
        answer)`` turns a 200 answer into the result, or None (after :meth:`SampleTries.again`) to try again."""
        tries = SampleTries(self, path, min_policy_version)
        for attempt in itertools.count():
            for url in self._round(affinity_key):
                try:
                    answer = tries.judge(url, self._http.post(url + path, json=body,
                                                              timeout=tries.limit(self._sample_timeout)))
                except httpx.TransportError as e:
                    answer = tries.judge(url, e)
                if answer is not None:
                    result = answer if accept is None else accept(tries, url, answer)
                    if result is not None:
                        return result
            time.sleep(tries.delay(attempt))
        raise AssertionError("unreachable")

    # --- hot-loads ---------------------------------------------------------------------------

    def hotload(self, snapshot: str | int = "latest", *, wait: bool = True, timeout: float = 600.0,
                poll_interval: float = 0.1, await_commit_s: float | None = None) -> dict[str, dict[str, Any]]:
        """Hot-load ``snapshot`` on every replica; with ``wait``, until each is READY at that version.

        As :meth:`hotload_each` (every replica on its own, at once, each hot-load given ``timeout``; one that is
        down does not stop the others; one that is starting is waited for until ``ready_timeout``), without
        queueing behind another hot-load, and then strict: unless every replica is READY (or, without ``wait``,
        has accepted), raises SnapshotNotFoundError, RunMismatchError (a replica of another run),
        HotLoadConflictError (a replica runs another hot-load), HotLoadError (FAILED somewhere), ReplicaError
        (unreachable, or answering something else) or HotLoadTimeoutError (a hot-load past ``timeout``, or a
        replica still STARTING at ``ready_timeout``), in that order of precedence, once every replica has ended;
        each carries ``.states`` (replica -> its answer, as :meth:`hotload_each` returns them).

        ``await_commit_s``: ``snapshot`` may be the version a publisher is writing now (newer than every committed
        one): each replica waits up to that long for its commit, fetching its objects as the publisher uploads
        them, instead of answering 404; ask as publish() starts and the fetch overlaps the upload
        (docs/SERVING.md, "Hot-loading the version being published")."""
        states = self._hotload_fleet(snapshot, wait=wait, timeout=timeout, poll_interval=poll_interval, queue=False,
                                     await_commit_s=await_commit_s)
        fleet.raise_for(states, snapshot, wait=wait)
        return states

    def hotload_each(self, snapshot: str | int = "latest", *, wait: bool = True, timeout: float = 600.0,
                     poll_interval: float = 0.2, await_commit_s: float | None = None) -> dict[str, dict[str, Any]]:
        """Hot-load ``snapshot`` on every replica, each on its own: a replica that fails, refuses, cannot be
        reached, hangs or answers something that is not a replica's answer does not stop or delay the others
        (what ``ckptdelta hotload URL... SNAPSHOT`` runs). All are asked at once, and each hot-load has its own
        ``timeout`` from when it was asked for: none spends another's. Never raises for a replica; returns
        replica -> its last answer, whose ``state`` is READY or FAILED (the job's own answer), REJECTED
        (refused, or an answer that is not a replica's: ``status``, ``error``), UNREACHABLE (``error``),
        STARTING (still starting at ``ready_timeout``: ``error``), or, without ``wait`` or past ``timeout``, the
        job's state then (QUEUED, PREPARING, SWAPPING; past ``timeout`` also with ``error``).

        Every replica must serve the run of the first one, in the order given, that answers (one of another run
        is REJECTED, not hot-loaded: its versions are another run's). "latest" is resolved by the first replica
        that accepts the hot-load, the others are asked for that exact version (loader/fleet.py, FleetPlan).
        The newest request wins: a replica busy with a hot-load to another version queues this one behind it
        (``queue``, loader/hotload_jobs.py). A replica that is starting (it refuses connections, or answers
        STARTING) is asked again until ``ready_timeout`` from the call, while the others go on (one rule for
        both clients and the CLI: :class:`ckptdelta.loader.fleet.StartWait`). Before its hot-load is asked for, a replica
        waits at most for those before it in the order given to answer ``/v1/status`` once, and for the one
        resolving the name: one request each (the client's ``timeout``), whatever they do."""
        return self._hotload_fleet(snapshot, wait=wait, timeout=timeout, poll_interval=poll_interval, queue=True,
                                   await_commit_s=await_commit_s)

    def _hotload_fleet(self, snapshot: str | int, *, wait: bool, timeout: float, poll_interval: float,
                       queue: bool, await_commit_s: float | None = None) -> dict[str, dict[str, Any]]:
        plan = fleet.FleetPlan(self.replicas, snapshot)
        cond = threading.Condition()

        def one(i: int) -> dict[str, Any]:
            try:
                return self._hotload_one(i, plan, cond, wait=wait, timeout=timeout, poll_interval=poll_interval,
                                         queue=queue, await_commit_s=await_commit_s)
            finally:     # whatever ended it, the others must not wait for this one's first answer or resolve
                with cond:
                    plan.answered(i, None)
                    plan.resolved(i, None)
                    cond.notify_all()

        # one thread a replica: one dead, hung or starting holds a thread for its timeout, never another replica
        with ThreadPoolExecutor(max_workers=len(self.replicas), thread_name_prefix="ckptdelta-fleet") as pool:
            return dict(zip(self.replicas, pool.map(one, range(len(self.replicas)))))

    def _hotload_one(self, i: int, plan: fleet.FleetPlan, cond: threading.Condition, *, wait: bool,
                     timeout: float, poll_interval: float, queue: bool,
                     await_commit_s: float | None = None) -> dict[str, Any]:
        url = self.replicas[i]
        up = fleet.StartWait(url, self.ready_timeout)
        while True:
            result: dict[str, Any] | ReplicaError
            try:
                result = self._status(url)
            except ReplicaError as e:
                result = e
            if isinstance(result, dict) and not up.starting(result):
                st = result
                break
            with cond:        # no run from this one yet: those after it do not wait for it
                plan.answered(i, None)
                cond.notify_all()
            if not up.again(result):
                return up.row(result)
            time.sleep(up.delay())
        run_id = st["run_id"]
        run = None
        with cond:
            plan.answered(i, run_id)
            cond.notify_all()
            while run_id is not None and (run := plan.run(i, run_id)) is None:
                cond.wait()       # for the replicas before it to answer once: each within one request
        if run is not None and run[0] != run_id:
            return fleet.other_run(st, run)
        with cond:
            while (target := plan.take_target(i)) is None:
                cond.wait()       # for the replica resolving the name: one request
        deadline = time.monotonic() + timeout          # its own timeout, from its own start
        # a version asked for by number is answered once its job ends (one request); a name is answered at once,
        # as the others wait for the version it resolves to
        held = fleet.long_poll_s(timeout, self._http.timeout.read) if wait and isinstance(target[0], int) else None
        job = self._post_job(url, target[0], queue, await_commit_s, held)
        if not isinstance(target[0], int):      # this replica was asked for the name: the others wait on it
            with cond:
                plan.resolved(i, job["target_version"] if job["state"] in fleet.JOB_STATES else None)
                cond.notify_all()
        if wait and job["state"] in fleet.BUSY:
            job = self._wait_job(url, job, deadline, poll_interval, timeout)
        return job

    def _post_job(self, url: str, snapshot: str | int, queue: bool, await_commit_s: float | None = None,
                  wait_s: float | None = None) -> dict[str, Any]:
        what = "POST /v1/hotload"
        body = fleet.hotload_body(snapshot, queue=queue, await_commit_s=await_commit_s, wait_s=wait_s)
        try:
            r = self._http.post(url + "/v1/hotload", json=body)
            if wait_s is not None and fleet.wait_refused(r):      # an older replica: its job is waited for by GETs
                r = self._http.post(url + "/v1/hotload", json={k: v for k, v in body.items() if k != "wait"})
            return fleet.job_answer(url, what, fleet.answer(url, what, r, ok=(200, 202)))
        except httpx.TransportError as e:
            return fleet.failed_state(fleet.transport_error(url, what, e))
        except ReplicaError as e:
            return fleet.failed_state(e)

    def _wait_job(self, url: str, job: dict[str, Any], deadline: float, poll_interval: float,
                  timeout: float) -> dict[str, Any]:
        path = f"/v1/hotload/{job['id']}"
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return fleet.timed_out(job, timeout)
            # the replica answers as soon as the job ends (``wait``); one that answers a busy job at once (an
            # older replica, which ignores ``wait``) is asked again after ``poll_interval``
            wait = fleet.long_poll_s(left, self._http.timeout.read)
            t0 = time.monotonic()
            try:
                job = fleet.job_answer(url, f"GET {path}", self._get(url, f"{path}?wait={wait:.3f}"), job["id"])
            except ReplicaError as e:
                return {**job, "error": str(e)}
            if job["state"] not in fleet.BUSY:
                return job
            if time.monotonic() - t0 < wait / 2:
                time.sleep(min(poll_interval, max(0.0, deadline - time.monotonic())))

    # --- status -----------------------------------------------------------------------------------

    def status(self) -> dict[str, dict[str, Any]]:
        """``GET /v1/status`` of every replica, all at once; one that cannot be reached or answers something that
        is not a replica's status maps to ``{"state": "UNREACHABLE" or "REJECTED", "error": ...}``."""
        def one(url: str) -> dict[str, Any]:
            try:
                return self._status(url)
            except ReplicaError as e:
                return fleet.failed_state(e)

        with ThreadPoolExecutor(max_workers=len(self.replicas), thread_name_prefix="ckptdelta-fleet") as pool:
            return dict(zip(self.replicas, pool.map(one, self.replicas)))

    def _status(self, url: str) -> dict[str, Any]:
        """``GET /v1/status`` of one replica, judged (:func:`ckptdelta.loader.fleet.status_of`); Unreachable without an
        answer."""
        try:
            r = self._http.get(url + "/v1/status")
        except httpx.TransportError as e:
            raise fleet.transport_error(url, "GET /v1/status", e) from None
        return fleet.status_of(url, r)

    def _get(self, url: str, path: str) -> dict[str, Any]:
        try:
            r = self._http.get(url + path)
        except httpx.TransportError as e:
            raise fleet.transport_error(url, f"GET {path}", e) from None
        return fleet.answer(url, f"GET {path}", r)


def _weight(key: bytes, url: str) -> int:
    """A replica's rendezvous weight for a key: a hash of both (the key's length first, so that no two (key,
    URL) pairs hash the same bytes), the same in every process and on every platform."""
    data = len(key).to_bytes(8, "little") + key + url.encode()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


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
    answer is raised at once, and so is no answer within ``sample_timeout`` or the replica's own
    ``--request-timeout`` (:class:`SampleTimeoutError`)."""

    def __init__(self, client: Any, path: str, min_policy_version: int | None):
        self.client, self.path, self.min_version = client, path, min_policy_version
        self.t0 = time.monotonic()
        self.deadline = self.t0 + client.ready_timeout
        self.last = ""
        self.tries = 0
        #: why each try of the round under way failed (a round: one replica in turn, or a key's whole order)
        self._round: list[str] = []

    def limit(self, timeout: httpx.Timeout) -> httpx.Timeout:
        """The httpx timeout of the next try: ``timeout`` (:func:`sampling_timeout`), its connect and send bounded
        by what is left of ``ready_timeout``, but at least :data:`MIN_TRY_S`: every replica of the last round,
        made at the deadline, still gets its try (a keyed request's next replica may serve it), and replicas that
        never answer a connection hold the request at most that long each past ``ready_timeout``, not
        ``timeout`` each. The answer is still waited for ``sample_timeout``: a replica that took the request
        may be generating it."""
        send = max(self.deadline - time.monotonic(), MIN_TRY_S)
        if timeout.connect is not None:
            send = min(send, timeout.connect)
        return httpx.Timeout(connect=send, read=timeout.read, write=send, pool=timeout.pool)

    def judge(self, url: str, r: "httpx.Response | httpx.TransportError") -> dict[str, Any] | None:
        """The answer's JSON on 200, None when it is worth another try; raises ReplicaError otherwise."""
        self.tries += 1
        if isinstance(r, httpx.ReadTimeout):
            # the replica took the request: it may still be generating it, so another try would spend its
            # time twice (a replica stops a generation whose client left, at its next token; vLLM aborts it)
            limit = self.client.sample_timeout
            raise SampleTimeoutError(
                f"replica {url} gave no answer to {self.path} within the client's sample_timeout of {limit:g}s; "
                "not sent again. A generation that long needs a longer sample_timeout (None waits for as "
                "long as it takes)") from r
        if isinstance(r, httpx.TransportError):
            return self.again(f"{url}: {type(r).__name__}: {r}")
        if r.status_code == 200:
            return fleet.answer(url, f"POST {self.path}", r)     # a body that is not JSON: ReplicaError at once
        err = fleet.error_of(r)
        if r.status_code == 504 and err.get("type") == ENGINE_TIMEOUT:
            raise SampleTimeoutError(f"replica {url} answered {self.path} with 504: {err.get('message')}; not sent "
                                     "again: its engine gave no answer within the replica's own --request-timeout, "
                                     "and another try would end the same way")
        if r.status_code == 408 and err.get("type") == "policy_version_too_old":
            return self.again(f"{url} serves policy version {err.get('policy_version')}, needs >= {self.min_version}")
        if r.status_code not in _RETRY_STATUS:
            raise ReplicaError(f"replica {url} answered {self.path} with {r.status_code}: "
                               f"{err.get('message') or r.text[:500]}")
        return self.again(f"{url}: {r.status_code} {err.get('message', '')}")

    def again(self, why: str) -> None:
        """An answer that is not the one wanted yet, for ``why`` (which names the replica): try again, as after
        a 408. A ``why`` that speaks of a "policy version" ends, at the deadline, as PolicyVersionTimeoutError."""
        self.last = why
        self._round.append(why)
        return None

    def delay(self, attempt: int) -> float:
        """Seconds to wait before the next round of tries (``attempt``: the round just over, from 0); raises once
        ``ready_timeout`` has passed. The last round is made at the deadline, not one backoff before it: the
        timeout said is the time tried. A last round in which a replica was too old (or answered on an older
        version) is a PolicyVersionTimeoutError, whatever the others of that round did: the floor is what no
        replica met."""
        reasons, self._round = self._round or [self.last], []
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            tried = f"{self.tries} tries in {time.monotonic() - self.t0:.1f}s"
            timeout = self.client.ready_timeout
            last = "; ".join(reasons)
            if any("policy version" in why for why in reasons):
                raise PolicyVersionTimeoutError(
                    f"no replica reached policy version {self.min_version} within the ready_timeout of "
                    f"{timeout:g}s ({tried}; last: {last})")
            raise ReplicaError(f"{self.path} failed on every try within the ready_timeout of {timeout:g}s "
                               f"({tried}); last: {last}")
        delay = min(self.client._delay(attempt), remaining)
        log.debug("retrying %s in %.2fs: %s", self.path, delay, self.last)
        return delay
