"""Encoding 5, gctx: encoding 4's contexts, positions coded per group of classes; the context coder.

Payload: a group table, a class table, the groups' position streams, then the step
stream (docs/FORMAT.md, "Encoding 5: gctx"); fields as encoding 4's. The glue is
delta/ctxcoder.py (``encode_gctx``, ``decode_gctx``), the kernels delta/gctx.py.

It is what ``encode(context=True)`` writes (``delta.chunks.CONTEXT_ENCODING``): its
scan of every element counts the changes and finds sparse's arrays on the way, so
the chunk coder tries sparse after it without a pass of its own, and skips
compressing sparse's planes where this payload is surely smaller.
"""

from __future__ import annotations

from .. import ctxcoder
from .base import CONTEXT, Candidate, LayoutEncoding, register
from .ctx import take_scan


class Gctx(LayoutEncoding):
    id = 5
    name = "gctx"
    tried = CONTEXT
    order = 20
    scans = True
    layout = ctxcoder.CTX_LAYOUT
    def scan(self, chunk):
        return take_scan(chunk, ctxcoder.encode_gctx(chunk.old, chunk.new, chunk.dt))

    def encode(self, chunk):
        if chunk.scan_payload is None:
            return None
        return Candidate(self.id, *self.layout[chunk.dt.name], chunk.changed, chunk.scan_payload)

    def decode(self, entry, payload, old, dt, where, out, grand):
        return ctxcoder.decode_ctx(payload, old, entry.count, dt, where, out, grouped=True)


ENCODING = register(Gctx())
