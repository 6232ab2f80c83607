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
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Callable, Iterator, MutableMapping  # noqa: F401 - the Weights alias names it

import torch

from ckptdelta.delta import dtypes, warmup
from ckptdelta.delta.errors import (GrandparentMismatchError, GrandparentNeededError,
                                    HotLoadCancelledError, HotLoadConflictError, HotLoadError, ShapeMismatchError)
from ckptdelta.delta.manifest import Manifest, snapshot_name

from ckptdelta.loader import batch_commit, stopping
from ckptdelta.loader.fetch_units import Piece, Prior, check_assembled, stored_order
from ckptdelta.loader.update_path import UpdatePlan, make_plan
from ckptdelta.loader.reader import SnapshotReader
from ckptdelta.loader.spans import VersionLog
from ckptdelta.loader.dense_swap import DenseSwap, _scatter_if_unchanged, _synchronize, _unchanged_since_prepare
from ckptdelta.loader.gate import ServingGate
from ckptdelta.loader.threads import Threads
from ckptdelta.loader.staging import Staged, Stager, host_copy, last_change, old_bits, stage_one, stage_threads_for

if TYPE_CHECKING:
    from ckptdelta.loader.engines.base import EngineApplier

log = logging.getLogger("ckptdelta.loader.hotswap")

Weights = "torch.nn.Module | MutableMapping[str, torch.Tensor]"


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
class PreparedUpdate:
    """A verified change from ``from_version`` to ``to_version``, ready for :meth:`HotSwapper.commit`."""

    from_version: int | None
    to_version: int
    path: list[int]
    via_anchor: bool
    staged: list[Staged] = field(repr=False)
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
                 stage_threads: int | None = None, applier: "EngineApplier | None" = None,
                 commit_mode: str = "auto") -> None:
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
        self._stage_pools: dict[int, Threads] = {}     # by thread count (a hot-load's: stage_threads_for)
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
        rank = {n: i for i, n in enumerate(names)}          # the commit's order, as planned
        order = stored_order(groups)                        # the fetch's: neighbouring bytes in few requests
        names, groups = [names[i] for i in order], [groups[i] for i in order]
        cur = None if current is None else self.reader.manifest(current)
        counter: dict = {}
        staged: list[Staged] = []
        priors: dict[str, Prior] = {}
        decode_s = 0.0
        to_fetch = sum(p.nbytes for g in groups for p in g)

        def stage_group(gi: int, values: list) -> "Staged | None":
            name = names[gi]
            t = live[mapping[name]]
            if not groups[gi]:      # a pieced tensor no record changed since the live version: prove it as is
                check_assembled(tgt.tensors[name], host_copy(t), f"live tensor {mapping[name]!r} for {tgt.where()}")
                return None
            # where the tensor last changed: only a swapper that keeps priors can use it (a walk of the chain)
            prior = last_change(plan, name, self._priors.get(name)) if self.keep_priors and not plan.via_anchor \
                else None
            st, after = stage_one(name, t, groups[gi], values, plan, cur, prior, self.keep_priors)
            if after is not None and self.keep_priors:
                priors[name] = after
            if st.dense is None and st.positions.shape[0] == 0:
                return None
            undo = None if st.dense is not None else old_bits(t, st, staged=True)
            st.old = None                      # held by the undo now
            s = Staged(name, mapping[name], st, _identity(t), undo)
            if self.apply_method == "auto" and t.device.type == "cpu" and t.is_contiguous():
                bits = dtypes.host_bits(t)
                if bits.ctypes.data == t.data_ptr():
                    s.bits = bits
                    s.choice = batch_commit.choose(bits, st.positions, st.values, self.commit_mode) \
                        if st.dense is None else batch_commit.choose_dense(bits, st.dense)
            return s

        threads = self.stage_threads or stage_threads_for(
            sum(live[mapping[names[gi]]].nbytes for gi, g in enumerate(groups) if g), os.cpu_count() or 1)
        with _progress_bar(self.progress, to_fetch, f"hot-load {snapshot_name(v)}") as bar, \
                Stager(stage_group, threads, self._staging_threads(threads)) as stager:
            for done in stager.run(self.reader.iter_fetched_batches(groups, counter=counter)):
                if done.value is not None:
                    staged.append(done.value)
                bar.update(sum(p.nbytes for p in groups[done.index]))
                stopping.hold("prepare")
                if self.cancel_prepare.is_set():
                    raise HotLoadCancelledError(f"hot-load to {snapshot_name(v)} dropped while preparing: the "
                                                f"replica is stopping; live weights and version unchanged")
            decode_s = stager.wait_s
        staged.sort(key=lambda s: rank[s.name])
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

    def _staging_threads(self, n: int) -> Threads | None:
        """``n`` staging threads, kept from one hot-load to the next (loader/threads.py); one stages inline."""
        if n <= 1:
            return None
        pool = self._stage_pools.get(n)
        if pool is None:
            pool = self._stage_pools[n] = Threads(n, "ckptdelta-stage")
        return pool

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
                        swap = DenseSwap(live, s.st, method, s.live_name)
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
            self._priors.update(p.priors)     # each checked against the chain before use (last_change)
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


def _batch(staged: list[Staged], threads: int) -> "batch_commit.CommitBatch | None":
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
