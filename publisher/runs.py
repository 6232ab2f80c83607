"""A run in its bucket, seen from the publisher: RUN.json, the committed manifests, the commit.

Manifests are the truth about what is committed (HEAD is a hint that may lag),
so "latest" is found by listing ``manifests/``. The commit is the create-only
write of the manifest: it either makes the whole snapshot visible or fails
because another publisher got there first, in which case nothing of ours is
visible and the data we uploaded under our writer id is debris for gc.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import xxhash

from ckptdelta.delta.codec import digest_hex
from ckptdelta.delta.errors import (CkptDeltaError, ConcurrentPublisherError, ManifestError, ObjectExistsError,
                                    ObjectNotFoundError, RunMismatchError, StorageError)
from ckptdelta.delta.manifest import (HEAD_KEY, MANIFEST_DIR, MAX_HEAD_BYTES, MAX_MANIFEST_BYTES, RUN_KEY, Head,
                                      Manifest, RunInfo, manifest_key, now_iso, version_of_manifest_key)
from ckptdelta.delta.storage import Store

log = logging.getLogger("ckptdelta.publisher")


def new_writer_id() -> str:
    """16 random hex digits: the prefix under which one publisher session writes its data."""
    return secrets.token_hex(8)


def read_run_info(store: Store) -> RunInfo | None:
    try:
        data = store.get(RUN_KEY, max_size=MAX_HEAD_BYTES)
    except ObjectNotFoundError:
        return None
    return RunInfo.from_json(data, what=store.key_url(RUN_KEY))


def ensure_run_info(store: Store, run_id: str) -> RunInfo:
    """Create RUN.json (create-only); if someone else created it first, theirs stands."""
    info = RunInfo(run_id, now_iso())
    try:
        store.put_if_absent(RUN_KEY, info.to_json())
        return info
    except ObjectExistsError:
        existing = read_run_info(store)
        assert existing is not None
        if existing.run_id != run_id:
            raise RunMismatchError(f"{store.key_url(RUN_KEY)} names run {existing.run_id!r}; this publisher "
                                   f"is publishing run {run_id!r}") from None
        return existing


def committed_versions(store: Store) -> list[int]:
    """Every committed version, ascending (from the listing, never from HEAD)."""
    out = []
    for key in store.list_prefix(MANIFEST_DIR + "/"):
        v = version_of_manifest_key(key)
        if v is not None:
            out.append(v)
    return sorted(out)


def read_manifest(store: Store, version: int, run_id: str | None) -> Manifest:
    key = manifest_key(version)
    data = store.get(key, max_size=MAX_MANIFEST_BYTES)
    m = Manifest.from_json(data, what=store.key_url(key), run_id=run_id)
    if m.version != version:
        raise ManifestError(f"{store.key_url(key)}: holds version {m.version}, not {version}")
    return m


def read_manifests(store: Store, versions: Iterable[int], run_id: str | None) -> list[Manifest]:
    """Several manifests, fetched in parallel, in the order asked."""
    versions = list(versions)
    if len(versions) <= 1:
        return [read_manifest(store, v, run_id) for v in versions]
    with ThreadPoolExecutor(min(16, len(versions)), thread_name_prefix="ckptdelta-manifests") as pool:
        return list(pool.map(lambda v: read_manifest(store, v, run_id), versions))


def commit(store: Store, manifest: Manifest, data: bytes | None = None) -> str:
    """Make ``manifest`` visible (the commit point). Returns the manifest's xxh3, which :func:`move_head`
    writes into HEAD after it.

    ``data``: ``manifest.to_json()`` when the caller has it already (it parsed it back first)."""
    data = manifest.to_json() if data is None else data
    key = manifest_key(manifest.version)
    try:
        store.put_if_absent(key, data)
    except ObjectExistsError:
        if _holds(store, key, data):
            # Our create landed and its answer was lost, then a retry below the Store (aiohttp
            # resends an idempotent PUT once when a kept-alive connection drops) found it. The
            # manifest names this session's writer id and creation time: those bytes are ours.
            log.warning("%s: the create answered 'exists' but the manifest holds this publisher's bytes "
                        "(a lost answer to our own commit); committed", store.key_url(key))
        else:
            raise ConcurrentPublisherError(
                f"run {manifest.run_id} at {store.url}: snapshot {manifest.name} (version {manifest.version}) was "
                "committed by another publisher while this one was publishing it; refusing to fork the run "
                "(one publisher per run; a new Publisher on this URL continues after the latest snapshot)") from None
    except StorageError as e:
        # Every try failed, yet one may have landed with its answer lost: then the snapshot is
        # committed, and saying otherwise would make the next publish find "its" version taken.
        try:
            ours = _holds(store, key, data)
        except CkptDeltaError:
            ours = False
        if not ours:
            raise StorageError(f"{store.key_url(key)}: the commit of snapshot {manifest.name} (version "
                               f"{manifest.version}) failed, and whether it landed could not be read back: {e}; the "
                               "next publish of this Publisher looks, and goes on after it if it did") from e
        log.warning("%s: the create failed, but the manifest holds this publisher's bytes (an answer was "
                    "lost); committed", store.key_url(key))
    return digest_hex(xxhash.xxh3_64_intdigest(data))


def move_head(store: Store, manifest: Manifest, h: str) -> None:
    """Point HEAD at ``manifest`` (committed, its xxh3 ``h``). Best effort: the snapshot is committed without
    it, and a reader whose HEAD lags finds the newer manifests after it (one existence check each), so a
    failure is logged, never raised."""
    try:
        store.put(HEAD_KEY, Head(manifest.run_id, manifest.version, h).to_json())
    except Exception as e:  # the commit happened; a stale HEAD only costs readers a look or two
        log.warning("committed %s but could not update %s: %s", manifest.where(), store.key_url(HEAD_KEY), e)


def _holds(store: Store, key: str, data: bytes) -> bool:
    """Whether ``key`` holds exactly ``data`` (an object of another size is not even downloaded)."""
    try:
        return store.size(key) == len(data) and store.get(key, max_size=len(data)) == data
    except ObjectNotFoundError:
        return False


def committed_manifest(store: Store, version: int, run_id: str) -> Manifest | None:
    """``version``'s manifest where it is committed, else None (one existence check)."""
    if not store.exists(manifest_key(version)):
        return None
    return read_manifest(store, version, run_id)
