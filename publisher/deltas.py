"""Deltas: every tensor encoded against the previous published snapshot, into objects per rank.

Tensors are encoded by :func:`ckptdelta.delta.encode_many`: small tensors encode side by side
on every core, a little ahead of the record being written, and records still come
out in the snapshot's order. Records are streamed into local part files (hashed as
they are written). When a part passes its size (``first_part_bytes`` for the first,
doubling from part to part up to ``part_bytes``) it is closed and handed to
``on_part``, which uploads it in the background while the next tensors are encoded:
encoding overlaps the upload of what came before, and a rank's delta of any size
never waits for one long upload at the end. A tensor whose bits equal its parent's
gets no record at all, only a manifest entry with ``object: null``; a delta where
nothing changed writes no object.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Container, Iterator, Mapping
from contextlib import closing
from dataclasses import dataclass, field
from typing import BinaryIO

import torch
import xxhash

from ckptdelta.delta import codec, doubling
from ckptdelta.delta.batch import BYTES_PER_THREAD, encode_many, threads_for
from ckptdelta.delta.container import ObjectWriter
from ckptdelta.delta.manifest import TensorEntry
from ckptdelta.delta.chunks import FAST_ENCODINGS
from ckptdelta.delta.record import UNCHANGED

#: Name of rank ``r``'s delta object ``part`` inside the snapshot's delta prefix.
def rank_object_name(rank: int, part: int = 0) -> str:
    return f"rank-{rank:05d}.ckd" if part == 0 else f"rank-{rank:05d}-{part:03d}.ckd"


#: A part is closed (and its upload started) once it holds this many bytes of records, at most.
DEFAULT_PART_BYTES = 64 << 20
#: The first part's bytes; each next part may hold twice as many as the last, up to ``part_bytes``. A
#: delta of tens of MB then uploads mostly while the rest of it encodes (what is left to upload after the
#: last record is the part being filled, not the whole delta: a 35 MB delta in one 64 MiB part waited
#: 0.3 s at 1 Gbit/s for its upload after encoding), and a delta of GBs is still parts of 64 MiB, a few
#: more objects than fixed 64 MiB parts (a 3 GB delta: 50 instead of 45), not hundreds. 1 MiB: the
#: upload of a LoRA step of a few MB starts after a few ms of encoding, not once 4 MiB of it are written.
FIRST_PART_BYTES = 1 << 20
#: A publisher's parts hold at most 1/TAIL_SHARE of the step's input bytes (:func:`part_bytes_for`, at least
#: MIN_PART_CAP): doubling alone leaves up to half of a delta of tens of MB in its last part, uploaded only
#: once every record is encoded (a LoRA step of 53 MB closed a last part of 25 MB, 0.2 s at 1 Gbit/s after
#: its encode). A full model's delta of GBs still gets parts of ``part_bytes``. 1 MiB at least: a LoRA step
#: of 3-4 MB then closes parts of 1 MiB, and what is left after its encode is at most ~9 ms at 1 Gbit/s
#: (2 MiB parts left ~17; docs/PERFORMANCE.md, "LoRA runs, the replica's fixed costs").
TAIL_SHARE = 16
MIN_PART_CAP = 1 << 20


#: A delta's input bytes each encode thread is given at least (:func:`encode_threads_for`, the codec's
#: ``threads_for`` rule): a LoRA step's hundreds of tensors of tens to hundreds of KB each encode faster on one
#: thread than on two of 2 cores (rank 16 bf16, 9.6 MB: 36 ms against 43 ms, quiet), whose second mostly waits for
#: the GIL between the first one's short kernels; a rank-64 step (38 MB) gains from a second (89 ms against 105).
ENCODE_BYTES_PER_THREAD = BYTES_PER_THREAD


def encode_threads_for(input_bytes: int, cores: int) -> int:
    """Threads to encode a delta of ``input_bytes`` bytes of tensors with on ``cores`` cores."""
    return threads_for(input_bytes, cores, ENCODE_BYTES_PER_THREAD)


def part_bytes_for(input_bytes: int, part_bytes: int = DEFAULT_PART_BYTES) -> int:
    """The part size a delta of a step of ``input_bytes`` bytes of tensors is cut at: ``part_bytes``, or
    less, so that what is left to upload after the last record is a small share of the delta."""
    return doubling.capped(input_bytes, part_bytes, MIN_PART_CAP, TAIL_SHARE)


def _part_limits(part_bytes: int, first_part_bytes: int) -> Iterator[int]:
    """The size at which each part closes: ``first_part_bytes``, then twice the last, at most ``part_bytes``."""
    if part_bytes < 1 or first_part_bytes < 1:
        raise ValueError(f"part sizes must be at least 1 byte, got part_bytes={part_bytes}, "
                         f"first_part_bytes={first_part_bytes}")
    return doubling.limits(first_part_bytes, part_bytes)


def part_sizes(nbytes: int, part_bytes: int = DEFAULT_PART_BYTES,
               first_part_bytes: int = FIRST_PART_BYTES) -> list[int]:
    """The sizes of the parts a delta of ``nbytes`` bytes of records is cut into (records taken as
    divisible: the real parts end at the first record past each size)."""
    out: list[int] = []
    for limit in _part_limits(part_bytes, first_part_bytes):
        if nbytes <= 0:
            return out
        out.append(min(nbytes, limit))
        nbytes -= out[-1]
    return out


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
    """What one rank wrote: entries index ``objects`` (its part files, in order) or are None (unchanged)."""

    entries: dict[str, TensorEntry]
    objects: list[tuple[int, str]] = field(default_factory=list)   # (size, xxh3) of each part
    changed: list[str] = field(default_factory=list)
    changed_elements: int = 0       # the records' chunk counts (changed elements; a raw chunk's: all of them)
    changed_nan: list[str] = field(default_factory=list)   # changed tensors where a changed element became NaN
    #: changed tensors whose every chunk tried the fast path's other encodings, and took its own (sparse)
    fast_won: list[str] = field(default_factory=list)
    encode_s: float = 0.0


def _grandparent(g: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor | None:
    return g if g is not None and g.dtype == new.dtype and g.shape == new.shape else None


def write_delta(open_part: Callable[[int], BinaryIO], parent: Mapping[str, torch.Tensor],
                snapshot: Mapping[str, torch.Tensor], *, level: int,
                on_part: Callable[[int, int, str], None] | None = None,
                on_bytes: Callable[[int], None] | None = None, part_bytes: int = DEFAULT_PART_BYTES,
                first_part_bytes: int = FIRST_PART_BYTES, context: bool = True,
                parent_digests: Mapping[str, int] | None = None,
                grandparents: Mapping[str, torch.Tensor] | None = None,
                fast_alone: Container[str] = (), threads: int | None = None) -> DeltaPart:
    """Encode ``snapshot`` against ``parent`` (same names, dtypes and shapes) into part streams.

    ``open_part(i)`` gives the stream for part ``i``; ``on_part(i, size, xxh3)`` is called
    once part ``i`` is complete and closed (the caller starts its upload there).
    ``parent_digests``: the xxh3 of parent tensors the caller already knows (what it
    committed last time), so the encoder does not read those parents once more to hash
    them. A wrong one cannot pass: a replica's parent check would refuse the record,
    and the record's own digest is always hashed from ``snapshot``. ``grandparents``: tensors of the
    snapshot ``parent`` was itself encoded against (same names, dtypes and shapes), for the context coder's
    encoding 6 (a replica then needs them too: LoRA runs only). ``fast_alone``: names whose chunks try the fast
    path's own encoding only (``encode_many``'s); ``DeltaPart.fast_won`` names those that tried the others and
    took it anyway, the caller's next ``fast_alone``. ``threads``: ``encode_many``'s (default: every core)."""
    t0 = time.perf_counter()
    part = DeltaPart(entries={})
    f: BinaryIO | None = None
    out: HashingWriter | None = None
    writer: ObjectWriter | None = None
    limits = _part_limits(part_bytes, first_part_bytes)
    limit = next(limits)

    def close_current() -> None:
        nonlocal f, out, writer, limit
        limit = next(limits)
        writer.finish()
        f.close()
        part.objects.append((out.size, out.hexdigest()))
        if on_part is not None:
            on_part(len(part.objects) - 1, out.size, out.hexdigest())
        f = out = writer = None

    known, grand = parent_digests or {}, grandparents or {}
    records = encode_many(((name, parent[name], new, known.get(name), _grandparent(grand.get(name), new))
                           for name, new in snapshot.items()), level=level, context=context,
                          fast_alone=fast_alone, threads=threads)
    try:
        with closing(records):          # on an error here, the encoding work still queued is dropped
            for enc in records:
                h = enc.header
                name, dtype, shape = h.name, h.dtype.name, tuple(h.shape)
                if all(c.encoding == UNCHANGED for c in h.chunks):
                    part.entries[name] = TensorEntry(dtype, shape, codec.digest_hex(h.digest), None)
                else:
                    if writer is None:
                        f = open_part(len(part.objects))
                        out = HashingWriter(f)
                        writer = ObjectWriter(out)
                    offset, length = writer.add(name, enc.to_bytes())
                    part.entries[name] = TensorEntry(dtype, shape, codec.digest_hex(h.digest), len(part.objects),
                                                     offset, length)
                    part.changed.append(name)
                    part.changed_elements += sum(c.count for c in h.chunks)
                    if enc.changed_nan:
                        part.changed_nan.append(name)
                    if not context and name not in fast_alone and h.has_parent and \
                            all(c.encoding in FAST_ENCODINGS or c.encoding == UNCHANGED for c in h.chunks):
                        part.fast_won.append(name)
                    if out.size >= limit:
                        close_current()
                if on_bytes is not None:
                    on_bytes(h.numel * h.dtype.itemsize)
        if writer is not None:
            close_current()
    except BaseException:
        if f is not None:               # the part being written: its file goes with the temp dir
            f.close()
        raise
    part.encode_s = time.perf_counter() - t0
    return part
