"""Hot swap: move a serving model's weights to another version with one short pause.

Everything slow happens while the model keeps serving: fetching, decoding, and
checking that each record names the version the live weights hold as its parent and
that the result hashes to the target's digests, which proves its bits
(:meth:`HotSwapper.prepare`). What remains
is writing the changed tensors, done while :class:`ServingGate` holds forward
steps back (:meth:`HotSwapper.commit`), so no forward step ever sees a mix of two
versions. In contiguous host memory each changed tensor is either scattered (its
changed elements) or copied whole from a staged copy, whichever costs less, or,
staged densely, swapped with its staged new bits (loader/batch_commit.py), all of
them in a few kernel calls per element width and thread. A commit that fails half-way writes back the old bits it replaced: the
weights and the version stay as they were, or the swap raises saying they could
not be (and the version becomes None).

Memory: staged changes are the changed elements' positions and new bits (or a
tensor's new bits when most of it changes), plus a copy of the new bits of each
tensor the commit copies whole (up to one copy of the model when every tensor
changes that much; ``commit_mode="scatter"`` never stages one); besides them, at
most one tensor's scratch copy per staging thread.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, MutableMapping

import numpy as np
import torch
import xxhash

from ckptdelta.delta import StagedTensor, dtypes, stage, stage_full, warmup
from ckptdelta.delta.errors import (ChecksumError, GrandparentMismatchError, GrandparentNeededError,
                                    HotLoadCancelledError, HotLoadConflictError, HotLoadError, ParentMismatchError,
                                    ShapeMismatchError)
from ckptdelta.delta.manifest import Manifest, TensorEntry, snapshot_name
from ckptdelta.delta.pieces import box_bits, box_view, flat_range

from ckptdelta.loader import batch_commit, stopping
from ckptdelta.loader.pieces import Piece, Prior, check_assembled, grandparent_of, rebuild, replay
from ckptdelta.loader.plan import UpdatePlan, make_plan
from ckptdelta.loader.reader import SnapshotReader
from ckptdelta.loader.spans import VersionLog

log = logging.getLogger("ckptdelta.loader.hotswap")

Weights = "torch.nn.Module | MutableMapping[str, torch.Tensor]"


# --- the gate ---------------------------------------------------------------------------

@dataclass
class Pause:
    """Filled in by :meth:`ServingGate.paused` (or an applier's): ``waited_s`` for running steps to end,
    ``seconds`` in all, from ``started`` (``time.perf_counter()`` when the engine stopped)."""

    waited_s: float = 0.0
    seconds: float = 0.0
    started: float = 0.0


class ServingGate:
    """Forward steps (many at once) against the swap (one at a time, exclusive).

    ``with gate.serving():`` around each forward step; ``with gate.paused() as pause:``
    waits for running steps to end, holds new ones back until the block exits, and
    sets ``pause.seconds``. A pending pause has priority: new steps wait behind it,
    so a swap is never starved by a steady stream of requests. Sections nest within
    a thread; pausing from inside a serving section would deadlock and raises instead."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._active = 0
        self._pausing = False
        self._writer = threading.Lock()
        self._local = threading.local()

    @property
    def active(self) -> int:
        """Forward steps running now."""
        return self._active

    @property
    def is_paused(self) -> bool:
        return self._pausing

    @contextmanager
    def serving(self) -> Iterator[None]:
        depth = getattr(self._local, "depth", 0)
        if depth == 0:
            with self._cond:
                while self._pausing:
                    self._cond.wait()
                self._active += 1
        self._local.depth = depth + 1
        try:
            yield
        finally:
            self._local.depth = depth
            if depth == 0:
                with self._cond:
                    self._active -= 1
                    if self._active == 0:
                        self._cond.notify_all()

    @contextmanager
    def paused(self, timeout: float | None = None) -> Iterator[Pause]:
        """Exclusive access to the weights. With ``timeout``, gives up (HotLoadError) if running
        steps have not ended by then, and lets held-back steps go on."""
        if getattr(self._local, "depth", 0):
            raise HotLoadError("cannot pause the model from inside a serving section (it would wait for itself)")
        t0 = time.perf_counter()
        pause = Pause(started=t0)
        with self._writer:
            with self._cond:
                self._pausing = True
                deadline = None if timeout is None else t0 + timeout
                while self._active:
                    left = None if deadline is None else deadline - time.perf_counter()
                    if left is not None and left <= 0:
                        self._pausing = False
                        self._cond.notify_all()
                        raise HotLoadError(f"{self._active} forward steps still running after {timeout:.1f}s; "
                                           "swap abandoned, weights unchanged")
                    self._cond.wait(left)
            pause.waited_s = time.perf_counter() - t0
            try:
                yield pause
            finally:
                with self._cond:
                    self._pausing = False
                    self._cond.notify_all()
                pause.seconds = time.perf_counter() - t0


# --- reports and prepared updates -----------------------------------------------------------

@dataclass
class HotLoadReport:
    from_version: int | None
    to_version: int
    path: list[int]
    via_anchor: bool
    bytes_fetched: int
    tensors_changed: int
    elements_changed: int   # elements written (a densely staged tensor counts all of its elements)
    fetch_s: float          # waiting for bytes (fetches overlap decoding)
    decode_s: float         # decoding, rebuilding and verifying, while serving
    apply_s: float          # writing the live tensors, inside the pause
    pause_s: float          # the whole pause: waiting for running steps, then applying
    total_s: float
    staging_bytes: int = 0
    tensors_copied: int = 0  # tensors the batch writes whole: copied from a staged copy or swapped with dense bits

    @property
    def snapshot(self) -> str:
        return snapshot_name(self.to_version)


@dataclass
class _Staged:
    name: str                 # checkpoint name
    live_name: str            # name in the live module / mapping
    st: StagedTensor
    key: tuple                # identity of the live tensor it was staged against
    undo: StagedTensor | None = None   # a sparse change's old bits, gathered while serving, not in the pause
    bits: np.ndarray | None = field(default=None, repr=False)   # the live bits, when batched (contiguous host)
    choice: batch_commit.Choice | None = None                   # how the batch writes it: scatter, copy, swap


@dataclass
class PreparedUpdate:
    """A verified change from ``from_version`` to ``to_version``, ready for :meth:`HotSwapper.commit`."""

    from_version: int | None
    to_version: int
    path: list[int]
    via_anchor: bool
    staged: list[_Staged] = field(repr=False)
    report: HotLoadReport
    staging_bytes: int
    _owner: int = field(default=0, repr=False)
    batch: batch_commit.CommitBatch | None = field(default=None, repr=False)
    committed: bool = False
    #: where each staged tensor last changed, and its bits before (with ``HotSwapper.keep_priors``)
    priors: dict[str, Prior] = field(default_factory=dict, repr=False)

    @property
    def snapshot(self) -> str:
        return snapshot_name(self.to_version)


# --- the swapper ----------------------------------------------------------------------------

class HotSwapper:
    """Moves live weights (an ``nn.Module`` or a name -> tensor mapping) between a run's versions.

    ``name_map`` turns a checkpoint name into the live name when they differ.
    ``stage_threads`` tensors are decoded and verified at once while preparing
    (default: one per core; 1 stages them one by one in the calling thread), and
    as many threads write the batch in the pause. ``commit_mode`` says how a
    sparsely changed tensor in contiguous host memory is written: "auto" (the
    cheaper of scattering its changed elements and copying a staged whole copy,
    by the share of elements changed: batch_commit.COPY_ABOVE), "scatter" (never
    stage a whole copy) or "copy" (always). One prepare or commit runs at a time (another raises :class:`HotLoadConflictError`);
    ``prepare`` may run in a background thread while forward steps run under
    ``gate.serving()``."""

    def __init__(self, weights: Weights, reader: SnapshotReader, *, version: int | None = None,
                 gate: ServingGate | None = None, name_map: Callable[[str], str] | None = None,
                 apply_method: str = "auto", progress: bool | None = None,
                 stage_threads: int | None = None, applier: Any = None, commit_mode: str = "auto") -> None:
        if commit_mode not in batch_commit.MODES:
            raise ValueError(f"commit_mode must be one of {batch_commit.MODES}, not {commit_mode!r}")
        if version is not None and (isinstance(version, bool) or not isinstance(version, int) or version < 0):
            raise ValueError(f"version must be a non-negative int or None, not {version!r}")
        self.weights = weights
        self.reader = reader
        # the versions served, in order: ``version`` reads and writes it, so every change of the version a
        # request may run on is in the log its span is read from (loader/spans.py)
        self.served = VersionLog(version)
        self.gate = gate or ServingGate()
        self.name_map = name_map or (lambda n: n)
        self.apply_method = apply_method
        self.progress = progress  # a tqdm bar while preparing: None = on a terminal, for >= 64 MiB to fetch
        self.stage_threads = stage_threads  # tensors staged at once while preparing (default: every core)
        self.commit_mode = commit_mode
        # An engine that keeps weights of its own (ckptdelta.loader.engines.base.EngineApplier): ``weights`` are then
        # its host copy, the applier's pause replaces the gate and it pushes each commit into the engine.
        self.applier = applier
        #: Keep each tensor's bits before its last change (a copy of what a hot-load changes), so that the next
        #: delta's records coded against their grandparent (docs/FORMAT.md encoding 6: LoRA runs) decode on the
        #: forward route; without them such a hot-load takes the anchor route. loader/lora.py turns it on.
        self.keep_priors = False
        self._priors: dict[str, Prior] = {}
        #: Set when the replica stops (loader/hotload_jobs.py): a prepare stops at its next tensor, having
        #: written nothing, with HotLoadCancelledError; a commit is never cut (its pause must end).
        self.cancel_prepare = threading.Event()
        self._lock = threading.Lock()
        # this process's first hot-load would otherwise load the staging and commit kernels from numba's
        # cache: done now, in the background (delta/warmup.py; CKPTDELTA_WARMUP=0: not)
        warmup.warm_in_background(_dtypes_of(weights))

    @property
    def version(self) -> int | None:
        """The version the live weights hold (None: unknown)."""
        return self.served.current

    @version.setter
    def version(self, version: int | None) -> None:
        # set inside the pause, before anything computes with the new bits (a span must never miss them)
        self.served.serve(version)

    @property
    def snapshot(self) -> str | None:
        return None if self.version is None else snapshot_name(self.version)

    @property
    def busy(self) -> bool:
        return self._lock.locked()

    # --- public verbs --------------------------------------------------------------------

    def plan(self, target: "str | int") -> list[int]:
        """Versions whose stored bytes a hot-load to ``target`` would read, in order."""
        return make_plan(self.reader, self.version, self.reader.resolve(target)).path

    def prepare(self, target: "str | int", *, initial: bool = False) -> PreparedUpdate:
        """Fetch, decode and verify the change to ``target``; the live weights are only read."""
        with self._exclusive():
            return self._prepare(target, initial)

    def commit(self, prepared: PreparedUpdate) -> HotLoadReport:
        """Apply a prepared update inside one pause of the gate."""
        with self._exclusive():
            return self._commit(prepared)

    def hotload(self, target: "str | int") -> HotLoadReport:
        with self._exclusive():
            return self._commit(self._prepare(target, False))

    def load_initial(self, target: "str | int") -> HotLoadReport:
        """Like :meth:`hotload`, also from weights of unknown version (every tensor is compared and replaced
        where it differs; names, shapes and dtypes must match the snapshot's)."""
        with self._exclusive():
            return self._commit(self._prepare(target, True))

    # --- internals ------------------------------------------------------------------------

    @contextmanager
    def _exclusive(self) -> Iterator[None]:
        if not self._lock.acquire(blocking=False):
            raise HotLoadConflictError(f"a hot-load is already running on this replica (live {self.snapshot})")
        try:
            yield
        finally:
            self._lock.release()

    def _live_map(self) -> dict[str, torch.Tensor]:
        w = self.weights
        if not isinstance(w, torch.nn.Module):
            return dict(w.items())
        out: dict[str, torch.Tensor] = {}
        for n, p in w.named_parameters(remove_duplicate=False):
            out[n] = p
        for n, b in w.named_buffers(remove_duplicate=False):
            mod_name, _, attr = n.rpartition(".")
            mod = w.get_submodule(mod_name) if mod_name else w
            if attr not in getattr(mod, "_non_persistent_buffers_set", ()):
                out[n] = b
        return out

    def _prepare(self, target: "str | int", initial: bool) -> PreparedUpdate:
        v = self.reader.resolve(target)
        try:
            return self._prepare_plan(v, initial, False)
        except (GrandparentNeededError, GrandparentMismatchError) as e:
            # a record coded against its grandparent, which this replica does not hold (or not as kept: those
            # kept are dropped): rebuild from the anchor, which gives them again
            if isinstance(e, GrandparentMismatchError):
                log.warning("hot-load to %s: %s; the bits kept are dropped", snapshot_name(v), e)
                self._priors.clear()
            log.info("hot-load to %s takes the anchor route: %s", snapshot_name(v), e)
            return self._prepare_plan(v, initial, True)

    def _prepare_plan(self, v: int, initial: bool, force_anchor: bool) -> PreparedUpdate:
        t0 = time.perf_counter()
        warmup.cancel_pending()
        current = self.version
        if current is None and not initial:
            raise HotLoadError("the live weights have no known version; use load_initial() for the first load")
        plan = make_plan(self.reader, current, v, force_anchor=force_anchor)
        if force_anchor and not plan.via_anchor:
            raise GrandparentNeededError(f"{plan.target.where()}: no anchor route to it")
        tgt = plan.target
        live = self._live_map()
        mapping = {n: self.name_map(n) for n in tgt.tensors}
        _check_names(tgt, mapping, live)
        for n, e in tgt.tensors.items():
            t = live[mapping[n]]
            if dtypes.of(t).name != e.dtype or tuple(t.shape) != tuple(e.shape):
                raise ShapeMismatchError(f"tensor {n!r}: live tensor {mapping[n]!r} is {dtypes.of(t).name}"
                                         f"{list(t.shape)}, {tgt.where()} has {e.dtype}{list(e.shape)}")
        names, groups = _dedupe_aliases(plan, mapping, live)
        cur = None if current is None else self.reader.manifest(current)
        counter: dict = {}
        staged: list[_Staged] = []
        priors: dict[str, Prior] = {}
        decode_s = 0.0
        to_fetch = sum(p.nbytes for g in groups for p in g)

        def stage_group(gi: int, values: list) -> "_Staged | None":
            name = names[gi]
            t = live[mapping[name]]
            if not groups[gi]:      # a pieced tensor no record changed since the live version: prove it as is
                check_assembled(tgt.tensors[name], _host_copy(t), f"live tensor {mapping[name]!r} for {tgt.where()}")
                return None
            # where the tensor last changed: only a swapper that keeps priors can use it (a walk of the chain)
            prior = _last_change(plan, name, self._priors.get(name)) if self.keep_priors and not plan.via_anchor \
                else None
            st, after = _stage_one(name, t, groups[gi], values, plan, cur, prior, self.keep_priors)
            if after is not None and self.keep_priors:
                priors[name] = after
            if st.dense is None and st.positions.shape[0] == 0:
                return None
            undo = None if st.dense is not None else _old_bits(t, st, staged=True)
            st.old = None                      # held by the undo now
            s = _Staged(name, mapping[name], st, _identity(t), undo)
            if self.apply_method == "auto" and t.device.type == "cpu" and t.is_contiguous():
                bits = dtypes.host_bits(t)
                if bits.ctypes.data == t.data_ptr():
                    s.bits = bits
                    s.choice = batch_commit.choose(bits, st.positions, st.values, self.commit_mode) \
                        if st.dense is None else batch_commit.choose_dense(bits, st.dense)
            return s

        threads = max(1, self.stage_threads or os.cpu_count() or 1)
        with _progress_bar(self.progress, to_fetch, f"hot-load {snapshot_name(v)}") as bar, \
                _Stager(stage_group, threads) as stager:
            for done in stager.run(self.reader.iter_fetched(groups, counter=counter)):
                if done.value is not None:
                    staged.append(done.value)
                bar.update(sum(p.nbytes for p in groups[done.index]))
                stopping.hold("prepare")
                if self.cancel_prepare.is_set():
                    raise HotLoadCancelledError(f"hot-load to {snapshot_name(v)} dropped while preparing: the "
                                                f"replica is stopping; live weights and version unchanged")
            decode_s = stager.wait_s
        batch = _batch(staged, threads)
        staging = sum(s.st.nbytes + (s.choice.nbytes if s.choice is not None else 0) for s in staged)
        report = HotLoadReport(
            from_version=current, to_version=v, path=plan.path, via_anchor=plan.via_anchor,
            bytes_fetched=counter.get("bytes", 0), tensors_changed=len(staged),
            elements_changed=sum(s.st.n_changed for s in staged), fetch_s=counter.get("fetch_s", 0.0),
            decode_s=decode_s, apply_s=0.0, pause_s=0.0, total_s=time.perf_counter() - t0, staging_bytes=staging,
            tensors_copied=0 if batch is None else batch.tensors_copied)
        log.info("prepared %s -> %s via %s: %d tensors, %d bytes fetched, %d bytes staged",
                 snapshot_name(current) if current is not None else "unknown weights", snapshot_name(v),
                 "anchor" if plan.via_anchor else "deltas", len(staged), report.bytes_fetched, staging)
        return PreparedUpdate(current, v, plan.path, plan.via_anchor, staged, report, staging, id(self), batch,
                              priors=priors)

    def _commit(self, p: PreparedUpdate) -> HotLoadReport:
        t0 = time.perf_counter()
        if p._owner != id(self):
            raise HotLoadError(f"update to {p.snapshot} was prepared by another swapper")
        if p.committed:
            raise HotLoadError(f"update to {p.snapshot} was already committed")
        if p.from_version != self.version:
            raise HotLoadError(f"update to {p.snapshot} was prepared from version {p.from_version}, "
                               f"the live version is now {self.version}; prepare it again")
        if p.from_version == p.to_version:
            p.committed = True
            return replace(p.report, total_s=p.report.total_s + time.perf_counter() - t0)
        module_map = self._live_map() if isinstance(self.weights, torch.nn.Module) else None
        undo: list[tuple[torch.Tensor | None, Callable[[], None]]] = []
        method = self.apply_method
        batch = p.batch if method == "auto" else None
        pushed: list[str] = []
        written = 0
        with (self.applier.paused() if self.applier is not None else self.gate.paused()) as pause:
            ta = time.perf_counter()
            if self.applier is None:
                stopping.hold("pause")      # an engine applier pauses its engine itself (and holds there)
            try:
                lives = []
                for s in p.staged:      # every tensor is where prepare() saw it before anything is written
                    live = module_map[s.live_name] if module_map is not None else self.weights[s.live_name]
                    if _identity(live) != s.key:
                        raise HotLoadError(f"tensor {s.name!r}: the live tensor {s.live_name!r} was replaced or "
                                           "moved after prepare(); prepare again")
                    lives.append(live)
                if batch is not None:
                    # a few kernel calls per width and thread; a refusal or failure has put back what it wrote
                    # (the kernels cannot be interrupted half-way), so its undo is recorded once it has succeeded
                    batch.run()
                    undo.append((None, batch.undo))
                    written += len(batch.items)
                for s, live in zip(p.staged, lives):
                    if batch is not None and s.choice is not None:
                        continue
                    written += 1
                    if s.st.dense is not None:
                        swap = _DenseSwap(live, s.st, method, s.live_name)
                        undo.append((live, swap.undo))            # before any write: undo knows how far it got
                        swap.apply()
                    elif s.undo is not None and method == "auto" and live.device.type == "cpu" \
                            and live.is_contiguous():
                        # one pass: each old bit checked against prepare's as its position is written; a
                        # refusal has put back what it wrote, so its undo is recorded once it has succeeded
                        # (the kernel cannot be interrupted half-way)
                        _scatter_if_unchanged(live, s)
                        undo.append((live, lambda live=live, old=s.undo: old.apply_(live, method=method)))
                    else:
                        old = _unchanged_since_prepare(live, s)
                        undo.append((live, lambda live=live, old=old: old.apply_(live, method=method)))
                        s.st.apply_(live, method=method)
                _synchronize(undo)
                if self.applier is None:
                    stopping.hold("proof")
                else:
                    changed = _changed_positions(p.staged)
                    pushed = list(changed)
                    self.applier.apply(pushed, p.to_version, changed)
            except BaseException as e:
                self._roll_back(undo, p, e)
                if pushed:
                    self._push_back(changed, p, e)
                if not isinstance(e, Exception):
                    raise
                raise HotLoadError(f"hot-load {_name(p.from_version)} -> {p.snapshot} failed while applying "
                                   f"({type(e).__name__}: {e}); the {written} tensors already written were "
                                   f"restored, live weights and version are unchanged") from e
            self.version = p.to_version
            self._priors.update(p.priors)     # each checked against the chain before use (_last_change)
            apply_s = time.perf_counter() - ta
            if self.applier is None:
                stopping.hold("resume")
        p.committed = True
        p.staged, p.batch = [], None   # densely staged tensors now hold the old bits: nothing left worth keeping
        report = replace(p.report, apply_s=apply_s, pause_s=pause.seconds,
                         total_s=p.report.total_s + time.perf_counter() - t0)
        log.info("hot-loaded %s -> %s: %d tensors, %d elements, pause %.3fs (apply %.3fs)",
                 _name(p.from_version), p.snapshot, report.tensors_changed, report.elements_changed,
                 report.pause_s, apply_s)
        return report

    def _push_back(self, changed: dict, p: PreparedUpdate, cause: BaseException) -> None:
        """After a failed push into the engine, push the restored host copy again (the old version's bits)."""
        try:
            self.applier.apply(list(changed), p.from_version, changed)
        except BaseException as e2:
            self.version = None
            log.critical("hot-load to %s failed (%s) and putting the engine back failed too (%s): "
                         "the engine's weights are now of unknown version", p.snapshot, cause, e2)
            raise HotLoadError(f"hot-load to {p.snapshot} failed ({cause}) and the engine could not be put back "
                               f"on {_name(p.from_version)} ({e2}); the live version is now unknown: "
                               "load_initial() again") from e2

    def _roll_back(self, undo: list[tuple[torch.Tensor, Callable[[], None]]], p: PreparedUpdate,
                   cause: BaseException) -> None:
        try:
            for _live, restore in reversed(undo):
                restore()
            _synchronize(undo)
        except BaseException as e2:
            self.version = None
            log.critical("hot-load to %s failed (%s) and restoring the old weights failed too (%s): "
                         "the live weights are now of unknown version", p.snapshot, cause, e2)
            raise HotLoadError(f"hot-load to {p.snapshot} failed ({cause}) and the old weights could not be "
                               f"restored ({e2}); the live version is now unknown: load_initial() again") from e2


PROGRESS_MIN_BYTES = 64 << 20


def _batch(staged: list[_Staged], threads: int) -> "batch_commit.CommitBatch | None":
    """The commit's batch of the tensors staged with a choice (contiguous host memory, sparse changes). The
    batch writes from the staged arrays themselves (the same objects, kept here for the undo)."""
    chosen = [s for s in staged if s.choice is not None]
    if not chosen:
        return None
    items = [batch_commit.Item(s.name, s.live_name, s.bits, s.st.positions,
                               s.undo.values if s.undo is not None else s.st.values, s.st.values, s.choice)
             for s in chosen]    # a swapped (densely staged) tensor has no changes listed: its whole is choice's
    warmup.ensure_commit_paths(it.bits.dtype.itemsize for it in items)   # compiled here, not in the pause
    batch = batch_commit.CommitBatch(items, threads)
    for s, it in zip(chosen, items):
        s.st.positions, s.st.values = it.positions, it.values
        if s.undo is not None:
            s.undo.positions, s.undo.values = it.positions, it.expected
    return batch


def _changed_positions(staged: list) -> dict[str, Any]:
    """Live name -> the flat positions a staged change writes (None for a densely staged tensor): what an
    engine applier needs to patch only those elements (the values are in the host copy by then)."""
    return {s.live_name: (s.st.positions if s.st.dense is None else None) for s in staged}


def _progress_bar(enabled: bool | None, total: int, desc: str) -> Any:
    """A tqdm bar over the bytes to fetch; by default only on a terminal and for a large hot-load."""
    from tqdm import tqdm

    if enabled is None:
        enabled = sys.stderr.isatty() and total >= PROGRESS_MIN_BYTES
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, leave=False,
                disable=not enabled)


def _name(v: int | None) -> str:
    return "unknown weights" if v is None else snapshot_name(v)


def _dtypes_of(weights: Weights) -> set[torch.dtype]:
    if isinstance(weights, torch.nn.Module):
        return {t.dtype for t in (*weights.parameters(), *weights.buffers())}
    return {t.dtype for t in weights.values() if isinstance(t, torch.Tensor)}


def _identity(t: torch.Tensor) -> tuple:
    """What must not change between prepare and commit: where the tensor lives and how it is laid out."""
    return (t.device.type, t.device.index, t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))


def _check_names(tgt: Manifest, mapping: dict[str, str], live: dict[str, torch.Tensor]) -> None:
    missing = sorted(n for n, ln in mapping.items() if ln not in live)
    mapped = set(mapping.values())
    covered = {_identity(live[ln]) for ln in mapped if ln in live}
    extra = sorted(ln for ln, t in live.items() if ln not in mapped and _identity(t) not in covered)
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing from the live weights: {', '.join(map(repr, missing[:10]))}"
                         + (f" (+{len(missing) - 10} more)" if len(missing) > 10 else ""))
        if extra:
            parts.append(f"live tensors not in the snapshot: {', '.join(map(repr, extra[:10]))}"
                         + (f" (+{len(extra) - 10} more)" if len(extra) > 10 else ""))
        raise HotLoadError(f"{tgt.where()} does not match the live weights: " + "; ".join(parts))


def _dedupe_aliases(plan: UpdatePlan, mapping: dict[str, str],
                    live: dict[str, torch.Tensor]) -> tuple[list[str], list[list[Piece]]]:
    """Tied weights share storage: stage one name per storage, once the snapshot agrees they are equal."""
    tgt = plan.target
    first: dict[tuple, str] = {}
    for n in sorted(tgt.tensors):
        other = first.setdefault(_identity(live[mapping[n]]), n)
        if other != n and tgt.tensors[other].xxh3 != tgt.tensors[n].xxh3:
            raise HotLoadError(f"tensors {other!r} and {n!r} share storage in the live model but differ in "
                               f"{tgt.where()}")
    names, groups, seen = [], [], set()
    for n, g in zip(plan.names, plan.groups):
        k = _identity(live[mapping[n]])
        if k not in seen:
            seen.add(k)
            names.append(n)
            groups.append(g)
    return names, groups


@dataclass
class _Done:
    index: int
    value: Any


class _Stager:
    """Stages fetched groups on ``threads`` threads, results in fetch order, a bounded number ahead.

    Decoding a tensor is numba kernels, zstd and xxhash, which release the GIL, and a
    model's tensors are independent, so a replica with many cores prepares a version
    that many times faster; the window keeps at most a few groups' fetched bytes and
    staged results waiting. On an error the groups not started are dropped and the
    running ones finish before it propagates: nothing stages after prepare returns."""

    def __init__(self, fn: Callable[[int, list], Any], threads: int) -> None:
        self.fn, self.threads, self.wait_s = fn, threads, 0.0
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="ckptdelta-stage") if threads > 1 else None
        self._pending: deque[tuple[int, Future]] = deque()

    def __enter__(self) -> "_Stager":
        return self

    def __exit__(self, *exc: object) -> None:
        for _gi, f in self._pending:
            f.cancel()
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def run(self, fetched: Iterator[tuple[int, list]]) -> Iterator[_Done]:
        """Time spent here other than waiting for ``fetched`` (decoding the caller waits for) adds to ``wait_s``."""
        for gi, values in fetched:
            t0 = time.perf_counter()
            if self._pool is None:
                value = self.fn(gi, values)
                self.wait_s += time.perf_counter() - t0
                yield _Done(gi, value)
                continue
            self._pending.append((gi, self._pool.submit(self.fn, gi, values)))
            while len(self._pending) >= 2 * self.threads or (self._pending and self._pending[0][1].done()):
                done = self._collect()
                self.wait_s += time.perf_counter() - t0
                yield done
                t0 = time.perf_counter()
            self.wait_s += time.perf_counter() - t0
        while self._pending:
            t0 = time.perf_counter()
            done = self._collect()
            self.wait_s += time.perf_counter() - t0
            yield done

    def _collect(self) -> _Done:
        gi, fut = self._pending[0]
        value = fut.result()
        self._pending.popleft()
        return _Done(gi, value)


def _last_change(plan: UpdatePlan, name: str, held: Prior | None) -> Prior | None:
    """Where the live tensor ``name`` last changed in the chain of the version held (the forward route's
    chain), with the bits before that change when ``held`` is that very change's; None when not found."""
    last = None
    for m in plan.chain:
        if m.version > plan.from_version:
            break
        e = m.tensors.get(name)
        if e is None:
            last = None
        elif m.kind == "anchor" or e.object is not None or any(p.object is not None for p in e.pieces):
            last = m.version
    if last is None:
        return None
    return held if held is not None and held.version == last else Prior(last)


def _stage_one(name: str, live: torch.Tensor, pieces: list[Piece], values: list, plan: UpdatePlan,
               cur: Manifest | None, prior: Prior | None = None,
               keep_prior: bool = False) -> tuple[StagedTensor, Prior | None]:
    """The tensor's change, and (with ``keep_prior``, or None) where it last changes and its bits before."""
    if plan.target.tensors[name].pieces or any(p.index is not None for p in pieces):
        return _stage_pieced(name, live, pieces, values, plan, cur), None
    expected = int(plan.target.tensors[name].xxh3, 16)
    if not plan.via_anchor:
        first = values[0]
        ce = None if cur is None else cur.tensors.get(name)
        if first.header.has_parent and ce is not None and first.header.parent_digest != int(ce.xxh3, 16):
            raise ParentMismatchError(          # no tensor data read: the record and the held version disagree
                f"{pieces[0].where()}: the delta was encoded against a tensor with digest "
                f"{first.header.parent_digest:016x}, {cur.where()} (the version held) says {ce.xxh3}")
        if len(pieces) == 1 and first.header.has_parent:
            grand = grandparent_of(pieces[0], live, prior) if first.needs_grandparent else None
            if first.needs_grandparent and grand is None:
                raise GrandparentNeededError(f"{pieces[0].where()}: the record is coded against the tensor two "
                                             "snapshots back, which this replica does not hold")
            # verifies the result digest (and so the bits), one chunk of scratch; the live bits, before the
            # record, are what the next snapshot's record of this tensor may be coded against
            after = Prior(pieces[0].manifest.version, live.detach().to("cpu", copy=True)) if keep_prior else None
            return stage(live, first, grandparent=grand), after
        base = live.detach().to("cpu", copy=True).contiguous() if first.header.has_parent else None
        # each record verifies its result digest
        new, after = replay(pieces, values, base=base, prior=prior, keep_prior=keep_prior)
        return stage_full(live, new, name=name, expected_digest=expected), after if keep_prior else None
    new, after = replay(pieces, values, keep_prior=keep_prior)
    st = stage_full(live, new, name=name, expected_digest=expected)
    _check_held(name, live, st, cur)
    return st, after if keep_prior else None


def _check_held(name: str, live: torch.Tensor, st: StagedTensor, cur: Manifest | None) -> None:
    """On the anchor route: the live tensor must be the version the replica claims (whole digest, or held in
    pieces: the digest of its boxes)."""
    ce = None if cur is None else cur.tensors.get(name)
    if ce is None:
        return
    if ce.pieces:
        check_assembled(ce, _host_copy(live), f"live tensor of {name!r}, held as {cur.where()}")
    elif st.parent_digest != int(ce.xxh3, 16):
        raise ParentMismatchError(f"tensor {name!r}: the live tensor hashes to {st.parent_digest:016x}, "
                                  f"{cur.where()} says {ce.xxh3}: the live weights are not the version they claim")


def _stage_pieced(name: str, live: torch.Tensor, pieces: list[Piece], values: list, plan: UpdatePlan,
                  cur: Manifest | None) -> StagedTensor:
    """A tensor a sharded trainer published in boxes: its records are applied to their boxes of a whole copy
    (the live tensor's on the forward route, the anchor's on the anchor route), each checking its box's
    digest; the copy is then proven whole against the target's digest of its pieces and staged like an
    anchor's tensor. Holds one whole copy of the tensor while it is staged."""
    te = plan.target.tensors[name]
    ce = None if cur is None else cur.tensors.get(name)
    if not plan.via_anchor and ce is not None and ce.pieces:
        boxes = {p.box: p.xxh3 for p in ce.pieces}      # no tensor data read: records and live version disagree
        for p, v in zip(pieces, values):
            if p.index is None or p.manifest.version != pieces[0].manifest.version or not v.header.has_parent:
                continue
            held = boxes.get(p.part.box)
            if held is not None and v.header.parent_digest != int(held, 16):
                raise ParentMismatchError(f"{p.where()}: the delta was encoded against a box with digest "
                                          f"{v.header.parent_digest:016x}, {cur.where()} (the version held) "
                                          f"says {held}")
    if not plan.via_anchor:
        st = _stage_boxes(name, live, pieces, values, te, ce)
        if st is not None:
            return st
    base = _host_copy(live, copy=True) if not plan.via_anchor else None
    new = rebuild(pieces, values, base=base)           # each record verifies its box's digest
    check_assembled(te, new, f"tensor {name!r} of {plan.target.where()}")
    st = stage_full(live, new, name=name, expected_digest=None if te.pieces else int(te.xxh3, 16))
    if plan.via_anchor:
        _check_held(name, live, st, cur)
    return st


def _stage_boxes(name: str, live: torch.Tensor, pieces: list[Piece], values: list, te: TensorEntry,
                 ce: TensorEntry | None) -> StagedTensor | None:
    """The common hot-load of a pieced tensor, without a copy of it: one version forward, every record's box a
    flat range of a contiguous host tensor (FSDP2's row shards). Each record is staged against its box of the
    live tensor (verifying the box's digest, as a whole tensor's record does) and the changes are put
    together at their offsets. A box the target lists unchanged holds the live bits: proven by the held
    version listing the same box with the same digest, else by hashing it. None: take the general path."""
    if not (live.device.type == "cpu" and live.is_contiguous() and all(p.index is not None for p in pieces)
            and len({p.manifest.version for p in pieces}) == 1):
        return None
    shape = tuple(te.shape)
    spans = [flat_range(p.part.offsets, p.part.shape, shape) for p in pieces]
    if any(r is None for r in spans):
        return None
    held = {p.box: p.xxh3 for p in ce.pieces} if ce is not None else {}
    stored = {p.part.box for p in pieces}
    for p in te.pieces:
        if p.box not in stored and held.get(p.box) != p.xxh3:
            got = f"{xxhash.xxh3_64_intdigest(box_bits(live, p.offsets, p.shape)):016x}"
            if got != p.xxh3:
                raise ChecksumError(f"tensor {name!r}: box {p.describe()}, which {pieces[0].manifest.where()} "
                                    f"lists unchanged, holds bits hashing to {got}, the manifest says {p.xxh3}")
    staged = []
    for p, v, (start, _stop) in zip(pieces, values, spans):
        st = stage(box_view(live.detach(), p.part.offsets, p.part.shape), v)   # proves the box's bits
        if st.dense is not None:
            return None
        staged.append((start, st))
    dt = staged[0][1].dtype
    old = [st.old for _s, st in staged]
    return StagedTensor(name, dt, shape, int(te.xxh3, 16), 0 if ce is None else int(ce.xxh3, 16),
                        np.concatenate([st.positions + start for start, st in staged]),
                        np.concatenate([st.values for _s, st in staged]),
                        old=None if any(o is None for o in old) else np.concatenate(old))


def _host_copy(t: torch.Tensor, *, copy: bool = False) -> torch.Tensor:
    """``t`` as a contiguous CPU tensor (itself when it already is one and ``copy`` is False)."""
    t = t.detach()
    if not copy and t.device.type == "cpu" and t.is_contiguous():
        return t
    return t.to("cpu", copy=True).contiguous()


def _old_bits(live: torch.Tensor, st: StagedTensor, *, staged: bool = False) -> StagedTensor:
    """The bits a sparse ``st`` will overwrite, as a staged change that writes them back. ``staged``
    (prepare only): take the ones stage() gathered while each chunk was in cache, if it did. The check
    in the pause must read the live tensor again."""
    if staged and st.old is not None:
        old = st.old
    elif live.device.type == "cpu" and live.is_contiguous():
        old = dtypes.host_bits(live)[st.positions]
    else:
        ints = dtypes.torch_bits_view(live.detach().reshape(-1).contiguous())
        idx = torch.from_numpy(st.positions).to(live.device)
        old = ints[idx].cpu().numpy().view(st.dtype.bits_dtype)
    return StagedTensor(st.name, st.dtype, st.shape, st.parent_digest, st.digest, st.positions, old)


_SWAP_CHUNK = 1 << 20


class _DenseSwap:
    """Exchange a live tensor's bits with ``st.dense``, undoably at every point.

    After :meth:`apply` the live tensor holds the new bits and ``st.dense`` the old
    ones. :meth:`undo` may be called whenever apply stopped (it raised anywhere, or
    finished) and puts back exactly what was there: the commit records it before
    anything is written, so a failure in an allocation (a non-contiguous tensor's
    copy, the device upload) writes nothing, and one half-way through a copy is
    rolled back from the bits it has not overwritten yet. Afterwards ``st.dense``
    holds the new bits again, so the prepared update can still be committed.

    Before or while writing, the bits swapped out are hashed and must equal the
    parent digest prepare() checked: a tensor someone else wrote in place since
    then is refused (HotLoadError) instead of being silently half-replaced.

    Nothing the size of the tensor is allocated on the host on the contiguous CPU
    path (the pause must not page-fault in a copy of the model); the device path
    uploads the new bits, as any dense apply must."""

    def __init__(self, live: torch.Tensor, st: StagedTensor, method: str, live_name: str) -> None:
        self.live, self.st, self.method, self.live_name = live, st, method, live_name
        self.swapped = False        # apply() finished: undo swaps back
        self._new: torch.Tensor | None = None   # torch path: a copy of the new bits on the live device
        self._stage = 0             # torch path: 1 = st.dense being overwritten, 2 = live being overwritten
        self._tmp: np.ndarray | None = None     # numpy path: the old bits of chunk [_s, _e)
        self._s = self._e = 0
        self._done = 0              # numpy path: elements [0, _done) swapped completely

    def apply(self, check: bool = True) -> None:
        live = self.live
        if self.method == "auto" and live.device.type == "cpu" and live.is_contiguous():
            self._apply_host(check)
        else:
            self._apply_torch(check)
        self.swapped = True

    def undo(self) -> None:
        if self.swapped:            # a finished swap: swapping again restores both sides
            self.swapped = False
            self.apply(check=False)
            self.swapped = False
        elif self._tmp is not None:
            self._undo_host()
        else:
            self._undo_torch()

    # --- contiguous host memory: chunked swap through a small scratch buffer ------------------

    def _apply_host(self, check: bool) -> None:
        bits, dense = self._host_bits(), self.st.dense
        n = bits.shape[0]
        tmp = np.empty(min(_SWAP_CHUNK, n), bits.dtype)  # may fail (memory): nothing written yet
        h = xxhash.xxh3_64()
        self._tmp, self._done, self._stage = tmp, 0, 0
        for s in range(0, n, _SWAP_CHUNK):
            e = min(n, s + _SWAP_CHUNK)
            tmp[:e - s] = bits[s:e]
            if check:
                h.update(tmp[:e - s])
            self._s, self._e, self._stage = s, e, 1   # live's chunk [s, e) takes the new bits
            bits[s:e] = dense[s:e]
            self._stage = 2                           # dense's chunk takes the old bits
            dense[s:e] = tmp[:e - s]
            self._done, self._stage = e, 0
        self._tmp = None
        if check and h.intdigest() != self.st.parent_digest:
            self.swapped = True            # so the commit's rollback swaps it back
            raise self._written_error(h.intdigest())

    def _undo_host(self) -> None:
        bits, dense, tmp = self._host_bits(), self.st.dense, self._tmp
        s, e = self._s, self._e
        if self._stage == 2:               # live's chunk holds the new bits, dense's some old ones
            dense[s:e] = bits[s:e]
        if self._stage >= 1:               # tmp holds the chunk's old bits
            bits[s:e] = tmp[:e - s]
        for s in range(0, self._done, _SWAP_CHUNK):
            e = min(self._done, s + _SWAP_CHUNK)
            tmp[:e - s] = bits[s:e]
            bits[s:e] = dense[s:e]
            dense[s:e] = tmp[:e - s]
        self._tmp, self._done, self._stage = None, 0, 0

    def _host_bits(self) -> np.ndarray:
        bits = dtypes.host_bits(self.live)
        if bits.ctypes.data != self.live.data_ptr():
            raise ShapeMismatchError(f"tensor {self.st.name!r}: cannot get a writable view of the live tensor")
        return bits

    # --- device or strided tensors: torch copies -----------------------------------------------

    def _apply_torch(self, check: bool) -> None:
        live, st = self.live, self.st
        host = self._host()
        with torch.no_grad():
            self._new = host.to(live.device, copy=True)            # may fail (memory): nothing written yet
            old = live.detach().contiguous().view(-1).view(host.dtype)  # a copy when strided: may fail too
            self._stage = 1                                        # st.dense takes the old bits
            host.copy_(old)
            del old
            got = xxhash.xxh3_64_intdigest(st.dense) if check else st.parent_digest
            if got != st.parent_digest:
                raise self._written_error(got)                     # live not written yet
            self._stage = 2                                        # live takes the new bits
            live.copy_(self._new.view(st.dtype.torch_dtype).reshape(st.shape))
        self._new, self._stage = None, 0

    def _undo_torch(self) -> None:
        live, st = self.live, self.st
        host = self._host()
        with torch.no_grad():
            if self._stage == 2:           # st.dense holds every old bit; live may hold some new ones
                live.copy_(host.to(live.device).view(st.dtype.torch_dtype).reshape(st.shape))
            if self._stage >= 1:           # st.dense may hold some old bits: give it back the new ones
                host.copy_(self._new)
        self._new, self._stage = None, 0

    def _host(self) -> torch.Tensor:
        st = self.st
        np_int = np.dtype(f"<i{st.dtype.itemsize}") if st.dtype.itemsize > 1 else np.dtype(np.uint8)
        return torch.from_numpy(st.dense.view(np_int))             # shares memory with st.dense

    def _written_error(self, got: int) -> HotLoadError:
        return HotLoadError(f"tensor {self.st.name!r}: the live tensor {self.live_name!r} hashes to {got:016x}, "
                            f"prepare() saw {self.st.parent_digest:016x}: it was written after prepare(); "
                            "prepare again")


def _unchanged_since_prepare(live: torch.Tensor, s: _Staged) -> StagedTensor:
    """The old bits at a sparse change's positions, gathered now (in the pause), as its undo.

    They must equal the ones prepare() gathered: a live tensor written in place since
    then (by anything but this swapper) is refused before it is touched, so neither the
    commit nor its rollback overwrites another writer's bits. Costs a gather of the
    changed elements only; a write elsewhere in the tensor is not seen (docs/GUARANTEES.md)."""
    old = _old_bits(live, s.st)
    if s.undo is not None and not np.array_equal(old.values, s.undo.values):
        n = int(np.count_nonzero(old.values != s.undo.values))
        raise HotLoadError(f"tensor {s.name!r}: {n} of the {old.values.shape[0]} elements this update changes in "
                           f"the live tensor {s.live_name!r} were written after prepare(); prepare again")
    return old


def _scatter_if_unchanged(live: torch.Tensor, s: _Staged) -> None:
    """A sparse change written into contiguous host memory, each old bit compared with the one prepare()
    saved as it is overwritten; a difference leaves the tensor as it was (the kernel puts back what it wrote)
    and refuses, as :func:`_unchanged_since_prepare` does."""
    from ckptdelta.delta import kernels

    bits = dtypes.host_bits(live)
    j = kernels.scatter_if_unchanged(bits, s.st.positions, s.undo.values, s.st.values)
    if j >= 0:
        raise HotLoadError(f"tensor {s.name!r}: element {int(s.st.positions[j])} of the live tensor {s.live_name!r}, "
                           "which this update changes, was written after prepare(); prepare again")


def _synchronize(applied: list[tuple[torch.Tensor | None, object]]) -> None:
    devices = {t.device for t, _ in applied if t is not None and t.device.type == "cuda"}
    for d in devices:
        torch.cuda.synchronize(d)
