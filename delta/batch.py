"""Encode or apply many tensors in one call, their chunks spread over the codec's threads.

:func:`~ckptdelta.delta.codec.encode` and :func:`~ckptdelta.delta.codec.apply_` parallelise over the
chunks of one tensor, and a model is mostly tensors of one to sixteen chunks
(small models: one), so tensor by tensor a second core rarely has work. Here each
chunk of each tensor, and each tensor's digests, is a task (a one-chunk tensor is
one task), run by the caller's thread and workers of the shared codec pool: two
small tensors run on two cores at once and a big one still spreads.

Work runs at most a window of chunk tasks ahead of the caller, so memory stays
bounded on a model of any size; results come back in input order, and each one is
exactly what the one-tensor call gives. Kernels, zstd and xxhash release the GIL,
which is why threads (not processes) scale here.
"""

from __future__ import annotations

import os
import threading
from collections import deque
from collections.abc import Callable, Container, Iterable, Iterator
from functools import partial
from typing import Any

import numpy as np
import torch
import xxhash

from ckptdelta.delta import chunks, codec, dtypes
from ckptdelta.delta.codec import DEFAULT_CHUNK_ELEMS, EncodedTensor, StagedTensor
from ckptdelta.delta.errors import ChecksumError, DeltaError, ParentMismatchError

#: Chunk tasks in flight per thread, by default: enough that the pool keeps busy while the caller
#: handles a result, few enough that lookahead memory stays a handful of chunks.
WINDOW_PER_THREAD = 4

#: The bytes of tensors each thread of a batch is given at least (:func:`threads_for`): on tensors of tens to
#: hundreds of KB, a second thread mostly waits for the GIL the first holds between its short kernels (a LoRA
#: step's hundreds of tensors encode and stage faster on one thread of 2 cores; docs/PERFORMANCE.md, "LoRA runs").
BYTES_PER_THREAD = 16 << 20


def threads_for(nbytes: int, cores: int, per_thread: int = BYTES_PER_THREAD) -> int:
    """Threads to encode or stage ``nbytes`` of tensors with on ``cores`` cores: one per ``per_thread`` bytes, at
    least one, at most every core. The publisher's encode and a replica's staging both follow it."""
    return max(1, min(cores, nbytes // per_thread))


class _Task:
    """One unit of work and its outcome, for the caller to collect in its own order."""

    __slots__ = ("fn", "value", "error", "done", "_running")

    def __init__(self, fn: Callable[[], Any]):
        self.fn, self.value, self.error, self.done = fn, None, None, False
        # held until the task has run: a bare lock, a third of an Event's cost (a batch makes one per tensor)
        self._running = threading.Lock()
        self._running.acquire()

    def run(self) -> None:
        try:
            self.value = self.fn()
        except BaseException as e:  # noqa: BLE001 - handed to whoever collects the result
            self.error = e
        finally:
            self.fn = None
            self.done = True
            self._running.release()

    def result(self) -> Any:
        if not self.done:
            with self._running:
                pass
        if self.error is not None:
            raise self.error
        return self.value


class _Runner:
    """One batch call's tasks, at most ``threads`` at once, taken in submission order.

    The calling thread is one of the workers: whenever it waits for a result it runs
    queued tasks itself (the awaited one first). ``threads - 1`` workers of the shared
    codec pool ("lanes") take tasks from this call's own queue meanwhile, so work goes
    on while the caller is elsewhere and :meth:`close` can drop what has not started.
    (On 2 cores, caller + 2 lanes was slower: three threads time-sliced, and each
    short task waited on a hand-off.) Runs everything inline with one thread, and on a
    thread of the codec pool itself, where waiting on the pool could deadlock it."""

    def __init__(self, threads: int | None):
        self.threads = max(1, threads if threads is not None else (os.cpu_count() or 1))
        self.inline = self.threads == 1 or codec.in_pool_worker()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._queue: deque[_Task] = deque()
        self._lanes = 0
        self._closed = False

    def submit(self, fn: Callable[[], Any]) -> _Task:
        task = _Task(fn)
        if self.inline:
            task.run()
            return task
        with self._lock:
            self._queue.append(task)
            if self._lanes >= self.threads - 1:
                return task
            self._lanes += 1
        try:
            codec._executor().submit(self._lane)
        except RuntimeError:
            # the interpreter is shutting down its pools, or no thread could be started: run the lane
            # here. In the second case the pool had queued it already and may run it later too, like any
            # lane; it then counts itself out once more, which close() tolerates.
            self._lane()
        except BaseException:
            # an interrupt (KeyboardInterrupt) inside the pool's submit: the lane counted above may never
            # run, and close() would wait for it forever. Count it out now; if the pool had queued it, it
            # counts itself out again when it finds the call closed, which close() tolerates.
            with self._lock:
                self._lanes -= 1
                self._idle.notify_all()
            raise
        return task

    def _lane(self) -> None:
        while True:
            with self._lock:
                if self._closed or not self._queue:
                    self._lanes -= 1
                    self._idle.notify_all()
                    return
                task = self._queue.popleft()
            task.run()

    def wait(self, task: _Task) -> Any:
        """``task``'s result, running the call's queued tasks (the awaited one first) until it is done."""
        while not task.done:
            with self._lock:
                try:
                    self._queue.remove(task)
                    todo = task
                except ValueError:
                    todo = self._queue.popleft() if self._queue else None
            if todo is None:
                break
            todo.run()
        return task.result()

    def close(self) -> None:
        """Drop the tasks not started and wait for those running: nothing of this call runs after it returns."""
        with self._lock:
            self._closed = True
            self._queue.clear()
            while self._lanes > 0:      # < 0 when a lane ran twice (see submit)
                self._idle.wait()


def _name_it(e: BaseException, name: str | None, index: int) -> BaseException:
    """Make sure an error says which tensor it is about (codec errors do; anything else gets a note)."""
    if isinstance(e, Exception) and (name is None or repr(name) not in str(e)):
        e.add_note(f"(while handling tensor {name!r}, item {index} of the batch)" if name is not None
                   else f"(while handling item {index} of the batch)")
    return e


# --- encode ---------------------------------------------------------------------------


class _Encoding:
    """One tensor's encode in flight: a task per chunk and one for its digests (a one-chunk tensor
    is a single task: on small tensors a hand-off between threads costs more than it saves)."""

    def __init__(self, runner: _Runner, index: int, item: tuple, level: int, context: bool, chunk_elems: int,
                 fast_alone: Container[str] = ()):
        self.index, self.name, self.error = index, None, None
        try:
            name, old, new, *rest = item
            if len(rest) > 2:
                raise TypeError("encode_many items are (name, old, new[, parent_digest[, grandparent]]), got "
                                f"{len(item)} fields")
            self.name = name
            job = codec._EncodeJob.prepare(old, new, name=name, chunk_elems=chunk_elems, level=level,
                                           parent_digest=rest[0] if rest else None, context=context,
                                           grandparent=rest[1] if len(rest) > 1 else None,
                                           fast_alone=name in fast_alone)
        except Exception as e:
            self.error, self.weight = e, 1
            return
        self.job, self.weight = job, max(1, job.n_chunks)
        if job.n_chunks <= 1:
            self.chunks = []
            self.digests = runner.submit(partial(_encode_whole, job))
        else:
            self.chunks = [runner.submit(partial(job.chunk, i)) for i in range(job.n_chunks)]
            self.digests = runner.submit(partial(_digests, job))

    def result(self, runner: _Runner) -> EncodedTensor:
        if self.error is not None:
            raise _name_it(self.error, self.name, self.index)
        try:
            results = [runner.wait(t) for t in self.chunks]
            digest, parent, *whole = runner.wait(self.digests)
            return self.job.assemble(whole[0] if whole else results, digest, parent)
        except Exception as e:
            raise _name_it(e, self.name, self.index) from None


class _Failed:
    """The items' own error, raised in its turn (after the records admitted before it)."""

    weight = 0

    def __init__(self, error: Exception):
        self.error = error

    def result(self, runner: _Runner) -> EncodedTensor:
        raise self.error


def _digests(job: codec._EncodeJob) -> tuple[int, int]:
    return job.digest(), job.parent_digest()


def _encode_whole(job: codec._EncodeJob) -> tuple[int, int, list]:
    return job.digest(), job.parent_digest(), [job.chunk(i) for i in range(job.n_chunks)]


def encode_many(items: Iterable[tuple], *, threads: int | None = None, level: int = chunks.DEFAULT_LEVEL,
                context: bool = True, chunk_elems: int = DEFAULT_CHUNK_ELEMS,
                window: int | None = None, fast_alone: Container[str] = ()) -> Iterator[EncodedTensor]:
    """:func:`~ckptdelta.delta.codec.encode` for every ``(name, old, new)`` (or ``(name, old, new, parent_digest)``,
    or ``(name, old, new, parent_digest, grandparent)``; either may be None) of ``items``, lazily and in
    order, each record byte-identical to encode()'s.

    ``threads``: threads working at once, this one (while it waits for a record) and
    ``threads - 1`` of the codec pool (default: every core; 1 runs all in this thread,
    deterministically). ``window``: chunk tasks admitted ahead of the record the caller is
    waiting for (default ``4 * threads``; a tensor bigger than that is admitted alone),
    so memory holds a few chunks' work, not the model's. ``items`` is read no further
    ahead than that. An error (naming its tensor) comes out of the iteration after the
    records before it; leaving the iteration early drops the work not yet started. ``fast_alone``: names of
    tensors whose chunks try the fast path's own encoding only (``chunks.encode_chunk``'s ``fast_alone``)."""
    runner = _Runner(threads)
    window = _window(window, runner)
    pending: deque[_Encoding] = deque()
    admitted = index = 0
    source: Iterator[tuple] | None = iter(items)
    try:
        while True:
            while source is not None and (not pending or (not runner.inline and admitted < window)):
                try:
                    item = next(source, None)
                except Exception as e:      # the items failing: after the records admitted before it
                    pending.append(_Failed(e))
                    source = None
                    break
                if item is None:
                    source = None
                    break
                job = _Encoding(runner, index, item, level, context, chunk_elems, fast_alone)
                index += 1
                pending.append(job)
                admitted += job.weight
                if job.error is not None:
                    source = None           # nothing after a bad item: it is where the iteration stops
            if not pending:
                return
            job = pending.popleft()
            admitted -= job.weight
            yield job.result(runner)
    finally:
        runner.close()


def _window(window: int | None, runner: _Runner) -> int:
    if window is None:
        return WINDOW_PER_THREAD * runner.threads
    if window < 1:
        raise ValueError(f"window must be at least 1, got {window}")
    return window


# --- apply ----------------------------------------------------------------------------


class _Applying:
    """One tensor's apply in flight: decoded against the live bits by tasks, then written by one more
    task (scatter, result digest), keeping the old bits of what it changed for the batch's rollback.
    A tensor of one chunk is one task from decode to result digest, written before its turn:
    the batch rolls back whatever was written, so only the order in which errors are judged matters."""

    def __init__(self, runner: _Runner, index: int, item: tuple, verify: bool, method: str):
        self.index, self.name, self.error, self.weight, self.undo = index, None, None, 1, []
        self.staged: StagedTensor | None = None
        self.write: _Task | None = None
        self.verify, self.method = verify, method
        try:
            live, enc, *rest = item
            if len(rest) > 1:
                raise TypeError(f"apply_many items are (live, enc[, grandparent]), got {len(item)} fields")
            enc = codec._as_encoded(enc)
            h = enc.header
            self.name, self.live, self.enc = h.name, live, enc
            self.grand = codec._grand_bits(enc, rest[0] if rest else None)
            in_place = codec._in_place(live, h, method)
        except Exception as e:
            self.error = e
            return
        self.weight = max(1, len(h.chunks))
        self.bits: np.ndarray | None = None
        self.stage: _Task | None = None
        if not in_place:           # device, strided or method="torch": stage, then apply as apply_() does
            self.stage = runner.submit(partial(codec.stage, live, enc, verify=verify, threads=1,
                                               grandparent=rest[0] if rest else None))
            return
        if len(h.chunks) <= 1:     # the task takes the view of the bits too: fewer calls into torch here
            self.write = runner.submit(self._whole)
            return
        try:
            self.bits = dtypes.host_bits(self.live)     # a view: codec._in_place() said so
        except Exception as e:
            self.error = e
            return
        self.chunks = [runner.submit(partial(codec._decode_chunk, enc, self.bits, i, None, self.grand))
                       for i in range(len(h.chunks))]

    def commit(self, runner: _Runner) -> None:
        """Check what the tasks found; then start writing (in place) or apply the staged change (here)."""
        try:
            if self.error is not None:
                raise self.error
            if self.write is not None:
                return                 # one task does it all
            if self.stage is not None:
                st = runner.wait(self.stage)
                self.stage = self.enc = None    # once written, only the undo is kept for the batch
                undo = _old_bits(self.live, st)
                st.apply_(self.live, method=self.method)
                self.staged = undo
                return
            try:
                per_chunk = [runner.wait(t) for t in self.chunks]
            except DeltaError:
                codec.diagnose_parent(self.enc, self.bits, self.verify)    # nothing of it written yet
                raise
            self.chunks = None
            self.write = runner.submit(partial(self._write, per_chunk))
        except Exception as e:
            raise _name_it(e, self.name, self.index) from None

    def _whole(self) -> int | None:
        h = self.enc.header
        self.bits = dtypes.host_bits(self.live)     # a view: codec._in_place() said so
        try:
            per_chunk = [codec._decode_chunk(self.enc, self.bits, i, None, self.grand) for i in range(len(h.chunks))]
        except DeltaError:
            codec.diagnose_parent(self.enc, self.bits, self.verify)
            raise
        return self._write(per_chunk)

    def _write(self, per_chunk: list[tuple[np.ndarray, np.ndarray]]) -> int | None:
        h = self.enc.header
        for i, (pos, vals) in enumerate(per_chunk):
            codec._write_chunk(self.bits, h, i, pos, vals, self.undo)
            per_chunk[i] = None
        return xxhash.xxh3_64_intdigest(self.bits) if self.verify else None

    def settled(self) -> bool:
        return self.write is None or self.write.done

    def verdict(self, runner: _Runner) -> None:
        """Wait for the write; a result that does not hash to the record's digest is this tensor's error."""
        if self.write is None:
            return
        try:
            got = runner.wait(self.write)
        except Exception as e:
            raise _name_it(e, self.name, self.index) from None
        enc, self.enc, self.write = self.enc, None, None    # the undo is all a rollback needs
        h = enc.header
        if self.verify and got != h.digest:
            self.rollback()          # the bits as decoded against, to tell a wrong parent (rolling back twice is
            try:                     # harmless: it writes the same old bits)
                codec.diagnose_parent(enc, self.bits, self.verify)
            except ParentMismatchError as e:
                raise _name_it(e, self.name, self.index) from None
            raise ChecksumError(f"tensor {h.name!r}: reconstructed bytes hash to {codec.digest_hex(got)}, the "
                                f"record says {codec.digest_hex(h.digest)}; no tensor of the batch was changed")

    def rollback(self) -> None:
        if self.staged is not None:
            self.staged.apply_(self.live, method=self.method)
        elif self.undo:
            codec._restore(self.bits, self.undo)


def _old_bits(live: "torch.Tensor | np.ndarray", st: StagedTensor) -> StagedTensor | None:
    """The change that puts back what applying ``st`` overwrites (read on the tensor's own device)."""
    if st.dense is None and st.positions.shape[0] == 0:
        return None
    if isinstance(live, torch.Tensor) and live.device.type != "cpu" and st.dense is None:
        ints = dtypes.torch_bits_view(live.detach().contiguous())
        old = ints[torch.from_numpy(st.positions).to(live.device)].cpu().numpy().view(st.dtype.bits_dtype)
        return StagedTensor(st.name, st.dtype, st.shape, st.parent_digest, st.digest, st.positions, old)
    bits = dtypes.host_bits(live)
    if st.dense is not None:          # the whole tensor (host_bits copied it already off contiguous host memory)
        return StagedTensor(st.name, st.dtype, st.shape, st.parent_digest, st.digest, st.positions,
                            st.values, bits.copy() if codec._shares(bits, live) else bits)
    return StagedTensor(st.name, st.dtype, st.shape, st.parent_digest, st.digest, st.positions, bits[st.positions])


def apply_many(items: Iterable[tuple], *, threads: int | None = None, verify: bool = True,
               method: str = "auto", window: int | None = None) -> None:
    """:func:`~ckptdelta.delta.codec.apply_` for every ``(live, enc)`` or ``(live, enc, grandparent)`` of ``items``
    (``enc``: an EncodedTensor or a record's bytes), all or nothing.

    Each tensor is checked as apply_() checks it (result digest; parent digest on failure). If
    any tensor fails (corrupt record, wrong parent, shape mismatch), every tensor this
    call already wrote gets its old bits back before the error (naming the tensor)
    propagates. The rollback keeps the old bits of the changed elements, at most
    about their count x (4 + itemsize) bytes and never more than the tensors' own.
    ``threads`` and ``window`` as in :func:`encode_many`. The live tensors must not
    share memory with one another (apply tied weights once)."""
    runner = _Runner(threads)
    window = _window(window, runner)
    decoding: deque[_Applying] = deque()
    writing: deque[_Applying] = deque()
    started: list[_Applying] = []       # every tensor admitted: any may have been written
    admitted = index = 0
    judging = reading = False
    source: Iterator[tuple] | None = iter(items)
    try:
        while True:
            while source is not None and (not (decoding or writing)
                                          or (not runner.inline and admitted < window)):
                reading = True
                item = next(source, None)
                reading = False
                if item is None:
                    source = None
                    break
                job = _Applying(runner, index, item, verify, method)
                index += 1
                started.append(job)
                decoding.append(job)
                admitted += job.weight
                if job.error is not None:
                    source = None
            if writing and (writing[0].settled() or not decoding):
                job = writing.popleft()
                judging = True
                job.verdict(runner)
                judging = False
                admitted -= job.weight
                continue        # refill the window before the next wait: draining it idles the other threads
            if decoding:
                job = decoding.popleft()
                writing.append(job)
                job.commit(runner)
            elif not writing and source is None:
                return
    except BaseException as e:
        err = e
        if not judging and isinstance(e, Exception):
            # every tensor before the failure is judged: the first tensor to fail is the one to report. The
            # items failing comes after every tensor admitted, those still decoding too.
            before = [(job, False) for job in writing] + ([(job, True) for job in decoding] if reading else [])
            for job, uncommitted in before:
                try:
                    if uncommitted:
                        job.commit(runner)
                    job.verdict(runner)
                except Exception as e2:
                    err = e2
                    break
        runner.close()
        lost = []
        for job in reversed(started):   # every tensor gets its try, whatever the one before it did
            try:
                job.rollback()
            except Exception as e3:     # noqa: BLE001 - reported on the error that propagates
                lost.append(f"{job.name!r} ({type(e3).__name__}: {e3})")
        if lost:
            err.add_note("restoring the old bits failed for tensor(s) " + ", ".join(reversed(lost))
                         + ": their content is unknown; reload them")
        if err is e:
            raise
        raise err from None
    finally:
        runner.close()
