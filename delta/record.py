"""The binary layout of one encoded tensor (a *record*), exactly as docs/FORMAT.md states it.

This module only packs and parses; it never decodes payloads. Parsing checks
every field before anything is allocated from it: sizes use Python integers
(no overflow), counts are bounded by the bytes actually present, and the header
carries its own xxh3-64 so a flipped bit anywhere in it is caught before a
field is trusted.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import xxhash

from ckptdelta.delta import dtypes
from ckptdelta.delta.ctxcoder import CTX_LAYOUT  # noqa: F401 - (planes_a, planes_b) per dtype of encodings 4 and 5
from ckptdelta.delta.encodings import (CTX, DENSE_STEP, DENSE_XOR, GCTX, GROUPED_PSTEP, GROUPED_STEP,  # noqa: F401
                                      PCTX, RAW, REGISTRY, SPARSE, UNCHANGED)
from ckptdelta.delta.errors import ChecksumError, FormatError, TruncatedError
from ckptdelta.delta.pctx import PCTX_LAYOUT  # noqa: F401 - the same, of encoding 6

MAGIC = b"CKDT"
FORMAT_VERSION = 1

# Chunk encodings (docs/FORMAT.md, "Chunk encodings"): one module each in delta/encodings/, registered by id
# (imported above: the built-in ids UNCHANGED .. GROUPED_PSTEP and layouts, for callers); new ones take new ids,
# old ids never change.
#: id -> name of every registered encoding (one dict, kept current by the registry).
ENCODING_NAMES = REGISTRY.names

FLAG_HAS_PARENT = 1

MAX_NDIM = 32
MAX_NAME_BYTES = 4096
MAX_CHUNK_ELEMS = 1 << 24
MAX_NUMEL = 1 << 48
MAX_CHUNKS = 1 << 20      # bounds a header to ~24 MiB whatever its fields say

_FIXED = struct.Struct("<4sHBBIIQQQIHH")  # 48 bytes
_CHUNK = struct.Struct("<BBBBIQQ")        # 24 bytes
FIXED_SIZE = _FIXED.size
CHUNK_ENTRY_SIZE = _CHUNK.size
assert FIXED_SIZE == 48 and CHUNK_ENTRY_SIZE == 24


@dataclass(frozen=True)
class ChunkEntry:
    encoding: int    # its id; it decides what the fields below mean (delta/encodings/, docs/FORMAT.md)
    planes_a: int    # sparse: byte planes of the gaps; ctx, gctx, pctx: mantissa bits; others: 0
    planes_b: int    # sparse: byte planes of the steps; dense/raw: element width; ctx, gctx, pctx: exponent bits
    count: int       # changed elements; raw: elements; unchanged: 0
    length: int      # payload bytes
    checksum: int    # xxh3-64 of the payload bytes


@dataclass(frozen=True)
class RecordHeader:
    name: str
    dtype: dtypes.DType
    shape: tuple[int, ...]
    numel: int
    chunk_elems: int
    digest: int            # xxh3-64 of the reconstructed tensor's bytes (C order, little-endian)
    parent_digest: int     # xxh3-64 of the tensor it was encoded against; 0 without parent
    has_parent: bool
    chunks: tuple[ChunkEntry, ...]
    header_size: int       # bytes before the first payload

    @property
    def payload_size(self) -> int:
        return sum(c.length for c in self.chunks)

    @property
    def record_size(self) -> int:
        return self.header_size + self.payload_size

    def chunk_range(self, i: int) -> tuple[int, int]:
        """Element range [start, stop) covered by chunk i."""
        start = i * self.chunk_elems
        return start, min(self.numel, start + self.chunk_elems)

    def payload_offsets(self) -> list[int]:
        """Offset of each chunk's payload from the start of the record."""
        out, off = [], self.header_size
        for c in self.chunks:
            out.append(off)
            off += c.length
        return out

    def where(self, what: str | None = None) -> str:
        return f"tensor {self.name!r}" + (f" {what}" if what else "")


def n_chunks_for(numel: int, chunk_elems: int) -> int:
    return 0 if numel == 0 else -(-numel // chunk_elems)


def header_size_for(ndim: int, name_len: int, n_chunks: int) -> int:
    return FIXED_SIZE + 8 * ndim + _pad8(name_len) + CHUNK_ENTRY_SIZE * n_chunks + 8


#: What one zstd frame may add to its input: ZSTD_compressBound's s/256 + 64 bytes, rounded up generously.
_FRAME_SLACK = 128


def max_record_size(numel: int, itemsize: int, ndim: int, name_len: int) -> int:
    """The most bytes a record of a tensor of this size may take; a longer one is refused unread.

    A bucket names a record's length in its manifest, and a reader would otherwise
    download (allocate) whatever it says before the record's own header could be
    checked. The bound covers every record the encoder writes, with any chunk size:
    the header of the most chunks there can be, and each chunk at its worst
    encoding (sparse, every element changed, at the widest planes, 4 + itemsize
    bytes an element) grown by zstd's worst case, doubled for headroom. So it is a
    few times the tensor's own size, never the manifest's word for it."""
    n_chunks = min(numel, MAX_CHUNKS)
    payload = 2 * (4 + itemsize) * numel + n_chunks * (4 + 2 * _FRAME_SLACK)
    return header_size_for(ndim, name_len, n_chunks) + payload


def _pad8(n: int) -> int:
    return (n + 7) & ~7


def pack_header(h: RecordHeader) -> bytes:
    name = h.name.encode("utf-8")
    if len(name) > MAX_NAME_BYTES:
        raise FormatError(f"tensor name too long ({len(name)} bytes > {MAX_NAME_BYTES}): {h.name[:80]!r}...")
    parts = [
        _FIXED.pack(
            MAGIC, FORMAT_VERSION, h.dtype.code, len(h.shape),
            FLAG_HAS_PARENT if h.has_parent else 0, h.chunk_elems, h.numel,
            h.digest, h.parent_digest, len(h.chunks), len(name), 0,
        ),
        struct.pack(f"<{len(h.shape)}Q", *h.shape),
        name + b"\0" * (_pad8(len(name)) - len(name)),
    ]
    parts += [_CHUNK.pack(c.encoding, c.planes_a, c.planes_b, 0, c.count, c.length, c.checksum) for c in h.chunks]
    body = b"".join(parts)
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))


def peek_header_size(buf: bytes | memoryview, *, what: str = "record") -> int:
    """Header size from the fixed part alone (48 bytes), so a reader can fetch exactly
    the header with a second byte-range read. Validates the fixed fields it uses."""
    if len(buf) < FIXED_SIZE:
        raise TruncatedError(f"{what}: {len(buf)} bytes, need at least {FIXED_SIZE} for a record header")
    magic, version, _code, ndim, _flags, _ce, _numel, _d, _pd, n_chunks, name_len, _r = _FIXED.unpack_from(buf, 0)
    if magic != MAGIC:
        raise FormatError(f"{_claimed(buf, what)}: bad magic {bytes(magic)!r}, expected {MAGIC!r} "
                          f"(not a ckptdelta tensor record)")
    if version != FORMAT_VERSION:
        raise FormatError(f"{_claimed(buf, what)}: record format version {version} is not supported "
                          f"(this reader knows {FORMAT_VERSION})")
    if ndim > MAX_NDIM or name_len > MAX_NAME_BYTES:
        raise FormatError(f"{_claimed(buf, what)}: header declares ndim={ndim}, name of {name_len} bytes: "
                          f"over the limits")
    if n_chunks > MAX_CHUNKS:
        raise FormatError(f"{_claimed(buf, what)}: header declares {n_chunks} chunks (limit {MAX_CHUNKS})")
    return header_size_for(ndim, name_len, n_chunks)


def parse_header(buf: bytes | memoryview, *, what: str = "record") -> RecordHeader:
    """Parse and validate a record header from the start of ``buf``."""
    size = peek_header_size(buf, what=what)
    if len(buf) < size:
        raise TruncatedError(f"{_claimed(buf, what)}: header needs {size} bytes, only {len(buf)} present")
    mv = memoryview(buf)[:size]
    (stored,) = struct.unpack_from("<Q", mv, size - 8)
    if xxhash.xxh3_64_intdigest(mv[: size - 8]) != stored:
        raise ChecksumError(f"{_claimed(buf, what)}: header checksum mismatch (corrupt record header)")
    (_m, _v, code, ndim, flags, chunk_elems, numel, digest, parent_digest,
     n_chunks, name_len, _r) = _FIXED.unpack_from(mv, 0)
    off = FIXED_SIZE
    shape = struct.unpack_from(f"<{ndim}Q", mv, off)
    off += 8 * ndim
    try:
        name = bytes(mv[off: off + name_len]).decode("utf-8")
    except UnicodeDecodeError:
        raise FormatError(f"{what}: tensor name is not valid UTF-8") from None
    where = f"{what} (tensor {name!r})"
    if any(mv[off + name_len: off + _pad8(name_len)]):
        raise FormatError(f"{where}: nonzero bytes in the name's padding")
    off += _pad8(name_len)
    dt = dtypes.BY_CODE.get(code)
    if dt is None:
        raise FormatError(f"{where}: unknown dtype code {code}")
    if flags & ~FLAG_HAS_PARENT or _r:
        raise FormatError(f"{where}: unknown flags {flags:#x} or nonzero reserved field {_r:#x}")
    if not 1 <= chunk_elems <= MAX_CHUNK_ELEMS:
        raise FormatError(f"{where}: chunk size {chunk_elems} elements is outside [1, {MAX_CHUNK_ELEMS}]")
    if math.prod(shape) != numel or numel > MAX_NUMEL or any(s > MAX_NUMEL for s in shape):
        raise FormatError(f"{where}: numel {numel} does not match shape {list(shape)} (or exceeds {MAX_NUMEL})")
    if n_chunks != n_chunks_for(numel, chunk_elems):
        raise FormatError(f"{where}: {n_chunks} chunks declared, {n_chunks_for(numel, chunk_elems)} expected")
    has_parent = bool(flags & FLAG_HAS_PARENT)
    if not has_parent and parent_digest:
        raise FormatError(f"{where}: a parent digest in a record without parent")
    chunks = []
    for i in range(n_chunks):
        enc, pa, pb, r2, count, length, checksum = _CHUNK.unpack_from(mv, off)
        off += CHUNK_ENTRY_SIZE
        start = i * chunk_elems
        n = min(numel, start + chunk_elems) - start
        if r2:
            raise FormatError(f"{where} chunk {i}: nonzero reserved byte {r2:#x}")
        _check_entry(where, i, enc, pa, pb, count, n, dt.itemsize, has_parent, length, dtype_name=dt.name)
        chunks.append(ChunkEntry(enc, pa, pb, count, length, checksum))
    return RecordHeader(name, dt, tuple(shape), numel, chunk_elems, digest, parent_digest,
                        has_parent, tuple(chunks), size)


def _claimed(buf: bytes | memoryview, what: str) -> str:
    """``what``, plus the tensor name the header claims when its bytes are present.

    Only for error messages about a header that failed its checks: the name is
    unverified, but it is usually what a user needs to find the broken tensor."""
    try:
        ndim, name_len = buf[7], struct.unpack_from("<H", buf, 44)[0]
        start = FIXED_SIZE + 8 * ndim
        if ndim > MAX_NDIM or name_len == 0 or len(buf) < start + name_len:
            return what
        name = bytes(buf[start: start + name_len]).decode("utf-8")
    except (UnicodeDecodeError, struct.error, IndexError):
        return what
    return f"{what} (claims tensor {name[:200]!r})"


def _check_entry(where: str, i: int, enc: int, pa: int, pb: int, count: int, n: int,
                 itemsize: int, has_parent: bool, length: int, dtype_name: str = "") -> None:
    e = REGISTRY.by_id.get(enc)
    bad = f"unknown encoding id {enc}" if e is None else \
        e.check_entry(pa, pb, count, n, itemsize, has_parent, length, dtype_name)
    if bad:
        raise FormatError(f"{where} chunk {i}: {bad}")
