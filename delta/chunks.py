"""The chunk coder: how one slice of a tensor's elements becomes a payload, and back.

A chunk is encoded on its own (no state crosses chunk boundaries), so chunks
decode in parallel and one chunk can be fetched by byte range. Each encoding is
an id in the record's chunk table, fixed by docs/FORMAT.md, and one module of
delta/encodings/ (fields, encoder, decoder); this module tries the registered
encodings on each chunk and keeps the smallest payload, and dispatches a payload
to its encoding's decoder. Decoding against a parent yields the *sparse form* —
chunk-local positions and the new bits there — whatever the encoding, so the
apply step has one shape; a chunk of a record that changes most of its tensor
decodes instead into every element's new bits (:func:`decode_dense`), which
dense_step writes itself.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import xxhash

from ckptdelta.delta import kernels
from ckptdelta.delta.dtypes import DType, nan_rule
from ckptdelta.delta.encodings import (ALWAYS, CONTEXT, DENSE_STEP, FAST, GCTX, GROUPED_PSTEP, GROUPED_STEP, REGISTRY,
                                      SPARSE, Chunk, Encoding, unchanged)
from ckptdelta.delta.encodings.dense_step import DENSE_STEP_FRACTION, GROUPED_DENSE_FRACTION
from ckptdelta.delta.encodings.grouped_step import WRITTEN as GROUPED_WRITTEN
from ckptdelta.delta.errors import ChecksumError, FormatError
from ckptdelta.delta.record import ChunkEntry

#: zstd's level for the byte planes of sparse, dense and raw chunks. The planes of a step are noise-like where
#: they are not constant: a deeper match search (level 3 and up) finds next to nothing in them, so level 1
#: codes them as small or smaller, in far less time (docs/PERFORMANCE.md, "The fast path on dense steps").
#: A reader decodes any level.
DEFAULT_LEVEL = 1

_UNCHANGED_ENTRY = ChunkEntry(unchanged.ENCODING.id, 0, 0, 0, 0, unchanged.EMPTY_CHECKSUM)


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
#: The fast path's own encoding, tried on every changed chunk (the others are taken only where they win), and
#: the one that stands for it in the publisher's cost model. Where at least DENSE_STEP_FRACTION of a chunk's
#: elements changed, the fast path codes the chunk as dense steps instead: grouped by class for a 16- or 8-bit
#: float (encoding 8, or 9 where the grandparent was given) from GROUPED_DENSE_FRACTION changed, in element order
#: for the others (7): FAST_ENCODINGS.
FAST_ENCODING = SPARSE
FAST_ENCODINGS = (SPARSE, DENSE_STEP, GROUPED_STEP, GROUPED_PSTEP)

_tries: dict[tuple, tuple] = {}


def tries(context: bool, grand: bool = False) -> tuple[Encoding | None, tuple[Encoding, ...]]:
    """(the context coder, or None; the encodings tried on a changed chunk, in order) of one codec mode.

    With ``context``: the registered encodings tried in both modes or with the context coder, of the
    context coders (``Encoding.scans``) only the one :data:`CONTEXT_ENCODING` names; without: those tried
    in both modes or by the fast path. Those that need the grandparent only with ``grand`` (it was given).
    Kept per registry version, so a chunk pays a dict lookup for it."""
    key = (context, grand, CONTEXT_ENCODING, REGISTRY.version)
    t = _tries.get(key)
    if t is None:
        scanner = REGISTRY.by_id[CONTEXT_ENCODING] if context else None

        def tried(e: Encoding) -> bool:
            if e.needs_grandparent and not grand:
                return False
            if e.scans:
                return e is scanner
            return e.tried == ALWAYS or e.tried == (CONTEXT if context else FAST)

        t = _tries[key] = (scanner, tuple(filter(tried, REGISTRY.in_order)))
    return t


def codec_encoding(context: bool) -> Encoding:
    """The encoding that stands for a codec mode in the publisher's cost model (publisher/codec_choice.py):
    the context coder with ``context``, else the fast path's own."""
    return REGISTRY.by_id[CONTEXT_ENCODING if context else FAST_ENCODING]


def encode_chunk(old: np.ndarray | None, new: np.ndarray, dt: DType, level: int = DEFAULT_LEVEL,
                 context: bool = True, grand: np.ndarray | None = None, *, fast_alone: bool = False) -> EncodedChunk:
    """Pick the smallest encoding for one chunk. ``old``/``new`` are the chunk's bits.

    ``context=False`` leaves out the context coder (id 5, or 4: CONTEXT_ENCODING): larger
    deltas, encode and decode faster where many elements change. ``grand``, the
    grandparent's bits of the chunk, lets the context coder try encoding 6 as well (a reader
    then needs them too).

    Encodings are tried in their order (``Encoding.order``), each seeing the smallest payload so far
    (it may skip work that cannot win), and a later one is kept only where it is strictly smaller.
    Without a parent, only those that need none (raw). The fast path codes a chunk whose changed share is at
    least :func:`dense_from` as dense steps (encodings 7-9) and any other as sparse, so it extracts no gaps
    from a chunk that is nearly all changes. ``fast_alone`` (the fast path only: without ``context``): its
    own encoding (:data:`FAST_ENCODINGS`) is the only one tried, where the caller saw the others lose on this
    tensor's last step: a record as valid, perhaps a few bytes larger."""
    chunk = Chunk(old, new, dt, level, grand)
    if old is None:
        order, nan = _whole(), None
    else:
        t = _tries.get((context, grand is not None, CONTEXT_ENCODING, REGISTRY.version))
        scanner, order = t if t is not None else tries(context, grand is not None)
        if fast_alone and scanner is None:
            order = _fast_alone()
            chunk.alone = True
        if scanner is None or not scanner.scan(chunk):     # a context coder's scan counts the changes
            rule = nan_rule(dt)
            if rule is None:
                chunk.changed, chunk.changed_nan = kernels.count_changed(old, new), False
            else:           # the new bits of each change looked at in the same pass
                chunk.changed, chunk.changed_nan = kernels.count_changed_nan(old, new,
                                                                             *(new.dtype.type(v) for v in rule))
            chunk.dense_step = scanner is None and chunk.changed >= dense_from(dt) * chunk.n
        if chunk.changed == 0:
            return EncodedChunk(_UNCHANGED_ENTRY, b"", False)
        if chunk.sparse_parts is None and not chunk.dense_step:
            chunk.sparse_parts = kernels.sparse_extract(old, new, chunk.changed, 8 * dt.itemsize, dt.sign_magnitude)
        nan = chunk.changed_nan             # counted above, or the context coder's scan looked at every change
        if nan is None:
            rule = nan_rule(dt)
            nan = rule is not None and bool(kernels.nan_at_gaps(new, chunk.sparse_parts[0],
                                                                *(new.dtype.type(v) for v in rule)))
    best = None
    for enc in order:
        cand = enc.encode(chunk)
        if cand is not None and len(cand.payload) < chunk.best_length:
            best = cand
            chunk.best_length = len(cand.payload)
            chunk.best_estimate = cand.estimate
    if best is None:
        raise AssertionError(f"no encoding took a chunk of {chunk.n} {dt.name} elements")    # a bug, never data
    return EncodedChunk(ChunkEntry(best.encoding, best.planes_a, best.planes_b, best.count, len(best.payload),
                                   xxhash.xxh3_64_intdigest(best.payload)), best.payload, nan)


def dense_from(dt: DType) -> float:
    """The share of a chunk's elements that must have changed for the fast path to code it as dense steps."""
    return GROUPED_DENSE_FRACTION if dt.name in GROUPED_WRITTEN else DENSE_STEP_FRACTION


def _fast_alone() -> tuple[Encoding, ...]:
    key = ("alone", REGISTRY.version)
    t = _tries.get(key)
    if t is None:
        t = _tries[key] = tuple(REGISTRY.by_id[i] for i in FAST_ENCODINGS)
    return t


def _whole() -> tuple[Encoding, ...]:
    key = ("whole", REGISTRY.version)
    t = _tries.get(key)
    if t is None:
        t = _tries[key] = tuple(e for e in REGISTRY.in_order if not e.needs_parent and e.tried is not None)
    return t


def verify_payload(entry: ChunkEntry, payload: bytes | memoryview, where: str) -> None:
    if len(payload) != entry.length:
        raise FormatError(f"{where}: payload is {len(payload)} bytes, header says {entry.length}")
    if xxhash.xxh3_64_intdigest(payload) != entry.checksum:
        raise ChecksumError(f"{where}: payload checksum mismatch (corrupt chunk)")


def check_whole(entry: ChunkEntry, payload: bytes | memoryview, n: int, dt: DType, where: str) -> None:
    """Refuse a chunk of a record without parent that cannot hold its ``n`` elements, before the caller
    allocates the tensor (its encoding must need no parent: raw)."""
    _whole_encoding(entry, where).check_whole(entry, payload, n, dt, where)


def decode_raw(entry: ChunkEntry, payload: bytes | memoryview, n: int, dt: DType, where: str) -> np.ndarray:
    """The chunk's bits from a chunk that needs no parent (RAW)."""
    return _whole_encoding(entry, where).decode_whole(entry, payload, n, dt, where)


def _whole_encoding(entry: ChunkEntry, where: str) -> Encoding:
    enc = REGISTRY.by_id.get(entry.encoding)
    if enc is None or enc.needs_parent:
        raise FormatError(f"{where}: {'a ' + enc.name if enc else 'an unknown'} chunk in a record without parent")
    return enc


def decode_dense(entry: ChunkEntry, payload: bytes | memoryview, old: np.ndarray, dt: DType, where: str,
                 out: np.ndarray, grand: np.ndarray | None = None) -> None:
    """Every element's new bits of a chunk encoded against ``old``, into ``out`` (``old``'s length): written
    by the encoding itself where it decodes densely (dense_step), else its changes scattered over a copy of
    ``old``. A dense stage's decode, without arrays of every change's position and value."""
    enc = REGISTRY.by_id.get(entry.encoding)
    if enc is None:
        raise FormatError(f"{where}: unknown encoding {entry.encoding}")
    if out.shape != old.shape:
        raise ValueError(f"{where}: a dense decode writes {old.shape[0]} elements, not {out.shape[0]}")
    if enc.decodes_dense:
        enc.decode_dense(entry, payload, old, dt, where, out, grand)
        return
    positions, values = enc.decode(entry, payload, old, dt, where, None, grand)
    np.copyto(out, old)
    kernels.scatter(out, positions, values)


def decode_changes(entry: ChunkEntry, payload: bytes | memoryview, old: np.ndarray, dt: DType,
                   where: str, out: "tuple[np.ndarray, np.ndarray] | None" = None,
                   grand: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Chunk-local positions (int64) and new bits for a chunk encoded against ``old``.

    ``out``: arrays of exactly ``entry.count`` elements (int64, ``dt``'s bits) to decode
    into instead of new ones, for a chunk whose encoding decodes into them (sparse, dense,
    ctx, gctx, pctx: the slices of a staged tensor that the chunk's changes fill); returned
    as they are, filled. ``grand``: the grandparent's bits of the chunk, which a pctx chunk needs."""
    enc = REGISTRY.by_id.get(entry.encoding)
    if out is not None and (enc is None or not enc.decodes_into
                            or out[0].shape != (entry.count,) or out[1].shape != (entry.count,)):
        names = [e.name for e in REGISTRY.decodes_into]
        raise ValueError(f"{where}: only {', '.join(names[:-1])} and {names[-1]} chunks decode into given arrays, "
                         "of their count")
    if enc is None:
        raise FormatError(f"{where}: unknown encoding {entry.encoding}")
    return enc.decode(entry, payload, old, dt, where, out, grand)
