"""vLLM's CPU all-reduce shared memory, removed when the :class:`~ckptdelta.loader.engines.vllm.replica.VllmServer` that started it
stops.

vLLM's CPU build gives tensor-parallel ranks a shared-memory all-reduce: each worker creates
``/dev/shm/<VLLM_DIST_IDENT>-<group>-[<ranks>]-cpushm_<rank>`` (4 MB, sparse) and maps its peers'. Nothing
unlinks them, so every stop of a TP-2 vLLM left a pair there for good: one per test run, one per replica restart.

``VLLM_DIST_IDENT`` (vLLM's ``cpu_worker.py``) is the base name of torch.distributed's rendezvous file,
``$TMPDIR/vllm_dist_<uuid hex>`` (``get_file_store_init_method``). VllmServer gives vLLM a private TMPDIR, so
the rendezvous names found there (:func:`idents`) name its segments. A segment is removed only if it was not there
before this vLLM started, is named for this vLLM's rendezvous where that is known, and no live process maps it or
holds it open: another replica's vLLM started meanwhile keeps its own.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import Iterable

log = logging.getLogger("ckptdelta.engine.vllm")

SHM_DIR = "/dev/shm"
PREFIX = "vllm_dist_"


def segments(shm_dir: str = SHM_DIR) -> set[str]:
    """The names of vLLM's distributed shared-memory segments in ``shm_dir`` now."""
    try:
        return {n for n in os.listdir(shm_dir) if n.startswith(PREFIX)}
    except OSError:
        return set()


def idents(tmp_dir: str | None) -> set[str]:
    """The ``VLLM_DIST_IDENT`` of every vLLM whose TMPDIR is ``tmp_dir``: its rendezvous files' names."""
    return segments(tmp_dir) if tmp_dir else set()


def _pids() -> list[str]:
    """Every process's id as /proc lists it (none where /proc cannot be read)."""
    try:
        return [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return []


def in_use(paths: Iterable[str]) -> set[str]:
    """Those of ``paths`` (absolute, resolved) that a live process maps or holds open; processes this one may not
    read are skipped."""
    paths, found = set(paths), set()
    for pid in _pids():
        try:
            with open(f"/proc/{pid}/maps", "rb") as f:
                for line in f:
                    parts = line.rstrip(b"\n").split(maxsplit=5)
                    if len(parts) == 6 and (p := os.fsdecode(parts[5])) in paths:
                        found.add(p)
            fd_dir = f"/proc/{pid}/fd"
            for fd in os.listdir(fd_dir):
                try:
                    if (p := os.readlink(os.path.join(fd_dir, fd))) in paths:
                        found.add(p)
                except OSError:
                    pass
        except OSError:      # gone meanwhile, or not ours to read
            pass
    return found


def live_members(pgid: int) -> list[int]:
    """The processes of process group ``pgid`` that still run (zombies, which map nothing, are not counted)."""
    out = []
    for pid in _pids():
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in (b"Z", b"X"):
            out.append(int(pid))
    return out


def end_group(pgid: int, timeout: float, *, term: bool = True) -> None:
    """Until no process of group ``pgid`` runs: SIGTERM (unless ``term`` is false: sent already), SIGKILL after
    ``timeout``. vLLM's workers may outlive the API server that leads the group, and while one runs it maps the
    segments."""
    if not live_members(pgid):
        return
    for sig, wait in ((signal.SIGTERM if term else None, timeout), (signal.SIGKILL, 5.0)):
        if sig is not None:
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                return
        deadline = time.monotonic() + wait
        while live_members(pgid):
            if time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        else:
            return
    log.warning("processes of vLLM's process group %d outlived SIGKILL: %s", pgid, live_members(pgid))


def remove_leftovers(before: Iterable[str], *, own: Iterable[str] | None = None, shm_dir: str = SHM_DIR) -> list[str]:
    """Remove the segments in ``shm_dir`` that are not in ``before``, are named for one of the rendezvous ``own``
    (any, where ``own`` is None) and no live process maps or holds open; the names removed. Never raises."""
    new = segments(shm_dir) - set(before)
    if own is not None:
        prefixes = tuple(i + "-" for i in own)
        new = {n for n in new if n.startswith(prefixes)}
    if not new:
        return []
    root = os.path.realpath(shm_dir)
    paths = {os.path.join(root, n): n for n in new}
    busy = in_use(paths)
    removed = []
    for path, name in sorted(paths.items()):
        if path in busy:
            log.debug("vLLM's shared memory %s is kept: a live process maps it", path)
            continue
        try:
            os.unlink(path)
        except OSError as e:
            log.debug("vLLM's shared memory %s: not removed (%s)", path, e)
            continue
        removed.append(name)
    if removed:
        log.debug("removed vLLM's CPU all-reduce shared memory in %s: %s", root, ", ".join(removed))
    return removed
