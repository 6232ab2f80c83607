"""Chunk encoding 6 ("pctx"): each element's step coded in contexts taken from its parent and from
the step before it (the grandparent), with an adaptive binary range coder.

Why: where an optimizer moves nearly every element at each step (a LoRA adapter
trained with Adam at 1e-5 to 1e-4), the parent alone says little more than how
large an ulp is (encodings 4 and 5). The step before says much more: Adam's
update direction ``m / sqrt(v)`` persists from step to step (beta1 = 0.9), so an
element that went up last time mostly goes up again, by a similar number of
ulps, and one that did not move mostly stays. On real LoRA steps (bf16) the
empirical entropy with the previous step as a context is clearly further below
XOR + zstd-3 than with the parent's exponent alone (benchmarks/lora_codec.py
measures both). The contexts are many and their statistics differ from chunk to
chunk, so they are learnt as the chunk is coded (LZMA's adaptive binary range
coder, 11-bit probabilities) rather than sent as tables.

The price: the decoder needs the tensor's bits before its parent (the caller
passes them), and both ends visit every element with a few binary decisions, each a
range coder's multiply and renormalisation: many times encoding 5's time per element.

Layout, contexts, binarisation and the coder's arithmetic are fixed by
docs/FORMAT.md ("Encoding 6: pctx"). These are pure numba kernels over numpy
arrays of element bits; delta/chunks.py is the glue. The decoder checks every
byte it reads against the payload's end and every value against its bound, and
returns small error codes (:data:`ERRORS`) instead of raising.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ckptdelta.delta.ctx_bits import U64, key, unkey
from ckptdelta.delta.dtypes import DType
from ckptdelta.delta.errors import FormatError

#: The dtypes encoding 6 serves: (planes_a, planes_b) of its chunk entries = (mantissa bits, exponent bits),
#: the fields its contexts take from the parent (docs/FORMAT.md, encoding 6).
PCTX_LAYOUT = {"BF16": (7, 8), "F16": (10, 5), "F32": (23, 8)}

PROB_BITS = 11
PROB_ONE = 1 << PROB_BITS        # probabilities are of a 0 bit, in units of 2**-11
PROB_INIT = PROB_ONE // 2
MOVE_BITS = 5
TOP = 1 << 24

ERRORS = {
    1: "the range coder's first byte is not 0",
    2: "the stream reads past the payload's end",
    3: "more changed elements than the chunk entry's count",
    4: "fewer changed elements than the chunk entry's count",
    5: "trailing bytes, or nonzero padding, after a stream",
    6: "a step's bit length exceeds the dtype's width",
    7: "the range-coded stream's length is outside the payload",
}


@njit(cache=True, nogil=True, inline="always")
def _bitlen(a):
    n = 0
    while a:
        a >>= U64(1)
        n += 1
    return n


@njit(cache=True, nogil=True, inline="always")
def _prev_step(o, g, signbit, mask):
    """(bit length of |p|, p < 0) for the previous step p = key(o) - key(g), taken as a signed
    w-bit number (so |p| <= 2^(w-1))."""
    d = (key(o, signbit, mask) - key(g, signbit, mask)) & mask
    neg = d >= signbit
    a = (mask - d + U64(1)) if neg else d
    return _bitlen(a), neg


@njit(cache=True, nogil=True)
def _tables(C, W):
    """Fresh probabilities: changed / flip / big per (class, previous bit length); the magnitude's
    bit-length tree per previous bit length; its first bit below the leading one per bit length."""
    chg = np.full(C * W, PROB_INIT, np.uint16)
    flip = np.full(C * W, PROB_INIT, np.uint16)
    big = np.full(C * W, PROB_INIT, np.uint16)
    ltree = np.full(W * 32, PROB_INIT, np.uint16)
    top = np.full(W + 1, PROB_INIT, np.uint16)
    return chg, flip, big, ltree, top


@njit(cache=True, nogil=True, inline="always")
def _constants(width_bits, mbits, ebits):
    """(W: previous-step bit lengths 0..w, T: levels of the bit-length tree (magnitudes of 2..w bits give
    L - 2 in 0..w - 2), C: classes, the key mask, the sign bit, the class mask, the mantissa bits)."""
    C = 1 << ebits
    return (width_bits + 1, 4 if width_bits <= 16 else 5, C, U64(0xFFFFFFFFFFFFFFFF) >> U64(64 - width_bits),
            U64(1) << U64(width_bits - 1), U64(C - 1), U64(mbits))


# --------------------------------------------------------------------------- encoder

@njit(cache=True, nogil=True, inline="always")
def _shift_low(out, pos, low, cache, csize):
    """LZMA's carry-deferring byte output: a byte is written once no carry can reach it."""
    if low < U64(0xFF000000) or low >= U64(1 << 32):
        carry = np.uint8(low >> U64(32))
        temp = cache
        while True:
            out[pos] = np.uint8((temp + carry) & 0xFF)
            pos += 1
            temp = np.uint8(0xFF)
            csize -= 1
            if csize == 0:
                break
        cache = np.uint8((low >> U64(24)) & U64(0xFF))
    csize += 1
    low = (low & U64(0x00FFFFFF)) << U64(8)
    return pos, low, cache, csize


@njit(cache=True, nogil=True, inline="always")
def _enc_bit(out, pos, low, rng, cache, csize, probs, i, bit):
    """Code ``bit`` with probability ``probs[i]`` and adapt it; the coder's new state."""
    p = U64(probs[i])
    bound = (rng >> U64(PROB_BITS)) * p
    if bit == 0:
        rng = bound
        probs[i] = np.uint16(p + ((U64(PROB_ONE) - p) >> U64(MOVE_BITS)))
    else:
        low += bound
        rng -= bound
        probs[i] = np.uint16(p - (p >> U64(MOVE_BITS)))
    if rng < U64(TOP):       # once is enough: a probability is at least 31 / 2048, so rng >= 2^16 here
        rng <<= U64(8)
        pos, low, cache, csize = _shift_low(out, pos, low, cache, csize)
    return pos, low, rng, cache, csize


@njit(cache=True, nogil=True, inline="always")
def _put_raw(raw, rs, v, n):
    """Append the ``n`` (0..31) low bits of ``v``, most significant first, to the raw stream.
    ``rs``: [bytes written, pending bits (left-aligned in 64), pending count]."""
    if n == 0:
        return
    acc = U64(rs[1]) | ((v & ((U64(1) << U64(n)) - U64(1))) << U64(64 - np.int64(rs[2]) - n))
    nb = np.int64(rs[2]) + n
    k = np.int64(rs[0])
    while nb >= 8:
        raw[k] = np.uint8(acc >> U64(56))
        k += 1
        acc <<= U64(8)
        nb -= 8
    rs[0], rs[1], rs[2] = U64(k), acc, U64(nb)


@njit(cache=True, nogil=True)
def pctx_encode(old, new, grand, width_bits, mbits, ebits):
    """Encoding-6 payload of one chunk from its parent, new and grandparent bits (same length), and
    the number of changed elements; an empty payload when nothing changed, or when the payload
    would exceed the chunk's raw size (then it never wins)."""
    n = old.shape[0]
    W, T, C, mask, signbit, em, mb = _constants(width_bits, mbits, ebits)
    chg, flip, big, ltree, top = _tables(C, W)
    cap = n * (width_bits // 8) + 64
    out = np.empty(cap + 64, np.uint8)      # an element adds at most ~12 to bytes written + pending
    raw = np.empty(cap + 64, np.uint8)
    pos, low, rng, cache, csize = 0, U64(0), U64(0xFFFFFFFF), np.uint8(0), 1
    rs = np.zeros(3, np.uint64)
    count = 0
    for i in range(n):
        if pos + csize + np.int64(rs[0]) > cap:     # one more per shift
            return np.empty(0, np.uint8), count
        o = U64(old[i])
        v = U64(new[i])
        pl, neg = _prev_step(o, U64(grand[i]), signbit, mask)
        ci = np.int64((o >> mb) & em) * W + pl
        if o == v:
            pos, low, rng, cache, csize = _enc_bit(out, pos, low, rng, cache, csize, chg, ci, 0)
            continue
        pos, low, rng, cache, csize = _enc_bit(out, pos, low, rng, cache, csize, chg, ci, 1)
        count += 1
        d = (key(v, signbit, mask) - key(o, signbit, mask)) & mask
        up = d < signbit
        a = d if up else (mask - d + U64(1))
        # predicted: the previous step's direction
        pos, low, rng, cache, csize = _enc_bit(out, pos, low, rng, cache, csize, flip, ci, np.int64(up == neg))
        L = _bitlen(a)
        if L == 1:
            pos, low, rng, cache, csize = _enc_bit(out, pos, low, rng, cache, csize, big, ci, 0)
            continue
        pos, low, rng, cache, csize = _enc_bit(out, pos, low, rng, cache, csize, big, ci, 1)
        x = L - 2
        node = 1
        base = pl * 32
        for k in range(T - 1, -1, -1):
            b = (x >> k) & 1
            pos, low, rng, cache, csize = _enc_bit(out, pos, low, rng, cache, csize, ltree, base + node, b)
            node = 2 * node + b
        pos, low, rng, cache, csize = _enc_bit(out, pos, low, rng, cache, csize, top, L,
                                               np.int64((a >> U64(L - 2)) & U64(1)))
        _put_raw(raw, rs, a, L - 2)
    if count == 0:
        return np.empty(0, np.uint8), 0
    for _ in range(5):
        pos, low, cache, csize = _shift_low(out, pos, low, cache, csize)
    _put_raw(raw, rs, U64(0), (8 - np.int64(rs[2])) % 8)      # zero bits up to a byte boundary
    nraw = np.int64(rs[0])
    total = 4 + pos + nraw
    if total > cap:
        return np.empty(0, np.uint8), count
    res = np.empty(total, np.uint8)
    for k in range(4):
        res[k] = np.uint8((pos >> (8 * k)) & 0xFF)
    res[4: 4 + pos] = out[:pos]
    res[4 + pos:] = raw[:nraw]
    return res, count


# --------------------------------------------------------------------------- decoder

@njit(cache=True, nogil=True, inline="always")
def _dec_bit(buf, pos, code, rng, probs, i):
    """One bit with probability ``probs[i]``, adapted; (bit, pos, code, rng). Branch-free but for
    the renormalisation (the bits are what the coder could not predict). A byte past the
    payload's end reads as 0 and leaves ``pos`` past it, which the caller reports."""
    p = np.uint32(probs[i])
    bound = (rng >> np.uint32(PROB_BITS)) * p
    b = np.uint32(code >= bound)
    m = np.uint32(0) - b                       # all ones for a 1 bit
    rng = (bound & ~m) | ((rng - bound) & m)
    code -= bound & m
    probs[i] = np.uint16((p + (((np.uint32(PROB_ONE) - p) >> np.uint32(MOVE_BITS)) & ~m))
                         - ((p >> np.uint32(MOVE_BITS)) & m))
    if rng < np.uint32(TOP):
        byte = np.uint32(buf[pos]) if pos < buf.shape[0] else np.uint32(0)
        pos += 1
        rng <<= np.uint32(8)
        code = ((code << np.uint32(8)) | byte) & np.uint32(0xFFFFFFFF)   # numba widens: u32, as the format says
    return np.int64(b), pos, code, rng


@njit(cache=True, nogil=True, inline="always")
def _get_raw(raw, rpos, acc, nb, n):
    """The next ``n`` (0..31) bits of the raw stream, most significant first; (value, rpos, acc, nb).
    Bytes past its end read as 0 and move ``rpos`` past it, which the caller reports."""
    while nb < n:
        byte = U64(raw[rpos]) if rpos < raw.shape[0] else U64(0)
        rpos += 1
        acc = (acc << U64(8)) | byte
        nb += 8
    nb -= n
    v = (acc >> U64(nb)) & ((U64(1) << U64(n)) - U64(1))
    acc &= (U64(1) << U64(nb)) - U64(1)
    return v, rpos, acc, nb


@njit(cache=True, nogil=True)
def pctx_decode(payload, old, grand, count, width_bits, mbits, ebits, out_pos, out_val):
    """Chunk-local positions and new bits of an encoding-6 chunk into ``out_pos``/``out_val``
    (``count`` elements each); 0, or an error code of :data:`ERRORS`. Reads only the payload's bytes."""
    n = old.shape[0]
    W, T, C, mask, signbit, em, mb = _constants(width_bits, mbits, ebits)
    if payload.shape[0] < 9:
        return 2
    R = np.int64(payload[0]) | (np.int64(payload[1]) << 8) | (np.int64(payload[2]) << 16) | \
        (np.int64(payload[3]) << 24)
    if R < 5 or R > payload.shape[0] - 4:
        return 7
    buf = payload[4: 4 + R]
    raw = payload[4 + R:]
    if buf[0] != 0:
        return 1
    code = np.uint32(0)
    for k in range(1, 5):
        code = (code << np.uint32(8)) | np.uint32(buf[k])
    rng = np.uint32(0xFFFFFFFF)
    pos = 5
    rpos = 0
    acc = U64(0)
    nb = 0
    chg, flip, big, ltree, top = _tables(C, W)
    j = 0
    for i in range(n):
        o = U64(old[i])
        pl, neg = _prev_step(o, U64(grand[i]), signbit, mask)
        ci = np.int64((o >> mb) & em) * W + pl
        bit, pos, code, rng = _dec_bit(buf, pos, code, rng, chg, ci)
        if bit == 0:
            continue
        if j >= count:
            return 3
        bit, pos, code, rng = _dec_bit(buf, pos, code, rng, flip, ci)
        up = (bit == 1) == neg
        bit, pos, code, rng = _dec_bit(buf, pos, code, rng, big, ci)
        if bit == 0:
            a = U64(1)
        else:
            node = 1
            base = pl * 32
            for _ in range(T):
                bit, pos, code, rng = _dec_bit(buf, pos, code, rng, ltree, base + node)
                node = 2 * node + bit
            L = node - (1 << T) + 2
            if L > width_bits:
                return 6
            bit, pos, code, rng = _dec_bit(buf, pos, code, rng, top, L)
            low, rpos, acc, nb = _get_raw(raw, rpos, acc, nb, L - 2)
            a = ((U64(2) | U64(bit)) << U64(L - 2)) | low
        ko = key(o, signbit, mask)
        kn = (ko + a) & mask if up else (ko - a) & mask
        out_pos[j] = i
        out_val[j] = unkey(kn, signbit, mask)
        j += 1
        if pos > R or rpos > raw.shape[0]:
            return 2
    if pos > R or rpos > raw.shape[0]:
        return 2
    if j != count:
        return 4
    if pos != R or rpos != raw.shape[0] or acc != U64(0):
        return 5
    return 0


# --------------------------------------------------------------------------- glue

def layout_of(dt: DType) -> tuple[int, int] | None:
    """(mantissa bits, exponent bits) when encoding 6 serves ``dt``, else None."""
    return PCTX_LAYOUT.get(dt.name)


def encode_pctx(old: np.ndarray, new: np.ndarray, grand: np.ndarray, dt: DType) -> bytes | None:
    """The encoding-6 payload of one chunk (bits of parent, new and grandparent, one length); None when
    the dtype has no layout, nothing changed, or the payload would not beat the chunk's raw size."""
    lay = layout_of(dt)
    if lay is None:
        return None
    if not old.shape == new.shape == grand.shape or not old.dtype == new.dtype == grand.dtype:
        raise ValueError(f"pctx: parent, new and grandparent chunks differ: {old.dtype}{list(old.shape)}, "
                         f"{new.dtype}{list(new.shape)}, {grand.dtype}{list(grand.shape)}")
    out, count = pctx_encode(np.ascontiguousarray(old), np.ascontiguousarray(new), np.ascontiguousarray(grand),
                             8 * dt.itemsize, lay[0], lay[1])
    return out.tobytes() if out.shape[0] else None


def decode_pctx(payload: bytes | memoryview, old: np.ndarray, grand: np.ndarray, count: int, dt: DType, where: str,
                out: "tuple[np.ndarray, np.ndarray] | None" = None) -> tuple[np.ndarray, np.ndarray]:
    """Chunk-local positions (int64) and new bits of an encoding-6 chunk, into ``out`` if given."""
    lay = layout_of(dt)
    if lay is None:
        raise FormatError(f"{where}: encoding pctx is not defined for dtype {dt.name}")
    if not 1 <= count <= old.shape[0]:
        raise FormatError(f"{where}: pctx chunk count {count} outside [1, {old.shape[0]}]")
    if grand.shape != old.shape or grand.dtype != old.dtype:
        raise ValueError(f"{where}: the grandparent's chunk is {grand.dtype}{list(grand.shape)}, the parent's "
                         f"{old.dtype}{list(old.shape)}")
    positions, values = (np.empty(count, np.int64), np.empty(count, dt.bits_dtype)) if out is None else out
    if positions.shape != (count,) or values.shape != (count,) or positions.dtype != np.int64 \
            or values.dtype != old.dtype:
        raise ValueError(f"{where}: pctx decodes into int64[{count}] and {old.dtype}[{count}]")
    err = pctx_decode(np.frombuffer(payload, np.uint8), np.ascontiguousarray(old), np.ascontiguousarray(grand),
                      count, 8 * dt.itemsize, lay[0], lay[1], positions, values)
    if err:
        raise FormatError(f"{where}: corrupt pctx payload ({ERRORS.get(err, f'error {err}')})")
    return positions, values
