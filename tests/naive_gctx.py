"""Plain-Python reference for encoding 5 ("gctx", delta/gctx.py), written from docs/FORMAT.md.

As tests/naive_ctx.py (whose bit reader, Golomb codes and step stream it uses): obvious
rather than fast, shares no code with the kernels. ``encode`` takes the groups and
every model as arguments, so a test can hand it what a kernel payload declares and
expect the same bytes, or models the kernel's encoder never picks.
"""

from __future__ import annotations

import numpy as np

from tests.naive_ctx import (ALL, GOLOMB, LAYOUT, NONE, Bits, Corrupt, FlagModel, _events, _gaps, _pack,
                             _param_byte, _parse_param, classes, golomb_code, golomb_m, read_steps, step_bits)

GMAX = 4


def parse_table(payload: bytes, ebits: int):
    """(bounds, group models, sub-stream lengths, big-flag models, magnitude indices, offset of
    the first position sub-stream)."""
    if len(payload) < 1 or not 1 <= payload[0] <= GMAX:
        raise Corrupt("group count")
    G = payload[0]
    off = 1
    if len(payload) < off + 2 * (G + 1) + G + 4 * G + 2:
        raise Corrupt("short")
    bounds = [int.from_bytes(payload[off + 2 * k: off + 2 * k + 2], "little") for k in range(G + 1)]
    off += 2 * (G + 1)
    if any(b <= a for a, b in zip(bounds, bounds[1:])) or bounds[-1] > 1 << ebits:
        raise Corrupt("group bounds")
    models = [_parse_param(b) for b in payload[off: off + G]]
    off += G
    lens = [int.from_bytes(payload[off + 4 * k: off + 4 * k + 4], "little") for k in range(G)]
    off += 4 * G
    if any(L and m.mode != GOLOMB for L, m in zip(lens, models)):
        raise Corrupt("a stream for a group that is not Golomb-coded")
    A = int.from_bytes(payload[off: off + 2], "little")
    off += 2
    if len(payload) < off + 3 * A:
        raise Corrupt("short")
    flag, val = {}, {}
    for _ in range(A):
        c, f, v = payload[off], _parse_param(payload[off + 1]), payload[off + 2]
        off += 3
        if (flag and c <= max(flag)) or c >= 1 << ebits:
            raise Corrupt("step classes not increasing, or past the classes")
        if v > 95 or f.mode == NONE:
            raise Corrupt("step parameters")
        flag[c], val[c] = f, v
    if sum(lens) > len(payload) - off:
        raise Corrupt("stream lengths")
    return bounds, models, lens, flag, val, off


def group_of(c: int, bounds: list[int]) -> int | None:
    for k in range(len(bounds) - 1):
        if bounds[k] <= c < bounds[k + 1]:
            return k
    return None


def encode(old: np.ndarray, new: np.ndarray, dtype: str, bounds: list[int], models: list[FlagModel],
           flag: dict, val: dict) -> bytes:
    """The payload for ``old`` -> ``new`` with the given groups and models; ``flag``/``val`` hold
    the classes whose big-flag model is not NONE (any other class steps one ulp)."""
    w, mbits, ebits = LAYOUT[dtype]
    cls = classes(old, mbits, ebits)
    old_i, new_i = [int(x) for x in old], [int(x) for x in new]
    n = len(old_i)
    changed = [old_i[i] != new_i[i] for i in range(n)]
    G = len(models)
    streams = []
    for k, m in enumerate(models):
        members = [i for i in range(n) if group_of(cls[i], bounds) == k]
        if m.mode != GOLOMB:
            streams.append(b"")
            continue
        gaps = _gaps(_events([changed[i] for i in members], m))
        streams.append(_pack("".join(golomb_code(g, golomb_m(m.j)) for g in gaps)))
    out = bytearray([G])
    for b in bounds:
        out += b.to_bytes(2, "little")
    out += bytes(_param_byte(m) for m in models)
    for st in streams:
        out += len(st).to_bytes(4, "little")
    out += len(flag).to_bytes(2, "little")
    for c in sorted(flag):
        out += bytes([c, _param_byte(flag[c]), val[c]])
    for st in streams:
        out += st
    return bytes(out) + _pack(step_bits(old_i, new_i, cls, flag, val, w))


def decode(payload: bytes, old: np.ndarray, count: int, dtype: str) -> tuple[list[int], list[int]]:
    """(changed positions, their new bits); raises :class:`Corrupt` on any rule broken."""
    w, mbits, ebits = LAYOUT[dtype]
    cls = classes(old, mbits, ebits)
    n = len(cls)
    bounds, models, lens, flag, val, off = parse_table(payload, ebits)
    changed = [False] * n
    for k, m in enumerate(models):
        members = [i for i in range(n) if group_of(cls[i], bounds) == k]
        start = off + sum(lens[:k])
        if m.mode == ALL:
            for i in members:
                changed[i] = True
        elif m.mode == GOLOMB:
            bits = Bits(payload[start: start + lens[k]])
            left = bits.golomb(golomb_m(m.j), n)
            for i in members:
                event = left == 0
                left = bits.golomb(golomb_m(m.j), n) if event else left - 1
                changed[i] = event != bool(m.pol)
            if left != 0:
                raise Corrupt("a group's gaps do not end at the chunk end")
            bits.finish()
    positions = [i for i in range(n) if changed[i]]
    if len(positions) != count:
        raise Corrupt("the changes do not number count")
    ss = Bits(payload[off + sum(lens):])
    return positions, read_steps(ss, old, positions, [cls[i] for i in positions], flag, val, count, w)


__all__ = ["ALL", "GOLOMB", "NONE", "FlagModel", "decode", "encode", "group_of", "parse_table"]
