"""The ctx decoder (chunk encoding 4): numba kernels from a payload and the parent's bits to
the changed positions and their new bits.

Every length, count and value taken from the payload is checked before it is used
as an index or a bound (numba checks none): streams are read from copies padded
with zeros, the read position is checked against the stream's end once per element
or change, unary runs are bounded, and the end state (counters at zero, streams
consumed exactly) is verified. Errors are small integer codes; delta/ctxcoder.py
turns them into FormatError messages.
"""

from __future__ import annotations

import numpy as np
from numba import njit
from numba.core import config

from ckptdelta.delta.ctx_bits import ALL, GOLOMB, HEADER_MIN, MAX_J, NONE, U64, class_params, key, unkey

if config.DISABLE_JIT:  # the kernels run as plain Python (coverage runs): no LLVM intrinsic
    def leading_zeros(x):
        return 64 - int(x).bit_length()
else:
    from numba.cpython.unsafe.numbers import leading_zeros

_BIG = 1 << 62          # a countdown that never runs out inside a chunk (<= 2**24 elements)
_SPECIAL = -(1 << 62)   # countdowns of classes coded by their unchanged elements sit here
_BIG_SPECIAL = 1 << 40


_PAD_WORDS = 8   # zero words after a copied stream: with the bit position checked against the
                 # stream's end + 64 once per element or change, and at most five codes of
                 # <= 64 bits read between checks (longer unary runs check every word), every
                 # read stays inside the copy


@njit(cache=True, nogil=True, inline="always")
def _peek(w, bp):
    """The 64 bits at bit position ``bp`` of the stream held as big-endian words ``w``."""
    k = bp >> 6
    s = U64(bp & 63)
    return (w[k] << s) | ((w[k + 1] >> U64(1)) >> (U64(63) - s))


@njit(cache=True, nogil=True, inline="always")
def _get_golomb(w, bp, m, b, cut, qmax, vmax, end):
    """One Golomb code at bit ``bp``; returns (value, or -1 when over ``vmax``, next bp).
    ``qmax`` = vmax div m (precomputed: no division here).

    No bit buffer to refill: each read takes the 64 bits at ``bp`` from two words, so a
    code is one dependent chain (load, count ones, add). Past the stream the words are
    zeros, which end a unary run; a run of 64 ones or more is counted a word at a
    time, and stops once past ``end`` (bits)."""
    x = _peek(w, bp)
    inv = ~x
    if inv == U64(0):
        q = 0
        while True:                      # a long unary run: only valid for huge gaps
            q += 64
            bp += 64
            if q > qmax or bp > end:
                return -1, bp
            x = _peek(w, bp)
            inv = ~x
            if inv != U64(0):
                break
        o = np.int64(leading_zeros(inv))
        q += o
        bp += o + 1
        x = _peek(w, bp)
    else:
        q = np.int64(leading_zeros(inv))
        if q >= 40:                      # the remainder may not fit after the run
            bp += q + 1
            x = _peek(w, bp)
        else:
            bp += q + 1
            x = (x << U64(q)) << U64(1)
    if q > qmax:
        return -1, bp
    # b <= 24 bits of remainder at the top of x; the first b - 1 are y. b = 0 (m = 1) falls
    # out of the same arithmetic: cut = 0, peek = 0, r = 0, used = 0.
    peek = np.int64((x >> U64(1)) >> U64(63 - b))
    y = peek >> 1
    longer = np.int64(y >= cut)          # branch-free: this bit is a coin toss
    r = y + longer * (peek - cut - y)
    bp += b - 1 + longer
    v = q * m + r
    if v > vmax:
        return -1, bp
    return v, bp


@njit(cache=True, nogil=True)
def _words(payload, start, stop):
    """The stream payload[start:stop] as big-endian 64-bit words, then _PAD_WORDS zero words."""
    L = stop - start
    nw = (L + 7) // 8 + _PAD_WORDS
    out = np.zeros(nw, np.uint64)
    for k in range(L // 8):
        o = start + 8 * k
        out[k] = ((U64(payload[o]) << U64(56)) | (U64(payload[o + 1]) << U64(48))
                  | (U64(payload[o + 2]) << U64(40)) | (U64(payload[o + 3]) << U64(32))
                  | (U64(payload[o + 4]) << U64(24)) | (U64(payload[o + 5]) << U64(16))
                  | (U64(payload[o + 6]) << U64(8)) | U64(payload[o + 7]))
    k = L // 8
    for i in range(8 * k, L):
        out[k] |= U64(payload[start + i]) << U64(56 - 8 * (i - 8 * k))
    return out


@njit(cache=True, nogil=True)
def _stream_end_ok(w, bp, L):
    """0 when the stream was read to its last byte, not beyond, and its padding bits are zero."""
    if bp > 8 * L:
        return 10
    if (bp + 7) // 8 != L:
        return 11
    k = 8 * L - bp            # padding bits, < 8
    if k > 0 and (_peek(w, bp) >> U64(64 - k)) != U64(0):
        return 11
    return 0


@njit(cache=True, nogil=True)
def _parse_param(byte):
    """(mode, polarity, j) of a parameter byte, or mode -1 when it is invalid."""
    if byte == 0:
        return NONE, 0, 0
    if byte == 1:
        return ALL, 1, 0
    v = byte - 2
    j = v >> 1
    if j > MAX_J:
        return -1, 0, 0
    return GOLOMB, v & 1, j


@njit(cache=True, nogil=True)
def _parse_table(payload, C):
    """The class table: (error, lo, hi, position modes, polarities, j, big-flag modes,
    polarities, j, magnitude j, offset of the position stream, P)."""
    z = np.zeros(C, np.int64)
    L = payload.shape[0]
    if L < HEADER_MIN:
        return 1, 0, 0, z, z, z, z, z, z, z, 0, 0
    lo = np.int64(payload[0]) | (np.int64(payload[1]) << 8)
    hi = np.int64(payload[2]) | (np.int64(payload[3]) << 8)
    if lo > hi or hi >= C:
        return 2, 0, 0, z, z, z, z, z, z, z, 0, 0
    R = hi - lo + 1
    if L < HEADER_MIN + R:
        return 1, 0, 0, z, z, z, z, z, z, z, 0, 0
    pmode = np.zeros(C, np.int64)
    ppol = np.zeros(C, np.int64)
    pj = np.zeros(C, np.int64)
    zmode = np.zeros(C, np.int64)
    zpol = np.zeros(C, np.int64)
    zj = np.zeros(C, np.int64)
    vj = np.zeros(C, np.int64)
    A = 0
    for c in range(lo, hi + 1):
        mode, p, jj = _parse_param(payload[HEADER_MIN + c - lo])
        if mode < 0:
            return 3, 0, 0, z, z, z, z, z, z, z, 0, 0
        pmode[c] = mode
        ppol[c] = p
        pj[c] = jj
        if mode != NONE:
            A += 1
    if pmode[lo] == NONE or pmode[hi] == NONE:
        return 4, 0, 0, z, z, z, z, z, z, z, 0, 0
    q = HEADER_MIN + R
    if L < q + 2 * A + 4:
        return 1, 0, 0, z, z, z, z, z, z, z, 0, 0
    for c in range(lo, hi + 1):
        if pmode[c] == NONE:
            continue
        mode, p, jj = _parse_param(payload[q])
        v = np.int64(payload[q + 1])
        q += 2
        if mode < 0 or v > MAX_J:
            return 3, 0, 0, z, z, z, z, z, z, z, 0, 0
        if mode == NONE and v != 0:
            return 4, 0, 0, z, z, z, z, z, z, z, 0, 0
        zmode[c] = mode
        zpol[c] = p
        zj[c] = jj
        vj[c] = v
    P = 0
    for k in range(4):
        P |= np.int64(payload[q + k]) << (8 * k)
    q += 4
    if P > L - q:
        return 1, 0, 0, z, z, z, z, z, z, z, 0, 0
    return 0, lo, hi, pmode, ppol, pj, zmode, zpol, zj, vj, q, P


@njit(cache=True, nogil=True)
def _decode_positions(w, P, old, count, mbits, lo, hi, pmode, ppol, pj, out_pos, ccls):
    """The position stream (``w``: its P bytes as words, then zero words): changed positions and
    their classes into ``out_pos``/``ccls``. Returns 0 or an error code."""
    n = old.shape[0]
    C = pmode.shape[0]
    cmask = C - 1
    pm, pb, pc, _ = class_params(pj)
    pq = n // pm          # the longest unary run a valid gap can have
    lim = 8 * P + 64        # bits
    bp = 0
    # cd[c] >= 0: a class coded by its changes (or NONE: _BIG), cd[c] elements of it before
    # its next event; every element decrements it and the event is where it goes negative.
    # Classes coded by their unchanged elements, and ALL classes, live far below zero
    # (_SPECIAL + countdown), so the common path is one decrement and one sign test.
    cd = np.full(C, _BIG, np.int64)
    for c in range(lo, hi + 1):
        if pmode[c] == GOLOMB:
            g, bp = _get_golomb(w, bp, pm[c], pb[c], pc[c], pq[c], n, lim)
            if g < 0:
                return 5
            if bp > lim:
                return 10
            cd[c] = g if ppol[c] == 0 else _SPECIAL + g
        elif pmode[c] == ALL:
            cd[c] = _SPECIAL + _BIG_SPECIAL
    j = 0
    for i in range(n):
        c = np.int64(U64(old[i]) >> U64(mbits)) & cmask
        r = cd[c] - 1
        cd[c] = r
        if r >= 0:
            continue
        if r == -1:                      # an event of a class coded by its changes
            g, bp = _get_golomb(w, bp, pm[c], pb[c], pc[c], pq[c], n, lim)
            if g < 0:
                return 5
            if bp > lim:
                return 10
            cd[c] = g
        elif r - _SPECIAL == -1:         # an event of a class coded by its unchanged elements
            g, bp = _get_golomb(w, bp, pm[c], pb[c], pc[c], pq[c], n, lim)
            if g < 0:
                return 5
            if bp > lim:
                return 10
            cd[c] = _SPECIAL + g
            continue
        if j >= count:
            return 6
        out_pos[j] = i
        ccls[j] = c
        j += 1
    if j != count:
        return 7
    for c in range(lo, hi + 1):
        if pmode[c] == GOLOMB and cd[c] != (0 if ppol[c] == 0 else _SPECIAL):
            return 8
    return _stream_end_ok(w, bp, P)


@njit(cache=True, nogil=True)
def _decode_steps(w, S, old, width_bits, lo, hi, zmode, zpol, zj, vj, out_pos, ccls, out_val):
    """The step stream (``w``: its S bytes as words, then zero words): the new bits of every
    change into ``out_val``. Returns 0 or an error code."""
    count = out_pos.shape[0]
    C = zmode.shape[0]
    mask = U64(0xFFFFFFFFFFFFFFFF) >> U64(64 - width_bits)
    signbit = U64(1) << U64(width_bits - 1)
    vmax = (1 << (width_bits - 1)) - 2
    zm, zb, zc, _ = class_params(zj)
    vm, vb, vc, _ = class_params(vj)
    zq = count // zm
    vq = vmax // vm
    lim = 8 * S + 64        # bits
    bp = 0
    zcd = np.full(C, _BIG, np.int64)    # as cd in _decode_positions, over the changes
    big_if_quiet = np.zeros(C, np.uint8)
    for c in range(lo, hi + 1):
        if zmode[c] == GOLOMB:
            g, bp = _get_golomb(w, bp, zm[c], zb[c], zc[c], zq[c], count, lim)
            if g < 0:
                return 5
            if bp > lim:
                return 10
            zcd[c] = g
            big_if_quiet[c] = zpol[c]
        elif zmode[c] == ALL:
            big_if_quiet[c] = 1
    for t in range(count):
        c = np.int64(ccls[t])
        s = np.int64(_peek(w, bp) >> U64(63))
        bp += 1
        r = zcd[c]
        if r != 0:
            zcd[c] = r - 1
            big = big_if_quiet[c] == 1
        else:
            g, bp = _get_golomb(w, bp, zm[c], zb[c], zc[c], zq[c], count, lim)
            if g < 0:
                return 5
            zcd[c] = g
            big = big_if_quiet[c] == 0
        a = 0
        if big:
            v, bp = _get_golomb(w, bp, vm[c], vb[c], vc[c], vq[c], vmax, lim)
            if v < 0:
                return 5
            a = v + 1
        if bp > lim:
            return 10
        z = U64(2 * a + s + 1)
        if z > mask:
            return 12
        if z & U64(1):
            d = mask - (z >> U64(1))
        else:
            d = z >> U64(1)
        o = U64(old[out_pos[t]])
        out_val[t] = unkey((key(o, signbit, mask) + d) & mask, signbit, mask)
    for c in range(lo, hi + 1):
        if zmode[c] == GOLOMB and zcd[c] != 0:
            return 9
    return _stream_end_ok(w, bp, S)


@njit(cache=True, nogil=True)
def ctx_decode(payload, old, count, width_bits, mbits, ebits, out_pos, out_val):
    """Decode an encoding-4 payload against the chunk's parent bits ``old``.

    Writes ``count`` chunk-local positions and new bits into ``out_pos``/``out_val``
    (each exactly ``count`` long). Returns 0, or an error code (``_ERRORS``)."""
    C = 1 << ebits
    err, lo, hi, pmode, ppol, pj, zmode, zpol, zj, vj, q, P = _parse_table(payload, C)
    if err:
        return err
    ccls = np.empty(count, np.uint16)
    err = _decode_positions(_words(payload, q, q + P), P, old, count, mbits, lo, hi,
                            pmode, ppol, pj, out_pos, ccls)
    if err:
        return err
    L = payload.shape[0]
    return _decode_steps(_words(payload, q + P, L), L - q - P, old, width_bits, lo, hi,
                         zmode, zpol, zj, vj, out_pos, ccls, out_val)
