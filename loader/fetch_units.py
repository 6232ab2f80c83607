"""The unit of fetching: one stored byte range a tensor needs, how it is checked, and how tensors are rebuilt.

A piece is an anchor tensor's data (checked against the tensor's digest) or a
delta record (checked by its header and chunk checksums, then against the
manifest's dtype, shape and digest); :func:`rebuild` applies checked pieces in
order, each record checking its result digest on the way (which proves the bits;
a wrong parent is named when that or the decode fails).

A tensor a sharded trainer published in parts (delta/pieces.py) has one record per
box in a delta: ``Piece(m, name, k)`` is box ``k``'s, applied to that box of the
whole tensor (in place where the box is a flat range of it, as dim-0 rows are).
Its record proves its box; :func:`check_assembled` then proves the whole tensor
against the entry's digest of its pieces' digests.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import xxhash

from ckptdelta.delta import EncodedTensor, apply_, decode, digest_hex, dtypes
from ckptdelta.delta.errors import (ChecksumError, FormatError, GrandparentNeededError, ParentMismatchError,
                                    ShapeMismatchError, TruncatedError)
from ckptdelta.delta.manifest import Manifest, ObjectRef, TensorEntry
from ckptdelta.delta.pieces import PieceEntry, box_view, flat_range, tensor_digest
from ckptdelta.delta.record import max_record_size

#: Neighbouring ranges of one object closer than this are fetched as one request.
COALESCE_GAP = 64 << 10
#: Upper bound of one coalesced request.
MAX_REQUEST_BYTES = 64 << 20
#: A request that would start within this many bytes of its object's first byte starts at it (see coalesce).
FROM_START_BYTES = 4 << 10


@dataclass(frozen=True)
class Piece:
    """One stored byte range a tensor needs: an anchor's tensor data or a delta record."""

    manifest: Manifest
    name: str
    index: int | None = None      # a pieced entry's piece (its box's record); None: the whole tensor's bytes

    @property
    def entry(self) -> TensorEntry:
        return self.manifest.tensors[self.name]

    @property
    def part(self) -> PieceEntry | None:
        return None if self.index is None else self.entry.pieces[self.index]

    @property
    def _stored(self) -> "TensorEntry | PieceEntry":
        return self.entry if self.index is None else self.entry.pieces[self.index]

    @property
    def obj(self) -> ObjectRef:
        return self.manifest.objects[self._stored.object]

    @property
    def is_record(self) -> bool:
        return self.manifest.kind == "delta"

    @property
    def start(self) -> int:
        return self._stored.offset

    @property
    def end(self) -> int:
        return self._stored.offset + self._stored.length

    @property
    def nbytes(self) -> int:
        return self._stored.length

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of what the stored bytes hold: the tensor's, or the piece's box."""
        return tuple(self._stored.shape)

    def where(self) -> str:
        kind = "record" if self.is_record else "data"
        box = "" if self.index is None else f" piece {self.index} ({self.part.describe()})"
        return (f"{kind} of tensor {self.name!r}{box} in {self.obj.key} bytes {self.start}-{self.end} "
                f"({self.manifest.where()})")


def stored_pieces(m: Manifest, name: str) -> list[Piece]:
    """The pieces ``m`` stores for ``name``: its data or record, or each of its boxes' records ([] if none)."""
    e = m.tensors[name]
    if e.pieces:
        return [Piece(m, name, k) for k, p in enumerate(e.pieces) if p.object is not None]
    return [] if e.object is None else [Piece(m, name)]



def check_piece_size(p: Piece) -> None:
    """Refuse, before a byte is fetched, a piece longer than its tensor can justify (a hostile manifest's
    length is otherwise what the reader allocates): an anchor tensor's exact size, a record's bound."""
    e = p.entry
    dt = dtypes.by_name(e.dtype)
    shape = p.shape
    numel = 1
    for s in shape:
        numel *= s
    most = max_record_size(numel, dt.itemsize, len(shape), len(p.name.encode("utf-8"))) if p.is_record \
        else e.nbytes
    if p.nbytes > most:
        raise FormatError(f"{p.where()}: {p.nbytes} bytes claimed, a {e.dtype}{list(shape)} "
                          f"{'piece' if p.index is not None else 'tensor'}'s "
                          f"{'record' if p.is_record else 'data'} takes at most {most}")


def check_piece(p: Piece, data: bytes) -> "bytes | EncodedTensor":
    """Bytes of a piece, checked: an anchor tensor's digest, or a record's checksums and its fit to the manifest."""
    e = p.entry
    stored = p._stored
    if len(data) != stored.length:
        raise TruncatedError(f"{p.where()}: got {len(data)} bytes, expected {stored.length}")
    if not p.is_record:
        if xxh_hex(data) != e.xxh3:
            raise ChecksumError(f"{p.where()}: tensor bytes hash to {xxh_hex(data)}, the manifest says {e.xxh3}")
        return data
    enc = EncodedTensor.from_bytes(data, what=p.where())
    h = enc.header
    if h.name != p.name or h.dtype.name != e.dtype or tuple(h.shape) != p.shape:
        raise FormatError(f"{p.where()}: the record holds tensor {h.name!r} {h.dtype.name}{list(h.shape)}, "
                          f"the manifest expects {e.dtype}{list(p.shape)}")
    if digest_hex(h.digest) != stored.xxh3:
        raise ChecksumError(f"{p.where()}: the record yields digest {digest_hex(h.digest)}, "
                            f"the manifest says {stored.xxh3}")
    return enc


def check_assembled(e: TensorEntry, t: torch.Tensor, what: str) -> None:
    """Prove a pieced tensor whole: every box of ``t`` hashes to its piece's digest and those to the entry's
    (delta/pieces.py). A plain entry's bits were proven by the record or data that produced them."""
    if not e.pieces:
        return
    got = tensor_digest(e.pieces, t)
    if got != e.xxh3:
        raise ChecksumError(f"{what}: the assembled tensor's pieces hash to {got}, the manifest says {e.xxh3} "
                            "(a piece the manifest calls unchanged holds other bits)")


def tensor_from_bytes(data: bytes, dtype: str, shape: Sequence[int]) -> torch.Tensor:
    """A writable CPU tensor holding a copy of ``data`` (an anchor tensor's little-endian bytes)."""
    dt = dtypes.by_name(dtype)
    return dtypes.from_bits(np.frombuffer(data, dt.bits_dtype).copy(), dt, tuple(shape))


@dataclass(frozen=True)
class Prior:
    """Where a tensor last changed: snapshot ``version``'s record (or anchor) of it, and the tensor as it was
    before that record when kept (None: not kept, or a whole copy, before which nothing counts). A record of
    the next snapshot may be coded against it (its grandparent: docs/FORMAT.md, encoding 6)."""

    version: int
    tensor: torch.Tensor | None = None


def grandparent_of(record: Piece, held: torch.Tensor | None, prior: Prior | None) -> torch.Tensor | None:
    """The grandparent of ``record`` (a whole tensor's record) for a reader holding ``held``, the tensor in
    the record's parent snapshot, and ``prior``, where it last changed: the tensor before that change when
    it was in the parent; ``held`` itself when it was earlier (the parent did not change it); None when
    not known."""
    if prior is None or held is None:
        return None
    parent = record.manifest.parent_version
    if prior.version == parent:
        return prior.tensor
    return held if prior.version < parent else None


def rebuild(pieces: Sequence[Piece], values: Sequence, *, base: torch.Tensor | None = None,
            prior: Prior | None = None) -> torch.Tensor:
    """Apply checked payloads in order, starting from ``base`` (a writable CPU tensor, modified
    in place) or from the first piece's whole copy. Each record checks its result digest.
    ``prior``: ``base`` before its last record, for a first record coded against its grandparent."""
    return replay(pieces, values, base=base, prior=prior)[0]


def replay(pieces: Sequence[Piece], values: Sequence, *, base: torch.Tensor | None = None,
           prior: Prior | None = None, keep_prior: bool = False) -> tuple[torch.Tensor, Prior | None]:
    """:func:`rebuild`, and the tensor before the last record applied (with ``keep_prior``, or where a later
    record needs it: a copy of the tensor per such record, which only LoRA runs write). A record that needs a
    grandparent this replay cannot give raises :class:`GrandparentNeededError`."""
    t = base
    for k, (p, v) in enumerate(zip(pieces, values)):
        grand = None
        if p.is_record and p.index is None and v.header.has_parent and v.needs_grandparent:
            grand = grandparent_of(p, t, prior)
            if grand is None:
                raise GrandparentNeededError(f"{p.where()}: the record is coded against the tensor two snapshots "
                                             "back, which this rebuild does not hold")
        nxt = pieces[k + 1] if k + 1 < len(pieces) else None
        keep = (keep_prior and nxt is None) or (nxt is not None and nxt.manifest.parent_version == p.manifest.version
                                                and values[k + 1].header.has_parent
                                                and values[k + 1].needs_grandparent)
        if p.is_record and p.index is None and v.header.has_parent and t is not None and keep:
            before = Prior(p.manifest.version, t.clone())
        else:
            before = Prior(p.manifest.version)      # not needed, or a whole copy (nothing before it counts)
        if not p.is_record:
            t = tensor_from_bytes(v, p.entry.dtype, p.entry.shape)
        elif p.index is not None:
            if t is None:
                raise ParentMismatchError(f"{p.where()}: a piece's record needs the tensor's previous version")
            apply_to_box(t, p.part.offsets, p.part.shape, v)
        elif not v.header.has_parent:
            t = decode(None, v)
        elif t is None:
            raise ParentMismatchError(f"{p.where()}: the record needs the tensor's previous version")
        else:
            h = v.header
            if dtypes.of(t) != h.dtype or tuple(t.shape) != tuple(h.shape):   # said with the record's place
                raise ShapeMismatchError(f"{p.where()}: the record applies to a {h.dtype.name}{list(h.shape)} "
                                         f"tensor, the previous version's is {dtypes.of(t).name}{list(t.shape)}")
            apply_(t, v, grandparent=grand)
        prior = before
    if t is None:
        raise ValueError("rebuild: no pieces")
    return t, prior


def apply_to_box(t: torch.Tensor, offsets: Sequence[int], shape: Sequence[int], enc: EncodedTensor) -> None:
    """Apply a piece's record to its box of ``t`` (a writable CPU tensor): in place where the box is a flat
    range of a contiguous ``t``, else through a copy of the box written back once the record checked out."""
    if t.is_contiguous() and flat_range(offsets, shape, tuple(t.shape)) is not None:
        view = box_view(t, offsets, shape)
        if enc.header.has_parent:
            apply_(view, enc)
        else:
            view.copy_(decode(None, enc))
        return
    view = box_view(t, offsets, shape)
    new = decode(view.contiguous(), enc) if enc.header.has_parent else decode(None, enc)
    view.copy_(new)


def coalesce(items: list[tuple[Piece, int]]) -> list[tuple[str, int, int, list[tuple[Piece, int]]]]:
    """Group pieces of one object into requests: (key, start, end, [(piece, index)]). A request that would start
    within ``FROM_START_BYTES`` of its object's first byte starts at it: a delta object's first record follows
    its 8-byte magic, and a range starting inside an object's first 4 KiB took rclone's ``serve s3`` 24-26 ms
    for a 2 MB object where one from byte 0 or 4096 took 4-8 (docs/PERFORMANCE.md, "LoRA runs, the replica's
    fixed costs"); a few bytes more cost nothing anywhere."""
    by_key: dict[str, list[tuple[Piece, int]]] = {}
    for p, i in items:
        by_key.setdefault(p.obj.key, []).append((p, i))
    out = []
    for key, members in by_key.items():
        members.sort(key=lambda x: (x[0].start, x[0].end))
        cur: list[tuple[Piece, int]] = []
        s = e = 0
        for p, i in members:
            if cur and p.start - e <= COALESCE_GAP and max(e, p.end) - s <= MAX_REQUEST_BYTES:
                cur.append((p, i))
                e = max(e, p.end)
                continue
            if cur:
                out.append((key, s, e, cur))
            cur, s, e = [(p, i)], p.start, p.end
            if s <= FROM_START_BYTES and e <= MAX_REQUEST_BYTES:
                s = 0
        if cur:
            out.append((key, s, e, cur))
    return out


def stored_order(groups: Sequence[Sequence[Piece]]) -> list[int]:
    """The indexes of ``groups`` in the order their bytes lie in the store: by the object and offset of each
    group's first piece. A reader's batches of consecutive groups then cover runs of neighbouring bytes, which
    :func:`coalesce` fetches in a request or two, where groups in name order scatter each batch over every part
    a publisher wrote (a rank-64 LoRA step: 37-40 requests a hot-load, each ~1 ms of the client's CPU, against
    15, and 7 once the batches follow the parts too: :func:`ckptdelta.loader.reader.fetch_batches`;
    docs/PERFORMANCE.md, "LoRA runs, a hot-load's requests").
    For callers that take groups in any order (a hot-load stages each on its own). Groups with no pieces keep
    their places: a hot-load proves each against the live tensor by hashing it, and gathered in one place they
    would all fall to one staging task (its tasks are cut by fetched bytes)."""
    def where(gi: int) -> tuple:
        g = groups[gi]
        # a version's objects in the manifest's order (a publisher's parts in the order it wrote them), not their
        # keys' spelling: "rank-00000.ckd", the first part, sorts after "rank-00000-001.ckd"
        return g[0].manifest.version, g[0]._stored.object, g[0].start

    fetched = iter(sorted((gi for gi, g in enumerate(groups) if g), key=where))
    return [gi if not g else next(fetched) for gi, g in enumerate(groups)]


def object_starts(groups: Sequence[Sequence[Piece]]) -> list[bool]:
    """For :func:`ckptdelta.loader.reader.fetch_batches`: whether each group's first piece lies in another object
    than the first piece of the last group before it that has one (what :func:`stored_order` sorts by: a group of
    several pieces, an anchor's copy and the records after it or a sharded tensor's boxes, would otherwise start
    another object every time)."""
    out, last = [], None
    for g in groups:
        key = g[0].obj.key if g else None
        out.append(key is not None and last is not None and key != last)
        last = key if key is not None else last
    return out


def xxh_hex(data: bytes) -> str:
    """The manifest's spelling of an xxh3-64: 16 lowercase hex digits."""
    return f"{xxhash.xxh3_64_intdigest(data):016x}"
