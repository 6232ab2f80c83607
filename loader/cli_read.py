"""CLI commands that read a run: ``materialize`` and ``verify``.

``add_commands(subparsers)`` registers them on the umbrella CLI's argparse
subparsers; each sets ``func`` to a callable taking the parsed args and returning
the exit code. Failures ckptdelta knows about print one line to stderr and exit 1.
"""

from __future__ import annotations

import argparse
import logging
import sys

from ckptdelta.options import add_storage_args, storage_options
from delta.errors import CkptDeltaError

log = logging.getLogger("ckptdelta.loader")


def add_commands(subparsers) -> None:
    p = subparsers.add_parser("materialize", help="write a snapshot as a Hugging Face safetensors directory",
                              description="Rebuild a snapshot (anchor + deltas, verified) and write it as "
                                          "safetensors shards, index and the anchor's config/tokenizer files.")
    p.add_argument("url", help="run root: a local path, file://, s3://bucket/prefix, gs://bucket/prefix ...")
    p.add_argument("snapshot", help="'latest', a version number or a name like v00000042")
    p.add_argument("out_dir", help="directory to create (must not exist, or be empty)")
    _common(p)
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar (default: when stderr is a terminal)")
    p.set_defaults(func=cmd_materialize)

    v = subparsers.add_parser("verify", help="check every object and tensor digest of a snapshot's chain",
                              description="Read every object of the snapshot's chain (anchor and deltas) and "
                                          "rebuild every tensor at every version, checking all digests.")
    v.add_argument("url", help="run root")
    v.add_argument("snapshot", nargs="?", default="latest", help="default: latest")
    _common(v)
    v.set_defaults(func=cmd_verify)


def _common(p: argparse.ArgumentParser) -> None:
    add_storage_args(p)
    p.add_argument("--cache-dir", default=None, help="shared on-disk cache of fetched ranges")


def _fail(e: BaseException) -> int:
    msg = " ".join(str(e).split())
    print(f"error: {msg}", file=sys.stderr)
    return 1


def cmd_materialize(args: argparse.Namespace) -> int:
    from .reader import SnapshotReader
    try:
        reader = SnapshotReader(args.url, storage_options=storage_options(args),
                                cache_dir=getattr(args, "cache_dir", None))
        v = reader.resolve(args.snapshot)
        out = reader.materialize(v, args.out_dir, progress=args.progress)
    except (CkptDeltaError, ValueError, FileExistsError) as e:
        return _fail(e)
    print(f"materialized {reader.manifest(v).name} of run {reader.run_id} into {out}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from .reader import SnapshotReader
    try:
        reader = SnapshotReader(args.url, storage_options=storage_options(args))
        report = reader.verify(args.snapshot)
    except (CkptDeltaError, ValueError) as e:
        return _fail(e)
    chain = report.chain
    print(f"ok: {report.snapshot} of run {reader.run_id} (chain v{chain[0]}..v{chain[-1]}, {len(chain)} versions): "
          f"{report.objects_checked} objects, {report.tensors_checked} tensor digests, "
          f"{report.bytes_read} bytes read in {report.seconds:.2f}s")
    for key in report.damaged:  # latest skipped them: the run is readable, but these need a look
        print(f"warning: newer manifest {key} is unreadable and was skipped; 'latest' is the snapshot above",
              file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m loader.cli_read materialize|verify ...`` (the same commands as the umbrella CLI)."""
    parser = argparse.ArgumentParser(prog="ckptdelta")
    add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
