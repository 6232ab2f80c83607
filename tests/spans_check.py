"""A check every test runs on every replica it serves from (tests/conftest.py): each completed request's reported
span (``policy_versions``) holds every version its replica served while the request ran, in order, none skipped.

It watches from outside the span code (loader/spans.py), at the engine seam every replica shares:

- **what the replica served**: its own copy of each replica's version history, appended where the served
  version changes (``VersionLog.serve``: the swapper's version, set in the swap's pause);
- **when a request ran**: the history's position when the engine is handed the request (before it is
  admitted) and when its answer or its stream's last event is back (after its span closed); inside that,
  where it was seen computing: each forward step of the reference decode loop, each event a vLLM stream
  forwarded.

A span must then be one stretch of that history: it starts no later than the first moment the request was
seen computing (and not before it was handed over), it ends no earlier than the last (and not after its answer),
and it holds every version served in between. A request pinned to one version (vLLM's LoRA slots) reports one
version, served once it was handed over. A request with no answer (an error, a stream cut before its end) is not
checked.
"""

from __future__ import annotations

import contextvars
import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

#: what the checks found since the session began (tests/conftest.py fails the test that made them)
violations: list[str] = []

_lock = threading.Lock()
_histories: "weakref.WeakKeyDictionary[Any, list]" = weakref.WeakKeyDictionary()
_request: contextvars.ContextVar["_Request | None"] = contextvars.ContextVar("span_check_request", default=None)


@dataclass
class _Request:
    log: Any
    handed: int                                   # history position when the engine got it
    seen: list[int] = field(default_factory=list)  # positions where it was seen computing
    pinned: bool = False


def _history(log: Any) -> list:
    """This check's own record of what ``log``'s replica served (from the first time it looked on)."""
    h = _histories.get(log)
    if h is None:
        h = _histories[log] = [log.current]
    return h


def position(log: Any) -> int:
    with _lock:
        return len(_history(log)) - 1


def check(kind: str, rec: _Request, versions: list, answered: int) -> None:
    """``versions`` as reported by a request handed over at ``rec.handed`` and answered at ``answered``."""
    with _lock:
        h = list(_history(rec.log))
    served = h[rec.handed:answered + 1]
    why = None
    if not versions:
        why = "no version at all"
    elif rec.pinned:
        if len(versions) != 1 or versions[0] not in h[rec.handed:]:
            why = "not the one version it was pinned to, served once it was handed over"
    else:
        first = min(rec.seen, default=answered)
        last = max(rec.seen, default=rec.handed)
        n = len(versions)
        if not any(h[i:i + n] == versions and last <= i + n - 1 <= answered for i in range(rec.handed, first + 1)):
            why = "not every version served while it ran, in order"
    if why is not None:
        violations.append(f"{kind} replica: a request reported policy_versions {versions}: {why}; the replica "
                          f"served {served} from when it was handed over to when it was answered (positions "
                          f"{rec.handed}-{answered} of {h}; seen computing at {rec.seen})")


def _log_of(replica: Any) -> Any:
    engine = getattr(replica, "engine", None)            # the reference replica's decode loop
    log = getattr(engine, "served", None)
    if log is None:
        log = getattr(getattr(replica, "swapper", None), "served", None)
    return log


def install(mp: Any) -> None:
    """Watch every replica through ``mp`` (a pytest MonkeyPatch held for the session)."""
    from ckptdelta.loader.engines.reference.model import Engine
    from ckptdelta.loader.engines.base import EngineStream
    from ckptdelta.loader.engines.reference.replica import ReferenceReplica
    from ckptdelta.loader.engines.vllm.replica import VllmReplica
    from ckptdelta.loader.spans import VersionLog

    real_serve = VersionLog.serve

    def serve(self: VersionLog, version: Any) -> None:
        with _lock:
            h = _history(self)
            real_serve(self, version)
            if self.current != h[-1]:
                h.append(self.current)

    mp.setattr(VersionLog, "serve", serve)

    real_step = Engine.step

    @contextmanager
    def step(self: Engine):
        with real_step(self) as version:
            rec = _request.get()
            if rec is not None and rec.log is self.served:
                rec.seen.append(position(self.served))     # inside the step: no swap moves it
            yield version

    mp.setattr(Engine, "step", step)

    for cls in (ReferenceReplica, VllmReplica):
        _wrap(mp, cls, EngineStream)


def _wrap(mp: Any, cls: type, stream_type: type) -> None:
    from ckptdelta.loader.engines.vllm.lora import VllmLoraReplica

    real_complete, real_stream = cls.complete, cls.stream

    def start(replica: Any) -> "_Request | None":
        log = _log_of(replica)
        if log is None:
            return None
        return _Request(log, position(log), pinned=isinstance(replica, VllmLoraReplica))

    async def complete(self: Any, kind: Any, body: Any) -> Any:
        rec = start(self)
        token = _request.set(rec)
        try:
            res = await real_complete(self, kind, body)
        finally:
            _request.reset(token)
        if rec is not None and res.status == 200:
            check(self.kind, rec, list(res.policy_versions), position(rec.log))
        return res

    async def stream(self: Any, kind: Any, body: Any) -> Any:
        rec = start(self)
        token = _request.set(rec)        # the decode loop's task and thread copy it
        try:
            answer = await real_stream(self, kind, body)
        finally:
            _request.reset(token)
        if rec is not None and isinstance(answer, stream_type):
            answer.events = _events(self, rec, answer.events, answer.result)
        return answer

    mp.setattr(cls, "complete", complete)
    mp.setattr(cls, "stream", stream)


async def _events(replica: Any, rec: _Request, inner: Any, res: Any) -> Any:
    """The stream's events, passed on; its span checked once they ended. A vLLM event comes from vLLM between
    the request's admission and its span's end (its span closes after the last one): it was computing."""
    from_vllm = replica.kind == "vllm"
    try:
        async for e in inner:
            if from_vllm:
                rec.seen.append(position(rec.log))
            yield e
    finally:
        await inner.aclose()             # its end has filled the result in
        if res.status == 200 and res.policy_versions:
            check(replica.kind, rec, list(res.policy_versions), position(rec.log))
