"""Chunk encodings: how one slice of a tensor's elements becomes a payload, and back.

A chunk is encoded on its own (no state crosses chunk boundaries), so chunks
decode in parallel and one chunk can be fetched by byte range. Each encoding is
an id in the record's chunk table; docs/FORMAT.md fixes every id's payload.
Decoding against a parent yields the *sparse form* — chunk-local positions and
the new bits there — whatever the encoding, so the apply step has one shape.
"""

from __future__ import annotations

import struct
import threading
from typing import NamedTuple

import numpy as np
import xxhash
import zstandard

from . import ctxcoder, kernels, pctx
from .dtypes import DType, nan_rule
from .errors import ChecksumError, FormatError, GrandparentNeededError
from .record import CTX, CTX_LAYOUT, DENSE_XOR, GCTX, PCTX, PCTX_LAYOUT, RAW, SPARSE, UNCHANGED, ChunkEntry

DEFAULT_LEVEL = 3
# Above this fraction of changed elements the dense XOR form is tried as well and the smaller kept,
# unless the best so far already compresses the chunk DENSE_SKIP_RATIO-fold: on the reference
# workloads (every lr and window, bf16/fp8) XOR+zstd never got below 1/15 of a chunk, and the
# ctx payload was smaller on every chunk where both applied. Compressing the XOR planes costs
# more than the whole ctx encode, so the try is kept for where it can win.
DENSE_TRY_FRACTION = 0.08
DENSE_SKIP_RATIO = 16

_local = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    cache = getattr(_local, "cctx", None)
    if cache is None:
        cache = _local.cctx = {}
    c = cache.get(level)
    if c is None:
        c = cache[level] = zstandard.ZstdCompressor(level=level, write_content_size=True, write_checksum=False)
    return c


def _decompressor() -> zstandard.ZstdDecompressor:
    d = getattr(_local, "dctx", None)
    if d is None:
        d = _local.dctx = zstandard.ZstdDecompressor()
    return d


def _planes_needed(max_value: int) -> int:
    return max(1, (int(max_value).bit_length() + 7) // 8)


# RFC 8878: a block regenerates at most 128 KiB and takes at least 4 bytes (3-byte header,
# >= 1 byte of content), so no frame expands more than 32768-fold.
_ZSTD_BLOCK_MAX = 128 << 10
_ZSTD_MIN_BLOCK_BYTES = 4


def check_frame(frame: bytes | memoryview, expected: int, where: str) -> None:
    """Reject a zstd frame that cannot hold exactly ``expected`` bytes, from its header and length alone.

    Cheap (no decompression), so a reader can vet every frame of a record before it
    allocates the output: a hostile header cannot make it allocate more than the
    payload bytes it actually delivered could expand to."""
    try:
        size = zstandard.frame_content_size(frame)
    except zstandard.ZstdError as e:
        raise FormatError(f"{where}: bad zstd frame ({e})") from None
    if size != expected:
        raise FormatError(f"{where}: zstd frame holds {size} bytes, {expected} expected")
    if len(frame) < _ZSTD_MIN_BLOCK_BYTES * -(-expected // _ZSTD_BLOCK_MAX):
        raise FormatError(f"{where}: a zstd frame of {len(frame)} bytes cannot hold {expected} bytes")


def _unzstd(frame: bytes | memoryview, expected: int, where: str) -> bytes:
    """Decompress one zstd frame whose content size must be exactly ``expected``.

    The size is checked from the frame header before zstd allocates anything, so a
    corrupt or hostile payload cannot ask for more memory than the record's own
    (already validated) fields allow."""
    check_frame(frame, expected, where)
    try:
        out = _decompressor().decompress(frame, max_output_size=expected)
    except zstandard.ZstdError as e:
        raise FormatError(f"{where}: corrupt zstd frame ({e})") from None
    if len(out) != expected:
        raise FormatError(f"{where}: zstd frame decoded to {len(out)} bytes, {expected} expected")
    return out


_UNCHANGED_ENTRY = ChunkEntry(UNCHANGED, 0, 0, 0, 0, xxhash.xxh3_64_intdigest(b""))


class EncodedChunk(NamedTuple):
    entry: ChunkEntry
    payload: bytes
    #: Whether a changed element's new bits are a NaN (None without a parent: nothing was compared).
    #: The encoder visits the changed elements anyway; a caller that must know whether NaNs appeared
    #: (the publisher warns) asks here instead of scanning the whole tensor again.
    changed_nan: bool | None


#: The encoding the context coder writes: 5 (gctx), faster at both ends than 4 (ctx), which
#: still decodes; a test sets this to CTX to run the codec paths over encoding 4.
CONTEXT_ENCODING = GCTX


def encode_chunk(old: np.ndarray | None, new: np.ndarray, dt: DType, level: int = DEFAULT_LEVEL,
                 context: bool = True, grand: np.ndarray | None = None) -> EncodedChunk:
    """Pick the smallest encoding for one chunk. ``old``/``new`` are the chunk's bits.

    ``context=False`` leaves out the context coder (id 5, or 4: CONTEXT_ENCODING): deltas
    about 1.6x larger, encode and decode faster where many elements change. ``grand``, the
    grandparent's bits of the chunk, lets the context coder try encoding 6 as well (a reader
    then needs them too)."""
    n = new.shape[0]
    if old is None:
        payload = _compressor(level).compress(kernels.to_planes(new, dt.itemsize))
        return EncodedChunk(_entry(RAW, 0, dt.itemsize, n, payload), payload, None)
    CTXE = CONTEXT_ENCODING
    ctx = None if not context else (ctxcoder.encode_gctx(old, new, dt) if CTXE == GCTX
                                    else ctxcoder.encode_ctx(old, new, dt))   # its scan counts the changes
    changed = kernels.count_changed(old, new) if ctx is None else ctx.sparse_parts[0].shape[0]
    if changed == 0:
        return EncodedChunk(_UNCHANGED_ENTRY, b"", False)
    sparse = ctx.sparse_parts if ctx is not None else kernels.sparse_extract(
        old, new, changed, 8 * dt.itemsize, dt.sign_magnitude)
    if ctx is not None and ctx.changed_nan is not None:
        nan = ctx.changed_nan            # the context coder's scan looked at every change's new bits
    else:
        rule = nan_rule(dt)
        nan = rule is not None and bool(kernels.nan_at_gaps(new, sparse[0], *(new.dtype.type(v) for v in rule)))
    if ctx is not None and ctx.beats_sparse:
        best = _entry(CTXE, *CTX_LAYOUT[dt.name], changed, ctx.payload), ctx.payload
    else:
        best = _encode_sparse(old, new, dt, changed, level, sparse)
        if ctx is not None and len(ctx.payload) < best[0].length:
            best = _entry(CTXE, *CTX_LAYOUT[dt.name], changed, ctx.payload), ctx.payload
    if context and grand is not None and dt.name in PCTX_LAYOUT:
        payload = pctx.encode_pctx(old, new, grand, dt)
        if payload is not None and len(payload) < best[0].length:
            best = _entry(PCTX, *PCTX_LAYOUT[dt.name], changed, payload), payload
    if changed > DENSE_TRY_FRACTION * n and DENSE_SKIP_RATIO * best[0].length > n * dt.itemsize:
        planes = kernels.xor_planes(old, new, dt.itemsize)
        if _may_beat(planes, n, best[0].length):
            dense = _compressor(level).compress(planes)
            if len(dense) < best[0].length:
                best = _entry(DENSE_XOR, 0, dt.itemsize, changed, dense), dense
        # A chunk reset to something simple (zeros, a constant) XORs into the old noise:
        # then the new bits alone are far smaller. Only worth a try when nothing compressed well.
        if best[0].length > n * dt.itemsize // 2:
            planes = kernels.to_planes(new, dt.itemsize)
            if _may_beat(planes, n, best[0].length):
                raw = _compressor(level).compress(planes)
                if len(raw) < best[0].length:
                    best = _entry(RAW, 0, dt.itemsize, n, raw), raw
    return EncodedChunk(*best, nan)


#: A dense or raw try is compressed only when its planes' order-0 estimate (kernels.planes_entropy_bytes) is
#: below this multiple of the best payload so far. zstd does not code bytes much below that estimate unless
#: it finds repeats the estimate misses (on noise-like planes it lands 2-5% above it), so
#: where every element changes by noise-like steps (a LoRA step: sparse wins by ~13%) the tries, which
#: doubled the encode, are skipped; planes whose order-0 entropy is that high rarely hold long repeats.
SURELY_LARGER = 1.0


def _may_beat(planes: np.ndarray, plane_len: int, best: int) -> bool:
    return kernels.planes_entropy_bytes(planes, plane_len, kernels.ENTROPY_BLOCK) < SURELY_LARGER * best


def _encode_sparse(old, new, dt: DType, changed: int, level: int, extracted=None) -> tuple[ChunkEntry, bytes]:
    gaps, steps, max_gap, max_step = extracted or kernels.sparse_extract(
        old, new, changed, 8 * dt.itemsize, dt.sign_magnitude)
    pa, pb = _planes_needed(max_gap), _planes_needed(max_step)
    c = _compressor(level)
    pos = c.compress(kernels.to_planes(gaps, pa))
    val = c.compress(kernels.to_planes(steps, pb))
    payload = struct.pack("<I", len(pos)) + pos + val
    return _entry(SPARSE, pa, pb, changed, payload), payload


def _entry(enc: int, pa: int, pb: int, count: int, payload: bytes) -> ChunkEntry:
    return ChunkEntry(enc, pa, pb, count, len(payload), xxhash.xxh3_64_intdigest(payload))


def verify_payload(entry: ChunkEntry, payload: bytes | memoryview, where: str) -> None:
    if len(payload) != entry.length:
        raise FormatError(f"{where}: payload is {len(payload)} bytes, header says {entry.length}")
    if xxhash.xxh3_64_intdigest(payload) != entry.checksum:
        raise ChecksumError(f"{where}: payload checksum mismatch (corrupt chunk)")


def decode_raw(entry: ChunkEntry, payload: bytes | memoryview, n: int, dt: DType, where: str) -> np.ndarray:
    """The chunk's bits from a RAW payload (no parent needed)."""
    planes = np.frombuffer(_unzstd(payload, n * dt.itemsize, where), dtype=np.uint8)
    out = np.empty(n, dtype=dt.bits_dtype)
    kernels.from_planes(planes, n, dt.itemsize, out)
    return out


def decode_changes(entry: ChunkEntry, payload: bytes | memoryview, old: np.ndarray, dt: DType,
                   where: str, out: "tuple[np.ndarray, np.ndarray] | None" = None,
                   grand: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Chunk-local positions (int64) and new bits for a chunk encoded against ``old``.

    ``out``: arrays of exactly ``entry.count`` elements (int64, ``dt``'s bits) to decode
    into instead of new ones, for a sparse, dense or ctx chunk (the slices of a staged
    tensor that the chunk's changes fill); returned as they are, filled. ``grand``: the
    grandparent's bits of the chunk, which a pctx chunk needs."""
    n = old.shape[0]
    if out is not None and (entry.encoding not in (SPARSE, CTX, GCTX, PCTX, DENSE_XOR)
                            or out[0].shape != (entry.count,) or out[1].shape != (entry.count,)):
        raise ValueError(f"{where}: only sparse, dense, ctx, gctx and pctx chunks decode into given arrays, of their "
                         "count")
    if entry.encoding == UNCHANGED:
        return np.empty(0, np.int64), np.empty(0, dt.bits_dtype)
    if entry.encoding == SPARSE:
        if len(payload) < 4:
            raise FormatError(f"{where}: sparse payload shorter than its 4-byte prefix")
        (pos_len,) = struct.unpack_from("<I", payload, 0)
        if pos_len > len(payload) - 4:
            raise FormatError(f"{where}: sparse position stream length {pos_len} exceeds the payload")
        k = entry.count
        gap_planes = np.frombuffer(_unzstd(payload[4: 4 + pos_len], k * entry.planes_a, where + " positions"), np.uint8)
        step_planes = np.frombuffer(_unzstd(payload[4 + pos_len:], k * entry.planes_b, where + " values"), np.uint8)
        gaps = np.empty(k, np.uint32)
        kernels.from_planes(gap_planes, k, entry.planes_a, gaps)
        positions, values = (np.empty(k, np.int64), np.empty(k, dt.bits_dtype)) if out is None else out
        if not kernels.sparse_positions_into(gaps, n, positions):
            raise FormatError(f"{where}: a changed position falls outside the chunk's {n} elements")
        steps = np.empty(k, np.uint64)
        kernels.from_planes(step_planes, k, entry.planes_b, steps)
        kernels.sparse_new_values(old, positions, steps, 8 * dt.itemsize, dt.sign_magnitude, values)
        return positions, values
    if entry.encoding in (CTX, GCTX):
        return ctxcoder.decode_ctx(payload, old, entry.count, dt, where, out, grouped=entry.encoding == GCTX)
    if entry.encoding == PCTX:
        if grand is None:
            raise GrandparentNeededError(f"{where}: a pctx chunk, coded against the tensor's version before its "
                                         "parent too, which this reader was not given")
        return pctx.decode_pctx(payload, old, grand, entry.count, dt, where, out)
    if entry.encoding == DENSE_XOR:
        planes = np.frombuffer(_unzstd(payload, n * dt.itemsize, where), np.uint8)
        positions, values = (np.empty(entry.count, np.int64), np.empty(entry.count, dt.bits_dtype)) \
            if out is None else out
        if _xor_count(planes, n, dt.itemsize) != entry.count:
            raise FormatError(f"{where}: dense chunk changes a different number of elements than its header says")
        kernels.xor_apply_planes(old, planes, dt.itemsize, positions, values)
        return positions, values
    if entry.encoding == RAW:
        new = decode_raw(entry, payload, n, dt, where)
        changed = kernels.count_changed(old, new)
        positions = np.empty(changed, np.int64)
        values = np.empty(changed, dt.bits_dtype)
        kernels.diff_positions(old, new, positions, values)
        return positions, values
    raise FormatError(f"{where}: unknown encoding {entry.encoding}")


def _xor_count(planes: np.ndarray, n: int, nplanes: int) -> int:
    nz = planes[:n] != 0
    for p in range(1, nplanes):
        nz |= planes[p * n:(p + 1) * n] != 0
    return int(np.count_nonzero(nz))
