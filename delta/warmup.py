"""Compile the codec's numba kernels ahead of use: ``ckptdelta warmup`` (or ``python -m ckptdelta.delta.warmup``; make
runs it at install, and a trainer's or replica's image should: ``RUN ckptdelta warmup``).

The kernels are compiled with ``cache=True``, so a fresh checkout compiles them
on first use: the first publish and the first hot-load then take seconds
instead of milliseconds, and a benchmark would report compile time as publish
time. Running every encoding and staging path once, on small tensors of each
dtype, fills numba's on-disk cache (this environment's folder of it:
delta/kernel_cache.py); later processes load the machine code. A completed
warm-up marks the environment warm, which keeps a process from announcing its
first compile.

Loading that machine code still costs every new process time on first use: each
kernel's cache entry is read and linked (~0.3 s for the staging path of one
dtype, ~0.4 s for the commit's four element widths). A replica that did this on
its first hot-load would be that much slower on that one, and its first pause
longer.
:func:`warm_in_background`, which every ``HotSwapper`` calls as it is built, runs
the replica's paths once per process, in a background thread, for the dtypes of
its weights, so the first hot-load finds them ready.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable

import torch

log = logging.getLogger("ckptdelta.warmup")

#: Dtypes whose kernels are specialised separately.
DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)


def _pair(dtype: torch.dtype, n: int, frac: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    old = (torch.randn(n, generator=g) * 0.05).to(dtype)
    mask = torch.rand(n, generator=g) < frac
    new = torch.where(mask, (old.float() * (1 + 0.01 * torch.randn(n, generator=g))).to(dtype), old)
    return old, new.contiguous()


def warm_up(progress: Callable[[str, int, int, float | None], None] | None = None) -> float:
    """Run encode (both codec modes), the batch paths, stage and apply once per dtype, and the hot-swap commit
    kernels once per element width, each checked bit-exact; returns the seconds it took.

    ``progress(group, i, n, seconds)`` is called as each of the ``n`` groups starts (``seconds`` None) and ends
    (the seconds it took): a fresh install compiles for minutes on a busy machine."""
    from ckptdelta.delta import apply_, apply_many, encode, encode_many, stage, stage_full

    from ckptdelta.delta import kernel_cache

    say = progress or (lambda *_: None)
    kernel_cache.quiet()    # this is the compile the announcement would point to
    groups = len(DTYPES) + 1
    t0 = time.perf_counter()
    for i, dtype in enumerate(DTYPES):
        group = f"codec kernels for {str(dtype).removeprefix('torch.')}"
        say(group, i + 1, groups, None)
        tg = time.perf_counter()
        for frac in (0.01, 0.5):  # sparse and dense chunk encodings
            old, new = _pair(dtype, 1 << 15, frac, seed=i)
            outs = []
            for context in (True, False):
                blob = encode(old, new, name="warmup", context=context).to_bytes()
                live = old.clone()
                stage(live, blob).apply_(live)
                outs.append(live)
                live = old.clone()
                apply_(live, blob)
                outs.append(live)
            recs = [e.to_bytes() for e in encode_many([("a", old, new), ("b", old, new)])]
            lives = [old.clone(), old.clone()]
            apply_many(zip(lives, recs))
            outs += lives
            live = old.clone()
            stage_full(live, new, name="warmup").apply_(live)
            outs.append(live)
            live = torch.zeros_like(new)
            apply_(live, encode(None, new, name="warmup").to_bytes())
            outs.append(live)
            want = new.view(torch.uint8)
            if not all(torch.equal(o.view(torch.uint8), want) for o in outs):
                raise AssertionError(f"warm-up round trip of {dtype} is not bit-exact")
            _warm_encodings(old, new, seed=i)
        say(group, i + 1, groups, time.perf_counter() - tg)
    say("hot-swap commit kernels", groups, groups, None)
    tg = time.perf_counter()
    _warm_commit()
    say("hot-swap commit kernels", groups, groups, time.perf_counter() - tg)
    kernel_cache.mark_warm()
    return time.perf_counter() - t0


def _warm_encodings(old: torch.Tensor, new: torch.Tensor, seed: int, encodings: Iterable | None = None) -> None:
    """Each encoding's own warm-up (``Encoding.warm_up``: the kernels the codec's round trips may not reach,
    such as encoding 4's, which the codec only reads now, and encoding 6's, which needs a grandparent), on
    these tensors and a grandparent made for them; every registered encoding unless ``encodings`` says."""
    from ckptdelta.delta import dtypes
    from ckptdelta.delta.encodings import REGISTRY

    dt = dtypes.of(old)
    grand = _pair(old.dtype, old.numel(), 0.5, seed=seed + 101)[1]
    o, n, g = (dtypes.host_bits(x) for x in (old, new, grand))
    for enc in REGISTRY if encodings is None else encodings:
        enc.warm_up(o, n, g, dt)


def _commit_case(width: int, n: int, frac: float, copy: bool) -> tuple:
    """Live bits of ``width``-byte elements, their changed copy, and a batch (delta/commit_ranges.py) that
    writes the change scattered into one live copy and, with ``copy``, also copied whole over a second and
    swapped with a staged copy (``wholes[2]``) over a third."""
    import numpy as np

    from ckptdelta.delta import commit_ranges, kernels

    dt = np.dtype(f"<u{width}")
    rng = np.random.default_rng(width)
    old = rng.integers(0, np.iinfo(dt).max, n, dtype=dt)
    pos = np.flatnonzero(rng.random(n) < frac).astype(np.int64)
    new = old.copy()
    new[pos] ^= dt.type(1)
    block = kernels.HASH_BLOCK_BYTES // width
    hashes = np.empty(-(-n // block), np.uint64)
    kernels.block_hashes(old, block, hashes)
    lives = [old.copy(), old.copy(), old.copy()]
    m, nb = pos.shape[0], hashes.shape[0]
    tasks = np.array([[0, kernels.MODE_SCATTER, 0, m, 0, 0, 0]]
                     + ([[1, kernels.MODE_COPY, 0, m, 0, nb, 0], [2, kernels.MODE_SWAP, 0, 0, 0, nb, nb]]
                        if copy else []), np.int64)
    none = pos[:0]
    wholes = [None, new, new.copy()] if copy else [None]      # scattered, copied, swapped
    tensors = [(lv, wh, pos, old[pos], new[pos]) if i < 2 else (lv, wh, none, old[:0], old[:0])
               for i, (lv, wh) in enumerate(zip(lives, wholes))]
    both = np.concatenate([hashes, hashes]) if copy else hashes
    tables = commit_ranges.Tables([(block, tensors, both, tasks)], [(0, t, t + 1) for t in range(tasks.shape[0])])
    return old, new, pos, lives[:len(wholes)], wholes, tables


def _warm_commit() -> None:
    """The hot-swap commit kernels (every mode, undo; on torch's OpenMP team where there is one) for every
    element width, and the int32-position scatter of Publisher(device_diff=True), each checked bit-exact
    (at install; a replica's runtime warm-up needs only :func:`_warm_commit_path`)."""
    import numpy as np

    from ckptdelta.delta import commit_ranges, kernels, omp

    team = omp.team()
    for width in (1, 2, 4, 8):
        old, new, pos, lives, wholes, tables = _commit_case(width, 3 << 14, 0.05, copy=True)
        ok = True
        for on_team in (False, True) if team is not None else (False,):
            tables.reset()
            if on_team:
                team.run(commit_ranges.team_entry(), tables.ctl.ctypes.data, 2)
            else:
                commit_ranges.commit_ranges(tables.ctl)
            ok &= bool((tables.results[:, 1] == 1).all()) and all(np.array_equal(x, new) for x in lives)
            ok &= np.array_equal(wholes[2], old)      # the swap left the old bits staged
            for g, t in ((0, 2), (0, 1), (0, 0)):
                tables.undo(g, t, t + 1)
            ok &= all(np.array_equal(x, old) for x in lives) and np.array_equal(wholes[2], new)
        live = old.copy()
        kernels.scatter(live, pos.astype(np.int32), new[pos])
        if not (ok and np.array_equal(live, new)):
            raise AssertionError(f"warm-up of the commit kernels ({width}-byte elements) is not bit-exact")


def _warm_commit_path(width: int) -> None:
    """What a replica's first commit of ``width``-byte elements would otherwise do inside its pause: load the
    commit and undo kernels from numba's cache (and the OpenMP team's entry); checked bit-exact."""
    import numpy as np

    from ckptdelta.delta import commit_ranges

    old, new, _pos, (live,), _wholes, tables = _commit_case(width, 64, 0.1, copy=False)
    tables.reset()
    commit_ranges.commit_ranges(tables.ctl)
    ok = np.array_equal(live, new)
    tables.undo(0, 0, 1)
    commit_ranges.team_entry()
    if not (ok and np.array_equal(live, old)):
        raise AssertionError(f"warm-up of the commit path ({width}-byte elements) is not bit-exact")


def _warm_stage(dtype: torch.dtype, context: bool) -> None:
    """The replica's staging path of one dtype and codec (sparse and dense chunks), checked. The records
    are encoded here: with numba's cache filled at install that costs little (a replica installed
    without ``python -m ckptdelta.delta.warmup`` compiles the encoder too, in this background thread)."""
    from ckptdelta.delta import encode, stage
    from ckptdelta.delta.chunks import tries

    for frac in (0.01, 0.5):
        old, new = _pair(dtype, 1 << 12, frac, seed=0)
        live = old.clone()
        stage(live, encode(old, new, name="warmup", context=context).to_bytes()).apply_(live)
        if not torch.equal(live.view(torch.uint8), new.view(torch.uint8)):
            raise AssertionError(f"warm-up of the staging path of {dtype} is not bit-exact")
        _warm_encodings(old, new, seed=0, encodings=tries(context, grand=True)[1])   # those its codec writes


#: Set to 0 to turn the background warm-up off (every HotSwapper then loads its kernels on first use).
ENV = "CKPTDELTA_WARMUP"

_lock = threading.Lock()
_busy = threading.RLock()    # held while one path is warmed (numba's compiler lock may be held inside)
_stop = threading.Event()
_warmed: set[tuple] = set()     # ("commit", element width) and ("stage", torch dtype, context) done
_failed: set[tuple] = set()     # ... or tried and raised (logged; never retried)
_pending: list[tuple] = []
_running: tuple | None = None
_thread: threading.Thread | None = None


def _jobs_for(dtypes: Iterable[torch.dtype]) -> list[tuple]:
    from ckptdelta.delta.dtypes import BY_TORCH

    dtypes = [d for d in dtypes if d in BY_TORCH]
    # the commit paths first: the pause waits for them (ensure_commit_paths)
    jobs: list[tuple] = [("commit", d.itemsize) for d in dtypes if d.itemsize in (1, 2, 4, 8)]
    jobs += [("stage", d, ctx) for d in dtypes if d.is_floating_point for ctx in (True, False)]
    return list(dict.fromkeys(jobs))


def _run(job: tuple) -> None:
    """Warm one path (the caller holds ``_busy``) and record how it went."""
    try:
        _warm_commit_path(job[1]) if job[0] == "commit" else _warm_stage(job[1], job[2])
        ok = True
    except Exception:   # noqa: BLE001 - a warm-up only saves time: the real call will raise properly
        log.warning("warm-up of the %s path for %s failed", job[0], job[1:], exc_info=True)
        ok = False
    with _lock:
        (_warmed if ok else _failed).add(job)


def _run_pending() -> None:
    global _thread, _running
    while not _stop.is_set():
        with _busy:
            with _lock:
                if not _pending:
                    _thread = None
                    return
                job = _running = _pending.pop(0)
            try:
                _run(job)
            finally:
                with _lock:
                    _running = None
    with _lock:
        _thread = None


def _known(job: tuple) -> bool:
    return job in _warmed or job in _failed or job in _pending or job == _running


def warm_in_background(dtypes: Iterable[torch.dtype]) -> threading.Thread | None:
    """Run the replica's staging and commit paths for ``dtypes`` once in this process, in a background
    thread (started unless every path is warm or queued already, or ``CKPTDELTA_WARMUP=0``); returns
    that thread, if any. Never raises: a warm-up only saves time."""
    global _thread
    if os.environ.get(ENV, "1") == "0":
        return None
    with _lock:
        _pending.extend(j for j in _jobs_for(dtypes) if not _known(j))
        if _thread is None and _pending and not _stop.is_set():
            t = threading.Thread(target=_run_pending, name="ckptdelta-warmup", daemon=True)
            try:
                t.start()
            except RuntimeError:     # no thread to be had: the paths load on first use instead
                log.warning("cannot start the warm-up thread", exc_info=True)
                _pending.clear()
                return None
            _thread = t
        return _thread


def ensure_commit_paths(widths: Iterable[int]) -> None:
    """Warm the commit path of each element width now, in the calling thread, unless it is warm (a
    prepare calls this before its pause: loading the commit's kernels must not happen inside it). Waits
    for the path the background thread is on, if any."""
    jobs = [("commit", w) for w in dict.fromkeys(widths) if w in (1, 2, 4, 8)]
    with _lock:
        if all(j in _warmed or j in _failed for j in jobs):
            return
    with _busy:
        for job in jobs:
            with _lock:
                if job in _warmed or job in _failed:
                    continue
                if job in _pending:
                    _pending.remove(job)
            _run(job)


def cancel_pending() -> None:
    """Drop the staging paths the warm-up has not started (a hot-load has begun: it loads those itself,
    and a warm-up beside it would only take cores from it). Commit paths stay: the pause needs them
    (:func:`ensure_commit_paths`); the path being warmed finishes."""
    with _lock:
        _pending[:] = [j for j in _pending if j[0] == "commit"]


def wait_warm(timeout: float | None = None) -> set[tuple]:
    """Wait for the background warm-up (if one runs); returns the paths warmed in this process so far
    (not those that failed)."""
    with _lock:
        t = _thread
    if t is not None:
        t.join(timeout)
    with _lock:
        return set(_warmed)


def failed() -> set[tuple]:
    """The paths whose warm-up raised (each logged as a warning)."""
    with _lock:
        return set(_failed)


def _before_fork() -> None:
    """A fork waits for the path being warmed: a child forked while the warm-up held numba's compiler lock
    would inherit it held by a thread that does not exist there, and hang on its first kernel."""
    _busy.acquire()


def _after_fork_in_parent() -> None:
    _busy.release()


def _after_fork_in_child() -> None:
    global _lock, _busy, _thread, _running
    _lock, _busy, _thread, _running = threading.Lock(), threading.RLock(), None, None
    _pending.clear()        # the child's next HotSwapper queues what is still cold


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                    after_in_child=_after_fork_in_child)


@atexit.register
def _stop_at_exit() -> None:
    """Let a running warm-up finish the path it is on (with numba's cache filled at install, well under a
    second) rather than stop the interpreter inside a compile."""
    _stop.set()
    with _lock:
        t = _thread
    if t is not None:
        t.join(30.0)


def main(progress: bool = True) -> int:
    """Compile every kernel, saying where they are cached; ``progress``: a line per group as it goes (the
    compile takes a minute or more the first time: not a silent one)."""
    from ckptdelta.delta import kernel_cache

    def say(group: str, i: int, n: int, seconds: float | None) -> None:
        if seconds is None:
            print(f"  [{i}/{n}] {group} ...", end="", file=sys.stderr, flush=True)
        else:
            print(f" {seconds:.1f} s", file=sys.stderr, flush=True)

    if progress:
        print("compiling the codec's kernels once for this environment (numba caches them; a minute or more the "
              "first time on two cores, longer on a busy machine):", file=sys.stderr, flush=True)
    s = warm_up(say if progress else None)
    print(f"codec kernels ready ({s:.1f} s; cached in {kernel_cache.kernel_dir()})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
