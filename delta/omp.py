"""torch's own OpenMP team, for the kernels of the hot-swap pause; and the raw-address glue they need.

Why: a pause starts right after torch has run something (the forward steps it
waited for, a copy) on its intra-op threads, and torch's CPU build runs those on
GNU OpenMP, whose idle threads spin for a while before they sleep. A commit on
threads of its own then finds the cores taken by spinning threads, or, once they
sleep, waits for an idle vCPU to wake, a delay the size of a small commit. Started
with ``GOMP_parallel`` from the thread that ran the torch work, the same kernel
gets those very threads, already awake: right after torch work, a scatter runs
clearly faster on torch's team than on a thread pool of our own.

An OpenMP team belongs to the thread that starts the parallel region: a commit
called from another thread than the forward steps gets a team of its own (woken
like any thread), no faster but no slower than a pool of ours.

:func:`team` finds the OpenMP runtime torch itself loaded (never a second copy),
or answers None where there is none to share: torch built with another parallel
backend, a platform without ``/proc``, a child forked after this module was
imported (libgomp is not fork-safe: once the parent has run a region, a child's
waits for the parent's threads, as torch's own ops do there), or
``CKPTDELTA_OMP_TEAM=0``. The caller then runs the
same kernel on Python threads.

The kernel a team runs is a numba ``cfunc`` taking one pointer, so what it works on
is passed as a table of array addresses (:func:`carray_at` makes arrays of them
again) and the threads share work through an atomic counter (:func:`fetch_add`).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import sys

import numpy as np
from llvmlite import ir
from numba import carray, types
from numba.core import cgutils
from numba.extending import intrinsic, register_jitable

log = logging.getLogger("ckptdelta.omp")

_I64_PTR = ir.IntType(64).as_pointer()


@intrinsic
def voidptr_at(typingctx, addr):
    """The int64 ``addr`` as a ``void *`` (for ``numba.carray``)."""
    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], cgutils.voidptr_t)
    return types.voidptr(types.int64), codegen


@intrinsic
def fetch_add(typingctx, addr, value):
    """Atomically add ``value`` to the int64 at address ``addr``; returns what it held before."""
    def codegen(context, builder, signature, args):
        return builder.atomic_rmw("add", builder.inttoptr(args[0], _I64_PTR), args[1], "seq_cst")
    return types.int64(types.int64, types.int64), codegen


@register_jitable
def int64s_at(addr, shape):
    """The int64 array of ``shape`` at address ``addr`` (no copy, no owner: the caller keeps it alive)."""
    return carray(voidptr_at(addr), shape, np.int64)


class Team:
    """torch's OpenMP runtime: :meth:`run` starts a parallel region of the calling thread's team."""

    def __init__(self, path: str) -> None:
        # RTLD_NOLOAD: the very library torch loaded, or an error, never a second runtime with threads of its own
        lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_NOW)
        self.path = path
        self._parallel = lib.GOMP_parallel
        self._parallel.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
        self._parallel.restype = None

    def run(self, entry: int, data: int, threads: int) -> None:
        """Run the cfunc at address ``entry`` on ``threads`` threads (the caller's one among them), each given
        ``data``; returns when all have returned. The GIL is released meanwhile (ctypes)."""
        self._parallel(entry, data, threads, 0)


_TEAM: Team | None = None
_LOOKED = False
_FORKED = False


def _forked() -> None:
    global _FORKED, _TEAM
    _FORKED, _TEAM = True, None


os.register_at_fork(after_in_child=_forked)


def team() -> Team | None:
    """torch's OpenMP team, or None where the caller should use threads of its own (see the module)."""
    global _TEAM, _LOOKED
    if _FORKED or os.environ.get("CKPTDELTA_OMP_TEAM", "1") == "0":
        return None
    if not _LOOKED:
        _LOOKED = True
        path = _torch_openmp_library()
        if path is not None:
            try:
                _TEAM = Team(path)
            except (OSError, AttributeError) as e:
                log.debug("torch's OpenMP runtime %s cannot be shared (%s): commit threads of our own", path, e)
    return _TEAM


def serial_here() -> bool:
    """torch's OpenMP work started from the calling thread (its elementwise ops, copies, fills) runs on that
    thread alone from now on; other threads keep their teams. Returns whether it took. (A matrix product that
    torch hands to MKL keeps MKL's own thread count: a LoRA write runs none.)

    Why: a thread of our own that runs torch ops (a vLLM worker's LoRA writes, beside the engine loop) gets
    an OpenMP team of its own, whose threads sleep between the ops: each op of a few hundred KB waits for
    them to wake, and then they take cores from the engine's team. Copying a rank-64 adapter's rows in such
    a thread took 4-5x as long as on the thread alone. torch sizes each parallel region by
    ``omp_get_max_threads()``, which OpenMP keeps per thread, so setting it to 1 here touches no other thread
    (``torch.set_num_threads`` would change the process's default too). torch sets each thread's count up
    lazily, from that default: it runs here first, never after."""
    import torch

    if _FORKED or os.environ.get("CKPTDELTA_OMP_TEAM", "1") == "0":
        return False
    path = _torch_openmp_library()
    if path is None or not os.path.basename(path).startswith("libgomp"):
        return False
    try:
        lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_NOW)
        torch.get_num_threads()          # torch's per-thread set-up, now rather than after the call below
        lib.omp_set_num_threads(1)
    except (OSError, AttributeError) as e:
        log.debug("torch's OpenMP runtime %s: this thread keeps its team (%s)", path, e)
        return False
    return torch.get_num_threads() == 1


@functools.cache
def _torch_openmp_library() -> str | None:
    """The OpenMP runtime mapped into this process from torch's own directories, when torch runs on it (read
    from ``/proc/self/maps`` once per process: torch cannot unload it)."""
    import torch

    if not sys.platform.startswith("linux") or "parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return None
    here = os.path.dirname(os.path.realpath(torch.__file__))
    roots = (os.path.join(here, "lib") + os.sep, here + ".libs" + os.sep)   # .libs: auditwheel's copy
    try:
        with open("/proc/self/maps") as f:
            mapped = {parts[5].strip() for parts in (line.split(None, 5) for line in f) if len(parts) == 6}
    except OSError:
        return None
    for path in sorted(mapped):
        name = os.path.basename(path)
        if name.startswith(("libgomp", "libomp", "libiomp5")) and ".so" in name and \
                os.path.realpath(path).startswith(roots):
            return path
    return None
