"""``Publisher(dtype=torch.bfloat16, keep_exact=True)``: the trainer's fp32 bits attached to each version after
its commit (delta/exact.py, docs/FORMAT.md "Exact attachments").

The attachment is written after publish() has returned, on a thread of its own, so that the replicas, which
read only the bf16 snapshot, start on it the moment it is committed. Its host copy of the fp32 tensors is
taken with the snapshot's, inside publish(), since the trainer may step its weights as soon as publish()
returns; the cast published is made from that copy, on the host.
"""

from __future__ import annotations

import io
import logging
import os
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor, TimeoutError as FuturesTimeout

import torch
import xxhash

from ckptdelta.delta import dtypes
from ckptdelta.delta.batch import encode_many
from ckptdelta.delta.codec import digest_hex
from ckptdelta.delta.container import ObjectWriter
from ckptdelta.delta.errors import ExactAttachError, PublishInputError
from ckptdelta.delta.exact import PART_BYTES, ExactEntry, ExactIndex, index_key, object_key, widen
from ckptdelta.delta.manifest import ObjectRef
from ckptdelta.delta.storage import Store
from ckptdelta.publisher.deltas import encode_threads_for
from ckptdelta.publisher.host_copy import Cast, copy_to_host

log = logging.getLogger("ckptdelta.publisher")


def check_keep_exact(dtype: torch.dtype | None, device_diff: bool, max_in_flight: int) -> None:
    """``keep_exact=True`` checked against the rest of the Publisher's arguments (ValueError naming the clash)."""
    if dtype != torch.bfloat16:
        raise ValueError("keep_exact=True keeps the fp32 bits of a run published as bf16: it needs "
                         f"dtype=torch.bfloat16, got dtype={dtype}")
    if device_diff:
        raise ValueError("keep_exact=True copies the fp32 weights to the host; device_diff=True does not")
    if max_in_flight != 1:
        raise ValueError("keep_exact=True needs max_in_flight=1: each attachment is read from its own snapshot")


def check_keep_exact_world(world: int) -> None:
    if world > 1:
        raise ValueError("keep_exact=True needs a publisher of one process (world size 1)")


class ExactAttacher:
    """Takes the fp32 host copy in publish(), writes each committed version's attachment in the background.

    One attachment is written at a time (one worker thread: an attachment still running when a join was
    skipped, by an interrupt, is still over before the next one starts). The next publish() waits for the one
    before (:meth:`join`) before its host copy: an attachment reads its snapshot, whose buffers later copies
    reuse. A failure is raised by that join, once, as :class:`ExactAttachError` naming the version.

    The published bf16 is cast from the fp32 host copy where that is the very cast ``Publisher(dtype=...)``
    makes without keep_exact (a contiguous CPU tensor, a numpy array: ``.to()`` of the same contiguous bits);
    a strided or device tensor is cast from itself, as without keep_exact (torch's casts of a NaN differ
    between its contiguous and strided kernels, and between devices)."""

    def __init__(self, store: Store, run_id: str, encode_threads: int | None) -> None:
        self.store, self.run_id, self.encode_threads = store, run_id, encode_threads
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ckptdelta-exact")
        self._lock = threading.Lock()
        self._pending: tuple[int, Future] | None = None
        self._spare: dict[str, torch.Tensor] = {}

    def copy(self, sources: Cast) -> tuple[dict[str, torch.Tensor], Cast]:
        """The fp32 tensors' host copy, and ``sources`` to cast from it (the host's cast, one pass each)."""
        raw = sources.sources
        names = []
        for n, t in raw.items():
            dt = dtypes.of(t).torch_dtype
            if not dt.is_floating_point:
                continue
            if dt == torch.float32:
                names.append(n)
            elif dt != sources.dtype:
                raise PublishInputError(f"tensor {n!r} is {dt}: keep_exact=True keeps the exact bits of float32 "
                                        f"tensors published as {sources.dtype}; publish it as it is or cast it "
                                        "to float32 first")
        with self._lock:
            spare, self._spare = self._spare, {}
        exact = copy_to_host(raw, spare, names)
        same_cast = {n: exact[n] for n in names if not isinstance(raw[n], torch.Tensor)
                     or (raw[n].device.type == "cpu" and raw[n].is_contiguous())}
        return exact, Cast({**raw, **same_cast}, sources.dtype)

    def attach(self, version: int, data_id: str, snapshot: Mapping[str, torch.Tensor],
               exact: dict[str, torch.Tensor]) -> None:
        """Write ``version``'s attachment in the background (after its commit)."""
        fut = self._pool.submit(self._write, version, data_id, snapshot, exact)
        with self._lock:
            self._pending = (version, fut)

    def join(self, timeout: float | None = None) -> None:
        """Wait for the attachment in flight; raise its failure once (ExactAttachError naming the version).
        It is forgotten only once waited for: an interrupt of the wait leaves it for the next join."""
        with self._lock:
            pending = self._pending
        if pending is None:
            return
        version, fut = pending
        err = fut.exception(timeout)       # TimeoutError past ``timeout``: still pending
        with self._lock:
            if self._pending is pending:
                self._pending = None
        if err is not None:
            raise ExactAttachError(f"run {self.run_id}: the exact fp32 bits of version {version} were not attached "
                                   f"({type(err).__name__}: {err}); the version is committed and served as bf16, "
                                   "and a reader asking for its exact bits is told they are missing") from err

    def finish(self, timeout: float | None = None) -> None:
        """:meth:`join`, with a failure logged rather than raised (the with-block left on an error, exit), and
        past ``timeout`` seconds given up on, logged too."""
        try:
            self.join(timeout)
        except ExactAttachError as e:
            log.error("%s", e)
        except FuturesTimeout:
            with self._lock:
                version = self._pending[0] if self._pending else None
            log.error("run %s: the exact fp32 bits of version %s were still being attached %gs after the publishes "
                      "ended; given up on, that version may have none", self.run_id, version, timeout)

    def close(self) -> None:
        """Wait for the attachment in flight; a failure no call raised yet is logged."""
        self._pool.shutdown(wait=True)
        self.finish()

    def _write(self, version: int, data_id: str, snapshot: Mapping[str, torch.Tensor],
               exact: dict[str, torch.Tensor]) -> None:
        """Each fp32 tensor's record against its widened bf16, in objects of about PART_BYTES each (one held at
        a time), then the index that names them: its create-only write is what makes the attachment whole."""
        t0 = time.perf_counter()
        objects: list[ObjectRef] = []
        entries: dict[str, ExactEntry] = {}
        nbytes = sum(t.numel() * 4 for t in exact.values())
        threads = self.encode_threads or encode_threads_for(nbytes, os.cpu_count() or 1)   # as the delta's
        items = ((n, torch.from_numpy(widen(dtypes.host_bits(snapshot[n]))).reshape(t.shape), t)
                 for n, t in sorted(exact.items()))
        buf = w = None

        def flush() -> None:
            size = w.finish()
            blob = buf.getbuffer()
            key = object_key(version, data_id, len(objects))
            self.store.put(key, blob)
            objects.append(ObjectRef(key, size, digest_hex(xxhash.xxh3_64_intdigest(blob))))

        for enc in encode_many(items, threads=threads, context=False):
            if w is None:
                buf = io.BytesIO()
                w = ObjectWriter(buf)
            off, length = w.add(enc.name, enc.to_bytes())
            entries[enc.name] = ExactEntry("F32", digest_hex(enc.header.digest), len(objects), off, length)
            if off + length >= PART_BYTES:
                flush()
                buf = w = None
        if w is not None:
            flush()
        for n, t in snapshot.items():       # bf16 as the trainer held it: said so, so that none goes missing
            if n not in exact and t.dtype == torch.bfloat16:
                entries[n] = ExactEntry("BF16")
        index = ExactIndex(self.run_id, version, tuple(objects), entries)
        self.store.put_if_absent(index_key(version), index.to_json())
        with self._lock:
            self._spare = exact          # the attachment is written: its host copy takes the next one
        log.info("run %s: attached the exact fp32 bits of version %d (%d tensors, %d bytes in %d objects) in %.2fs",
                 self.run_id, version, len(exact), sum(o.size for o in objects), len(objects),
                 time.perf_counter() - t0)
