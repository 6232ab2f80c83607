"""Read any committed snapshot of a run, bit-exact, fetching only the bytes it needs.

A snapshot is its anchor plus the records of every delta since (loader/update_path.py
says which). The reader resolves names to versions, validates manifests and the
chain that links them, and fetches tensor data with byte-range reads batched per
request (a tensor-parallel rank that asks for its own tensors downloads only
those). Nothing fetched is trusted before it is checked: whole objects against
their size and xxh3, an anchor tensor's bytes against its digest, a record by its
header and chunk checksums and, once applied, the digest of the tensor it yields.
"""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
from collections import OrderedDict
from concurrent import futures
from typing import Callable, Iterator, Sequence, TYPE_CHECKING

import torch

from ckptdelta.delta import EncodedTensor, doubling
from ckptdelta.delta.errors import (ChecksumError, CkptDeltaError, DeltaError, ManifestError, ObjectNotFoundError,
                                    ObjectTooLargeError, RunMismatchError, SnapshotNotFoundError)
from ckptdelta.delta.manifest import (HEAD_KEY, MANIFEST_DIR, MAX_HEAD_BYTES, MAX_MANIFEST_BYTES, RUN_KEY, Head,
                                      Manifest, ObjectRef, RunInfo, extra_file_name, manifest_key, snapshot_name,
                                      version_of_manifest_key)
from ckptdelta.delta.storage import Store

from ckptdelta.loader.cache import DiskCache
from ckptdelta.loader.fetch_units import (xxh_hex, Piece, check_assembled, check_piece, check_piece_size, coalesce,
                                         object_starts, replay)
from ckptdelta.loader.update_path import rebuild_pieces
from ckptdelta.loader.prefetch import in_flight
from ckptdelta.loader.threads import Threads

if TYPE_CHECKING:
    from ckptdelta.loader.landing import Landing
    from ckptdelta.loader.verify import VerifyReport

log = logging.getLogger("ckptdelta.loader")

#: Bytes of pieces fetched per batch, at most; one more batch is fetched while the last one decodes.
BATCH_BYTES = 256 << 20
#: The first batch's bytes; each next batch may hold twice as many, up to ``batch_bytes``. Decoding starts
#: once the first batch is in: on a 1 Gbit/s link a first batch of 256 MiB would be ~2 s of waiting
#: before any work, one of 1 MiB is ~9 ms, and the batches after it arrive while earlier ones decode.
#: 1 MiB, the publisher's first part (publisher/deltas.py): a LoRA step of a few MB was one 4 MiB batch,
#: decoded only once all of it had crossed the link (docs/PERFORMANCE.md, "LoRA runs, the replica's fixed
#: costs"); a model's delta of GBs still reaches 256 MiB batches after a few doublings.
FIRST_BATCH_BYTES = 1 << 20
#: A read's batches hold at most 1/TAIL_SHARE of its bytes (at least FIRST_BATCH_BYTES; a batch that finishes a
#: stored object up to twice that, :func:`fetch_batches`): the last batch is decoded only once all of it is in,
#: so doubling alone left up to half of a LoRA step's tens of MB to decode after the link went quiet (a rank-64
#: fp32 step of 48 MB closed on a batch of 17 MB, 70-110 ms of decoding after its fetch; docs/PERFORMANCE.md).
#: The publisher cuts its parts by the same rule.
TAIL_SHARE = 8
#: A reader's kept threads (loader/threads.py): the run's check beside a resolve and one fetch batch in flight
#: per iteration, with room for a few iterations at once (a hot-load and a prefetch of the next version).
READER_THREADS = 4
MAX_CHAIN = 1 << 20
#: Manifests kept in memory (least recently used dropped first); a chain rarely exceeds a few hundred.
MANIFEST_CACHE = 1024


def fetch_batches(sizes: Sequence[int], batch_bytes: int = BATCH_BYTES,
                  starts: Sequence[bool] | None = None) -> list[list[int]]:
    """The groups of a read (their fetched bytes, in order) cut into batches of whole groups: the first of
    about FIRST_BATCH_BYTES, each next one up to twice the last, at most ``batch_bytes`` and 1/TAIL_SHARE of
    the read (FIRST_BATCH_BYTES at least); a group larger than that is a batch of its own.

    ``starts[gi]``: group ``gi``'s bytes begin another stored object than the group before's. A batch then ends
    where an object does once it holds half its limit, and where it reaches its limit inside an object it goes on
    to the object's end if that is within twice its limit (and ``batch_bytes``): a publisher's parts of 1-2.4 MB
    come as a batch and a request each, where cutting by size alone split most of them between two batches, two
    requests (each ~1 ms of an S3 client's CPU and a round trip; docs/PERFORMANCE.md, "LoRA runs, a hot-load's
    requests"). An object larger than that is cut by the limits as before until what is left of it fits: a read
    of one large object starts on a first batch of FIRST_BATCH_BYTES, and its batches hold at most 1/TAIL_SHARE
    of it but for the last, which may take up to twice that (what is left to decode after the last byte)."""
    limits = doubling.limits(FIRST_BATCH_BYTES, doubling.capped(sum(sizes), batch_bytes, FIRST_BATCH_BYTES,
                                                                TAIL_SHARE))
    rest = list(sizes)                 # with starts: the bytes from each group to the end of its object
    if starts is not None:
        for gi in range(len(sizes) - 2, -1, -1):
            if not starts[gi + 1]:
                rest[gi] += rest[gi + 1]
    batches: list[list[int]] = [[]]
    size = 0
    limit = next(limits)
    for gi, n in enumerate(sizes):
        if batches[-1]:
            if starts is None:
                cut = size + n > limit
            elif starts[gi]:
                cut = size + n > limit or 2 * size >= limit
            else:
                cut = size + n > limit and size + rest[gi] > min(2 * limit, batch_bytes)
            if cut:
                batches.append([])
                size = 0
                limit = next(limits)
        batches[-1].append(gi)
        size += n
    return batches


_NAME = re.compile(r"v([0-9]{8,18})", re.ASCII)
_DECIMAL = re.compile(r"[0-9]{1,18}", re.ASCII)

Names = "None | Iterable[str] | Callable[[str], bool]"


class SnapshotReader:
    """One run's snapshots, read-only. Thread-safe; manifests are cached (they never change once committed).

    The cache belongs to the run the reader opened (its RUN.json) and to snapshots
    that still exist: ``resolve(ref, fresh=True)`` (what a replica's hot-load asks)
    re-reads RUN.json and the snapshot's manifest key, so a snapshot gc deleted, or a
    run deleted and published again (a new RUN.json), is SnapshotNotFoundError rather
    than a hot-load planned from manifests that describe objects no longer there."""

    def __init__(self, url: str, *, storage_options: dict | None = None, cache_dir: str | None = None,
                 run_id: str | None = None) -> None:
        self.url = url
        self.store = Store.from_url(url, storage_options)
        self.cache = DiskCache(cache_dir) if cache_dir else None
        self._expected_run_id = run_id
        self._run_id: str | None = None
        self._run_info: RunInfo | None = None
        self._manifests: OrderedDict[int, Manifest] = OrderedDict()
        self._lock = threading.Lock()
        self.stats: dict[str, int] = {"bytes_fetched": 0, "requests": 0, "cache_hits": 0, "bytes_landed": 0}
        self._landing: "Landing | None" = None     # objects of the version a hot-load awaits (:meth:`await_commit`)
        # the run's check beside a resolve, the next batch of a fetch: on threads kept between hot-loads
        # (loader/threads.py), not one started for each
        self._threads = Threads(READER_THREADS, "ckptdelta-reader")

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
            self._run_info, self._run_id = info, info.run_id
        return self._run_id

    def check_run(self) -> None:
        """Raise SnapshotNotFoundError, and drop every cached manifest, if the run this reader opened is no longer
        the one at its URL: RUN.json deleted, or written anew (the run deleted and published again)."""
        rid = self.run_id
        opened = self._run_info
        try:
            data = self._get(RUN_KEY, max_size=MAX_HEAD_BYTES)
        except ObjectNotFoundError:
            self._forget()
            raise SnapshotNotFoundError(f"run {rid!r} at {self.url} is gone ({RUN_KEY} was deleted): its "
                                        "snapshots no longer exist") from None
        info = RunInfo.from_json(data, what=self.store.key_url(RUN_KEY))
        if opened is not None and info != opened:
            self._forget()
            raise SnapshotNotFoundError(
                f"run {rid!r} at {self.url} was deleted and the URL now holds run {info.run_id!r} (created "
                f"{info.created}): the snapshots of run {rid!r} no longer exist; restart on the new run")

    def _forget(self) -> None:
        with self._lock:
            self._manifests.clear()

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

    def resolve(self, ref: "str | int", *, fresh: bool = False) -> int:
        """A version from "latest", a version number, a snapshot name ("v00000042") or a decimal string.

        ``fresh``: also confirm against the store, not the cache, that the run is still the one this reader
        opened (:meth:`check_run`) and that the snapshot's manifest still exists (gc may have deleted it)."""
        if isinstance(ref, bool) or not isinstance(ref, (int, str)):
            raise SnapshotNotFoundError(f"not a snapshot reference: {ref!r}")
        if ref == "latest":
            if fresh:
                self.check_run()
            return self.latest()
        v = self._version_of(ref)
        if fresh:
            self._read_fresh(v)
        else:
            self._manifest(v)
        return v

    def _read_fresh(self, v: int) -> None:
        """Confirm version ``v`` against the store while :meth:`check_run` reads RUN.json beside it: a cached
        manifest by a HEAD (it never changes once committed), one not read before by its GET. A hot-load's
        one round trip, where the run's check, a HEAD of the manifest and its GET took three in turn. A run
        that is gone or another is what is said (check_run drops the cache then); a manifest gc deleted is
        dropped from the cache and said to be gone."""
        _ = self.run_id                     # the run this reader opened, read once before it is checked
        with self._lock:
            cached = v in self._manifests
        errors: list[BaseException] = []
        checked = self._threads.submit(self._check_run_into, errors)
        gone, err = False, None
        try:
            if cached:
                self._count(requests=1)
                gone = not self.store.exists(manifest_key(v))
            else:
                self._manifest(v)
        except SnapshotNotFoundError:
            gone = True
        except CkptDeltaError as e:
            err = e
        finally:
            futures.wait([checked])         # whatever happened here, the run's check is waited for and said first
        if errors:
            if isinstance(errors[0], SnapshotNotFoundError):
                self._forget()              # the run is gone or another: what the read beside it cached is too
            raise errors[0]
        if gone:
            with self._lock:
                self._manifests.pop(v, None)
            raise SnapshotNotFoundError(f"no committed snapshot {snapshot_name(v)} (version {v}) in run "
                                        f"{self.run_id!r} at {self.url}" + (" any more (deleted, by gc?)" if cached
                                                                           else ""))
        if err is not None:
            raise err

    def _check_run_into(self, errors: list) -> None:
        try:
            self.check_run()
        except BaseException as e:  # noqa: BLE001 - handed to the thread that waits for it
            errors.append(e)

    def _version_of(self, ref: "str | int") -> int:
        """The version a reference other than "latest" names (a number, a decimal string or a snapshot name)."""
        if isinstance(ref, str):
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
        return v

    def upcoming(self, ref: "str | int") -> int:
        """The version ``ref`` names if it is newer than every committed one (one a publisher may be writing
        now), else SnapshotNotFoundError: an older version that is not committed never will be."""
        if ref == "latest" or isinstance(ref, bool) or not isinstance(ref, (int, str)):
            raise SnapshotNotFoundError(f"only a version number or name can be awaited, not {str(ref)[:80]!r}")
        v = self._version_of(ref)
        try:
            newest = self.latest()
        except SnapshotNotFoundError:
            newest = -1                            # a run with no snapshot yet: any version may come
        if v <= newest:
            raise SnapshotNotFoundError(f"no committed snapshot {snapshot_name(v)} (version {v}) in run "
                                        f"{self.run_id!r} at {self.url}, and the run is at version {newest} already")
        return v

    def await_commit(self, version: int, timeout_s: float, *,
                     cancelled: "Callable[[], str | None]" = lambda: None) -> float:
        """Wait for ``version``'s manifest, fetching its delta objects as they land (loader/landing.py), which
        the fetches of this version then take instead of reading them again, each checked against the manifest
        first. The seconds waited; HotLoadTimeoutError past ``timeout_s``, HotLoadCancelledError once
        ``cancelled()`` gives a reason."""
        from ckptdelta.loader.landing import Landing, await_commit

        landing = Landing(self.store, version)
        with self._lock:
            self._landing = landing
        def committed() -> bool:
            try:
                self._manifest(version)           # read once it is there: the hot-load plans from it next
                return True
            except SnapshotNotFoundError:
                return False

        try:
            return await_commit(landing, committed, timeout_s, cancelled)
        finally:
            self._count(requests=landing.requests, bytes_fetched=landing.fetched_bytes)

    def drop_landed(self, version: int) -> None:
        """Forget the objects fetched ahead of ``version``'s commit (its hot-load ended)."""
        with self._lock:
            if self._landing is not None and self._landing.version == version:
                self._landing = None

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

    def iter_tensors(self, ref: "str | int", names: Names = None, *, batch_bytes: int = BATCH_BYTES,
                     priors: dict | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) in the order asked (sorted for None/predicates), a batch in memory at a time.
        ``priors``: filled with each tensor's :class:`ckptdelta.loader.fetch_units.Prior` (where it last changed, and a copy of
        its bits before that), what a LoRA replica keeps for records coded against their grandparent."""
        chain = self.chain(ref)
        selected = select_names(chain[-1], names)
        groups = [rebuild_pieces(chain, n) for n in selected]
        with contextlib.closing(self.iter_fetched(groups, batch_bytes=batch_bytes)) as fetched:
            for i, values in fetched:
                t, prior = replay(groups[i], values, keep_prior=priors is not None)
                if priors is not None and prior is not None:
                    priors[selected[i]] = prior
                check_assembled(chain[-1].tensors[selected[i]], t, f"tensor {selected[i]!r} of {chain[-1].where()}")
                yield selected[i], t

    def read_exact(self, ref: "str | int", names: Names = None) -> dict[str, torch.Tensor]:
        """The snapshot's tensors as the trainer held them, for a run published with
        ``Publisher(dtype=torch.bfloat16, keep_exact=True)``: its fp32 tensors rebuilt bit for bit from the bf16
        snapshot and the version's exact attachment (loader/exact.py); ExactBitsMissingError where the version
        has none."""
        from ckptdelta.loader.exact import read_exact
        return read_exact(self, ref, names)

    def extra_files(self, ref: "str | int") -> list[tuple[str, ObjectRef]]:
        """(relative path, object) of the non-weight files (config, tokenizer) that go with a snapshot:
        the snapshot's own, else its anchor's."""
        chain = self.chain(ref)
        refs = chain[-1].extra_files or chain[0].extra_files
        return [(relative_name(r.key), r) for r in refs]

    def read_object(self, obj: ObjectRef, *, use_cache: bool = True) -> bytes:
        """A whole (small) object: size checked before download, xxh3 after."""
        cache = self.cache if use_cache else None
        if cache is not None:
            data = cache.get(obj.xxh3, obj.size, 0, obj.size)
            if data is not None and xxh_hex(data) == obj.xxh3:
                self._count(cache_hits=1)
                return data
        try:
            size = self.store.size(obj.key)
            self._count(requests=1)
            if size != obj.size:
                raise ChecksumError(f"object {obj.key}: {size} bytes in the store, its manifest says {obj.size}")
            data = self._get(obj.key, max_size=obj.size)
            if len(data) != obj.size or xxh_hex(data) != obj.xxh3:
                raise ChecksumError(f"object {obj.key}: content does not match its manifest "
                                    f"({len(data)} bytes hashing to {xxh_hex(data)}, expected {obj.size} / {obj.xxh3})")
        except BaseException:
            if cache is not None:       # the miss's claim: the other replicas of the host stop waiting for it
                cache.release(obj.xxh3, obj.size, 0, obj.size)
            raise
        if cache is not None:
            cache.put(obj.xxh3, obj.size, 0, obj.size, data)
        return data

    # --- whole checkpoints -------------------------------------------------------

    def materialize(self, ref: "str | int", out_dir: str, *, progress: bool | None = None,
                    priors: dict | None = None, exact: bool = False) -> str:
        """Write a HF-style safetensors checkpoint of the snapshot to ``out_dir`` (atomically); ``priors`` as in
        :meth:`iter_tensors`. ``exact``: the trainer's bits, as :meth:`read_exact` gives them (its fp32 tensors
        of a run published with ``keep_exact=True``), the checkpoint it resumes from."""
        from ckptdelta.loader.materialize import write_checkpoint
        return write_checkpoint(self, self.resolve(ref), out_dir, progress=progress, priors=priors, exact=exact)

    def verify(self, ref: "str | int | None" = None, *, progress: bool | None = None) -> "VerifyReport":
        """Check every object and every tensor of every version on the chain (default: latest), reading each
        object once (loader/verify.py); a progress bar with ``progress`` (default: when stderr is a terminal).

        Reads the store directly, never the cache. Raises the first failure
        (:class:`ChecksumError` and friends) naming the object, tensor and snapshot; an unreadable HEAD, once an
        explicit version's chain verified, as :class:`ckptdelta.loader.HeadPointerError` with that report."""
        from ckptdelta.loader.verify import verify
        return verify(self, ref, progress=progress)

    # --- fetching (also used by ckptdelta.loader.hotswap) -----------------------------------

    def fetch(self, pieces: Sequence[Piece], *, use_cache: bool = True,
              counter: dict | None = None) -> list["bytes | EncodedTensor"]:
        """Verified payloads of ``pieces``: an anchor tensor's bytes, or a parsed record.

        Cache hits are checked like fetched bytes; the misses are coalesced per object
        into few range requests, fetched in parallel, checked, then cached."""
        out: list = [None] * len(pieces)
        misses: list[int] = []
        for p in pieces:
            check_piece_size(p)
        cache = self.cache if use_cache else None
        claimed: set[int] = set()     # misses whose claim this call holds until it puts (or gives back) the entry
        try:
            for i, p in enumerate(pieces):
                if p.nbytes == 0:
                    out[i] = check_piece(p, b"")
                    continue
                if cache is not None:
                    data = cache.get(p.obj.xxh3, p.obj.size, p.start, p.end)
                    if data is None:
                        claimed.add(i)
                    else:
                        try:
                            out[i] = check_piece(p, data)
                            self._count(cache_hits=1)
                            continue
                        except DeltaError as e:
                            log.warning("cache entry for %s failed its check (%s); refetching", p.where(), e)
                            cache.discard(p.obj.xxh3, p.obj.size, p.start, p.end)
                misses.append(i)
            return self._fetch_misses(pieces, misses, out, cache, claimed, counter)
        except BaseException:
            # a failed fetch, or a caller that stopped (an interrupt, a generator closed): the other replicas
            # of the host must not wait wait_s for entries this call will never put
            if cache is not None:
                for i in claimed:
                    cache.release(pieces[i].obj.xxh3, pieces[i].obj.size, pieces[i].start, pieces[i].end)
            raise

    def _fetch_misses(self, pieces: Sequence[Piece], misses: list[int], out: list, cache: "DiskCache | None",
                      claimed: set[int], counter: dict | None) -> list["bytes | EncodedTensor"]:
        landing = self._landing
        if landing is not None and misses:
            misses = self._take_landed(landing, pieces, misses, out, cache, claimed)
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
                if cache is not None:
                    cache.put(p.obj.xxh3, p.obj.size, p.start, p.end, chunk)
                    claimed.discard(i)
        if counter is not None:
            counter["bytes"] = counter.get("bytes", 0) + fetched
            counter["requests"] = counter.get("requests", 0) + len(requests)
        return out

    def _take_landed(self, landing: "Landing", pieces: Sequence[Piece], misses: list[int], out: list,
                     cache: "DiskCache | None", claimed: set[int]) -> list[int]:
        """Fill the misses whose object landed before the commit and matches its manifest entry; the rest."""
        left, took = [], 0
        for i in misses:
            p = pieces[i]
            data = landing.take(p.obj)
            if data is None:
                left.append(i)
                continue
            chunk = data[p.start:p.end]
            out[i] = check_piece(p, chunk)
            took += len(chunk)
            if cache is not None:
                cache.put(p.obj.xxh3, p.obj.size, p.start, p.end, chunk)
                claimed.discard(i)
        if took:
            self._count(bytes_landed=took)
        return left

    def iter_fetched(self, groups: Sequence[Sequence[Piece]], *, batch_bytes: int = BATCH_BYTES,
                     use_cache: bool = True, counter: dict | None = None) -> Iterator[tuple[int, list]]:
        """(group index, verified payloads) for each group, fetched in batches with the next batch in
        flight while the caller works on this one, cut by :func:`fetch_batches` (a group is never split).
        ``counter["fetch_s"]`` accumulates the time spent waiting for bytes."""
        for batch in self.iter_fetched_batches(groups, batch_bytes=batch_bytes, use_cache=use_cache,
                                               counter=counter):
            yield from batch

    def iter_fetched_batches(self, groups: Sequence[Sequence[Piece]], *, batch_bytes: int = BATCH_BYTES,
                             use_cache: bool = True, counter: dict | None = None) -> Iterator[list[tuple[int, list]]]:
        """:meth:`iter_fetched`'s groups a fetched batch at a time: a caller that hands work to other threads
        can hand many small groups over at once (one handoff per group costs more than decoding a small
        tensor on a busy host)."""
        starts = object_starts(groups)
        batches = fetch_batches([sum(p.nbytes for p in g) for g in groups], batch_bytes, starts)

        def fetch_batch(b: list[int]) -> list:
            return self.fetch([p for gi in b for p in groups[gi]], use_cache=use_cache, counter=counter)

        if not groups:
            return
        with in_flight() as held:
            fut = held.add(self._threads.submit(fetch_batch, batches[0]))
            for bi, b in enumerate(batches):
                t0 = time.perf_counter()
                try:
                    values = fut.result()
                finally:
                    if counter is not None:
                        counter["fetch_s"] = counter.get("fetch_s", 0.0) + time.perf_counter() - t0
                if bi + 1 < len(batches):
                    fut = held.add(self._threads.submit(fetch_batch, batches[bi + 1]))
                out, k = [], 0
                for gi in b:
                    n = len(groups[gi])
                    out.append((gi, values[k: k + n]))
                    k += n
                yield out

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
        except ObjectTooLargeError as e:      # its bytes, not the storage, are wrong: a damaged HEAD
            raise ManifestError(f"{self.store.key_url(HEAD_KEY)} is not a head pointer: {e}") from None
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


# --- helpers shared with ckptdelta.loader.hotswap and ckptdelta.loader.materialize ----------------------------

def select_names(m: Manifest, names: Names) -> list[str]:
    if names is None:
        return sorted(m.tensors)
    if callable(names):
        out = [n for n in sorted(m.tensors) if names(n)]
        if not out and m.tensors:
            sample = sorted(m.tensors)
            log.warning("%s: the names filter matched none of its %d tensors (they are named like %s)", m.where(),
                        len(sample), ", ".join(repr(n) for n in sample[:: max(1, len(sample) // 3)][:3]))
        return out
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
    return extra_file_name(key)


def _check_link(child: Manifest, parent: Manifest) -> None:
    if child.anchor_version != parent.anchor_version:
        raise ManifestError(f"{child.where()}: anchor {child.anchor_version} but its parent "
                            f"{parent.where()} belongs to anchor {parent.anchor_version}")
    for name, e in child.tensors.items():
        if e.pieces:
            _check_pieces_link(child, parent, name)
            continue
        if e.object is None:
            pe = parent.tensors.get(name)
            if pe is None or (pe.dtype, pe.shape, pe.xxh3) != (e.dtype, e.shape, e.xxh3):
                raise ManifestError(f"{child.where()}: tensor {name!r} is marked unchanged but differs from "
                                    f"(or is absent in) its parent {parent.where()}")


def _check_pieces_link(child: Manifest, parent: Manifest, name: str) -> None:
    """A pieced entry's records are steps from the parent's bits in their boxes: the parent must hold the tensor
    at the same dtype and shape, and a box listed unchanged must carry the parent's digest where the parent
    lists the same boxes (after a whole entry, the assembled tensor's check proves it)."""
    e, pe = child.tensors[name], parent.tensors.get(name)
    if pe is None or (pe.dtype, pe.shape) != (e.dtype, e.shape):
        raise ManifestError(f"{child.where()}: tensor {name!r} is stored in pieces (records against its parent), "
                            f"but its parent {parent.where()} does not hold it as {e.dtype}{list(e.shape)}")
    if [p.box for p in pe.pieces] != [p.box for p in e.pieces]:
        return
    for k, (p, pp) in enumerate(zip(e.pieces, pe.pieces)):
        if p.object is None and p.xxh3 != pp.xxh3:
            raise ManifestError(f"{child.where()}: piece {k} ({p.describe()}) of tensor {name!r} is marked "
                                f"unchanged but its digest differs from its parent {parent.where()}'s")
