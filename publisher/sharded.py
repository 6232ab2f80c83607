"""Publishing from DTensor state dicts (FSDP2's ``fully_shard``) without gathering a parameter for a delta.

Each rank takes its own box of every DTensor (:func:`split_dtensors`): the local
shard of ``Shard(d)`` placements, an uneven last one included; for ``Replicate``
mesh dimensions, which every rank of that dimension holds whole, the rank's
``torch.chunk`` share of dimension 0, so the replicas share the encoding instead of
all doing it. The publisher then treats the box like any tensor it holds: it copies
it to host memory, keeps it as the next delta's parent, and encodes its record
against the same box of the previous snapshot. Rank 0 learns every rank's boxes
with the tensor schemas (metadata), checks that they tile each tensor
(:func:`plan_union`), and the manifest lists the tensor as pieces
(docs/FORMAT.md, "Pieces"): no bits cross between ranks for a delta.

Anchors stay Hugging Face checkpoints, whole tensors in safetensors shards, so a
tensor in pieces must meet its other pieces once per anchor: the shards of such
tensors are planned by rank 0 and each is written by one rank (the one with the
fewest anchor bytes so far), to which the holders send their pieces point to point,
one tensor at a time, in an order every rank follows (:func:`write_piece_shards`).
A holder sends from its host copy and allocates nothing. The writer streams row
ranges into the file as they arrive (one piece held at a time); a tensor cut along
another dimension than 0 is received whole (its other ranks' pieces: less than one
tensor) and written in C order through a block of at most ``BLOCK_BYTES``. So no rank
holds more than one tensor at a time beyond its own boxes.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import math
import os
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
import xxhash

from ckptdelta.delta import dtypes
from ckptdelta.delta.codec import digest_hex
from ckptdelta.delta.errors import PublishInputError
from ckptdelta.delta.manifest import GridCells, Manifest, ObjectRef, TensorEntry, anchor_prefix
from ckptdelta.delta.pieces import MAX_PIECES, cells, flat_range, grid_problem
from ckptdelta.delta.storage import Store

from ckptdelta.publisher import anchor as anchor_fmt
from ckptdelta.publisher.distributed import Comm
from ckptdelta.publisher.nan import nan_tensor_names
from ckptdelta.publisher.host_copy import Schema
from ckptdelta.publisher.tempdirs import locked_tempdir
from ckptdelta.publisher.writer import PieceRecords, Uploader, Written, progress_bar

log = logging.getLogger("ckptdelta.publisher")

#: A tensor cut along another dimension than 0 is assembled into C order in blocks of rows of at most this size.
BLOCK_BYTES = 64 << 20


@dataclass(frozen=True)
class LocalBox:
    """Where a rank's piece of a DTensor lies: the whole tensor's shape and the piece's offsets in it."""

    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]


#: name -> this rank's box of a DTensor it publishes
Boxes = dict[str, LocalBox]


def is_dtensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and type(value).__name__ == "DTensor"


#: (mesh, placements, global shape) -> where this rank's box of such a DTensor lies (see :func:`_box_of`)
BoxCache = dict[tuple, "_Where"]


@dataclass(frozen=True)
class _Where:
    """This rank's box of every DTensor of one mesh, placements and shape: the local tensor's shape, the rows
    of it the rank publishes (a Replicate share) and the box; ``box`` None: the rank publishes none of it."""

    local_shape: tuple[int, ...]
    rows: tuple[int, int] | None
    box: LocalBox | None
    whole_empty: bool = False


def split_dtensors(sources: Mapping[str, Any], cache: BoxCache | None = None) -> tuple[dict[str, Any], Boxes]:
    """``sources`` with each DTensor replaced by this rank's box of it (a view of its local tensor), and the
    boxes. A rank whose box of a tensor is empty (an uneven last shard; a Replicate split of fewer rows than
    ranks) does not publish that tensor; a tensor of no elements is published whole by one rank.

    ``cache``: boxes already worked out by this rank, kept by the caller from publish to publish (a box
    depends only on the mesh, the placements and the shape; torch's own computation of it, per tensor, adds
    up to a visible share of a step's publish)."""
    out: dict[str, Any] = {}
    boxes: Boxes = {}
    for name, value in sources.items():
        if not is_dtensor(value):
            out[name] = value
            continue
        piece = local_piece(name, value, cache)
        if piece is not None:
            out[name], boxes[name] = piece
    return out, boxes


def local_piece(name: str, dt: Any, cache: BoxCache | None = None) -> tuple[torch.Tensor, LocalBox] | None:
    """This rank's box of the DTensor ``dt`` and a view of its bits (None when the box is empty)."""
    key = (dt.device_mesh, tuple(dt.placements), tuple(int(s) for s in dt.shape))
    where = cache.get(key) if cache is not None else None
    if where is None:
        where = _box_of(name, dt)
        if cache is not None:
            cache[key] = where
    with torch.no_grad():          # to_local() outside no_grad is an autograd call, many times the cost
        local = dt.to_local()
    if tuple(local.shape) != where.local_shape:
        raise PublishInputError(f"tensor {name!r}: the DTensor's local tensor is {list(local.shape)}, its "
                                f"placements {list(dt.placements)} give a shard of {list(where.local_shape)}")
    if where.box is None:
        return None
    if where.whole_empty:
        return torch.empty(where.box.global_shape, dtype=local.dtype), where.box
    if where.rows is not None:
        local = local.narrow(0, where.rows[0], where.rows[1])
    return local, where.box


def _box_of(name: str, dt: Any) -> _Where:
    mesh, placements = dt.device_mesh, dt.placements
    for p in placements:
        if type(p).__name__ == "_StridedShard" or p.is_partial():
            raise PublishInputError(
                f"tensor {name!r} is a DTensor placed as {p}: only Shard(dim) and Replicate placements are "
                "published as pieces; redistribute it to Shard or Replicate (or full_tensor() it) first")
    gshape = tuple(int(s) for s in dt.shape)
    coord = mesh.get_coordinate()
    if coord is None:                      # this rank is not in the tensor's mesh: it holds none of it
        with torch.no_grad():
            return _Where(tuple(dt.to_local().shape), None, None)
    with torch.no_grad():
        chunk = dt.__create_chunk_list__()[0]     # the local shard's box (torch.distributed.checkpoint's own)
    offsets = [int(o) for o in chunk.offsets]
    lshape = [int(s) for s in chunk.sizes]
    local_shape = tuple(lshape)
    if math.prod(gshape) == 0:
        if all(c == 0 for c in coord):
            return _Where(local_shape, None, LocalBox(gshape, (0,) * len(gshape)), whole_empty=True)
        return _Where(local_shape, None, None)
    rows = None
    for md, p in enumerate(placements):   # replicated: this rank's share of dimension 0 (torch.chunk's)
        if not p.is_replicate():
            continue
        k, c = mesh.size(md), coord[md]
        if not gshape:
            if c != 0:
                return _Where(local_shape, None, None)
            continue
        size = -(-lshape[0] // k)
        start = min(c * size, lshape[0])
        stop = min(start + size, lshape[0])
        rows = (start if rows is None else rows[0] + start, stop - start)
        offsets[0] += start
        lshape[0] = stop - start
    if math.prod(lshape) == 0:
        return _Where(local_shape, None, None)
    return _Where(local_shape, rows, LocalBox(gshape, tuple(offsets)))


# --- rank 0: the union of every rank's tensors ---------------------------------------------------------
#
# At 256 ranks a 1T model is ~470,000 pieces (1,830 tensors x 256 ranks). Rank 0 takes them in as columns, one
# array per field over every rank's boxes, and checks and plans them with array operations per tensor: its
# Python work per publish grows with the tensors and the ranks, not with their product (an object per box,
# made, sorted and checked one by one, took a large share of a publish there; benchmarks/sharded.py).

@dataclass(frozen=True, eq=False)
class Holdings:
    """What one rank publishes, as rank 0 plans it (the first round of a publish): the schema of its plain
    tensors, and its DTensor boxes as columns, a name each then one row per box in int64 arrays (``ndim``
    wide, past which they hold 0): the tensor's shape, the box's offsets in it and the box's shape."""

    plain: Schema
    names: tuple[str, ...]
    dtype_names: tuple[str, ...]     # the dtypes among them; ``dtype``: each box's index in this
    dtype: np.ndarray
    ndim: np.ndarray
    global_shape: np.ndarray
    offsets: np.ndarray
    shape: np.ndarray


def holdings(schema: Schema | None, boxes: Boxes | None) -> Holdings:
    """A rank's tensors (``schema``: name -> (dtype, shape), a DTensor's the shape of its box) and its DTensor
    boxes, as rank 0 takes them in."""
    schema, boxes = schema or {}, boxes or {}
    plain: Schema = {}
    names, dts, rows = [], [], []
    for n, (dtype, shape) in schema.items():
        b = boxes.get(n)
        if b is None:
            plain[n] = (dtype, tuple(shape))
            continue
        if not len(b.global_shape) == len(b.offsets) == len(shape):
            raise PublishInputError(f"DTensor {n!r}: a box at {list(b.offsets)} of shape {list(shape)} in a tensor "
                                    f"of shape {list(b.global_shape)}")
        names.append(n)
        dts.append(dtype)
        rows.append((tuple(b.global_shape), tuple(b.offsets), tuple(shape)))
    width = max((len(g) for g, _o, _s in rows), default=0)
    table = np.zeros((3, len(rows), width), np.int64)
    for k, row in enumerate(rows):
        for f, v in enumerate(row):
            table[f, k, :len(v)] = v
    dtype_names = tuple(dict.fromkeys(dts))
    code = {d: i for i, d in enumerate(dtype_names)}
    return Holdings(plain, tuple(names), dtype_names, np.array([code[d] for d in dts], np.int64),
                    np.array([len(g) for g, _o, _s in rows], np.int64), table[0], table[1], table[2])


@dataclass(frozen=True)
class Pieced:
    """A tensor held in pieces: its dtype and shape, the grid its pieces make (per dimension its cuts:
    docs/FORMAT.md, "Pieces") and the rank holding each of the grid's cells, in the format's order."""

    dtype: str
    shape: tuple[int, ...]
    cuts: tuple[tuple[int, ...], ...]
    ranks: tuple[int, ...]

    @property
    def parts(self) -> tuple[tuple[int, tuple[int, ...], tuple[int, ...]], ...]:
        """((rank, offsets, shape), ...): each piece, in the format's order."""
        return tuple((r, o, s) for r, (o, s) in zip(self.ranks, cells(self.cuts)))

    @property
    def dt(self) -> dtypes.DType:
        return dtypes.by_name(self.dtype)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dt.itemsize


@dataclass(frozen=True)
class Layout:
    """Rank 0's plan for the tensors held in pieces, broadcast with the publish plan.

    ``pieces``: name -> :class:`Pieced`; ``shards``: for an anchor, (writing rank, names) of each shard of
    those tensors, in the order every rank gathers them."""

    pieces: dict[str, Pieced] = field(default_factory=dict)
    shards: tuple[tuple[int, tuple[str, ...]], ...] = ()
    #: rank 0's own: every piece's box, as :func:`ckptdelta.delta.manifest.grid_cells` gives them, from the boxes it
    #: planned, for the merge's digests (not sent to the other ranks)
    cells: Any = field(default=None, compare=False, repr=False)

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "cells"}

    def grids(self) -> dict[str, tuple[tuple[int, ...], ...]]:
        """name -> its grid (:attr:`TensorEntry.grid`): what must stay the same for a delta to follow a delta."""
        return {n: p.cuts for n, p in self.pieces.items()}

    def shards_of(self, rank: int) -> list[int]:
        return [i for i, (w, _names) in enumerate(self.shards) if w == rank]


def layout_of(m: Manifest) -> dict[str, tuple[tuple[int, ...], ...]]:
    """The grids of ``m``'s pieced tensors (what :meth:`Layout.grids` gives for a publish)."""
    return {n: e.grid for n, e in m.tensors.items() if e.pieces}


def plan_union(gathered: list[Holdings] | list[tuple[Schema | None, Boxes | None]],
               shard_bytes: int) -> tuple[Schema, Layout]:
    """Every rank's tensors as one snapshot: plain tensors must be held by one rank each, a DTensor's pieces
    must agree on dtype and shape and tile it (one piece covering it all is a plain tensor of its rank).
    Also plans an anchor's shards of pieced tensors, each to the rank with the fewest anchor bytes so far.
    ``gathered``: each rank's :class:`Holdings` (or its schema and boxes)."""
    ranks = [g if isinstance(g, Holdings) else holdings(*g) for g in gathered]
    union: Schema = {}
    owner: dict[str, int] = {}
    for r, h in enumerate(ranks):
        for n, (dtype, shape) in h.plain.items():
            if n in owner:
                raise PublishInputError(f"tensor {n!r} is published by both rank {owner[n]} and rank {r}")
            owner[n], union[n] = r, (dtype, tuple(shape))
    pieces: dict[str, Pieced] = {}
    t = _box_table(ranks)
    if t is not None:
        head = t.start[:-1]                 # each tensor's first row
        dtypes_, first_rank = t.dtype[head].tolist(), t.rank[head].tolist()
        ndims, count = t.ndim[head].tolist(), np.diff(t.start).tolist()
        disagree = np.logical_or.reduceat(t.disagree, head).tolist()
        gshapes = np.stack([g[head] for g in t.global_shape], axis=1).tolist()
        whole = np.logical_and.reduce([s[head] == g[head] for s, g in zip(t.shape, t.global_shape)]).tolist()
        lowest = np.minimum.reduceat(t.rank, head).tolist()
        ranks_of = t.rank.tolist()
        for k, n in enumerate(t.names):
            if n in owner:
                raise PublishInputError(f"tensor {n!r} is a DTensor on rank {lowest[k]} but a plain tensor on rank "
                                        f"{owner[n]}: publish it from one kind of state dict")
            a, b = int(t.start[k]), int(t.start[k + 1])
            if disagree[k]:
                kinds = sorted({(t.dtype_names[int(d)], tuple(g[:int(m)]))
                                for d, g, m in zip(t.dtype[a:b], t.global_shape[:, a:b].T.tolist(), t.ndim[a:b])})
                raise PublishInputError(f"ranks disagree on DTensor {n!r}: " + ", ".join(
                    f"{d}{list(s)}" for d, s in kinds))
            dtype, gshape = t.dtype_names[dtypes_[k]], tuple(gshapes[k][:ndims[k]])
            union[n] = (dtype, gshape)
            if count[k] == 1 and whole[k]:         # one rank holds it all: a plain tensor of that rank
                owner[n] = first_rank[k]
                continue
            cuts = t.grids[k]
            if cuts is None:        # why, in the words of the format's rule (the boxes in the order it lists them)
                nd = ndims[k]
                rows = sorted((tuple(o[:nd]), tuple(s[:nd]), r) for o, s, r in
                              zip(t.offsets[:, a:b].T.tolist(), t.shape[:, a:b].T.tolist(), ranks_of[a:b]))
                problem = grid_problem(gshape, [(o, s) for o, s, _r in rows])
                raise PublishInputError(f"DTensor {n!r}: the ranks' pieces cannot be published: {problem}")
            pieces[n] = Pieced(dtype, gshape, cuts, tuple(ranks_of[a:b]))
    load = [0] * len(ranks)
    for n, r in owner.items():
        d, s = union[n]
        load[r] += math.prod(s) * dtypes.by_name(d).itemsize
    shards = []
    sizes = [(n, p.nbytes) for n, p in pieces.items()]
    nbytes = dict(sizes)
    fewest = [(b, r) for r, b in enumerate(load)]       # the rank with the fewest anchor bytes, then the lowest
    heapq.heapify(fewest)
    for names in anchor_fmt.plan_shards(sizes, shard_bytes):
        b, writer = heapq.heappop(fewest)
        heapq.heappush(fewest, (b + sum(nbytes[n] for n in names), writer))
        shards.append((writer, tuple(names)))
    return union, Layout(pieces, tuple(shards), _cells_of(t, pieces) if pieces else None)


def _cells_of(t: "_Boxes", pieces: dict[str, Pieced]) -> tuple[np.ndarray, list[GridCells]]:
    """The boxes of the tensors in pieces, in the order of ``pieces``, as :func:`ckptdelta.delta.manifest.grid_cells`
    gives them: the table's rows of each such tensor are its grid's cells in C order."""
    where = {n: k for k, n in enumerate(t.names)}
    groups: dict[int, list[int]] = {}
    for i, (n, p) in enumerate(pieces.items()):
        groups.setdefault(len(p.shape), []).append(i)
    ks = np.array([where[n] for n in pieces], np.int64)
    count = t.start[ks + 1] - t.start[ks]
    first = np.concatenate(([0], np.cumsum(count)))
    out = []
    for ndim, which in groups.items():
        w = np.array(which, np.int64)
        c = count[w]
        start = np.concatenate(([0], np.cumsum(c)))
        k = np.arange(int(start[-1])) - np.repeat(start[:-1], c)
        table = np.repeat(t.start[ks[w]], c) + k
        out.append(GridCells(which, start, np.repeat(first[w], c) + k, np.ascontiguousarray(t.offsets[:ndim, table].T),
                             np.ascontiguousarray(t.shape[:ndim, table].T)))
    return first, out


@dataclass
class _Boxes:
    """Every rank's DTensor boxes as one table of rows, sorted by tensor (in the order the ranks first name
    them) then offsets: tensor k's boxes are rows ``start[k]:start[k + 1]``, its name ``names[k]``, and
    ``grids[k]`` the cuts of the grid they make, or None where they make none (:func:`_grids`). The tensor
    shape, offsets and box shape are (width, rows) arrays, a row per dimension (0 past a box's ``ndim``).
    ``disagree``: the row's dtype or tensor shape is not its tensor's first row's."""

    names: list[str]
    dtype_names: list[str]
    rank: np.ndarray
    dtype: np.ndarray
    ndim: np.ndarray
    global_shape: np.ndarray
    offsets: np.ndarray
    shape: np.ndarray
    start: np.ndarray
    disagree: np.ndarray
    grids: list[tuple[tuple[int, ...], ...] | None]


def _box_table(ranks: list[Holdings]) -> _Boxes | None:
    index: dict[str, int] = {}          # tensor name -> its number, in the order the ranks name them
    dtype_code: dict[str, int] = {}
    ids, codes = [], []
    before: tuple[tuple[str, ...], np.ndarray] | None = None
    for h in ranks:
        if before is not None and h.names == before[0]:        # most ranks hold a box of the same tensors
            ids.append(before[1])
        else:
            if None in map(index.get, h.names):
                for n in h.names:
                    index.setdefault(n, len(index))
            ids.append(np.fromiter(map(index.__getitem__, h.names), np.int64, len(h.names)))
            before = (h.names, ids[-1])
        remap = np.array([dtype_code.setdefault(d, len(dtype_code)) for d in h.dtype_names] or [0], np.int64)
        codes.append(remap[h.dtype])
    if not index:
        return None
    width = max(h.offsets.shape[1] for h in ranks)
    tensor = np.concatenate(ids)

    def column(field: str) -> np.ndarray:      # (width, rows): a row per dimension
        out = np.zeros((width, len(tensor)), np.int64)
        at = 0
        for h in ranks:
            a = getattr(h, field)
            out[:a.shape[1], at:at + len(a)] = a.T
            at += len(a)
        return out

    offsets = column("offsets")
    order = np.lexsort([*offsets[::-1], tensor])
    tensor = tensor[order]
    start = np.searchsorted(tensor, np.arange(len(index) + 1))
    first = np.repeat(start[:-1], np.diff(start))
    dtype, ndim = np.concatenate(codes)[order], np.concatenate([h.ndim for h in ranks])[order]
    gshape, offsets, shape = (np.take(c, order, axis=1) for c in (column("global_shape"), offsets, column("shape")))
    disagree = np.logical_or.reduce([dtype != dtype[first], ndim != ndim[first],
                                     *(g != g[first] for g in gshape)])
    rank = np.repeat(np.arange(len(ranks)), [len(h.names) for h in ranks])[order]
    return _Boxes(list(index), list(dtype_code), rank, dtype, ndim, gshape, offsets, shape, start, disagree,
                  _grids(tensor, start, ndim, gshape, offsets, shape, disagree))


def _grids(tensor: np.ndarray, start: np.ndarray, ndim: np.ndarray, gshape: np.ndarray, offsets: np.ndarray,
           shape: np.ndarray, disagree: np.ndarray) -> list[tuple[tuple[int, ...], ...] | None]:
    """Per tensor, the cuts of the grid its boxes (rows ``start[k]:start[k + 1]``, sorted by offsets) are the
    cells of, in C order, or None where they are not exactly that: what :func:`ckptdelta.delta.pieces.grid_problem`
    accepts, decided for every tensor at once with array operations over the rows.

    Along dimension d, a grid's cells whose offsets are 0 in every other dimension (its axis along d) give its
    cuts there: their offsets and the tensor's size. With n_d such cells per dimension, row j of a tensor is
    the cell of coordinates (j // stride_d) % n_d (stride_d the product of n_e for e > d); the boxes are the
    grid's cells in C order exactly when there are prod(n_d) rows, each has its cell's offsets and ends, and
    each axis's cells chain from 0 to the tensor's size."""
    n_tensors, width = len(start) - 1, len(offsets)
    head = start[:-1]
    count = np.diff(start)
    # a dimension past a tensor's ndim counts as one of size 1, in one piece
    real = [ndim > d for d in range(width)]
    ends = [np.where(real[d], offsets[d] + shape[d], 1) for d in range(width)]
    size = [np.where(real[d], gshape[d], 1) for d in range(width)]
    bad = np.logical_or.reduce([disagree, *((real[d] & (shape[d] < 1)) | (offsets[d] < 0) | (ends[d] > size[d])
                                            for d in range(width))])
    ok = (ndim[head] >= 1) & (count >= 2) & (count <= MAX_PIECES) & ~np.logical_or.reduceat(bad, head)
    j = np.arange(len(tensor)) - start[tensor]                       # each row's index in its tensor
    zero = [o == 0 for o in offsets]
    axes, cells = [], np.ones(n_tensors, np.int64)
    for d in range(width):
        on_axis = np.logical_and.reduce([zero[e] for e in range(width) if e != d] or [np.ones(len(tensor), bool)])
        axis = np.flatnonzero(on_axis)
        n = np.bincount(tensor[axis], minlength=n_tensors)
        axes.append((axis, n))
        cells *= n
    ok &= cells == count
    stride = np.ones(n_tensors, np.int64)
    cuts_of = []
    for d in reversed(range(width)):
        axis, n = axes[d]
        n1 = np.maximum(n, 1)
        first = np.concatenate(([0], np.cumsum(n)))[:-1]
        at = first[tensor] + (j // stride[tensor]) % n1[tensor]
        valid = at < len(axis)
        cell = axis[np.where(valid, at, 0)] if len(axis) else np.zeros(len(at), np.int64)
        wrong = ~valid | (offsets[d] != offsets[d][cell]) | (ends[d] != ends[d][cell])
        ok &= ~np.logical_or.reduceat(wrong, head)
        # the axis's cells chain: each ends where the next starts, the first at 0, the last at the size
        t_axis = tensor[axis]
        o, e = offsets[d][axis], ends[d][axis]
        new = np.ones(len(axis), bool)
        new[1:] = t_axis[1:] != t_axis[:-1]
        last = np.ones(len(axis), bool)
        last[:-1] = new[1:]
        broken = (new & (o != 0)) | (last & (e != size[d][axis]))
        broken[1:] |= ~new[1:] & (o[1:] != e[:-1])
        ok &= np.bincount(t_axis[broken], minlength=n_tensors) == 0
        stride *= n1
        cuts_of.append((o.tolist(), first.tolist(), n.tolist()))
    cuts_of.reverse()
    sizes = np.stack([g[head] for g in gshape], axis=1).tolist()
    nds = ndim[head].tolist()
    return [tuple(tuple(o[f[k]:f[k] + n[k]]) + (sizes[k][d],) for d, (o, f, n) in enumerate(cuts_of[:nds[k]]))
            if good else None for k, good in enumerate(ok.tolist())]


# --- what a rank wrote: its pieces as rank 0 merges them --------------------------------------------------

def with_boxes(written: Written, boxes: Boxes, layout: Layout | None) -> Written:
    """Mark which of a rank's entries are pieces of a pieced tensor, and put a delta's in columns for rank 0
    (:class:`~ckptdelta.publisher.writer.PieceRecords`: merge() lists them as the tensors' pieces)."""
    if layout is not None and layout.pieces:
        written.boxes = {n: (boxes[n].global_shape, boxes[n].offsets) for n in written.entries if n in layout.pieces}
        mine = [(k, written.entries[n]) for k, n in enumerate(layout.pieces) if n in written.boxes]
        written.pieces = PieceRecords(
            np.array([k for k, _e in mine], np.int64),
            np.array([int(e.xxh3, 16) for _k, e in mine], np.uint64),
            np.array([-1 if e.object is None else e.object for _k, e in mine], np.int64),
            np.array([e.offset for _k, e in mine], np.int64), np.array([e.length for _k, e in mine], np.int64))
    return written


# --- anchors: each shard of pieced tensors gathered, one tensor at a time, into its writer -----------------

class _Fault:
    """The first local failure of a rank during the piece exchange (``with fault:`` around each local step).

    The exchange is point to point, between status rounds: a rank that left it at its first failure would
    leave the others waiting for pieces it never sends or never receives. So a failed rank goes on with the
    exchange: it still receives every piece sent to it (and drops it) and sends every piece it owes (zeros
    where its own bits cannot be had), skips the local steps that would build on what failed, and raises the
    failure once the exchange is over; the commit round then fails the publish on every rank. A failure of
    the exchange itself (:class:`~ckptdelta.delta.errors.CollectiveError`, raised by the comm's calls, which
    stay outside these blocks) is not caught."""

    def __init__(self) -> None:
        self.error: Exception | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def __enter__(self) -> "_Fault":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        if isinstance(exc, Exception):
            if self.error is None:
                self.error = exc
            return True
        return False


def write_piece_shards(comm: Comm, store: Store, pool: ThreadPoolExecutor, snapshot: Mapping[str, torch.Tensor],
                       boxes: Boxes, layout: Layout, *, version: int, writer_id: str, first_shard: int,
                       total_shards: int, progress: bool | None, failed: BaseException | None = None,
                       context: str = "") -> Written:
    """This rank's part of an anchor's shards of pieced tensors: it sends its pieces of every such tensor to the
    tensor's writer, in the order every rank follows (the shards', then each shard's data order), and writes
    the shards assigned to it (numbered from ``first_shard``) as their tensors arrive. A holder sends from its
    host copy (nothing allocated); ``comm.stats["largest_gather"]``: the most bytes of other ranks' pieces
    this rank held at once.

    A status round comes first, which every rank joins: ``failed`` (this rank's anchor failed before, its
    plain shards) or a failure of its preparation here (the temp dir) fails the publish on every rank there,
    before any piece is sent. A failure during the exchange does not stop this rank's part of it
    (:class:`_Fault`): it is raised once every message has been sent and received, so no rank ever waits for
    a piece from a rank that failed. ``context``: what is being published, for the errors' messages."""
    out = Written()
    mine = layout.shards_of(comm.rank)
    with contextlib.ExitStack() as stack:
        shards: list[anchor_fmt.ShardLayout] = []
        tmp: str | None = None
        bar: Any = progress_bar(False, 0, "")     # none until the preparation below succeeds
        if failed is None:
            try:
                for n in layout.pieces:   # its own pieces: digests (the next delta's parents) and NaNs (the warning)
                    if n in snapshot:
                        t = snapshot[n]
                        out.entries[n] = TensorEntry(dtypes.of(t).name, tuple(t.shape),
                                                     digest_hex(xxhash.xxh3_64_intdigest(dtypes.host_bits(t))), None)
                        out.boxes[n] = (boxes[n].global_shape, boxes[n].offsets)
                out.changed_nan = nan_tensor_names(snapshot, sorted(out.boxes), set())
                shards = [anchor_fmt.layout_shard({n: _meta(layout.pieces[n]) for n in names}, list(names))
                          for _w, names in layout.shards]
                if mine:
                    tmp = stack.enter_context(locked_tempdir("anchor"))
                total = sum(layout.pieces[n].nbytes for i in mine for n in layout.shards[i][1])
                bar = progress_bar(progress, total, f"anchor v{version} (pieces)")
                stack.callback(bar.close)
            except Exception as e:  # noqa: BLE001 - every rank raises it in the round below
                failed = e
        comm.exchange(failed, context=context)
        fault = _Fault()
        up = Uploader(store, pool, max_pending=4, bar=bar)
        prefix = anchor_prefix(version, writer_id)
        tags = itertools.count()        # one tag per tensor, in the order every rank follows
        try:
            for i, ((writer, _names), shard) in enumerate(zip(layout.shards, shards)):
                _one_shard(comm, snapshot, layout, shard, writer, out, up, tmp, prefix,
                           first_shard + mine.index(i) if writer == comm.rank else -1, total_shards, tags, fault)
            if fault.ok:
                with fault:
                    out.upload_s = up.wait()
        finally:
            up.drain()      # no upload may still read the temporary files once they are removed
    if fault.error is not None:
        raise fault.error
    return out


def _one_shard(comm: Comm, snapshot: Mapping[str, torch.Tensor], layout: Layout, shard: "anchor_fmt.ShardLayout",
               writer: int, out: Written, up: Uploader, tmp: str | None, prefix: str, index: int, total: int,
               tags: "itertools.count[int]", fault: _Fault) -> None:
    t0 = time.perf_counter()
    if writer != comm.rank:      # a holder: send each of its pieces when the writer comes to its tensor
        for n in shard.order:
            tag = next(tags)
            if n in snapshot:
                comm.send_bytes(_own_bits(snapshot[n], fault), writer, tag)
        return
    assert tmp is not None
    fname = anchor_fmt.shard_file_name(index, total)
    path = os.path.join(tmp, fname)
    f = None
    whole = xxhash.xxh3_64()
    if fault.ok:
        with fault:
            f = open(path, "wb")
    try:
        if f is not None:
            with fault:
                f.write(shard.header)
                whole.update(shard.header)
        for n in shard.order:
            tag = next(tags)
            p = layout.pieces[n]
            h = xxhash.xxh3_64()
            for block in _c_order(comm, p, snapshot.get(n), tag, out, fault):   # every piece, even after a fault
                if f is not None and fault.ok:
                    with fault:
                        f.write(block)
                        whole.update(block)
                        h.update(block)
            if fault.ok:
                off, ln = shard.ranges[n]
                out.assembled[n] = TensorEntry(p.dtype, p.shape, digest_hex(h.intdigest()), len(out.objects), off,
                                               ln)
                out.weight_map[n] = fname
    finally:
        if f is not None:
            with fault:
                f.close()       # the last bytes reach the file here: a full disk may say so only now
    if fault.ok:
        with fault:
            out.objects.append(ObjectRef(f"{prefix}/{fname}", shard.size, digest_hex(whole.intdigest())))
            out.encode_s += time.perf_counter() - t0
            up.submit_file(f"{prefix}/{fname}", path, shard.size)


def _meta(p: Pieced) -> torch.Tensor:
    return torch.empty(p.shape, dtype=p.dt.torch_dtype, device="meta")


def _own_bits(t: torch.Tensor, fault: _Fault) -> np.ndarray:
    """This rank's piece as bytes to send; zeros of its size where they cannot be had (``fault`` keeps why,
    and the publish fails: those zeros are never committed)."""
    if fault.ok:
        with fault:
            return np.ascontiguousarray(dtypes.host_bits(t))
    return np.zeros(t.numel() * t.element_size(), np.uint8)


def _c_order(comm: Comm, p: Pieced, own: torch.Tensor | None, tag: int, out: Written, fault: _Fault):
    """The tensor's bytes in C order, from its pieces as they arrive (each piece's bits in its box's C order).

    Row ranges (any box that is a flat range of the tensor) follow each other in C order: each piece is
    written as it arrives, one piece held at a time. Otherwise every piece of the tensor is received first,
    then blocks of rows of at most ``BLOCK_BYTES`` are assembled from them. Every other rank's piece is
    received even after ``fault`` holds a failure (nothing is yielded then)."""
    dt = p.dt

    def piece(r: int, s: tuple[int, ...]) -> np.ndarray:
        if r == comm.rank:
            assert own is not None
            return _own_bits(own, fault).view(dt.bits_dtype)
        return comm.recv_bytes(math.prod(s) * dt.itemsize, r, tag).view(dt.bits_dtype)

    if all(flat_range(o, s, p.shape) is not None for _r, o, s in p.parts):
        for r, _o, s in p.parts:
            if r == comm.rank and not fault.ok:
                continue
            bits = piece(r, s)
            if r != comm.rank:
                _held(comm, bits.nbytes)
            if fault.ok:
                yield memoryview(bits.view(np.uint8))
            del bits
        return
    pieces = [(r, o, s, piece(r, s)) for r, o, s in p.parts]
    if not fault.ok:
        return
    _held(comm, sum(a.nbytes for r, _o, _s, a in pieces if r != comm.rank))
    shape = p.shape
    row = math.prod(shape[1:]) * dt.itemsize
    step = max(1, BLOCK_BYTES // max(1, row))
    for r0 in range(0, shape[0], step):
        r1 = min(shape[0], r0 + step)
        block = None
        with fault:
            block = np.empty((r1 - r0, *shape[1:]), dt.bits_dtype)
            for _r, o, s, a in pieces:
                lo, hi = max(r0, o[0]), min(r1, o[0] + s[0])
                if lo >= hi:
                    continue
                dst = (slice(lo - r0, hi - r0), *(slice(x, x + n) for x, n in zip(o[1:], s[1:])))
                block[dst] = a.reshape(s)[lo - o[0]: hi - o[0]]
        if block is None or not fault.ok:
            return
        yield memoryview(block.reshape(-1).view(np.uint8))


def _held(comm: Comm, nbytes: int) -> None:
    comm.stats["largest_gather"] = max(comm.stats["largest_gather"], nbytes)


def combine(a: Written, b: Written) -> Written:
    """Two shares of one rank's anchor (its plain shards, its shards of pieced tensors) as one."""
    base = len(a.objects)
    a.objects.extend(b.objects)
    a.entries.update(b.entries)
    a.boxes.update(b.boxes)
    a.assembled.update({n: replace(e, object=e.object + base) for n, e in b.assembled.items()})
    a.weight_map.update(b.weight_map)
    a.changed_nan = [*a.changed_nan, *b.changed_nan]
    a.encode_s += b.encode_s
    a.upload_s = max(a.upload_s, b.upload_s)
    return a
