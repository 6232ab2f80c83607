"""Check a snapshot's whole chain, reading each stored object once (``SnapshotReader.verify``).

Every object of the chain (anchor shards and index, delta objects, extra files) is
read whole, in order, and hashed against its manifest entry, and the same bytes
rebuild every tensor at every version of the chain, each version's digest checked.
Delta objects are read first and kept (in memory up to ``SPOOL_MEMORY_BYTES``, in
a temporary directory beyond: the anchor policy keeps a chain under about half an
anchor); then each anchor shard streams through once: its safetensors header is
checked against the manifest, and each tensor, as soon as its bytes have passed, is
rebuilt through the deltas and checked. Memory: a read or two plus the tensors
being rebuilt, whatever the model's size.

A version with exact bits attached (``keep_exact``, docs/FORMAT.md "Exact attachments")
has its index checked against its manifest and its objects read and kept like the
deltas (about two bytes an fp32 element); each fp32 tensor is decoded from its record
against the bf16 tensor just proven, every digest checked, as ``read_exact`` does.

Failures keep their order of priority: bytes that do not hash to their object's
digest are reported before what they would mean (a shard's remaining bytes are
hashed even once one of its tensors failed), a shard's header before its tensors.
HEAD is a hint (docs/FORMAT.md): an unreadable one does not stop the check of an
explicit version, whose chain is verified whole; it is then reported on its own
(:class:`HeadPointerError`, the report attached), since ``latest`` fails for every
reader until HEAD is rewritten or deleted. ``latest`` itself needs HEAD.
This module is the reader's own: it reads through the reader's counted accessors.
"""

from __future__ import annotations

import os
import shutil
import struct
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterator

import xxhash

from ckptdelta.delta import untrusted_json
from ckptdelta.delta.pieces import tensor_digest
from ckptdelta.delta.errors import (ChecksumError, CkptDeltaError, ExactBitsMissingError, ManifestError,
                                    ObjectNotFoundError, RunMismatchError)
from ckptdelta.delta.exact import ExactIndex
from ckptdelta.delta.manifest import (HEAD_KEY, MANIFEST_DIR, MAX_MANIFEST_BYTES, Head, Manifest, ObjectRef,
                                      TensorEntry, manifest_key, snapshot_name)

from ckptdelta.loader.exact import attachment_where, exact_tensor, read_index
from ckptdelta.loader.fetch_units import xxh_hex, Piece, Prior, check_piece, check_piece_size, replay, stored_pieces
from ckptdelta.loader.prefetch import in_flight

if TYPE_CHECKING:
    import torch

    from ckptdelta.loader.reader import SnapshotReader

#: Objects are read in requests of this size (verify never holds a whole shard in memory).
@dataclass
class VerifyReport:
    """What :meth:`SnapshotReader.verify` checked."""

    version: int
    snapshot: str
    chain: list[int]
    objects_checked: int
    tensors_checked: int
    bytes_read: int
    seconds: float
    damaged: tuple[str, ...] = ()   # unreadable manifests newer than the version checked (verify of latest)
    #: tensors whose exact bits (a keep_exact run's attachment) were rebuilt and checked; None: none attached
    exact_tensors_checked: int | None = None


class HeadPointerError(ManifestError):
    """The run's HEAD cannot be read (not a head pointer, or one naming another run).

    HEAD is only a hint: an explicit version's chain is verified whole before this is raised, and ``report``
    holds what that check found (every object and digest good); ``latest`` cannot be resolved without HEAD, and
    ``report`` is None. Either way ``latest`` fails for every reader until HEAD is rewritten (the next publish
    does) or deleted (readers then take the newest manifest)."""

    def __init__(self, message: str, report: "VerifyReport | None" = None) -> None:
        super().__init__(message)
        self.report = report


#: How to repair an unreadable HEAD, said by verify.
HEAD_REPAIR = (f"rewrite or delete {HEAD_KEY} (the next publish rewrites it; without it readers take the newest "
               f"manifest under {MANIFEST_DIR}/)")


READ_BYTES = 64 << 20
#: Delta objects kept in memory for the rebuild up to this total; the rest goes to a temporary directory.
SPOOL_MEMORY_BYTES = 64 << 20
#: safetensors' own cap on a file's JSON header.
MAX_SAFETENSORS_HEADER = 100 << 20


def verify(reader: "SnapshotReader", ref: "str | int | None" = None, *,
           progress: bool | None = None) -> "VerifyReport":
    from tqdm import tqdm


    t0 = time.perf_counter()
    before = reader.stats["bytes_fetched"]
    latest = ref is None or ref == "latest"
    _ = reader.run_id                  # RUN.json first: its own failures are not HEAD's
    head, head_error = _head_or_error(reader)
    if head_error is not None and latest:
        raise HeadPointerError(f"{head_error}; 'latest' is found through {HEAD_KEY}, so it cannot be resolved until "
                               f"{HEAD_KEY} is repaired: {HEAD_REPAIR} (an explicit version verifies without it)")
    v = reader.resolve("latest" if ref is None else ref)
    chain = reader.chain(v)
    objects: dict[str, ObjectRef] = {}
    listed_by: dict[str, str] = {}     # object key -> what lists it, as messages name it
    for m in chain:
        key = manifest_key(m.version)
        raw = reader._get(key, max_size=MAX_MANIFEST_BYTES)
        if head is not None and head.version == m.version and xxh_hex(raw) != head.manifest_xxh3:
            raise ChecksumError(f"manifest {reader.store.key_url(key)}: hashes to {xxh_hex(raw)}, "
                                f"the head pointer says {head.manifest_xxh3}")
        if Manifest.from_json(raw, what=f"manifest {reader.store.key_url(key)}", run_id=reader.run_id) != m:
            raise ChecksumError(f"manifest {reader.store.key_url(key)} changed since this reader first read it")
        for o in (*m.objects, *m.extra_files):
            if o.key in objects and objects[o.key] != o:
                raise ManifestError(f"{m.where()}: object {o.key} is listed with a different size or digest "
                                    "by another manifest of the chain")
            objects[o.key] = o
            listed_by.setdefault(o.key, f"the manifest of {m.where()}")
    exact = _exact_index(reader, v)
    exact_where = None if exact is None else attachment_where(reader, v)
    if exact is not None:       # its objects read whole and hashed with the rest, kept for the rebuild
        for o in exact.objects:
            objects[o.key] = o
            listed_by[o.key] = f"the index of the {exact_where}"
    anchor = chain[0]
    shards = [i for i, o in enumerate(anchor.objects) if o.key.endswith(".safetensors")]
    shard_keys = {anchor.objects[i].key for i in shards}
    delta_keys = {o.key for m in chain[1:] for o in m.objects} | {o.key for o in (exact.objects if exact else ())}
    show = sys.stderr.isatty() if progress is None else progress
    checker = _TensorChecker(chain, exact, exact_where)
    with _Spool() as spool, tqdm(total=sum(o.size for o in objects.values()), unit="B", unit_scale=True,
                                 disable=not show, desc=f"verify {snapshot_name(v)}") as bar:
        checker.spool = spool
        for key, o in objects.items():       # everything but the shards: hashed, and the deltas kept
            if key not in shard_keys:
                sink = spool.open(key, o.size) if key in delta_keys else None
                _read_whole(reader, o, listed_by[key], bar, sink)
        for i in shards:
            _stream_shard(reader, anchor, i, bar, checker.check)
        for name in checker.names:           # tensors the shards did not hold (added by a delta)
            if name not in checker.done:
                checker.check(name, None)
    damaged = ()
    if latest:     # latest skipped damaged newer manifests: say which
        damaged = tuple(reader.store.key_url(manifest_key(u)) for u in reader.versions() if u > v)
        for key in damaged:
            _log().warning("verify: manifest %s is unreadable; latest is %s", key, snapshot_name(v))
    report = VerifyReport(v, snapshot_name(v), [m.version for m in chain], len(objects), checker.checked,
                          reader.stats["bytes_fetched"] - before, time.perf_counter() - t0, damaged,
                          None if exact is None else checker.exact_checked)
    if head_error is not None:      # the snapshot is good; the run's head pointer is not
        raise HeadPointerError(f"{head_error}; {snapshot_name(v)} itself verified, but 'latest' fails for every "
                               f"reader until {HEAD_KEY} is repaired: {HEAD_REPAIR}", report)
    return report


def _exact_index(reader: "SnapshotReader", version: int) -> "ExactIndex | None":
    """The version's exact attachment index, checked against its manifest; None where none is attached (a run
    published without keep_exact, or a version whose publisher stopped before attaching)."""
    try:
        return read_index(reader, version)
    except ExactBitsMissingError:
        return None


def _head_or_error(reader: "SnapshotReader") -> "tuple[Head | None, CkptDeltaError | None]":
    """(HEAD, None), (None, None) when there is no HEAD, or (None, why) when HEAD is there but unreadable as this
    run's head pointer. A storage failure is raised: it says nothing about HEAD's bytes."""
    try:
        return reader._head_record(), None
    except (ManifestError, RunMismatchError) as e:
        return None, e


def _log():
    import logging
    return logging.getLogger("ckptdelta.loader")


class _TensorChecker:
    """Rebuild one tensor at every version of the chain from its anchor bytes and the spooled deltas."""

    def __init__(self, chain: list[Manifest], exact: "ExactIndex | None" = None, exact_where: str | None = None) -> None:
        self.chain = chain
        self.names = sorted({n for m in chain for n in m.tensors})
        self.checked = 0
        self.done: set[str] = set()
        self.spool: _Spool | None = None
        self.exact, self.exact_where, self.exact_checked = exact, exact_where, 0

    def check(self, name: str, anchor_data: bytes | None) -> None:
        self.done.add(name)
        t: "torch.Tensor | None" = None
        prior: Prior | None = None
        lora = self.chain[-1].adapter is not None    # records coded against their grandparent: keep it
        for m in self.chain:
            e = m.tensors.get(name)
            if e is None:
                t = prior = None
                continue
            for p in stored_pieces(m, name):      # its data or record, or the records of its changed boxes
                check_piece_size(p)
                if not p.is_record:
                    if anchor_data is None:
                        raise ChecksumError(f"{p.where()}: the shard's stream held no such tensor")
                    value = check_piece(p, anchor_data)
                else:
                    assert self.spool is not None
                    value = check_piece(p, self.spool.read(p.obj.key, p.start, p.end))
                t, prior = replay([p], [value], base=t, prior=prior, keep_prior=lora)
            if t is None or tensor_digest(e.pieces, t) != e.xxh3:   # a pieced tensor: the digest of its boxes
                raise ChecksumError(f"tensor {name!r} of {m.where()}: rebuilt tensor does not match "
                                    f"the manifest digest {e.xxh3}")
            self.checked += 1
        x = None if self.exact is None else self.exact.tensors.get(name)
        if x is not None and x.has_record:       # the version's exact bits, decoded against its proven tensor
            assert self.spool is not None and t is not None and self.exact_where is not None
            o = self.exact.objects[x.object]
            exact_tensor(self.exact, name, self.spool.read(o.key, x.offset, x.offset + x.length), t,
                         self.exact_where)
            self.exact_checked += 1


def _size(reader: "SnapshotReader", o: ObjectRef, lister: str) -> None:
    """``o``'s size in the store checked against ``lister``'s (what lists it: a manifest, an attachment's
    index)."""
    try:
        size = reader.store.size(o.key)
    except ObjectNotFoundError as e:   # a damaged key in the manifest, or a lost object: say which lists it
        raise ObjectNotFoundError(f"object {o.key}, listed by {lister}, is not in the store ({e})") from None
    reader._count(requests=1)
    if size != o.size:
        raise ChecksumError(f"object {o.key}: {size} bytes in the store, {lister} says {o.size}")


def _chunks(reader: "SnapshotReader", o: ObjectRef) -> Iterator[tuple[int, bytes]]:
    """(offset, bytes) of ``o`` in order, the next read in flight while the caller works on this one."""
    spans = [(s, min(o.size, s + READ_BYTES)) for s in range(0, o.size, READ_BYTES)]
    if not spans:
        return

    def get(span: tuple[int, int]) -> bytes:
        data = reader._get(o.key, span)
        if len(data) != span[1] - span[0]:
            raise ChecksumError(f"object {o.key}: read {len(data)} bytes at offset {span[0]}, "
                                f"expected {span[1] - span[0]}")
        return data

    with in_flight() as held:    # on the reader's kept threads, as its own fetches (loader/prefetch.py)
        fut = held.add(reader._threads.submit(get, spans[0]))
        for i, span in enumerate(spans):
            data = fut.result()
            if i + 1 < len(spans):
                fut = held.add(reader._threads.submit(get, spans[i + 1]))
            yield span[0], data


def _hash_mismatch(o: ObjectRef, h: "xxhash.xxh3_64", lister: str) -> ChecksumError | None:
    if h.hexdigest() != o.xxh3:
        return ChecksumError(f"object {o.key}: content hashes to {h.hexdigest()}, {lister} says {o.xxh3}")
    return None


def _read_whole(reader: "SnapshotReader", o: ObjectRef, lister: str, bar, sink: "_Sink | None") -> None:
    _size(reader, o, lister)
    h = xxhash.xxh3_64()
    for _s, data in _chunks(reader, o):
        h.update(data)
        if sink is not None:
            sink.write(data)
        bar.update(len(data))
    if sink is not None:
        sink.close()
    err = _hash_mismatch(o, h, lister)
    if err is not None:
        raise err


def _stream_shard(reader: "SnapshotReader", m: Manifest, index: int, bar,
                  on_tensor: Callable[[str, bytes], None]) -> None:
    """Hash shard ``index`` of anchor ``m`` in one pass; check its header; hand each tensor's bytes on."""
    o = m.objects[index]
    _size(reader, o, f"the manifest of {m.where()}")
    placed = {name: e for name, e in m.tensors.items() if e.object == index}
    problem = _overlaps(m, o, placed)          # a damaged manifest: hash the shard, then say so
    order = _data_order(placed)
    nxt = 0
    active: dict[str, bytearray] = {}
    prefix = bytearray()                      # the 8-byte length, then the JSON header
    header_len: int | None = None
    header_done = False
    failure: CkptDeltaError | None = None
    h = xxhash.xxh3_64()
    for s, data in _chunks(reader, o):
        h.update(data)
        bar.update(len(data))
        e_ = s + len(data)
        while not header_done and len(prefix) < e_:
            want = 8 if header_len is None else 8 + header_len
            pos = len(prefix)
            prefix += data[pos - s: min(want, e_) - s]
            if header_len is None and len(prefix) >= 8:
                (header_len,) = struct.unpack("<Q", bytes(prefix[:8]))
                if header_len > min(o.size - 8, MAX_SAFETENSORS_HEADER):
                    problem = problem or (f"{m.where()}: shard {o.key} declares a {header_len}-byte header in "
                                          f"{o.size} bytes")
                    header_done = True
                elif order and 8 + header_len != placed[order[0]].offset:    # the data starts after the header
                    problem = problem or (f"{m.where()}: shard {o.key} declares a {header_len}-byte header, its "
                                          f"manifest places the first tensor at byte {placed[order[0]].offset}")
                    header_done = True
            elif header_len is not None and len(prefix) >= 8 + header_len:
                header_done = True
                problem = problem or _header_problem(m, o, bytes(prefix[8:]), placed)
                prefix = bytearray()
        if problem is not None or failure is not None or not header_done:
            continue
        # a tensor starts once its first byte is in; an empty one (no bytes) once its offset is reached, also
        # at the shard's very end, where safetensors places the empty tensors laid out last
        while nxt < len(order) and (placed[order[nxt]].offset < e_
                                    or (placed[order[nxt]].length == 0 and placed[order[nxt]].offset == e_)):
            active[order[nxt]] = bytearray()
            nxt += 1
        for name in list(active):
            ent = placed[name]
            buf = active[name]
            lo = ent.offset + len(buf)
            hi = min(ent.offset + ent.length, e_)
            if lo < hi:
                buf += data[lo - s: hi - s]
            if len(buf) == ent.length:
                del active[name]
                try:
                    on_tensor(name, bytes(buf))
                except CkptDeltaError as err:   # reported once the shard's own hash is known
                    failure = err
                    active.clear()
                    break
    err = _hash_mismatch(o, h, f"the manifest of {m.where()}")
    if err is not None:
        raise err
    if not header_done:
        problem = problem or f"{m.where()}: shard {o.key} ends inside its safetensors header ({o.size} bytes)"
    if problem is not None:
        raise ChecksumError(problem)
    if failure is not None:
        raise failure
    if active or nxt < len(order):             # only if the object ended early, which its size check rules out
        raise ChecksumError(f"{m.where()}: shard {o.key} ended before tensor {next(iter(active), order[nxt])!r}")


def _data_order(placed: dict[str, TensorEntry]) -> list[str]:
    """Tensors by where their data lies, an empty one (a zero-element tensor: no bytes) before the tensor that
    starts where it does: safetensors gives it the offset of the next tensor's data, and ordered after that
    tensor (by name, at the same offset) it would seem to start inside it."""
    return sorted(placed, key=lambda n: (placed[n].offset, placed[n].length, n))


def _overlaps(m: Manifest, o: ObjectRef, placed: dict[str, TensorEntry]) -> str | None:
    """The manifest's ranges in a shard must lie inside it without overlapping (as safetensors requires); an
    empty range may start where another starts or ends, not inside it."""
    end, prev = 0, None
    for name in _data_order(placed):
        e = placed[name]
        check_piece_size(Piece(m, name))
        if e.offset < end or e.offset + e.length > o.size:
            return (f"{m.where()}: shard {o.key} does not hold what its manifest says about tensors "
                    f"{prev!r}, {name!r} (ranges overlap or pass the end: a damaged manifest?)")
        end, prev = e.offset + e.length, name
    return None


def _header_problem(m: Manifest, o: ObjectRef, raw: bytes, placed: dict[str, TensorEntry]) -> str | None:
    """Each shard's safetensors header must hold exactly the tensors the manifest places in it, with the same
    names, dtypes, shapes and byte ranges. Digests bind an anchor tensor's bits to its entry; only this binds the
    entry's name (a damaged manifest could otherwise rename a tensor unnoticed). The header is parsed within
    the bounds of any JSON read from a bucket (delta/untrusted_json.py), and every field's type is checked."""
    n = len(raw)
    try:
        header = untrusted_json.loads(raw, what=f"{m.where()}: shard {o.key}: safetensors header",
                                      max_bytes=MAX_SAFETENSORS_HEADER, error=ChecksumError)
    except ChecksumError as e:
        return str(e)
    layout = _layout(header, 8 + n) if isinstance(header, dict) else None
    if layout is None:
        return f"{m.where()}: shard {o.key} has an unreadable safetensors header (not the format's fields)"
    want = {k: (e.dtype, tuple(e.shape), e.offset, e.length) for k, e in placed.items()}
    if layout != want:
        diff = sorted(k for k in set(layout) | set(want) if layout.get(k) != want.get(k))
        return (f"{m.where()}: shard {o.key} does not hold what its manifest says about "
                f"tensors {', '.join(repr(k[:200]) for k in diff[:5])} (a damaged manifest?)")
    return None


def _layout(header: dict, data_start: int) -> dict[str, tuple] | None:
    """name -> (dtype, shape, absolute offset, length) of a parsed safetensors header, or None where a field
    is not of safetensors' types (``__metadata__`` maps strings to strings; offsets are two ascending ints)."""
    meta = header.get("__metadata__", {})
    if not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        return None
    out = {}
    for k, v in header.items():
        if k == "__metadata__":
            continue
        if not isinstance(v, dict) or set(v) != {"dtype", "shape", "data_offsets"}:
            return None
        dt, shape, offsets = v["dtype"], v["shape"], v["data_offsets"]
        if not (isinstance(dt, str) and isinstance(shape, list) and all(_is_count(d) for d in shape)
                and isinstance(offsets, list) and len(offsets) == 2 and all(_is_count(x) for x in offsets)
                and offsets[0] <= offsets[1]):
            return None
        out[k] = (dt, tuple(shape), data_start + offsets[0], offsets[1] - offsets[0])
    return out


def _is_count(x: object) -> bool:
    return type(x) is int and x >= 0


# --- the delta objects, kept for the rebuild -------------------------------------------------------

class _Sink:
    def __init__(self, spool: "_Spool", key: str, size: int) -> None:
        self.spool, self.key = spool, key
        if spool.in_memory + size <= SPOOL_MEMORY_BYTES:
            spool.in_memory += size
            self.buf: bytearray | None = bytearray()
            self.f = None
        else:
            self.buf = None
            self.f = open(os.path.join(spool.directory(), f"{len(spool.files)}.bin"), "wb")

    def write(self, data: bytes) -> None:
        if self.buf is not None:
            self.buf += data
        else:
            self.f.write(data)

    def close(self) -> None:
        if self.buf is not None:
            self.spool.memory[self.key] = bytes(self.buf)
        else:
            self.f.close()
            self.spool.files[self.key] = self.f.name


class _Spool:
    """Objects kept for the rebuild, by key: small ones in memory, the rest in a temporary directory."""

    def __init__(self) -> None:
        self.memory: dict[str, bytes] = {}
        self.files: dict[str, str] = {}
        self.in_memory = 0
        self._dir: str | None = None

    def directory(self) -> str:
        if self._dir is None:
            self._dir = tempfile.mkdtemp(prefix="ckptdelta-verify-")
        return self._dir

    def open(self, key: str, size: int) -> _Sink:
        return _Sink(self, key, size)

    def read(self, key: str, start: int, end: int) -> bytes:
        if key in self.memory:
            return self.memory[key][start:end]
        if key not in self.files:   # a delta's object that is also an anchor shard: a damaged manifest
            raise ManifestError(f"object {key}: a delta record points into it, but it is not a delta object")
        with open(self.files[key], "rb") as f:
            f.seek(start)
            return f.read(end - start)

    def __enter__(self) -> "_Spool":
        return self

    def __exit__(self, *exc: object) -> None:
        self.memory.clear()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
