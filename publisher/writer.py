"""Carrying out a plan: one rank's data objects, serialized to local files and uploaded.

Anchor shards are written one after the other into a temporary directory; each
is handed to an upload thread as soon as it is complete, so serializing shard
i+1 overlaps uploading shard i (at most ``max_pending`` finished shards wait on
local disk). A rank's delta is one or more part objects, each uploading while the
next is encoded (publisher/deltas.py). Everything lands under the
publisher's writer prefix, so nothing written here is visible before the
manifest commits it.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import sys
import threading
import time
from collections.abc import Container, Mapping
from concurrent import futures
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
import xxhash

from ckptdelta.delta import dtypes
from ckptdelta.delta.codec import digest_hex
from ckptdelta.delta.errors import PublishError
from ckptdelta.delta.manifest import (ObjectRef, PieceColumns, TensorEntry, anchor_prefix, delta_prefix, hex_digests,
                                      pieces_digests)
from ckptdelta.delta.storage import Store

from ckptdelta.publisher import anchor as anchor_fmt
from ckptdelta.publisher import deltas as deltas_mod
from ckptdelta.publisher.deltas import rank_object_name, write_delta
from ckptdelta.publisher.tempdirs import locked_tempdir

log = logging.getLogger("ckptdelta.publisher")


@dataclass(eq=False)
class PieceRecords:
    """A rank's pieces of a delta as rank 0 merges them: a row per piece, in the order the plan lists the
    pieced tensors (``tensor``: the tensor's index in ``Layout.pieces``), where rank 0 knows each piece's box
    from the plan. ``object`` indexes the rank's own objects, -1: the piece is unchanged. Columns, not a
    :class:`TensorEntry` each, so rank 0 takes in 256 ranks' pieces of 1,830 tensors as arrays."""

    tensor: np.ndarray      # int64
    xxh3: np.ndarray        # uint64
    object: np.ndarray      # int64
    offset: np.ndarray      # int64
    length: np.ndarray      # int64


@dataclass
class Written:
    """One rank's share of a snapshot; entries index ``objects`` (this rank's list)."""

    objects: list[ObjectRef] = field(default_factory=list)
    entries: dict[str, TensorEntry] = field(default_factory=dict)
    weight_map: dict[str, str] = field(default_factory=dict)   # anchors: tensor -> shard file name
    extra_files: list[ObjectRef] = field(default_factory=list)
    changed: int = 0
    changed_elements: int = 0        # deltas: elements the records changed (publisher/deltas.py)
    changed_nan: list[str] = field(default_factory=list)   # deltas: tensors where a changed element became NaN
    fast_won: list[str] = field(default_factory=list)      # deltas: DeltaPart.fast_won
    codec: str = ""                  # deltas: "context" or "fast" (Publisher(codec=...)); anchors: ""
    codec_reason: str = ""
    encode_threads: int = 0          # deltas: the threads the encode ran on
    encode_s: float = 0.0
    upload_s: float = 0.0
    # a tensor held in pieces (publisher/sharded.py): entries[name] is this rank's piece, boxes[name] its
    # (tensor shape, offsets); an anchor's writer of such a tensor lists it whole in ``assembled``
    boxes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)
    assembled: dict[str, TensorEntry] = field(default_factory=dict)
    pieces: PieceRecords | None = None      # a delta's: its entries of pieces, as rank 0 merges them

    def for_commit(self) -> "Written":
        """This share as it goes to rank 0 for the commit: without its entries of pieces (merge() takes a
        delta's from ``pieces``, an anchor's tensors in pieces whole from their writer's ``assembled``)."""
        if not self.boxes:
            return self
        return replace(self, entries={n: e for n, e in self.entries.items() if n not in self.boxes}, boxes={})


def progress_bar(enabled: bool | None, total: int, desc: str) -> Any:
    """A tqdm bar over bytes, or a stand-in that ignores updates."""
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        return _NoBar()
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024, leave=False)


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


class Uploader:
    """Uploads local files in parallel; remembers the wall time from the first start to the last end."""

    def __init__(self, store: Store, pool: ThreadPoolExecutor, max_pending: int, bar: Any):
        self._store, self._pool, self._bar = store, pool, bar
        self._slots = threading.BoundedSemaphore(max_pending)
        self._futures: list[Future] = []
        self._t0: float | None = None
        self._t1 = 0.0
        self._lock = threading.Lock()

    def submit_file(self, key: str, path: str, size: int) -> None:
        self._slots.acquire()
        self._t0 = self._t0 or time.perf_counter()

        def run() -> None:
            try:
                self._store.put_file(key, path)
                os.unlink(path)
                self._done(size)
            finally:
                self._slots.release()
        self._futures.append(self._pool.submit(run))

    def submit_bytes(self, key: str, data: bytes) -> None:
        self._t0 = self._t0 or time.perf_counter()

        def run() -> None:
            self._store.put(key, data)
            self._done(len(data))
        self._futures.append(self._pool.submit(run))

    def _done(self, n: int) -> None:
        with self._lock:
            self._t1 = time.perf_counter()
            self._bar.update(n)

    def drain(self) -> None:
        """Wait for every upload, ignoring failures (the caller is already failing)."""
        for f in self._futures:
            f.exception()

    def wait(self) -> float:
        """Wait for every upload; the first failure is raised (after all have stopped)."""
        first: BaseException | None = None
        for f in self._futures:
            try:
                f.result()
            except BaseException as e:  # noqa: BLE001 - re-raised below once all uploads are done
                first = first or e
        if first is not None:
            raise first
        return 0.0 if self._t0 is None else max(0.0, self._t1 - self._t0)


def write_anchor(store: Store, pool: ThreadPoolExecutor, snapshot: Mapping[str, torch.Tensor], shards: list[list[str]],
                 *, version: int, writer_id: str, first_shard: int, total_shards: int,
                 extra_files: Mapping[str, bytes], progress: bool | None, file_name: str | None = None) -> Written:
    """This rank's shards (numbered from ``first_shard`` of ``total_shards``) and the extra files.
    ``file_name``: one file of that name holds every tensor (a LoRA anchor's adapter_model.safetensors)."""
    if file_name is not None:
        shards = [[n for s in shards for n in s]]
    prefix = anchor_prefix(version, writer_id)
    out = Written()
    total = sum(t.numel() * t.element_size() for t in snapshot.values()) + sum(len(b) for b in extra_files.values())
    bar = progress_bar(progress, total, f"anchor v{version}")
    up = Uploader(store, pool, max_pending=4, bar=bar)
    try:
        for name, data in extra_files.items():
            key = f"{prefix}/{name}"
            up.submit_bytes(key, data)
            out.extra_files.append(ObjectRef(key, len(data), digest_hex(xxhash.xxh3_64_intdigest(data))))
        with locked_tempdir("anchor") as tmp:
            try:
                for i, names in enumerate(shards):
                    t0 = time.perf_counter()
                    fname = file_name or anchor_fmt.shard_file_name(first_shard + i, total_shards)
                    layout = anchor_fmt.layout_shard(snapshot, names)
                    path = os.path.join(tmp, fname)
                    with open(path, "wb") as f:
                        shard = anchor_fmt.write_shard(f, snapshot, layout)
                    idx = len(out.objects)
                    out.objects.append(ObjectRef(f"{prefix}/{fname}", shard.size, shard.xxh3))
                    for n in names:
                        off, ln = shard.ranges[n]
                        t = snapshot[n]
                        out.entries[n] = TensorEntry(dtypes.of(t).name, tuple(t.shape), shard.digests[n],
                                                     idx, off, ln)
                        out.weight_map[n] = fname
                    out.encode_s += time.perf_counter() - t0  # serialization only; uploads run meanwhile
                    up.submit_file(f"{prefix}/{fname}", path, shard.size)
            except BaseException:
                up.drain()  # no upload may still read the temporary files once they are removed
                raise
            out.upload_s = up.wait()
    finally:
        bar.close()
    # keep state_dict order in the entries (shards may have been laid out by element size)
    out.entries = {n: out.entries[n] for n in snapshot if n in out.entries}
    out.changed = len(out.entries)
    return out


def busy_seconds(spans: list[tuple[float, float]]) -> float:
    """How long at least one of ``spans`` was in progress: the uploads' time, the link's bandwidth's divisor."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


#: Parts of a delta uploading at once: a part's request has a fixed cost (the store's answer, its write) that
#: one part in flight would pay in turn for every part, and a few MB of parts are many.
UPLOADS_IN_FLIGHT = 2


def write_delta_object(store: Store, parent: Mapping[str, torch.Tensor], snapshot: Mapping[str, torch.Tensor], *,
                       version: int, writer_id: str, rank: int, level: int, progress: bool | None,
                       part_bytes: int | None = None, context: bool = True,
                       parent_digests: Mapping[str, int] | None = None,
                       grandparents: Mapping[str, torch.Tensor] | None = None,
                       fast_alone: Container[str] = (), threads: int | None = None,
                       pool: Executor | None = None) -> Written:
    """This rank's delta objects (none when nothing changed); each finished part uploads while the
    next tensors are encoded, at most UPLOADS_IN_FLIGHT at once. ``parent_digests``, ``grandparents``,
    ``fast_alone`` and ``threads`` as in :func:`ckptdelta.publisher.deltas.write_delta`. ``pool``: the
    threads to upload on, kept by the caller from one publish to the next (a Publisher's); else a pool of this
    call's own. A thread started for every delta waits, in ``Thread.start``, until a busy core and the GIL let
    it run (loader/threads.py says how much that was measured to cost)."""
    total = sum(t.numel() * t.element_size() for t in snapshot.values())
    bar = progress_bar(progress, total, f"delta v{version}")
    out = Written()
    uploads: list[Future] = []
    spans: list[tuple[float, float]] = []      # each part's upload, start and end (two may overlap)
    lock = threading.Lock()
    in_flight = threading.BoundedSemaphore(UPLOADS_IN_FLIGHT)
    try:
        with locked_tempdir("delta") as tmp, contextlib.ExitStack() as stack:
            if pool is None:
                pool = stack.enter_context(ThreadPoolExecutor(max_workers=UPLOADS_IN_FLIGHT,
                                                              thread_name_prefix="ckptdelta-delta-upload"))
            else:       # every upload started has ended before the part files go (the pool outlives this call)
                stack.callback(lambda: futures.wait(uploads))

            def path_of(i: int) -> str:
                return os.path.join(tmp, rank_object_name(rank, i))

            def upload(i: int) -> None:
                with in_flight:
                    t0 = time.perf_counter()
                    store.put_file(f"{delta_prefix(version, writer_id)}/{rank_object_name(rank, i)}", path_of(i))
                    with lock:
                        spans.append((t0, time.perf_counter()))

            part = write_delta(lambda i: open(path_of(i), "wb"), parent, snapshot, level=level, context=context,
                               parent_digests=parent_digests, grandparents=grandparents, fast_alone=fast_alone,
                               threads=threads, on_part=lambda i, _size, _h: uploads.append(pool.submit(upload, i)),
                               on_bytes=bar.update,
                               part_bytes=deltas_mod.part_bytes_for(
                                   total, deltas_mod.DEFAULT_PART_BYTES if part_bytes is None else part_bytes))
            for u in uploads:
                u.result()
            out.encode_s = part.encode_s
            out.upload_s = busy_seconds(spans)
            for i, (size, xxh3) in enumerate(part.objects):
                out.objects.append(ObjectRef(f"{delta_prefix(version, writer_id)}/{rank_object_name(rank, i)}",
                                             size, xxh3))
    finally:
        bar.close()
    out.entries = part.entries
    out.changed = len(part.changed)
    out.changed_elements = part.changed_elements
    out.changed_nan = part.changed_nan
    out.fast_won = part.fast_won
    return out


def merge(parts: list[Written], layout: Any = None) -> tuple[list[ObjectRef], dict[str, TensorEntry], dict[str, str],
                                                            list[ObjectRef]]:
    """All ranks' shares as one snapshot: objects concatenated in rank order, entries re-indexed; a tensor
    held in pieces (``layout``: the plan's, publisher/sharded.py) becomes one entry listing them (a delta's,
    from each rank's :class:`PieceRecords`), or its writer's whole entry (an anchor's)."""
    if layout is None and any(p.boxes for p in parts):
        raise ValueError("merge(): entries of pieces are merged by the plan's layout (merge(parts, plan.layout))")
    objects: list[ObjectRef] = []
    entries: dict[str, TensorEntry] = {}
    weight_map: dict[str, str] = {}
    extra: list[ObjectRef] = []
    bases = []
    for p in parts:
        base = len(objects)
        bases.append(base)
        objects.extend(p.objects)
        for n, e in p.entries.items():
            if n not in p.boxes:        # a piece of a tensor in pieces: merged below
                entries[n] = e if e.object is None else replace(e, object=e.object + base)
        for n, e in p.assembled.items():
            entries[n] = replace(e, object=e.object + base)
        weight_map.update(p.weight_map)
        extra.extend(p.extra_files)
    pieced = layout.pieces if layout is not None else {}
    if any(p.pieces is not None for p in parts):
        entries.update(_pieced_entries(parts, bases, pieced, getattr(layout, "cells", None)))
    missing = [n for n in pieced if n not in entries]
    if missing:
        raise PublishError(f"tensor {missing[0]!r} (held in pieces) has no entry from the ranks"
                           + (f" (+{len(missing) - 1} more)" if len(missing) > 1 else ""))
    return objects, entries, weight_map, extra


def _pieced_entries(parts: list[Written], bases: list[int], pieced: Mapping[str, Any],
                    cells: Any = None) -> dict[str, TensorEntry]:
    """Each tensor in pieces as one entry of a delta, from every rank's :class:`PieceRecords`: the values of
    all pieces put in the format's order (tensor by tensor, each tensor's cells in C order) in one array per
    field, then each tensor's columns cut from them. Python work per tensor and per rank, none per piece.
    ``cells``: the pieces' boxes from the plan (``Layout.cells``), when rank 0 has them (else made from the
    grids); a wrong one would give digests the parse-back refuses."""
    names = list(pieced)
    ranks = np.fromiter(itertools.chain.from_iterable(p.ranks for p in pieced.values()), np.int64)
    start = np.cumsum([0] + [len(p.ranks) for p in pieced.values()])
    tensor = np.repeat(np.arange(len(names)), np.diff(start))
    by_rank = np.argsort(ranks, kind="stable")      # each rank's cells, tensor by tensor: the order it sends
    count = np.bincount(ranks, minlength=len(parts))
    recs = [p.pieces if p.pieces is not None else _NO_PIECES for p in parts]
    sent = np.concatenate([r.tensor for r in recs])
    if len(sent) != len(by_rank) or not np.array_equal(sent, tensor[by_rank]):
        for r, (rec, a, b) in enumerate(zip(recs, np.cumsum(count) - count, np.cumsum(count))):
            if not np.array_equal(rec.tensor, tensor[by_rank[a:b]]):
                raise PublishError(f"rank {r} sent entries of {len(rec.tensor)} pieces where the plan gives it "
                                   f"{b - a} pieces of tensors held in pieces")
    xxh3 = np.empty(len(ranks), np.uint64)
    xxh3[by_rank] = np.concatenate([r.xxh3 for r in recs])
    obj = np.concatenate([r.object for r in recs])
    obj = np.where(obj < 0, -1, obj + np.repeat(np.array(bases, np.int64), count))
    where = np.empty(len(ranks), np.int64)
    where[by_rank] = obj
    objs = where.astype(object)
    objs[where < 0] = None
    objs = objs.tolist()
    offset, length = np.empty(len(ranks), np.int64), np.empty(len(ranks), np.int64)
    offset[by_rank] = np.concatenate([r.offset for r in recs])
    length[by_rank] = np.concatenate([r.length for r in recs])
    hexes, offset, length = hex_digests(xxh3), offset.tolist(), length.tolist()     # hexes: 16 digits a piece
    digests = pieces_digests([p.cuts for p in pieced.values()], xxh3, cells)
    out = {}
    for (n, p), a, b, digest in zip(pieced.items(), start[:-1].tolist(), start[1:].tolist(), digests):
        cols = PieceColumns(p.cuts, hexes[16 * a:16 * b], objs[a:b], offset[a:b], length[a:b])
        out[n] = TensorEntry(p.dtype, tuple(p.shape), digest, None, 0, 0, cols)
    return out


_NO_PIECES = PieceRecords(*(np.empty(0, t) for t in (np.int64, np.uint64, np.int64, np.int64, np.int64)))
