"""Bit masks of 64 consecutive elements from one vector compare (numba intrinsics).

Why: encoding 5 (delta/gctx.py) works a word of 64 elements at a time, and both of
its ends spend most of their per-element time building such masks. Written as a
scalar loop (``m |= (x[j] == v) << j``), LLVM vectorises the compares but assembles
the mask lane by lane, several times slower than the target's own mask
instructions. Here the 64 elements are loaded as one LLVM vector, compared, and the
<64 x i1> result bitcast to an i64, which LLVM lowers to those instructions
(AVX-512 mask registers, AVX2 movemask, NEON on ARM): a few per word
(benchmarks/stages.py times the stages that use them). The caller guarantees that
all 64 elements exist; the last, partial word of a chunk goes through a scalar loop.

Under ``NUMBA_DISABLE_JIT`` (coverage runs) the same functions are plain Python.
"""

from __future__ import annotations

import numpy as np
from numba.core import config

if config.DISABLE_JIT:
    def range_mask64(x, base, em, lo, wd):
        """Bit j: ``(x[base + j] & em) - lo < wd``, in the elements' own width (a wrapped
        difference is out of range)."""
        top = (1 << (8 * x.dtype.itemsize)) - 1
        m = 0
        for j in range(64):
            if (((int(x[base + j]) & int(em)) - int(lo)) & top) < int(wd):
                m |= 1 << j
        return np.uint64(m)

    def neq_mask64(a, b, base):
        """Bit j: ``a[base + j] != b[base + j]``."""
        m = 0
        for j in range(64):
            if a[base + j] != b[base + j]:
                m |= 1 << j
        return np.uint64(m)
else:
    from llvmlite import ir
    from numba import types
    from numba.core import cgutils
    from numba.extending import intrinsic

    def _load64(context, builder, aty, ary_val, base):
        ary = context.make_array(aty)(context, builder, ary_val)
        ptr = cgutils.get_item_pointer(context, builder, aty, ary, [base], wraparound=False)
        elt = context.get_value_type(aty.dtype)
        vty = ir.VectorType(elt, 64)
        return builder.load(builder.bitcast(ptr, vty.as_pointer()), align=1), elt, vty

    def _splat(builder, val, elt, vty):
        if val.type.width > elt.width:
            val = builder.trunc(val, elt)
        undef = ir.Constant(vty, ir.Undefined)
        v = builder.insert_element(undef, val, ir.Constant(ir.IntType(32), 0))
        return builder.shuffle_vector(v, undef, ir.Constant(ir.VectorType(ir.IntType(32), 64), [0] * 64))

    def _contiguous(*arrays) -> bool:
        """Only 1-d C-contiguous arrays: the 64 elements are loaded as one vector from the first."""
        return all(isinstance(a, types.Array) and a.ndim == 1 and a.layout == "C" for a in arrays)

    @intrinsic
    def range_mask64(typingctx, x, base, em, lo, wd):
        """Bit j: ``(x[base + j] & em) - lo < wd``, in the elements' own width (a wrapped
        difference is out of range). ``x``: a C-contiguous uint8/uint16 array; em, lo, wd:
        uint32 that fit the element width."""
        if not _contiguous(x):
            return None
        sig = types.uint64(x, base, em, lo, wd)

        def codegen(context, builder, signature, args):
            a, b, em_, lo_, wd_ = args
            v, elt, vty = _load64(context, builder, signature.args[0], a, b)
            d = builder.sub(builder.and_(v, _splat(builder, em_, elt, vty)), _splat(builder, lo_, elt, vty))
            c = builder.icmp_unsigned("<", d, _splat(builder, wd_, elt, vty))
            return builder.bitcast(c, ir.IntType(64))

        return sig, codegen

    @intrinsic
    def neq_mask64(typingctx, a, b, base):
        """Bit j: ``a[base + j] != b[base + j]`` (two C-contiguous arrays of one integer dtype)."""
        if not _contiguous(a, b):
            return None
        sig = types.uint64(a, b, base)

        def codegen(context, builder, signature, args):
            x, y, i = args
            v1, _, _ = _load64(context, builder, signature.args[0], x, i)
            v2, _, _ = _load64(context, builder, signature.args[1], y, i)
            return builder.bitcast(builder.icmp_unsigned("!=", v1, v2), ir.IntType(64))

        return sig, codegen
