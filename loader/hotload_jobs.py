"""Hot-load jobs of one replica: one at a time, prepared in the background, observable by id.

The HTTP layer only submits and looks up jobs; this module decides what a
request means given what is running: a request for the target already being
loaded joins that job (same id), a different target is a conflict, and a
request for the version already served is a no-op that reports READY. The job
thread prepares the update while the replica keeps serving, then commits it in
the swapper's short pause.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from delta.errors import HotLoadConflictError
from delta.manifest import snapshot_name

log = logging.getLogger("ckptdelta.server")

PREPARING, SWAPPING, READY, FAILED = "PREPARING", "SWAPPING", "READY", "FAILED"
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

    @property
    def done(self) -> bool:
        return self.state in (READY, FAILED)

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
        return d


class HotLoadManager:
    """Runs hot-loads against a HotSwapper, at most one at a time.

    ``on_done(job, state)`` is called when a job ends (READY or FAILED, or a no-op),
    before the job shows that state to anyone polling it (metrics stay consistent)."""

    def __init__(self, swapper: Any, reader: Any, *, on_done: Any = None):
        self.swapper = swapper
        self.reader = reader
        self.on_done = on_done
        self._lock = threading.Lock()
        self._jobs: dict[str, HotLoadJob] = {}
        self._running: HotLoadJob | None = None
        self._last: HotLoadJob | None = None
        self._seq = itertools.count(1)

    @property
    def running(self) -> HotLoadJob | None:
        return self._running

    @property
    def last(self) -> HotLoadJob | None:
        """The most recent finished job (READY, FAILED or no-op)."""
        return self._last

    def get(self, job_id: str) -> HotLoadJob | None:
        return self._jobs.get(job_id)

    def submit(self, ref: str | int) -> tuple[HotLoadJob, str]:
        """Start, join or acknowledge a hot-load of ``ref``; returns (job, "started"|"joined"|"noop").

        Raises SnapshotNotFoundError for a snapshot the run lacks and
        HotLoadConflictError while a hot-load to another version runs."""
        # storage I/O, outside the lock; fresh: a snapshot gc deleted, or a run deleted and published again,
        # is refused here (404) instead of failing later on objects its cached manifests still name
        target = self.reader.resolve(ref, fresh=True)
        requested = str(ref)
        with self._lock:
            run = self._running
            if run is not None:
                if run.target_version == target:
                    return run, "joined"
                raise HotLoadConflictError(
                    f"hot-load {run.id} to {snapshot_name(run.target_version)} is {run.state}; "
                    f"refusing a concurrent hot-load to {snapshot_name(target)}")
            current = self.swapper.version
            if current == target:
                last = self._last
                if last is not None and last.state == READY and last.target_version == target:
                    return last, "noop"
                job = self._new_job(requested, target, current)
                job.state, job.noop, job.finished = READY, True, time.time()
                self._last = job
                self._notify(job, READY)
                return job, "noop"
            job = self._new_job(requested, target, current)
            self._running = job
        threading.Thread(target=self._run, args=(job,), name=f"hotload-{job.id}", daemon=True).start()
        log.info("hot-load %s: %s -> %s started", job.id, _name(job.from_version), snapshot_name(target))
        return job, "started"

    def _new_job(self, requested: str, target: int, current: int | None) -> HotLoadJob:
        job = HotLoadJob(id=f"hl-{next(self._seq):04d}-{uuid.uuid4().hex[:8]}", requested=requested,
                         target_version=target, from_version=current)
        self._jobs[job.id] = job
        while len(self._jobs) > MAX_KEPT_JOBS:
            oldest = next(iter(self._jobs))
            if self._jobs[oldest] is self._running:
                break
            del self._jobs[oldest]
        return job

    def _run(self, job: HotLoadJob) -> None:
        state = FAILED
        try:
            # Weights of unknown version (an HF directory): only an anchor can establish one ("initial").
            prepared = self.swapper.prepare(job.target_version, initial=self.swapper.version is None)
            job.state = SWAPPING
            report = self.swapper.commit(prepared)
            del prepared
            job.report = dataclasses.asdict(report) if dataclasses.is_dataclass(report) else dict(vars(report))
            state = READY
            log.info("hot-load %s: %s ready (pause %.4fs, %d bytes fetched)", job.id,
                     snapshot_name(job.target_version), job.report.get("pause_s", 0.0),
                     job.report.get("bytes_fetched", 0))
        except Exception as e:  # noqa: BLE001 - any failure must leave the replica serving
            job.reason, job.error_type = f"{type(e).__name__}: {e}", type(e).__name__
            log.error("hot-load %s to %s failed; still serving %s: %s", job.id, snapshot_name(job.target_version),
                      _name(self.swapper.version), job.reason)
        finally:
            # Everything an observer may check after seeing the final state (metrics, the
            # running slot, "last") is settled first; the state, which clients poll, goes last.
            with self._lock:
                job.finished = time.time()
                self._notify(job, state)
                self._running = None
                self._last = job
                job.state = state

    def _notify(self, job: HotLoadJob, state: str) -> None:
        if self.on_done is not None:
            try:
                self.on_done(job, state)
            except Exception:  # noqa: BLE001 - metrics must not break hot-loads
                log.exception("hot-load %s: on_done callback failed", job.id)


def _name(version: int | None) -> str:
    return "unknown version" if version is None else snapshot_name(version)
