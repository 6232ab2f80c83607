"""Hot-load jobs of one replica: one at a time, prepared in the background, observable by id.

The HTTP layer only submits and looks up jobs; this module decides what a
request means given what is running: a request for the target already being
loaded joins that job (same id), a different target is a conflict, and a
request for the version already served is a no-op that reports READY. The job
thread prepares the update while the replica keeps serving, then commits it in
the swapper's short pause.

A request with ``queue=True`` (what ``ckptdelta hotload`` sends to a fleet) is
not refused while another target loads: the newest request wins, as a managed
service's hot-load does. It waits (QUEUED) and starts when the running one
ends; a request queued before it and not started yet is dropped (FAILED,
``error_type`` ``HotLoadSuperseded``, naming the hot-load that replaced it).
The running one is never interrupted: its swap is short, and what it fetched
is what the next one builds on.

When the replica stops (:meth:`HotLoadManager.stop`; loader/stopping.py), new
requests are refused, a queued hot-load never starts and one still preparing
stops at its next tensor (FAILED, ``HotLoadCancelledError``: nothing was
written); one past its prepare is waited for, so that its pause ends, on the
new version proven or the previous one put back, before the engine is closed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ckptdelta.delta.errors import (HotLoadCancelledError, HotLoadConflictError, HotLoadError,
                                    SnapshotNotFoundError)
from ckptdelta.delta.manifest import snapshot_name
from ckptdelta.loader.threads import Threads

if TYPE_CHECKING:
    from ckptdelta.loader.hotswap import HotSwapper
    from ckptdelta.loader.reader import SnapshotReader

log = logging.getLogger("ckptdelta.server")

QUEUED, PREPARING, SWAPPING, READY, FAILED = "QUEUED", "PREPARING", "SWAPPING", "READY", "FAILED"
SUPERSEDED = "HotLoadSuperseded"   # the error_type of a queued hot-load a newer request replaced
MAX_KEPT_JOBS = 256
_TIMING_FIELDS = ("fetch_s", "decode_s", "apply_s", "pause_s", "total_s")


@dataclass
class HotLoadJob:
    """One hot-load's state, as ``GET /v1/hotload/{id}`` reports it."""

    id: str
    requested: str  # the snapshot as asked for: "latest", a name or a version
    target_version: int
    from_version: int | None
    state: str = PREPARING
    reason: str | None = None  # why it FAILED
    error_type: str | None = None
    created: float = field(default_factory=time.time)
    finished: float | None = None
    report: dict[str, Any] | None = None  # HotLoadReport fields once READY
    noop: bool = False  # already at the target: nothing was done
    prepare_s: float | None = None  # from its start to the end of prepare (fetch, decode, verify; serving)
    #: asked for before its snapshot was committed: wait this long for the commit (loader/landing.py)
    await_commit_s: float | None = None
    commit_wait_s: float | None = None  # how long it waited for the commit, fetching what landed meanwhile
    bytes_landed: int | None = None     # bytes of that version's objects fetched before its commit and used

    #: (event loop, future) of each ``wait_done`` in progress, woken as the state becomes READY or FAILED
    _waiters: list = field(default_factory=list, repr=False, compare=False)

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        if name == "state" and value in (READY, FAILED):
            self._wake()

    @property
    def done(self) -> bool:
        return self.state in (READY, FAILED)

    async def wait_done(self, timeout: float) -> None:
        """Return once the job is READY or FAILED, or after ``timeout`` seconds. Woken by the state's change
        (from the job's thread), not by looking at it every few ms: in the replica's process each look took
        the GIL from the hot-load being waited for."""
        if self.done or timeout <= 0:
            return
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with _WAITERS_LOCK:
            if self.done:
                return
            self._waiters.append((loop, fut))
        try:
            await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            pass
        finally:
            with _WAITERS_LOCK:
                if (loop, fut) in self._waiters:
                    self._waiters.remove((loop, fut))

    def _wake(self) -> None:
        with _WAITERS_LOCK:
            waiters = getattr(self, "_waiters", None)
            if not waiters:
                return
            self._waiters = []
        for loop, fut in waiters:
            try:
                loop.call_soon_threadsafe(_resolve, fut)
            except RuntimeError:      # that loop has closed: no one waits on it any more
                pass

    def to_dict(self) -> dict[str, Any]:
        d = {
            "id": self.id, "state": self.state, "snapshot": snapshot_name(self.target_version),
            "requested": self.requested, "target_version": self.target_version,
            "from_version": self.from_version, "noop": self.noop, "created": self.created,
            "finished": self.finished,
            "duration_s": (self.finished - self.created) if self.finished is not None else None,
        }
        if self.reason is not None:
            d["reason"], d["error_type"] = self.reason, self.error_type
        if self.report is not None:
            d["report"] = self.report
            d["timings"] = {k: self.report.get(k) for k in _TIMING_FIELDS}
        if self.prepare_s is not None:
            d.setdefault("timings", {})["prepare_s"] = self.prepare_s
        if self.await_commit_s is not None:
            d["await_commit_s"] = self.await_commit_s
        if self.commit_wait_s is not None:
            d.setdefault("timings", {})["commit_wait_s"] = self.commit_wait_s
            d["bytes_landed"] = self.bytes_landed
        return d


_WAITERS_LOCK = threading.Lock()


def _resolve(fut: "asyncio.Future[None]") -> None:
    if not fut.done():
        fut.set_result(None)


class HotLoadManager:
    """Runs hot-loads against a HotSwapper, at most one at a time.

    ``on_done(job, state)`` is called when a job ends (READY or FAILED, or a no-op),
    before the job shows that state to anyone polling it (metrics stay consistent)."""

    def __init__(self, swapper: "HotSwapper", reader: "SnapshotReader", *, on_done: Any = None):
        self.swapper = swapper
        self.reader = reader
        self.on_done = on_done
        self._lock = threading.Lock()
        self._jobs: dict[str, HotLoadJob] = {}
        self._running: HotLoadJob | None = None
        self._queued: HotLoadJob | None = None    # waits for the running one (submit(queue=True))
        self._last: HotLoadJob | None = None
        self._seq = itertools.count(1)
        # the thread hot-loads run on, kept between them (loader/threads.py: a thread started per hot-load waits
        # in Thread.start until a busy core and the GIL let it run); _ended is set once the running job ends
        self._runner = Threads(1, "ckptdelta-hotload")
        self._ended: threading.Event | None = None
        self._stopping: str | None = None              # why, once the replica stops
        self._stopped_in: HotLoadJob | None = None     # the hot-load that was running when the stop came

    @property
    def running(self) -> HotLoadJob | None:
        return self._running

    @property
    def queued(self) -> HotLoadJob | None:
        """The hot-load that starts when the running one ends, if one was queued."""
        return self._queued

    @property
    def last(self) -> HotLoadJob | None:
        """The most recent finished job (READY, FAILED or no-op)."""
        return self._last

    def get(self, job_id: str) -> HotLoadJob | None:
        return self._jobs.get(job_id)

    def submit(self, ref: str | int, *, queue: bool = False,
               await_commit_s: float | None = None) -> tuple[HotLoadJob, str]:
        """Start, join or acknowledge a hot-load of ``ref``; returns (job, "started"|"joined"|"noop"|"queued").

        Raises SnapshotNotFoundError for a snapshot the run lacks and, without
        ``queue``, HotLoadConflictError while a hot-load to another version runs
        (with it, the request waits for that one and replaces any queued before it).
        ``await_commit_s``: a version newer than every committed one (the one a publisher is writing) is
        not refused: the job waits up to that long for its commit, fetching its objects as they land."""
        # storage I/O, outside the lock; fresh: a snapshot gc deleted, or a run deleted and published again,
        # is refused here (404) instead of failing later on objects its cached manifests still name
        self._refuse_if_stopping(ref)
        awaiting = None
        try:
            target = self.reader.resolve(ref, fresh=True)
        except SnapshotNotFoundError:
            if await_commit_s is None:
                raise
            target, awaiting = self.reader.upcoming(ref), float(await_commit_s)
        requested = str(ref)
        with self._lock:
            return self._submit_locked(ref, requested, target, queue, awaiting)

    def _submit_locked(self, ref: str | int, requested: str, target: int, queue: bool,
                       awaiting: float | None) -> tuple[HotLoadJob, str]:
        self._refuse_if_stopping(ref)
        run = self._running
        if run is not None:
            if run.target_version == target and (self._queued is None or not queue):
                return run, "joined"
            queued = self._queued
            if queued is not None and queued.target_version == target:
                return queued, "joined"
            if not queue:
                raise HotLoadConflictError(
                    f"hot-load {run.id} to {snapshot_name(run.target_version)} is {run.state}; "
                    f"refusing a concurrent hot-load to {snapshot_name(target)}")
            job = self._new_job(requested, target, None, awaiting)
            job.state = QUEUED
            self._queued = job
            if queued is not None:
                self._supersede(queued, job)
            log.info("hot-load %s to %s queued behind %s to %s", job.id, snapshot_name(target), run.id,
                     snapshot_name(run.target_version))
            return job, "queued"
        return self._start_locked(requested, target, awaiting=awaiting)

    def _supersede(self, old: HotLoadJob, new: HotLoadJob) -> None:
        old.reason = (f"superseded by hot-load {new.id} to {snapshot_name(new.target_version)}, requested later "
                      "while this one waited (the newest request wins)")
        old.error_type, old.finished = SUPERSEDED, time.time()
        self._notify(old, FAILED)
        old.state = FAILED
        log.info("hot-load %s to %s dropped: %s", old.id, snapshot_name(old.target_version), old.reason)

    def _start_locked(self, requested: str, target: int, job: HotLoadJob | None = None, *,
                      awaiting: float | None = None) -> tuple[HotLoadJob, str]:
        """Start a hot-load of ``target`` (``job``: a queued one); the caller holds the lock."""
        current = self.swapper.version
        if current == target:
            last = self._last
            if job is None and last is not None and last.state == READY and last.target_version == target:
                return last, "noop"
            job = job or self._new_job(requested, target, current)
            job.from_version = current
            job.noop, job.finished = True, time.time()
            self._last = job
            self._notify(job, READY)
            job.state = READY
            return job, "noop"
        job = job or self._new_job(requested, target, current, awaiting)
        job.from_version, job.state = current, PREPARING
        self._running = job
        self._ended = ended = threading.Event()
        try:
            self._runner.submit(self._run, job, ended)
        except Exception as e:  # no thread to be had: the job fails, said why, and nothing waits on it for good
            self._running = None
            ended.set()
            job.reason, job.error_type, job.finished = f"{type(e).__name__}: {e}", type(e).__name__, time.time()
            self._last = job
            self._notify(job, FAILED)
            job.state = FAILED
            log.error("hot-load %s to %s could not start: %s", job.id, snapshot_name(target), job.reason)
            raise HotLoadError(f"hot-load {job.id} to {snapshot_name(target)} could not start ({job.reason}); "
                               f"still serving {_name(current)}") from e
        log.info("hot-load %s: %s -> %s started", job.id, _name(job.from_version), snapshot_name(target))
        return job, "started"

    def _new_job(self, requested: str, target: int, current: int | None,
                 awaiting: float | None = None) -> HotLoadJob:
        job = HotLoadJob(id=f"hl-{next(self._seq):04d}-{uuid.uuid4().hex[:8]}", requested=requested,
                         target_version=target, from_version=current, await_commit_s=awaiting)
        self._jobs[job.id] = job
        while len(self._jobs) > MAX_KEPT_JOBS:
            oldest = next(iter(self._jobs))
            if self._jobs[oldest] is self._running:
                break
            del self._jobs[oldest]
        return job

    def _run(self, job: HotLoadJob, ended: threading.Event) -> None:
        try:
            self._run_job(job)
        finally:
            ended.set()

    def _run_job(self, job: HotLoadJob) -> None:
        state = FAILED
        try:
            # Weights of unknown version (an HF directory): only an anchor can establish one ("initial").
            t0 = time.perf_counter()
            if job.await_commit_s is not None:
                job.commit_wait_s = self.reader.await_commit(job.target_version, job.await_commit_s,
                                                             cancelled=lambda: self._stopping)
            landed = self.reader.stats.get("bytes_landed", 0)
            prepared = self.swapper.prepare(job.target_version, initial=self.swapper.version is None)
            if job.await_commit_s is not None:
                job.bytes_landed = self.reader.stats.get("bytes_landed", 0) - landed
            job.prepare_s = time.perf_counter() - t0
            if self._stopping is not None:      # prepared, but the replica stops: nothing is written
                raise HotLoadCancelledError(f"hot-load to {snapshot_name(job.target_version)} dropped before "
                                            f"its pause: {self._stopping}")
            job.state = SWAPPING
            report = self.swapper.commit(prepared)
            del prepared
            job.report = dataclasses.asdict(report) if dataclasses.is_dataclass(report) else dict(vars(report))
            state = READY
            log.debug("hot-load %s: %s ready (pause %.4fs, %d bytes fetched)", job.id,
                     snapshot_name(job.target_version), job.report.get("pause_s", 0.0),
                     job.report.get("bytes_fetched", 0))
        except Exception as e:  # noqa: BLE001 - any failure must leave the replica serving
            job.reason, job.error_type = f"{type(e).__name__}: {e}", type(e).__name__
            log.error("hot-load %s to %s failed; still serving %s: %s", job.id, snapshot_name(job.target_version),
                      _name(self.swapper.version), job.reason)
        finally:
            if job.await_commit_s is not None:
                self.reader.drop_landed(job.target_version)
            # Everything an observer may check after seeing the final state (metrics, the
            # running slot, "last") is settled first; the state, which clients poll, goes last.
            with self._lock:
                job.finished = time.time()
                self._notify(job, state)
                self._running = None
                self._last = job
                job.state = state
                nxt, self._queued = self._queued, None
                if nxt is not None and self._stopping is not None:
                    self._drop(nxt)
                elif nxt is not None:
                    try:
                        self._start_locked(nxt.requested, nxt.target_version, nxt)
                    except HotLoadError:      # no thread to be had: the queued job failed, saying why
                        pass

    # --- the replica stops ---------------------------------------------------------------------------

    def request_stop(self, why: str) -> None:
        """The replica is stopping (``why`` says so to clients): refuse new hot-loads, start no queued one, and
        make one still preparing stop at its next tensor. Only sets flags: a signal handler calls it."""
        if self._stopping is None:
            self._stopping, self._stopped_in = why, self._running
        cancel = getattr(self.swapper, "cancel_prepare", None)
        if cancel is not None:
            cancel.set()

    def stop(self, why: str, timeout: float | None = None) -> HotLoadJob | None:
        """:meth:`request_stop`, then wait for the running hot-load to end, before the engine is closed: a
        commit is never cut, so the pause it began ends (its engine generates again) on bits it proved, the new
        version's or the previous one's put back. ``timeout`` None: as long as it takes, which each step of a
        commit bounds (its control calls: ``--control-timeout``); a dead engine's replica waits less. Returns
        the hot-load that was running, if one was."""
        self.request_stop(why)
        with self._lock:
            queued, self._queued = self._queued, None
            if queued is not None:
                self._drop(queued)
            job, ended = self._running or self._stopped_in, self._ended
        if job is None or ended is None:
            return None
        if not job.done:
            log.warning("%s: waiting for hot-load %s to %s (%s) to end before the engine stops", self._stopping,
                        job.id, snapshot_name(job.target_version), job.state)
        ended.wait(timeout)
        if not job.done:
            log.error("hot-load %s to %s still %s after %.0f s: the engine stops under it", job.id,
                      snapshot_name(job.target_version), job.state, timeout)
            return job
        log.warning("hot-load %s to %s ended %s%s; the engine serves %s", job.id, snapshot_name(job.target_version),
                    job.state, f" ({job.reason})" if job.reason else "", _name(self.swapper.version))
        return job

    def _refuse_if_stopping(self, ref: str | int) -> None:
        if self._stopping is not None:
            raise HotLoadCancelledError(f"hot-load to {ref!r} refused: {self._stopping}")

    def _drop(self, job: HotLoadJob) -> None:
        """A queued hot-load that will never start (the replica stops); the caller holds the lock."""
        job.reason = f"HotLoadCancelledError: dropped before it started: {self._stopping}"
        job.error_type, job.finished = HotLoadCancelledError.__name__, time.time()
        self._notify(job, FAILED)
        job.state = FAILED
        log.info("hot-load %s to %s dropped: %s", job.id, snapshot_name(job.target_version), self._stopping)

    def _notify(self, job: HotLoadJob, state: str) -> None:
        if self.on_done is not None:
            try:
                self.on_done(job, state)
            except Exception:  # noqa: BLE001 - metrics must not break hot-loads
                log.exception("hot-load %s: on_done callback failed", job.id)


def _name(version: int | None) -> str:
    return "unknown version" if version is None else snapshot_name(version)
