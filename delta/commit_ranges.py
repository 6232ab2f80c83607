"""The pause's batch kernel: task ranges of :func:`ckptdelta.delta.kernels.commit_task`, claimed by whichever thread is free.

One entry serves both ways of running the batch (loader/batch_commit.py): torch's
OpenMP team calls :func:`team_entry` (a cfunc, one ``void *`` argument), or each
of a few Python threads calls :func:`commit_ranges` (nogil). So that a cfunc can
take it, the batch is described by int64 tables of array addresses, built and
kept alive by the caller:

``ctl`` (``CTL_LEN`` int64): ``n_ranges, ranges, results, claims, abort, groups,
arrivals, n_groups`` (the second to seventh are addresses);

- ``ranges`` ``(n_ranges, 3)``: ``group, t0, t1``, tasks ``[t0, t1)`` of a group;
- ``results`` ``(n_ranges, 4)``: per range ``thread, done, kind, where`` (thread -1:
  never claimed; otherwise tasks ``[t0, t0 + done)`` are written, and ``kind``,
  ``where`` are those of :func:`ckptdelta.delta.kernels.commit_task` for the task that was
  not, or 2 when it stopped because another range was refused);
- ``claims``, ``arrivals``: int64 counters, zero at the start (the next range to
  claim; the threads that came);
- ``abort``: int64, set by a refusal, read before each task;
- ``groups`` ``(n_groups, GROUP_COLS)``: per element width ``width, block_elems,
  items, n_items, hashes, n_hashes, tasks, n_tasks`` (``items``, ``hashes`` and
  ``tasks`` are addresses: the group's item table, its uint64 block hashes, its
  ``(n_tasks, 7)`` tasks as :func:`ckptdelta.delta.kernels.commit_task` reads them);
- ``items`` ``(n_items, ITEM_COLS)``: per tensor ``live, n, whole, positions,
  expected, values, m``: its live bits (``n`` elements of ``width`` bytes), its
  staged whole new bits (0 when scattered) and its ``m`` staged changes (int64
  positions, old and new bits; a swapped tensor has its staged new bits as
  ``whole`` and no changes).
"""

from __future__ import annotations

import numpy as np
from numba import carray, njit

from ckptdelta.delta import kernels
from ckptdelta.delta.omp import fetch_add, int64s_at, voidptr_at

CTL_LEN = 8
GROUP_COLS = 8
ITEM_COLS = 7
UNCLAIMED = -1


@njit(cache=True, nogil=True)
def _tensor(it, dt):
    n, m = it[1], it[6]
    live = carray(voidptr_at(it[0]), n, dt)
    whole = carray(voidptr_at(it[2]), n if it[2] != 0 else 0, dt)
    return (live, whole, carray(voidptr_at(it[3]), m, np.int64), carray(voidptr_at(it[4]), m, dt),
            carray(voidptr_at(it[5]), m, dt))


@njit(cache=True, nogil=True)
def _run_range(g, t0, t1, abort, dt):
    items = int64s_at(g[2], (g[3], ITEM_COLS))
    hashes = carray(voidptr_at(g[4]), g[5], np.uint64)
    tasks = int64s_at(g[6], (g[7], 7))
    for t in range(t0, t1):
        if abort[0] != 0:
            return t - t0, 2, -1
        live, whole, pos, exp, val = _tensor(items[tasks[t, 0]], dt)
        kind, where = kernels.commit_task(live, whole, pos, exp, val, hashes, tasks[t], g[1])
        if kind >= 0:
            abort[0] = 1
            return t - t0, kind, where
    return t1 - t0, -1, -1


@njit(cache=True, nogil=True)
def _undo_range(g, t0, t1, dt):
    items = int64s_at(g[2], (g[3], ITEM_COLS))
    tasks = int64s_at(g[6], (g[7], 7))
    for t in range(t1 - 1, t0 - 1, -1):
        live, whole, pos, exp, _val = _tensor(items[tasks[t, 0]], dt)
        kernels.undo_task(live, whole, pos, exp, tasks[t], g[1])


@njit(cache=True, nogil=True)
def commit_ranges(ctl):
    """Claim ranges and write them until none is left or one is refused (then the others stop at their next
    task). Safe to call from any number of threads at once, none holding the GIL."""
    n = ctl[0]
    ranges = int64s_at(ctl[1], (n, 3))
    results = int64s_at(ctl[2], (n, 4))
    abort = int64s_at(ctl[4], 1)
    groups = int64s_at(ctl[5], (ctl[7], GROUP_COLS))
    me = fetch_add(ctl[6], 1)
    while True:
        r = fetch_add(ctl[3], 1)
        if r >= n:
            return
        g = groups[ranges[r, 0]]
        t0, t1 = ranges[r, 1], ranges[r, 2]
        w = g[0]
        if w == 1:
            done, kind, where = _run_range(g, t0, t1, abort, np.uint8)
        elif w == 2:
            done, kind, where = _run_range(g, t0, t1, abort, np.uint16)
        elif w == 4:
            done, kind, where = _run_range(g, t0, t1, abort, np.uint32)
        else:
            done, kind, where = _run_range(g, t0, t1, abort, np.uint64)
        results[r, 0], results[r, 1], results[r, 2], results[r, 3] = me, done, kind, where
        if kind >= 0:
            return


@njit(cache=True, nogil=True)
def undo_ranges(ctl, group, t0, t1):
    """Put back the old bits of tasks ``[t0, t1)`` of ``group``, written by :func:`commit_ranges` (each of
    them written whole: a swap task undone twice would swap its new bits back in)."""
    g = int64s_at(ctl[5], (ctl[7], GROUP_COLS))[group]
    w = g[0]
    if w == 1:
        _undo_range(g, t0, t1, np.uint8)
    elif w == 2:
        _undo_range(g, t0, t1, np.uint16)
    elif w == 4:
        _undo_range(g, t0, t1, np.uint32)
    else:
        _undo_range(g, t0, t1, np.uint64)


def team_entry() -> int:
    """The address of the cfunc an OpenMP team runs, given the ``ctl`` table's address (delta/commit_team.py:
    loaded from numba's cache, or compiled, on first use, not on import)."""
    from ckptdelta.delta.commit_team import entry

    return entry.address


#: One tensor of a group: live bits, staged whole new bits (None: scattered), positions, old bits, new bits.
Tensor = tuple[np.ndarray, "np.ndarray | None", np.ndarray, np.ndarray, np.ndarray]


class Tables:
    """The tables of one batch (the module's layout) and every array they point into, kept alive with them.

    ``groups``: per element width ``(block_elems, tensors, hashes, tasks)``; ``ranges``: ``(group, t0, t1)``.
    Every array must be contiguous, and the tensors' arrays of one group of one element width (positions
    int64, hashes uint64, tasks int64)."""

    def __init__(self, groups: list[tuple[int, list[Tensor], np.ndarray, np.ndarray]],
                 ranges: list[tuple[int, int, int]]) -> None:
        self._keep: list[np.ndarray] = []
        rows = []
        for block, tensors, hashes, tasks in groups:
            width = tensors[0][0].dtype.itemsize
            table = np.zeros((len(tensors), ITEM_COLS), np.int64)
            for i, (live, whole, pos, exp, val) in enumerate(tensors):
                arrays = [a for a in (live, whole, pos, exp, val) if a is not None]
                bits = [a for a in arrays if a is not pos]
                if any(not a.flags.c_contiguous or a.ndim != 1 for a in arrays) or pos.dtype != np.int64 or \
                        any(a.dtype.itemsize != width for a in bits):
                    raise ValueError(f"tensor {i} of the {width}-byte group: arrays not as the kernel reads them")
                table[i] = (live.ctypes.data, live.shape[0], 0 if whole is None else whole.ctypes.data,
                            pos.ctypes.data, exp.ctypes.data, val.ctypes.data, pos.shape[0])
                self._keep += arrays
            hashes = np.ascontiguousarray(hashes, np.uint64)
            tasks = np.ascontiguousarray(tasks, np.int64).reshape(-1, 7)
            self._keep += [table, hashes, tasks]
            rows.append((width, block, table.ctypes.data, table.shape[0], hashes.ctypes.data, hashes.shape[0],
                         tasks.ctypes.data, tasks.shape[0]))
        self.n_tasks = [int(r[7]) for r in rows]
        self._groups = np.array(rows, np.int64).reshape(-1, GROUP_COLS)
        self._ranges = np.array(ranges, np.int64).reshape(-1, 3)
        self.results = np.full((len(ranges), 4), UNCLAIMED, np.int64)
        self._counters = np.zeros(3, np.int64)     # claims, abort, arrivals
        c = self._counters.ctypes.data
        self.ctl = np.array([len(ranges), self._ranges.ctypes.data, self.results.ctypes.data, c, c + 8,
                             self._groups.ctypes.data, c + 16, len(rows)], np.int64)

    def reset(self) -> None:
        """Before each run: every range unclaimed (no outcome left from a run before), the counters and the
        abort flag zero."""
        self.results[:] = UNCLAIMED
        self._counters[:] = 0

    def abort(self) -> None:
        """Stop every thread at its next task."""
        self._counters[1] = 1

    @property
    def aborted(self) -> bool:
        """Set by :meth:`abort` or by a refusal."""
        return bool(self._counters[1])

    def undo(self, group: int, t0: int, t1: int) -> None:
        """Put back tasks ``[t0, t1)`` of ``group``."""
        if t1 > t0:
            undo_ranges(self.ctl, group, t0, t1)
