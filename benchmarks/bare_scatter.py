"""A plain scatter on torch's OpenMP team: the update-latency benchmark's floor under the pause.

The commit runs on torch's team where it can (delta/omp.py); a floor measured on
Python threads would carry their wake-up, which the commit no longer pays. The
team's threads take one part each of every tensor's changes (``parts[i]``, cut
as for the Python-thread floor) and write them with no check and no undo.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import carray, cfunc, njit, types

from ckptdelta.delta import kernels
from ckptdelta.delta.omp import fetch_add, int64s_at, voidptr_at

_HEAD = 3    # arrivals, the table's own address, number of rows
_COLS = 7    # part, element width, live bits, their length, positions, values, changes


@njit(cache=True, nogil=True)
def _scatter(r, dt):
    kernels.scatter(carray(voidptr_at(r[2]), r[3], dt), int64s_at(r[4], r[6]), carray(voidptr_at(r[5]), r[6], dt))


@cfunc(types.void(types.voidptr), cache=True)
def _entry(data):
    head = carray(data, _HEAD, np.int64)
    me = fetch_add(head[1], 1)     # head[1] is the address of head[0]: the threads number themselves
    rows = int64s_at(head[1] + 8 * _HEAD, (head[2], _COLS))
    for i in range(rows.shape[0]):
        r = rows[i]
        if r[0] != me:
            continue
        if r[1] == 1:
            _scatter(r, np.uint8)
        elif r[1] == 2:
            _scatter(r, np.uint16)
        elif r[1] == 4:
            _scatter(r, np.uint32)
        else:
            _scatter(r, np.uint64)


def team_entry() -> int:
    return _entry.address


def table(parts: list[list[tuple[Any, Any, Any]]]) -> tuple[np.ndarray, list]:
    """The table :func:`team_entry` reads, for ``parts[i]`` = thread i's ``(live bits, positions, values)``;
    and the arrays it points into, to keep alive while it is used. Zero its first entry before each run."""
    keep, rows = [], []
    for i, part in enumerate(parts):
        for bits, pos, vals in part:
            pos, vals = np.ascontiguousarray(pos, np.int64), np.ascontiguousarray(vals)
            keep += [bits, pos, vals]
            rows.append((i, bits.dtype.itemsize, bits.ctypes.data, bits.shape[0], pos.ctypes.data,
                         vals.ctypes.data, pos.shape[0]))
    tab = np.zeros(_HEAD + _COLS * len(rows), np.int64)
    tab[1], tab[2] = tab.ctypes.data, len(rows)
    tab[_HEAD:] = np.array(rows, np.int64).reshape(-1)
    return tab, keep
