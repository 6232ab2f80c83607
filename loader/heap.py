"""A replica's heap once it has started: frozen out of the cyclic garbage collector's scans.

A replica process holds hundreds of thousands of Python objects once it serves (torch,
the HTTP stack, an engine's client, the snapshot it loaded), nearly all of them for the
life of the process. CPython's full collection walks every one of them whenever enough
objects have outlived the younger generations, and on a busy host one such walk took
200-300 ms (the LoRA benchmark's replica beside vLLM on 2 cores, timed with
``gc.callbacks``): now and then it landed inside a hot-load, whose plan then took
370-400 ms instead of 50-90 (docs/PERFORMANCE.md, "LoRA runs, the replica's fixed
costs"). :func:`freeze_started_heap` collects once and moves what is alive to the
permanent generation, which collections skip: objects made later are collected as
before. vLLM freezes its engine core's heap after its start in the same way.
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger("ckptdelta.loader")


def freeze_started_heap() -> int:
    """Collect, then freeze every object alive (``gc.freeze``); call once the replica has started. Returns how
    many objects the collector will no longer scan."""
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("started: %d objects moved out of the garbage collector's scans (%.0f ms)", frozen,
             1e3 * (time.perf_counter() - t0))
    return frozen


def unfreeze_heap() -> None:
    """Undo :func:`freeze_started_heap` (a process that stops a replica and goes on: a benchmark, a test), so that
    what the stopped replica held can be collected."""
    gc.unfreeze()
