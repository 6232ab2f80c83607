"""Numba helpers shared by the ctx encoder and decoder (chunk encoding 4, docs/FORMAT.md).

Constants of the format, the Golomb parameter grid, the ordered-key map, and the
per-class code tables. Kept apart so delta/ctx_encoder.py and delta/ctx_decoder.py
cannot disagree on any of them.
"""

from __future__ import annotations

import numpy as np
from numba import njit

MAX_J = 95          # largest Golomb parameter index; m(95) = 7 * 2**21
HEADER_MIN = 4      # u16 lo, u16 hi

U64 = np.uint64
NONE, ALL, GOLOMB = 0, 1, 2     # models of a flag sequence (docs/FORMAT.md "model byte")


@njit(cache=True, nogil=True, inline="always")
def m_of(j):
    return ((4 + (j & 3)) << (j >> 2)) >> 2


@njit(cache=True, nogil=True, inline="always")
def ceil_log2(m):
    b = 0
    while (1 << b) < m:
        b += 1
    return b


@njit(cache=True, nogil=True, inline="always")
def key(b, signbit, mask):
    """Ordered key of sign-magnitude bits (docs/FORMAT.md): ``~b & mask`` when the sign bit is
    set, else ``b | signbit``. Branch-free: the sign of a weight is a coin toss."""
    return b ^ signbit ^ ((mask >> U64(1)) * U64((b & signbit) != U64(0)))


@njit(cache=True, nogil=True, inline="always")
def unkey(k, signbit, mask):
    """Inverse of :func:`key`: ``k ^ signbit`` when the key has the sign bit, else ``~k & mask``."""
    return k ^ mask ^ ((mask >> U64(1)) * U64((k & signbit) != U64(0)))


@njit(cache=True, nogil=True)
def class_params(j):
    """(m, b, cut, 1/m) arrays of the Golomb code of each class's parameter index."""
    C = j.shape[0]
    m = np.empty(C, np.int64)
    b = np.empty(C, np.int64)
    cut = np.empty(C, np.int64)
    rinv = np.empty(C, np.float64)
    for c in range(C):
        m[c] = m_of(j[c])
        b[c] = ceil_log2(m[c])
        cut[c] = (1 << b[c]) - m[c]
        rinv[c] = 1.0 / m[c]
    return m, b, cut, rinv
