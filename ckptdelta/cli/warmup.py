"""``ckptdelta warmup``: compile the codec's numba kernels now, for this environment, rather than in the first
publish or hot-load (tens of seconds the first time, silent but for one log line).

Meant for the last step of building an image or a venv (``RUN ckptdelta warmup``
in a trainer's or a replica's Dockerfile): the kernels are cached per environment
(Python, numba, llvmlite, CPU; delta/kernel_cache.py), so an image that ran it
starts warm, and a second environment on the same checkout does not undo it.
"""

from __future__ import annotations

import argparse
import sys

from ckptdelta.cli.console import guarded


def add_commands(sub: "argparse._SubParsersAction") -> None:
    p = sub.add_parser("warmup", help="compile the codec's kernels for this environment ahead of use",
                       description="Compile and check (bit-exact) every codec and hot-swap kernel once, so the "
                                   "first publish and hot-load of this environment load them from numba's cache. "
                                   "Run it at install: RUN ckptdelta warmup in a Dockerfile.")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="a line per group of kernels (default: when stderr is a terminal)")
    p.set_defaults(func=guarded(run, "warmup"))


def run(args: argparse.Namespace) -> int:
    from ckptdelta.delta import warmup

    progress = sys.stderr.isatty() if args.progress is None else args.progress
    return warmup.main(progress=progress)
