"""Staging: each changed tensor's record turned, while the model serves, into what the pause writes (its
changed positions and new bits, or its whole new bits), checked against the live tensor's current bits and,
for tensors in pieces or coded against a grandparent, against what the chain says they were.
"""

from __future__ import annotations

import time
from collections import deque
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np
import torch
import xxhash

from ckptdelta.delta import StagedTensor, dtypes, stage, stage_full
from ckptdelta.delta.batch import BYTES_PER_THREAD, threads_for
from ckptdelta.delta.errors import (ChecksumError, GrandparentNeededError,
                                    ParentMismatchError)
from ckptdelta.delta.manifest import Manifest, TensorEntry
from ckptdelta.delta.pieces import box_bits, box_view, flat_range

from ckptdelta.loader import batch_commit
from ckptdelta.loader.threads import Threads
from ckptdelta.loader.fetch_units import Piece, Prior, check_assembled, grandparent_of, rebuild, replay
from ckptdelta.loader.update_path import UpdatePlan


@dataclass
class Staged:
    name: str                 # checkpoint name
    live_name: str            # name in the live module / mapping
    st: StagedTensor
    key: tuple                # identity of the live tensor it was staged against
    undo: StagedTensor | None = None   # a sparse change's old bits, gathered while serving, not in the pause
    bits: np.ndarray | None = field(default=None, repr=False)   # the live bits, when batched (contiguous host)
    choice: batch_commit.Choice | None = None                   # how the batch writes it: scatter, copy, swap


@dataclass
class StageDone:
    index: int
    value: Any


#: Small groups of one fetched batch are handed to a staging thread together, up to about this many fetched
#: bytes a task (fewer where the batch would not otherwise reach every thread): a LoRA adapter's hundreds of
#: small tensors are a few handoffs, not hundreds. Each handoff waits for a thread to wake, which on a host
#: whose cores are busy serving costs more than decoding a small tensor (docs/PERFORMANCE.md, "LoRA runs").
TASK_BYTES = 1 << 20

#: The changed tensors' bytes each staging thread is given at least: below it a hot-load stages on fewer threads
#: (one for a small LoRA adapter's step). Each tensor's stage is a few short kernels between lines of Python; on
#: tensors of tens to hundreds of KB a second thread mostly waits for the GIL the first holds (docs/PERFORMANCE.md,
#: "LoRA runs, the replica's fixed costs").
STAGE_BYTES_PER_THREAD = BYTES_PER_THREAD


def stage_threads_for(staged_bytes: int, cores: int) -> int:
    """Threads to stage ``staged_bytes`` of changed tensors with on ``cores`` cores (see
    :data:`STAGE_BYTES_PER_THREAD`; the codec's ``threads_for`` rule, which the publisher's encode follows too)."""
    return threads_for(staged_bytes, cores, STAGE_BYTES_PER_THREAD)


class Stager:
    """Stages fetched groups on ``threads`` threads, results in fetch order, a bounded number ahead.

    Decoding a tensor is numba kernels, zstd and xxhash, which release the GIL, and a
    model's tensors are independent, so a replica with many cores prepares a version
    that many times faster; the window keeps at most a few tasks' fetched bytes and
    staged results waiting. On an error the tasks not started are dropped and the
    running ones finish before it propagates: nothing stages after prepare returns."""

    def __init__(self, fn: Callable[[int, list], Any], threads: int, pool: Threads | None = None) -> None:
        """``pool``: kept threads to stage on (at least ``threads`` of them; the swapper's, loader/threads.py),
        else a pool of this Stager's own."""
        self.fn, self.threads, self.wait_s = fn, threads, 0.0
        self._own = pool is None and threads > 1
        self._pool: Threads | ThreadPoolExecutor | None = None if threads <= 1 else \
            pool if pool is not None else ThreadPoolExecutor(threads, thread_name_prefix="ckptdelta-stage")
        self._pending: deque[tuple[list[int], Future]] = deque()

    def __enter__(self) -> "Stager":
        return self

    def __exit__(self, *exc: object) -> None:
        for _gis, f in self._pending:
            f.cancel()
        if self._own:
            self._pool.shutdown(wait=True)
        elif self._pool is not None:        # the tasks that started end before this does: nothing stages after
            futures.wait([f for _gis, f in self._pending])

    def run(self, batches: Iterator[list[tuple[int, list]]]) -> Iterator[StageDone]:
        """Stage each fetched batch's groups (``iter_fetched_batches``), yielding them in order. Time spent
        here other than waiting for ``batches`` (decoding the caller waits for) adds to ``wait_s``."""
        for batch in batches:
            t0 = time.perf_counter()
            if self._pool is None:
                for gi, values in batch:
                    value = self.fn(gi, values)
                    self.wait_s += time.perf_counter() - t0
                    yield StageDone(gi, value)
                    t0 = time.perf_counter()
                continue
            for task in self._tasks(batch):
                self._pending.append(([gi for gi, _ in task], self._pool.submit(self._stage_task, task)))
                while len(self._pending) >= 2 * self.threads or (self._pending and self._pending[0][1].done()):
                    done = self._collect()
                    self.wait_s += time.perf_counter() - t0
                    yield from done
                    t0 = time.perf_counter()
            self.wait_s += time.perf_counter() - t0
        while self._pending:
            t0 = time.perf_counter()
            done = self._collect()
            self.wait_s += time.perf_counter() - t0
            yield from done

    def _tasks(self, batch: list[tuple[int, list]]) -> Iterator[list[tuple[int, list]]]:
        """The batch cut into runs of consecutive groups of about ``TASK_BYTES`` fetched bytes each, at most a
        1/threads share of the batch's, so that a batch of small groups still reaches every thread."""
        sizes = [sum(_nbytes(v) for v in values) for _, values in batch]
        target = max(1, min(TASK_BYTES, sum(sizes) // self.threads))
        task: list[tuple[int, list]] = []
        size = 0
        for item, n in zip(batch, sizes):
            task.append(item)
            size += n
            if size >= target:
                yield task
                task, size = [], 0
        if task:
            yield task

    def _stage_task(self, task: list[tuple[int, list]]) -> list[Any]:
        return [self.fn(gi, values) for gi, values in task]

    def _collect(self) -> list[StageDone]:
        gis, fut = self._pending[0]
        values = fut.result()
        self._pending.popleft()
        return [StageDone(gi, v) for gi, v in zip(gis, values)]


def _nbytes(value: Any) -> int:
    """A fetched payload's size: an anchor tensor's bytes or a parsed record (EncodedTensor)."""
    n = getattr(value, "nbytes", None)
    return n if isinstance(n, int) else len(value)


def last_change(plan: UpdatePlan, name: str, held: Prior | None) -> Prior | None:
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


def stage_one(name: str, live: torch.Tensor, pieces: list[Piece], values: list, plan: UpdatePlan,
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
            # verifies the result digest (and so the bits), one chunk of scratch; staging leaves ``live`` as it
            # is, so its bits, before the record, are what the next snapshot's record may be coded against
            st = stage(live, first, grandparent=grand)
            return st, Prior(pieces[0].manifest.version, bits_before(live, st)) if keep_prior else None
        base = live.detach().to("cpu", copy=True).contiguous() if first.header.has_parent else None
        # each record verifies its result digest
        new, after = replay(pieces, values, base=base, prior=prior, keep_prior=keep_prior)
        return stage_full(live, new, name=name, expected_digest=expected), after if keep_prior else None
    new, after = replay(pieces, values, keep_prior=keep_prior)
    st = stage_full(live, new, name=name, expected_digest=expected)
    _check_held(name, live, st, cur)
    return st, after if keep_prior else None


def bits_before(live: torch.Tensor, st: StagedTensor) -> torch.Tensor:
    """The live tensor's bits as they are before its staged change is committed, for a Prior: a copy, except
    for a densely staged tensor, whose staged array is itself what the commit leaves them in. The commit
    exchanges a dense stage with the live bits (loader/dense_swap.py, batch_commit's swap), so once it has
    succeeded, and a Prior is only taken up then, that array holds exactly the bits before; no copy of the
    tensor is made for it (a LoRA step stages most tensors densely: 76 MB of copies at rank 64, fp32)."""
    if st.dense is not None:
        return dtypes.from_bits(st.dense, st.dtype, tuple(st.shape))
    return live.detach().to("cpu", copy=True)


def _check_held(name: str, live: torch.Tensor, st: StagedTensor, cur: Manifest | None) -> None:
    """On the anchor route: the live tensor must be the version the replica claims (whole digest, or held in
    pieces: the digest of its boxes)."""
    ce = None if cur is None else cur.tensors.get(name)
    if ce is None:
        return
    if ce.pieces:
        check_assembled(ce, host_copy(live), f"live tensor of {name!r}, held as {cur.where()}")
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
    base = host_copy(live, copy=True) if not plan.via_anchor else None
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


def host_copy(t: torch.Tensor, *, copy: bool = False) -> torch.Tensor:
    """``t`` as a contiguous CPU tensor (itself when it already is one and ``copy`` is False)."""
    t = t.detach()
    if not copy and t.device.type == "cpu" and t.is_contiguous():
        return t
    return t.to("cpu", copy=True).contiguous()


def old_bits(live: torch.Tensor, st: StagedTensor, *, staged: bool = False) -> StagedTensor:
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
