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
    """Number of positions where the bits differ. Without a branch, which LLVM vectorises: a LoRA step's
    lora_A matrices change about half their elements, where a branch on each is mispredicted often (the NaN
    variant below: 3.0-3.5 ms against 13.5-15.5 for a rank-64 bf16 step's 224 tensors, one thread)."""
    n = 0
    for i in range(old.shape[0]):
        n += old[i] != new[i]
    return n


@njit(cache=True, nogil=True)
def count_changed_nan(old, new, mask, threshold):
    """:func:`count_changed`, and whether a changed element's new bits are a NaN (``new & mask > threshold``),
    in the same pass: the fast path then needs no second look at the changes for the publisher's NaN check.
    Without a branch, as :func:`count_changed`."""
    n = 0
    nan = 0
    for i in range(old.shape[0]):
        c = old[i] != new[i]
        n += c
        nan |= c & ((new[i] & mask) > threshold)
    return n, nan != 0


#: Where a chunk has between these fractions of its elements changed, :func:`sparse_extract` writes every
#: element's gap and step and moves on only past a change, instead of branching on each element: the branch
#: is mispredicted there often enough to cost more than the writes (a LoRA step's A matrices at lr 1e-4, 40-70%
#: changed: 2.2x faster at half changed; below ~18% or above ~92% the branch wins).
BRANCHLESS_FROM = 0.18
BRANCHLESS_TO = 0.92


@njit(cache=True, nogil=True)
def sparse_extract(old, new, n_changed, width_bits, sign_magnitude):
    """Gaps between changed positions and the zigzag key step of each change.

    ``gaps[j] = pos[j] - pos[j-1] - 1`` (with ``pos[-1] = -1``); returns
    ``(gaps uint32, steps uint64, max_gap, max_step)`` so the caller can pick the
    number of byte planes to store. ``n_changed`` must be :func:`count_changed`'s count.
    """
    n = old.shape[0]
    if BRANCHLESS_FROM * n <= n_changed <= BRANCHLESS_TO * n and n < (1 << 32):
        return _sparse_extract_every(old, new, n_changed, width_bits, sign_magnitude)
    return _sparse_extract_changed(old, new, n_changed, width_bits, sign_magnitude)


@njit(cache=True, nogil=True)
def _sparse_extract_every(old, new, n_changed, width_bits, sign_magnitude):
    """:func:`sparse_extract` without a branch per element: each element's position and step are written at
    the next free index, which advances only past a change (one spare slot takes the writes after the last
    change); the gaps are taken from the positions in a second pass over the changes alone."""
    gaps = np.empty(n_changed + 1, dtype=np.uint32)
    steps = np.empty(n_changed + 1, dtype=np.uint64)
    mask = _U64(0xFFFFFFFFFFFFFFFF) >> _U64(64 - width_bits)
    signbit = _U64(1) << _U64(width_bits - 1)
    top = _U64(width_bits - 1)
    sm = _U64(1) if sign_magnitude else _U64(0)
    j = 0
    max_step = _U64(0)
    for i in range(old.shape[0]):
        o = _U64(old[i])
        v = _U64(new[i])
        # _key without a branch: a set sign bit flips every bit, a clear one sets it (sign-magnitude only)
        ko = o ^ ((signbit | ((_U64(0) - (o >> top)) & mask)) * sm)
        kv = v ^ ((signbit | ((_U64(0) - (v >> top)) & mask)) * sm)
        d = (kv - ko) & mask
        neg = d >> top                          # the zigzag of a modular difference, without a branch
        z = ((d ^ (mask * neg)) << _U64(1)) | neg
        gaps[j] = np.uint32(i)
        steps[j] = z                            # 0 where unchanged: the maximum needs no condition
        max_step = max(max_step, z)
        j += np.int64(o != v)
    prev = -1
    max_gap = 0
    for k in range(n_changed):
        p = np.int64(gaps[k])
        g = p - prev - 1
        gaps[k] = np.uint32(g)
        max_gap = max(max_gap, g)
        prev = p
    return gaps[:n_changed], steps[:n_changed], max_gap, max_step


@njit(cache=True, nogil=True)
def _sparse_extract_changed(old, new, n_changed, width_bits, sign_magnitude):
    """:func:`sparse_extract` branching on each element: the faster where few or nearly all changed."""
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
    ok = sparse_positions_into(gaps, n_elems, pos)
    return pos, ok


@njit(cache=True, nogil=True)
def sparse_positions_into(gaps, n_elems, pos):
    """:func:`sparse_positions` into ``pos`` (as long as ``gaps``): a staged tensor's slice."""
    p = -1
    for j in range(gaps.shape[0]):
        p = p + 1 + np.int64(gaps[j])
        pos[j] = p
    return gaps.shape[0] == 0 or (p < n_elems)


@njit(cache=True, nogil=True)
def nan_at_gaps(new, gaps, mask, threshold):
    """Whether an element at the positions ``gaps`` encode (as :func:`sparse_extract` writes them) holds
    a NaN: ``new[pos] & mask > threshold``. Visits only the changed elements."""
    p = -1
    for j in range(gaps.shape[0]):
        p = p + 1 + np.int64(gaps[j])
        if new[p] & mask > threshold:
            return True
    return False


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


#: The estimate below is taken per block of this many bytes: finer than zstd's Huffman blocks (up to 128 KiB),
#: so where statistics change along the planes (runs, a region left unchanged, a plane boundary) it errs low,
#: the safe side for deciding that a compression cannot win; large enough that a block's own statistics
#: barely bias it (on noise-like planes it came slightly below zstd's output).
ENTROPY_BLOCK = 1 << 14


@njit(cache=True, nogil=True)
def step_planes(old, new, width_bits, sign_magnitude):
    """Byte planes of every element's zigzag key step (0 where it did not change), as few planes as the
    largest step needs; returns (planes, number of planes). The steps go through a scratch array of the
    bits' own width first, so each plane is then written in one sequential sweep (writing all planes per
    element was four times slower)."""
    n = old.shape[0]
    steps = np.empty(n, dtype=old.dtype)
    mask = _U64(0xFFFFFFFFFFFFFFFF) >> _U64(64 - width_bits)
    signbit = _U64(1) << _U64(width_bits - 1)
    seen = _U64(0)
    for i in range(n):
        d = (_key(_U64(new[i]), signbit, mask, sign_magnitude)
             - _key(_U64(old[i]), signbit, mask, sign_magnitude)) & mask
        if d < signbit:
            z = d << _U64(1)
        else:
            z = ((mask - d) << _U64(1)) | _U64(1)
        seen |= z
        steps[i] = z
    nplanes = 1
    while nplanes < width_bits // 8 and (seen >> _U64(8 * nplanes)) != _U64(0):
        nplanes += 1
    return to_planes(steps, nplanes), nplanes


@njit(cache=True, nogil=True)
def step_apply_planes(old, planes, nplanes, width_bits, sign_magnitude, out_positions, out_values):
    """Decode dense step planes against ``old`` into the sparse form (positions, new bits). Returns the number
    of changed elements, written only where it is exactly what the output arrays hold; -1 where it is more (a
    corrupt payload: the caller compares the count with the chunk entry's).

    Written for a branch predictor that cannot guess which elements changed: the planes are gathered into
    steps one sequential sweep each, then every element up to the last change is written at the next free
    slot, which only a change advances (gathering every plane per element, then a branch per change, was
    over twice as slow)."""
    n = old.shape[0]
    cap = out_positions.shape[0]
    if planes.shape[0] < nplanes * n or out_values.shape[0] != cap or nplanes > width_bits // 8:
        return -1       # the callers check all three first; a kernel without bounds checks refuses them too
    mask = _U64(0xFFFFFFFFFFFFFFFF) >> _U64(64 - width_bits)
    signbit = _U64(1) << _U64(width_bits - 1)
    steps = np.empty(n, dtype=old.dtype)
    from_planes(planes, n, nplanes, steps)
    count = 0
    for i in range(n):
        count += steps[i] != 0
    if count != cap:
        return -1 if count > cap else count
    last = n - 1
    while last >= 0 and steps[last] == 0:
        last -= 1
    j = 0
    for i in range(last + 1):           # slot j < cap throughout: the changes before element i are fewer than cap
        z = _U64(steps[i])
        d = (mask - (z >> _U64(1))) if z & _U64(1) else (z >> _U64(1))
        k = (_key(_U64(old[i]), signbit, mask, sign_magnitude) + d) & mask
        out_positions[j] = i
        out_values[j] = _unkey(k, signbit, mask, sign_magnitude)
        j += z != _U64(0)
    return j


@njit(cache=True, nogil=True)
def step_apply_planes_dense(old, planes, nplanes, width_bits, sign_magnitude, out):
    """Decode dense step planes against ``old`` into every element's new bits, ``out`` (``old``'s length; it
    holds the gathered steps first, so no scratch is allocated). Returns the number of changed elements; -1
    where the planes are shorter than they say, ``out`` is not ``old``'s length or the planes are more than
    the width (the callers check all three first). An element whose step is zero keeps ``old``'s bits as they
    are, whatever they are (NaN payloads included)."""
    n = old.shape[0]
    if planes.shape[0] < nplanes * n or out.shape[0] != n or nplanes > width_bits // 8:
        return -1
    mask = _U64(0xFFFFFFFFFFFFFFFF) >> _U64(64 - width_bits)
    signbit = _U64(1) << _U64(width_bits - 1)
    from_planes(planes, n, nplanes, out)
    count = 0
    for i in range(n):
        z = _U64(out[i])
        d = (mask - (z >> _U64(1))) if z & _U64(1) else (z >> _U64(1))
        k = (_key(_U64(old[i]), signbit, mask, sign_magnitude) + d) & mask
        out[i] = _unkey(k, signbit, mask, sign_magnitude) if z != _U64(0) else old[i]
        count += z != _U64(0)
    return count


#: Bits of a class word (:func:`_classes`): the class (at most 2^12, F64's exponent field times two), and the mark
#: of an element whose step is coded negated (encoding 9: the step before went down).
_CLASS = np.uint16(0x7FFF)
_NEGATED = np.uint16(0x8000)


@njit(cache=True, nogil=True)
def _classes(old, grand, by_prev, exp_shift, exp_bits, width_bits, sign_magnitude):
    """(each element's class word, each lane's first slot per class in the grouped order): docs/FORMAT.md,
    encodings 8 and 9. The class is the parent's exponent field, times two plus whether the step before moved the
    element where ``by_prev``, which also marks (:data:`_NEGATED`) an element whose step before went down: the step
    before is taken once, here, for both. The grouped order is a stable counting sort of the chunk by class.
    Classes index arrays of 2^exp_bits (x2) entries, so none can land outside them. :func:`_lane_move` walks the
    lanes."""
    n = old.shape[0]
    mask = _U64(0xFFFFFFFFFFFFFFFF) >> _U64(64 - width_bits)
    signbit = _U64(1) << _U64(width_bits - 1)
    emask = (_U64(1) << _U64(exp_bits)) - _U64(1)
    cls = np.empty(n, dtype=np.uint16)
    if by_prev:
        for i in range(n):
            o = _U64(old[i])
            p = (_key(o, signbit, mask, sign_magnitude) - _key(_U64(grand[i]), signbit, mask, sign_magnitude)) & mask
            cls[i] = np.uint16((((o >> _U64(exp_shift)) & emask) << _U64(1)) | _U64(p != _U64(0))
                               | (_U64(_NEGATED) if p >= signbit else _U64(0)))
    else:
        for i in range(n):
            cls[i] = np.uint16((_U64(old[i]) >> _U64(exp_shift)) & emask)
    nclass = (1 << exp_bits) * (2 if by_prev else 1)
    # four lanes, the chunk's quarters (the last takes the remainder): each lane has a cursor per class, starting
    # where the lanes before it end in that class, so the order stays stable and four independent cursor chains
    # run side by side (one chain waits on its own last store wherever neighbours share a class, as most do)
    q = n // 4
    counts = np.zeros((4, nclass), dtype=np.int64)
    for i in range(q):                      # the lanes side by side, as _lane_move walks them
        counts[0, cls[i] & _CLASS] += 1
        counts[1, cls[q + i] & _CLASS] += 1
        counts[2, cls[2 * q + i] & _CLASS] += 1
        counts[3, cls[3 * q + i] & _CLASS] += 1
    for i in range(4 * q, n):
        counts[3, cls[i] & _CLASS] += 1
    starts = np.empty((4, nclass), dtype=np.int64)
    at = 0
    for c in range(nclass):
        for lane in range(4):
            starts[lane, c] = at
            at += counts[lane, c]
    return cls, starts


@njit(cache=True, nogil=True, inline="always")
def _lane_move(cls, at, src, dst, scatter):
    """Element order -> grouped order (``scatter``: ``dst[slot(i)] = src[i]``) or back (``dst[i] =
    src[slot(i)]``), a slot being the next of element i's lane's cursor for its class (``at``, from
    :func:`_classes`, advanced here)."""
    n = cls.shape[0]
    q = n // 4
    for i in range(q):
        i1 = q + i
        i2 = 2 * q + i
        i3 = 3 * q + i
        c0 = cls[i] & _CLASS
        c1 = cls[i1] & _CLASS
        c2 = cls[i2] & _CLASS
        c3 = cls[i3] & _CLASS
        j0 = at[0, c0]
        j1 = at[1, c1]
        j2 = at[2, c2]
        j3 = at[3, c3]
        at[0, c0] = j0 + 1
        at[1, c1] = j1 + 1
        at[2, c2] = j2 + 1
        at[3, c3] = j3 + 1
        if scatter:
            dst[j0] = src[i]
            dst[j1] = src[i1]
            dst[j2] = src[i2]
            dst[j3] = src[i3]
        else:
            dst[i] = src[j0]
            dst[i1] = src[j1]
            dst[i2] = src[j2]
            dst[i3] = src[j3]
    for i in range(4 * q, n):               # the last lane's remainder, after its quarter
        c = cls[i] & _CLASS
        j = at[3, c]
        at[3, c] = j + 1
        if scatter:
            dst[j] = src[i]
        else:
            dst[i] = src[j]


@njit(cache=True, nogil=True, inline="always")
def _negation(w, mask):
    """``mask`` where class word ``w`` marks a step coded negated, else 0: ``(d ^ it) + (it & 1)`` negates ``d``
    modulo the width, or leaves it, without a branch."""
    return mask if w & _NEGATED else _U64(0)


@njit(cache=True, nogil=True)
def grouped_step_planes(old, new, grand, by_prev, exp_shift, exp_bits, width_bits, sign_magnitude):
    """Byte planes of every element's zigzag key step (as :func:`step_planes`) in the grouped order: the
    chunk stably sorted by class, so each class's steps, which share a scale (an exponent fixes an ulp), sit
    together for zstd's per-block tables. ``by_prev`` (``grand`` the grandparent's bits; any array of the
    chunk's length otherwise): a step is coded negated where the step before went down, and the class also says
    whether that step moved the element (an optimizer's steps keep their direction). Returns (planes, number of
    planes). The steps are one vectorisable pass, then scattered to their class's next slot."""
    n = old.shape[0]
    mask = _U64(0xFFFFFFFFFFFFFFFF) >> _U64(64 - width_bits)
    signbit = _U64(1) << _U64(width_bits - 1)
    cls, at = _classes(old, grand, by_prev, exp_shift, exp_bits, width_bits, sign_magnitude)
    zs = np.empty(n, dtype=old.dtype)
    seen = _U64(0)
    for i in range(n):
        d = (_key(_U64(new[i]), signbit, mask, sign_magnitude) - _key(_U64(old[i]), signbit, mask, sign_magnitude)) \
            & mask
        fm = _negation(cls[i], mask)
        d = ((d ^ fm) + (fm & _U64(1))) & mask
        z = (d << _U64(1)) if d < signbit else (((mask - d) << _U64(1)) | _U64(1))
        seen |= z
        zs[i] = z
    steps = np.empty(n, dtype=old.dtype)
    _lane_move(cls, at, zs, steps, True)
    nplanes = 1
    while nplanes < width_bits // 8 and (seen >> _U64(8 * nplanes)) != _U64(0):
        nplanes += 1
    return to_planes(steps, nplanes), nplanes


@njit(cache=True, nogil=True)
def grouped_step_apply_dense(old, grand, by_prev, planes, nplanes, exp_shift, exp_bits, width_bits, sign_magnitude,
                             out):
    """Decode grouped step planes (:func:`grouped_step_planes`) against ``old`` into every element's new bits,
    ``out`` (``old``'s length; it may be ``old`` itself). An element whose step is zero keeps ``old``'s bits as
    they are, whatever they are (NaN payloads included). Returns the number of changed elements; -1 where the
    planes are shorter than they say, ``grand`` or ``out`` is not ``old``'s length or the planes are more than
    the width (the callers check these first). The steps are gathered back into element order first, then
    applied in one vectorisable pass."""
    n = old.shape[0]
    if planes.shape[0] < nplanes * n or out.shape[0] != n or grand.shape[0] != n or nplanes > width_bits // 8:
        return -1
    mask = _U64(0xFFFFFFFFFFFFFFFF) >> _U64(64 - width_bits)
    signbit = _U64(1) << _U64(width_bits - 1)
    cls, at = _classes(old, grand, by_prev, exp_shift, exp_bits, width_bits, sign_magnitude)
    steps = np.empty(n, dtype=old.dtype)
    from_planes(planes, n, nplanes, steps)
    zs = np.empty(n, dtype=old.dtype)
    _lane_move(cls, at, steps, zs, False)
    count = 0
    for i in range(n):
        o = _U64(old[i])
        z = _U64(zs[i])
        fm = _negation(cls[i], mask)
        d = (mask - (z >> _U64(1))) if z & _U64(1) else (z >> _U64(1))
        d = ((d ^ fm) + (fm & _U64(1))) & mask
        v = _unkey((_key(o, signbit, mask, sign_magnitude) + d) & mask, signbit, mask, sign_magnitude)
        out[i] = v if z != _U64(0) else o
        count += z != _U64(0)
    return count


@njit(cache=True, nogil=True)
def grouped_step_apply(old, grand, by_prev, planes, nplanes, exp_shift, exp_bits, width_bits, sign_magnitude,
                       out_positions, out_values):
    """:func:`grouped_step_apply_dense`, then the sparse form: positions and new bits of the changed elements,
    into arrays of exactly the chunk entry's count. Returns the number of changed elements, written only where it
    is exactly what the output arrays hold; -1 where it is more, or the inputs are refused as there."""
    n = old.shape[0]
    cap = out_positions.shape[0]
    if out_values.shape[0] != cap:
        return -1
    new = np.empty(n, dtype=old.dtype)
    count = grouped_step_apply_dense(old, grand, by_prev, planes, nplanes, exp_shift, exp_bits, width_bits,
                                     sign_magnitude, new)
    if count != cap:
        return -1 if count > cap else count
    j = 0
    for i in range(n):                  # slot j < cap while a change is left: the changes before i are fewer
        if j < cap:
            out_positions[j] = i
            out_values[j] = new[i]
        j += old[i] != new[i]
    return j


@njit(cache=True, nogil=True)
def planes_entropy_bytes(planes, plane_len, block, stride=1):
    """About the fewest bytes zstd could code these byte planes in (``plane_len`` bytes each): per block of
    at most ``block`` bytes inside a plane, the smaller of its order-0 entropy (what literal coding needs
    without repeats) and two bytes per run of equal bytes (what repeats of one byte cost at most).

    ``stride`` > 1 looks at every ``stride``-th block of each plane only (its first included) and scales
    what they hold up to the plane: a guess at ``stride`` times less work, for deciding at once where the
    answer is far from the line (frames.may_beat)."""
    n = planes.shape[0]
    # four histograms, one per byte of each group of four: runs of one byte (the usual in a high plane) then
    # increment four counters in turn instead of one counter that waits on its own last store (1.4-1.7x)
    hist = np.zeros((4, 256), np.int64)
    total = 0.0
    step = block * max(stride, 1)
    for p0 in range(0, n, max(plane_len, 1)):
        p1 = min(n, p0 + plane_len)
        seen = 0
        part = 0.0
        for start in range(p0, p1, step):
            end = min(p1, start + block)
            hist[:, :] = 0
            runs = 1
            prev = planes[start]
            hist[0, prev] += 1
            i = start + 1
            while i + 4 <= end:
                a, b, c, d = planes[i], planes[i + 1], planes[i + 2], planes[i + 3]
                hist[0, a] += 1
                hist[1, b] += 1
                hist[2, c] += 1
                hist[3, d] += 1
                runs += (a != prev) + (b != a) + (c != b) + (d != c)
                prev = d
                i += 4
            for i in range(i, end):
                hist[0, planes[i]] += 1
                runs += planes[i] != planes[i - 1]
            m = end - start
            bits = 0.0
            for v in range(256):
                h = hist[0, v] + hist[1, v] + hist[2, v] + hist[3, v]
                if h:
                    bits -= h * np.log2(h / m)
            part += min(bits / 8.0, 2.0 * runs)
            seen += m
        total += part if seen == p1 - p0 else part * (p1 - p0) / seen
    return total


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


# --- the hot-swap commit: every changed tensor of one element width in one call ----------------------
#
# A commit writes each changed tensor in one of three ways (loader/hotswap.py picks the cheaper per tensor):
# MODE_SCATTER writes the changed elements only, each old bit compared with prepare's as it is overwritten
# (as scatter_if_unchanged); MODE_COPY copies a whole staged copy of the new tensor over the live one,
# block by block, each block's live bytes hashed and compared with the hash prepare took of them before
# the block is written (the hash of a block runs while the block before it is written); MODE_SWAP, for a
# tensor staged densely (all its new bits, no positions), exchanges the live bits with the staged ones
# block by block, checked as a copy is, so that afterwards the staged array holds the old bits: its undo.
# A task is one row of ``tasks``: (tensor, mode, ja, jb, ba, bb, hoff): the changed elements
# ``positions[ja:jb]`` (tensor-local) with their old bits ``expected[ja:jb]`` and new bits ``values[ja:jb]``;
# for a copy or a swap also the blocks [ba, bb) of ``block_elems`` elements and the index ``hoff`` of block
# 0's hash in ``hashes``. The changed elements of a copy task are the ones inside its blocks, so undoing a
# scatter or copy task, finished or not, is writing ``expected`` back at its positions; a swap task (no
# positions) is undone by swapping its blocks back, so only a task that was written may be undone.

MODE_SCATTER = 0
MODE_COPY = 1
MODE_SWAP = 2
HASH_BLOCK_BYTES = 1 << 16   # a copy's check-and-write unit: the hash reads it into cache, the copy writes it

_H1 = _U64(0x9E3779B185EBCA87)
_H3 = _U64(0x165667B19E3779F9)


@njit(cache=True, nogil=True, inline="always")
def _hround(acc, x):
    acc = (acc ^ x) * _H1
    return acc ^ (acc >> _U64(29))   # carries the high bits down: two sign flips in a lane cannot cancel


@njit(cache=True, nogil=True)
def block_hash(b8):
    """A 64-bit hash of the bytes ``b8``: eight lanes over its 64-bit words (xor, multiply, xorshift), then
    the leftover words and bytes.

    Each lane's update is a bijection of its state and of its input word, so changing any one word (any
    element, whatever its width) always changes the hash; a change of several collides with probability
    about 2**-64. Not the xxh3 of the format: a check between prepare and commit in one process, at the
    speed of memory (the lanes are independent: eight multiplies in flight)."""
    none = np.empty(0, np.uint64)
    return hash_while_copying(b8, none, none)


@njit(cache=True, nogil=True)
def hash_while_copying(b8, dst, src, swap=False):
    """:func:`block_hash` of ``b8`` while copying the 64-bit words ``src`` over ``dst`` (same length, a
    multiple of 8, or both empty), or with ``swap`` exchanging them: the commit hashes the next block as it
    writes this one.

    The hash is bound by multiplies and the copy by memory, so interleaved they cost little more than the
    copy alone; one after the other (hash a block, then write it) they take clearly longer."""
    n = b8.shape[0]
    nw = n >> 3
    w = b8[:nw << 3].view(np.uint64)
    m = dst.shape[0]
    a0, a1, a2, a3 = _U64(1), _U64(2), _U64(3), _U64(4)
    a4, a5, a6, a7 = _U64(5), _U64(6), _U64(7), _U64(8)
    for i in range(nw >> 3):
        k = i << 3
        a0 = _hround(a0, w[k])
        a1 = _hround(a1, w[k + 1])
        a2 = _hround(a2, w[k + 2])
        a3 = _hround(a3, w[k + 3])
        a4 = _hround(a4, w[k + 4])
        a5 = _hround(a5, w[k + 5])
        a6 = _hround(a6, w[k + 6])
        a7 = _hround(a7, w[k + 7])
        if k < m:
            if swap:
                for q in range(8):
                    x = dst[k + q]
                    dst[k + q] = src[k + q]
                    src[k + q] = x
            else:
                for q in range(8):
                    dst[k + q] = src[k + q]
    for k in range((nw >> 3) << 3, m):
        x = dst[k]
        dst[k] = src[k]
        if swap:
            src[k] = x
    h = _U64(n) * _H3
    for k in range((nw >> 3) << 3, nw):
        h = _hround(h, w[k])
    tail = _U64(0)
    for k in range(nw << 3, n):
        tail |= _U64(b8[k]) << _U64(8 * (k - (nw << 3)))
    h = _hround(h, tail)
    return h ^ a0 ^ a1 ^ a2 ^ a3 ^ a4 ^ a5 ^ a6 ^ a7


@njit(cache=True, nogil=True)
def block_hashes(bits, block_elems, out):
    """``out[b]`` = :func:`block_hash` of elements ``[b * block_elems, (b + 1) * block_elems)`` of ``bits``."""
    n = bits.shape[0]
    for b in range(out.shape[0]):
        s = b * block_elems
        out[b] = block_hash(bits[s:min(n, s + block_elems)].view(np.uint8))


@njit(cache=True, nogil=True)
def count_lines(positions, shift):
    """Number of distinct ``positions >> shift`` in sorted ``positions``: the cache lines a scatter touches."""
    n = 0
    last = -1
    for j in range(positions.shape[0]):
        line = positions[j] >> shift
        if line != last:
            n += 1
            last = line
    return n


@njit(cache=True, nogil=True)
def _undo_range(live, positions, expected, ja, jb):
    pj, ej = positions[ja:jb], expected[ja:jb]
    for j in range(pj.shape[0] - 1, -1, -1):
        live[pj[j]] = ej[j]


@njit(cache=True, nogil=True)
def commit_task(live, whole, positions, expected, values, hashes, task, block_elems):
    """Write one task of the pause's batch into ``live`` (a tensor's live bits; ``whole``: its staged new bits
    when copied or swapped, anything when scattered). ``positions``, ``expected`` and ``values`` are the
    tensor's staged changes. ``task`` is a row ``(ti, mode, ja, jb, ba, bb, hoff)``: a scatter writes changes ``[ja, jb)``; a
    copy writes blocks ``[ba, bb)``, whose changes are ``[ja, jb)``, checked against ``hashes[hoff + b]``; a
    swap exchanges blocks ``[ba, bb)`` with ``whole``'s, checked the same way. Returns ``(kind, where)``:
    ``(-1, -1)`` written; otherwise nothing of the task is left written (what was has been put back) and
    ``kind`` 0 = element ``positions[where]`` no longer held ``expected[where]``, 1 = block ``where`` no
    longer hashed to ``hashes[hoff + where]``: a write after prepare()."""
    mode, ja, jb = task[1], task[2], task[3]
    if mode == MODE_SCATTER:
        # slices indexed from 0: numba then knows every index is >= 0 and drops its wraparound checks
        pj, ej, vj = positions[ja:jb], expected[ja:jb], values[ja:jb]
        for j in range(pj.shape[0]):
            p = pj[j]
            if live[p] != ej[j]:
                _undo_range(live, pj, ej, 0, j)
                return 0, ja + j
            live[p] = vj[j]
        return -1, -1
    if mode == MODE_SWAP:
        return _whole_blocks(live, whole, positions, expected, hashes, task, block_elems, True)
    return _whole_blocks(live, whole, positions, expected, hashes, task, block_elems, False)


@njit(cache=True, nogil=True)
def _whole_blocks(live, whole, positions, expected, hashes, task, block_elems, swap):
    """:func:`commit_task` of a copy, or with ``swap`` of a swap: blocks ``[ba, bb)`` written whole, each live
    block hashed (while the block before it is written) and compared with prepare's hash first; a difference
    puts back the blocks before it."""
    ja, jb = task[2], task[3]
    n = live.shape[0]
    hoff, ba, bb = task[6], task[4], task[5]
    # each block is hashed while the one before it is written (hash_while_copying), the first alone
    h = block_hash(live[ba * block_elems:min(n, (ba + 1) * block_elems)].view(np.uint8))
    for b in range(ba, bb):
        s = b * block_elems
        e = min(n, s + block_elems)
        if h != hashes[hoff + b]:
            # blocks before b hold the new bits: swap them back, or put back the old bits of their changes
            if swap:
                _swap_range(live, whole, ba * block_elems, s)
            else:
                _undo_range(live, positions, expected, ja, ja + np.searchsorted(positions[ja:jb], s))
            return 1, b
        if b + 1 < bb:   # a next block: this one is whole (64 KiB, a multiple of 8 bytes)
            h = hash_while_copying(live[e:min(n, e + block_elems)].view(np.uint8),
                                   live[s:e].view(np.uint64), whole[s:e].view(np.uint64), swap)
        elif swap:
            _swap_range(live, whole, s, e)
        else:
            lv, wv = live[s:e], whole[s:e]
            for i in range(lv.shape[0]):
                lv[i] = wv[i]
    return -1, -1


@njit(cache=True, nogil=True)
def _swap_range(live, whole, s, e):
    lv, wv = live[s:e], whole[s:e]
    for i in range(lv.shape[0]):
        x = lv[i]
        lv[i] = wv[i]
        wv[i] = x


@njit(cache=True, nogil=True)
def undo_task(live, whole, positions, expected, task, block_elems):
    """Put back the old bits of a task :func:`commit_task` wrote whole (its changed elements, last first; a
    swap's blocks swapped back)."""
    if task[1] == MODE_SWAP:
        _swap_range(live, whole, task[4] * block_elems, min(live.shape[0], task[5] * block_elems))
    else:
        _undo_range(live, positions, expected, task[2], task[3])
