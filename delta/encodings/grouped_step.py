"""Encoding 8, grouped_step: dense steps in the order of their classes, one zstd frame (and encoding 9's base).

Payload (docs/FORMAT.md, "Encodings 8 and 9"): one zstd frame of every element's zigzag
key step (as dense_step's, encoding 7) in ``planes_b`` byte planes, the elements taken
class by class: a chunk stably sorted by its parent's exponent field (8), or by that
and whether the step before moved the element, each step negated where the step before
went down (9, which needs the grandparent). ``count`` is the number of changed elements.

Why: a step's size in ulps follows its element's exponent (an exponent fixes the ulp,
an optimizer's step its value), so dense_step's planes interleave a few dozen
distributions, and zstd's per-block Huffman tables fit their mixture. Sorted by class, a
block holds one or two of them: on bf16 LoRA steps 11-15% fewer bytes than dense_step
(Adam's steps keep their direction, so with the grandparent, encoding 9, a step negated
where the one before went down is mostly positive), and zstd runs faster both ways on the
sorted planes, which pays for part of the sort (docs/PERFORMANCE.md, "Dense steps grouped
by class"). The fast path codes a dense chunk of a 16- or 8-bit float dtype with one of
these instead of dense_step (:data:`WRITTEN`); dense_step stays for the others (fp32's
low planes are noise in any order) and decodes as before. Encoding 9 is
delta/encodings/grouped_pstep.py; the kernels are in delta/kernels.py.
"""

from __future__ import annotations

import numpy as np

from ckptdelta.delta import kernels
from ckptdelta.delta.encodings import frames
from ckptdelta.delta.encodings.base import FAST, Candidate, Encoding, register
from ckptdelta.delta.errors import FormatError, GrandparentNeededError

#: dtype name -> (mantissa bits, exponent bits): an element's class is its parent's exponent field,
#: ``(bits >> mantissa) & (2^exponent - 1)``. The float dtypes, which a reader decodes in these encodings.
GROUPED_LAYOUT = {"BF16": (7, 8), "F16": (10, 5), "F32": (23, 8), "F64": (52, 11), "F8_E4M3": (3, 4),
                  "F8_E5M2": (2, 5)}
#: The dtypes whose dense chunks the fast path writes in these encodings (dense_step for the others). The sort
#: pays where a step is a few ulps: on bf16 LoRA steps 11-15% fewer bytes for 1.1-1.5x the encode and 1.4-1.7x
#: the stage; on fp32 ones, whose low planes are noise in any order, 3% fewer for 1.4x the encode and 1.6x the
#: stage (docs/PERFORMANCE.md, "Dense steps grouped by class"). A set, not a constant: a benchmark compares the
#: two orders by emptying it.
WRITTEN = {"BF16", "F16", "F8_E4M3", "F8_E5M2"}


class GroupedStep(Encoding):
    id = 8
    name = "grouped_step"
    tried = FAST
    order = 12
    decodes_dense = True
    #: Whether the classes also say if the step before moved the element, and steps are coded negated where it
    #: went down (encoding 9: the grandparent's bits needed at both ends).
    by_prev = False

    def check_fields(self, planes_a, planes_b, count, n, itemsize, length, dtype_name):
        if dtype_name not in GROUPED_LAYOUT:
            return f"{self.name} chunk of {dtype_name or 'a dtype'} without an exponent field"
        if not (1 <= count <= n and planes_a == 0 and 1 <= planes_b <= itemsize):
            return f"{self.name} chunk fields out of range (count={count}, planes={planes_a}/{planes_b})"
        return None

    def _grand(self, old: np.ndarray, grand: np.ndarray | None, where: str) -> np.ndarray:
        """What the kernels take as the grandparent: its bits (encoding 9), or any array of the chunk's length."""
        if not self.by_prev:
            return old
        if grand is None:
            raise GrandparentNeededError(f"{where}: a {self.name} chunk, coded against the tensor's version before "
                                         "its parent too, which this reader was not given")
        return grand

    def encode(self, chunk):
        # the fast path's dense chunks of a 16- or 8-bit float: this one without a grandparent, 9 with (chunk.grand
        # is given only where encoding 9 is tried too)
        if not chunk.dense_step or (chunk.grand is not None) != self.by_prev or chunk.dt.name not in WRITTEN:
            return None
        dt = chunk.dt
        planes, nplanes = kernels.grouped_step_planes(chunk.old, chunk.new, chunk.grand if self.by_prev else chunk.old,
                                                      self.by_prev, *GROUPED_LAYOUT[dt.name], 8 * dt.itemsize,
                                                      dt.sign_magnitude)
        payload = frames.compressor(chunk.level).compress(planes)
        est = None if chunk.alone else frames.estimate(planes, chunk.n)
        return Candidate(self.id, 0, nplanes, chunk.changed, payload, est)

    def _planes(self, entry, payload, n: int, where: str) -> np.ndarray:
        return np.frombuffer(frames.unzstd(payload, n * entry.planes_b, where), np.uint8)

    def decode(self, entry, payload, old, dt, where, out, grand):
        g = self._grand(old, grand, where)
        n = old.shape[0]
        planes = self._planes(entry, payload, n, where)
        positions, values = (np.empty(entry.count, np.int64), np.empty(entry.count, dt.bits_dtype)) \
            if out is None else out
        got = kernels.grouped_step_apply(old, g, self.by_prev, planes, entry.planes_b, *GROUPED_LAYOUT[dt.name],
                                         8 * dt.itemsize, dt.sign_magnitude, positions, values)
        if got != entry.count:
            raise FormatError(f"{where}: {self.name} chunk changes {'more' if got < 0 else got} elements, its "
                              f"header says {entry.count}")
        return positions, values

    def decode_dense(self, entry, payload, old, dt, where, out, grand):
        g = self._grand(old, grand, where)
        planes = self._planes(entry, payload, old.shape[0], where)
        got = kernels.grouped_step_apply_dense(old, g, self.by_prev, planes, entry.planes_b,
                                               *GROUPED_LAYOUT[dt.name], 8 * dt.itemsize, dt.sign_magnitude, out)
        if got != entry.count:
            raise FormatError(f"{where}: {self.name} chunk changes {got if got >= 0 else 'an unreadable number of'} "
                              f"elements, its header says {entry.count}")

    def warm_up(self, old, new, grand, dt):
        # encoding 9 needs a grandparent the codec's round trips do not give, and both run only on dense chunks
        lay = GROUPED_LAYOUT.get(dt.name)
        if lay is None:
            return
        w = 8 * dt.itemsize
        g = grand if self.by_prev else old
        planes, nplanes = kernels.grouped_step_planes(old, new, g, self.by_prev, *lay, w, dt.sign_magnitude)
        count = kernels.count_changed(old, new)
        positions, values = np.empty(count, np.int64), np.empty(count, dt.bits_dtype)
        if kernels.grouped_step_apply(old, g, self.by_prev, planes, nplanes, *lay, w, dt.sign_magnitude, positions,
                                      values) != count or not np.array_equal(values, new[positions]):
            raise AssertionError(f"warm-up of {self.name} of {dt.name} is not bit-exact")
        dense = np.empty_like(old)
        if kernels.grouped_step_apply_dense(old, g, self.by_prev, planes, nplanes, *lay, w, dt.sign_magnitude,
                                            dense) != count or not np.array_equal(dense, new):
            raise AssertionError(f"warm-up of {self.name} of {dt.name} (decoded densely) is not bit-exact")


ENCODING = register(GroupedStep())
