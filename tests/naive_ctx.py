"""Plain-Python references for encoding 4 ("ctx", delta/ctxcoder.py), written from docs/FORMAT.md.

Obvious rather than fast: bits are a Python string of '0'/'1', values Python ints,
classes plain lists of indices. Shares no code with the kernels, so a bug in one is
not repeated in the other. ``encode`` takes the per-class parameters as arguments
(choosing them is the encoder's policy, not the format), so a test can hand it the
parameters a kernel payload declares and expect the same bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

LAYOUT = {"BF16": (16, 7, 8), "F16": (16, 10, 5), "F8_E4M3": (8, 3, 4), "F8_E5M2": (8, 2, 5)}
NONE, ALL, GOLOMB = "none", "all", "golomb"


class Corrupt(ValueError):
    """The payload breaks a rule of the format."""


@dataclass
class FlagModel:
    mode: str           # NONE: no flag set; ALL: every flag set; GOLOMB: gaps between events
    pol: int = 0        # GOLOMB: 0 -> the events are the set flags, 1 -> the clear ones
    j: int = 0          # GOLOMB: parameter index, m = golomb_m(j)


def golomb_m(j: int) -> int:
    return ((4 + (j & 3)) << (j >> 2)) >> 2


def key(b: int, w: int) -> int:
    sign, mask = 1 << (w - 1), (1 << w) - 1
    return (mask - b) if b & sign else (b + sign)


def unkey(k: int, w: int) -> int:
    sign, mask = 1 << (w - 1), (1 << w) - 1
    return (k - sign) if k & sign else (mask - k)


def step_z(o: int, v: int, w: int) -> int:
    d = (key(v, w) - key(o, w)) % (1 << w)
    return 2 * d if d < (1 << (w - 1)) else 2 * ((1 << w) - 1 - d) + 1


def golomb_code(v: int, m: int) -> str:
    q, r = divmod(v, m)
    out = "1" * q + "0"
    b = (m - 1).bit_length()          # ceil(log2 m)
    cut = (1 << b) - m
    if b == 0:
        return out
    if r < cut:
        return out + format(r, f"0{b - 1}b") if b > 1 else out
    return out + format(r + cut, f"0{b}b")


class Bits:
    def __init__(self, data: bytes):
        self.s = "".join(format(x, "08b") for x in data)
        self.i = 0

    def bit(self) -> int:
        if self.i >= len(self.s):
            raise Corrupt("read past the end of the stream")
        self.i += 1
        return int(self.s[self.i - 1])

    def bits(self, k: int) -> int:
        v = 0
        for _ in range(k):
            v = 2 * v + self.bit()
        return v

    def golomb(self, m: int, vmax: int) -> int:
        q = 0
        while self.bit():
            q += 1
            if q * m > vmax:
                raise Corrupt("unary run too long")
        b = (m - 1).bit_length()
        cut = (1 << b) - m
        r = 0
        if b:
            x = self.bits(b - 1)
            r = x if x < cut else 2 * x + self.bit() - cut
        v = q * m + r
        if v > vmax:
            raise Corrupt("value over its bound")
        return v

    def finish(self) -> None:
        if (self.i + 7) // 8 * 8 != len(self.s) or "1" in self.s[self.i:]:
            raise Corrupt("stream not consumed exactly, or nonzero padding")


def _pack(bits: str) -> bytes:
    bits += "0" * (-len(bits) % 8)
    return bytes(int(bits[i:i + 8], 2) for i in range(0, len(bits), 8))


def classes(old: np.ndarray, mbits: int, ebits: int) -> list[int]:
    return [(int(b) >> mbits) & ((1 << ebits) - 1) for b in old]


def _events(flags: list[bool], model: FlagModel) -> list[bool]:
    return [f != bool(model.pol) for f in flags]


def _gaps(ev: list[bool]) -> list[int]:
    """Gaps of an event sequence: before the first event, between events, after the last."""
    out, run = [], 0
    for e in ev:
        if e:
            out.append(run)
            run = 0
        else:
            run += 1
    return out + [run]


def _param_byte(model: FlagModel) -> int:
    return {NONE: 0, ALL: 1}.get(model.mode, 2 + 2 * model.j + model.pol)


def _parse_param(b: int) -> FlagModel:
    if b == 0:
        return FlagModel(NONE)
    if b == 1:
        return FlagModel(ALL, 1)
    v = b - 2
    if v >> 1 > 95:
        raise Corrupt(f"parameter byte {b}")
    return FlagModel(GOLOMB, v & 1, v >> 1)


def parse_table(payload: bytes, ebits: int) -> tuple[dict, dict, dict, int]:
    """(position models, step-flag models, magnitude parameter indices, offset of the streams)."""
    if len(payload) < 4:
        raise Corrupt("short")
    lo, hi = int.from_bytes(payload[0:2], "little"), int.from_bytes(payload[2:4], "little")
    if lo > hi or hi >= 1 << ebits:
        raise Corrupt("class range")
    R = hi - lo + 1
    if len(payload) < 4 + R:
        raise Corrupt("short")
    pos = {c: _parse_param(payload[4 + c - lo]) for c in range(lo, hi + 1)}
    if pos[lo].mode == NONE or pos[hi].mode == NONE:
        raise Corrupt("non-canonical class range")
    active = [c for c in range(lo, hi + 1) if pos[c].mode != NONE]
    off = 4 + R
    if len(payload) < off + 2 * len(active) + 4:
        raise Corrupt("short")
    flag, val = {}, {}
    for c in active:
        flag[c] = _parse_param(payload[off])
        val[c] = payload[off + 1]
        if val[c] > 95 or (flag[c].mode == NONE and val[c]):
            raise Corrupt("step parameters")
        off += 2
    return pos, flag, val, off


def encode(old: np.ndarray, new: np.ndarray, dtype: str, pos: dict, flag: dict, val: dict) -> bytes:
    """The payload for ``old`` -> ``new`` with the given per-class models (classes absent from
    ``pos`` are NONE). Models must fit the data (NONE only where nothing is set, etc.)."""
    w, mbits, ebits = LAYOUT[dtype]
    cls = classes(old, mbits, ebits)
    old_i, new_i = [int(x) for x in old], [int(x) for x in new]
    n = len(old_i)
    changed = [old_i[i] != new_i[i] for i in range(n)]
    active = sorted(c for c, m in pos.items() if m.mode != NONE)
    lo, hi = active[0], active[-1]
    table = bytearray(lo.to_bytes(2, "little") + hi.to_bytes(2, "little"))
    table += bytes(_param_byte(pos.get(c, FlagModel(NONE))) for c in range(lo, hi + 1))
    for c in active:
        table += bytes([_param_byte(flag[c]), val[c]])
    # position stream
    members = {c: [i for i in range(n) if cls[i] == c] for c in active}
    gaps_after = {}       # element index -> gap written at that event
    pbits = ""
    for c in active:
        if pos[c].mode != GOLOMB:
            continue
        ev = _events([changed[i] for i in members[c]], pos[c])
        g = _gaps(ev)
        pbits += golomb_code(g[0], golomb_m(pos[c].j))
        evs = [i for i, e in zip(members[c], ev) if e]
        for i, gap in zip(evs, g[1:]):
            gaps_after[i] = gap
    for i in range(n):
        if i in gaps_after:
            pbits += golomb_code(gaps_after[i], golomb_m(pos[cls[i]].j))
    p = _pack(pbits)
    return bytes(table) + len(p).to_bytes(4, "little") + p + _pack(step_bits(old_i, new_i, cls, flag, val, w))


def step_bits(old_i: list[int], new_i: list[int], cls: list[int], flag: dict, val: dict, w: int) -> str:
    """The step stream (encodings 4 and 5): ``flag``/``val`` hold the models of the classes it
    covers, in class order; a changed element's class must be among them."""
    n = len(old_i)
    changed = [old_i[i] != new_i[i] for i in range(n)]
    zs = {i: step_z(old_i[i], new_i[i], w) for i in range(n) if changed[i]}
    sbits = ""
    flag_gap_after = {}
    for c in sorted(flag):
        if flag[c].mode != GOLOMB:
            continue
        ch = [i for i in range(n) if cls[i] == c and changed[i]]
        ev = _events([((zs[i] - 1) >> 1) > 0 for i in ch], flag[c])
        g = _gaps(ev)
        sbits += golomb_code(g[0], golomb_m(flag[c].j))
        for i, gap in zip([i for i, e in zip(ch, ev) if e], g[1:]):
            flag_gap_after[i] = gap
    for i in sorted(zs):
        u = zs[i] - 1
        sbits += str(u & 1)
        if i in flag_gap_after:
            sbits += golomb_code(flag_gap_after[i], golomb_m(flag[cls[i]].j))
        if u >> 1:
            sbits += golomb_code((u >> 1) - 1, golomb_m(val[cls[i]]))
    return sbits


def decode(payload: bytes, old: np.ndarray, count: int, dtype: str) -> tuple[list[int], list[int]]:
    """(changed positions, their new bits); raises :class:`Corrupt` on any rule broken."""
    w, mbits, ebits = LAYOUT[dtype]
    cls = classes(old, mbits, ebits)
    n = len(cls)
    pos, flag, val, off = parse_table(payload, ebits)
    P = int.from_bytes(payload[off:off + 4], "little")
    off += 4
    if P > len(payload) - off:
        raise Corrupt("position stream length")
    ps, ss = Bits(payload[off:off + P]), Bits(payload[off + P:])
    left = {}
    for c in sorted(pos):
        if pos[c].mode == GOLOMB:
            left[c] = ps.golomb(golomb_m(pos[c].j), n)
    positions, pcls = [], []
    for i in range(n):
        c = cls[i]
        m = pos.get(c, FlagModel(NONE))
        if m.mode == NONE:
            continue
        if m.mode == ALL:
            changed = True
        else:
            event = left[c] == 0
            left[c] = ps.golomb(golomb_m(m.j), n) if event else left[c] - 1
            changed = event != bool(m.pol)
        if changed:
            if len(positions) == count:
                raise Corrupt("more changes than count")
            positions.append(i)
            pcls.append(c)
    if len(positions) != count:
        raise Corrupt("fewer changes than count")
    if any(v != 0 for v in left.values()):
        raise Corrupt("position gaps do not end at the chunk end")
    ps.finish()
    return positions, read_steps(ss, old, positions, pcls, flag, val, count, w)


def read_steps(ss: Bits, old: np.ndarray, positions: list[int], pcls: list[int], flag: dict, val: dict,
               count: int, w: int) -> list[int]:
    """The new bits of each changed element from the step stream ``ss`` (encodings 4 and 5); a
    class without a model in ``flag`` has big-flag model NONE."""
    zleft = {}
    for c in sorted(flag):
        if flag[c].mode == GOLOMB:
            zleft[c] = ss.golomb(golomb_m(flag[c].j), count)
    values = []
    for i, c in zip(positions, pcls):
        s = ss.bit()
        f = flag.get(c, FlagModel(NONE))
        if f.mode == GOLOMB:
            event = zleft[c] == 0
            zleft[c] = ss.golomb(golomb_m(f.j), count) if event else zleft[c] - 1
            big = event != bool(f.pol)
        else:
            big = f.mode == ALL
        a = ss.golomb(golomb_m(val[c]), (1 << (w - 1)) - 2) + 1 if big else 0
        z = 2 * a + s + 1
        if z > (1 << w) - 1:
            raise Corrupt("step outside the key space")
        d = z >> 1 if z % 2 == 0 else (1 << w) - 1 - (z >> 1)
        values.append(unkey((key(int(old[i]), w) + d) % (1 << w), w))
    if any(v != 0 for v in zleft.values()):
        raise Corrupt("step flags do not end with the changes")
    ss.finish()
    return values
