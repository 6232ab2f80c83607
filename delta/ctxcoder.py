"""Chunk encodings 4 ("ctx") and 5 ("gctx"): changes coded with contexts the decoder already holds.

Why: the parent's bits predict the change. An element's exponent fixes its ulp,
and an optimizer step of roughly ``lr`` moves an element with a small ulp almost
surely and one with a large ulp rarely; an element that moves nearly always moves
one ulp. So every element is put in a *class*, its parent's exponent field (known
to encoder and decoder alike), and each class gets its own model: the changed
positions are Golomb-coded gaps inside the class's own index sequence, the steps a
sign bit plus a Golomb-coded "moved more than one ulp" sequence and magnitude.
Golomb codes are within ~1% of the entropy of geometric gaps, need one parameter
byte per class (no frequency tables), and decode with a bit reader and no
divisions. On the small reference model (bf16, 1% of elements changed) this comes
close to the conditional entropy benchmarks/entropy.py prints, well past the
order-0 limit and much smaller than XOR+zstd (docs/PERFORMANCE.md); the price is a
pass over every parent element where encoding 1 touches only the changes.

Layout, classes, parameters and bit order are fixed by docs/FORMAT.md
("Encoding 4: ctx"). This module is the glue delta/chunks.py calls; the kernels
(pure numba functions over numpy arrays) are in delta/ctx_encoder.py and
delta/ctx_decoder.py, their shared helpers in delta/ctx_bits.py. The decoder
validates every length, count and value it derives from the payload (numba does no
bounds checks) and never reads past it: a bad payload yields an error code that
:func:`decode_ctx` turns into a :class:`FormatError` naming the tensor and chunk.
"""

from __future__ import annotations

import sys
import threading
from typing import NamedTuple

import numpy as np

from ckptdelta.delta.ctx_bits import MAX_J
from ckptdelta.delta.ctx_decoder import ctx_decode
from ckptdelta.delta.ctx_encoder import ctx_encode, sparse_estimate
from ckptdelta.delta.dtypes import DType, nan_rule
from ckptdelta.delta.errors import FormatError
from ckptdelta.delta.gctx import GMAX, gctx_decode, gctx_encode

__all__ = ["CTX_LAYOUT", "MAX_J", "CtxResult", "ctx_decode", "ctx_encode", "decode_ctx", "decode_gctx", "encode_ctx",
           "encode_gctx", "gctx_decode", "gctx_encode", "golomb_m", "layout_of", "sparse_estimate"]

#: The dtypes encodings 4 and 5 serve: an element's context is its parent's exponent field, and
#: (planes_a, planes_b) of their chunk entries = (mantissa bits, exponent bits) (docs/FORMAT.md, encoding 4).
CTX_LAYOUT = {"BF16": (7, 8), "F16": (10, 5), "F8_E4M3": (3, 4), "F8_E5M2": (2, 5)}

_ERRORS = {
    1: "payload shorter than its class table",
    2: "class range outside the dtype's exponent classes",
    3: "invalid parameter byte",
    4: "non-canonical class table",
    5: "a coded gap or step exceeds its bound",
    6: "more changed elements than the chunk entry's count",
    7: "fewer changed elements than the chunk entry's count",
    8: "a class's position gaps do not end at the chunk's end",
    9: "a class's step flags do not end with its changes",
    10: "bit stream read past the payload's end",
    11: "trailing bytes or nonzero padding after the bit stream",
    12: "a step outside the dtype's key space",
}
#: Encoding 5's: the same codes, where a table or a stream belongs to a group of classes.
_GERRORS = {**_ERRORS,
            1: "payload shorter than its group and class tables",
            2: "group bounds or class range outside the dtype's exponent classes",
            4: "non-canonical table (a stream for a group not Golomb-coded, or a magnitude index without big steps)",
            8: "a group's position gaps do not end at the chunk's end"}


def layout_of(dt: DType) -> tuple[int, int] | None:
    """(mantissa bits, exponent bits) when encoding 4 serves ``dt``, else None."""
    return CTX_LAYOUT.get(dt.name)


def golomb_m(j: int) -> int:
    """The Golomb parameter of index ``j``: four steps per octave, exact in integers."""
    return ((4 + (j & 3)) << (j >> 2)) >> 2


class CtxResult(NamedTuple):
    payload: bytes
    sparse_parts: tuple     # encoding 1's (gaps, steps, max_gap, max_step), as kernels.sparse_extract
    beats_sparse: bool      # payload <= SURELY_SMALLER * sparse's patternless estimate
    changed_nan: bool | None = None     # a changed element's new bits are a NaN (None: not looked at)


# Below this fraction of sparse's order-0 estimate (which its zstd frames never beat on the
# reference workloads: actual / estimate >= 1.0, median 1.1-1.4) ctx is taken without
# compressing sparse's planes; above it, both are encoded and the smaller kept.
SURELY_SMALLER = 0.9


_WORD = {1: np.uint32, 2: np.uint64}

_local = threading.local()
#: Scratch up to this many elements is kept per thread (20 MB of address space at the default chunk size;
#: only the pages the changes fill are touched).
SCRATCH_KEEP = 1 << 20


def scan_scratch(n: int) -> np.ndarray:
    """The encoder scan's change arrays for a chunk of ``n`` elements: this thread's own, reused
    from chunk to chunk (fresh memory per chunk costs a page fault on every page written)."""
    s = getattr(_local, "scratch", None)
    if s is not None and s.shape[1] >= n + GMAX:
        return s
    s = np.empty((5, n + GMAX), np.int32)        # encoding 5 writes up to n + GMAX gaps
    if n <= SCRATCH_KEEP:
        _local.scratch = s
    return s


def _words_of_four(x: np.ndarray) -> np.ndarray:
    """The leading elements of ``x`` as one word per four (a view, no copy), or an empty array
    where that view is not possible (unaligned memory, big-endian host): the encoder then
    takes the elements one by one, slower and with the same result."""
    word = _WORD[x.dtype.itemsize]
    n4 = x.shape[0] - x.shape[0] % 4
    if sys.byteorder != "little" or not x.flags.c_contiguous or x.ctypes.data % np.dtype(word).itemsize:
        return np.empty(0, word)
    return x[:n4].view(word)


def encode_ctx(old: np.ndarray, new: np.ndarray, dt: DType, changed: int | None = None) -> CtxResult | None:
    """The encoding-4 payload of one chunk, the sparse encoding's arrays found on the way
    (their length is the number of changed elements: the scan counts them), and whether
    compressing those can be skipped; None when the dtype has no context layout. With no
    element changed the payload is empty. ``changed``, when the caller counted already,
    must agree with the scan."""
    lay = layout_of(dt)
    if lay is None:
        return None
    old4, new4 = _words_of_four(old), _words_of_four(new)
    if old4.shape[0] != new4.shape[0]:
        old4, new4 = old4[:0], new4[:0]
    out, sparse = ctx_encode(old, new, old4, new4, 8 * dt.itemsize, lay[0], lay[1], scan_scratch(old.shape[0]))
    return _result(out, sparse, changed)


def _result(out: np.ndarray, sparse: tuple, changed: int | None, nan: bool | None = None) -> CtxResult:
    if changed is not None and sparse[0].shape[0] != changed:
        raise AssertionError("context encoder: inconsistent change count")  # a bug, never data
    if out.shape[0] == 0:
        return CtxResult(b"", sparse, False, nan)
    sure = out.shape[0] <= SURELY_SMALLER * sparse_estimate(*sparse)
    return CtxResult(out.tobytes(), sparse, sure, nan)


def encode_gctx(old: np.ndarray, new: np.ndarray, dt: DType, changed: int | None = None) -> CtxResult | None:
    """As :func:`encode_ctx`, for encoding 5 (delta/gctx.py): the same contexts, positions coded
    per group of classes, both ends much faster for slightly more bytes."""
    lay = layout_of(dt)
    if lay is None:
        return None
    old, new = np.ascontiguousarray(old), np.ascontiguousarray(new)     # the kernels load 64 elements at once
    nan_mask, nan_above = nan_rule(dt) or (0, 0)
    out, sparse, nan = gctx_encode(old, new, 8 * dt.itemsize, lay[0], lay[1], scan_scratch(old.shape[0]),
                                   nan_mask, nan_above)
    return _result(out, sparse, changed, nan)


def decode_ctx(payload: bytes | memoryview, old: np.ndarray, count: int, dt: DType,
               where: str, out: "tuple[np.ndarray, np.ndarray] | None" = None,
               grouped: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Chunk-local positions (int64) and new bits of an encoding-4 chunk (encoding 5 with
    ``grouped``), into ``out``'s two arrays of ``count`` elements, if given."""
    name = "gctx" if grouped else "ctx"
    lay = layout_of(dt)
    if lay is None:
        raise FormatError(f"{where}: encoding {name} is not defined for dtype {dt.name}")
    if not 1 <= count <= old.shape[0]:
        raise FormatError(f"{where}: {name} chunk count {count} outside [1, {old.shape[0]}]")
    buf = np.frombuffer(payload, np.uint8)
    positions, values = (np.empty(count, np.int64), np.empty(count, dt.bits_dtype)) if out is None else out
    err = (gctx_decode if grouped else ctx_decode)(buf, np.ascontiguousarray(old), count, 8 * dt.itemsize,
                                                   lay[0], lay[1], positions, values)
    if err:
        msg = (_GERRORS if grouped else _ERRORS).get(err, f"error {err}")
        raise FormatError(f"{where}: corrupt {name} payload ({msg})")
    return positions, values


def decode_gctx(payload: bytes | memoryview, old: np.ndarray, count: int, dt: DType,
                where: str, out: "tuple[np.ndarray, np.ndarray] | None" = None) -> tuple[np.ndarray, np.ndarray]:
    """Chunk-local positions (int64) and new bits of an encoding-5 chunk."""
    return decode_ctx(payload, old, count, dt, where, out, grouped=True)
