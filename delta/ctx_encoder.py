"""The ctx encoder (chunk encoding 4): numba kernels from a chunk's parent and new bits to a payload.

Passes: :func:`_scan` goes once over the chunk (class sizes; every change with its
class, class-local rank and step; it also counts them); :func:`_unchanged_events` goes again only when a
mostly-changed class is worth coding by its unchanged elements; everything else is
work per change: models (:func:`_position_models`, :func:`_step_models`), gaps, and
:func:`_assemble`, which writes the class table and both bit streams in the order
the decoder reads them. Policy choices (polarities, Golomb parameters) are the
encoder's; docs/FORMAT.md fixes only what they mean.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from ckptdelta.delta.ctx_bits import ALL, GOLOMB, HEADER_MIN, MAX_J, NONE, U64, ceil_log2, class_params, key, m_of


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
    while j < MAX_J and m_of(j) < m:
        j += 1
    return j


# --------------------------------------------------------------------------- bit writer

@njit(cache=True, nogil=True, inline="always")
def _put(w, acc, nb, k, val, n):
    """Append the ``n`` (1..32) low bits of ``val``, most significant first, to the stream of
    32-bit words ``w``. ``acc`` holds ``nb`` < 32 pending bits, left-aligned. Branch-free:
    the top word is stored every time and ``k`` moves on once it is complete (one store
    per code where a byte writer needs several); bits left over past a completed word
    stay in ``acc`` until the next call, or the caller's final store."""
    acc |= U64(val) << U64(64 - nb - n)
    nb += n
    w[k] = np.uint32(acc >> U64(32))
    full = np.int64(nb >= 32)
    k += full
    acc = acc << U64(32 * full)
    nb -= 32 * full
    return acc, nb, k


@njit(cache=True, nogil=True, inline="always")
def _put_golomb(w, acc, nb, k, v, m, b, cut, rinv):
    q, r = _qr(v, m, rinv)
    while q > 24:
        acc, nb, k = _put(w, acc, nb, k, 0xFFFFFF, 24)
        q -= 24
    longer = np.int64(r >= cut) if b > 0 else 0
    rb = b - 1 + longer if b > 0 else 0         # remainder bits: b - 1 or b (0 when m = 1)
    code = ((((1 << q) - 1) << 1) << rb) | (r + longer * cut)
    n = q + 1 + rb                              # <= 25 + 23
    if n > 32:
        acc, nb, k = _put(w, acc, nb, k, code >> 16, n - 16)
        return _put(w, acc, nb, k, code & 0xFFFF, 16)
    return _put(w, acc, nb, k, code, n)


@njit(cache=True, nogil=True, inline="always")
def _first_gaps(w, mode, init, m, b, cut, rinv):
    """Start a stream in ``w``: the first gap of every Golomb-coded class, in class order."""
    acc = U64(0)
    nb = 0
    k = 0
    for c in range(mode.shape[0]):
        if mode[c] == GOLOMB:
            acc, nb, k = _put_golomb(w, acc, nb, k, init[c], m[c], b[c], cut[c], rinv[c])
    return acc, nb, k


@njit(cache=True, nogil=True)
def _bytes_of(w, k, nb, out, pos):
    """Copy the ``32 k + nb`` bits of word stream ``w`` into ``out`` at byte ``pos``,
    the last byte completed with zero bits; returns the end position."""
    nbytes = (32 * k + nb + 7) // 8
    for i in range(nbytes):
        out[pos + i] = np.uint8((w[i >> 2] >> np.uint32(24 - 8 * (i & 3))) & np.uint32(0xFF))
    return pos + nbytes


@njit(cache=True, nogil=True, inline="always")
def _param_byte(mode, pol, j):
    if mode == NONE:
        return 0
    if mode == ALL:
        return 1
    return 2 + 2 * j + pol


@njit(cache=True, nogil=True)
def _flag_model(n_items, n_set):
    """(mode, polarity, j) of a flag sequence with ``n_set`` of ``n_items`` set: the rarer
    value is the event, its gaps Golomb-coded with the parameter fit to its rate."""
    if n_set == 0:
        return NONE, 0, 0
    if n_set == n_items:
        return ALL, 1, 0
    pol = 1 if 2 * n_set > n_items else 0
    ev = n_items - n_set if pol else n_set
    return GOLOMB, pol, _j_for_p(ev / n_items)


@njit(cache=True, nogil=True)
def change_steps(cold, cnew, ccls, C, signbit, mask):
    """Each change's step from its old and new bits (encodings 4 and 5): sign (1: the key goes
    up) and magnitude - 1 (< 2**15: widths 8 and 16); and the changes per class."""
    j = cold.shape[0]
    ca = np.empty(j, np.int32)
    csign = np.empty(j, np.uint8)
    kcls = np.zeros(C, np.int64)
    for t in range(j):
        o = U64(cold[t])
        v = U64(cnew[t])
        d = (key(v, signbit, mask) - key(o, signbit, mask)) & mask
        up = U64(d < signbit)                        # z - 1, branch-free (the direction is a coin toss)
        u = up * ((d << U64(1)) - U64(1)) + (U64(1) - up) * ((mask - d) << U64(1))
        csign[t] = np.uint8(u & U64(1))
        ca[t] = np.int32(u >> U64(1))
        kcls[ccls[t]] += 1
    return csign, ca, kcls


@njit(cache=True, nogil=True)
def _scan(old, new, old4, new4, width_bits, mbits, C, signbit, mask, cpos, ccls, crank, cold, cnew):
    """Class sizes, changes per class, and every change: position, class, class-local rank,
    sign and magnitude - 1 of its step; one pass, which also counts the changes.

    ``old4``/``new4`` are the first ``4 * len(old4)`` elements as one word per four
    (uint64 for 16-bit dtypes, uint32 for 8-bit ones, little-endian as the elements):
    one compare finds the (rare) changed groups. Element ``4g + k`` counts in histogram
    bank ``k``, so consecutive elements of one class do not serialise on one counter.
    Inside the pass a change records only its position, class, rank and both bit patterns,
    into the caller's scratch arrays ``cpos``/``ccls``/``crank``/``cold``/``cnew`` (at least
    as long as the chunk, reused from chunk to chunk: fresh ones cost page faults); its
    step is worked out after the pass from those, in order (reading the two elements again
    there waits on the cache), which takes a good part off this pass (benchmarks/stages.py
    times it, "scan"). Returns the change arrays cut to the changes found (views of the scratch)."""
    n = old.shape[0]
    cm = U64(C - 1)
    h = np.zeros((4, C), np.int32)
    j = 0
    wb = U64(width_bits)
    mb = U64(mbits)
    s1 = wb + mb
    s2 = U64(2) * wb + mb
    s3 = U64(3) * wb + mb
    for g in range(old4.shape[0]):
        a = U64(old4[g])
        b = U64(new4[g])
        h[0, (a >> mb) & cm] += 1
        h[1, (a >> s1) & cm] += 1
        h[2, (a >> s2) & cm] += 1
        h[3, (a >> s3) & cm] += 1
        if a != b:
            x = a ^ b
            for k in range(4):
                sh = U64(k) * wb
                if (x >> sh) & mask:
                    c = np.int64(((a >> sh) >> mb) & cm)
                    later = 0               # the group's later elements of the class, counted already
                    for k2 in range(k + 1, 4):
                        later += np.int64(((a >> (U64(k2) * wb + mb)) & cm) == U64(c))
                    cpos[j] = 4 * g + k
                    ccls[j] = c
                    crank[j] = h[0, c] + h[1, c] + h[2, c] + h[3, c] - 1 - later
                    cold[j] = np.int32((a >> sh) & mask)
                    cnew[j] = np.int32((b >> sh) & mask)
                    j += 1
    for i in range(4 * old4.shape[0], n):
        a = U64(old[i])
        c = np.int64((a >> mb) & cm)
        h[0, c] += 1
        if a != U64(new[i]):
            cpos[j] = i
            ccls[j] = c
            crank[j] = h[0, c] + h[1, c] + h[2, c] + h[3, c] - 1
            cold[j] = np.int32(a)
            cnew[j] = np.int32(new[i])
            j += 1
    csign, ca, kcls = change_steps(cold[:j], cnew[:j], ccls[:j], C, signbit, mask)
    ncls = np.zeros(C, np.int64)
    for c in range(C):
        ncls[c] = h[0, c] + h[1, c] + h[2, c] + h[3, c]
    return ncls, kcls, cpos[:j], ccls[:j], crank[:j], csign, ca


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
        if pmode[c] == GOLOMB:
            p = kcls[c] / ncls[c]
            h = -(p * math.log2(p) + (1.0 - p) * math.log2(1.0 - p))
            est += ncls[c] * h
            if ppol[c] == 1:
                gain += ncls[c] * (1.0 - h)
    ucount = 0
    for c in range(C):
        if pmode[c] == GOLOMB and ppol[c] == 1:
            if gain < 0.01 * est:
                ppol[c] = 0
                pj[c] = 0
            else:
                ucount += ncls[c] - kcls[c]
    return pmode, ppol, pj, ucount


@njit(cache=True, nogil=True, inline="always")
def _unchanged_one(o, v, c, i, cnt, upos, ucls, urank, t):
    r = cnt[c]
    cnt[c] = r + 1
    upos[t] = i
    ucls[t] = c
    urank[t] = r
    return t + np.int64(o == v)


@njit(cache=True, nogil=True)
def _unchanged_events(old, new, old4, new4, width_bits, mbits, pmode, ppol, ucount):
    """Position, class and class-local rank of the unchanged elements of the classes
    whose events are their unchanged elements (a second pass; only when there are any).
    Groups of four (``old4``/``new4`` as in :func:`_scan`) whose classes all lie outside
    the range of those classes, nearly all of them, are passed over on one SWAR range test
    of the four class fields at once (no table look-up, which shows at lr 1e-5, where this
    pass runs on most chunks)."""
    C = pmode.shape[0]
    cm = U64(C - 1)
    upos = np.empty(ucount + 4, np.int32)
    ucls = np.empty(ucount + 4, np.int32)
    urank = np.empty(ucount + 4, np.int32)
    if ucount == 0:
        return upos[:0], ucls[:0], urank[:0]
    want = np.zeros(C, np.uint8)
    wlo, whi = C, 0
    for c in range(C):
        want[c] = pmode[c] == GOLOMB and ppol[c] == 1
        if want[c]:
            wlo = min(wlo, c)
            whi = max(whi, c)
    cnt = np.zeros(C, np.int64)
    t = 0
    wb = U64(width_bits)
    mb = U64(mbits)
    mask = U64(0xFFFFFFFFFFFFFFFF) >> U64(64 - width_bits)
    # four fields of width_bits, each the class of one element (mbits + ebits < width_bits, so a
    # field's top bit is free): X's top bit is set where class >= wlo (no borrow crosses a field,
    # as each field holds its top bit minus at most C - 1), Y's where class - wlo > whi - wlo
    top = U64(1) << (wb - U64(1))
    one = U64(1) | (U64(1) << wb) | (U64(1) << (U64(2) * wb)) | (U64(1) << (U64(3) * wb))
    hrep, crep = top * one, cm * one
    lorep, krep = U64(wlo) * one, (top - U64(1) - U64(whi - wlo)) * one
    for g in range(old4.shape[0]):
        a = U64(old4[g])
        x = (((a >> mb) & crep) | hrep) - lorep
        y = (x & ~hrep) + krep
        if x & ~y & hrep:
            b = U64(new4[g])
            for k in range(4):
                sh = U64(k) * wb
                o = (a >> sh) & mask
                c = np.int64((o >> mb) & cm)
                if want[c]:
                    t = _unchanged_one(o, (b >> sh) & mask, c, 4 * g + k, cnt, upos, ucls, urank, t)
    for i in range(4 * old4.shape[0], old.shape[0]):
        o = U64(old[i])
        c = np.int64((o >> mb) & cm)
        if want[c]:
            t = _unchanged_one(o, U64(new[i]), c, i, cnt, upos, ucls, urank, t)
    return upos[:t], ucls[:t], urank[:t]


@njit(cache=True, nogil=True)
def _position_gaps(ncls, ccls, crank, pmode, ppol, ucls, urank):
    """The gap after each event (to the next event of its class, or to the class's end;
    -1 for changes that are not events) and each class's first gap."""
    count = ccls.shape[0]
    nxt = ncls.copy()
    cgap = np.empty(count, np.int32)
    for t in range(count - 1, -1, -1):
        c = ccls[t]
        if pmode[c] == GOLOMB and ppol[c] == 0:
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


_H = 64     # magnitudes below this are costed from a per-class histogram, the rest one by one


@njit(cache=True, nogil=True)
def _step_models(kcls, ccls, ca):
    """Per class: the big-flag model, each big-flag event's gap (-1 elsewhere), the first
    gaps, the magnitude parameter index (the cheapest of six around the fit to the
    mean: magnitudes have heavier tails than a geometric law), and the sum of the coded
    magnitudes (for the payload's size bound)."""
    C = kcls.shape[0]
    count = ccls.shape[0]
    # Only the classes that hold a change have a histogram row: a class without one keeps zero counts and
    # the NONE model (_flag_model(0, 0), zeros), and a chunk of a few changes in a small tensor then pays for
    # the handful of classes it touches, not for all 2**ebits (256 x 64 counters for bf16, set up per chunk).
    row = np.full(C, -1, np.int64)
    act = np.empty(C, np.int64)
    nact = 0
    for c in range(C):
        if kcls[c]:
            row[c] = nact
            act[nact] = c
            nact += 1
    hist = np.zeros((nact, _H + 1), np.int32)   # ca (magnitude - 1) per class; _H: ca >= _H
    for t in range(count):
        hist[row[ccls[t]], min(np.int64(ca[t]), _H)] += 1
    nzc = np.zeros(C, np.int64)
    vsum = np.zeros(C, np.int64)                # sum of ca - 1 over the big steps
    tail = False
    for r in range(nact):
        c = act[r]
        for a in range(1, _H):
            nzc[c] += hist[r, a]
            vsum[c] += hist[r, a] * (a - 1)
        nzc[c] += hist[r, _H]
        tail |= hist[r, _H] > 0
    if tail:
        for t in range(count):
            if ca[t] >= _H:
                vsum[ccls[t]] += ca[t] - 1
    zmode = np.zeros(C, np.int64)               # NONE
    zpol = np.zeros(C, np.int64)
    zj = np.zeros(C, np.int64)
    for r in range(nact):
        c = act[r]
        zmode[c], zpol[c], zj[c] = _flag_model(kcls[c], nzc[c])
    nxt = kcls.copy()
    seen = kcls.copy()
    zgap = np.empty(count, np.int32)
    for t in range(count - 1, -1, -1):
        c = ccls[t]
        i = seen[c] - 1     # index of this change among its class's changes
        seen[c] = i
        ev = np.int64(zmode[c] == GOLOMB) * np.int64((ca[t] > 0) != (zpol[c] == 1))   # branch-free
        zgap[t] = ev * (nxt[c] - i) - 1
        nxt[c] = ev * i + (1 - ev) * nxt[c]
    NV = 6
    vj0 = np.zeros(C, np.int64)
    cm = np.ones((C, NV), np.int64)
    cb = np.zeros((C, NV), np.int64)
    cr = np.ones((C, NV), np.float64)
    vcost = np.zeros((C, NV), np.int64)
    for r in range(nact):
        c = act[r]
        if nzc[c] == 0:
            continue
        vj0[c] = max(0, min(MAX_J - NV + 1, _j_for_p(1.0 / (vsum[c] / nzc[c] + 1.0)) - NV // 2))
        for k in range(NV):
            m = m_of(vj0[c] + k)
            cm[c, k] = m
            cb[c, k] = ceil_log2(m)
            cr[c, k] = 1.0 / m
            for a in range(1, _H):
                if hist[r, a]:
                    vcost[c, k] += hist[r, a] * _golomb_bits(a - 1, m, cb[c, k], (1 << cb[c, k]) - m, cr[c, k])
    if tail:
        for t in range(count):
            if ca[t] >= _H:
                c = ccls[t]
                for k in range(NV):
                    vcost[c, k] += _golomb_bits(ca[t] - 1, cm[c, k], cb[c, k], (1 << cb[c, k]) - cm[c, k], cr[c, k])
    vj = np.zeros(C, np.int64)
    for c in range(C):
        if nzc[c] > 0:
            vj[c] = vj0[c] + np.argmin(vcost[c])
    return zmode, zpol, zj, zgap, nxt, vj, vsum


@njit(cache=True, nogil=True, inline="always")
def _bound(total, events, m, b):
    """Most bits ``events`` Golomb codes (parameter m, b) with values summing to <= ``total`` take:
    each code is (v div m) + 1 + (<= b) bits."""
    return total // m + events * (1 + b)


@njit(cache=True, nogil=True)
def step_stream(sbits, ccls, zmode, zinit, zgap, zj, vj, csign, ca):
    """The step stream (encodings 4 and 5 share it), in at most ``sbits`` bits: first the
    big-flag gaps of each class, then per change its sign, its big-flag gap at events and
    its magnitude. Returns (32-bit words, complete words, pending bits)."""
    zm, zb, zc, zr = class_params(zj)
    vm, vb, vc, vr = class_params(vj)
    sw = np.zeros(sbits // 32 + 2, np.uint32)
    acc, nb, k = _first_gaps(sw, zmode, zinit, zm, zb, zc, zr)
    for t in range(ccls.shape[0]):
        c = ccls[t]
        acc, nb, k = _put(sw, acc, nb, k, csign[t], 1)
        if zgap[t] >= 0:
            acc, nb, k = _put_golomb(sw, acc, nb, k, zgap[t], zm[c], zb[c], zc[c], zr[c])
        if ca[t] > 0:
            acc, nb, k = _put_golomb(sw, acc, nb, k, ca[t] - 1, vm[c], vb[c], vc[c], vr[c])
    sw[k] = np.uint32(acc >> U64(32))
    return sw, k, nb


@njit(cache=True, nogil=True)
def _assemble(ncls, kcls, pmode, ppol, pj, pinit, cpos, ccls, cgap, upos, ucls, ugap,
              zmode, zpol, zj, zinit, zgap, vj, vsum, csign, ca):
    """Class table, position stream and step stream, in the decoder's order.

    Each stream is written into 32-bit words sized by a bound (per class: the gaps of a
    flag sequence sum to at most its length), not by a first pass that codes everything
    twice, then copied after the class table."""
    C = pmode.shape[0]
    count = cpos.shape[0]
    ucount = upos.shape[0]
    pm, pb, pc, pr = class_params(pj)
    zm, zb, _, _ = class_params(zj)
    vm, vb, _, _ = class_params(vj)
    pbits = 0
    sbits = count
    lo = C
    hi = -1
    A = 0
    for c in range(C):
        if pmode[c] != NONE:
            lo = min(lo, c)
            hi = max(hi, c)
            A += 1
        if pmode[c] == GOLOMB:
            pbits += _bound(ncls[c], ncls[c] + 1, pm[c], pb[c]) if ppol[c] else \
                _bound(ncls[c], kcls[c] + 1, pm[c], pb[c])
        if zmode[c] == GOLOMB:
            sbits += _bound(kcls[c], kcls[c] + 1, zm[c], zb[c])
        sbits += _bound(vsum[c], kcls[c], vm[c], vb[c])
    R = hi - lo + 1
    hdr = HEADER_MIN + R + 2 * A + 4
    # position stream: first gaps, then the gap after each event, in element order
    pw = np.zeros(pbits // 32 + 2, np.uint32)
    acc, nb, k = _first_gaps(pw, pmode, pinit, pm, pb, pc, pr)
    t = 0
    s = 0
    while t < count or s < ucount:
        if s < ucount and (t == count or upos[s] < cpos[t]):
            c = ucls[s]
            acc, nb, k = _put_golomb(pw, acc, nb, k, ugap[s], pm[c], pb[c], pc[c], pr[c])
            s += 1
        else:
            if cgap[t] >= 0:
                c = ccls[t]
                acc, nb, k = _put_golomb(pw, acc, nb, k, cgap[t], pm[c], pb[c], pc[c], pr[c])
            t += 1
    pw[k] = np.uint32(acc >> U64(32))           # the pending bits a completed word left over
    pk, pnb = k, nb
    sw, k, nb = step_stream(sbits, ccls, zmode, zinit, zgap, zj, vj, csign, ca)
    P = (32 * pk + pnb + 7) // 8
    out = np.empty(hdr + P + (32 * k + nb + 7) // 8, np.uint8)
    out[0] = lo & 0xFF
    out[1] = lo >> 8
    out[2] = hi & 0xFF
    out[3] = hi >> 8
    q = HEADER_MIN + R
    for c in range(lo, hi + 1):
        out[HEADER_MIN + c - lo] = _param_byte(pmode[c], ppol[c], pj[c])
        if pmode[c] != NONE:
            out[q] = _param_byte(zmode[c], zpol[c], zj[c])
            out[q + 1] = vj[c]
            q += 2
    for i in range(4):
        out[q + i] = (P >> (8 * i)) & 0xFF
    pos = _bytes_of(pw, pk, pnb, out, hdr)
    pos = _bytes_of(sw, k, nb, out, pos)
    return out


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
def sparse_estimate(gaps, steps, max_gap, max_step):
    """Bytes encoding 1 would need if zstd found no repeats: the order-0 entropy of each of
    its byte planes, plus frame overheads. zstd's literal coding does not beat order-0 on
    patternless data, so a ctx payload far below this is smaller than sparse's."""
    count = gaps.shape[0]
    if count == 0:
        return 0.0
    pa = 1
    while pa < 4 and (max_gap >> (8 * pa)) > 0:
        pa += 1
    pb = 1
    while pb < 8 and (max_step >> (8 * pb)) > 0:
        pb += 1
    # Every plane's histogram in one pass, each kept in four copies (change t counts in copy t % 4): the
    # high planes are mostly zero, and one copy would make each increment wait on the store before it.
    hist = np.zeros((4, 12, 256), np.int32)
    for t in range(count):
        c = t & 3
        g = np.int64(gaps[t])
        for p in range(pa):
            hist[c, p, (g >> (8 * p)) & 0xFF] += 1
        z = np.int64(steps[t])
        for p in range(pb):
            hist[c, pa + p, (z >> (8 * p)) & 0xFF] += 1
    bits = 0.0
    for p in range(pa + pb):
        for v in range(256):
            h = np.int64(hist[0, p, v]) + hist[1, p, v] + hist[2, p, v] + hist[3, p, v]
            if h:
                bits -= h * math.log2(h / count)
    return bits / 8.0 + 24.0


@njit(cache=True, nogil=True)
def ctx_encode(old, new, old4, new4, width_bits, mbits, ebits, scratch):
    """Encoding-4 payload of one chunk (empty when no element differs), and encoding 1's
    gaps and steps of the same changes (:func:`_sparse_parts`; their length is the
    number of changes). ``old4``/``new4``: see :func:`_scan`; ``scratch``: int32 of shape
    (5, >= len(old)), the scan's change arrays (its content is not used; reused across calls).

    One pass over the elements finds and counts the changes; a second runs only when
    some class is coded by its unchanged elements (more than half of it changed). The
    rest is work per change."""
    C = 1 << ebits
    mask = U64(0xFFFFFFFFFFFFFFFF) >> U64(64 - width_bits)
    signbit = U64(1) << U64(width_bits - 1)
    ncls, kcls, cpos, ccls, crank, csign, ca = _scan(old, new, old4, new4, width_bits, mbits, C, signbit, mask,
                                                     scratch[0], scratch[1], scratch[2], scratch[3], scratch[4])
    count = cpos.shape[0]
    if count == 0:
        return np.empty(0, np.uint8), _sparse_parts(cpos, csign, ca)
    pmode, ppol, pj, ucount = _position_models(ncls, kcls, count)
    upos, ucls, urank = _unchanged_events(old, new, old4, new4, width_bits, mbits, pmode, ppol, ucount)
    cgap, ugap, pinit = _position_gaps(ncls, ccls, crank, pmode, ppol, ucls, urank)
    zmode, zpol, zj, zgap, zinit, vj, vsum = _step_models(kcls, ccls, ca)
    return _assemble(ncls, kcls, pmode, ppol, pj, pinit, cpos, ccls, cgap, upos, ucls, ugap,
                     zmode, zpol, zj, zinit, zgap, vj, vsum, csign, ca), _sparse_parts(cpos, csign, ca)
