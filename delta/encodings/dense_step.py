"""Encoding 7, dense_step: the zigzag key step of every element of the chunk (zero where it did not change),
in byte planes, one zstd frame.

Payload (docs/FORMAT.md, "Chunk encodings"): one zstd frame of the steps in
``planes_b`` byte planes (as few as the largest step needs); ``count`` is the
number of nonzero steps (the changed elements), which a reader checks.

Why: where most of a chunk's elements move (a LoRA step, every element of the
adapter; a full model's dense step) sparse's positions say next to nothing, yet
its encoder still extracts every gap and codes two frames. Coding the step of
every element in place gives the same bytes (within 2% on LoRA steps, fp32 and
bf16, from half the chunk changed up) from one pass, one sweep per plane and one
frame: the fast path's encode of a LoRA step in 0.66-0.82x the time on one
thread, its decode in 0.81-0.99x (docs/PERFORMANCE.md, "LoRA runs, dense
steps"). The fast path codes a chunk with it, instead of sparse,
where at least :data:`DENSE_STEP_FRACTION` of the elements changed
(delta/chunks.py); below that sparse's positions are worth their cost, and its
bytes were 1.5x smaller at a tenth changed. For 16- and 8-bit floats the fast path
now writes encodings 8 and 9 instead (delta/encodings/grouped_step.py: the same
steps sorted by class, 11-15% fewer bytes on bf16 LoRA steps); this one codes the
other dtypes' dense chunks, and decodes every delta written before. The kernels are
in delta/kernels.py.
"""

from __future__ import annotations

import numpy as np

from ckptdelta.delta import kernels
from ckptdelta.delta.encodings import frames
from ckptdelta.delta.encodings.base import FAST, Candidate, Encoding, register
from ckptdelta.delta.encodings.grouped_step import WRITTEN as GROUPED
from ckptdelta.delta.errors import FormatError

#: The share of a chunk's elements that must have changed for the fast path to code it as dense steps rather
#: than sparse. On LoRA steps (fp32 and bf16, ranks 16 and 64) dense steps were 0.98-1.00x sparse's bytes
#: from half changed up, and 1.5-1.6x at 10-20% changed.
DENSE_STEP_FRACTION = 0.5
#: The same line for the dtypes the fast path writes grouped by class (encodings 8 and 9: grouped_step.WRITTEN).
#: Sorted by class, the steps (unchanged elements' zeros included) code smaller, and they cross sparse's bytes
#: near 35% changed (a bf16 rank-64 LoRA step with changes reverted at random); at lr 1e-4 the lora_A tensors
#: that change 43-45% of their elements then code 10% smaller: 2.6% fewer bytes a step, 0.96x the encode and
#: 1.06x the stage on one thread (docs/PERFORMANCE.md, "Dense steps grouped by class").
GROUPED_DENSE_FRACTION = 0.4


class DenseStep(Encoding):
    id = 7
    name = "dense_step"
    tried = FAST
    order = 11
    decodes_dense = True

    def check_fields(self, planes_a, planes_b, count, n, itemsize, length, dtype_name):
        if not (1 <= count <= n and planes_a == 0 and 1 <= planes_b <= itemsize):
            return f"dense_step chunk fields out of range (count={count}, planes={planes_a}/{planes_b})"
        return None

    def encode(self, chunk):
        # the chunk coder's call: the fast path, at least half the chunk changed; a 16- or 8-bit float's chunk goes
        # to grouped_step (8) or grouped_pstep (9) instead, which sort its steps by class first
        if not chunk.dense_step or chunk.dt.name in GROUPED:
            return None
        dt = chunk.dt
        planes, nplanes = kernels.step_planes(chunk.old, chunk.new, 8 * dt.itemsize, dt.sign_magnitude)
        payload = frames.compressor(chunk.level).compress(planes)
        # a dense XOR or raw try follows unless the fast path's own encoding is tried alone: it weighs its
        # planes against these
        est = None if chunk.alone else frames.estimate(planes, chunk.n)
        return Candidate(self.id, 0, nplanes, chunk.changed, payload, est)

    def decode(self, entry, payload, old, dt, where, out, grand):
        n = old.shape[0]
        planes = np.frombuffer(frames.unzstd(payload, n * entry.planes_b, where), np.uint8)
        positions, values = (np.empty(entry.count, np.int64), np.empty(entry.count, dt.bits_dtype)) \
            if out is None else out
        got = kernels.step_apply_planes(old, planes, entry.planes_b, 8 * dt.itemsize, dt.sign_magnitude,
                                        positions, values)
        if got != entry.count:
            raise FormatError(f"{where}: dense_step chunk changes {'more' if got < 0 else got} elements, its "
                              f"header says {entry.count}")
        return positions, values

    def decode_dense(self, entry, payload, old, dt, where, out, grand):
        n = old.shape[0]
        planes = np.frombuffer(frames.unzstd(payload, n * entry.planes_b, where), np.uint8)
        got = kernels.step_apply_planes_dense(old, planes, entry.planes_b, 8 * dt.itemsize, dt.sign_magnitude, out)
        if got != entry.count:
            raise FormatError(f"{where}: dense_step chunk changes {got if got >= 0 else 'an unreadable number of'} "
                              f"elements, its header says {entry.count}")

    def warm_up(self, old, new, grand, dt):
        # the codec's round trips change half the elements at most, where the fast path may still pick sparse
        w = 8 * dt.itemsize
        planes, nplanes = kernels.step_planes(old, grand, w, dt.sign_magnitude)
        count = kernels.count_changed(old, grand)
        positions, values = np.empty(count, np.int64), np.empty(count, dt.bits_dtype)
        if kernels.step_apply_planes(old, planes, nplanes, w, dt.sign_magnitude, positions, values) != count or \
                not np.array_equal(values, grand[positions]):
            raise AssertionError(f"warm-up of dense steps of {dt.name} is not bit-exact")
        dense = np.empty_like(old)
        if kernels.step_apply_planes_dense(old, planes, nplanes, w, dt.sign_magnitude, dense) != count or \
                not np.array_equal(dense, grand):
            raise AssertionError(f"warm-up of dense steps of {dt.name} (decoded densely) is not bit-exact")


ENCODING = register(DenseStep())
