"""Encoding 0, unchanged: the chunk equals the parent's (docs/FORMAT.md, "Chunk encodings").

No payload and no fields. The chunk coder writes it itself wherever a chunk has
no change (``ckptdelta.delta.chunks.encode_chunk``): no other encoding is tried then.
"""

from __future__ import annotations

import numpy as np
import xxhash

from ckptdelta.delta.encodings.base import Encoding, register


class Unchanged(Encoding):
    id = 0
    name = "unchanged"
    decodes_into = False        # nothing to decode: a stager gives it no arrays (its count is 0)

    def check_entry(self, planes_a, planes_b, count, n, itemsize, has_parent, length, dtype_name):
        if count or length or planes_a or planes_b:
            return "unchanged chunk with a payload or planes"
        return super().check_entry(planes_a, planes_b, count, n, itemsize, has_parent, length, dtype_name)

    def decode(self, entry, payload, old, dt, where, out, grand):
        return np.empty(0, np.int64), np.empty(0, dt.bits_dtype)


ENCODING = register(Unchanged())
#: The checksum of the empty payload, which every unchanged entry carries.
EMPTY_CHECKSUM = xxhash.xxh3_64_intdigest(b"")
