"""Encoding 4, ctx: the changes coded in contexts taken from the parent (its exponent field), per class.

Payload: a class table, then a position and a step bit stream (docs/FORMAT.md,
"Encoding 4: ctx"); ``planes_a``/``planes_b`` are the dtype's mantissa and exponent
bits (:data:`ckptdelta.delta.ctxcoder.CTX_LAYOUT`), ``count`` the changed elements. The glue
is delta/ctxcoder.py, the kernels delta/ctx_encoder.py and delta/ctx_decoder.py.

The codec wrote it before encoding 5 existed and still reads it; it writes it again
only where ``ckptdelta.delta.chunks.CONTEXT_ENCODING`` names it (tests of encoding 4).
"""

from __future__ import annotations

import numpy as np

from ckptdelta.delta import ctxcoder, kernels
from ckptdelta.delta.encodings.base import CONTEXT, Candidate, Cost, LayoutEncoding, register


def take_scan(chunk, res: "ctxcoder.CtxResult | None") -> bool:
    """Fill ``chunk`` from a context coder's result (its scan counted the changes and found sparse's
    arrays on the way); False for None (the dtype has no context layout)."""
    if res is None:
        return False
    chunk.sparse_parts = res.sparse_parts
    chunk.changed = res.sparse_parts[0].shape[0]
    chunk.scan_payload = res.payload
    chunk.beats_sparse = res.beats_sparse
    chunk.changed_nan = res.changed_nan
    return True


class Ctx(LayoutEncoding):
    id = 4
    name = "ctx"
    tried = CONTEXT
    order = 20
    scans = True
    layout = ctxcoder.CTX_LAYOUT
    #: Fitted as for encoding 5 (delta/encodings/gctx.py) when this was the context coder: ~2.2 ns/element +
    #: ~150 ns/changed element; decode (1.25, 28.0) of that encode's units.
    cost = Cost(work_per_changed=70.0, decode_work=(1.25, 28.0), prior_per_work=1.0, prior_bytes_per_changed=1.0)

    def scan(self, chunk):
        return take_scan(chunk, ctxcoder.encode_ctx(chunk.old, chunk.new, chunk.dt))

    def encode(self, chunk):
        if chunk.scan_payload is None:
            return None
        return Candidate(self.id, *self.layout[chunk.dt.name], chunk.changed, chunk.scan_payload)

    def decode(self, entry, payload, old, dt, where, out, grand):
        return ctxcoder.decode_ctx(payload, old, entry.count, dt, where, out)

    def warm_up(self, old, new, grand, dt):
        """The codec no longer writes encoding 4, so its round trips never reach these kernels; a
        replica still decodes records written before encoding 5."""
        if ctxcoder.layout_of(dt) is None:
            return
        k = kernels.count_changed(old, new)
        if not k:
            return
        pos, vals = ctxcoder.decode_ctx(ctxcoder.encode_ctx(old, new, dt, k).payload, old, k, dt, "warmup")
        if not (np.array_equal(pos, np.flatnonzero(old != new)) and np.array_equal(vals, new[pos])):
            raise AssertionError(f"warm-up of encoding 4 ({dt.name}) is not bit-exact")


ENCODING = register(Ctx())
