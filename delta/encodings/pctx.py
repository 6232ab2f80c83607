"""Encoding 6, pctx: each step coded in contexts of the parent and of the step before it (the grandparent).

Payload: u32 R, a range-coded stream of R bytes, then a raw bit stream (docs/FORMAT.md,
"Encoding 6: pctx"); ``planes_a``/``planes_b`` the dtype's mantissa and exponent bits
(:data:`ckptdelta.delta.pctx.PCTX_LAYOUT`), ``count`` the changed elements. A reader needs the
tensor's grandparent too. The kernels and their glue are delta/pctx.py.

The chunk coder tries it with the context coder where its caller gave the
grandparent (a publisher of a LoRA run does), and keeps it where it is smaller.
"""

from __future__ import annotations

import numpy as np

from ckptdelta.delta import pctx as coder
from ckptdelta.delta.errors import GrandparentNeededError
from ckptdelta.delta.encodings.base import CONTEXT, Candidate, LayoutEncoding, register


class Pctx(LayoutEncoding):
    id = 6
    name = "pctx"
    needs_grandparent = True
    tried = CONTEXT
    order = 30
    layout = coder.PCTX_LAYOUT

    def encode(self, chunk):        # tried only where the grandparent was given (needs_grandparent)
        lay = self.layout.get(chunk.dt.name)
        if lay is None:
            return None
        payload = coder.encode_pctx(chunk.old, chunk.new, chunk.grand, chunk.dt)
        return None if payload is None else Candidate(self.id, *lay, chunk.changed, payload)

    def decode(self, entry, payload, old, dt, where, out, grand):
        if grand is None:
            raise GrandparentNeededError(f"{where}: a pctx chunk, coded against the tensor's version before its "
                                         "parent too, which this reader was not given")
        return coder.decode_pctx(payload, old, grand, entry.count, dt, where, out)

    def warm_up(self, old, new, grand, dt):
        """The codec's round trips give no grandparent, so they never reach these kernels (the encoder might
        pick another encoding anyway): they run here, on the kernels themselves."""
        if coder.layout_of(dt) is None:
            return
        payload = coder.encode_pctx(old, new, grand, dt)
        if payload is None:
            return
        pos, vals = coder.decode_pctx(payload, old, grand, int((old != new).sum()), dt, "warm-up")
        out = old.copy()
        out[pos] = vals
        if not np.array_equal(out, new):
            raise AssertionError(f"warm-up of encoding 6 for {dt.torch_dtype} is not bit-exact")


ENCODING = register(Pctx())
