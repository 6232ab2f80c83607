"""Encoding 2, dense_xor: ``old XOR new`` of every element of the chunk, in byte planes, one zstd frame.

Payload (docs/FORMAT.md, "Chunk encodings"): one zstd frame of the XOR values in
``planes_b`` = w/8 byte planes; ``count`` is the number of nonzero XOR values (the
changed elements), which a reader checks. The kernels are in delta/kernels.py.
"""

from __future__ import annotations

import numpy as np

from ckptdelta.delta import kernels
from ckptdelta.delta.errors import FormatError
from ckptdelta.delta.encodings import frames
from ckptdelta.delta.encodings.base import ALWAYS, Candidate, Encoding, register

# Above this fraction of changed elements the dense XOR form is tried as well and the smaller kept,
# unless the best so far already compresses the chunk DENSE_SKIP_RATIO-fold: on the reference
# workloads (every lr and window, bf16/fp8) XOR+zstd never got below 1/15 of a chunk, and the
# ctx payload was smaller on every chunk where both applied. Compressing the XOR planes costs
# more than the whole ctx encode, so the try is kept for where it can win.
DENSE_TRY_FRACTION = 0.08
DENSE_SKIP_RATIO = 16


class DenseXor(Encoding):
    id = 2
    name = "dense_xor"
    tried = ALWAYS
    order = 40

    def check_fields(self, planes_a, planes_b, count, n, itemsize, length, dtype_name):
        if not (1 <= count <= n and planes_a == 0 and planes_b == itemsize):
            return f"dense chunk fields out of range (count={count}, planes={planes_a}/{planes_b})"
        return None

    def encode(self, chunk):
        n, w, best = chunk.n, chunk.dt.itemsize, chunk.best_length
        if not (chunk.changed > DENSE_TRY_FRACTION * n and DENSE_SKIP_RATIO * best > n * w):
            return None
        planes = kernels.xor_planes(chunk.old, chunk.new, w)
        if not frames.may_beat(planes, n, best, chunk.best_estimate):
            return None
        return Candidate(self.id, 0, w, chunk.changed, frames.compressor(chunk.level).compress(planes))

    def decode(self, entry, payload, old, dt, where, out, grand):
        n = old.shape[0]
        planes = np.frombuffer(frames.unzstd(payload, n * dt.itemsize, where), np.uint8)
        positions, values = (np.empty(entry.count, np.int64), np.empty(entry.count, dt.bits_dtype)) \
            if out is None else out
        if _xor_count(planes, n, dt.itemsize) != entry.count:
            raise FormatError(f"{where}: dense chunk changes a different number of elements than its header says")
        kernels.xor_apply_planes(old, planes, dt.itemsize, positions, values)
        return positions, values


def _xor_count(planes: np.ndarray, n: int, nplanes: int) -> int:
    nz = planes[:n] != 0
    for p in range(1, nplanes):
        nz |= planes[p * n:(p + 1) * n] != 0
    return int(np.count_nonzero(nz))


ENCODING = register(DenseXor())
