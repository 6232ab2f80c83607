"""``ckptdelta inspect``: what is inside a delta object or a single record, without a manifest."""

from __future__ import annotations

import argparse
import json
import os

from delta import container, record
from delta.codec import EncodedTensor
from delta.errors import ObjectNotFoundError, StorageError

from .console import guarded


def add_commands(sub: "argparse._SubParsersAction") -> None:
    p = sub.add_parser("inspect", help="describe a delta object (.ckd) file: tensors, encodings, sizes",
                       description="Describe a delta object file: each tensor's dtype, shape, chunk encodings "
                                   "and encoded size. Every checksum is verified.")
    p.add_argument("path", help="a .ckd delta object on the local filesystem")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=guarded(run, "inspect"))


def run(args: argparse.Namespace) -> int:
    what = f"delta object {os.path.basename(args.path)}"
    try:
        with open(args.path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise ObjectNotFoundError(f"{what}: no such file {args.path}") from None
    except OSError as e:     # a directory, no permission...: one line, not a traceback
        raise StorageError(f"{what}: cannot read {args.path}: {e.strerror or e}") from None
    if data[:8] != container.OBJECT_MAGIC:
        raise record.FormatError(f"{what}: not a ckptdelta delta object (bad magic)")
    index = container.read_index(data, len(data), what=what)
    rows = []
    for name, (off, length) in sorted(index.items(), key=lambda kv: kv[1][0]):
        enc = EncodedTensor.from_bytes(memoryview(data)[off: off + length], what=f"{what} tensor {name!r}")
        h = enc.header
        full = h.numel * h.dtype.itemsize
        rows.append({"name": name, "dtype": h.dtype.name, "shape": list(h.shape), "encoded_bytes": length,
                     "full_bytes": full, "chunks": enc.encoding_counts(), "has_parent": h.has_parent})
    if args.json:
        print(json.dumps({"object": args.path, "size": len(data), "tensors": rows}))
        return 0
    print(f"{'tensor':<48} {'dtype':<8} {'shape':<18} {'bytes':>10} {'ratio':>8}  chunks")
    for r in rows:
        ratio = r["full_bytes"] / max(1, r["encoded_bytes"])
        print(f"{r['name'][:48]:<48} {r['dtype']:<8} {str(r['shape'])[:18]:<18} {r['encoded_bytes']:>10} "
              f"{ratio:>7.1f}x  {r['chunks']}")
    return 0
