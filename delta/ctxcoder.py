"""Chunk encoding 4 ("ctx"): changes coded with contexts the decoder already holds.

Why: the parent's bits predict the change. An element's exponent fixes its ulp,
and an optimizer step of roughly ``lr`` moves an element with a small ulp almost
surely and one with a large ulp rarely; an element that moves nearly always moves
one ulp. So every element is put in a *class*, its parent's exponent field (known
to encoder and decoder alike), and each class gets its own model: the changed
positions are Golomb-coded gaps inside the class's own index sequence, the steps a
sign bit plus a Golomb-coded "moved more than one ulp" sequence and magnitude.
Golomb codes are within ~1% of the entropy of geometric gaps, need one parameter
byte per class (no frequency tables), and decode with a bit reader and no
divisions: on the reference workloads this is within a few percent of the
conditional entropy (benchmarks/entropy.py) at ~2x the order-0 codecs.

Layout, classes, parameters and bit order are fixed by docs/FORMAT.md
("Encoding 4: ctx"). The kernels are pure numba functions over numpy arrays; the
decoder validates every length, count and value it derives from the payload (numba
does no bounds checks) and never reads past the payload: a bad payload yields an
error code that :func:`decode_ctx` turns into a :class:`FormatError`.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit
from numba.core import config

if config.DISABLE_JIT:  # the kernels run as plain Python (coverage runs): no LLVM intrinsic
    def leading_zeros(x):
        return 64 - int(x).bit_length()
else:
    from numba.cpython.unsafe.numbers import leading_zeros

from .dtypes import DType
from .errors import FormatError
from .record import CTX_LAYOUT

MAX_J = 95          # largest Golomb parameter index; m(95) = 7 * 2**21
HEADER_MIN = 4      # u16 lo, u16 hi

_U64 = np.uint64
_NONE, _ALL, _GOLOMB = 0, 1, 2
_BIG = 1 << 62      # a countdown that never reaches zero inside a chunk (<= 2**24 elements)
_SPECIAL = -(1 << 62)   # decoder: countdowns of classes coded by unchanged elements sit here
_BIG_SPECIAL = 1 << 40

_ERRORS = {
    1: "payload shorter than its class table",
    2: "class range outside the dtype's exponent classes",
    3: "invalid parameter byte",
    4: "non-canonical class table",
    5: "a coded gap or step exceeds its bound",
    6: "more changed elements than the chunk entry's count",
    7: "fewer changed elements than the chunk entry's count",
    8: "a class's position gaps do not end at the chunk's end",
    9: "a class's step flags do not end with its changes",
    10: "bit stream read past the payload's end",
    11: "trailing bytes or nonzero padding after the bit stream",
    12: "a step outside the dtype's key space",
}


def layout_of(dt: DType) -> tuple[int, int] | None:
    """(mantissa bits, exponent bits) when encoding 4 serves ``dt``, else None."""
    return CTX_LAYOUT.get(dt.name)


def golomb_m(j: int) -> int:
    """The Golomb parameter of index ``j``: four steps per octave, exact in integers."""
    return ((4 + (j & 3)) << (j >> 2)) >> 2


# --------------------------------------------------------------------------- shared helpers

@njit(cache=True, nogil=True, inline="always")
def _m_of(j):
    return ((4 + (j & 3)) << (j >> 2)) >> 2


@njit(cache=True, nogil=True, inline="always")
def _ceil_log2(m):
    b = 0
    while (1 << b) < m:
        b += 1
    return b


@njit(cache=True, nogil=True, inline="always")
def _key(b, signbit, mask):
    """Ordered key of sign-magnitude bits (docs/FORMAT.md): ``~b & mask`` when the sign bit is
    set, else ``b | signbit``. Branch-free: the sign of a weight is a coin toss."""
    return b ^ signbit ^ ((mask >> _U64(1)) * _U64((b & signbit) != _U64(0)))


@njit(cache=True, nogil=True, inline="always")
def _unkey(k, signbit, mask):
    """Inverse of :func:`_key`: ``k ^ signbit`` when the key has the sign bit, else ``~k & mask``."""
    return k ^ mask ^ ((mask >> _U64(1)) * _U64((k & signbit) != _U64(0)))


@njit(cache=True, nogil=True, inline="always")
def _qr(v, m, rinv):
    """(v div m, v mod m) for 0 <= v < 2**52 without an integer division: the float
    quotient is off by at most one, and one correction fixes it."""
    q = np.int64(v * rinv)
    r = v - q * m
    if r < 0:
        q -= 1
        r += m
    elif r >= m:
        q += 1
        r -= m
    return q, r


@njit(cache=True, nogil=True, inline="always")
def _golomb_bits(v, m, b, cut, rinv):
    q, r = _qr(v, m, rinv)
    if b == 0:
        return q + 1
    return q + 1 + (b - 1 if r < cut else b)


@njit(cache=True, nogil=True)
def _j_for_p(p):
    """Parameter index of the Golomb code for geometric gaps with event probability p (0 < p <= 1)."""
    if p >= 0.5:
        return 0
    m = math.ceil(math.log(2.0 - p) / -math.log1p(-p))
    j = 0
    while j < MAX_J and _m_of(j) < m:
        j += 1
    return j


# --------------------------------------------------------------------------- bit writer

_SLACK = 8  # spare bytes after the encoder's output: _put stores seven bytes whatever it appends


@njit(cache=True, nogil=True, inline="always")
def _put(out, acc, nb, pos, val, k):
    """Append the ``k`` (<= 56) low bits of ``val``, most significant first. ``acc`` holds
    ``nb`` < 8 pending bits. Branch-free: seven bytes are always stored and the complete
    ones kept (callers append at most 49 bits; ``out`` has _SLACK spare bytes at its end)."""
    acc = (acc << _U64(k)) | _U64(val)
    nb += k
    top = (acc << _U64(63 - nb)) << _U64(1)      # the nb pending bits, left-aligned
    out[pos] = np.uint8(top >> _U64(56))
    out[pos + 1] = np.uint8((top >> _U64(48)) & _U64(0xFF))
    out[pos + 2] = np.uint8((top >> _U64(40)) & _U64(0xFF))
    out[pos + 3] = np.uint8((top >> _U64(32)) & _U64(0xFF))
    out[pos + 4] = np.uint8((top >> _U64(24)) & _U64(0xFF))
    out[pos + 5] = np.uint8((top >> _U64(16)) & _U64(0xFF))
    out[pos + 6] = np.uint8((top >> _U64(8)) & _U64(0xFF))
    pos += nb >> 3
    nb &= 7
    return acc, nb, pos


@njit(cache=True, nogil=True, inline="always")
def _flush(out, acc, nb, pos):
    """Complete the last byte with zero bits."""
    if nb > 0:
        out[pos] = np.uint8((acc << _U64(8 - nb)) & _U64(0xFF))
        pos += 1
    return _U64(0), 0, pos


@njit(cache=True, nogil=True, inline="always")
def _put_golomb(out, acc, nb, pos, v, m, b, cut, rinv):
    q, r = _qr(v, m, rinv)
    while q > 24:
        acc, nb, pos = _put(out, acc, nb, pos, 0xFFFFFF, 24)
        q -= 24
    longer = np.int64(r >= cut) if b > 0 else 0
    rb = b - 1 + longer if b > 0 else 0         # remainder bits: b - 1 or b (0 when m = 1)
    code = ((((1 << q) - 1) << 1) << rb) | (r + longer * cut)
    return _put(out, acc, nb, pos, code, q + 1 + rb)


@njit(cache=True, nogil=True, inline="always")
def _param_byte(mode, pol, j):
    if mode == _NONE:
        return 0
    if mode == _ALL:
        return 1
    return 2 + 2 * j + pol


# --------------------------------------------------------------------------- encoder

@njit(cache=True, nogil=True)
def _class_params(j):
    """(m, b, cut, 1/m) arrays of the Golomb code of each class's parameter index."""
    C = j.shape[0]
    m = np.empty(C, np.int64)
    b = np.empty(C, np.int64)
    cut = np.empty(C, np.int64)
    rinv = np.empty(C, np.float64)
    for c in range(C):
        m[c] = _m_of(j[c])
        b[c] = _ceil_log2(m[c])
        cut[c] = (1 << b[c]) - m[c]
        rinv[c] = 1.0 / m[c]
    return m, b, cut, rinv


@njit(cache=True, nogil=True)
def _flag_model(n_items, n_set):
    """(mode, polarity, j) of a flag sequence with ``n_set`` of ``n_items`` set: the rarer
    value is the event, its gaps Golomb-coded with the parameter fit to its rate."""
    if n_set == 0:
        return _NONE, 0, 0
    if n_set == n_items:
        return _ALL, 1, 0
    pol = 1 if 2 * n_set > n_items else 0
    ev = n_items - n_set if pol else n_set
    return _GOLOMB, pol, _j_for_p(ev / n_items)


@njit(cache=True, nogil=True, inline="always")
def _change(old, new, i, mbits, cmask, h0, h1, h2, h3, later, signbit, mask,
            cpos, ccls, crank, csign, ca, kcls, j):
    """Record element ``i`` (changed) at slot ``j``; its rank is the class count after the
    group of four minus the group's later elements of the same class."""
    o = _U64(old[i])
    c = np.int64(o >> _U64(mbits)) & cmask
    v = _U64(new[i])
    d = (_key(v, signbit, mask) - _key(o, signbit, mask)) & mask
    up = _U64(d < signbit)                        # z - 1, branch-free (the direction is a coin toss)
    u = up * ((d << _U64(1)) - _U64(1)) + (_U64(1) - up) * ((mask - d) << _U64(1))
    cpos[j] = i
    ccls[j] = c
    crank[j] = h0[c] + h1[c] + h2[c] + h3[c] - 1 - later
    csign[j] = np.uint8(u & _U64(1))
    ca[j] = np.int32(u >> _U64(1))
    kcls[c] += 1


@njit(cache=True, nogil=True)
def _scan(old, new, count, mbits, C, signbit, mask):
    """Class sizes, changes per class, and every change: position, class, class-local rank,
    sign and magnitude - 1 of its step. Four histogram banks (element i counts in bank
    i % 4) keep consecutive elements of one class from serialising on one counter.
    Returns arrays of length 0 for the changes when ``count`` is wrong."""
    n = old.shape[0]
    cmask = C - 1
    h0 = np.zeros(C, np.int64)
    h1 = np.zeros(C, np.int64)
    h2 = np.zeros(C, np.int64)
    h3 = np.zeros(C, np.int64)
    kcls = np.zeros(C, np.int64)
    cpos = np.empty(count, np.int32)     # chunks hold at most 2**24 elements
    ccls = np.empty(count, np.int32)
    crank = np.empty(count, np.int32)
    ca = np.empty(count, np.int32)       # magnitude - 1 (< 2**15: widths 8 and 16)
    csign = np.empty(count, np.uint8)    # 1: the key goes up
    bad = np.empty(0, np.int32)
    j = 0
    n4 = n - n % 4
    for i in range(0, n4, 4):
        c0 = np.int64(_U64(old[i]) >> _U64(mbits)) & cmask
        c1 = np.int64(_U64(old[i + 1]) >> _U64(mbits)) & cmask
        c2 = np.int64(_U64(old[i + 2]) >> _U64(mbits)) & cmask
        c3 = np.int64(_U64(old[i + 3]) >> _U64(mbits)) & cmask
        h0[c0] += 1
        h1[c1] += 1
        h2[c2] += 1
        h3[c3] += 1
        x0 = old[i] != new[i]
        x1 = old[i + 1] != new[i + 1]
        x2 = old[i + 2] != new[i + 2]
        x3 = old[i + 3] != new[i + 3]
        if x0 | x1 | x2 | x3:
            if j + x0 + x1 + x2 + x3 > count:
                return h0, kcls, bad, bad, bad, np.empty(0, np.uint8), bad
            if x0:
                later = np.int64(c1 == c0) + np.int64(c2 == c0) + np.int64(c3 == c0)
                _change(old, new, i, mbits, cmask, h0, h1, h2, h3, later, signbit, mask,
                        cpos, ccls, crank, csign, ca, kcls, j)
                j += 1
            if x1:
                later = np.int64(c2 == c1) + np.int64(c3 == c1)
                _change(old, new, i + 1, mbits, cmask, h0, h1, h2, h3, later, signbit, mask,
                        cpos, ccls, crank, csign, ca, kcls, j)
                j += 1
            if x2:
                later = np.int64(c3 == c2)
                _change(old, new, i + 2, mbits, cmask, h0, h1, h2, h3, later, signbit, mask,
                        cpos, ccls, crank, csign, ca, kcls, j)
                j += 1
            if x3:
                _change(old, new, i + 3, mbits, cmask, h0, h1, h2, h3, 0, signbit, mask,
                        cpos, ccls, crank, csign, ca, kcls, j)
                j += 1
    for i in range(n4, n):
        c = np.int64(_U64(old[i]) >> _U64(mbits)) & cmask
        h0[c] += 1
        if old[i] != new[i]:
            if j >= count:
                return h0, kcls, bad, bad, bad, np.empty(0, np.uint8), bad
            _change(old, new, i, mbits, cmask, h0, h1, h2, h3, 0, signbit, mask,
                    cpos, ccls, crank, csign, ca, kcls, j)
            j += 1
    if j != count:
        return h0, kcls, bad, bad, bad, np.empty(0, np.uint8), bad
    return h0 + h1 + h2 + h3, kcls, cpos, ccls, crank, csign, ca


@njit(cache=True, nogil=True)
def _position_models(ncls, kcls, count):
    """Per class: (mode, polarity, j) of its "changed" flags, and how many unchanged
    elements are events.

    Coding a mostly-changed class by its unchanged elements (polarity 1) needs a second
    pass over the chunk to find them; it is used only when it saves about 1% of the
    payload (it saves ~n (1 - H(p)) bits over Golomb m = 1 on the changes)."""
    C = ncls.shape[0]
    pmode = np.zeros(C, np.int64)
    ppol = np.zeros(C, np.int64)
    pj = np.zeros(C, np.int64)
    est = 1.5 * count             # bits: the steps' share, roughly
    gain = 0.0
    for c in range(C):
        pmode[c], ppol[c], pj[c] = _flag_model(ncls[c], kcls[c])
        if pmode[c] == _GOLOMB:
            p = kcls[c] / ncls[c]
            h = -(p * math.log2(p) + (1.0 - p) * math.log2(1.0 - p))
            est += ncls[c] * h
            if ppol[c] == 1:
                gain += ncls[c] * (1.0 - h)
    ucount = 0
    for c in range(C):
        if pmode[c] == _GOLOMB and ppol[c] == 1:
            if gain < 0.01 * est:
                ppol[c] = 0
                pj[c] = 0
            else:
                ucount += ncls[c] - kcls[c]
    return pmode, ppol, pj, ucount


@njit(cache=True, nogil=True)
def _unchanged_events(old, new, mbits, pmode, ppol, ucount):
    """Position, class and class-local rank of the unchanged elements of the classes
    whose events are their unchanged elements (a second pass; only when there are any)."""
    C = pmode.shape[0]
    cmask = C - 1
    upos = np.empty(ucount, np.int32)
    ucls = np.empty(ucount, np.int32)
    urank = np.empty(ucount, np.int32)
    if ucount == 0:
        return upos, ucls, urank
    want = np.zeros(C, np.uint8)
    for c in range(C):
        want[c] = pmode[c] == _GOLOMB and ppol[c] == 1
    cnt = np.zeros(C, np.int64)
    t = 0
    for i in range(old.shape[0]):
        o = old[i]
        c = np.int64(_U64(o) >> _U64(mbits)) & cmask
        if not want[c]:
            continue
        r = cnt[c]
        cnt[c] = r + 1
        if o == new[i]:
            upos[t] = i
            ucls[t] = c
            urank[t] = r
            t += 1
    return upos, ucls, urank


@njit(cache=True, nogil=True)
def _position_gaps(ncls, ccls, crank, pmode, ppol, ucls, urank):
    """The gap after each event (to the next event of its class, or to the class's end;
    -1 for changes that are not events) and each class's first gap."""
    count = ccls.shape[0]
    nxt = ncls.copy()
    cgap = np.empty(count, np.int32)
    for t in range(count - 1, -1, -1):
        c = ccls[t]
        if pmode[c] == _GOLOMB and ppol[c] == 0:
            cgap[t] = nxt[c] - crank[t] - 1
            nxt[c] = crank[t]
        else:
            cgap[t] = -1
    ucount = ucls.shape[0]
    ugap = np.empty(ucount, np.int32)
    for t in range(ucount - 1, -1, -1):
        c = ucls[t]
        ugap[t] = nxt[c] - urank[t] - 1
        nxt[c] = urank[t]
    return cgap, ugap, nxt


@njit(cache=True, nogil=True)
def _step_models(kcls, ccls, ca):
    """Per class: the big-flag model, each big-flag event's gap (-1 elsewhere), the first
    gaps, and the magnitude parameter index (the cheapest of six around the fit to the
    mean: magnitudes have heavier tails than a geometric law)."""
    C = kcls.shape[0]
    count = ccls.shape[0]
    nzc = np.zeros(C, np.int64)
    vsum = np.zeros(C, np.float64)
    for t in range(count):
        if ca[t] > 0:
            nzc[ccls[t]] += 1
            vsum[ccls[t]] += ca[t] - 1
    zmode = np.zeros(C, np.int64)
    zpol = np.zeros(C, np.int64)
    zj = np.zeros(C, np.int64)
    for c in range(C):
        zmode[c], zpol[c], zj[c] = _flag_model(kcls[c], nzc[c])
    nxt = kcls.copy()
    seen = kcls.copy()
    zgap = np.empty(count, np.int32)
    for t in range(count - 1, -1, -1):
        c = ccls[t]
        seen[c] -= 1        # index of this change among its class's changes
        if zmode[c] == _GOLOMB and ((ca[t] > 0) != (zpol[c] == 1)):
            zgap[t] = nxt[c] - seen[c] - 1
            nxt[c] = seen[c]
        else:
            zgap[t] = -1
    NV = 6
    vj0 = np.zeros(C, np.int64)
    for c in range(C):
        if nzc[c] > 0:
            vj0[c] = max(0, min(MAX_J - NV + 1, _j_for_p(1.0 / (vsum[c] / nzc[c] + 1.0)) - NV // 2))
    vcost = np.zeros((C, NV), np.int64)
    cm = np.empty((C, NV), np.int64)
    cb = np.empty((C, NV), np.int64)
    cr = np.empty((C, NV), np.float64)
    for c in range(C):
        for k in range(NV):
            cm[c, k] = _m_of(vj0[c] + k)
            cb[c, k] = _ceil_log2(cm[c, k])
            cr[c, k] = 1.0 / cm[c, k]
    for t in range(count):
        if ca[t] > 0:
            c = ccls[t]
            for k in range(NV):
                vcost[c, k] += _golomb_bits(ca[t] - 1, cm[c, k], cb[c, k], (1 << cb[c, k]) - cm[c, k], cr[c, k])
    vj = np.zeros(C, np.int64)
    for c in range(C):
        if nzc[c] > 0:
            vj[c] = vj0[c] + np.argmin(vcost[c])
    return zmode, zpol, zj, zgap, nxt, vj


@njit(cache=True, nogil=True)
def _assemble(pmode, ppol, pj, pinit, cpos, ccls, cgap, upos, ucls, ugap,
              zmode, zpol, zj, zinit, zgap, vj, csign, ca):
    """Class table, position stream and step stream, in the decoder's order."""
    C = pmode.shape[0]
    count = cpos.shape[0]
    ucount = upos.shape[0]
    pm, pb, pc, pr = _class_params(pj)
    zm, zb, zc, zr = _class_params(zj)
    vm, vb, vc, vr = _class_params(vj)
    # exact sizes first: one allocation, no copy
    pbits = 0
    sbits = count
    for c in range(C):
        if pmode[c] == _GOLOMB:
            pbits += _golomb_bits(pinit[c], pm[c], pb[c], pc[c], pr[c])
        if zmode[c] == _GOLOMB:
            sbits += _golomb_bits(zinit[c], zm[c], zb[c], zc[c], zr[c])
    for t in range(count):
        c = ccls[t]
        if cgap[t] >= 0:
            pbits += _golomb_bits(cgap[t], pm[c], pb[c], pc[c], pr[c])
        if zgap[t] >= 0:
            sbits += _golomb_bits(zgap[t], zm[c], zb[c], zc[c], zr[c])
        if ca[t] > 0:
            sbits += _golomb_bits(ca[t] - 1, vm[c], vb[c], vc[c], vr[c])
    for t in range(ucount):
        pbits += _golomb_bits(ugap[t], pm[ucls[t]], pb[ucls[t]], pc[ucls[t]], pr[ucls[t]])
    lo = C
    hi = -1
    A = 0
    for c in range(C):
        if pmode[c] != _NONE:
            lo = min(lo, c)
            hi = max(hi, c)
            A += 1
    R = hi - lo + 1
    P = (pbits + 7) // 8
    hdr = HEADER_MIN + R + 2 * A + 4
    size = hdr + P + (sbits + 7) // 8
    out = np.zeros(size + _SLACK, np.uint8)
    out[0] = lo & 0xFF
    out[1] = lo >> 8
    out[2] = hi & 0xFF
    out[3] = hi >> 8
    q = HEADER_MIN + R
    for c in range(lo, hi + 1):
        out[HEADER_MIN + c - lo] = _param_byte(pmode[c], ppol[c], pj[c])
        if pmode[c] != _NONE:
            out[q] = _param_byte(zmode[c], zpol[c], zj[c])
            out[q + 1] = vj[c]
            q += 2
    for k in range(4):
        out[q + k] = (P >> (8 * k)) & 0xFF
    # position stream: first gaps, then the gap after each event, in element order
    acc = _U64(0)
    nb = 0
    pos = hdr
    for c in range(C):
        if pmode[c] == _GOLOMB:
            acc, nb, pos = _put_golomb(out, acc, nb, pos, pinit[c], pm[c], pb[c], pc[c], pr[c])
    t = 0
    s = 0
    while t < count or s < ucount:
        if s < ucount and (t == count or upos[s] < cpos[t]):
            c = ucls[s]
            acc, nb, pos = _put_golomb(out, acc, nb, pos, ugap[s], pm[c], pb[c], pc[c], pr[c])
            s += 1
        else:
            if cgap[t] >= 0:
                c = ccls[t]
                acc, nb, pos = _put_golomb(out, acc, nb, pos, cgap[t], pm[c], pb[c], pc[c], pr[c])
            t += 1
    acc, nb, pos = _flush(out, acc, nb, pos)
    if pos != hdr + P:
        return np.empty(0, np.uint8)
    # step stream: first big-flag gaps, then per change: sign, big-flag gap at events, magnitude
    for c in range(C):
        if zmode[c] == _GOLOMB:
            acc, nb, pos = _put_golomb(out, acc, nb, pos, zinit[c], zm[c], zb[c], zc[c], zr[c])
    for t in range(count):
        c = ccls[t]
        acc, nb, pos = _put(out, acc, nb, pos, csign[t], 1)
        if zgap[t] >= 0:
            acc, nb, pos = _put_golomb(out, acc, nb, pos, zgap[t], zm[c], zb[c], zc[c], zr[c])
        if ca[t] > 0:
            acc, nb, pos = _put_golomb(out, acc, nb, pos, ca[t] - 1, vm[c], vb[c], vc[c], vr[c])
    acc, nb, pos = _flush(out, acc, nb, pos)
    if pos != size:
        return np.empty(0, np.uint8)
    return out[:size]


@njit(cache=True, nogil=True)
def _sparse_parts(cpos, csign, ca):
    """Encoding 1's gaps and zigzag steps of the same changes, so the encoder can compare
    both encodings without a second pass over the chunk."""
    count = cpos.shape[0]
    gaps = np.empty(count, np.uint32)
    steps = np.empty(count, np.uint64)
    prev = -1
    max_gap = 0
    max_step = 0
    for t in range(count):
        g = cpos[t] - prev - 1
        prev = cpos[t]
        gaps[t] = g
        z = 2 * np.int64(ca[t]) + csign[t] + 1
        steps[t] = z
        max_gap = max(max_gap, g)
        max_step = max(max_step, z)
    return gaps, steps, max_gap, max_step


@njit(cache=True, nogil=True)
def ctx_encode(old, new, count, width_bits, mbits, ebits):
    """Encoding-4 payload of one chunk in which exactly ``count`` >= 1 elements differ
    (an empty array if they do not: a caller bug), and encoding 1's gaps and steps
    (:func:`_sparse_parts`).

    One pass over the elements finds the changes; a second runs only when some class
    is coded by its unchanged elements (more than half of it changed). The rest is
    work per change."""
    C = 1 << ebits
    mask = _U64(0xFFFFFFFFFFFFFFFF) >> _U64(64 - width_bits)
    signbit = _U64(1) << _U64(width_bits - 1)
    ncls, kcls, cpos, ccls, crank, csign, ca = _scan(old, new, count, mbits, C, signbit, mask)
    if cpos.shape[0] != count:
        return np.empty(0, np.uint8), _sparse_parts(cpos, csign, ca)
    pmode, ppol, pj, ucount = _position_models(ncls, kcls, count)
    upos, ucls, urank = _unchanged_events(old, new, mbits, pmode, ppol, ucount)
    cgap, ugap, pinit = _position_gaps(ncls, ccls, crank, pmode, ppol, ucls, urank)
    zmode, zpol, zj, zgap, zinit, vj = _step_models(kcls, ccls, ca)
    return _assemble(pmode, ppol, pj, pinit, cpos, ccls, cgap, upos, ucls, ugap,
                     zmode, zpol, zj, zinit, zgap, vj, csign, ca), _sparse_parts(cpos, csign, ca)



# --------------------------------------------------------------------------- decoder

_PAD = 64   # zero bytes after a copied stream: with bp <= len + 8 checked once per element or
            # change (at most 5 refills of 8 bytes between checks), refills stay inside the copy


@njit(cache=True, nogil=True, inline="always")
def _refill(buf, acc, nacc, bp):
    """Top up the bit buffer to at least 33 bits, four bytes at a time."""
    if nacc <= 32:
        x = ((_U64(buf[bp]) << _U64(24)) | (_U64(buf[bp + 1]) << _U64(16))
             | (_U64(buf[bp + 2]) << _U64(8)) | _U64(buf[bp + 3]))
        acc |= x << _U64(32 - nacc)
        nacc += 32
        bp += 4
    return acc, nacc, bp


@njit(cache=True, nogil=True, inline="always")
def _get_golomb(buf, acc, nacc, bp, m, b, cut, qmax, vmax):
    """One Golomb code; returns (value, or -1 when over ``vmax``, acc, nacc, bp).
    ``qmax`` = vmax div m (precomputed: no division here).

    ``buf`` holds the stream plus _PAD zero bytes and the caller stops once ``bp`` passes
    the stream's end by 8, so the reads here stay inside ``buf``: past the stream the
    bits are zeros, which end a unary run."""
    q = 0
    while True:
        acc, nacc, bp = _refill(buf, acc, nacc, bp)
        inv = ~acc
        ones = 64 if inv == _U64(0) else np.int64(leading_zeros(inv))
        if ones < nacc:
            q += ones
            acc = (acc << _U64(ones)) << _U64(1)
            nacc -= ones + 1
            break
        # all buffered bits are ones: only inside the stream (its padding is zeros)
        q += nacc
        acc = _U64(0)
        nacc = 0
        if q > qmax or bp >= buf.shape[0] - 8:
            return -1, acc, nacc, bp
    if q > qmax:
        return -1, acc, nacc, bp
    r = 0
    if b > 0:
        acc, nacc, bp = _refill(buf, acc, nacc, bp)
        peek = np.int64(acc >> _U64(64 - b))       # b bits; the first b - 1 are x
        x = peek >> 1
        longer = np.int64(x >= cut)                # branch-free: this bit is a coin toss
        r = x + longer * (peek - cut - x)
        used = b - 1 + longer
        acc = acc << _U64(used)
        nacc -= used
    v = q * m + r
    if v > vmax:
        return -1, acc, nacc, bp
    return v, acc, nacc, bp


@njit(cache=True, nogil=True)
def _parse_param(byte):
    """(mode, polarity, j) of a parameter byte, or mode -1 when it is invalid."""
    if byte == 0:
        return _NONE, 0, 0
    if byte == 1:
        return _ALL, 1, 0
    v = byte - 2
    j = v >> 1
    if j > MAX_J:
        return -1, 0, 0
    return _GOLOMB, v & 1, j


@njit(cache=True, nogil=True)
def _padded(payload, start, stop):
    out = np.zeros(stop - start + _PAD, np.uint8)
    out[:stop - start] = payload[start:stop]
    return out


@njit(cache=True, nogil=True)
def _stream_end_ok(acc, nacc, bp, L):
    """0 when the stream was read to its last byte, not beyond, and its padding bits are zero."""
    used = 8 * bp - nacc
    if used > 8 * L:
        return 10
    if (used + 7) // 8 != L:
        return 11
    k = 8 * L - used          # padding bits: the next k bits held in acc (bp >= L here)
    if k > 0 and (acc >> _U64(64 - k)) != _U64(0):
        return 11
    return 0


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
        if mode != _NONE:
            A += 1
    if pmode[lo] == _NONE or pmode[hi] == _NONE:
        return 4, 0, 0, z, z, z, z, z, z, z, 0, 0
    q = HEADER_MIN + R
    if L < q + 2 * A + 4:
        return 1, 0, 0, z, z, z, z, z, z, z, 0, 0
    for c in range(lo, hi + 1):
        if pmode[c] == _NONE:
            continue
        mode, p, jj = _parse_param(payload[q])
        v = np.int64(payload[q + 1])
        q += 2
        if mode < 0 or v > MAX_J:
            return 3, 0, 0, z, z, z, z, z, z, z, 0, 0
        if mode == _NONE and v != 0:
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
def _decode_positions(buf, P, old, count, mbits, lo, hi, pmode, ppol, pj, out_pos, ccls):
    """The position stream (``buf``: its P bytes then _PAD zeros): changed positions and
    their classes into ``out_pos``/``ccls``. Returns 0 or an error code."""
    n = old.shape[0]
    C = pmode.shape[0]
    cmask = C - 1
    pm, pb, pc, _ = _class_params(pj)
    pq = n // pm          # the longest unary run a valid gap can have
    lim = P + 8
    acc = _U64(0)
    nacc = 0
    bp = 0
    # cd[c] >= 0: a class coded by its changes (or NONE: _BIG), cd[c] elements of it before
    # its next event; every element decrements it and the event is where it goes negative.
    # Classes coded by their unchanged elements, and ALL classes, live far below zero
    # (_SPECIAL + countdown), so the common path is one decrement and one sign test.
    cd = np.full(C, _BIG, np.int64)
    for c in range(lo, hi + 1):
        if pmode[c] == _GOLOMB:
            g, acc, nacc, bp = _get_golomb(buf, acc, nacc, bp, pm[c], pb[c], pc[c], pq[c], n)
            if g < 0:
                return 5
            if bp > lim:
                return 10
            cd[c] = g if ppol[c] == 0 else _SPECIAL + g
        elif pmode[c] == _ALL:
            cd[c] = _SPECIAL + _BIG_SPECIAL
    j = 0
    for i in range(n):
        c = np.int64(_U64(old[i]) >> _U64(mbits)) & cmask
        r = cd[c] - 1
        cd[c] = r
        if r >= 0:
            continue
        if r == -1:                      # an event of a class coded by its changes
            g, acc, nacc, bp = _get_golomb(buf, acc, nacc, bp, pm[c], pb[c], pc[c], pq[c], n)
            if g < 0:
                return 5
            if bp > lim:
                return 10
            cd[c] = g
        elif r - _SPECIAL == -1:         # an event of a class coded by its unchanged elements
            g, acc, nacc, bp = _get_golomb(buf, acc, nacc, bp, pm[c], pb[c], pc[c], pq[c], n)
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
        if pmode[c] == _GOLOMB and cd[c] != (0 if ppol[c] == 0 else _SPECIAL):
            return 8
    return _stream_end_ok(acc, nacc, bp, P)


@njit(cache=True, nogil=True)
def _decode_steps(buf, S, old, width_bits, lo, hi, zmode, zpol, zj, vj, out_pos, ccls, out_val):
    """The step stream (``buf``: its S bytes then _PAD zeros): the new bits of every
    change into ``out_val``. Returns 0 or an error code."""
    count = out_pos.shape[0]
    C = zmode.shape[0]
    mask = _U64(0xFFFFFFFFFFFFFFFF) >> _U64(64 - width_bits)
    signbit = _U64(1) << _U64(width_bits - 1)
    vmax = (1 << (width_bits - 1)) - 2
    zm, zb, zc, _ = _class_params(zj)
    vm, vb, vc, _ = _class_params(vj)
    zq = count // zm
    vq = vmax // vm
    lim = S + 8
    acc = _U64(0)
    nacc = 0
    bp = 0
    zcd = np.full(C, _BIG, np.int64)    # as cd in _decode_positions, over the changes
    big_if_quiet = np.zeros(C, np.uint8)
    for c in range(lo, hi + 1):
        if zmode[c] == _GOLOMB:
            g, acc, nacc, bp = _get_golomb(buf, acc, nacc, bp, zm[c], zb[c], zc[c], zq[c], count)
            if g < 0:
                return 5
            if bp > lim:
                return 10
            zcd[c] = g
            big_if_quiet[c] = zpol[c]
        elif zmode[c] == _ALL:
            big_if_quiet[c] = 1
    for t in range(count):
        c = np.int64(ccls[t])
        acc, nacc, bp = _refill(buf, acc, nacc, bp)
        s = np.int64(acc >> _U64(63))
        acc = acc << _U64(1)
        nacc -= 1
        r = zcd[c]
        if r != 0:
            zcd[c] = r - 1
            big = big_if_quiet[c] == 1
        else:
            g, acc, nacc, bp = _get_golomb(buf, acc, nacc, bp, zm[c], zb[c], zc[c], zq[c], count)
            if g < 0:
                return 5
            zcd[c] = g
            big = big_if_quiet[c] == 0
        a = 0
        if big:
            v, acc, nacc, bp = _get_golomb(buf, acc, nacc, bp, vm[c], vb[c], vc[c], vq[c], vmax)
            if v < 0:
                return 5
            a = v + 1
        if bp > lim:
            return 10
        z = _U64(2 * a + s + 1)
        if z > mask:
            return 12
        if z & _U64(1):
            d = mask - (z >> _U64(1))
        else:
            d = z >> _U64(1)
        o = _U64(old[out_pos[t]])
        out_val[t] = _unkey((_key(o, signbit, mask) + d) & mask, signbit, mask)
    for c in range(lo, hi + 1):
        if zmode[c] == _GOLOMB and zcd[c] != 0:
            return 9
    return _stream_end_ok(acc, nacc, bp, S)


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
    err = _decode_positions(_padded(payload, q, q + P), P, old, count, mbits, lo, hi,
                            pmode, ppol, pj, out_pos, ccls)
    if err:
        return err
    L = payload.shape[0]
    return _decode_steps(_padded(payload, q + P, L), L - q - P, old, width_bits, lo, hi,
                         zmode, zpol, zj, vj, out_pos, ccls, out_val)


# --------------------------------------------------------------------------- glue

def encode_ctx(old: np.ndarray, new: np.ndarray, dt: DType, changed: int) -> tuple[bytes, tuple] | None:
    """The encoding-4 payload of one chunk with ``changed`` >= 1 differing elements, and the
    sparse encoding's ``(gaps, steps, max_gap, max_step)`` found on the way (what
    ``kernels.sparse_extract`` returns); None when the dtype has no context layout."""
    lay = layout_of(dt)
    if lay is None or changed < 1:
        return None
    out, sparse = ctx_encode(old, new, changed, 8 * dt.itemsize, lay[0], lay[1])
    if out.shape[0] == 0:
        raise AssertionError("ctx encoder: inconsistent change count")  # a bug, never data
    return out.tobytes(), sparse


def decode_ctx(payload: bytes | memoryview, old: np.ndarray, count: int, dt: DType,
               where: str) -> tuple[np.ndarray, np.ndarray]:
    """Chunk-local positions (int64) and new bits of an encoding-4 chunk."""
    lay = layout_of(dt)
    if lay is None:
        raise FormatError(f"{where}: encoding ctx is not defined for dtype {dt.name}")
    if not 1 <= count <= old.shape[0]:
        raise FormatError(f"{where}: ctx chunk count {count} outside [1, {old.shape[0]}]")
    buf = np.frombuffer(payload, np.uint8)
    positions = np.empty(count, np.int64)
    values = np.empty(count, dt.bits_dtype)
    err = ctx_decode(buf, old, count, 8 * dt.itemsize, lay[0], lay[1], positions, values)
    if err:
        raise FormatError(f"{where}: corrupt ctx payload ({_ERRORS.get(err, f'error {err}')})")
    return positions, values
