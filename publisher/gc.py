"""Retention: keep the last K anchors and every snapshot after the oldest of them, delete the rest.

Manifests go first (newest first, so whatever remains at any moment is a set of
complete chains): once a manifest is gone no reader can resolve its snapshot,
and only then are its data objects deleted. Objects no manifest references are
debris of failed or racing publishes; they are deleted once older than
``grace_seconds``, which is what protects a publish still in flight (its data
exists before its manifest). The temp files of local writes whose writer was
killed mid-write are debris too, under the same grace period (a live writer's
temp file is younger than it). A version's exact attachment (``exact/``, delta/exact.py) goes with its
version, and stays with it. RUN.json and HEAD are never touched, nor anything a
kept snapshot needs (its chain is followed to its anchor), nor the objects of a
manifest that cannot be read (what it references is unknown, so everything
under its version stays).
"""

from __future__ import annotations

import logging
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ckptdelta.delta.errors import CkptDeltaError, SnapshotNotFoundError
from ckptdelta.delta.exact import EXACT_DIR, version_of_key
from ckptdelta.delta.manifest import ANCHOR_DIR, DELTA_DIR, MANIFEST_DIR, RUN_KEY, Manifest, manifest_key
from ckptdelta.delta.storage import Store, is_temp_key

from ckptdelta.publisher.runs import committed_versions, read_manifest, read_run_info

log = logging.getLogger("ckptdelta.publisher.gc")

_DATA_KEY = re.compile(rf"^(?:{ANCHOR_DIR}|{DELTA_DIR})/(\d{{12}})-[^/]+/")


@dataclass(frozen=True)
class GcReport:
    kept_versions: tuple[int, ...]
    deleted_versions: tuple[int, ...]       # manifests deleted (or that would be, with dry_run)
    deleted_objects: tuple[str, ...]        # data objects deleted (or that would be)
    deleted_bytes: int
    young_orphans: tuple[str, ...]          # unreferenced, but within the grace period: kept for now
    dry_run: bool

    def to_dict(self) -> dict[str, Any]:
        return {"kept_versions": list(self.kept_versions), "deleted_versions": list(self.deleted_versions),
                "deleted_objects": list(self.deleted_objects), "deleted_bytes": self.deleted_bytes,
                "young_orphans": list(self.young_orphans), "dry_run": self.dry_run}


def collect(url: str, keep_anchors: int = 2, storage_options: dict[str, Any] | None = None,
            grace_seconds: float = 3600, dry_run: bool = False, *, now: float | None = None) -> GcReport:
    """Apply retention to the run at ``url``; with ``dry_run`` only report what would go."""
    if not (isinstance(keep_anchors, int) and keep_anchors >= 1):
        raise ValueError(f"keep_anchors must be an int >= 1, got {keep_anchors!r}")
    if grace_seconds < 0:
        raise ValueError(f"grace_seconds must be >= 0, got {grace_seconds!r}")
    now = time.time() if now is None else now
    with Store.from_url(url, storage_options) as store:
        return _collect(store, keep_anchors, grace_seconds, dry_run, now)


def _collect(store: Store, keep_anchors: int, grace: float, dry_run: bool, now: float) -> GcReport:
    info = read_run_info(store)
    run_id = info.run_id if info else None
    versions = committed_versions(store)
    if info is None and not versions and not any(  # nothing of a run here: say so rather than "kept 0 snapshots"
            store.list_prefix(f"{d}/", include_temp=True) for d in (ANCHOR_DIR, DELTA_DIR)):
        raise SnapshotNotFoundError(f"no run at {store.url}: {RUN_KEY} does not exist and no snapshot is "
                                    "committed there")
    manifests, unreadable = _read_all(store, versions, run_id)
    kept = _kept_versions(manifests, unreadable, keep_anchors)
    doomed = sorted((v for v in versions if v not in kept), reverse=True)

    referenced: set[str] = set()
    for v in kept:
        if v in manifests:
            referenced.update(o.key for o in manifests[v].objects + manifests[v].extra_files)
    committed_data = {o.key: o.size for v in doomed for o in manifests[v].objects + manifests[v].extra_files}

    to_delete: dict[str, int] = {}
    young: list[str] = []
    gone = set(doomed)
    for key in _own_keys(store):
        if key in referenced:
            continue
        m = _DATA_KEY.match(key)
        if m and int(m.group(1)) in unreadable:
            continue
        if key in committed_data:
            to_delete[key] = committed_data[key]
            continue
        exact = version_of_key(key)
        if exact is not None and exact in kept:      # an attachment lives as long as its version
            continue
        if exact is not None and exact in gone:
            try:
                to_delete[key] = int(store.info(key)["size"])
            except FileNotFoundError:
                pass
            continue
        try:
            meta = store.info(key)
        except FileNotFoundError:
            continue
        mtime = meta.get("mtime")
        old = (not dry_run and grace == 0) if mtime is None else now - mtime >= grace
        if old:
            to_delete[key] = int(meta["size"])
        else:
            young.append(key)

    if not dry_run:
        for v in doomed:  # newest first: what remains is always whole chains
            store.delete([manifest_key(v)])
        store.delete(sorted(to_delete))
    report = GcReport(tuple(sorted(kept)), tuple(sorted(doomed)), tuple(sorted(to_delete)),
                      sum(to_delete.values()), tuple(young), dry_run)
    log.info("gc of %s%s: kept %d snapshots, deleted %d manifests and %d objects (%d bytes); %d young orphans kept",
             store.url, " (dry run)" if dry_run else "", len(report.kept_versions), len(doomed),
             len(to_delete), report.deleted_bytes, len(young))
    return report


def _own_keys(store: Store) -> list[str]:
    """The keys of this run's layout that gc may delete: data objects under anchors/ and deltas/ (a version and
    writer id, then the object), exact attachments under exact/, and the temp files of local writes beside
    them, at the root (HEAD, RUN.json), in manifests/ and in exact/. A run nested under this one's prefix (``runs/a/sub``
    under ``runs/a``) is another run: its keys are never deleted, and on an object store never listed (only
    anchors/, deltas/ and exact/ are)."""
    if store.backend == "local":       # temp files sit beside their final names, also at the root
        keys = store.list_prefix("", include_temp=True)
    else:
        keys = [k for d in (ANCHOR_DIR, DELTA_DIR, EXACT_DIR) for k in store.list_prefix(f"{d}/", include_temp=True)]
    return [k for k in keys if _DATA_KEY.match(k) or version_of_key(k) is not None
            or (is_temp_key(k) and k.rsplit("/", 1)[0] in (k, MANIFEST_DIR, EXACT_DIR))]


def _read_all(store: Store, versions: list[int], run_id: str | None) -> tuple[dict[int, Manifest], set[int]]:
    def one(v: int) -> Manifest | None:
        try:
            return read_manifest(store, v, run_id)
        except CkptDeltaError as e:
            log.warning("gc: cannot read manifest version %d (%s); keeping it and everything under its version", v, e)
            return None

    with ThreadPoolExecutor(min(16, max(1, len(versions))), thread_name_prefix="ckptdelta-gc") as pool:
        read = list(pool.map(one, versions))
    manifests = {v: m for v, m in zip(versions, read) if m is not None}
    return manifests, {v for v, m in zip(versions, read) if m is None}


def _kept_versions(manifests: dict[int, Manifest], unreadable: set[int], keep_anchors: int) -> set[int]:
    anchors = sorted(v for v, m in manifests.items() if m.kind == "anchor")
    all_versions = set(manifests) | unreadable
    if len(anchors) <= keep_anchors:
        return all_versions
    oldest = anchors[-keep_anchors]
    kept = {v for v in all_versions if v >= oldest} | unreadable
    todo = [v for v in kept if v in manifests]
    while todo:  # follow every kept snapshot's chain to its anchor
        m = manifests[todo.pop()]
        for dep in (m.parent_version if m.kind == "delta" else None, m.anchor_version):
            if dep is not None and dep not in kept and dep in all_versions:
                kept.add(dep)
                if dep in manifests:
                    todo.append(dep)
    return kept
