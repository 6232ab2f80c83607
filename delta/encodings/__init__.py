"""The chunk encodings of docs/FORMAT.md, one module each, registered by id (:mod:`ckptdelta.delta.encodings.base`).

Importing this package registers the built-in encodings. A new encoding is one
more module here (its id, fields check, encoder, decoder, warm-up and cost, with
its kernels in a module of their own) and one import below: the chunk coder
(delta/chunks.py), the record parser (delta/record.py), the warm-up and the
publisher's cost model take it from the registry.
"""

from __future__ import annotations

from ckptdelta.delta.encodings import (ctx, dense_step, dense_xor, gctx, grouped_pstep, grouped_step, pctx, raw,
                                      sparse, unchanged)
from ckptdelta.delta.encodings.base import (ALWAYS, CONTEXT, FAST, REGISTRY, Candidate, Chunk, Cost, Encoding,
                                            LayoutEncoding, register)

UNCHANGED = unchanged.ENCODING.id
SPARSE = sparse.ENCODING.id
DENSE_XOR = dense_xor.ENCODING.id
RAW = raw.ENCODING.id
CTX = ctx.ENCODING.id
GCTX = gctx.ENCODING.id
PCTX = pctx.ENCODING.id
DENSE_STEP = dense_step.ENCODING.id
GROUPED_STEP = grouped_step.ENCODING.id
GROUPED_PSTEP = grouped_pstep.ENCODING.id

__all__ = ["ALWAYS", "CONTEXT", "CTX", "DENSE_STEP", "DENSE_XOR", "FAST", "GCTX", "GROUPED_PSTEP", "GROUPED_STEP",
           "PCTX", "RAW", "REGISTRY", "SPARSE", "UNCHANGED", "Candidate", "Chunk", "Cost", "Encoding", "LayoutEncoding",
           "register"]
