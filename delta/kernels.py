"""Numba kernels for the codec's hot loops.

Each kernel is a small pure function over contiguous numpy arrays of unsigned
integers (the raw bits of a tensor, see delta/dtypes.py); no torch, no Python
objects, no allocation sized by anything but its inputs. Every kernel has a
plain-numpy reference in tests/naive.py and is tested against it.

Arithmetic is done in uint64 and masked to the element width ``w`` so one
compiled kernel serves every width. Float bits are sign-magnitude; ``key``
maps them to an order-preserving unsigned integer so that one ulp up is +1
(and -0.0/+0.0 are neighbours). The change of an element is the modular
difference of keys, zigzag-coded: small moves in either direction become small
unsigned numbers, and the map is a bijection for every bit pattern, NaN
payloads included, so decoding is exact by construction.
"""

from __future__ import annotations

import numpy as np
from numba import njit

_U64 = np.uint64


@njit(cache=True, nogil=True, inline="always")
def _key(b, signbit, mask, sign_magnitude):
    if not sign_magnitude:
        return b
    if b & signbit:
        return (~b) & mask
    return b | signbit


@njit(cache=True, nogil=True, inline="always")
def _unkey(k, signbit, mask, sign_magnitude):
    if not sign_magnitude:
        return k
    if k & signbit:
        return k ^ signbit
    return (~k) & mask


@njit(cache=True, nogil=True)
def count_changed(old, new):
    """Number of positions where the bits differ."""
    n = 0
    for i in range(old.shape[0]):
        if old[i] != new[i]:
            n += 1
    return n


@njit(cache=True, nogil=True)
def sparse_extract(old, new, n_changed, width_bits, sign_magnitude):
    """Gaps between changed positions and the zigzag key step of each change.

    ``gaps[j] = pos[j] - pos[j-1] - 1`` (with ``pos[-1] = -1``); returns
    ``(gaps uint32, steps uint64, max_gap, max_step)`` so the caller can pick the
    number of byte planes to store.
    """
    gaps = np.empty(n_changed, dtype=np.uint32)
    steps = np.empty(n_changed, dtype=np.uint64)
    mask = _U64(0xFFFFFFFFFFFFFFFF) >> _U64(64 - width_bits)
    signbit = _U64(1) << _U64(width_bits - 1)
    j = 0
    prev = -1
    max_gap = 0
    max_step = _U64(0)
    for i in range(old.shape[0]):
        o = _U64(old[i])
        v = _U64(new[i])
        if o != v:
            g = i - prev - 1
            gaps[j] = g
            if g > max_gap:
                max_gap = g
            d = (_key(v, signbit, mask, sign_magnitude) - _key(o, signbit, mask, sign_magnitude)) & mask
            if d < signbit:
                z = d << _U64(1)
            else:
                z = ((mask - d) << _U64(1)) | _U64(1)
            steps[j] = z
            if z > max_step:
                max_step = z
            prev = i
            j += 1
    return gaps, steps, max_gap, max_step


@njit(cache=True, nogil=True)
def sparse_positions(gaps, n_elems):
    """Absolute positions from gaps; returns (positions int64, ok) where ok is False if any
    position falls outside ``[0, n_elems)`` (a corrupt payload)."""
    pos = np.empty(gaps.shape[0], dtype=np.int64)
    p = -1
    for j in range(gaps.shape[0]):
        p = p + 1 + np.int64(gaps[j])
        pos[j] = p
    ok = gaps.shape[0] == 0 or (p < n_elems)
    return pos, ok


@njit(cache=True, nogil=True)
def sparse_new_values(old, positions, steps, width_bits, sign_magnitude, out):
    """New bits at ``positions`` given the old bits and the zigzag key steps (written to ``out``)."""
    mask = _U64(0xFFFFFFFFFFFFFFFF) >> _U64(64 - width_bits)
    signbit = _U64(1) << _U64(width_bits - 1)
    for j in range(positions.shape[0]):
        z = _U64(steps[j])
        if z & _U64(1):
            d = mask - (z >> _U64(1))
        else:
            d = z >> _U64(1)
        k = (_key(_U64(old[positions[j]]), signbit, mask, sign_magnitude) + d) & mask
        out[j] = _unkey(k, signbit, mask, sign_magnitude)


@njit(cache=True, nogil=True)
def scatter(live, positions, values):
    """``live[positions] = values`` — the whole of an in-place apply on host memory."""
    for j in range(positions.shape[0]):
        live[positions[j]] = values[j]


@njit(cache=True, nogil=True)
def scatter_if_unchanged(live, positions, expected, values):
    """``live[positions] = values`` provided ``live[positions]`` still equals ``expected``; returns -1.

    At the first position that does not, the positions already written get their
    ``expected`` bits back (so ``live`` is as it was) and its index is returned.
    One pass: each compare reads the cache line the write needs anyway, so the
    check costs about nothing beside the scatter (a gather first would double it)."""
    for j in range(positions.shape[0]):
        p = positions[j]
        if live[p] != expected[j]:
            for k in range(j - 1, -1, -1):
                live[positions[k]] = expected[k]
            return j
        live[p] = values[j]
    return -1


@njit(cache=True, nogil=True)
def to_planes(values, nplanes):
    """Split unsigned integers into ``nplanes`` little-endian byte planes, plane-major.

    Bytes of equal significance end up adjacent, which is what lets zstd find the
    structure (high planes of small steps are all zero)."""
    n = values.shape[0]
    out = np.empty(n * nplanes, dtype=np.uint8)
    for p in range(nplanes):
        shift = _U64(8 * p)
        base = p * n
        for i in range(n):
            out[base + i] = np.uint8((_U64(values[i]) >> shift) & _U64(0xFF))
    return out


@njit(cache=True, nogil=True)
def from_planes(planes, n, nplanes, out):
    """Inverse of :func:`to_planes`, writing into ``out`` (any unsigned dtype, length n)."""
    for i in range(n):
        out[i] = 0
    for p in range(nplanes):
        shift = _U64(8 * p)
        base = p * n
        for i in range(n):
            out[i] = out[i] | (_U64(planes[base + i]) << shift)


@njit(cache=True, nogil=True)
def xor_planes(old, new, nplanes):
    """Byte planes of ``old ^ new`` (the dense encoding), without materialising the XOR."""
    n = old.shape[0]
    out = np.empty(n * nplanes, dtype=np.uint8)
    for p in range(nplanes):
        shift = _U64(8 * p)
        base = p * n
        for i in range(n):
            out[base + i] = np.uint8(((_U64(old[i]) ^ _U64(new[i])) >> shift) & _U64(0xFF))
    return out


@njit(cache=True, nogil=True)
def xor_apply_planes(old, planes, nplanes, out_positions, out_values):
    """Decode dense XOR planes against ``old`` into the sparse form (positions, new bits).

    Returns the number of changed elements written. Keeping the dense encoding's
    output sparse lets every encoding share one apply path."""
    n = old.shape[0]
    j = 0
    for i in range(n):
        x = _U64(0)
        for p in range(nplanes):
            x |= _U64(planes[p * n + i]) << _U64(8 * p)
        if x != _U64(0):
            out_positions[j] = i
            out_values[j] = _U64(old[i]) ^ x
            j += 1
    return j


@njit(cache=True, nogil=True)
def diff_positions(old, new, out_positions, out_values):
    """Positions and new bits where ``new`` differs from ``old``; returns the count."""
    j = 0
    for i in range(old.shape[0]):
        if old[i] != new[i]:
            out_positions[j] = i
            out_values[j] = new[i]
            j += 1
    return j


@njit(cache=True, nogil=True)
def gather(src, positions, out):
    """``out[j] = src[positions[j]]`` — saves what an in-place apply overwrites, for undo."""
    for j in range(positions.shape[0]):
        out[j] = src[positions[j]]
