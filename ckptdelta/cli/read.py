"""CLI commands that read a run: ``materialize`` and ``verify``.

``add_commands(subparsers)`` registers them on the umbrella CLI's argparse
subparsers; each sets ``func`` to a callable taking the parsed args and returning
the exit code. Errors are one line on stderr (ckptdelta/cli/console.py): exit 2 for a
usage error, 1 for a failure.
"""

from __future__ import annotations

import argparse
import logging
import sys

from ckptdelta.cli.console import CommandParser, guarded, one_line, plural, warn
from ckptdelta.cli.options import add_storage_args, storage_options

log = logging.getLogger("ckptdelta.loader")


def add_commands(subparsers) -> None:
    p = subparsers.add_parser("materialize", help="write a snapshot as a Hugging Face safetensors directory",
                              description="Rebuild a snapshot (anchor + deltas, verified) and write it as "
                                          "safetensors shards, index and the anchor's config/tokenizer files.")
    p.add_argument("url", metavar="URL",
                   help="run root: a local path, file://, s3://bucket/prefix, gs://bucket/prefix ...")
    p.add_argument("snapshot", metavar="SNAPSHOT", help="'latest', a version number or a name like v00000042")
    p.add_argument("out_dir", metavar="OUT_DIR", help="directory to create (must not exist, or be empty)")
    add_storage_args(p)
    p.add_argument("--cache-dir", default=None, metavar="DIR", help="shared on-disk cache of fetched ranges")
    p.add_argument("--exact", action="store_true",
                   help="write the trainer's own bits: for a run published with keep_exact=True, its fp32 tensors "
                        "rebuilt from the version's exact attachment (the checkpoint a trainer resumes from), "
                        "where the default writes the bf16 the replicas serve")
    _progress(p)
    p.set_defaults(func=guarded(cmd_materialize, "materialize"))

    v = subparsers.add_parser("verify", help="check every object and tensor digest of a snapshot's chain",
                              description="Read every object of the snapshot's chain (anchor and deltas) once, "
                                          "checking its digest, and rebuild every tensor at every version, "
                                          "checking all digests; where the snapshot has exact bits attached "
                                          "(a run published with keep_exact=True), rebuild those too, checking "
                                          "theirs. Reads the store, never a cache.")
    v.add_argument("url", metavar="URL", help="run root: a local path, file://, s3://bucket/prefix ...")
    v.add_argument("snapshot", nargs="?", default="latest", metavar="SNAPSHOT",
                   help="'latest' (default; found through the run's HEAD), a version number or a name like "
                        "v00000042 (verified even where HEAD is unreadable, which is then reported: exit 1)")
    add_storage_args(v)
    _progress(v)
    v.set_defaults(func=guarded(cmd_verify, "verify"))


def _progress(p: argparse.ArgumentParser) -> None:
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bar (default: when stderr is a terminal)")


def cmd_materialize(args: argparse.Namespace) -> int:
    from ckptdelta.loader.reader import SnapshotReader
    reader = SnapshotReader(args.url, storage_options=storage_options(args),
                            cache_dir=getattr(args, "cache_dir", None))
    v = reader.resolve(args.snapshot)
    out = reader.materialize(v, args.out_dir, progress=args.progress, exact=args.exact)
    bits = " (the trainer's exact bits)" if args.exact else ""
    print(f"materialized {reader.manifest(v).name} of run {reader.run_id}{bits} into {out}")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from ckptdelta.loader.reader import SnapshotReader
    from ckptdelta.loader.verify import HeadPointerError

    reader = SnapshotReader(args.url, storage_options=storage_options(args))
    try:
        report = reader.verify(args.snapshot, progress=args.progress)
        head_problem = None
    except HeadPointerError as e:
        if e.report is None:       # 'latest' needs HEAD: nothing was verified
            raise
        report, head_problem = e.report, str(e)   # the snapshot was verified whole; HEAD is its own finding
    chain = report.chain
    print(f"ok: {report.snapshot} of run {reader.run_id} (chain v{chain[0]}..v{chain[-1]}, "
          f"{plural(len(chain), 'version')}): {plural(report.objects_checked, 'object')}, "
          f"{plural(report.tensors_checked, 'tensor digest')}"
          + ("" if report.exact_tensors_checked is None else
             f", the exact bits of {plural(report.exact_tensors_checked, 'tensor')} (keep_exact)")
          + f", {plural(report.bytes_read, 'byte')} read in {report.seconds:.2f}s")
    for key in report.damaged:  # latest skipped them: the run is readable, but these need a look
        warn("verify", f"newer manifest {key} is unreadable and was skipped; 'latest' is the snapshot above")
    if head_problem is not None:   # every reader's 'latest' fails: a failure of the run, exit 1
        print(f"ckptdelta verify: error: {one_line(head_problem)}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m ckptdelta.cli.read materialize|verify ...`` (the same commands as the umbrella CLI)."""
    parser = CommandParser(prog="ckptdelta")
    add_commands(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
