"""``ckptdelta inspect``: what is inside a delta object, or inside one snapshot of a run.

``inspect FILE.ckd`` reads a delta object on the local filesystem, without a
manifest. ``inspect URL SNAPSHOT`` reads the snapshot's manifest from the run's
bucket (any store the other commands reach: ``--storage-options``) and, for a
delta, each of its delta objects (whole, checked against the manifest's size
and xxh3): every changed tensor's dtype, shape, chunk encodings and stored size,
and how many tensors are unchanged. An anchor's tensors are listed from the
manifest alone (its safetensors shards are not downloaded).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from ckptdelta.delta import container, record
from ckptdelta.delta.codec import EncodedTensor
from ckptdelta.delta.errors import ObjectNotFoundError, StorageError

from ckptdelta.cli.console import guarded, plural
from ckptdelta.cli.options import add_storage_args, storage_options


def add_commands(sub: "argparse._SubParsersAction") -> None:
    p = sub.add_parser("inspect", help="describe a delta object (.ckd) file, or a snapshot of a run",
                       usage="ckptdelta inspect [options] FILE.ckd | URL SNAPSHOT",
                       description="Describe a delta object file, or every delta object of a run's snapshot: each "
                                   "tensor's dtype, shape, chunk encodings and encoded size. Every checksum is "
                                   "verified.")
    p.add_argument("path", metavar="FILE.ckd | URL",
                   help="a .ckd delta object on the local filesystem, or a run's URL (then give SNAPSHOT)")
    p.add_argument("snapshot", nargs="?", metavar="SNAPSHOT",
                   help="with a run's URL: 'latest', a version or a name like v00000042")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_storage_args(p)
    p.set_defaults(func=guarded(run, "inspect"))


def describe(data: bytes | memoryview, off: int, length: int, name: str, what: str) -> dict[str, Any]:
    """One record's row: dtype, shape, sizes and chunk encodings (its checksums verified)."""
    enc = EncodedTensor.from_bytes(memoryview(data)[off: off + length], what=f"{what} tensor {name!r}")
    h = enc.header
    return {"name": name, "dtype": h.dtype.name, "shape": list(h.shape), "encoded_bytes": length,
            "full_bytes": h.numel * h.dtype.itemsize, "chunks": enc.encoding_counts(), "has_parent": h.has_parent}


def run(args: argparse.Namespace) -> int:
    if args.snapshot is not None:
        return run_snapshot(args)
    what = f"delta object {os.path.basename(args.path)}"
    try:
        with open(args.path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        hint = " (a run's URL takes a SNAPSHOT too: ckptdelta inspect URL latest)" if "://" in args.path else ""
        raise ObjectNotFoundError(f"{what}: no such file {args.path}{hint}") from None
    except OSError as e:     # a directory, no permission...: one line, not a traceback
        hint = " (a run: ckptdelta inspect URL SNAPSHOT)" if os.path.isdir(args.path) else ""
        raise StorageError(f"{what}: cannot read {args.path}: {e.strerror or e}{hint}") from None
    if data[:8] != container.OBJECT_MAGIC:
        raise record.FormatError(f"{what}: not a ckptdelta delta object (bad magic)")
    index = container.read_index(data, len(data), what=what)
    rows = [describe(data, off, length, name, what)
            for name, (off, length) in sorted(index.items(), key=lambda kv: kv[1][0])]
    if args.json:
        print(json.dumps({"object": args.path, "size": len(data), "tensors": rows}))
        return 0
    print(_table(rows))
    return 0


def run_snapshot(args: argparse.Namespace) -> int:
    from ckptdelta.loader.reader import SnapshotReader

    reader = SnapshotReader(args.path, storage_options=storage_options(args))
    try:
        m = reader.manifest(args.snapshot)
        rows: list[dict[str, Any]] = []
        unchanged = 0
        by_object: dict[int, list[tuple[str, Any]]] = {}
        for name, t in m.tensors.items():
            # a tensor published in pieces (docs/FORMAT.md, "Pieces"): a row per box that has a record
            stored = [(f"{name} {p.describe()}", p) for p in t.pieces if p.object is not None] if t.pieces \
                else [(name, t)] if t.object is not None else []
            if not stored:
                unchanged += 1
            for n, e in stored:
                by_object.setdefault(e.object, []).append((n, e))
        for i, entries in sorted(by_object.items()):
            obj = m.objects[i]
            if m.kind == "anchor":       # safetensors shards: the manifest says all there is to list
                rows += [{"name": n, "dtype": t.dtype, "shape": list(t.shape), "encoded_bytes": t.length,
                          "full_bytes": t.nbytes, "chunks": {"anchor": 1}, "has_parent": False, "object": obj.key}
                         for n, t in entries]
                continue
            data = reader.read_object(obj, use_cache=False)
            what = f"delta object {obj.key} of {m.where()}"
            rows += [{**describe(data, t.offset, t.length, n, what), "object": obj.key} for n, t in entries]
    finally:
        reader.store.close()
    rows.sort(key=lambda r: (r["object"], r["name"]))
    head = {"snapshot": m.name, "version": m.version, "run_id": m.run_id, "kind": m.kind,
            "parent_version": m.parent_version, "anchor_version": m.anchor_version, "step": m.step,
            "created": m.created, "objects": [{"key": o.key, "size": o.size} for o in m.objects],
            "full_bytes": m.full_bytes, "stored_bytes": m.stored_bytes, "unchanged_tensors": unchanged}
    if args.json:
        print(json.dumps({**head, "tensors": rows}))
        return 0
    parent = f", parent v{m.parent_version}" if m.parent_version is not None else ""
    print(f"{m.where()}: {m.kind}{parent}, anchor v{m.anchor_version}, step {m.step}, created {m.created}")
    print(f"{plural(len(m.objects), 'object')}, {plural(m.stored_bytes, 'byte')} stored for "
          f"{plural(m.full_bytes, 'byte')} of weights; {plural(len(rows), 'tensor')} stored, {unchanged} unchanged")
    if rows:
        print(_table(rows))
    return 0


def _table(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'tensor':<48} {'dtype':<8} {'shape':<18} {'bytes':>10} {'ratio':>8}  chunks"]
    for r in rows:
        ratio = r["full_bytes"] / max(1, r["encoded_bytes"])
        lines.append(f"{r['name'][:48]:<48} {r['dtype']:<8} {str(r['shape'])[:18]:<18} {r['encoded_bytes']:>10} "
                     f"{ratio:>7.1f}x  {r['chunks']}")
    return "\n".join(lines)
