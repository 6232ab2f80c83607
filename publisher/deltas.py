"""Deltas: every tensor encoded against the previous published snapshot, into one object per rank.

Records are streamed into a local file (hashed as they are written) and the
object is uploaded once complete: a delta is a few percent of the model, and the
publish as a whole already overlaps the trainer's next step (``wait=False``).
A tensor whose bits equal its parent's gets no record at all, only a manifest
entry with ``object: null``; a delta where nothing changed writes no object.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import BinaryIO

import torch
import xxhash

from delta import codec
from delta.container import ObjectWriter
from delta.manifest import TensorEntry
from delta.record import UNCHANGED

#: Name of rank ``r``'s delta object inside the snapshot's delta prefix.
def rank_object_name(rank: int) -> str:
    return f"rank-{rank:05d}.ckd"


class HashingWriter:
    """A write-only stream that hashes (xxh3-64) and counts what passes through it."""

    def __init__(self, f: BinaryIO):
        self._f = f
        self._h = xxhash.xxh3_64()
        self.size = 0

    def write(self, data: bytes | memoryview) -> int:
        self._f.write(data)
        self._h.update(data)
        self.size += len(data)
        return len(data)

    def hexdigest(self) -> str:
        return codec.digest_hex(self._h.intdigest())


@dataclass
class DeltaPart:
    """What one rank wrote: entries with object index 0 (its object) or None (unchanged)."""

    entries: dict[str, TensorEntry]
    size: int = 0                  # 0: no object was written
    xxh3: str = ""
    changed: list[str] = field(default_factory=list)
    encode_s: float = 0.0


def write_delta(f: BinaryIO, parent: Mapping[str, torch.Tensor], snapshot: Mapping[str, torch.Tensor], *,
                level: int, on_bytes: Callable[[int], None] | None = None) -> DeltaPart:
    """Encode ``snapshot`` against ``parent`` (same names, dtypes and shapes) into ``f``."""
    t0 = time.perf_counter()
    out = HashingWriter(f)
    writer: ObjectWriter | None = None
    part = DeltaPart(entries={})
    for name, new in snapshot.items():
        enc = codec.encode(parent[name], new, name=name, level=level)
        h = enc.header
        dtype, shape = h.dtype.name, tuple(h.shape)
        if all(c.encoding == UNCHANGED for c in h.chunks):
            part.entries[name] = TensorEntry(dtype, shape, codec.digest_hex(h.digest), None)
        else:
            if writer is None:
                writer = ObjectWriter(out)
            offset, length = writer.add(name, enc.to_bytes())
            part.entries[name] = TensorEntry(dtype, shape, codec.digest_hex(h.digest), 0, offset, length)
            part.changed.append(name)
        if on_bytes is not None:
            on_bytes(h.numel * h.dtype.itemsize)
    if writer is not None:
        writer.finish()
        part.size, part.xxh3 = out.size, out.hexdigest()
    part.encode_s = time.perf_counter() - t0
    return part
