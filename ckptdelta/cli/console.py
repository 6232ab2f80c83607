"""How every ``ckptdelta`` command ends: exit 0, a usage error (2) or a failure (1), each said in one line.

- A usage error (a missing or malformed argument, a flag that does not fit the
  others) prints ``ckptdelta CMD: error: MESSAGE (see ckptdelta CMD --help)`` and
  exits 2; argparse's own errors take the same form (:class:`CommandParser`).
- A failure prints ``ckptdelta CMD: error: MESSAGE`` and exits 1; ckptdelta's
  messages name the object and what to do. Anything else that escapes a command
  is one line too, ``... (ckptdelta -v CMD ... shows the traceback)``.
- A traceback is printed only with ``-v``.
- Warnings a command prints itself are ``ckptdelta CMD: warning: MESSAGE``.
"""

from __future__ import annotations

import argparse
import functools
import logging
import os
import sys
import traceback
from typing import Any, Callable, NoReturn

from ckptdelta.delta.errors import CkptDeltaError

from ckptdelta.cli.options import UsageError, storage_timeout

#: Loggers of the storage client libraries: their retries log tracebacks of their own, shown only with -vv.
NOISY_LOGGERS = ("gcsfs", "s3fs", "aiobotocore", "botocore", "fsspec", "urllib3", "google", "google_auth_httplib2")


def one_line(text: object) -> str:
    return " ".join(str(text).split())


def plural(n: int, noun: str) -> str:
    """``1 object``, ``2 objects``: a count and its noun, as a command prints them."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _prog(name: str) -> str:
    return f"ckptdelta {name}" if name else "ckptdelta"


def usage_error(name: str, message: str) -> int:
    """Print a usage error for command ``name`` and return its exit status (2)."""
    print(f"{_prog(name)}: error: {one_line(message)} (see {_prog(name)} --help)", file=sys.stderr)
    return 2


def warn(name: str, message: str) -> None:
    print(f"{_prog(name)}: warning: {one_line(message)}", file=sys.stderr)


class CommandParser(argparse.ArgumentParser):
    """argparse with one-line usage errors: ``ckptdelta ls: error: ... (see ckptdelta ls --help)``, exit 2.
    Subparsers made by ``add_subparsers`` are of this class too."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {one_line(message)} (see {self.prog} --help)\n")


def guarded(fn: Callable[[argparse.Namespace], Any], name: str) -> Callable[[argparse.Namespace], int]:
    """``fn`` as a command: its exit status, with every error said in one line (see the module docstring)."""

    @functools.wraps(fn)
    def run(args: argparse.Namespace) -> int:
        verbose = getattr(args, "verbose", 0) or 0
        try:
            with storage_timeout(args):
                return int(fn(args) or 0)
        except UsageError as e:
            return usage_error(name, str(e))
        except KeyboardInterrupt:
            return 130
        except BrokenPipeError:     # whoever read our output stopped (`| head`): not an error of ours
            return quiet_stdout()
        except Exception as e:  # noqa: BLE001 - the point: no traceback unless asked for
            if verbose:
                traceback.print_exc()
            if isinstance(e, (CkptDeltaError, OSError)):
                msg = one_line(e)
            else:  # not one of ours: a bug, or a library's own error
                msg = f"{type(e).__name__}: {one_line(e)}"
                if not verbose:
                    msg += f" ({_prog('-v ' + name)} ... shows the traceback)"
            print(f"{_prog(name)}: error: {msg}", file=sys.stderr)
            return 1

    return run


def quiet_stdout() -> int:
    """Point standard output at /dev/null, so that the interpreter's own flush at exit does not fail a second
    time on a pipe whose reader is gone; a command cut short that way exits 0, as ``head`` asked."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 0


#: Loggers that say something at INFO for every HTTP request (httpx: each call a replica forwards to vLLM).
CHATTY_LOGGERS = ("httpx", "httpcore")
#: Commands that log at INFO without -v: a replica runs for hours and should say what it is doing (its
#: engine's start, each hot-load); the others print their result themselves.
INFO_COMMANDS = ("serve",)
#: Under a command of INFO_COMMANDS without -v: details the command's own lines already sum up (the swapper's
#: per-step lines; the replica logs one line per hot-load).
DETAIL_LOGGERS = ("ckptdelta.loader.hotswap",)
#: Loggers at INFO under every command: the line that says a first publish or hot-load is about to compile the
#: codec's kernels (once per environment, and slow) instead of sitting silent.
ALWAYS_INFO_LOGGERS = ("ckptdelta.kernel_cache",)


def set_up_logging(verbose: int, command: str | None = None) -> None:
    """WARNING, -v INFO, -vv DEBUG (``serve``: INFO without -v); the storage clients' own loggers stay quiet
    below -vv, and so do loggers that log each HTTP request."""
    default = logging.INFO if command in INFO_COMMANDS else logging.WARNING
    level = [default, logging.INFO, logging.DEBUG][min(verbose, 2)]
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if verbose < 2:
        for name in NOISY_LOGGERS:
            logging.getLogger(name).setLevel(logging.CRITICAL)
        for name in CHATTY_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)
    if verbose == 0 and command in INFO_COMMANDS:
        for name in DETAIL_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)
    if level > logging.INFO:
        for name in ALWAYS_INFO_LOGGERS:
            logging.getLogger(name).setLevel(logging.INFO)
