"""A delta *object*: many tensor records in one stored object, with a footer index.

Layout (docs/FORMAT.md, "Delta objects"): an 8-byte magic, the records back to
back, then a JSON footer mapping each tensor name to its ``[offset, length]``,
then ``u64 footer_length``, ``u64 xxh3(footer)`` and an 8-byte end magic. The
manifest repeats every offset, so a reader normally range-reads one record
without touching the footer; the footer makes an object self-describing
(``ckptdelta`` can inspect or salvage it without its manifest).
"""

from __future__ import annotations

import json
import struct
from typing import BinaryIO

import xxhash

from ckptdelta.delta import untrusted_json
from ckptdelta.delta.errors import ChecksumError, FormatError, TruncatedError

OBJECT_MAGIC = b"CKDOBJ01"
END_MAGIC = b"CKDEND01"
TRAILER = struct.Struct("<QQ8s")
MAX_FOOTER_BYTES = 64 << 20


class ObjectWriter:
    """Appends records to a binary stream and remembers where each one went."""

    def __init__(self, stream: BinaryIO):
        self._f = stream
        self._f.write(OBJECT_MAGIC)
        self._pos = len(OBJECT_MAGIC)
        self.index: dict[str, tuple[int, int]] = {}

    def add(self, name: str, record: bytes | memoryview) -> tuple[int, int]:
        if name in self.index:
            raise FormatError(f"tensor {name!r} written twice into one delta object")
        self._f.write(record)
        where = (self._pos, len(record))
        self.index[name] = where
        self._pos += len(record)
        return where

    def finish(self) -> int:
        """Write the footer; returns the object's total size."""
        footer = json.dumps({"records": self.index}, separators=(",", ":"), sort_keys=True).encode()
        self._f.write(footer)
        self._f.write(TRAILER.pack(len(footer), xxhash.xxh3_64_intdigest(footer), END_MAGIC))
        self._pos += len(footer) + TRAILER.size
        return self._pos


def footer_length(tail: bytes, *, what: str = "delta object") -> int:
    """Footer size from the last 24 bytes of an object (so a reader can fetch exactly it)."""
    if len(tail) < TRAILER.size:
        raise TruncatedError(f"{what}: too short for a trailer")
    n, _h, magic = TRAILER.unpack_from(tail, len(tail) - TRAILER.size)
    if magic != END_MAGIC:
        raise FormatError(f"{what}: bad end magic {magic!r} (truncated or not a ckptdelta delta object)")
    if n > MAX_FOOTER_BYTES:
        raise FormatError(f"{what}: footer of {n} bytes exceeds the {MAX_FOOTER_BYTES}-byte limit")
    return n


def read_index(buf: bytes | memoryview, object_size: int, *, what: str = "delta object") -> dict[str, tuple[int, int]]:
    """Parse the footer index. ``buf`` is the end of the object (at least footer + trailer)."""
    n = footer_length(buf, what=what)
    if len(buf) < n + TRAILER.size:
        raise TruncatedError(f"{what}: need the last {n + TRAILER.size} bytes to read the footer")
    _n, h, _m = TRAILER.unpack_from(buf, len(buf) - TRAILER.size)
    footer = bytes(buf[len(buf) - TRAILER.size - n: len(buf) - TRAILER.size])
    if xxhash.xxh3_64_intdigest(footer) != h:
        raise ChecksumError(f"{what}: footer checksum mismatch")
    doc = untrusted_json.loads(footer, what=f"{what}: footer", max_bytes=MAX_FOOTER_BYTES, error=FormatError)
    records = doc.get("records") if isinstance(doc, dict) else None
    if not isinstance(records, dict):
        raise FormatError(f"{what}: footer is not a valid index (records is not a mapping)")
    limit = object_size - n - TRAILER.size
    out: dict[str, tuple[int, int]] = {}
    for name, v in records.items():
        if not (isinstance(v, list) and len(v) == 2 and all(type(x) is int and x >= 0 for x in v)
                and len(OBJECT_MAGIC) <= v[0] and v[0] + v[1] <= limit):
            raise FormatError(f"{what}: footer entry for tensor {name[:200]!r} is out of bounds")
        out[name] = (v[0], v[1])
    end, prev = 0, None
    for name, (off, length) in sorted(out.items(), key=lambda kv: kv[1]):   # back to back: reading every
        if off < end:                                                          # record reads the object once
            raise FormatError(f"{what}: footer entries for tensors {prev[:200]!r} and {name[:200]!r} overlap")
        end, prev = off + length, name
    return out
