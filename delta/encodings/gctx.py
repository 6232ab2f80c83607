"""Encoding 5, gctx: encoding 4's contexts, positions coded per group of classes; the context coder.

Payload: a group table, a class table, the groups' position streams, then the step
stream (docs/FORMAT.md, "Encoding 5: gctx"); fields as encoding 4's. The glue is
delta/ctxcoder.py (``encode_gctx``, ``decode_gctx``), the kernels delta/gctx.py.

It is what ``encode(context=True)`` writes (``ckptdelta.delta.chunks.CONTEXT_ENCODING``): its
scan of every element counts the changes and finds sparse's arrays on the way, so
the chunk coder tries sparse after it without a pass of its own, and skips
compressing sparse's planes where this payload is surely smaller. It carries the
context codec's cost model.
"""

from __future__ import annotations

from ckptdelta.delta import ctxcoder
from ckptdelta.delta.encodings.base import CONTEXT, Candidate, Cost, LayoutEncoding, register
from ckptdelta.delta.encodings.ctx import take_scan


class Gctx(LayoutEncoding):
    id = 5
    name = "gctx"
    tried = CONTEXT
    order = 20
    scans = True
    layout = ctxcoder.CTX_LAYOUT
    #: ``ckptdelta.delta.encode_many`` on the reference workload (benchmarks.workloads "small", 2 threads, 0.13-6.8%
    #: changed): 0.53x and 0.39x encoding 4's time per changed element and 1.0-1.4x per element in two runs,
    #: so 70 -> 32 units per changed element. Decode: encoding 4's (1.25, 28.0), fitted to benchmarks/at_scale.py
    #: at 1 GB, 2 cores each side (decode over trainer-side time 0.89-0.90 at lr 1e-6 (1.0% changed), 0.50-0.59
    #: at lr 1e-5 (6.8%)), scaled by what this encoding's stage() took against encoding 4's in one fit of the
    #: reference workload (0.66x per element, 0.69x per changed element) over its encode unit (~1.15x encoding
    #: 4's). Its priors are encoding 4's (the fast path's are relative to those).
    cost = Cost(work_per_changed=32.0, decode_work=(0.72, 16.8), prior_per_work=1.0, prior_bytes_per_changed=1.0)

    def scan(self, chunk):
        return take_scan(chunk, ctxcoder.encode_gctx(chunk.old, chunk.new, chunk.dt))

    def encode(self, chunk):
        if chunk.scan_payload is None:
            return None
        return Candidate(self.id, *self.layout[chunk.dt.name], chunk.changed, chunk.scan_payload)

    def decode(self, entry, payload, old, dt, where, out, grand):
        return ctxcoder.decode_ctx(payload, old, entry.count, dt, where, out, grouped=True)


ENCODING = register(Gctx())
