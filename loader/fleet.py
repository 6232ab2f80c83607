"""What the sync and the async client share when they ask a whole fleet at once: hot-loads and status.

Each replica is handled on its own, all of them at once, each with its own
deadline: a replica that is dead, hung, still starting, of another run, or
answering something that is not a replica's answer (not JSON, another schema,
HTTP 500) ends with a row that says so, and none of that holds another up. This
module holds the parts that do no I/O: judging a replica's answer
(:func:`answer`, :func:`status_answer`, :func:`job_answer`), the rows for what
went wrong, the exception a strict hot-load raises (:func:`raise_for`), and
:class:`FleetPlan`, what the replicas' hot-loads decide together. The clients
wait on the plan in their own way (a thread's condition, an event loop's).
"""

from __future__ import annotations

import re
import time
from typing import Any

import httpx

from ckptdelta.delta.errors import (HotLoadConflictError, HotLoadError, HotLoadTimeoutError, ReplicaError,
                                    RunMismatchError, SnapshotNotFoundError)

from ckptdelta.loader.hotload_jobs import FAILED, PREPARING, QUEUED, READY, SWAPPING

#: A replica's row when it could not be asked, or refused: no answer at all, or an answer that is not acceptance.
UNREACHABLE, REJECTED = "UNREACHABLE", "REJECTED"
#: A replica whose port answers while its engine still loads (``ckptdelta serve``: loader/starting.py).
STARTING = "STARTING"
JOB_STATES = (QUEUED, PREPARING, SWAPPING, READY, FAILED)
#: A hot-load still under way.
BUSY = (QUEUED, PREPARING, SWAPPING)
#: Seconds between two tries of a replica that refuses connections while the caller waits for it to come up.
UP_POLL_S = 0.25
_JOB_ID = re.compile(r"[A-Za-z0-9_\-][A-Za-z0-9._\-]{0,127}")     # one path segment, never '.' or '..'
_PEEK = 120


class Unreachable(ReplicaError):
    """No answer at all. ``refused``: nothing listens at the address, which is also what a replica in its
    first seconds looks like (``serve`` listens once its checks are done, and answers STARTING from then on
    until it serves: ckptdelta/cli/serve.py, loader/starting.py), so a caller waiting for replicas to come up tries it
    again (:class:`StartWait`); a replica that took the connection and then did not answer in time is hung,
    not starting."""

    def __init__(self, message: str, *, refused: bool) -> None:
        super().__init__(message)
        self.refused = refused


class BadAnswer(ReplicaError):
    """An answer, but not acceptance: an HTTP error (``status``, the replica's own ``error_type``), or a body
    that is not what a replica answers (not JSON, not an object, fields missing or of another type)."""

    def __init__(self, message: str, *, status: int | None = None, error_type: str | None = None) -> None:
        super().__init__(message)
        self.status, self.error_type = status, error_type


class StartWait:
    """The one rule for a replica that is starting, the same in the sync client, the async client and
    ``ckptdelta hotload``: a replica that refuses connections (nothing listens yet) or answers ``/v1/status``
    with STARTING is asked again every :data:`UP_POLL_S` seconds until ``ready_timeout`` has passed since the
    call began (the clients' ``ready_timeout``; the command's ``--timeout`` with ``--wait``, 0 without: asked
    once), while the other replicas go on. Any other failure (hung, garbage, an HTTP error) is final at once.
    Sampling follows the same rule by its own retries: a refused connection and STARTING's 503 are retried
    until ``ready_timeout`` (loader/client.py, SampleTries)."""

    def __init__(self, url: str, ready_timeout: float) -> None:
        self.url, self.ready_timeout = url, ready_timeout
        self.t0 = time.monotonic()
        self.deadline = self.t0 + ready_timeout

    @staticmethod
    def starting(result: "dict[str, Any] | ReplicaError") -> bool:
        """Whether ``result`` (a replica's status, or why there is none) says the replica is starting."""
        if isinstance(result, dict):
            return result.get("state") == STARTING
        return isinstance(result, Unreachable) and result.refused

    def again(self, result: "dict[str, Any] | ReplicaError") -> bool:
        """Whether to ask again, after :meth:`delay`: the replica is starting and the ready timeout has not passed."""
        return self.starting(result) and time.monotonic() < self.deadline

    def delay(self) -> float:
        return min(UP_POLL_S, max(0.0, self.deadline - time.monotonic()))

    def row(self, result: "dict[str, Any] | ReplicaError") -> dict[str, Any]:
        """The replica's row once given up on: why it failed, and for one still starting, for how long it was
        waited for."""
        waited = "" if self.ready_timeout <= 0 else f" after {self.ready_timeout:g}s of waiting for it to start"
        if isinstance(result, dict):
            return {**result, "error": f"replica {self.url} is still {STARTING}{waited or ' (not waited for)'}"}
        row = failed_state(result)
        if self.starting(result) and waited:
            row["error"] += f"; still refused{waited}"
        return row


#: The longest ``GET /v1/hotload/{id}?wait=`` a client asks for (the replica holds at most 30 s).
LONG_POLL_MAX_S = 5.0


def long_poll_s(left: float, read_timeout: float | None) -> float:
    """How long to ask the replica to hold a job's GET: within what is left of the wait, under the client's own
    read timeout (with a second to spare) and :data:`LONG_POLL_MAX_S`."""
    cap = LONG_POLL_MAX_S if read_timeout is None else min(LONG_POLL_MAX_S, max(0.0, read_timeout - 1.0))
    return max(0.0, min(left, cap))


def transport_error(url: str, what: str, e: httpx.TransportError) -> Unreachable:
    refused = isinstance(e, httpx.ConnectError)     # refused, or a name that does not resolve (yet)
    how = ("refused the connection" if "refused" in str(e).lower() else "could not be connected to") if refused \
        else "did not answer in time" if isinstance(e, httpx.TimeoutException) else "dropped the connection"
    return Unreachable(f"replica {url} unreachable ({what}): it {how} ({type(e).__name__}: {e})", refused=refused)


def _peek(r: httpx.Response) -> str:
    try:
        text = r.text
    except Exception:  # noqa: BLE001 - an undecodable body: its bytes then
        text = repr(r.content[:_PEEK])
    text = " ".join(text.split())
    return repr(text[:_PEEK] + ("..." if len(text) > _PEEK else ""))


def error_of(r: httpx.Response) -> dict[str, Any]:
    """The ``error`` object of a replica's error answer ({} when the body is not one)."""
    try:
        body = r.json()
    except ValueError:
        return {}
    err = body.get("error") if isinstance(body, dict) else None
    return err if isinstance(err, dict) else {}


def hotload_body(snapshot: str | int, *, queue: bool = False, await_commit_s: float | None = None,
                 wait_s: float | None = None) -> dict[str, Any]:
    """``POST /v1/hotload``'s body; ``wait_s``: the replica answers once the job ends, within that long."""
    body: dict[str, Any] = {"snapshot": snapshot}
    if queue:
        body["queue"] = True
    if await_commit_s is not None:
        body["await_commit_s"] = await_commit_s
    if wait_s is not None:
        body["wait"] = round(wait_s, 3)
    return body


_WAIT_FIELD = re.compile(r"\bwait\b")


def wait_refused(r: httpx.Response) -> bool:
    """An older replica's answer to a ``POST /v1/hotload`` with ``wait``, a field it does not know (400, the
    request refused before anything started): the client asks again without it and waits with GETs."""
    err = error_of(r)
    message = err.get("message")
    return r.status_code == 400 and err.get("type") == "invalid_request_error" and isinstance(message, str) \
        and _WAIT_FIELD.search(message) is not None


def answer(url: str, what: str, r: httpx.Response, ok: tuple[int, ...] = (200,)) -> dict[str, Any]:
    """The JSON object a replica answered ``what`` with; BadAnswer naming the replica for anything else."""
    if r.status_code not in ok:
        err = error_of(r)
        message = err.get("message")
        raise BadAnswer(f"replica {url} answered {what} with {r.status_code}"
                        f"{' ' + str(err['type']) if isinstance(err.get('type'), str) else ''}: "
                        f"{message if isinstance(message, str) else _peek(r)}", status=r.status_code,
                        error_type=err.get("type") if isinstance(err.get("type"), str) else None)
    try:
        body = r.json()
    except ValueError:
        raise BadAnswer(f"replica {url} answered {what} with {r.status_code} and a body that is not JSON "
                        f"({_peek(r)}): not a ckptdelta replica's answer") from None
    if not isinstance(body, dict):
        raise BadAnswer(f"replica {url} answered {what} with {r.status_code} and JSON that is not an object "
                        f"({_peek(r)}): not a ckptdelta replica's answer")
    return body


def _is_version(v: Any) -> bool:
    return type(v) is int and v >= 0


def _schema(url: str, what: str, body: dict[str, Any], problem: str | None) -> dict[str, Any]:
    if problem is not None:
        text = " ".join(str(body).split())
        raise BadAnswer(f"replica {url} answered {what} with JSON that is not a ckptdelta replica's answer: "
                        f"{problem} (got {text[:_PEEK]!r}{'...' if len(text) > _PEEK else ''})")
    return body


def status_answer(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """``body``, a replica's ``/v1/status`` once the fields the fleet commands read are of their types."""
    problem = None
    if not isinstance(body.get("state"), str):
        problem = "no 'state' string"
    elif "policy_version" not in body or not (body["policy_version"] is None or _is_version(body["policy_version"])):
        problem = "no 'policy_version' (a version or null)"
    elif "run_id" not in body or not (body["run_id"] is None or isinstance(body["run_id"], str)):
        problem = "no 'run_id' (a string or null)"
    elif any(not (body.get(k) is None or isinstance(body[k], dict)) for k in ("last_hotload", "engine")):
        problem = "'last_hotload' or 'engine' is not an object"
    return _schema(url, "GET /v1/status", body, problem)


def status_of(url: str, r: httpx.Response) -> dict[str, Any]:
    """A replica's answer to ``GET /v1/status`` as its status (:func:`status_answer`): a 200, or the 503 of a
    replica still starting, whose body is a status saying STARTING (loader/starting.py: 503, so that whatever
    takes a 200 for "serving" waits); BadAnswer for anything else."""
    if r.status_code == 503:
        try:
            body = r.json()
        except ValueError:
            body = None
        if isinstance(body, dict) and body.get("state") == STARTING:
            return status_answer(url, body)
    return status_answer(url, answer(url, "GET /v1/status", r))


def job_answer(url: str, what: str, body: dict[str, Any], job_id: str | None = None) -> dict[str, Any]:
    """``body``, a replica's hot-load job (loader/hotload_jobs.py) once its fields are of their types (and, for a
    poll, it is the job polled)."""
    problem = None
    if not (isinstance(body.get("id"), str) and _JOB_ID.fullmatch(body["id"])):
        problem = "no job 'id'"
    elif job_id is not None and body["id"] != job_id:
        problem = f"the answer is about hot-load {body['id']!r}, not {job_id!r}"
    elif body.get("state") not in JOB_STATES:
        problem = f"'state' is not one of {', '.join(JOB_STATES)}"
    elif not _is_version(body.get("target_version")):
        problem = "no 'target_version'"
    elif not (body.get("timings") is None or isinstance(body["timings"], dict)):
        problem = "'timings' is not an object"
    return _schema(url, what, body, problem)


def failed_state(e: ReplicaError) -> dict[str, Any]:
    """A replica's row for an error: UNREACHABLE (no answer) or REJECTED (an answer that is not acceptance)."""
    if isinstance(e, Unreachable):
        return {"state": UNREACHABLE, "error": str(e)}
    return {"state": REJECTED, "status": getattr(e, "status", None), "error_type": getattr(e, "error_type", None),
            "error": str(e)}


def other_run(st: dict[str, Any], run: tuple[str, str]) -> dict[str, Any]:
    return {"state": REJECTED, "status": None, "error_type": "run_mismatch", "from_version": st.get("policy_version"),
            "error": f"serves run {st.get('run_id')}, not run {run[0]} of {run[1]}: not hot-loaded (its versions "
                     "are another run's)"}


def timed_out(job: dict[str, Any], timeout: float) -> dict[str, Any]:
    return {**job, "error": f"not READY within the timeout of {timeout:g}s (still {job.get('state')})"}


def summary(states: dict[str, dict[str, Any]]) -> str:
    return ", ".join(f"{u}={s.get('state')}" for u, s in states.items())


def with_states(exc: Exception, states: dict[str, dict[str, Any]]) -> Exception:
    exc.states = dict(states)  # type: ignore[attr-defined]
    return exc


def raise_for(states: dict[str, dict[str, Any]], snapshot: "str | int", *, wait: bool) -> None:
    """Raise what a strict fleet hot-load raises when a replica is not READY (``wait``) or has not accepted: the
    most telling kind first (the snapshot does not exist; a replica of another run; another hot-load runs; a
    hot-load FAILED; a replica unreachable or refusing; the timeout), with ``.states`` (replica -> its row)."""
    ok = (READY,) if wait else JOB_STATES[:-1]
    bad = {u: st for u, st in states.items() if st.get("state") not in ok or "error" in st}
    if not bad:
        return

    def first(pred: Any) -> tuple[str, dict[str, Any]] | None:
        return next(((u, st) for u, st in bad.items() if pred(st)), None)

    kinds = [
        (lambda st: st.get("status") == 404, SnapshotNotFoundError),
        (lambda st: st.get("error_type") == "run_mismatch", RunMismatchError),
        (lambda st: st.get("status") == 409, HotLoadConflictError),
        (lambda st: st.get("state") == FAILED, HotLoadError),
        (lambda st: st.get("state") in (UNREACHABLE, REJECTED), ReplicaError),
        (lambda st: True, HotLoadTimeoutError),
    ]
    for pred, cls in kinds:
        hit = first(pred)
        if hit is not None:
            url, st = hit
            why = st.get("error") or st.get("reason") or st.get("state")
            raise with_states(cls(f"hot-load of {snapshot!r} not {'READY' if wait else 'accepted'} on "
                                  f"{len(bad)} of {len(states)} replicas; {url}: {why} (states: {summary(states)})"),
                              states)


_PENDING = object()


class FleetPlan:
    """What the replicas of one fleet hot-load decide together, each handled on its own.

    The run they must all serve is that of the first replica, in the order given, that answers its first
    ``/v1/status`` (a replica of another run is refused: its version numbers are another run's): a replica
    waits only until those before it have answered or failed once, never for one after it, nor for one being
    retried while it starts (if none answered at first, the first to answer later sets the run). A name such
    as ``latest`` is resolved once, by the first replica to accept it; the others are asked for that exact
    version, so a snapshot published meanwhile cannot split the fleet. Plain state, no I/O and no waiting: the
    caller holds its lock around every call and re-asks after every change."""

    def __init__(self, urls: list[str], snapshot: "str | int") -> None:
        self.urls = list(urls)
        self.snapshot = snapshot
        self.target: int | None = snapshot if isinstance(snapshot, int) else None
        self._first: list[Any] = [_PENDING] * len(self.urls)  # each replica's run at its first try (None: none)
        self._late: tuple[str, str] | None = None
        self._resolver: int | None = None

    def answered(self, i: int, run_id: str | None) -> None:
        """Replica ``i``'s first try at ``/v1/status``: its run, or None (no answer, or no run); later ones are
        not recorded here (see :meth:`run`)."""
        if self._first[i] is _PENDING:
            self._first[i] = run_id

    def run(self, i: int, run_id: str) -> tuple[str, str] | None:
        """(run, URL of the replica it is taken from) that replica ``i``, which serves ``run_id``, must serve;
        None while a replica before the first with a run has not had its first try."""
        for j, r in enumerate(self._first):
            if r is _PENDING:
                return None
            if r is not None:
                return r, self.urls[j]
        if self._late is None:
            self._late = (run_id, self.urls[i])
        return self._late

    def take_target(self, i: int) -> "tuple[int | str] | None":
        """(what to ask replica ``i`` to hot-load,): the version, or the name itself when ``i`` is to resolve it
        (then :meth:`resolved` must follow); None while another replica resolves it."""
        if self.target is not None:
            return (self.target,)
        if self._resolver is None:
            self._resolver = i
            return (self.snapshot,)
        return None

    def resolved(self, i: int, version: int | None) -> None:
        """Replica ``i`` asked for the name answered with ``version`` (None: it did not accept it)."""
        if self._resolver == i:
            self._resolver = None
            if version is not None and self.target is None:
                self.target = version
