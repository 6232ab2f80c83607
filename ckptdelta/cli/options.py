"""Command-line options every ckptdelta command shares: how to reach the bucket.

One definition, so ``publish``, ``ls``, ``gc``, ``serve``, ``materialize`` and
``verify`` take the same flags (docs/PUBLISHING.md): ``--storage-options JSON``
and repeatable ``--storage-option K=V`` (dotted keys nest, values parse as JSON
when they can), merged in that order; and ``--storage-timeout SECONDS``, the most
one storage operation may take, its retries included (ckptdelta.delta.storage.RetryPolicy).
"""

from __future__ import annotations

import argparse
import json
import math
import os
from contextlib import contextmanager
from typing import Any, Iterator

from ckptdelta.delta.errors import CkptDeltaError
from ckptdelta.delta.storage import DEFAULT_TIMEOUT_S, TIMEOUT_ENV


class UsageError(CkptDeltaError, ValueError):
    """A command-line value the user can fix (named in the message)."""


def count(minimum: int, maximum: int | None = None):
    """An argparse ``type=``: an integer from ``minimum`` to ``maximum`` (None: no upper bound); anything else is
    a usage error naming the flag (``argument --keep-anchors: 0 is below 1``), exit 2."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is below {minimum}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"{value} is above {maximum}")
        return value
    return parse


def number(minimum: float = 0.0, *, above: bool = False, maximum: float | None = None):
    """An argparse ``type=``: a finite number at least ``minimum`` (``above``: greater than it) and at most
    ``maximum`` (seconds, gigabytes); anything else is a usage error naming the flag, exit 2."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
        if value < minimum or (above and value == minimum):
            raise argparse.ArgumentTypeError(f"{value:g} is {'not above' if above else 'below'} {minimum:g}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"{value:g} is above {maximum:g}")
        return value
    return parse


def add_storage_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--storage-options", default=None, metavar="JSON",
                   help='fsspec options as a JSON object, e.g. \'{"anon": true}\'')
    p.add_argument("--storage-option", action="append", default=[], metavar="K=V",
                   help="one fsspec option (repeatable; dotted keys nest: client_kwargs.endpoint_url=...)")
    p.add_argument("--storage-timeout", type=float, default=None, metavar="SECONDS",
                   help=f"fail a storage operation that has not succeeded after this long, retries included "
                        f"(default: {DEFAULT_TIMEOUT_S:g}, or ${TIMEOUT_ENV} when set; 0: no bound)")


@contextmanager
def storage_timeout(args: argparse.Namespace) -> Iterator[None]:
    """While a command runs, every Store it opens uses ``--storage-timeout`` (through $CKPTDELTA_STORAGE_TIMEOUT,
    which is what ckptdelta.delta.storage reads: engines open their own stores)."""
    value = getattr(args, "storage_timeout", None)
    if value is None:
        yield
        return
    if not value >= 0:
        raise UsageError(f"--storage-timeout {value:g}: must be >= 0 seconds (0: no bound)")
    old = os.environ.get(TIMEOUT_ENV)
    os.environ[TIMEOUT_ENV] = repr(float(value))
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(TIMEOUT_ENV, None)
        else:
            os.environ[TIMEOUT_ENV] = old


def storage_options(args: argparse.Namespace) -> dict[str, Any] | None:
    """The fsspec options the flags give, or None when none were given."""
    raw = getattr(args, "storage_options", None)
    items = getattr(args, "storage_option", None) or []
    if raw is None and not items:
        return None
    opts: dict[str, Any] = {}
    if isinstance(raw, dict):
        opts = dict(raw)
    elif raw:
        try:
            opts = json.loads(raw)
        except ValueError as e:
            raise UsageError(f"--storage-options is not valid JSON: {e}") from None
        if not isinstance(opts, dict):
            raise UsageError("--storage-options must be a JSON object")
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--storage-option takes K=V, got {item!r}")
        try:
            parsed: Any = json.loads(value)
        except ValueError:
            parsed = value
        node = opts
        *parents, leaf = key.split(".")
        for k in parents:
            child = node.setdefault(k, {})
            if not isinstance(child, dict):
                raise UsageError(f"--storage-option {item!r}: {k!r} is already set to a value, not an object")
            node = child
        node[leaf] = parsed
    return opts
