"""Plain-numpy references for every kernel in delta/kernels.py.

Written for obviousness, not speed: whole-array numpy with no shared code with
the kernels, so a bug in one is not repeated in the other. tests/delta/test_kernels.py
compares each kernel to its reference on random inputs of every width.
"""

from __future__ import annotations

import numpy as np

_U64 = np.uint64


def mask_of(width_bits: int) -> np.uint64:
    return _U64((1 << width_bits) - 1)


def key(bits: np.ndarray, width_bits: int, sign_magnitude: bool) -> np.ndarray:
    """Order-preserving unsigned key of sign-magnitude bits (identity for integers).

    Negative floats (sign bit set) count down from the middle, positives count up
    from it, so -0.0 and +0.0 are adjacent and one ulp is a step of one."""
    b = bits.astype(_U64)
    if not sign_magnitude:
        return b
    m = mask_of(width_bits)
    sign = _U64(1 << (width_bits - 1))
    return np.where((b & sign) != 0, m - b, b + sign)


def unkey(keys: np.ndarray, width_bits: int, sign_magnitude: bool) -> np.ndarray:
    k = keys.astype(_U64)
    if not sign_magnitude:
        return k
    m = mask_of(width_bits)
    sign = _U64(1 << (width_bits - 1))
    return np.where(k >= sign, k - sign, m - k)


def zigzag(d: np.ndarray, width_bits: int) -> np.ndarray:
    """Zigzag of a modular difference read as a signed ``width_bits`` integer."""
    d = d.astype(object)  # Python ints: no wrap-around to reason about
    half = 1 << (width_bits - 1)
    signed = np.array([x - (1 << width_bits) if x >= half else x for x in d], dtype=object)
    z = np.array([2 * s if s >= 0 else -2 * s - 1 for s in signed], dtype=object)
    return z.astype(_U64) if z.size else np.empty(0, _U64)


def unzigzag(z: np.ndarray, width_bits: int) -> np.ndarray:
    z = z.astype(object)
    signed = [x // 2 if x % 2 == 0 else -(x + 1) // 2 for x in z]
    out = np.array([s % (1 << width_bits) for s in signed], dtype=object)
    return out.astype(_U64) if out.size else np.empty(0, _U64)


def count_changed(old: np.ndarray, new: np.ndarray) -> int:
    return int(np.count_nonzero(old != new))


def sparse_extract(old: np.ndarray, new: np.ndarray, width_bits: int, sign_magnitude: bool):
    pos = np.flatnonzero(old != new)
    gaps = (np.diff(np.concatenate([[-1], pos])) - 1).astype(np.uint32)
    m = int(mask_of(width_bits))
    d = (key(new[pos], width_bits, sign_magnitude).astype(object)
         - key(old[pos], width_bits, sign_magnitude).astype(object)) % (m + 1)
    steps = zigzag(np.asarray(d, dtype=object), width_bits)
    max_gap = int(gaps.max()) if gaps.size else 0
    max_step = int(steps.max()) if steps.size else 0
    return gaps, steps, max_gap, max_step


def count_changed_nan(old: np.ndarray, new: np.ndarray, mask: int, threshold: int) -> tuple[int, bool]:
    return count_changed(old, new), nan_at_gaps(old, new, mask, threshold)


def step_planes(old: np.ndarray, new: np.ndarray, width_bits: int, sign_magnitude: bool):
    """Every element's zigzag key step in as few byte planes as the largest needs (at least one)."""
    m = int(mask_of(width_bits))
    d = (key(new, width_bits, sign_magnitude).astype(object) - key(old, width_bits, sign_magnitude).astype(object)) \
        % (m + 1)
    steps = zigzag(np.asarray(d, dtype=object), width_bits)
    top = int(steps.max()) if steps.size else 0
    nplanes = max(1, (top.bit_length() + 7) // 8)
    return to_planes(steps, nplanes), nplanes


def step_apply_planes(old: np.ndarray, planes: np.ndarray, nplanes: int, width_bits: int, sign_magnitude: bool):
    steps = from_planes(planes, old.shape[0], nplanes, _U64)
    pos = np.flatnonzero(steps != 0).astype(np.int64)
    return pos, sparse_new_values(old, pos, steps[pos], width_bits, sign_magnitude)


def grouped_order(old: np.ndarray, grand: np.ndarray | None, mant: int, exp_bits: int, width_bits: int,
                  sign_magnitude: bool) -> tuple[np.ndarray, np.ndarray]:
    """(the class order of docs/FORMAT.md's encodings 8 and 9: element indices by ascending class, ties by
    position; which elements are negated). ``grand`` None: encoding 8's classes, else encoding 9's."""
    cls = (old.astype(np.uint64) >> np.uint64(mant)) & np.uint64((1 << exp_bits) - 1)
    neg = np.zeros(old.shape[0], bool)
    if grand is not None:
        m = int(mask_of(width_bits))
        p = (key(old, width_bits, sign_magnitude).astype(object) - key(grand, width_bits, sign_magnitude)
             .astype(object)) % (m + 1)
        p = np.asarray(p, dtype=object)
        cls = cls * np.uint64(2) + (p != 0).astype(np.uint64)
        neg = np.asarray(p >= (m + 1) // 2, bool)
    return np.argsort(cls, kind="stable"), neg


def grouped_step_planes(old: np.ndarray, new: np.ndarray, grand: np.ndarray | None, mant: int, exp_bits: int,
                        width_bits: int, sign_magnitude: bool):
    """Encoding 8 (``grand`` None) or 9's planes: every element's zigzag key step, negated where the step
    before went down (9), in the class order; as few planes as the largest needs."""
    m = int(mask_of(width_bits))
    order, neg = grouped_order(old, grand, mant, exp_bits, width_bits, sign_magnitude)
    d = (key(new, width_bits, sign_magnitude).astype(object) - key(old, width_bits, sign_magnitude).astype(object)) \
        % (m + 1)
    d = np.asarray(np.where(neg, (m + 1 - d) % (m + 1), d), dtype=object)
    steps = zigzag(d, width_bits)[order]
    top = int(steps.max()) if steps.size else 0
    nplanes = max(1, (top.bit_length() + 7) // 8)
    return to_planes(steps, nplanes), nplanes


def nan_at_gaps(old: np.ndarray, new: np.ndarray, mask: int, threshold: int) -> bool:
    """Whether a changed element's new bits are a NaN (bits & mask > threshold)."""
    changed = new[old != new].astype(np.uint64)
    return bool(np.any((changed & np.uint64(mask)) > np.uint64(threshold)))


def sparse_positions(gaps: np.ndarray, n_elems: int):
    pos = np.cumsum(gaps.astype(np.int64) + 1) - 1
    ok = pos.size == 0 or bool(pos[-1] < n_elems)
    return pos.astype(np.int64), ok


def sparse_new_values(old: np.ndarray, positions: np.ndarray, steps: np.ndarray, width_bits: int,
                      sign_magnitude: bool) -> np.ndarray:
    m = int(mask_of(width_bits))
    d = unzigzag(steps, width_bits).astype(object)
    k = (key(old[positions], width_bits, sign_magnitude).astype(object) + d) % (m + 1)
    k = np.asarray(k, dtype=object).astype(_U64) if len(positions) else np.empty(0, _U64)
    return unkey(k, width_bits, sign_magnitude).astype(old.dtype)


def scatter(live: np.ndarray, positions: np.ndarray, values: np.ndarray) -> None:
    live[positions] = values


def scatter_if_unchanged(live: np.ndarray, positions: np.ndarray, expected: np.ndarray,
                         values: np.ndarray) -> int:
    bad = np.flatnonzero(live[positions] != expected)
    if bad.size:
        return int(bad[0])
    live[positions] = values
    return -1


def gather(src: np.ndarray, positions: np.ndarray) -> np.ndarray:
    return src[positions].copy()


def to_planes(values: np.ndarray, nplanes: int) -> np.ndarray:
    v = values.astype(_U64)
    return np.concatenate([((v >> _U64(8 * p)) & _U64(0xFF)).astype(np.uint8) for p in range(nplanes)]) \
        if nplanes else np.empty(0, np.uint8)


def from_planes(planes: np.ndarray, n: int, nplanes: int, dtype) -> np.ndarray:
    out = np.zeros(n, _U64)
    for p in range(nplanes):
        out |= planes[p * n:(p + 1) * n].astype(_U64) << _U64(8 * p)
    return out.astype(dtype)


def planes_entropy_bytes(planes: np.ndarray, plane_len: int, block: int, stride: int = 1) -> float:
    total = 0.0
    for p0 in range(0, planes.shape[0], max(plane_len, 1)):
        plane = planes[p0:p0 + plane_len]
        part, seen = 0.0, 0
        for start in range(0, plane.shape[0], block * stride):
            b = plane[start:start + block]
            counts = np.bincount(b, minlength=256).astype(np.float64)
            counts = counts[counts > 0]
            bits = -float((counts * np.log2(counts / counts.sum())).sum())
            runs = 1 + int(np.count_nonzero(b[1:] != b[:-1]))
            part += min(bits / 8.0, 2.0 * runs)
            seen += b.shape[0]
        total += part * plane.shape[0] / seen
    return total


def xor_planes(old: np.ndarray, new: np.ndarray, nplanes: int) -> np.ndarray:
    return to_planes(old ^ new, nplanes)


def xor_apply_planes(old: np.ndarray, planes: np.ndarray, nplanes: int):
    x = from_planes(planes, old.shape[0], nplanes, old.dtype)
    pos = np.flatnonzero(x != 0).astype(np.int64)
    return pos, old[pos] ^ x[pos]


def diff_positions(old: np.ndarray, new: np.ndarray):
    pos = np.flatnonzero(old != new).astype(np.int64)
    return pos, new[pos]


_M64 = (1 << 64) - 1
_H1 = 0x9E3779B185EBCA87
_H3 = 0x165667B19E3779F9


def _hround(acc: int, x: int) -> int:
    acc = ((acc ^ x) * _H1) & _M64
    return acc ^ (acc >> 29)


def block_hash(b8: np.ndarray) -> int:
    """kernels.block_hash in Python integers: lane ``i % 8`` takes the i-th 64-bit word of each full group
    of eight, the words left over and the tail bytes (little-endian) go through one more state seeded by
    the length, and the lanes are xored with it."""
    data = bytes(np.ascontiguousarray(b8).view(np.uint8))
    n = len(data)
    words = [int.from_bytes(data[8 * i: 8 * i + 8], "little") for i in range(n // 8)]
    lanes = list(range(1, 9))
    full = (len(words) // 8) * 8
    for i, w in enumerate(words[:full]):
        lanes[i % 8] = _hround(lanes[i % 8], w)
    h = (n * _H3) & _M64
    for w in words[full:]:
        h = _hround(h, w)
    h = _hround(h, int.from_bytes(data[8 * len(words):], "little"))
    for a in lanes:
        h ^= a
    return h


def count_lines(positions: np.ndarray, shift: int) -> int:
    return int(np.unique(positions >> shift).shape[0])


def commit_tasks(lives, wholes, positions, expected, values, hashes, tasks, t0, t1, block_elems, abort):
    """kernels.commit_task over tasks [t0, t1), checking before writing (the kernel writes, then puts back on a
    refusal); mode 0 scatters, 1 copies, 2 swaps with ``wholes``."""
    for t in range(t0, t1):
        if abort[0]:
            return t - t0, 2, -1
        ti, mode, ja, jb, ba, bb, hoff = (int(x) for x in tasks[t])
        live = lives[ti]
        pos, exp = positions[ti][ja:jb], expected[ti][ja:jb]
        if mode == 0:
            bad = np.flatnonzero(live[pos] != exp)
            if bad.size:
                abort[0] = 1
                return t - t0, 0, ja + int(bad[0])
            live[pos] = values[ti][ja:jb]
            continue
        n = live.shape[0]
        whole = wholes[ti]
        for b in range(ba, bb):
            s, e = b * block_elems, min(n, (b + 1) * block_elems)
            if block_hash(live[s:e]) != int(hashes[hoff + b]):
                if mode == 2:         # a swap: the blocks before b hold each other's bits again
                    a = ba * block_elems
                    live[a:s], whole[a:s] = whole[a:s].copy(), live[a:s].copy()
                else:
                    done = pos < s
                    live[pos[done]] = exp[done]
                abort[0] = 1
                return t - t0, 1, b
            if mode == 2:
                live[s:e], whole[s:e] = whole[s:e].copy(), live[s:e].copy()
            else:
                live[s:e] = whole[s:e]
    return t1 - t0, -1, -1
