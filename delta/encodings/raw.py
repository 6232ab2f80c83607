"""Encoding 3, raw: the chunk's new bits in byte planes, one zstd frame; the one encoding without parent.

Payload (docs/FORMAT.md, "Chunk encodings"): one zstd frame of the new bits in
``planes_b`` = w/8 byte planes; ``count`` is the chunk's elements. Every chunk of a
record without parent is raw. With a parent the chunk coder tries it where a chunk
was reset to something simple (zeros, a constant), which XORs into the old noise.
"""

from __future__ import annotations

import numpy as np

from ckptdelta.delta import kernels
from ckptdelta.delta.encodings import frames
from ckptdelta.delta.encodings.base import ALWAYS, Candidate, Encoding, register
from ckptdelta.delta.encodings.dense_xor import DENSE_TRY_FRACTION


class Raw(Encoding):
    id = 3
    name = "raw"
    needs_parent = False
    count_is_changes = False    # count = the chunk's elements: the changes are known only once decoded
    decodes_into = False
    tried = ALWAYS
    order = 50

    def check_fields(self, planes_a, planes_b, count, n, itemsize, length, dtype_name):
        if not (count == n and planes_a == 0 and planes_b == itemsize):
            return f"raw chunk fields out of range (count={count}, planes={planes_a}/{planes_b})"
        return None

    def encode(self, chunk):
        n, w = chunk.n, chunk.dt.itemsize
        # With a parent, only where the dense try ran (that many changes) and nothing compressed well: then the
        # new bits alone may be far smaller. (The dense try's own condition on the best before it follows.)
        if chunk.old is not None and not (chunk.changed > DENSE_TRY_FRACTION * n and chunk.best_length > n * w // 2):
            return None
        planes = kernels.to_planes(chunk.new, w)
        if chunk.old is not None and not frames.may_beat(planes, n, chunk.best_length, chunk.best_estimate):
            return None
        return Candidate(self.id, 0, w, n, frames.compressor(chunk.level).compress(planes))

    def check_whole(self, entry, payload, n, dt, where):
        frames.check_frame(payload, n * dt.itemsize, where)

    def decode_whole(self, entry, payload, n, dt, where):
        planes = np.frombuffer(frames.unzstd(payload, n * dt.itemsize, where), dtype=np.uint8)
        out = np.empty(n, dtype=dt.bits_dtype)
        kernels.from_planes(planes, n, dt.itemsize, out)
        return out

    def decode(self, entry, payload, old, dt, where, out, grand):
        new = self.decode_whole(entry, payload, old.shape[0], dt, where)
        changed = kernels.count_changed(old, new)
        positions = np.empty(changed, np.int64)
        values = np.empty(changed, dt.bits_dtype)
        kernels.diff_positions(old, new, positions, values)
        return positions, values


ENCODING = register(Raw())
