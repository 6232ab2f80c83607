"""A tensor stored as pieces: boxes of it, each in its own rank's delta object (docs/FORMAT.md, "Pieces").

An FSDP2 trainer holds every parameter split across ranks (a DTensor: ``Shard(0)``
row ranges with an uneven last one, ``Shard(1)`` column ranges, a 2-D mesh's
blocks). Gathering a parameter to encode its delta is the cost sharded trainers
exist to avoid, so each rank encodes the box it holds against the same box of the
parent snapshot, and a manifest lists the tensor as those boxes: a *piece* is a
box (offsets and shape per dimension) whose bits, in C order, are one record.

Nobody holds the whole tensor when it is published, so nobody can compute its
xxh3 (XXH3 is a chain over the bytes in order, not combinable from pieces). The
digest of a pieced tensor is therefore a digest *of its pieces*: xxh3 over each
box and the xxh3 of its bits (:func:`pieces_digest`). The pieces tile the tensor
exactly (:func:`grid_problem`), so a reader that assembles the tensor and finds
every box of it hashing to its piece's digest, and those digests hashing to the
entry's, has proven every bit of the whole tensor (:func:`tensor_digest`).

Pure format arithmetic and small tensor helpers; no I/O.
"""

from __future__ import annotations

import itertools
import math
import struct
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import xxhash

from ckptdelta.delta import dtypes

#: The most pieces one tensor may have (a 2-D mesh of 256 x 256 ranks).
MAX_PIECES = 1 << 16
PIECES_MAGIC = b"CKDPIECE"

Box = tuple[tuple[int, ...], tuple[int, ...]]   # (offsets, shape)


@dataclass(frozen=True)
class PieceEntry:
    """One box of a tensor in a delta: where its record is (``object`` None: the box's bits are the parent's)."""

    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    xxh3: str
    object: int | None
    offset: int = 0
    length: int = 0

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def box(self) -> Box:
        return self.offsets, self.shape

    def describe(self) -> str:
        """The box as slices: '[8:16, 0:20]'."""
        return describe_box(self.offsets, self.shape)


def describe_box(offsets: Sequence[int], shape: Sequence[int]) -> str:
    return "[" + ", ".join(f"{o}:{o + s}" for o, s in zip(offsets, shape)) + "]"


def pieces_digest(pieces: Sequence[PieceEntry] | Sequence[tuple[Sequence[int], Sequence[int], int]]) -> str:
    """The digest of a pieced tensor (FORMAT.md, "Pieces"): XXH3-64 over ``"CKDPIECE"``, u32 ndim, u32 count,
    then per piece in listed order its offsets, its shape and its xxh3, each a u64 (little-endian)."""
    rows = [(p.offsets, p.shape, int(p.xxh3, 16)) if isinstance(p, PieceEntry) else p for p in pieces]
    ndim = len(rows[0][0]) if rows else 0
    h = xxhash.xxh3_64()
    h.update(PIECES_MAGIC + struct.pack("<II", ndim, len(rows)))
    fmt = struct.Struct(f"<{2 * ndim + 1}Q")
    for offsets, shape, digest in rows:
        h.update(fmt.pack(*offsets, *shape, digest))
    return f"{h.intdigest():016x}"


def grid_problem(shape: Sequence[int], boxes: Sequence[Box]) -> str | None:
    """Why ``boxes`` do not tile a tensor of ``shape`` as a grid in the order the format lists them, or None.

    A grid: along each dimension the boxes' edges cut it into intervals, every box is exactly one cell of
    the product of those intervals, and every cell is one box, so the boxes are disjoint and cover the tensor
    (what any DTensor placement gives: each mesh dimension cuts one tensor dimension, for all the others
    alike). Listed in increasing order of offsets (lexicographic: C order of their first elements).
    O(boxes x ndim) with a sort per dimension."""
    ndim = len(shape)
    if ndim == 0:
        return "a scalar cannot be split into pieces"
    if len(boxes) < 2:
        return f"{len(boxes)} piece(s): a pieced tensor has at least 2 (one whole piece is a plain entry)"
    if len(boxes) > MAX_PIECES:
        return f"{len(boxes)} pieces (at most {MAX_PIECES})"
    for offsets, size in boxes:
        if len(offsets) != ndim or len(size) != ndim:
            return f"a piece of {len(offsets)} dimensions in a tensor of {ndim}"
        for d in range(ndim):
            if size[d] < 1 or offsets[d] < 0 or offsets[d] + size[d] > shape[d]:
                return f"piece {describe_box(offsets, size)} is empty or outside the tensor's shape {list(shape)}"
    if any(a[0] >= b[0] for a, b in zip(boxes, boxes[1:])):
        return "pieces are not listed in increasing order of their offsets"
    cuts = grid_cuts(shape, boxes)
    index = [{c: i for i, c in enumerate(cs)} for cs in cuts]
    cells = set()
    for offsets, size in boxes:
        cell = []
        for d in range(ndim):
            i = index[d][offsets[d]]
            if cuts[d][i + 1] != offsets[d] + size[d]:
                return (f"piece {describe_box(offsets, size)} spans several cells of the grid the pieces cut "
                        f"(dimension {d}): the pieces overlap or are not a grid")
            cell.append(i)
        if tuple(cell) in cells:
            return f"piece {describe_box(offsets, size)} is listed twice"
        cells.add(tuple(cell))
    want = 1
    for cs in cuts:
        want *= len(cs) - 1
        if want > len(boxes):
            break
    if want != len(cells):
        return f"{len(boxes)} pieces do not cover the tensor (its grid has {want} cells)"
    return None


def grid_cuts(shape: Sequence[int], boxes: Sequence[Box]) -> list[list[int]]:
    """Per dimension, the edges of ``boxes`` with 0 and the dimension's size, ascending: the grid's cuts (the
    boxes are its cells when :func:`grid_problem` finds nothing wrong with them)."""
    return [sorted({0, shape[d], *(o[d] for o, _ in boxes), *(o[d] + s[d] for o, s in boxes)})
            for d in range(len(shape))]


def cells(cuts: Sequence[Sequence[int]]) -> list[Box]:
    """The boxes of the grid ``cuts`` makes, in C order of their grid coordinates (the format's order)."""
    spans = [[(c[i], c[i + 1] - c[i]) for i in range(len(c) - 1)] for c in cuts]
    return [(tuple(o for o, _ in cell), tuple(n for _, n in cell)) for cell in itertools.product(*spans)]


def flat_range(offsets: Sequence[int], shape: Sequence[int], full: Sequence[int]) -> tuple[int, int] | None:
    """The box's elements as one range ``[start, stop)`` of the tensor flattened in C order, or None when they
    are not contiguous there (a column range). Dim-0 row ranges always are."""
    ndim = len(full)
    d = ndim - 1
    while d >= 0 and shape[d] == full[d]:
        d -= 1
    if any(shape[k] != 1 for k in range(d)):
        return None
    start, stride = 0, 1
    for k in range(ndim - 1, -1, -1):
        start += offsets[k] * stride
        stride *= full[k]
    return start, start + math.prod(shape)


def box_view(t: torch.Tensor, offsets: Sequence[int], shape: Sequence[int]) -> torch.Tensor:
    """The box of ``t`` as a view (contiguous when ``t`` is and the box is a flat range)."""
    r = flat_range(offsets, shape, tuple(t.shape)) if t.is_contiguous() else None
    if r is not None:
        return t.view(-1)[r[0]:r[1]].view(tuple(shape))
    return t[tuple(slice(o, o + s) for o, s in zip(offsets, shape))]


def box_bits(t: torch.Tensor | np.ndarray, offsets: Sequence[int], shape: Sequence[int]) -> np.ndarray:
    """The box's bits in C order (a view where they are contiguous, else a copy)."""
    if isinstance(t, np.ndarray):
        t = torch.from_numpy(np.ascontiguousarray(t))
    return dtypes.host_bits(box_view(t, offsets, shape))


def tensor_digest(pieces: Sequence[PieceEntry], t: torch.Tensor | np.ndarray) -> str:
    """The digest a manifest entry gives ``t``'s bits: their xxh3, or for a pieced entry the digest of the
    xxh3s of its boxes (each box hashed where it lies in ``t``)."""
    if not pieces:
        return f"{xxhash.xxh3_64_intdigest(dtypes.host_bits(t)):016x}"
    return pieces_digest([(p.offsets, p.shape, xxhash.xxh3_64_intdigest(box_bits(t, p.offsets, p.shape)))
                          for p in pieces])
