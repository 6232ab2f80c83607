"""The ``ckptdelta`` command: one entry point whose subcommands live beside the code they drive.

publisher/ and loader/ each register their own subcommands, so this module only
assembles the parser, sets up logging and turns ckptdelta errors into one-line
messages with exit status 1 (a traceback is for bugs, not for a wrong URL).
"""

from __future__ import annotations

import argparse
import logging
import sys

from delta.errors import CkptDeltaError

from . import __version__

DESCRIPTION = """\
Ship bit-exact policy weights from an RL trainer to its sampling replicas as small
deltas through object storage (a local directory, s3://, gs://, any fsspec URL).

trainer side:   publish, ls, gc
replica side:   serve, hotload, materialize, verify
inspection:     inspect
"""

EPILOG = """\
examples:
  ckptdelta publish ./my-model .ckptdelta/bucket/run1 --step 0
  ckptdelta ls .ckptdelta/bucket/run1
  ckptdelta serve --bucket .ckptdelta/bucket/run1 --port 8000
  ckptdelta serve --engine vllm --bucket .ckptdelta/bucket/run1 --port 8000 -- --max-model-len 4096
  ckptdelta hotload http://127.0.0.1:8000 latest --wait
  ckptdelta materialize s3://bucket/run1 v00000042 ./checkpoint

Credentials and endpoints for s3:// and gs:// come from the usual places (environment,
config files) or --storage-options '{"client_kwargs": {"endpoint_url": "..."}}'.
"""


def build_parser() -> argparse.ArgumentParser:
    from loader import cli as loader_serve_cli
    from loader import cli_read as loader_read_cli
    from publisher import cli as publisher_cli

    from . import inspect_cmd

    parser = argparse.ArgumentParser(
        prog="ckptdelta", description=DESCRIPTION, epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"ckptdelta {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging (-vv for debug)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    publisher_cli.add_commands(sub)
    loader_serve_cli.add_commands(sub)
    loader_read_cli.add_commands(sub)
    inspect_cmd.add_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything after a bare "--" belongs to the engine (``serve --engine vllm ... -- --max-model-len 4096``).
    passthrough: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1:]
    args = parser.parse_args(argv)
    args.passthrough = passthrough
    if passthrough and getattr(args, "command", None) != "serve":
        parser.error(f"arguments after '--' ({' '.join(passthrough[:3])} ...) are only for 'serve --engine vllm'")
    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)]
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except CkptDeltaError as e:
        print(f"ckptdelta {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
