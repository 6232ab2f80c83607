"""Chunk encoding 5 ("gctx"): encoding 4's contexts, with the changed positions coded per
*group* of classes, so that both ends find them 64 elements at a time.

Why: encoding 4 codes positions per class, so its decoder keeps one countdown per
class and walks every element, a load and a store on a counter that the next
element may need (more per element than XOR+zstd's whole decode).
Here adjacent exponent classes share one position model (a *group*, at most four per
chunk), each group's elements form a bit mask per 64-element word (a few vector
compares), and a gap is skipped a word at a time by counting the mask's bits. The
steps keep encoding 4's per-class models (that work is per change, not per element).
Grouping costs a few percent more position bits per change than encoding 4 on the
reference model; both ends run much faster (benchmarks/stages.py times the stages).

Layout, groups and bit order are fixed by docs/FORMAT.md ("Encoding 5: gctx"); the
step stream and the Golomb codes are encoding 4's (delta/ctx_encoder.py,
delta/ctx_decoder.py, delta/ctx_bits.py). As there, every length, count and value
taken from a payload is checked before it is used; errors are small integer codes.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit
from numba.core import config

from ckptdelta.delta.ctx_bits import ALL, GOLOMB, MAX_J, NONE, U64, ceil_log2, class_params, m_of
from ckptdelta.delta.ctx_decoder import (_BIG, _PAD_WORDS, _decode_steps, _get_golomb, _parse_param, _peek,
                                         _stream_end_ok)
from ckptdelta.delta.masks import neq_mask64, range_mask64
from ckptdelta.delta.ctx_encoder import (_bound, _bytes_of, _j_for_p, _param_byte, _put_golomb, _sparse_parts,
                                         _step_models, change_steps, step_stream)

GMAX = 4            # most groups a payload may have
SAMPLE_EVERY = 16   # the encoder sizes classes from every 16th word of 64 elements

if config.DISABLE_JIT:  # plain Python (coverage runs): no LLVM intrinsic, no wrapping uint64 products
    def popcount(x):
        return int(x).bit_count()

    def trailing_zeros(x):
        return (int(x) & -int(x)).bit_length() - 1
else:
    from numba.cpython.unsafe.numbers import trailing_zeros

    @njit(cache=True, nogil=True, inline="always")
    def popcount(x):
        """Set bits of a uint64 (LLVM turns this idiom into one popcnt)."""
        x = x - ((x >> U64(1)) & U64(0x5555555555555555))
        x = (x & U64(0x3333333333333333)) + ((x >> U64(2)) & U64(0x3333333333333333))
        x = (x + (x >> U64(4))) & U64(0x0F0F0F0F0F0F0F0F)
        return np.int64((x * U64(0x0101010101010101)) >> U64(56))


def _select_table() -> np.ndarray:
    """``t[l * 256 + byte]``: the position of the ``l``-th (from 0) set bit of ``byte``."""
    t = np.full(8 * 256, 8, np.uint8)
    for byte in range(256):
        for l, p in enumerate(i for i in range(8) if byte >> i & 1):
            t[l * 256 + byte] = p
    return t


_SELECT_IN_BYTE = _select_table()
_L8 = U64(0x0101010101010101)
_H8 = U64(0x8080808080808080)

if config.DISABLE_JIT:
    def _select(m, r):
        """The ``r``-th (from 0) lowest set bit of ``m`` as a one-bit word; ``r`` < popcount(m)."""
        m = int(m)
        for _ in range(int(r)):
            m &= m - 1
        return U64(m & -m)
else:
    @njit(cache=True, nogil=True, inline="always")
    def _select(m, r):
        """The ``r``-th (from 0) lowest set bit of ``m`` as a one-bit word; ``r`` < popcount(m).
        Broadword (no loop, no branch: Vigna's select in a word): byte-wise prefix counts of the
        set bits, one compare of all eight bytes with ``r`` finds the byte, a table the bit in it.
        Clearing bits one by one or halving the word costs several times more, in mispredictions."""
        s = m - ((m >> U64(1)) & U64(0x5555555555555555))
        s = (s & U64(0x3333333333333333)) + ((s >> U64(2)) & U64(0x3333333333333333))
        s = ((s + (s >> U64(4))) & U64(0x0F0F0F0F0F0F0F0F)) * _L8      # byte i: set bits of bytes 0..i
        rr = U64(r) * _L8
        le = (((rr | _H8) - (s & ~_H8)) ^ s ^ rr) & _H8                 # bytes whose count is <= r
        b = ((le >> U64(7)) * _L8 >> U64(53)) & ~U64(7)                 # bit offset of the byte with it
        left = U64(r) - (((s << U64(8)) >> b) & U64(0xFF))
        return U64(1) << (b + U64(_SELECT_IN_BYTE[np.int64((left << U64(8)) | ((m >> b) & U64(0xFF)))]))


@njit(cache=True, nogil=True, inline="always")
def _member(x, base, n, em, lo, wd):
    """Bit j of the result: ``lo <= x[base + j] & em < lo + wd`` for the ``n`` (<= 64) elements
    from ``base``: one vector compare for a whole word (delta/masks.py), a loop for the last."""
    if n == 64:
        return range_mask64(x, base, em, lo, wd)
    m = U64(0)
    b = U64(base)
    for j in range(n):
        e = np.uint32(np.uint32(x[b + U64(j)]) & em) - lo
        m |= U64(np.uint32(e) < wd) << U64(j)
    return m


@njit(cache=True, nogil=True, inline="always")
def _changed_word(a, c, base, n):
    """Bit j: ``a[base + j] != c[base + j]``, for the ``n`` (<= 64) elements from ``base``."""
    if n == 64:
        return neq_mask64(a, c, base)
    m = U64(0)
    b = U64(base)
    for j in range(n):
        m |= U64(a[b + U64(j)] != c[b + U64(j)]) << U64(j)
    return m


@njit(cache=True, nogil=True)
def _group_ranges(t, G, mbits, ebits):
    """(element mask, low bound, width) of each group, on the elements' bits, as uint32."""
    em = np.uint32(((1 << ebits) - 1) << mbits)
    glo = np.zeros(GMAX + 1, np.uint32)
    gwd = np.zeros(GMAX + 1, np.uint32)
    for k in range(G):
        glo[k] = np.uint32(t[k] << mbits)
        gwd[k] = np.uint32((t[k + 1] - t[k]) << mbits)
    return em, glo, gwd


_BLOCK = 256    # words whose masks are worked out at a time (16384 elements; 8 KiB of masks)


@njit(cache=True, nogil=True)
def _masks(old, w0, w1, G, em, glo, gwd, out):
    """Group masks of words w0..w1-1 into out[k, 0 .. w1-w0]. A function of its own: inlined in
    the loops that use the masks, the compares stop vectorising (several times slower)."""
    n = old.shape[0]
    for wi in range(w0, w1):
        base = wi << 6
        nb = min(64, n - base)
        for k in range(G):
            out[k, wi - w0] = _member(old, base, nb, em, glo[k], gwd[k])


# --------------------------------------------------------------------------- decoder

@njit(cache=True, nogil=True)
def _parse_table(payload, C):
    """(error, G, bounds, group modes, polarities, j, sub-stream lengths, the class range the
    step models cover (all classes), big-flag modes, polarities, j, magnitude j, offset of the
    first position sub-stream)."""
    zc = np.zeros(C, np.int64)
    zg = np.zeros(GMAX + 1, np.int64)
    L = payload.shape[0]
    if L < 1:
        return 1, 0, zg, zg, zg, zg, zg, 0, 0, zc, zc, zc, zc, 0
    G = np.int64(payload[0])
    if G < 1 or G > GMAX:
        return 2, 0, zg, zg, zg, zg, zg, 0, 0, zc, zc, zc, zc, 0
    q = 1
    if L < q + 2 * (G + 1) + G + 4 * G + 2:
        return 1, 0, zg, zg, zg, zg, zg, 0, 0, zc, zc, zc, zc, 0
    t = np.zeros(GMAX + 1, np.int64)
    for k in range(G + 1):
        t[k] = np.int64(payload[q]) | (np.int64(payload[q + 1]) << 8)
        q += 2
        if (k > 0 and t[k] <= t[k - 1]) or t[k] > C:
            return 2, 0, zg, zg, zg, zg, zg, 0, 0, zc, zc, zc, zc, 0
    gmode = np.zeros(GMAX + 1, np.int64)
    gpol = np.zeros(GMAX + 1, np.int64)
    gj = np.zeros(GMAX + 1, np.int64)
    for k in range(G):
        mode, p, jj = _parse_param(payload[q])
        q += 1
        if mode < 0:
            return 3, 0, zg, zg, zg, zg, zg, 0, 0, zc, zc, zc, zc, 0
        gmode[k], gpol[k], gj[k] = mode, p, jj
    P = np.zeros(GMAX + 1, np.int64)
    total = 0
    for k in range(G):
        for b in range(4):
            P[k] |= np.int64(payload[q + b]) << (8 * b)
        q += 4
        if gmode[k] != GOLOMB and P[k] != 0:
            return 4, 0, zg, zg, zg, zg, zg, 0, 0, zc, zc, zc, zc, 0
        total += P[k]
    A = np.int64(payload[q]) | (np.int64(payload[q + 1]) << 8)
    q += 2
    if A > C:
        return 2, 0, zg, zg, zg, zg, zg, 0, 0, zc, zc, zc, zc, 0
    if L < q + 3 * A:
        return 1, 0, zg, zg, zg, zg, zg, 0, 0, zc, zc, zc, zc, 0
    zmode = np.zeros(C, np.int64)
    zpol = np.zeros(C, np.int64)
    zj = np.zeros(C, np.int64)
    vj = np.zeros(C, np.int64)
    prev = -1
    for _ in range(A):
        c = np.int64(payload[q])
        mode, p, jj = _parse_param(payload[q + 1])
        v = np.int64(payload[q + 2])
        q += 3
        if c <= prev or c >= C:
            return 2, 0, zg, zg, zg, zg, zg, 0, 0, zc, zc, zc, zc, 0
        if mode < 0 or v > MAX_J:
            return 3, 0, zg, zg, zg, zg, zg, 0, 0, zc, zc, zc, zc, 0
        if mode == NONE:
            return 4, 0, zg, zg, zg, zg, zg, 0, 0, zc, zc, zc, zc, 0
        zmode[c], zpol[c], zj[c], vj[c] = mode, p, jj, v
        prev = c
    if total > L - q:
        return 1, 0, zg, zg, zg, zg, zg, 0, 0, zc, zc, zc, zc, 0
    return 0, G, t, gmode, gpol, gj, P, 0, C - 1, zmode, zpol, zj, vj, q


@njit(cache=True, nogil=True)
def _words_at(payload, start, stop, out, at):
    """payload[start:stop] as big-endian 64-bit words into out[at:], then zero words (``out``
    is zeroed); returns the index after them."""
    L = stop - start
    for k in range(L // 8):
        o = start + 8 * k
        out[at + k] = ((U64(payload[o]) << U64(56)) | (U64(payload[o + 1]) << U64(48))
                       | (U64(payload[o + 2]) << U64(40)) | (U64(payload[o + 3]) << U64(32))
                       | (U64(payload[o + 4]) << U64(24)) | (U64(payload[o + 5]) << U64(16))
                       | (U64(payload[o + 6]) << U64(8)) | U64(payload[o + 7]))
    for i in range(8 * (L // 8), L):
        out[at + (i >> 3)] |= U64(payload[start + i]) << U64(56 - 8 * (i & 7))
    return at + (L + 7) // 8 + _PAD_WORDS


@njit(cache=True, nogil=True)
def _group_positions(w, wstart, P, old, count, mbits, ebits, G, t, gmode, gpol, gj, out_pos, ccls):
    """The changed positions (and their classes) of the chunk, in order, from the groups'
    position sub-streams (``w``: their words; group k's from word ``wstart[k]``)."""
    n = old.shape[0]
    cmask = (1 << ebits) - 1
    em, glo, gwd = _group_ranges(t, G, mbits, ebits)
    pm, pb, pc, _ = class_params(gj)
    pq = n // pm
    bp = np.zeros(GMAX + 1, np.int64)
    lim = np.zeros(GMAX + 1, np.int64)
    left = np.zeros(GMAX + 1, np.int64)
    for k in range(G):
        bp[k] = 64 * wstart[k]
        lim[k] = bp[k] + 8 * P[k] + 64
        if gmode[k] == GOLOMB:
            g, bp[k] = _get_golomb(w, bp[k], pm[k], pb[k], pc[k], pq[k], n, lim[k])
            if g < 0:
                return 5
            if bp[k] > lim[k]:
                return 10
            left[k] = g
    j = 0
    nw = (n + 63) >> 6
    mks = np.empty((GMAX, _BLOCK), np.uint64)
    for wi in range(nw):
        if wi % _BLOCK == 0:
            _masks(old, wi, min(nw, wi + _BLOCK), G, em, glo, gwd, mks)
        base = wi << 6
        chg = U64(0)
        for k in range(G):
            mode = gmode[k]
            if mode == NONE:
                continue
            mk = mks[k, wi % _BLOCK]
            if mode == ALL:
                chg |= mk
                continue
            r = left[k]
            c = popcount(mk)
            if r >= c:
                left[k] = r - c
                if gpol[k] == 1:
                    chg |= mk
                continue
            m = mk
            ev = U64(0)
            while True:
                b = _select(m, r)
                ev |= b
                m &= ~(b | (b - U64(1)))
                g, bp[k] = _get_golomb(w, bp[k], pm[k], pb[k], pc[k], pq[k], n, lim[k])
                if g < 0:
                    return 5
                if bp[k] > lim[k]:
                    return 10
                c = popcount(m)
                if g >= c:
                    left[k] = g - c
                    break
                r = g
            chg |= ev if gpol[k] == 0 else mk & ~ev
        while chg != U64(0):
            if j >= count:
                return 6
            p = base + np.int64(trailing_zeros(chg))
            out_pos[j] = p
            ccls[j] = (np.int64(old[p]) >> mbits) & cmask
            j += 1
            chg &= chg - U64(1)
    if j != count:
        return 7
    for k in range(G):
        if gmode[k] == GOLOMB:
            if left[k] != 0:
                return 8
            err = _stream_end_ok(w[wstart[k]:], bp[k] - 64 * wstart[k], P[k])
            if err:
                return err
    return 0


@njit(cache=True, nogil=True)
def stream_words(payload, G, P, q):
    """The G position streams (from byte ``q``, lengths ``P``) as words in one array, group k's from
    word ``wstart[k]``, each followed by zero words; the step stream after them likewise. Returns
    (position words, wstart, step words, offset of the step stream)."""
    nwords = 0
    for k in range(G):
        nwords += (P[k] + 7) // 8 + _PAD_WORDS
    w = np.zeros(max(nwords, 1), np.uint64)
    wstart = np.zeros(GMAX + 1, np.int64)
    at = 0
    s = q
    for k in range(G):
        wstart[k] = at
        at = _words_at(payload, s, s + P[k], w, at)
        s += P[k]
    L = payload.shape[0]
    sw = np.zeros((L - s + 7) // 8 + _PAD_WORDS, np.uint64)
    _words_at(payload, s, L, sw, 0)
    return w, wstart, sw, s


@njit(cache=True, nogil=True)
def gctx_decode(payload, old, count, width_bits, mbits, ebits, out_pos, out_val):
    """Decode an encoding-5 payload against the chunk's parent bits ``old`` into ``count``
    chunk-local positions and new bits (``out_pos``/``out_val``). Returns 0 or an error code."""
    C = 1 << ebits
    err, G, t, gmode, gpol, gj, P, lo, hi, zmode, zpol, zj, vj, q = _parse_table(payload, C)
    if err:
        return err
    w, wstart, sw, s = stream_words(payload, G, P, q)
    ccls = np.empty(count, np.uint16)
    err = _group_positions(w, wstart, P, old, count, mbits, ebits, G, t, gmode, gpol, gj, out_pos, ccls)
    if err:
        return err
    L = payload.shape[0]
    return _decode_steps(sw, L - s, old, width_bits, lo, hi, zmode, zpol, zj, vj, out_pos, ccls, out_val)


# --------------------------------------------------------------------------- encoder

@njit(cache=True, nogil=True)
def _find_changes(old, new, mbits, cmask, cpos, ccls, cold, cnew, chgw):
    """Every change's position, class and both bit patterns, in order, a word of 64 elements at
    a time. A function of its own: inlined into a larger one, the compares stop vectorising."""
    n = old.shape[0]
    j = 0
    for wi in range((n + 63) >> 6):
        base = wi << 6
        chg = _changed_word(old, new, base, min(64, n - base))
        chgw[wi] = chg
        while chg != U64(0):
            p = base + np.int64(trailing_zeros(chg))
            o = np.int64(old[p])
            cpos[j] = p
            ccls[j] = (o >> mbits) & cmask
            cold[j] = o                 # both bits now, while in cache: read again after the
            cnew[j] = np.int64(new[p])  # pass, they wait on memory
            j += 1
            chg &= chg - U64(1)
    return j


@njit(cache=True, nogil=True)
def _scan(old, new, width_bits, mbits, ebits, cpos, ccls, cold, cnew, chgw):
    """Every change (position, class) in order (:func:`_find_changes`), and class sizes
    estimated from every SAMPLE_EVERY-th word; then each change's sign and magnitude - 1.
    Returns (estimated class sizes, changes per class, positions, classes, signs,
    magnitudes - 1); the change arrays are views of the scratch."""
    n = old.shape[0]
    C = 1 << ebits
    cmask = C - 1
    mask = U64(0xFFFFFFFFFFFFFFFF) >> U64(64 - width_bits)
    signbit = U64(1) << U64(width_bits - 1)
    hs = np.zeros((4, C), np.int64)
    sampled = 0
    j = _find_changes(old, new, mbits, cmask, cpos, ccls, cold, cnew, chgw)
    every = 64 * SAMPLE_EVERY if n >= 4 * 64 * SAMPLE_EVERY else 64    # a small chunk: count them all
    for i in range(0, n - 63, every):
        for i4 in range(i, i + 64, 4):
            hs[0, (np.int64(old[i4]) >> mbits) & cmask] += 1
            hs[1, (np.int64(old[i4 + 1]) >> mbits) & cmask] += 1
            hs[2, (np.int64(old[i4 + 2]) >> mbits) & cmask] += 1
            hs[3, (np.int64(old[i4 + 3]) >> mbits) & cmask] += 1
        sampled += 64
    if sampled == 0:                    # under 64 elements
        for i in range(n):
            hs[0, (np.int64(old[i]) >> mbits) & cmask] += 1
        sampled = n
    csign, ca, kcls = change_steps(cold[:j], cnew[:j], ccls[:j], C, signbit, mask)
    nest = np.zeros(C, np.float64)
    scale = n / sampled if sampled else 1.0
    for c in range(C):
        nest[c] = max((hs[0, c] + hs[1, c] + hs[2, c] + hs[3, c]) * scale, np.float64(kcls[c]))
    return nest, kcls, cpos[:j], ccls[:j], csign, ca


@njit(cache=True, nogil=True, inline="always")
def _flag_bits(n, k):
    """Bits to code which ``k`` of ``n`` flags are set, about (n H(k/n))."""
    if k <= 0 or k >= n:
        return 0.0
    p = k / n
    return -n * (p * math.log2(p) + (1.0 - p) * math.log2(1.0 - p))


_GROUP_COST = 8.0 * 7   # bits of table a group costs (bounds, model byte, stream length)
_CUTS = 48              # candidate group bounds considered at most


@njit(cache=True, nogil=True)
def _choose_groups(nest, kcls, cmin, cmax):
    """Group bounds over classes cmin..cmax: at most GMAX contiguous ranges minimising the
    estimated position bits plus the table; a dynamic programme over <= _CUTS + 1 candidate
    bounds (class edges, thinned to quantiles of the changes when there are more)."""
    R = cmax - cmin + 1
    cand = np.empty(min(R, _CUTS) + 1, np.int64)
    if R <= _CUTS:
        for i in range(R + 1):
            cand[i] = cmin + i
        nc = R + 1
    else:
        total = 0
        for c in range(cmin, cmax + 1):
            total += kcls[c]
        cand[0] = cmin
        nc = 1
        acc = 0
        for c in range(cmin, cmax):
            acc += kcls[c]
            if acc * _CUTS >= nc * total and nc < _CUTS:
                cand[nc] = c + 1
                nc += 1
        cand[nc] = cmax + 1
        nc += 1
    pn = np.zeros(nc, np.float64)     # prefix sums at the candidates
    pk = np.zeros(nc, np.float64)
    for i in range(1, nc):
        sn = 0.0
        sk = 0.0
        for c in range(cand[i - 1], cand[i]):
            sn += nest[c]
            sk += kcls[c]
        pn[i] = pn[i - 1] + sn
        pk[i] = pk[i - 1] + sk
    INF = 1e300
    best = np.full((GMAX + 1, nc), INF)
    arg = np.zeros((GMAX + 1, nc), np.int64)
    best[0, 0] = 0.0
    for g in range(1, GMAX + 1):
        for b in range(1, nc):
            for a in range(g - 1, b):
                if best[g - 1, a] >= INF:
                    continue
                v = best[g - 1, a] + _flag_bits(pn[b] - pn[a], pk[b] - pk[a]) + _GROUP_COST
                if v < best[g, b]:
                    best[g, b] = v
                    arg[g, b] = a
    G = 1
    for g in range(2, GMAX + 1):
        if best[g, nc - 1] < best[G, nc - 1]:
            G = g
    t = np.zeros(G + 1, np.int64)
    b = nc - 1
    for g in range(G, 0, -1):
        t[g] = cand[b]
        b = arg[g, b]
    t[0] = cand[0]
    return t


@njit(cache=True, nogil=True, inline="always")
def _gaps_of_word(mk, ev, since, k, gaps, gid, e):
    """Append the gaps before each event ``ev`` (a subset of group k's mask ``mk``) of one word;
    returns (elements of the group since its last event, gaps written)."""
    m = mk
    while ev != U64(0):
        b = ev & (U64(0) - ev)
        gaps[e] = since + popcount(m & (b - U64(1)))
        gid[e] = k
        e += 1
        since = 0
        m &= ~(b | (b - U64(1)))
        ev &= ev - U64(1)
    return since + popcount(m), e


@njit(cache=True, nogil=True)
def _group_gaps(old, mbits, ebits, t, gpol, chgw, gaps, gid):
    """Each group's gaps in its own element sequence, in element order (group ids in ``gid``),
    the last gap of each group after its events; and each group's size. Events are the
    changed elements (``chgw``: a mask per word) of a polarity-0 group and the unchanged ones
    of a polarity-1 group. The GMAX groups' counters are locals, not an array (a group past
    G has an empty mask), so they stay in registers."""
    n = old.shape[0]
    G = t.shape[0] - 1
    em, glo, gwd = _group_ranges(t, G, mbits, ebits)
    flip = np.zeros(GMAX, np.uint64)
    for k in range(G):
        flip[k] = U64(0) - U64(gpol[k])
    f0, f1, f2, f3 = flip[0], flip[1], flip[2], flip[3]
    mks = np.zeros((GMAX, _BLOCK), np.uint64)
    s0 = s1 = s2 = s3 = 0
    n0 = n1 = n2 = n3 = 0
    e = 0
    nw = (n + 63) >> 6
    for wi in range(nw):
        r = wi % _BLOCK
        if r == 0:
            _masks(old, wi, min(nw, wi + _BLOCK), G, em, glo, gwd, mks)
        chg = chgw[wi]
        m0, m1, m2, m3 = mks[0, r], mks[1, r], mks[2, r], mks[3, r]
        n0 += popcount(m0)
        n1 += popcount(m1)
        n2 += popcount(m2)
        n3 += popcount(m3)
        s0, e = _gaps_of_word(m0, m0 & (chg ^ f0), s0, 0, gaps, gid, e)
        s1, e = _gaps_of_word(m1, m1 & (chg ^ f1), s1, 1, gaps, gid, e)
        s2, e = _gaps_of_word(m2, m2 & (chg ^ f2), s2, 2, gaps, gid, e)
        s3, e = _gaps_of_word(m3, m3 & (chg ^ f3), s3, 3, gaps, gid, e)
    last = (s0, s1, s2, s3)
    size = np.zeros(G, np.int64)
    sizes = (n0, n1, n2, n3)
    for k in range(G):
        gaps[e] = last[k]
        gid[e] = k
        e += 1
        size[k] = sizes[k]
    return gaps[:e], gid[:e], size


@njit(cache=True, nogil=True)
def _position_models(old, mbits, ebits, nest, kcls, chgw, gaps_out, gid_out):
    """Groups, each group's model and its gaps: (bounds, modes, polarities, j, gaps, group ids,
    changes per group, group sizes). The polarity is fixed before the gaps (from the estimated
    sizes: coding a mostly-changed group by its unchanged elements); the rest from exact sizes."""
    C = 1 << ebits
    cmin, cmax = C, -1
    for c in range(C):
        if kcls[c]:
            cmin = min(cmin, c)
            cmax = max(cmax, c)
    t = _choose_groups(nest, kcls, cmin, cmax)
    G = t.shape[0] - 1
    gpol = np.zeros(G, np.int64)
    gk = np.zeros(G, np.int64)
    gn = np.zeros(G, np.float64)
    for k in range(G):
        for c in range(t[k], t[k + 1]):
            gk[k] += kcls[c]
            gn[k] += nest[c]
        gpol[k] = np.int64(2 * gk[k] > gn[k])
    gaps, gid, size = _group_gaps(old, mbits, ebits, t, gpol, chgw, gaps_out, gid_out)
    gmode = np.zeros(G, np.int64)
    gj = np.zeros(G, np.int64)
    for k in range(G):
        if gk[k] == 0:
            gmode[k] = NONE
        elif gk[k] == size[k]:
            gmode[k] = ALL
        else:
            gmode[k] = GOLOMB
            ev = gk[k] if gpol[k] == 0 else size[k] - gk[k]
            gj[k] = _j_for_p(ev / size[k])
    return t, gmode, gpol, gj, gaps, gid, gk, size


@njit(cache=True, nogil=True)
def _assemble(t, gmode, gpol, gj, gaps, gid, gk, size, kcls, ccls, zmode, zpol, zj, zgap, zinit, vj, vsum,
              csign, ca):
    """Group table, step-class table, the position sub-streams (one per Golomb group, each
    byte-aligned) and the step stream, in the decoder's order."""
    C = kcls.shape[0]
    G = t.shape[0] - 1
    count = ccls.shape[0]
    pm, pb, pc, pr = class_params(gj)
    streams = []
    lens = np.zeros(G, np.int64)
    for k in range(G):
        if gmode[k] != GOLOMB:
            streams.append(np.zeros(1, np.uint32))
            continue
        ev = gk[k] if gpol[k] == 0 else size[k] - gk[k]
        pw = np.zeros(_bound(size[k], ev + 1, pm[k], pb[k]) // 32 + 2, np.uint32)
        acc = U64(0)
        nb = 0
        kk = 0
        for i in range(gaps.shape[0]):
            if gid[i] == k:
                acc, nb, kk = _put_golomb(pw, acc, nb, kk, gaps[i], pm[k], pb[k], pc[k], pr[k])
        pw[kk] = np.uint32(acc >> U64(32))
        lens[k] = (32 * kk + nb + 7) // 8
        streams.append(pw)
    sbits = count
    for c in range(C):
        if zmode[c] == GOLOMB:
            sbits += _bound(kcls[c], kcls[c] + 1, m_of(zj[c]), ceil_log2(m_of(zj[c])))
        sbits += _bound(vsum[c], kcls[c], m_of(vj[c]), ceil_log2(m_of(vj[c])))
    sw, sk, snb = step_stream(sbits, ccls, zmode, zinit, zgap, zj, vj, csign, ca)
    A = 0
    for c in range(C):
        A += np.int64(zmode[c] != NONE)
    hdr = 1 + 2 * (G + 1) + G + 4 * G + 2 + 3 * A
    total = hdr + (32 * sk + snb + 7) // 8
    for k in range(G):
        total += lens[k]
    out = np.zeros(total, np.uint8)
    out[0] = G
    q = 1
    for k in range(G + 1):
        out[q] = t[k] & 0xFF
        out[q + 1] = t[k] >> 8
        q += 2
    for k in range(G):
        out[q] = _param_byte(gmode[k], gpol[k], gj[k])
        q += 1
    for k in range(G):
        for b in range(4):
            out[q + b] = (lens[k] >> (8 * b)) & 0xFF
        q += 4
    out[q] = A & 0xFF
    out[q + 1] = A >> 8
    q += 2
    for c in range(C):
        if zmode[c] != NONE:
            out[q] = c
            out[q + 1] = _param_byte(zmode[c], zpol[c], zj[c])
            out[q + 2] = vj[c]
            q += 3
    for k in range(G):
        if gmode[k] == GOLOMB:
            pw = streams[k]
            nbits = 8 * lens[k]
            q = _bytes_of(pw, nbits // 32, nbits % 32, out, q)
    _bytes_of(sw, sk, snb, out, q)
    return out


@njit(cache=True, nogil=True)
def _any_above(bits, mask, above):
    """Whether ``bits[j] & mask > above`` for some j (a NaN, with dtypes.nan_rule's mask and bound)."""
    hit = False
    for j in range(bits.shape[0]):
        hit |= (np.int64(bits[j]) & mask) > above
    return hit


@njit(cache=True, nogil=True)
def gctx_encode(old, new, width_bits, mbits, ebits, scratch, nan_mask, nan_above):
    """Encoding-5 payload of one chunk (empty when nothing changed), encoding 1's gaps and steps of
    the same changes (their length is the number of changes), and whether a changed element's new
    bits are a NaN (``bits & nan_mask > nan_above``; a mask of 0 for a dtype without NaN). ``scratch``:
    int32 of shape (5, >= len(old) + GMAX), reused across calls; its content is not used."""
    chgw = np.empty((old.shape[0] + 63) >> 6, np.uint64)
    nest, kcls, cpos, ccls, csign, ca = _scan(old, new, width_bits, mbits, ebits, scratch[0], scratch[1],
                                              scratch[2], scratch[3], chgw)
    if cpos.shape[0] == 0:
        return np.empty(0, np.uint8), _sparse_parts(cpos, csign, ca), False
    # the scan left every change's new bits in scratch[3] (as int32: the low 31 bits survive, all a NaN
    # test looks at), contiguous, before the position models reuse it: far cheaper than visiting
    # each change in the chunk again
    nan = _any_above(scratch[3][:cpos.shape[0]], nan_mask, nan_above)
    t, gmode, gpol, gj, gaps, gid, gk, size = _position_models(old, mbits, ebits, nest, kcls, chgw,
                                                               scratch[2], scratch[3])
    zmode, zpol, zj, zgap, zinit, vj, vsum = _step_models(kcls, ccls, ca)
    out = _assemble(t, gmode, gpol, gj, gaps, gid, gk, size, kcls, ccls, zmode, zpol, zj, zgap, zinit, vj, vsum,
                    csign, ca)
    return out, _sparse_parts(cpos, csign, ca), nan
