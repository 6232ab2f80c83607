"""The ``ckptdelta`` command: one entry point whose subcommands live beside the code they drive.

publisher/ and loader/ each register their own subcommands, so this module only
assembles the parser and sets up logging; every command reports through
ckptdelta/cli/console.py: a usage error is one line and exit status 2, a failure one
line and exit status 1, a traceback only with -v (it is for bugs, not for a wrong URL).
"""

from __future__ import annotations

import argparse
import sys

from ckptdelta import __version__
from ckptdelta.cli.console import CommandParser, guarded, quiet_stdout, set_up_logging, usage_error

DESCRIPTION = """\
Ship bit-exact policy weights from an RL trainer to its sampling replicas as small
deltas through object storage (a local directory, s3://, gs://, any fsspec URL).

trainer side:   publish, ls, gc
replica side:   serve, hotload, status, materialize, verify
inspection:     inspect
set-up:         warmup (compile the kernels ahead: RUN ckptdelta warmup in an image)
"""

COMMANDS = ("publish", "ls", "gc", "serve", "hotload", "status", "materialize", "verify", "inspect", "warmup")

EPILOG = """\
examples:
  ckptdelta publish ./my-model .ckptdelta/bucket/run1 --step 0
  ckptdelta ls .ckptdelta/bucket/run1
  ckptdelta serve --bucket .ckptdelta/bucket/run1 --port 8000
  ckptdelta serve --engine vllm --bucket .ckptdelta/bucket/run1 --port 8000 -- --max-model-len 4096
  ckptdelta hotload http://127.0.0.1:8000 latest --wait
  ckptdelta hotload --replicas-file replicas.txt latest --wait   # a fleet: one row per replica
  ckptdelta status http://127.0.0.1:8000 http://127.0.0.1:8001
  ckptdelta materialize s3://bucket/run1 v00000042 ./checkpoint

Credentials and endpoints for s3:// and gs:// come from the usual places (environment,
config files) or --storage-options '{"client_kwargs": {"endpoint_url": "..."}}'.
Errors are one line (exit 2: a usage error, 1: a failure); -v adds the traceback.
"""


def build_parser() -> argparse.ArgumentParser:
    from ckptdelta.cli import serve as loader_serve_cli
    from ckptdelta.cli import read as loader_read_cli
    from ckptdelta.cli import publish as publisher_cli

    from ckptdelta.cli import inspect as inspect_cmd
    from ckptdelta.cli import warmup as warmup_cmd

    parser = CommandParser(
        prog="ckptdelta", description=DESCRIPTION, epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"ckptdelta {__version__}")
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="more logging and tracebacks of errors (-vv: debug, storage clients' logs too)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    publisher_cli.add_commands(sub)
    loader_serve_cli.add_commands(sub)
    loader_read_cli.add_commands(sub)
    inspect_cmd.add_commands(sub)
    warmup_cmd.add_commands(sub)
    for p in sub.choices.values():  # -v after the command too (SUPPRESS: it adds to the count before it)
        p.add_argument("-v", "--verbose", action="count", default=argparse.SUPPRESS,
                       help="more logging and the traceback of an error (-vv: debug)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    # Everything after a bare "--" belongs to the engine (``serve --engine vllm ... -- --max-model-len 4096``).
    passthrough: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1:]
    args, unknown = parser.parse_known_args(argv)
    command = getattr(args, "command", None)
    if unknown:    # the subcommand's own --help is the one that lists what it takes
        return usage_error(command or "", f"unrecognized arguments: {' '.join(unknown)}")
    args.passthrough = passthrough
    if passthrough and command != "serve":
        return usage_error(command or "", f"arguments after '--' ({' '.join(passthrough[:3])} ...) are only "
                                          "for 'serve --engine vllm'")
    set_up_logging(args.verbose, command)
    if not getattr(args, "func", None):
        return usage_error("", f"give a command: {', '.join(COMMANDS)}")
    status = guarded(args.func, command)(args)   # each command is guarded already; this catches what is not
    try:
        sys.stdout.flush()       # here, not at exit: a reader gone by now ends the command quietly too
    except BrokenPipeError:
        return quiet_stdout()
    return status


if __name__ == "__main__":
    sys.exit(main())
