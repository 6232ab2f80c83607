"""The pause's writes into contiguous host memory, batched: a few kernel calls per element width and thread.

Every changed tensor that lives in contiguous CPU memory is written by
:func:`ckptdelta.delta.kernels.commit_task`. A sparsely staged one (its changed positions
and their new bits) is written in one of two ways chosen per tensor while
preparing (:func:`choose`):

- **scatter** the changed elements, each old bit compared with the one prepare()
  saw as it is overwritten: the cost follows the changed elements (and the cache
  lines they touch);
- **copy** a staged whole copy of the new tensor over the live one, in 64 KiB
  blocks, each block's live bytes hashed (``kernels.block_hash``) and compared
  with the hash prepare() took of them before it is overwritten (the hash of a
  block runs while the block before it is written): a little more than a plain
  copy of the tensor, whatever changed. Staging it (a copy of the tensor and its
  hashes) happens in prepare, while serving.

Copy wins where so many elements change that the scatter costs more than a copy
(:data:`COPY_ABOVE`, measured). A densely staged tensor (so much of it changed that
all its new bits are smaller than positions and values: codec.stage) is **swapped**
(:func:`choose_dense`): the staged new bits and the live ones exchanged block by
block, each live block checked as a copy checks it, so that the staged array then
holds the old bits, the undo, and nothing the size of the tensor is allocated.
Its blocks are hashed while preparing. The tasks of every tensor (big tensors split into
several) are cut by their estimated cost into ranges, about :data:`RANGES_PER_THREAD`
per thread, which the threads claim one at a time as they finish the last (a fixed
half each left one thread idle for a good part of the pause: the estimate
is rough and the two cores of a shared machine are not equally fast). The threads
are torch's own OpenMP team where torch runs on one (:mod:`ckptdelta.delta.omp`: right after
torch work its threads are awake, where ours would have to be woken), else a pool
of ours; either runs the same kernel (:mod:`ckptdelta.delta.commit_ranges`). A refusal
in any thread stops the others at their next task, and everything written is put
back before the commit raises, so a refused or failed batch leaves every tensor as
it was and the prepared update whole (it can be committed again).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

import numpy as np
from ckptdelta.delta import commit_ranges, kernels, omp
from ckptdelta.delta.errors import HotLoadError

MODES = ("auto", "scatter", "copy")
BLOCK_BYTES = kernels.HASH_BLOCK_BYTES

#: Share of changed elements above which copying the whole tensor costs less than scattering them, per
#: element width in bytes. Measured on the 2-core development machine with python -m
#: benchmarks.commit_choice (both ways forced on 256 MB tensors of each width, random positions:
#: benchmarks/results/commit_choice.md). A scatter's cost follows the cache lines it touches (a line holds
#: 64 / width elements) and its changed elements; a copy costs about 1.2-1.4x a plain copy of the tensor (its
#: check hashes the live bytes, each block while the one before it is written). There, a bf16 scatter
#: costs about a plain copy at 10% changed and the copy wins from 20-40%; 1-byte elements from 10-20%,
#: 4-byte ones at about 40% (cheaper there in one run of three), 8-byte ones not below 40%. Past these
#: shares a change is mostly staged densely anyway (its new bits smaller than positions + values), and a
#: dense change is always written whole (a swap, :func:`choose_dense`).
COPY_ABOVE = {1: 0.15, 2: 0.2, 4: 0.4, 8: 0.5}
#: Tensors smaller than this are always scattered (a staged copy would save nothing worth its memory).
MIN_COPY_BYTES = 1 << 20
#: Work units: a scatter task writes at most this many changed elements, a copy task this many blocks.
TASK_ELEMS = 1 << 18
TASK_BLOCKS = 32
#: Task ranges per commit thread: the threads claim them one at a time (a claim costs a kernel call).
RANGES_PER_THREAD = 8
#: Below this estimated cost (ns) the batch runs in the calling thread: a hand-off to threads of our own
#: is not free, and costs more when they must be woken ...
THREADS_ABOVE_NS = 2e6
#: ... to torch's OpenMP team, far less right after torch work (its threads are awake: delta/omp.py).
TEAM_ABOVE_NS = 2e5
# rough costs for sharing tasks out (ns): per changed element scattered, per byte copied
_SCATTER_NS = 4.0
_COPY_NS = 0.08
_SWAP_NS = 0.12


@dataclass
class Choice:
    """How the commit writes one tensor: ``mode`` (kernels.MODE_SCATTER, MODE_COPY or MODE_SWAP) and, for a
    copy or a swap, the whole new bits and the block hashes of the live bits they replace."""

    mode: int
    whole: np.ndarray | None = field(default=None, repr=False)
    hashes: np.ndarray | None = field(default=None, repr=False)

    @property
    def nbytes(self) -> int:
        """Bytes staged for the choice alone (a swap's whole new bits are the staged change itself)."""
        if self.whole is None:
            return 0
        return self.hashes.nbytes + (self.whole.nbytes if self.mode == kernels.MODE_COPY else 0)


def block_elems(itemsize: int) -> int:
    return BLOCK_BYTES // itemsize


def choose(bits: np.ndarray, positions: np.ndarray, values: np.ndarray, mode: str = "auto") -> Choice:
    """Scatter or copy (called while preparing, in a staging thread; ``bits`` are the live tensor's)."""
    n, k, w = bits.shape[0], positions.shape[0], bits.dtype.itemsize
    copy = mode == "copy" or (mode == "auto" and bits.nbytes >= MIN_COPY_BYTES and k > COPY_ABOVE[w] * n)
    if not copy or k == 0:
        return Choice(kernels.MODE_SCATTER)
    whole = bits.copy()
    kernels.scatter(whole, positions, values)
    return Choice(kernels.MODE_COPY, whole, _block_hashes(bits))


def choose_dense(bits: np.ndarray, dense: np.ndarray) -> Choice:
    """A densely staged tensor is swapped: ``dense`` (its staged new bits, the very array, of ``bits``'s
    width) is exchanged with the live bits in the pause (called while preparing, like :func:`choose`)."""
    if dense.shape != bits.shape or dense.dtype.itemsize != bits.dtype.itemsize or not dense.flags.c_contiguous:
        raise ValueError(f"staged bits {dense.dtype}{list(dense.shape)} do not match the live {bits.dtype}"
                         f"{list(bits.shape)}")
    return Choice(kernels.MODE_SWAP, dense.view(bits.dtype), _block_hashes(bits))


def _block_hashes(bits: np.ndarray) -> np.ndarray:
    be = block_elems(bits.dtype.itemsize)
    hashes = np.empty(-(-bits.shape[0] // be), np.uint64)
    kernels.block_hashes(bits, be, hashes)
    return hashes


@dataclass
class Item:
    """One tensor of a batch: its names (for errors), live bits (a view of the live tensor), the staged
    change (positions, old bits, new bits) and the choice."""

    name: str
    live_name: str
    bits: np.ndarray
    positions: np.ndarray
    expected: np.ndarray
    values: np.ndarray
    choice: Choice


class _Group:
    """The items of one element width: their staged arrays (the staged arrays themselves, not copies), the
    tasks, and the item table the commit kernel reads them through (delta/commit_ranges.py)."""

    def __init__(self, items: list[Item]) -> None:
        self.items = items
        w = items[0].bits.dtype
        self.block = block_elems(w.itemsize)
        for it in items:   # one element type per group; no-ops as staged
            if it.expected.dtype.itemsize != w.itemsize or it.values.dtype.itemsize != w.itemsize:
                raise HotLoadError(f"tensor {it.name!r}: staged changes of {it.values.dtype} for the "
                                   f"{w.itemsize}-byte elements of {it.live_name!r}")
            it.positions = np.ascontiguousarray(it.positions, np.int64)
            it.expected = np.ascontiguousarray(it.expected).view(w)
            it.values = np.ascontiguousarray(it.values).view(w)
        hs = [it.choice.hashes for it in items if it.choice.hashes is not None]
        self.hashes = np.concatenate(hs) if hs else np.empty(1, np.uint64)
        rows, costs = [], []
        hoff = 0
        for ti, it in enumerate(items):
            m = it.positions.shape[0]
            if it.choice.mode == kernels.MODE_SCATTER:
                for ja in range(0, m, TASK_ELEMS):
                    jb = min(m, ja + TASK_ELEMS)
                    rows.append((ti, kernels.MODE_SCATTER, ja, jb, 0, 0, 0))
                    costs.append((jb - ja) * _SCATTER_NS)
                continue
            nb = it.choice.hashes.shape[0]
            pos, mode = it.positions, it.choice.mode
            per_byte = _COPY_NS if mode == kernels.MODE_COPY else _SWAP_NS
            for ba in range(0, nb, TASK_BLOCKS):
                bb = min(nb, ba + TASK_BLOCKS)
                ja = int(np.searchsorted(pos, ba * self.block))
                jb = int(np.searchsorted(pos, bb * self.block))
                rows.append((ti, mode, ja, jb, ba, bb, hoff))
                costs.append((min(it.bits.shape[0], bb * self.block) - ba * self.block) * w.itemsize * per_byte)
            hoff += nb
        self.tasks = np.array(rows, np.int64).reshape(-1, 7)
        self.costs = np.array(costs, np.float64)

    def tables(self) -> tuple[int, list, np.ndarray, np.ndarray]:
        """This group as :class:`ckptdelta.delta.commit_ranges.Tables` takes it."""
        return (self.block, [(it.bits, it.choice.whole, it.positions, it.expected, it.values) for it in self.items],
                self.hashes, self.tasks)

    def refusal(self, t: int, kind: int, where: int) -> HotLoadError:
        it = self.items[int(self.tasks[t, 0])]
        if kind == 0:
            what = f"element {int(it.positions[where])}"
        else:
            s = where * self.block
            what = f"elements [{s}, {min(it.bits.shape[0], s + self.block)})"
        return HotLoadError(f"tensor {it.name!r}: {what} of the live tensor {it.live_name!r}, which this update "
                            "writes, were written after prepare(); prepare again")


_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


def _pool(workers: int) -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL._max_workers < workers:
            _POOL = ThreadPoolExecutor(workers, thread_name_prefix="ckptdelta-commit")
        return _POOL


def _claim_and_write(ctl: np.ndarray) -> None:
    """What each of the commit's own threads runs: claim ranges and write them (the GIL released)."""
    commit_ranges.commit_ranges(ctl)


class CommitBatch:
    """Every batched tensor of a prepared update, ready to be written by :meth:`run` in the pause.

    ``runner`` says who writes it: ``"team"``, torch's OpenMP team of the calling thread
    (delta/omp.py: awake right after torch work, where threads of our own must be woken
    first); ``"threads"``, the caller and a pool of our own; ``"caller"``, the calling
    thread alone (a small batch, or one thread). The threads claim the task ranges
    one at a time from a shared counter, whoever is free."""

    def __init__(self, items: list[Item], threads: int | None = None) -> None:
        by_width: dict[int, list[Item]] = {}
        for it in items:
            by_width.setdefault(it.bits.dtype.itemsize, []).append(it)
        self.groups = [_Group(g) for _w, g in sorted(by_width.items())]
        self.items = items
        total = sum(float(g.costs.sum()) for g in self.groups)
        threads = max(1, threads or os.cpu_count() or 1)
        self._team = omp.team() if threads > 1 else None
        self.threads = threads if total >= (THREADS_ABOVE_NS if self._team is None else TEAM_ABOVE_NS) else 1
        self.ranges = self._cut(self.threads * RANGES_PER_THREAD if self.threads > 1 else 1)
        self.tables = commit_ranges.Tables([g.tables() for g in self.groups], self.ranges)
        self.runner = "caller" if self.threads == 1 else ("team" if self._team is not None else "threads")
        if self.runner == "threads":   # start the pool's threads now, not in the pause
            pool = _pool(self.threads - 1)
            for f in [pool.submit(int) for _ in range(self.threads - 1)]:
                f.result()

    @property
    def tensors_copied(self) -> int:
        """Tensors written whole: copied from a staged copy, or swapped with their dense staged bits."""
        return sum(1 for it in self.items if it.choice.mode != kernels.MODE_SCATTER)

    def _cut(self, pieces: int) -> list[tuple[int, int, int]]:
        """The (group, t0, t1) task ranges the threads claim: each group's tasks cut by cost into ``pieces``."""
        ranges = []
        for gi, g in enumerate(self.groups):
            n = g.tasks.shape[0]
            if n == 0:
                continue
            cum = np.cumsum(g.costs)
            cuts = [0] + [int(np.searchsorted(cum, cum[-1] * i / pieces)) for i in range(1, pieces)] + [n]
            ranges += [(gi, a, b) for a, b in zip(cuts, cuts[1:]) if b > a]
        return ranges

    def run(self) -> None:
        """Write every tensor, or none: a refusal (HotLoadError naming the tensor), an error or an interrupt
        puts back everything written before it propagates."""
        tables = self.tables
        tables.reset()
        workers = max(1, min(self.threads, len(self.ranges)))
        futures: list[Future] = []
        first_error: BaseException | None = None
        try:
            if self.runner == "team" and workers > 1:
                self._team.run(commit_ranges.team_entry(), tables.ctl.ctypes.data, workers)
            else:
                if workers > 1:
                    pool = _pool(workers - 1)
                    futures = [pool.submit(_claim_and_write, tables.ctl) for _ in range(1, workers)]
                _claim_and_write(tables.ctl)
        except BaseException as e:   # noqa: BLE001 - the others must finish before anything is undone
            first_error = e
            tables.abort()
        for f in futures:
            while True:
                try:
                    wait([f])
                    break
                except BaseException as e:   # noqa: BLE001 - an interrupt while waiting: wait on
                    first_error = first_error or e
                    tables.abort()
            try:
                f.result()
            except BaseException as e:   # noqa: BLE001
                first_error = first_error or e
        refusal = None
        if first_error is None:
            for (gi, t0, _t1), (_who, done, kind, where) in zip(self.ranges, tables.results.tolist()):
                if kind in (0, 1):
                    refusal = self.groups[gi].refusal(t0 + done, kind, where)
                    break
            if refusal is None:
                return
        self._undo_claimed()
        raise first_error or refusal

    def _undo_claimed(self) -> None:
        results = self.tables.results
        for r in range(len(self.ranges) - 1, -1, -1):
            gi, t0, _t1 = self.ranges[r]
            if results[r, 0] != commit_ranges.UNCLAIMED:
                self.tables.undo(gi, t0, t0 + int(results[r, 1]))

    def undo(self) -> None:
        """Put back the old bits of a batch :meth:`run` wrote completely (a later step of the commit failed)."""
        for gi in range(len(self.groups) - 1, -1, -1):
            self.tables.undo(gi, 0, self.tables.n_tasks[gi])
