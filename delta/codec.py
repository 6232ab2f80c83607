"""The codec's public surface: encode two versions of a tensor, decode or apply the result.

``encode(old, new)`` -> :class:`EncodedTensor` (one record, docs/FORMAT.md);
``decode(old, enc)`` -> the new tensor; ``apply_(live, enc)`` rewrites ``live``
in place. Applying is split in two for hot swaps: :func:`stage` does all the
work that can run while a model keeps serving (fetching is the caller's;
decompression, reconstruction of the changed elements, and the check that the
result hashes to the recorded digest), and :meth:`StagedTensor.apply_` is the
part that must run in the pause: a scatter of the changed elements.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch
import xxhash

from ckptdelta.delta import chunks, dtypes, kernels
from ckptdelta.delta.errors import (ChecksumError, DeltaError, FormatError, GrandparentMismatchError,
                                    GrandparentNeededError, ParentMismatchError, ShapeMismatchError, TruncatedError,
                                    UnsupportedDtypeError)
from ckptdelta.delta.encodings import REGISTRY
from ckptdelta.delta.record import (ENCODING_NAMES, MAX_CHUNK_ELEMS, MAX_CHUNKS, MAX_NUMEL, RecordHeader,
                                    header_size_for, n_chunks_for, pack_header, parse_header)

DEFAULT_CHUNK_ELEMS = 1 << 20

Array = "torch.Tensor | np.ndarray"

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()
_worker = threading.local()


def _mark_worker() -> None:
    _worker.in_pool = True


def in_pool_worker() -> bool:
    """True on a thread of the codec pool. Work fanned out from there must run inline:
    waiting on tasks queued behind every busy worker (each waiting the same way) deadlocks the pool."""
    return getattr(_worker, "in_pool", False)


def _executor() -> ThreadPoolExecutor:
    """One process-wide pool: kernels, zstd and xxhash release the GIL, so chunks run on all cores."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=os.cpu_count() or 1, thread_name_prefix="ckptdelta-codec",
                                       initializer=_mark_worker)
        return _pool


def _forget_pool_after_fork() -> None:
    """A forked child has none of the parent's threads, only the pool object that thinks it has
    them: work queued there would wait forever. The child starts a pool of its own instead."""
    global _pool, _pool_lock
    _pool = None
    _pool_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_pool_after_fork)


def _imap(fn, items, threads: int | None):
    """``fn`` over ``items``, results in order as they are ready (lazily: the caller works on the
    first while the others run)."""
    items = list(items)
    if len(items) <= 1 or threads == 1 or in_pool_worker():
        return map(fn, items)
    return _executor().map(fn, items)


def _map(fn, items: list, threads: int | None) -> list:
    return list(_imap(fn, items, threads))


def digest(x: Array) -> int:
    """xxh3-64 of a tensor's bytes in C order (its logical content, whatever its strides or device)."""
    return xxhash.xxh3_64_intdigest(dtypes.host_bits(x))


def digest_hex(value: int) -> str:
    return f"{value:016x}"


@dataclass
class EncodedTensor:
    """One encoded tensor: a validated header and its chunk payloads."""

    header: RecordHeader
    payloads: list[bytes | memoryview]
    #: Where the record came from (object key, byte range, snapshot), when parsed with ``what``: every error
    #: decoding or applying it raises names it, not only the tensor.
    origin: str | None = field(default=None, compare=False, repr=False)
    #: Encoded here (not parsed): whether a changed element's new bits are a NaN; None without a parent
    #: (nothing compared) or for a parsed record. What the publisher needs to warn of NaNs without a scan.
    changed_nan: bool | None = field(default=None, compare=False, repr=False)

    @property
    def name(self) -> str:
        return self.header.name

    def where(self) -> str:
        return self.origin or f"tensor {self.header.name!r}"

    @property
    def nbytes(self) -> int:
        return self.header.record_size

    def to_bytes(self) -> bytes:
        return pack_header(self.header) + b"".join(bytes(p) for p in self.payloads)

    @property
    def needs_grandparent(self) -> bool:
        """Whether decoding needs the tensor's version before its parent too (a pctx chunk, encoding 6)."""
        needs = REGISTRY.needs_grandparent
        return any(c.encoding in needs for c in self.header.chunks)

    def encoding_counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for c in self.header.chunks:
            k = ENCODING_NAMES[c.encoding]
            out[k] = out.get(k, 0) + 1
        return out

    @classmethod
    def from_bytes(cls, buf: bytes | memoryview, *, what: str | None = None, verify: bool = True) -> "EncodedTensor":
        """Parse one record. ``buf`` must hold exactly the record (header and every payload)."""
        h = parse_header(buf, what=what or "record")
        where = what or h.where()
        if len(buf) != h.record_size:
            cls_ = TruncatedError if len(buf) < h.record_size else FormatError
            raise cls_(f"{where}: record is {len(buf)} bytes, its header says {h.record_size}")
        mv = memoryview(buf)
        payloads = [mv[o: o + c.length] for o, c in zip(h.payload_offsets(), h.chunks)]
        if verify:
            for i, (c, p) in enumerate(zip(h.chunks, payloads)):
                chunks.verify_payload(c, p, f"{where} chunk {i}")
        return cls(h, payloads, what)


def _as_encoded(enc: "EncodedTensor | bytes | memoryview", what: str | None = None) -> EncodedTensor:
    return enc if isinstance(enc, EncodedTensor) else EncodedTensor.from_bytes(enc, what=what)


def encode(old: Array | None, new: Array, *, name: str = "tensor", chunk_elems: int = DEFAULT_CHUNK_ELEMS,
           level: int = chunks.DEFAULT_LEVEL, threads: int | None = None,
           parent_digest: int | None = None, context: bool = True,
           grandparent: Array | None = None) -> EncodedTensor:
    """Encode ``new`` against ``old`` (or on its own when ``old`` is None).

    A shape or dtype change needs no special call: pass ``old=None`` and the
    record is self-contained (raw chunks). ``parent_digest``, when the caller
    already knows ``digest(old)`` (a publisher does: it recorded it last step),
    saves one pass over ``old``. ``context=False`` skips the context coder
    (docs/FORMAT.md, encoding 4): larger deltas, faster encode and decode.
    ``grandparent``: the tensor before ``old`` (same dtype and shape), whose step to ``old``
    predicts the next one (encoding 6: where nearly every element moves, as in a LoRA step,
    fewer bytes than encoding 5; benchmarks/lora_codec.py measures it); a reader then needs it too.
    Many tensors: :func:`ckptdelta.delta.encode_many` spreads them over the cores as well."""
    job = _EncodeJob.prepare(old, new, name=name, chunk_elems=chunk_elems, level=level,
                             parent_digest=parent_digest, context=context, grandparent=grandparent)
    results = _map(job.chunk, list(range(job.n_chunks)), threads)
    return job.assemble(results, job.digest(), job.parent_digest())


@dataclass
class _EncodeJob:
    """One tensor's encode cut into independent tasks (each chunk, each digest), so that
    :func:`encode` and :func:`ckptdelta.delta.encode_many` schedule the same work and give the same bytes."""

    name: str
    dt: dtypes.DType
    shape: tuple[int, ...]
    numel: int
    chunk_elems: int
    n_chunks: int
    level: int
    context: bool
    new_bits: np.ndarray = field(repr=False)
    old_bits: np.ndarray | None = field(repr=False)
    known_parent: int | None
    grand_bits: np.ndarray | None = field(default=None, repr=False)
    fast_alone: bool = False      # chunks.encode_chunk's: the dense and raw tries lost on this tensor last step

    @classmethod
    def prepare(cls, old: Array | None, new: Array, *, name: str, chunk_elems: int, level: int,
                parent_digest: int | None, context: bool, grandparent: Array | None = None,
                fast_alone: bool = False) -> "_EncodeJob":
        """Check the inputs and take their bits (a host copy only for device or strided tensors)."""
        try:
            dt = dtypes.of(new)
        except UnsupportedDtypeError as e:
            raise UnsupportedDtypeError(f"tensor {name!r}: {e}") from None
        shape = tuple(int(s) for s in new.shape)
        new_bits = dtypes.host_bits(new)
        numel = new_bits.shape[0]
        if numel > MAX_NUMEL:
            raise FormatError(f"tensor {name!r}: {numel} elements exceed the format's limit of {MAX_NUMEL}")
        old_bits = None
        if old is not None:
            if dtypes.of(old) != dt or tuple(old.shape) != shape:
                raise ShapeMismatchError(
                    f"tensor {name!r}: cannot encode {dt.name}{list(shape)} against {dtypes.of(old).name}"
                    f"{list(old.shape)}; pass old=None to store it whole")
            old_bits = dtypes.host_bits(old)
        grand_bits = None
        if grandparent is not None and old is not None:
            if dtypes.of(grandparent) != dt or tuple(grandparent.shape) != shape:
                raise ShapeMismatchError(f"tensor {name!r}: its grandparent is {dtypes.of(grandparent).name}"
                                         f"{list(grandparent.shape)}, the tensor {dt.name}{list(shape)}")
            grand_bits = dtypes.host_bits(grandparent)
        chunk_elems = max(1, min(MAX_CHUNK_ELEMS, max(chunk_elems, -(-numel // MAX_CHUNKS))))
        if numel:
            chunk_elems = min(chunk_elems, numel)
        return cls(name, dt, shape, numel, chunk_elems, n_chunks_for(numel, chunk_elems), level, context,
                   new_bits, old_bits, parent_digest, grand_bits, fast_alone)

    @property
    def hashes_parent(self) -> bool:
        """Whether :meth:`parent_digest` reads ``old`` (a pass worth its own task)."""
        return self.old_bits is not None and self.known_parent is None

    def chunk(self, i: int) -> chunks.EncodedChunk:
        s, e = i * self.chunk_elems, min(self.numel, (i + 1) * self.chunk_elems)
        old = None if self.old_bits is None else self.old_bits[s:e]
        grand = None if self.grand_bits is None else self.grand_bits[s:e]
        return chunks.encode_chunk(old, self.new_bits[s:e], self.dt, self.level, self.context, grand,
                                   fast_alone=self.fast_alone)

    def digest(self) -> int:
        return xxhash.xxh3_64_intdigest(self.new_bits)

    def parent_digest(self) -> int:
        if self.old_bits is None:
            return 0
        return self.known_parent if self.known_parent is not None else xxhash.xxh3_64_intdigest(self.old_bits)

    def assemble(self, results: list[chunks.EncodedChunk], digest: int, parent_digest: int) -> EncodedTensor:
        header = RecordHeader(
            name=self.name, dtype=self.dt, shape=self.shape, numel=self.numel, chunk_elems=self.chunk_elems,
            digest=digest, parent_digest=parent_digest, has_parent=self.old_bits is not None,
            chunks=tuple(r[0] for r in results),
            header_size=header_size_for(len(self.shape), len(self.name.encode("utf-8")), self.n_chunks),
        )
        nan = None if self.old_bits is None else any(r.changed_nan for r in results)
        return EncodedTensor(header, [r.payload for r in results], changed_nan=nan)


@dataclass
class StagedTensor:
    """A verified change to one tensor, ready to be applied in a pause.

    ``positions``/``values`` list the elements that change and their new bits; when
    most of the tensor changes, ``dense`` holds all its new bits instead (smaller
    than positions + values). Either way the result has been checked to hash to
    ``digest`` when applied to the tensor it was staged against, whose digest is
    ``parent_digest`` (the record's; with ``dense``, the one computed while staging)."""

    name: str
    dtype: dtypes.DType
    shape: tuple[int, ...]
    digest: int
    parent_digest: int
    positions: np.ndarray = field(repr=False)
    values: np.ndarray = field(repr=False)
    dense: np.ndarray | None = field(default=None, repr=False)
    #: Beside ``positions``, when :func:`stage` made it: the bits there before the change (an undo).
    old: np.ndarray | None = field(default=None, repr=False)

    @property
    def n_changed(self) -> int:
        return int(self.positions.shape[0]) if self.dense is None else int(self.dense.shape[0])

    @property
    def nbytes(self) -> int:
        if self.dense is not None:
            return self.dense.nbytes
        return self.positions.nbytes + self.values.nbytes

    def apply_(self, live: torch.Tensor | np.ndarray, *, method: str = "auto") -> None:
        """Write the staged change into ``live`` in place.

        ``method``: "auto" (numba scatter on contiguous host memory, torch ops elsewhere),
        "torch" (torch ops on the tensor's own device: the path CUDA tensors take)."""
        _check_live(live, self.name, self.dtype, self.shape)
        if self.dense is None and self.positions.shape[0] == 0:
            return
        if isinstance(live, np.ndarray) and not live.flags.writeable:
            raise ShapeMismatchError(f"tensor {self.name!r}: live array is read-only; cannot apply in place")
        if isinstance(live, np.ndarray) and not live.flags.c_contiguous:
            # strided host array: index it in C order through a same-width integer view
            lv = live.view(self.dtype.bits_dtype)
            if self.dense is not None:
                lv[...] = self.dense.reshape(self.shape)
            else:
                lv[np.unravel_index(self.positions, self.shape)] = self.values
            return
        if isinstance(live, np.ndarray) or (method == "auto" and live.device.type == "cpu" and live.is_contiguous()):
            bits = dtypes.host_bits(live)
            if isinstance(live, torch.Tensor) and bits.ctypes.data != live.data_ptr():
                raise ShapeMismatchError(f"tensor {self.name!r}: cannot get a writable view of the live tensor")
            if isinstance(live, np.ndarray) and not np.shares_memory(bits, live):
                raise ShapeMismatchError(f"tensor {self.name!r}: live array is not contiguous; cannot apply in place")
            if self.dense is not None:
                bits[:] = self.dense
            else:
                kernels.scatter(bits, self.positions, self.values)
            return
        _torch_apply(live, self)


def _torch_apply(live: torch.Tensor, st: StagedTensor) -> None:
    int_dtype = dtypes._UINT_FOR_WIDTH[st.dtype.itemsize]
    np_int = np.dtype(f"<i{st.dtype.itemsize}") if st.dtype.itemsize > 1 else np.dtype(np.uint8)
    dev = live.device
    with torch.no_grad():
        if st.dense is not None:
            src = torch.from_numpy(st.dense.view(np_int)).to(dev, non_blocking=True)
            live.copy_(src.view(st.dtype.torch_dtype).reshape(st.shape))
            return
        vals = torch.from_numpy(st.values.view(np_int)).to(dev, non_blocking=True)
        idx = torch.from_numpy(st.positions).to(dev, non_blocking=True)
        if live.is_contiguous():
            live.view(-1).view(int_dtype).index_copy_(0, idx, vals)
        else:
            coords = torch.unravel_index(idx, st.shape)
            live.view(int_dtype).index_put_(coords, vals)


def _check_live(live, name: str, dt: dtypes.DType, shape: tuple[int, ...]) -> None:
    if dtypes.of(live) != dt or tuple(live.shape) != tuple(shape):
        raise ShapeMismatchError(
            f"tensor {name!r}: live tensor is {dtypes.of(live).name}{list(live.shape)}, "
            f"the delta expects {dt.name}{list(shape)}")


def _check_parent(enc: EncodedTensor, got: int) -> None:
    h = enc.header
    if got != h.parent_digest:
        raise ParentMismatchError(
            f"{enc.where()}: the delta was encoded against a tensor with digest "
            f"{digest_hex(h.parent_digest)}, the live tensor has {digest_hex(got)} (wrong parent snapshot?)")


def diagnose_parent(enc: EncodedTensor, bits: np.ndarray, verify: bool) -> None:
    """After a failed decode or a result that does not hash to the record's digest: raise
    ParentMismatchError if ``bits`` (the tensor the delta was decoded against, as it was then)
    is not the record's parent, so the error says so rather than "corrupt".

    Why only then: the result's digest, which every verified decode checks, already proves the
    bits (a step is applied to the parent's bits, so any other parent changes the result).
    Hashing the parent first would prove nothing more and cost a pass over it on every
    decode, a noticeable share of one where few elements changed."""
    if verify and enc.header.has_parent:
        _check_parent(enc, xxhash.xxh3_64_intdigest(bits))
        if enc.needs_grandparent:      # the record stores no digest of it: the right parent leaves only this
            raise GrandparentMismatchError(f"{enc.where()}: decoded against its parent, but the grandparent given is "
                                      "not the tensor it was encoded against (or the record is corrupt)")


def _decode_chunk(enc: EncodedTensor, bits: np.ndarray, i: int,
                  out: "tuple[np.ndarray, np.ndarray] | None" = None,
                  grand: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Chunk ``i``'s changes against ``bits`` (the whole parent): chunk-local positions and new bits
    (into ``out``, as :func:`chunks.decode_changes` takes it). ``grand``: the whole grandparent's bits."""
    h = enc.header
    s, e = h.chunk_range(i)
    return chunks.decode_changes(h.chunks[i], enc.payloads[i], bits[s:e], h.dtype, f"{enc.where()} chunk {i}", out,
                                 None if grand is None else grand[s:e])


def _grand_bits(enc: EncodedTensor, grandparent: Array | None) -> np.ndarray | None:
    """The grandparent's bits, checked against the record's dtype and shape; None when no chunk needs them.
    A record that needs them and did not get them fails here, before anything is decoded."""
    if not enc.needs_grandparent:
        return None
    if grandparent is None:
        raise GrandparentNeededError(f"{enc.where()}: the record is coded against the tensor's version before its "
                                     "parent too (pctx or grouped_pstep chunks, docs/FORMAT.md encodings 6 and 9), "
                                     "which was not given")
    h = enc.header
    if dtypes.of(grandparent) != h.dtype or tuple(grandparent.shape) != tuple(h.shape):
        raise ShapeMismatchError(f"{enc.where()}: the grandparent given is {dtypes.of(grandparent).name}"
                                 f"{list(grandparent.shape)}, the record's tensor {h.dtype.name}{list(h.shape)}")
    return dtypes.host_bits(grandparent)


def _decode_against(enc: EncodedTensor, bits: np.ndarray, verify: bool, threads: int | None,
                    grand: np.ndarray | None = None):
    """Decode every chunk's changes against ``bits``; a failure against the wrong parent says so."""
    h = enc.header
    try:
        return _map(lambda i: _decode_chunk(enc, bits, i, None, grand), list(range(len(h.chunks))), threads)
    except DeltaError:
        diagnose_parent(enc, bits, verify)
        raise


def stage(live: Array, enc: "EncodedTensor | bytes | memoryview", *, verify: bool = True,
          threads: int | None = None, grandparent: Array | None = None) -> StagedTensor:
    """Decode ``enc`` against the current content of ``live`` without modifying it.

    With ``verify`` (the default) the staged result must hash to the record's digest,
    else :class:`ParentMismatchError` when ``live`` is not the record's parent
    (:func:`diagnose_parent`: hashed only then) or :class:`ChecksumError`; the check
    streams through ``live`` one chunk at a time, so it needs one chunk of scratch,
    not a copy.

    Chunks decode on the codec pool; this thread takes them in order as they come and,
    while each chunk's bits are in cache, gathers the bits the change overwrites
    (``StagedTensor.old``, the undo of an in-place apply) and hashes the result: one
    read of ``live`` from memory instead of two. ``grandparent``: the tensor before ``live``'s
    version, which a record with pctx chunks needs (:class:`GrandparentNeededError` without it)."""
    enc = _as_encoded(enc)
    h = enc.header
    _check_live(live, h.name, h.dtype, h.shape)
    bits = dtypes.host_bits(live)
    grand = _grand_bits(enc, grandparent)
    w = h.dtype.itemsize
    counts = [c.count for c in h.chunks]           # each checked <= its chunk's elements (record.py)
    total = sum(counts)
    unsized = REGISTRY.counts_elements            # raw: its count is not its changes
    if any(c.encoding in unsized for c in h.chunks):
        return _stage_chunkwise(bits, enc, verify, threads, grand)
    if _dense_worthy(h):
        return _stage_dense(bits, enc, verify, threads, grand)
    # The changes decode straight into the staged arrays, each chunk into its slice: no per-chunk arrays
    # to assemble afterwards (a copy of every change, a sizeable share of a sparse stage).
    positions = np.empty(total, np.int64)
    values = np.empty(total, h.dtype.bits_dtype)
    old_bits = np.empty(total, h.dtype.bits_dtype)
    offs = [0]
    for k in counts:
        offs.append(offs[-1] + k)
    result = xxhash.xxh3_64() if verify else None
    scratch = np.empty(max((e - s for s, e in map(h.chunk_range, range(len(h.chunks)))), default=0),
                       h.dtype.bits_dtype) if result is not None else None

    def decode(i: int) -> None:
        a, b = offs[i], offs[i + 1]
        if b > a:
            _decode_chunk(enc, bits, i, (positions[a:b], values[a:b]), grand)

    try:
        for i, _ in enumerate(_imap(decode, range(len(h.chunks)), threads)):
            s, e = h.chunk_range(i)
            a, b = offs[i], offs[i + 1]
            pos = positions[a:b]
            if b > a and result is not None:
                sc = scratch[: e - s]
                np.copyto(sc, bits[s:e])
                kernels.gather(sc, pos, old_bits[a:b])
                kernels.scatter(sc, pos, values[a:b])
                result.update(sc)
            else:
                kernels.gather(bits[s:e], pos, old_bits[a:b])
                if result is not None:
                    result.update(bits[s:e])
            pos += s                                   # chunk-local -> tensor positions
    except DeltaError:
        diagnose_parent(enc, bits, verify)     # decoding against the wrong parent fails in any way: say so
        raise
    _check_result(enc, result, bits, verify)
    return StagedTensor(h.name, h.dtype, h.shape, h.digest, h.parent_digest, positions, values, old=old_bits)


def _check_result(enc: EncodedTensor, result: "xxhash.xxh3_64 | None", bits: np.ndarray, verify: bool) -> None:
    if result is not None and result.intdigest() != enc.header.digest:
        diagnose_parent(enc, bits, verify)
        raise ChecksumError(
            f"{enc.where()}: reconstructed bytes hash to {digest_hex(result.intdigest())}, "
            f"the record says {digest_hex(enc.header.digest)}")


def _dense_worthy(h: RecordHeader) -> bool:
    """Whether a record's changes, counted from its header, fill enough of its tensor that a whole new copy
    holds them in fewer bytes than a position and a value each (raw chunks' counts are elements: never)."""
    if any(c.encoding in REGISTRY.counts_elements for c in h.chunks):
        return False
    w = h.dtype.itemsize
    return sum(c.count for c in h.chunks) * (8 + w) > h.numel * w


def _stage_dense(bits: np.ndarray, enc: EncodedTensor, verify: bool, threads: int | None,
                 grand: np.ndarray | None = None, *, parent_seen: bool = True) -> StagedTensor:
    """:func:`stage` where the changes are known up front to fill most of the tensor: each chunk decodes
    straight into a new whole copy (dense_step writes every element itself), which is hashed chunk by chunk
    as it comes. The sparse form would hold a position and a value per change (12 bytes an fp32 element where
    the copy holds 4) and copy every change twice more on the way to the copy a dense swap writes."""
    h = enc.header
    dense = np.empty_like(bits)
    result = xxhash.xxh3_64() if verify else None

    def decode(i: int) -> None:
        s, e = h.chunk_range(i)
        chunks.decode_dense(h.chunks[i], enc.payloads[i], bits[s:e], h.dtype, f"{enc.where()} chunk {i}",
                            dense[s:e], None if grand is None else grand[s:e])

    try:
        for i, _ in enumerate(_imap(decode, range(len(h.chunks)), threads)):
            if result is not None:
                s, e = h.chunk_range(i)
                result.update(dense[s:e])
    except DeltaError:
        diagnose_parent(enc, bits, verify)
        raise
    _check_result(enc, result, bits, verify)
    # as a chunkwise dense stage: the dense swap checks, in the pause, that the live bits still hash to this
    seen = xxhash.xxh3_64_intdigest(bits) if parent_seen and verify and h.has_parent else h.parent_digest
    return StagedTensor(h.name, h.dtype, h.shape, h.digest, seen,
                        np.empty(0, np.int64), np.empty(0, h.dtype.bits_dtype), dense)


def _stage_chunkwise(bits: np.ndarray, enc: EncodedTensor, verify: bool, threads: int | None,
                     grand: np.ndarray | None = None) -> StagedTensor:
    """:func:`stage` where the changes cannot be sized before decoding (raw chunks): each chunk's changes
    decoded, then staged sparsely or, where they fill most of the tensor, densely."""
    h = enc.header
    result = xxhash.xxh3_64() if verify else None
    per_chunk: list[tuple[np.ndarray, np.ndarray]] = []
    olds: list[np.ndarray] = []
    try:
        for i, (pos, vals) in enumerate(_imap(lambda i: _decode_chunk(enc, bits, i, None, grand),
                                              range(len(h.chunks)), threads)):
            s, e = h.chunk_range(i)
            old = np.empty(pos.shape[0], h.dtype.bits_dtype)
            if pos.shape[0] and result is not None:
                scratch = bits[s:e].copy()
                kernels.gather(scratch, pos, old)
                kernels.scatter(scratch, pos, vals)
                result.update(scratch)
            else:
                kernels.gather(bits[s:e], pos, old)
                if result is not None:
                    result.update(bits[s:e])
            per_chunk.append((pos, vals))
            olds.append(old)
    except DeltaError:
        diagnose_parent(enc, bits, verify)
        raise
    _check_result(enc, result, bits, verify)
    total = sum(p.shape[0] for p, _ in per_chunk)
    w = h.dtype.itemsize
    if total * (8 + w) > h.numel * w:
        dense = bits.copy()
        for i, (pos, vals) in enumerate(per_chunk):
            s, _e = h.chunk_range(i)
            kernels.scatter(dense[s:], pos, vals)
        # A dense swap checks, in the pause, that the live bits still hash to what was staged against: that
        # is the tensor's own digest (the header's is unchecked when the result proved right without it).
        seen = xxhash.xxh3_64_intdigest(bits) if verify and h.has_parent else h.parent_digest
        return StagedTensor(h.name, h.dtype, h.shape, h.digest, seen,
                            np.empty(0, np.int64), np.empty(0, h.dtype.bits_dtype), dense)
    positions = np.empty(total, np.int64)
    values = np.empty(total, h.dtype.bits_dtype)
    old_bits = np.empty(total, h.dtype.bits_dtype)
    off = 0
    for i, ((pos, vals), old) in enumerate(zip(per_chunk, olds)):
        k = pos.shape[0]
        positions[off: off + k] = pos + h.chunk_range(i)[0]
        values[off: off + k] = vals
        old_bits[off: off + k] = old
        off += k
    return StagedTensor(h.name, h.dtype, h.shape, h.digest, h.parent_digest, positions, values, old=old_bits)


def stage_full(live: Array, new: Array, *, name: str = "tensor", expected_digest: int | None = None) -> StagedTensor:
    """Stage a replacement of ``live`` by the complete tensor ``new`` (an anchor's tensor).

    Only differing elements are kept, so moving between nearby versions through an
    anchor still pauses for the changed bytes only."""
    dt = dtypes.of(new)
    _check_live(live, name, dt, tuple(new.shape))
    old_bits, new_bits = dtypes.host_bits(live), dtypes.host_bits(new)
    d = xxhash.xxh3_64_intdigest(new_bits)
    if expected_digest is not None and d != expected_digest:
        raise ChecksumError(f"tensor {name!r}: anchor bytes hash to {digest_hex(d)}, "
                            f"the manifest says {digest_hex(expected_digest)}")
    k = kernels.count_changed(old_bits, new_bits)
    parent = xxhash.xxh3_64_intdigest(old_bits)
    if k * (8 + dt.itemsize) > new_bits.shape[0] * dt.itemsize:
        return StagedTensor(name, dt, tuple(new.shape), d, parent, np.empty(0, np.int64),
                            np.empty(0, dt.bits_dtype), new_bits.copy())
    positions, values = np.empty(k, np.int64), np.empty(k, dt.bits_dtype)
    kernels.diff_positions(old_bits, new_bits, positions, values)
    return StagedTensor(name, dt, tuple(new.shape), d, parent, positions, values)


def decode(old: Array | None, enc: "EncodedTensor | bytes | memoryview", *, verify: bool = True,
           threads: int | None = None, grandparent: Array | None = None):
    """The new tensor. Returns the type of ``old`` (torch on old's device, or numpy);
    a CPU torch tensor when ``old`` is None (records without parent). ``grandparent``: see :func:`stage`."""
    enc = _as_encoded(enc)
    h = enc.header
    if not h.has_parent:
        if old is not None:
            _check_live(old, h.name, h.dtype, h.shape)
        new_bits = _decode_raw(enc, verify, threads)
        if isinstance(old, np.ndarray):
            return new_bits.view(old.dtype).reshape(h.shape)
        t = dtypes.from_bits(new_bits, h.dtype, h.shape)
        return t if old is None else t.to(old.device)
    if old is None:
        raise ParentMismatchError(f"{enc.where()}: the record needs its parent tensor to decode")
    if _dense_worthy(h):     # most of it changes: decoded straight from old into the result, no copy of old first
        _check_live(old, h.name, h.dtype, h.shape)
        new_bits = _stage_dense(dtypes.host_bits(old), enc, verify, threads, _grand_bits(enc, grandparent),
                                parent_seen=False).dense
        if isinstance(old, np.ndarray):
            return new_bits.view(old.dtype).reshape(h.shape)
        return dtypes.from_bits(new_bits, h.dtype, h.shape).to(old.device)
    if isinstance(old, np.ndarray):
        out = np.array(old, copy=True, order="C")
    else:
        out = old.detach().clone(memory_format=torch.contiguous_format)
    apply_(out, enc, verify=verify, threads=threads, grandparent=grandparent)
    return out


def _decode_raw(enc: EncodedTensor, verify: bool, threads: int | None) -> np.ndarray:
    h = enc.header
    for i, c in enumerate(h.chunks):  # vet every chunk before allocating what the header claims
        s, e = h.chunk_range(i)
        chunks.check_whole(c, enc.payloads[i], e - s, h.dtype, f"{enc.where()} chunk {i}")
    out = np.empty(h.numel, h.dtype.bits_dtype)

    def one(i: int):
        s, e = h.chunk_range(i)
        c = h.chunks[i]
        out[s:e] = chunks.decode_raw(c, enc.payloads[i], e - s, h.dtype, f"{enc.where()} chunk {i}")

    _map(one, list(range(len(h.chunks))), threads)
    if verify and xxhash.xxh3_64_intdigest(out) != h.digest:
        raise ChecksumError(f"{enc.where()}: decoded bytes do not match the record's digest")
    return out


def apply_(live: Array, enc: "EncodedTensor | bytes | memoryview", *, verify: bool = True,
           threads: int | None = None, method: str = "auto", grandparent: Array | None = None) -> None:
    """Rewrite ``live`` in place into the tensor ``enc`` encodes. On any error ``live`` is untouched.

    On contiguous host memory a sparse change is verified after writing instead of
    staging a checked copy first: the old bits of every changed element are kept, the
    result is hashed in place, and a mismatch puts the old bits back before raising.
    That reads the tensor twice (parent digest, result digest) and copies only the old
    bits of what changes. A record that changes most of the tensor is decoded whole
    into a copy and proven there (fewer bytes than the old bits and positions of every
    change), then copied in. ``grandparent``: see :func:`stage`. Many tensors:
    :func:`ckptdelta.delta.apply_many`."""
    enc = _as_encoded(enc)
    h = enc.header
    bits = _writable_bits(live, h, method)
    if bits is None:
        stage(live, enc, verify=verify, threads=threads, grandparent=grandparent).apply_(live, method=method)
        return
    if h.has_parent and _dense_worthy(h):
        # most of the tensor changes: decoded whole into a new copy and proven there, then copied in (live is
        # written only once the result is right: nothing to undo)
        st = _stage_dense(bits, enc, verify, threads, _grand_bits(enc, grandparent), parent_seen=False)
        np.copyto(bits, st.dense)
        return
    per_chunk = _decode_against(enc, bits, verify, threads, _grand_bits(enc, grandparent))
    undo: list[_Undo] = []
    try:
        for i, (pos, vals) in enumerate(per_chunk):
            _write_chunk(bits, h, i, pos, vals, undo)
    except BaseException:          # a later chunk failed (its undo found no memory): put back the earlier ones
        _restore(bits, undo)
        raise
    if verify and xxhash.xxh3_64_intdigest(bits) != h.digest:
        _restore(bits, undo)
        diagnose_parent(enc, bits, verify)
        raise ChecksumError(f"{enc.where()}: reconstructed bytes do not match the record's digest "
                            f"{digest_hex(h.digest)}; the live tensor was left unchanged")


def _writable_bits(live, h: RecordHeader, method: str) -> np.ndarray | None:
    """``live``'s bits as a writable view when a delta can be written into it directly, else None
    (device or strided tensors, read-only arrays, ``method="torch"``: those are staged, then applied)."""
    return dtypes.host_bits(live) if _in_place(live, h, method) else None


def _in_place(live, h: RecordHeader, method: str) -> bool:
    """Whether ``live`` takes a delta in place, told from its attributes alone (asking torch for the view
    gives up the GIL, slow beside busy codec threads). When it does, host_bits() is a view of it: a
    contiguous CPU tensor's numpy() shares its memory, as does a C-contiguous array's flat view, so
    nothing checks the pointers (even ndarray.ctypes is slow, per tensor). An empty tensor has no
    memory to share: it is staged."""
    if isinstance(live, np.ndarray):
        ok = bool(live.flags.writeable and live.flags.c_contiguous) and live.size > 0
    else:
        ok = method == "auto" and live.device.type == "cpu" and live.is_contiguous() and live.numel() > 0
    if ok:
        _check_live(live, h.name, h.dtype, h.shape)
    return ok


#: What puts one chunk's old bits back: (start, chunk-local positions or None, old bits there or the whole chunk).
_Undo = tuple[int, "np.ndarray | None", np.ndarray]


def _write_chunk(bits: np.ndarray, h: RecordHeader, i: int, pos: np.ndarray, vals: np.ndarray,
                 undo: list[_Undo]) -> None:
    """Scatter chunk ``i``'s changes into ``bits``, first appending to ``undo`` what restores it.

    The undo keeps the old bits of the changed elements at uint32 chunk-local
    positions (chunks hold at most 2**24 elements), or a copy of the chunk where that
    is smaller: never more than the chunk's own bytes, so a caller can hold the undo
    of many tensors (ckptdelta.delta.apply_many rolls a whole batch back with it)."""
    k = pos.shape[0]
    if not k:
        return
    s, e = h.chunk_range(i)
    seg = bits[s:e]
    w = h.dtype.itemsize
    if k * (4 + w) >= (e - s) * w:
        undo.append((s, None, seg.copy()))
    else:
        old_vals = np.empty_like(vals)
        kernels.gather(seg, pos, old_vals)
        undo.append((s, pos.astype(np.uint32), old_vals))
    kernels.scatter(seg, pos, vals)


def _restore(bits: np.ndarray, undo: list[_Undo]) -> None:
    for s, pos, old in reversed(undo):
        if pos is None:
            bits[s: s + old.shape[0]] = old
        else:
            kernels.scatter(bits[s:], pos.astype(np.int64), old)


def _shares(bits: np.ndarray, live) -> bool:
    if isinstance(live, torch.Tensor):
        return bits.ctypes.data == live.data_ptr()
    return np.shares_memory(bits, live) and bits.flags.writeable
