"""``Publisher(codec="auto")`` measuring the codec it does not publish with, off the publish's critical path.

The chooser (publisher/codec_choice.py) needs both codecs' costs side by side, but a
delta published with the codec predicted to lose reaches the replicas later: on a LoRA
run's dense adapter deltas the context coder's encode and decode are several times the
fast path's, and every such delta was served that much later. So a delta is always
published with the predicted winner, and when the chooser asks for a measurement the
publisher copies a sample of that delta's (parent, new) tensors before anything can
change them (the parent's buffers are recycled for the next host copy, a LoRA run's
grandparent moves on), and once publish() has returned encodes the sample with both
codecs, one right after the other, on one thread of its own, into memory: nothing is
uploaded, and the trainer's next step is what it runs beside. The pair measured so
(:class:`~ckptdelta.publisher.codec_choice.Measurement`) compares the two on the same
tensors at the same moment, which a pair of consecutive deltas never did.

The sample is whole tensors where they fit (a record is a tensor's, and the codecs'
costs per record are part of what is measured; the tensor larger than what is left of
the sample gives its leading elements), chosen by a hash of their names salted with the
version (deterministic, and a different share of the model each time), about 1/16 of the
elements (at least ``SAMPLE_MIN_ELEMENTS``, at most ``SAMPLE_MAX_ELEMENTS``), with at
least one changed tensor (the codecs differ only in how they code changes).

A measurement yields the cores. Its thread runs ``MEASURE_NICE`` steps below the publisher's
(Linux, where a thread has a priority of its own): what it measures informs a later choice
only, while the trainer's next step and, where trainer and replicas share a machine, the
replicas' load of the delta just published are what users wait for. Each codec's encode is
timed by the thread's own CPU time, so the pair's ratio is the codecs' whatever else runs on
the cores, and however long the low-priority thread waits for one.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Mapping
from contextlib import closing
from dataclasses import dataclass

import torch
import xxhash

from ckptdelta.delta.batch import encode_many
from ckptdelta.delta.record import UNCHANGED

from ckptdelta.publisher.codec_choice import CONTEXT, FAST, Measurement

log = logging.getLogger("ckptdelta.publisher")

#: A sample holds about this share of a delta's elements (whole tensors where they fit) ...
SAMPLE_FRACTION = 1 / 16
#: ... and at most this many (its copies stay in memory until measured; each codec encodes it on one core).
SAMPLE_MAX_ELEMENTS = 4 << 20
#: ... and at least this many (or the whole delta): a smaller sample measures the records' fixed costs more than
#: the coding.
SAMPLE_MIN_ELEMENTS = 1 << 16
#: How long close() lets a running measurement notice it is no longer wanted before leaving it behind.
CLOSE_WAIT_S = 0.2
#: Nice steps a measurement's thread runs below the thread that started it: under contention it then gets about a
#: tenth of a core's share (Linux's weights: 110 against 1024), not half of one.
MEASURE_NICE = 10


def yield_cores(steps: int = MEASURE_NICE) -> None:
    """Lower this thread's scheduling priority by ``steps`` (at most to 19), where the OS gives threads priorities
    of their own (Linux: a thread is a task and ``setpriority`` takes its id); elsewhere, or where it is refused,
    nothing changes: a measurement then only competes as before."""
    if not sys.platform.startswith("linux"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + steps))
    except OSError as e:
        log.debug("a codec measurement keeps its thread's priority: %s", e)


@dataclass
class Sample:
    """Copies of some tensors of one delta: (name, parent, new, parent's digest, grandparent) for encode_many."""

    version: int
    explored: str
    items: list[tuple[str, torch.Tensor, torch.Tensor, int | None, torch.Tensor | None]]
    elements: int


def pick(snapshot: Mapping[str, torch.Tensor], changed: set[str], salt: int) -> list[tuple[str, int]]:
    """A sample of ``snapshot`` as (name, elements taken) (see the module docstring); [] when nothing changed.
    Tensors are taken whole while they fit; the one that does not fit what is left of the sample (in a large
    model, the first: its tensors are larger than the whole sample) gives its leading elements, so the sample
    is its size however large the tensors."""
    if not changed:
        return []
    order = sorted(snapshot, key=lambda n: (xxhash.xxh3_64_intdigest(n.encode(), seed=salt), n))
    total = sum(t.numel() for t in snapshot.values())
    target = min(total, max(SAMPLE_MIN_ELEMENTS, min(SAMPLE_MAX_ELEMENTS, int(total * SAMPLE_FRACTION))))
    picked = _fill(snapshot, order, target)
    if not changed.intersection(n for n, _k in picked):     # the first changed tensor first, then as before
        first = next(n for n in order if n in changed)
        picked = _fill(snapshot, [first] + [n for n in order if n != first], target)
    return picked


def _fill(snapshot: Mapping[str, torch.Tensor], order: list[str], target: int) -> list[tuple[str, int]]:
    picked: list[tuple[str, int]] = []
    left = target
    for name in order:
        if left <= 0:
            break
        k = snapshot[name].numel()
        picked.append((name, min(k, left)))
        left -= k
    return picked


def _part(t: torch.Tensor, n: int) -> torch.Tensor:
    """A copy of ``t``, or of its first ``n`` elements (flat) when that is fewer."""
    return t.clone() if n >= t.numel() else t.reshape(-1)[:n].clone()


def take_sample(parent: Mapping[str, torch.Tensor], snapshot: Mapping[str, torch.Tensor], changed: set[str], *,
                version: int, explored: str, digests: Mapping[str, int] | None = None,
                grandparents: Mapping[str, torch.Tensor] | None = None) -> Sample | None:
    """Copies of a sample of the delta ``parent`` -> ``snapshot`` (``changed``: the names its records changed),
    with what the published encode had beside them (the parents' digests, a LoRA run's grandparents); None when
    nothing changed."""
    names = pick(snapshot, changed, version)
    if not names:
        return None
    known, grand = digests or {}, grandparents or {}
    items = []
    for name, n in names:
        new = snapshot[name]
        g = grand.get(name)
        g = _part(g, n) if g is not None and g.dtype == new.dtype and g.shape == new.shape else None
        whole = n >= new.numel()
        items.append((name, _part(parent[name], n), _part(new, n), known.get(name) if whole else None, g))
    return Sample(version, explored, items, sum(t.numel() for _n, _o, t, _d, _g in items))


def measure(sample: Sample, level: int, stop: threading.Event) -> tuple[Measurement, Measurement] | None:
    """Both codecs' encodes of ``sample`` on this thread alone, (context, fast), each timed by this thread's CPU
    time (the encode runs inline on one thread: all of it is this thread's); None once ``stop`` is set. The order
    alternates with the version, so neither codec always runs on the caches the other warmed."""
    out: dict[str, Measurement] = {}
    order = (CONTEXT, FAST) if sample.version % 2 == 0 else (FAST, CONTEXT)
    for codec in order:
        changed = stored = 0
        t0 = time.thread_time()
        records = encode_many(sample.items, threads=1, level=level, context=codec == CONTEXT)
        with closing(records):
            for enc in records:
                if stop.is_set():
                    return None
                chunks = enc.header.chunks
                if all(c.encoding == UNCHANGED for c in chunks):
                    continue
                changed += sum(c.count for c in chunks)
                stored += len(enc.to_bytes())
        out[codec] = Measurement(sample.elements, changed, time.thread_time() - t0, stored)
    return out[CONTEXT], out[FAST]


class Explorer:
    """At most one measurement at a time, each on a thread of its own; ``on_pair`` gets its result.

    The publish thread hands :meth:`schedule` a sample as its publish succeeds (from then on the explorer is busy:
    a delta chosen meanwhile asks for no measurement) and :meth:`go` starts it once the publish's result is out.
    A measurement only ever informs the chooser: one that fails is logged and forgotten, one still running at
    :meth:`close` is told to stop and left behind after ``CLOSE_WAIT_S`` (it holds nothing but its copies); the
    interpreter's exit waits for it to end at its next record."""

    def __init__(self, level: int, on_pair: Callable[[Measurement, Measurement], None], what: str = ""):
        self.level, self._on_pair, self._what = level, on_pair, what
        self._pending: Sample | None = None
        self._stop = threading.Event()
        self._done = threading.Event()      # set while no measurement is scheduled or running
        self._done.set()
        self._closed = False
        self._lock = threading.Lock()     # go() may run in the caller's thread and the publish thread at once

    @property
    def busy(self) -> bool:
        """Whether a measurement is scheduled or running."""
        return not self._done.is_set()

    def schedule(self, sample: Sample) -> bool:
        """Hold ``sample`` for :meth:`go`, unless a measurement is scheduled or running or this explorer is closed."""
        with self._lock:
            if self._closed or self.busy:
                return False
            self._pending, self._stop, self._done = sample, threading.Event(), threading.Event()
            return True

    def go(self) -> None:
        """Start measuring the scheduled sample, if any, on a thread of its own."""
        with self._lock:
            sample, self._pending = self._pending, None
            if sample is None:
                return
            if self._closed:
                self._done.set()
                return
            # not a daemon: the interpreter's exit waits for it (told to stop at close, it ends at its next
            # record), where a daemon thread still inside a kernel as the interpreter finalizes aborts the process
            # ("terminate called without an active exception": a README LoRA snippet, once in four fresh runs)
            threading.Thread(target=self._run, args=(sample, self._stop, self._done), daemon=False,
                             name=f"ckptdelta-explore-v{sample.version}").start()

    def _run(self, sample: Sample, stop: threading.Event, done: threading.Event) -> None:
        try:
            yield_cores()
            pair = measure(sample, self.level, stop)
            if pair is not None and not stop.is_set():
                self._on_pair(*pair)
        except Exception as e:  # noqa: BLE001 - a measurement never fails a publish: the chooser goes without it
            log.warning("%smeasuring both codecs on a sample of version %d (for %s) failed: %s: %s; the codec "
                        "choice goes on without it", self._what, sample.version, sample.explored,
                        type(e).__name__, e)
        finally:
            done.set()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the scheduled or running measurement (if any) to end; whether none is left."""
        return self._done.wait(timeout)

    def close(self, timeout: float = CLOSE_WAIT_S) -> None:
        """No measurement starts after this; a running one is told to stop and waited for at most ``timeout``."""
        with self._lock:
            self._closed = True
            self._stop.set()
            if self._pending is not None:
                self._pending = None
                self._done.set()
        if not self.join(timeout):
            log.debug("%sleaving a measurement of the codecs behind at close (still encoding its sample)",
                      self._what)
