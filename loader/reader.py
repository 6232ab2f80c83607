"""Read any committed snapshot of a run, bit-exact, fetching only the bytes it needs.

A snapshot is its anchor plus the records of every delta since (loader/plan.py
says which). The reader resolves names to versions, validates manifests and the
chain that links them, and fetches tensor data with byte-range reads batched per
request (a tensor-parallel rank that asks for its own tensors downloads only
those). Nothing fetched is trusted before it is checked: whole objects against
their size and xxh3, an anchor tensor's bytes against its digest, a record by its
header and chunk checksums and, once applied, the digest of the tensor it yields.
"""

from __future__ import annotations

import json
import logging
import re
import struct
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Sequence

import torch
import xxhash

from delta import EncodedTensor, digest, digest_hex
from delta.errors import (ChecksumError, DeltaError, ManifestError, ObjectNotFoundError, RunMismatchError,
                          SnapshotNotFoundError)
from delta.manifest import (ANCHOR_DIR, DELTA_DIR, HEAD_KEY, MANIFEST_DIR, MAX_HEAD_BYTES, MAX_MANIFEST_BYTES,
                            RUN_KEY, Head, Manifest, ObjectRef, RunInfo, TensorEntry, manifest_key, snapshot_name,
                            version_of_manifest_key)
from delta.storage import Store

from .cache import DiskCache
from .pieces import Piece, check_piece, check_piece_size, coalesce, rebuild
from .plan import rebuild_pieces

log = logging.getLogger("ckptdelta.loader")

#: Bytes of pieces fetched per batch; one more batch is fetched while the last one decodes.
BATCH_BYTES = 256 << 20
#: Whole objects are hashed in reads of this size (verify never holds a shard in memory).
VERIFY_READ_BYTES = 64 << 20
MAX_CHAIN = 1 << 20
#: safetensors' own cap on a file's JSON header.
MAX_SAFETENSORS_HEADER = 100 << 20
#: Manifests kept in memory (least recently used dropped first); a chain rarely exceeds a few hundred.
MANIFEST_CACHE = 1024

_NAME = re.compile(r"v([0-9]{8,18})", re.ASCII)
_DECIMAL = re.compile(r"[0-9]{1,18}", re.ASCII)

Names = "None | Iterable[str] | Callable[[str], bool]"


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


class SnapshotReader:
    """One run's snapshots, read-only. Thread-safe; manifests are cached (they never change once committed)."""

    def __init__(self, url: str, *, storage_options: dict | None = None, cache_dir: str | None = None,
                 run_id: str | None = None) -> None:
        self.url = url
        self.store = Store.from_url(url, storage_options)
        self.cache = DiskCache(cache_dir) if cache_dir else None
        self._expected_run_id = run_id
        self._run_id: str | None = None
        self._manifests: OrderedDict[int, Manifest] = OrderedDict()
        self._lock = threading.Lock()
        self.stats: dict[str, int] = {"bytes_fetched": 0, "requests": 0, "cache_hits": 0}

    def __repr__(self) -> str:
        return f"SnapshotReader({self.url!r})"

    # --- run, versions, names ---------------------------------------------------

    @property
    def run_id(self) -> str:
        """From RUN.json, read on first use (so a reader can exist before the first publish)."""
        if self._run_id is None:
            try:
                data = self._get(RUN_KEY, max_size=MAX_HEAD_BYTES)
            except ObjectNotFoundError:
                raise SnapshotNotFoundError(f"no run at {self.url}: {RUN_KEY} does not exist") from None
            info = RunInfo.from_json(data, what=self.store.key_url(RUN_KEY))
            if self._expected_run_id is not None and info.run_id != self._expected_run_id:
                raise RunMismatchError(f"{self.url} holds run {info.run_id!r}, expected run {self._expected_run_id!r}")
            self._run_id = info.run_id
        return self._run_id

    def versions(self) -> list[int]:
        """Committed versions, ascending (a manifest is the commit)."""
        _ = self.run_id
        keys = self.store.list_prefix(f"{MANIFEST_DIR}/")
        self._count(requests=1)
        return sorted(v for v in map(version_of_manifest_key, keys) if v is not None)

    def latest(self) -> int:
        """The newest committed version: the head hint, then any manifests written after it."""
        _ = self.run_id
        head = self._head()
        if head is None or not self._manifest_exists(head):
            vs = self.versions()
            if not vs:
                raise SnapshotNotFoundError(f"run {self.run_id!r} at {self.url} has no committed snapshot yet")
            return self._last_readable(vs[-1])
        v = head
        while self._manifest_exists(v + 1):
            v += 1
        return self._last_readable(v)

    def _last_readable(self, v: int) -> int:
        """``v``, or the newest committed version below it whose manifest can be read: a damaged newest
        manifest (create-only, so it stays) must not make ``latest`` fail for every replica. Logged;
        ``verify`` and ``ckptdelta ls`` still report it."""
        try:
            self._manifest(v)
            return v
        except ManifestError as e:
            damaged = e
        older = [u for u in self.versions() if u < v]
        for u in reversed(older):
            try:
                self._manifest(u)
            except ManifestError:
                continue
            log.warning("run %s at %s: the newest manifest (version %d) is unreadable (%s); latest is version %d",
                        self.run_id, self.url, v, damaged, u)
            return u
        raise damaged

    def resolve(self, ref: "str | int") -> int:
        """A version from "latest", a version number, a snapshot name ("v00000042") or a decimal string."""
        if isinstance(ref, bool) or not isinstance(ref, (int, str)):
            raise SnapshotNotFoundError(f"not a snapshot reference: {ref!r}")
        if isinstance(ref, str):
            if ref == "latest":
                return self.latest()
            m = _NAME.fullmatch(ref)
            if m:
                v = int(m.group(1))
            elif _DECIMAL.fullmatch(ref):
                v = int(ref)
            else:
                raise SnapshotNotFoundError(f"no snapshot named {ref[:80]!r} in {self.url} "
                                            "(expected 'latest', a version number or a name like v00000042)")
        else:
            v = ref
        if not 0 <= v < 1 << 62:
            raise SnapshotNotFoundError(f"no snapshot with version {v} in {self.url}")
        self._manifest(v)
        return v

    def manifest(self, ref: "str | int") -> Manifest:
        return self._manifest(self.resolve(ref))

    def chain(self, ref: "str | int") -> list[Manifest]:
        """Manifests from the snapshot's anchor to the snapshot, each link checked."""
        m = self.manifest(ref)
        out = [m]
        while m.kind != "anchor":
            if len(out) > MAX_CHAIN:
                raise ManifestError(f"{out[0].where()}: delta chain longer than {MAX_CHAIN}")
            try:
                parent = self._manifest(m.parent_version)
            except SnapshotNotFoundError:
                raise ManifestError(f"{m.where()}: its parent version {m.parent_version} is not committed") from None
            _check_link(m, parent)
            out.append(parent)
            m = parent
        if m.version != out[0].anchor_version:
            raise ManifestError(f"{out[0].where()}: names anchor {out[0].anchor_version}, "
                                f"its chain ends at anchor {m.version}")
        return out[::-1]

    # --- tensors ---------------------------------------------------------------

    def read_tensor(self, ref: "str | int", name: str) -> torch.Tensor:
        return self.read_tensors(ref, [name])[name]

    def read_tensors(self, ref: "str | int", names: Names = None) -> dict[str, torch.Tensor]:
        """Tensors of a snapshot (all, a list, or those a predicate selects), on CPU, bit-exact."""
        return dict(self.iter_tensors(ref, names))

    def iter_tensors(self, ref: "str | int", names: Names = None, *,
                     batch_bytes: int = BATCH_BYTES) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) in the order asked (sorted for None/predicates), a batch in memory at a time."""
        chain = self.chain(ref)
        selected = select_names(chain[-1], names)
        groups = [rebuild_pieces(chain, n) for n in selected]
        for i, values in self.iter_fetched(groups, batch_bytes=batch_bytes):
            yield selected[i], rebuild(groups[i], values)

    def extra_files(self, ref: "str | int") -> list[tuple[str, ObjectRef]]:
        """(relative path, object) of the non-weight files (config, tokenizer) that go with a snapshot:
        the snapshot's own, else its anchor's."""
        chain = self.chain(ref)
        refs = chain[-1].extra_files or chain[0].extra_files
        return [(relative_name(r.key), r) for r in refs]

    def read_object(self, obj: ObjectRef, *, use_cache: bool = True) -> bytes:
        """A whole (small) object: size checked before download, xxh3 after."""
        if use_cache and self.cache is not None:
            data = self.cache.get(obj.xxh3, obj.size, 0, obj.size)
            if data is not None and _xxh(data) == obj.xxh3:
                self._count(cache_hits=1)
                return data
        size = self.store.size(obj.key)
        self._count(requests=1)
        if size != obj.size:
            raise ChecksumError(f"object {obj.key}: {size} bytes in the store, its manifest says {obj.size}")
        data = self._get(obj.key, max_size=obj.size)
        if len(data) != obj.size or _xxh(data) != obj.xxh3:
            raise ChecksumError(f"object {obj.key}: content does not match its manifest "
                                f"({len(data)} bytes hashing to {_xxh(data)}, expected {obj.size} / {obj.xxh3})")
        if use_cache and self.cache is not None:
            self.cache.put(obj.xxh3, obj.size, 0, obj.size, data)
        return data

    # --- whole checkpoints -------------------------------------------------------

    def materialize(self, ref: "str | int", out_dir: str, *, progress: bool | None = None) -> str:
        """Write a HF-style safetensors checkpoint of the snapshot to ``out_dir`` (atomically)."""
        from .materialize import write_checkpoint
        return write_checkpoint(self, self.resolve(ref), out_dir, progress=progress)

    def verify(self, ref: "str | int | None" = None) -> VerifyReport:
        """Check every object and every tensor of every version on the chain (default: latest).

        Reads the store directly, never the cache. Raises the first failure
        (:class:`ChecksumError` and friends) naming the object, tensor and snapshot."""
        t0 = time.perf_counter()
        before = self.stats["bytes_fetched"]
        v = self.resolve("latest" if ref is None else ref)
        chain = self.chain(v)
        head = self._head_record()
        objects: dict[str, ObjectRef] = {}
        listed_by: dict[str, Manifest] = {}
        for m in chain:
            key = manifest_key(m.version)
            raw = self._get(key, max_size=MAX_MANIFEST_BYTES)
            if head is not None and head.version == m.version and _xxh(raw) != head.manifest_xxh3:
                raise ChecksumError(f"manifest {self.store.key_url(key)}: hashes to {_xxh(raw)}, "
                                    f"the head pointer says {head.manifest_xxh3}")
            if Manifest.from_json(raw, what=f"manifest {self.store.key_url(key)}", run_id=self.run_id) != m:
                raise ChecksumError(f"manifest {self.store.key_url(key)} changed since this reader first read it")
            for o in (*m.objects, *m.extra_files):
                if o.key in objects and objects[o.key] != o:
                    raise ManifestError(f"{m.where()}: object {o.key} is listed with a different size or digest "
                                        "by another manifest of the chain")
                objects[o.key] = o
                listed_by.setdefault(o.key, m)
        for o in objects.values():
            self._verify_object(o, listed_by[o.key])
        for m in chain:
            if m.kind == "anchor":
                self._verify_anchor_names(m)
        n_tensors = self._verify_tensors(chain)
        damaged = ()
        if ref is None or ref == "latest":     # latest skipped damaged newer manifests: say which
            damaged = tuple(self.store.key_url(manifest_key(u)) for u in self.versions() if u > v)
            for key in damaged:
                log.warning("verify: manifest %s is unreadable; latest is %s", key, snapshot_name(v))
        return VerifyReport(v, snapshot_name(v), [m.version for m in chain], len(objects), n_tensors,
                            self.stats["bytes_fetched"] - before, time.perf_counter() - t0, damaged)

    # --- fetching (also used by loader.hotswap) -----------------------------------

    def fetch(self, pieces: Sequence[Piece], *, use_cache: bool = True,
              counter: dict | None = None) -> list["bytes | EncodedTensor"]:
        """Verified payloads of ``pieces``: an anchor tensor's bytes, or a parsed record.

        Cache hits are checked like fetched bytes; the misses are coalesced per object
        into few range requests, fetched in parallel, checked, then cached."""
        out: list = [None] * len(pieces)
        misses = []
        for p in pieces:
            check_piece_size(p)
        for i, p in enumerate(pieces):
            if p.nbytes == 0:
                out[i] = check_piece(p, b"")
                continue
            if use_cache and self.cache is not None:
                data = self.cache.get(p.obj.xxh3, p.obj.size, p.start, p.end)
                if data is not None:
                    try:
                        out[i] = check_piece(p, data)
                        self._count(cache_hits=1)
                        continue
                    except DeltaError as e:
                        log.warning("cache entry for %s failed its check (%s); refetching", p.where(), e)
                        self.cache.discard(p.obj.xxh3, p.obj.size, p.start, p.end)
            misses.append(i)
        requests = coalesce([(pieces[i], i) for i in misses])
        try:
            datas = self._get_many([(key, (s, e)) for key, s, e, _members in requests])
        except ObjectNotFoundError as e:   # a manifest names an object the store lacks: say which entry
            wanted = next((members[0][0] for key, _s, _e, members in requests if key == getattr(e, "key", None)),
                          None)
            if wanted is None:
                raise
            raise ObjectNotFoundError(f"{wanted.where()}: the object is not in the store ({e})") from None
        fetched = 0
        for (key, s, e, members), data in zip(requests, datas):
            fetched += len(data)
            for p, i in members:
                chunk = data[p.start - s: p.end - s]
                try:
                    out[i] = check_piece(p, chunk)
                except DeltaError:
                    # the bytes or the manifest that describes them is damaged: if it is the (cached)
                    # manifest, keeping it would fail this version forever, even once it is repaired
                    with self._lock:
                        self._manifests.pop(p.manifest.version, None)
                    raise
                if use_cache and self.cache is not None:
                    self.cache.put(p.obj.xxh3, p.obj.size, p.start, p.end, chunk)
        if counter is not None:
            counter["bytes"] = counter.get("bytes", 0) + fetched
            counter["requests"] = counter.get("requests", 0) + len(requests)
        return out

    def iter_fetched(self, groups: Sequence[Sequence[Piece]], *, batch_bytes: int = BATCH_BYTES,
                     use_cache: bool = True, counter: dict | None = None) -> Iterator[tuple[int, list]]:
        """(group index, verified payloads) for each group, fetched in batches of about
        ``batch_bytes`` with the next batch in flight while the caller works on this one.
        ``counter["fetch_s"]`` accumulates the time spent waiting for bytes."""
        batches: list[list[int]] = [[]]
        size = 0
        for gi, g in enumerate(groups):
            n = sum(p.nbytes for p in g)
            if batches[-1] and size + n > batch_bytes:
                batches.append([])
                size = 0
            batches[-1].append(gi)
            size += n

        def fetch_batch(b: list[int]) -> list:
            return self.fetch([p for gi in b for p in groups[gi]], use_cache=use_cache, counter=counter)

        if not groups:
            return
        with ThreadPoolExecutor(1, thread_name_prefix="ckptdelta-prefetch") as ex:
            fut = ex.submit(fetch_batch, batches[0])
            for bi, b in enumerate(batches):
                t0 = time.perf_counter()
                try:
                    values = fut.result()
                finally:
                    if counter is not None:
                        counter["fetch_s"] = counter.get("fetch_s", 0.0) + time.perf_counter() - t0
                if bi + 1 < len(batches):
                    fut = ex.submit(fetch_batch, batches[bi + 1])
                k = 0
                for gi in b:
                    n = len(groups[gi])
                    yield gi, values[k: k + n]
                    k += n

    # --- internals -----------------------------------------------------------------

    def _count(self, **kw: int) -> None:
        with self._lock:
            for k, v in kw.items():
                self.stats[k] += v

    def _get(self, key: str, byte_range: tuple[int, int] | None = None, *, max_size: int | None = None) -> bytes:
        data = self.store.get(key, byte_range, max_size=max_size)
        self._count(bytes_fetched=len(data), requests=1)
        return data

    def _get_many(self, items: list[tuple[str, tuple[int, int]]]) -> list[bytes]:
        if not items:
            return []
        datas = self.store.get_many(items)
        self._count(bytes_fetched=sum(len(d) for d in datas), requests=len(items))
        return datas

    def _head_record(self) -> Head | None:
        try:
            data = self._get(HEAD_KEY, max_size=MAX_HEAD_BYTES)
        except ObjectNotFoundError:
            return None
        head = Head.from_json(data, what=self.store.key_url(HEAD_KEY))
        if head.run_id != self.run_id:
            raise RunMismatchError(f"{self.store.key_url(HEAD_KEY)} names run {head.run_id!r}, "
                                   f"this run is {self.run_id!r}")
        return head

    def _head(self) -> int | None:
        head = self._head_record()
        return None if head is None else head.version

    def _manifest_exists(self, v: int) -> bool:
        with self._lock:
            if v in self._manifests:
                return True
        self._count(requests=1)
        return self.store.exists(manifest_key(v))

    def _manifest(self, v: int) -> Manifest:
        with self._lock:
            m = self._manifests.get(v)
            if m is not None:
                self._manifests.move_to_end(v)
                return m
        run_id = self.run_id
        key = manifest_key(v)
        try:
            data = self._get(key, max_size=MAX_MANIFEST_BYTES)
        except ObjectNotFoundError:
            raise SnapshotNotFoundError(f"no committed snapshot {snapshot_name(v)} (version {v}) "
                                        f"in run {run_id!r} at {self.url}") from None
        m = Manifest.from_json(data, what=f"manifest {self.store.key_url(key)}", run_id=run_id)
        if m.version != v:
            raise ManifestError(f"manifest {self.store.key_url(key)} describes version {m.version}, not {v}")
        with self._lock:
            self._manifests[v] = m
            while len(self._manifests) > MANIFEST_CACHE:
                self._manifests.popitem(last=False)
        return m

    def _verify_object(self, o: ObjectRef, m: Manifest) -> None:
        try:
            size = self.store.size(o.key)
        except ObjectNotFoundError as e:   # a damaged key in the manifest, or a lost object: say which lists it
            raise ObjectNotFoundError(f"object {o.key}, listed by {m.where()}, is not in the store ({e})") from None
        self._count(requests=1)
        if size != o.size:
            raise ChecksumError(f"object {o.key}: {size} bytes in the store, its manifest says {o.size}")
        h = xxhash.xxh3_64()
        for s in range(0, o.size, VERIFY_READ_BYTES):
            e = min(o.size, s + VERIFY_READ_BYTES)
            data = self._get(o.key, (s, e))
            if len(data) != e - s:
                raise ChecksumError(f"object {o.key}: read {len(data)} bytes at offset {s}, expected {e - s}")
            h.update(data)
        if h.hexdigest() != o.xxh3:
            raise ChecksumError(f"object {o.key}: content hashes to {h.hexdigest()}, its manifest says {o.xxh3}")

    def _verify_anchor_names(self, m: Manifest) -> None:
        """Each shard's safetensors header must hold exactly the tensors the manifest places in it, with the
        same names, dtypes, shapes and byte ranges. Digests bind an anchor tensor's bits to its entry;
        only this binds the entry's name (a damaged manifest could otherwise rename a tensor unnoticed).
        Runs after the shard's own xxh3 was checked, so the header is the published one."""
        placed: dict[int, dict[str, TensorEntry]] = {}
        for name, e in m.tensors.items():
            placed.setdefault(e.object, {})[name] = e
        for i, o in enumerate(m.objects):
            if not o.key.endswith(".safetensors"):
                continue  # the shard index
            (n,) = struct.unpack("<Q", self._get(o.key, (0, 8)).ljust(8, b"\xff"))
            if n > min(o.size - 8, MAX_SAFETENSORS_HEADER):
                raise ChecksumError(f"{m.where()}: shard {o.key} declares a {n}-byte header in {o.size} bytes")
            try:
                header = json.loads(self._get(o.key, (8, 8 + n)))
                layout = {k: (v["dtype"], tuple(v["shape"]), 8 + n + v["data_offsets"][0],
                              v["data_offsets"][1] - v["data_offsets"][0])
                          for k, v in header.items() if k != "__metadata__"}
            except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
                raise ChecksumError(f"{m.where()}: shard {o.key} has an unreadable safetensors header ({e})") from None
            want = {k: (e.dtype, tuple(e.shape), e.offset, e.length) for k, e in placed.get(i, {}).items()}
            if layout != want:
                diff = sorted(k for k in set(layout) | set(want) if layout.get(k) != want.get(k))
                raise ChecksumError(f"{m.where()}: shard {o.key} does not hold what its manifest says about "
                                    f"tensors {', '.join(map(repr, diff[:5]))} (a damaged manifest?)")

    def _verify_tensors(self, chain: list[Manifest]) -> int:
        """Rebuild every tensor at every version of the chain, checking each version's digest."""
        names = sorted({n for m in chain for n in m.tensors})
        groups = []
        for n in names:
            groups.append([Piece(m, n) for m in chain if n in m.tensors and m.tensors[n].object is not None])
        checked = 0
        for gi, values in self.iter_fetched(groups, use_cache=False):
            name = names[gi]
            by_version = {p.manifest.version: v for p, v in zip(groups[gi], values)}
            t: torch.Tensor | None = None
            for m in chain:
                e = m.tensors.get(name)
                if e is None:
                    t = None
                    continue
                if e.object is not None:
                    t = rebuild([Piece(m, name)], [by_version[m.version]], base=t)
                if t is None or digest_hex(digest(t)) != e.xxh3:
                    raise ChecksumError(f"tensor {name!r} of {m.where()}: rebuilt tensor does not match "
                                        f"the manifest digest {e.xxh3}")
                checked += 1
        return checked


# --- helpers shared with loader.hotswap and loader.materialize ----------------------------

def select_names(m: Manifest, names: Names) -> list[str]:
    if names is None:
        return sorted(m.tensors)
    if callable(names):
        return [n for n in sorted(m.tensors) if names(n)]
    if isinstance(names, str):
        names = [names]
    out = list(dict.fromkeys(names))
    missing = [n for n in out if n not in m.tensors]
    if missing:
        raise SnapshotNotFoundError(f"{m.where()} has no tensor named {', '.join(map(repr, missing[:10]))}"
                                    + (f" (and {len(missing) - 10} more)" if len(missing) > 10 else ""))
    return out


def relative_name(key: str) -> str:
    """Path of an anchor/delta file relative to its version's prefix (``anchors/<v>-<writer>/x/y`` -> ``x/y``)."""
    parts = key.split("/")
    if len(parts) >= 3 and parts[0] in (ANCHOR_DIR, DELTA_DIR):
        return "/".join(parts[2:])
    return parts[-1]


def _check_link(child: Manifest, parent: Manifest) -> None:
    if child.anchor_version != parent.anchor_version:
        raise ManifestError(f"{child.where()}: anchor {child.anchor_version} but its parent "
                            f"{parent.where()} belongs to anchor {parent.anchor_version}")
    for name, e in child.tensors.items():
        if e.object is None:
            pe = parent.tensors.get(name)
            if pe is None or (pe.dtype, pe.shape, pe.xxh3) != (e.dtype, e.shape, e.xxh3):
                raise ManifestError(f"{child.where()}: tensor {name!r} is marked unchanged but differs from "
                                    f"(or is absent in) its parent {parent.where()}")


def _xxh(data: bytes) -> str:
    return f"{xxhash.xxh3_64_intdigest(data):016x}"
