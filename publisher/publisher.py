"""The trainer's handle on a run: ``Publisher.publish(weights, step)`` -> a committed snapshot.

One publish goes: copy the weights to host memory (in the caller's thread, so
the trainer may step again as soon as publish() returns), then in a background
thread: plan (anchor or delta), write and upload the data objects under this
session's writer prefix, commit the manifest (create-only), move HEAD. Publishes
run one at a time, in call order; each delta is encoded against the exact bits
of the previous committed snapshot, which the publisher keeps as a host copy.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
import weakref
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import replace
from datetime import datetime, timezone
from typing import Any

import torch
import xxhash

from ckptdelta.delta.chunks import DEFAULT_LEVEL
from ckptdelta.delta.codec import digest_hex
from ckptdelta.delta.errors import (CkptDeltaError, ConcurrentPublisherError, ExactAttachError, ManifestError, PublishError,
                                    PublishInputError, RunMismatchError, StorageError)
from ckptdelta.delta.manifest import (Manifest, ObjectRef, anchor_prefix, metadata_problem, now_iso, snapshot_name,
                                      text_problem)
from ckptdelta.delta.storage import Store

from ckptdelta.publisher import lora
from ckptdelta.publisher import anchor as anchor_fmt
from ckptdelta.publisher import explore, rounds, sharded, tempdirs
from ckptdelta.publisher.anchor_files import AnchorFiles
from ckptdelta.publisher.codec_choice import CODECS, CONTEXT, FAST, CodecChooser, Measurement, check_bandwidth, warm_up
from ckptdelta.publisher.distributed import make_comm
from ckptdelta.publisher.job import PublishJob, Skipped
from ckptdelta.publisher.nan import nan_tensor_names
from ckptdelta.publisher.parents import Parents
from ckptdelta.publisher.chain import ChainState, Plan, decide
from ckptdelta.publisher.prefault import Prefault
from ckptdelta.publisher.rebuild import read_chain
from ckptdelta.publisher.result import PublishResult
from ckptdelta.publisher.runs import (commit, committed_manifest, committed_versions, ensure_run_info, move_head,
                                      new_writer_id, read_manifest, read_run_info)
from ckptdelta.publisher.deltas import encode_threads_for
from ckptdelta.publisher.device_diff import DeviceDiff
from ckptdelta.publisher.exact import ExactAttacher, check_keep_exact, check_keep_exact_world
from ckptdelta.publisher.host_copy import (Cast, Partition, Weights, check_publish_dtype, copy_to_host,
                                          gather_sources, schema_of, spares)
from ckptdelta.publisher.writer import Written, merge, write_anchor, write_delta_object

log = logging.getLogger("ckptdelta.publisher")

#: ``Publisher(exit_timeout=...)``'s default: how long the interpreter's exit waits for publishes still in flight.
EXIT_TIMEOUT_S = 600.0


#: A tensor whose chunks all took the fast path's own encoding (sparse) where its dense and raw tries ran tries
#: those again only this many deltas later, sparse alone meanwhile: on a LoRA run's dense steps the tries lose
#: every time and cost about a third of the encode (docs/PERFORMANCE.md, "LoRA runs, the fetch beside the
#: upload"); a tensor whose steps change in kind is weighed again within this many.
FAST_RETRY_EVERY = 8

class Publisher:
    """Publishes a trainer's weights to a run at ``url`` as anchors and deltas.

    Host memory held: the previous published snapshot (a host copy of the exact
    bits published, the parent of the next delta) plus one staging copy per
    publish in flight (``max_in_flight``, default 1), so about
    ``(1 + max_in_flight) x`` the published weights while a publish runs. A
    superseded parent's buffers are kept for the next copy (filling fresh memory
    costs more than the copy), so ``2x`` stays held between publishes too. With
    CUDA weights the staging copies are pinned. Anchor shards also pass through a
    temporary directory (``TMPDIR``): up to 5 shards on local disk at once.

    ``codec`` picks how deltas are coded: ``"auto"`` (the default): per delta,
    whichever of the two below is predicted to get the weights onto a replica
    sooner (publish() -> swapped), from this publisher's own measurements of both
    codecs' encode speed and output and of the upload bandwidth, which
    ``upload_bandwidth`` (bytes/s) seeds (publisher/codec_choice.py); ``"context"``:
    the context coder, the smallest deltas (``context_coding=True`` says the same);
    ``"fast"``: zstd alone, ``context=False``: larger deltas, faster to encode and
    decode (``context_coding=False`` says the same; docs/PERFORMANCE.md measures
    both). Replicas decode both, so any mix is bit-exact.

    ``device_diff=True`` (for weights on a GPU; needs ``max_in_flight=1``) keeps a
    copy of the last published bits on the weights' device, finds the changed
    elements there and moves only their positions and values to the host, where
    the new snapshot is built from the parent's bits (publisher/device_diff.py).
    It costs one more copy of the published weights on the device.

    Anchors are written for the first publish of a run, every ``anchor_every``
    versions, when the chain's delta bytes since the last anchor pass
    ``anchor_chain_fraction`` (default 0.5; 4 for a LoRA run's adapters) of that anchor's size, when tensor
    names, dtypes or
    shapes change, when a delta chain would pass 128, and on ``anchor=True``. A
    change of tensor names, dtypes or shapes is logged as a warning: replicas
    serving the old tensors cannot hot-load the new anchor (docs/PUBLISHING.md).

    ``dtype`` (e.g. ``torch.bfloat16``): the dtype floating-point tensors are
    published in, for a trainer that keeps fp32 master weights while replicas
    serve bf16. Each tensor is cast on its own device before the host copy, so
    only the published bits cross to the host; integer and bool tensors are
    published as they are. None (the default) publishes every tensor as it is.

    ``keep_exact=True`` (with ``dtype=torch.bfloat16``, one process): the run keeps the trainer's fp32 bits too,
    as an attachment to each version written after its commit (docs/PUBLISHING.md "fp32 trainers, bf16
    replicas"): replicas fetch and serve the bf16 snapshot the moment it is committed, while
    ``SnapshotReader.read_exact`` rebuilds the fp32 tensors bit for bit. publish() returns at the commit; the
    next publish(), ``wait_until_finished()`` and ``close()`` wait for the attachment and raise its failure
    (``ExactAttachError``). The bf16 published is the same as without keep_exact.

    ``extra_files`` travel with every anchor, so a replica can load it with
    transformers: a model directory (its config, generation config and tokenizer
    files, what ``ckptdelta publish DIR`` takes) or a mapping of file name -> path
    or bytes. Publishing a transformers model publishes its own ``config.json``
    (in the dtype published; it replaces one in ``extra_files``, with a warning
    naming the fields that differ) and its ``generation_config.json`` when
    ``extra_files`` has none; its tied weights are published once, as
    ``save_pretrained`` writes them. An anchor's ``config.json`` always describes
    its tensors: a ``dtype`` that does not is fixed (a warning names the field), a
    ``tie_word_embeddings`` that does not is refused (PublishInputError). The
    tokenizer must come from ``extra_files`` (``ckptdelta serve`` refuses a
    snapshot without one).

    Sharded trainers (torch.distributed up with more than one rank, unless
    ``distributed=False``): build a Publisher on every rank (a collective call);
    each rank publishes the tensors it holds (an FSDP2 model's state dict of
    DTensors, its own tensors under distinct names, or the full state dict
    filtered by ``partition``: a set of names or a predicate), rank 0 decides and
    commits one manifest. A DTensor is never gathered for a delta: each rank
    encodes its own box of it, listed as the tensor's pieces (publisher/sharded.py);
    an anchor gathers one such tensor at a time into the rank writing its shard.
    Collectives run on ``process_group``, or a new gloo group by default, which waits at most
    ``collective_timeout`` seconds (default 300) for another rank at any step of a publish: long enough for
    a healthy rank to lag (a later publish() call, a larger share of an anchor to upload), short enough that
    a rank that hangs costs the others minutes, not torch's 30. A rank's own failure never waits for it: it
    fails the publish on every rank at the next round they all join (publisher/distributed.py).

    Publishes still in flight when the interpreter exits (``wait=False`` and no ``close()``) are finished
    first, for at most ``exit_timeout`` seconds, and logged (a warning names them, each commit is logged);
    one that fails or is still running then is logged as an error naming its step and version, and a
    publish given up on commits nothing afterwards. Leaving a ``with Publisher(...)`` block on an
    exception finishes them the same way (without the bound), then lets the exception go on.

    ``encode_threads``: the most threads a delta's encode runs on at once (default: one per 16 MiB of the
    step's tensors, at most every core: a small step's many small tensors encode faster on one thread), for a
    trainer that shares its host with a sampler (a co-located vLLM) and keeps cores for it. The bytes are
    the same whatever the number; ``PublishResult.encode_threads`` says what each delta ran on.

    LoRA runs: ``publish(peft_model, step)`` publishes the model's adapter (its tensors under peft's saved
    names; anchors are PEFT adapter directories, and every manifest records the base model and the adapter
    config); ``adapter=AdapterSpec(config, base)`` lets publish() take adapter state dicts instead
    (publisher/lora.py, docs/PUBLISHING.md "LoRA runs").
    """

    def __init__(self, url: str, *, anchor_every: int = 20, anchor_chain_fraction: float | None = None,
                 storage_options: dict[str, Any] | None = None,
                 extra_files: Mapping[str, str | os.PathLike[str] | bytes] | str | os.PathLike[str] | None = None,
                 shard_bytes: int = 5 * 2**30, level: int = DEFAULT_LEVEL, max_in_flight: int = 1,
                 run_id: str | None = None,
                 process_group: Any = None, distributed: bool | None = None, partition: Partition = None,
                 progress: bool | None = None, context_coding: bool | None = None, device_diff: bool = False,
                 codec: str | None = None, upload_bandwidth: float | None = None, dtype: torch.dtype | None = None,
                 adapter: "lora.AdapterSpec | None" = None, collective_timeout: float | None = None,
                 exit_timeout: float = EXIT_TIMEOUT_S, encode_threads: int | None = None, keep_exact: bool = False):
        if not (isinstance(anchor_every, int) and anchor_every >= 1):
            raise ValueError(f"anchor_every must be an int >= 1, got {anchor_every!r}")
        if anchor_chain_fraction is not None and not anchor_chain_fraction >= 0:
            raise ValueError(f"anchor_chain_fraction must be >= 0, got {anchor_chain_fraction!r}")
        if not (isinstance(shard_bytes, int) and shard_bytes >= 1):
            raise ValueError(f"shard_bytes must be a positive int, got {shard_bytes!r}")
        if not (isinstance(max_in_flight, int) and max_in_flight >= 1):
            raise ValueError(f"max_in_flight must be an int >= 1, got {max_in_flight!r}")
        if device_diff and max_in_flight != 1:
            raise ValueError("device_diff=True builds each snapshot from the previous one: it needs max_in_flight=1")
        if run_id is not None and text_problem(run_id) is not None:
            raise ValueError(f"run_id {text_problem(run_id)}, got {run_id!r}")
        if isinstance(exit_timeout, bool) or not (isinstance(exit_timeout, (int, float)) and exit_timeout >= 0):
            raise ValueError(f"exit_timeout must be a number of seconds >= 0, got {exit_timeout!r}")
        if encode_threads is not None and (isinstance(encode_threads, bool) or not isinstance(encode_threads, int)
                                           or encode_threads < 1):
            raise ValueError(f"encode_threads must be an int >= 1 or None (every core), got {encode_threads!r}")
        self.exit_timeout = float(exit_timeout)
        self.encode_threads = encode_threads
        self.url = url
        self.dtype = check_publish_dtype(dtype)
        self.anchor_every = anchor_every
        # None: 0.5, or for a LoRA run's adapters lora.CHAIN_FRACTION (their deltas are dense)
        self.anchor_chain_fraction = None if anchor_chain_fraction is None else float(anchor_chain_fraction)
        self.shard_bytes, self.level, self.progress = shard_bytes, level, progress
        self.codec = _resolve_codec(codec, context_coding, upload_bandwidth)
        self._chooser = CodecChooser(check_bandwidth(upload_bandwidth)) if self.codec == "auto" else None
        # the chooser is fed by the publish thread and by measurements on a sample (publisher/explore.py)
        self._choice_lock = threading.Lock()
        self._explorer = explore.Explorer(level, self._explored, f"run at {url}: ")
        self._last_codec = ""          # the codec of this rank's previous delta (logged when auto switches)
        # tensor -> this rank's delta count when the fast path last tried its other encodings on it and they lost:
        # for FAST_RETRY_EVERY deltas after, its chunks try the fast path's own alone (bytes at stake, never bits)
        self._fast_won: dict[str, int] = {}
        self._deltas = 0
        self._partition = partition
        self._files = AnchorFiles(extra_files, dtype=self.dtype)
        self._anchor_files: dict[str, bytes] = {}          # rank 0: the extra files of the anchor being planned
        tempdirs.sweep()         # what publishers killed mid-publish on this host left in the temp dir
        if keep_exact:
            check_keep_exact(self.dtype, device_diff, max_in_flight)
        self._store = Store.from_url(url, storage_options)
        self._comm = make_comm(process_group, distributed, collective_timeout)
        if keep_exact:
            check_keep_exact_world(self._comm.world)
        if self._comm.world > 1 and max_in_flight > 1:
            # Ranks must agree on which publishes run; with one slot each publish() starts only after
            # the previous one finished on this rank, so every rank sees the same failures.
            log.warning("max_in_flight=%d is reduced to 1 for a sharded publisher", max_in_flight)
            max_in_flight = 1
        self._files.rank = self._comm.rank
        # rank 0's view of the run (others follow its decisions)
        self._chain = ChainState()
        self._anchor_extra: tuple[ObjectRef, ...] = ()
        self._run_info_exists = False
        self._adapter = lora.RunAdapter(adapter)
        self.run_id, self.writer_id, last_step = self._comm.decide(lambda: self._open_run(run_id))
        # keep_exact: each version's fp32 bits, attached after its commit (publisher/exact.py)
        self._exact = ExactAttacher(self._store, self.run_id, encode_threads) if keep_exact else None
        self._parents = Parents()       # what this rank's next delta is encoded against (publisher/parents.py)
        self._box_cache: sharded.BoxCache = {}         # where this rank's boxes of DTensors lie, by layout
        self._lock = threading.Lock()
        self._committed_step: int | None = last_step
        self._last_step: int | None = last_step
        self._spare: dict[str, torch.Tensor] = {}     # buffers for the next host copy
        self._prefault = Prefault(self._lock)          # filling the first spares while the trainer steps
        self._diff = DeviceDiff() if device_diff else None   # the device copy of the last published bits
        self._nan_warned: set[str] = set()
        # Tensors whose bits at version _nan_clean_version were checked free of NaNs: in a delta on that
        # version only their changed elements need a look (the encoder's), not a scan of the whole tensor.
        self._nan_clean: set[str] = set()
        self._nan_clean_version: int | None = None
        self._nan_next: set[str] = set()
        self._n_failures = 0
        self._calls = 0          # publish() calls that reached the rounds: every rank's count is the same
        self._last_failure: str | None = None       # which publish failed last, and why
        self._attempts = 0          # publish attempts planned by this session (rank 0): each one's data prefix
        self._committed_here: int | None = None     # the newest version this session committed (rank 0)
        self._pending_error: BaseException | None = None
        self._fatal: BaseException | None = None
        self._closed = False
        self._abandoned = False     # given up on at interpreter exit: nothing commits any more
        self._slots = threading.BoundedSemaphore(max_in_flight)
        self._jobs: dict[Future, PublishJob] = {}      # publishes in flight
        # wait=False publishes that failed (or were skipped behind a failure) while no call of the caller's
        # raised it yet: logged at exit, or when a with-block is left on an error, so no loss goes unsaid
        self._unreported: list[tuple[str, str]] = []    # (the publish, its error), no job: it holds a snapshot
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="ckptdelta-publish")
        self._warmed: set[torch.dtype] = set()   # dtypes whose kernels auto loaded before a timed delta
        self._uploads = ThreadPoolExecutor(4, thread_name_prefix="ckptdelta-upload")
        # HEAD moves after each commit on a thread of its own, in commit order: publish() returns once the
        # manifest is committed, a PUT sooner (readers find a manifest newer than HEAD without it)
        self._heads = ThreadPoolExecutor(1, thread_name_prefix="ckptdelta-head")
        self._head_moved: Future | None = None
        _LIVE.add(self)

    @property
    def rank(self) -> int:
        return self._comm.rank

    @property
    def world_size(self) -> int:
        return self._comm.world

    @property
    def partition(self) -> Partition:
        """The ``partition=`` this publisher was built with: which names this rank publishes (None: every name
        it is handed)."""
        return self._partition

    @property
    def store(self) -> Store:
        """The run's storage (shared with the background publish thread)."""
        return self._store

    def __repr__(self) -> str:
        return f"Publisher({self.url!r}, run_id={self.run_id!r}, writer_id={self.writer_id!r})"

    # --- the run ---------------------------------------------------------------------

    def _open_run(self, run_id: str | None) -> tuple[str, str, int | None]:
        store = self._store
        info = read_run_info(store)
        versions = committed_versions(store)
        existing = info.run_id if info else None
        if existing is None and versions:     # RUN.json lost: the run is the one its newest readable manifest names
            last = _last_readable(store, versions, None)
            if last is None:
                raise ManifestError(f"{store.url}: no RUN.json and none of its {len(versions)} manifests can be read: "
                                    "this is not a run a publisher can continue; publish to a new URL")
            existing = last.run_id
        if run_id is not None and existing is not None and run_id != existing:
            raise RunMismatchError(f"{store.url} holds run {existing!r}, not run {run_id!r}")
        rid = existing or run_id or f"{datetime.now(timezone.utc):%Y%m%d-%H%M%S}-{new_writer_id()[:8]}"
        self._run_info_exists = info is not None
        if versions:
            try:
                self._follow_chain(versions[-1], rid)
            except CkptDeltaError as e:  # an unreadable chain: the next publish anchors
                log.warning("run %s at %s: cannot read the chain of version %d (%s); the next publish will anchor",
                            rid, store.url, versions[-1], e)
                # The newest manifest itself may be the damaged one (manifests are create-only and gc keeps
                # unreadable ones): the step comes from the last readable one, and the next version still
                # follows the newest that exists, so nothing committed is ever rewritten.
                last = _last_readable(store, versions, rid)
                self._chain = ChainState(last_version=versions[-1], last_step=None if last is None else last.step)
            log.info("run %s at %s: resuming after version %d (step %s)", rid, store.url, versions[-1],
                     self._chain.last_step)
        return rid, new_writer_id(), self._chain.last_step

    def _follow_chain(self, version: int, run_id: str) -> None:
        """Rank 0's view of the run set to end at ``version``, from its manifests (as a new session resumes)."""
        chain = read_chain(self._store, version, run_id)
        self._chain = ChainState.from_chain(chain)
        self._anchor_extra = chain[0].extra_files
        self._adapter.resume(self._store, chain)

    # --- public verbs --------------------------------------------------------------------

    def publish(self, weights: Weights, step: int, *, metadata: dict[str, str] | None = None, wait: bool = True,
                anchor: bool = False) -> "PublishResult | Future[PublishResult]":
        """Publish ``weights`` as the run's next snapshot, for trainer step ``step``.

        ``weights``: an nn.Module (its state_dict), or a mapping of name -> torch
        tensor (any device) or numpy array. With ``wait=False`` returns a Future
        once the weights are copied to host memory; encoding and upload continue
        in the background, and a failure surfaces from the Future and from the
        next publish(), wait_until_finished() or close().

        On a sharded publisher every call takes its place in the ranks' rounds, whatever it raises, so that the
        ranks' calls pair up in order (docs/PUBLISHING.md, "Sharded trainers"): a call that fails on this rank
        before its weights are copied (bad input) raises once every rank has reached it, which fails it there
        too, ``wait=False`` or not; an interrupt of the host copy is raised at once, the others failing the
        call; and a background failure raised by this call makes it publish nothing on any rank (the others'
        call raises :class:`Skipped`).
        """
        t_start = time.perf_counter()
        if self._closed:
            raise PublishError(f"publisher for {self.url} is closed")
        self._slots.acquire()  # with one slot, every earlier publish has finished once this returns
        raised: BaseException | None = None     # what this call raises at once, its job taking its rounds' place
        try:
            err: BaseException | None = None
            skip = False
            snapshot, copy_s, snap, boxes, exact = None, 0.0, None, {}, None
            try:
                self._check_open()
                pending = self._take_pending()
                if pending is not None:
                    if self._comm.world == 1:
                        raise pending
                    # Told here of an earlier failure that every rank had (each one's call failed with it): this
                    # call publishes nothing anywhere, a skip, not a failure of its own, which the other ranks
                    # would keep as theirs to raise in turn.
                    raised, skip = pending, True
                    raise _Told()
                weights, snap = self._adapter.split(weights, f"run {self.run_id} at {self.url}")
                if snap is not None and self._comm.world > 1:
                    raise PublishInputError("a LoRA adapter is published by one process (world size 1): gather "
                                            "it on one rank")
                step, metadata, sources, boxes = self._check_inputs(weights, step, metadata)
                if not self._files.checked and snap is None:
                    self._files.check(weights, self.run_id, self.url)
                t0 = time.perf_counter()
                self._join_prefault()
                if self._exact is not None:
                    self._exact.join()      # the attachment before reads buffers this copy may reuse
                    exact, sources = self._exact.copy(sources)
                with self._lock:
                    spare, self._spare = self._spare, {}
                if self._diff is None:
                    snapshot = copy_to_host(sources, spare)
                else:   # one slot: the last publish has finished, so the parent and its version are settled
                    snapshot = self._diff.capture(sources, self._parents.tensors, self._parents.version, spare)
                copy_s = time.perf_counter() - t0
            except _Told:
                pass
            except BaseException as e:
                # A sharded publisher's ranks must run the same publishes, round for round: this rank's failure
                # joins this publish's rounds and fails it on every rank, so that no rank's next call pairs with
                # another rank's this one.
                if self._comm.world == 1 or (self._closed and isinstance(e, PublishError)):
                    raise
                if not isinstance(e, Exception):    # KeyboardInterrupt: the others fail this publish with it,
                    raised = e                      # and the caller gets it at once
                    e = PublishError(f"rank {self._comm.rank}'s publish() of step {step} was interrupted "
                                     f"({type(e).__name__}) before its weights were copied")
                err = e
            with self._lock:
                self._last_step = step if err is None and not skip else self._last_step
                failures = -1 if skip else self._n_failures     # not this publisher's count: skipped everywhere
                call = self._calls + 1
            # a failure this call raises itself is not kept for a later call to raise again
            job = PublishJob(snapshot=snapshot, schema=None if snapshot is None else schema_of(snapshot), step=step,
                             metadata=metadata if err is None else {}, force_anchor=anchor, error=err,
                             failures_seen=failures, t_start=t_start, wait=wait or err is not None or skip,
                             copy_s=copy_s, adapter=snap, boxes=boxes if err is None else {}, call=call,
                             exact=exact if err is None else None)
            fut = self._worker.submit(self._run_job, job)
            with self._lock:
                self._calls = call
        except BaseException:
            self._slots.release()
            raise
        with self._lock:
            self._jobs[fut] = job
        fut.add_done_callback(self._job_done)
        if raised is not None:
            raise raised
        return fut.result() if wait or err is not None else fut

    def _check_inputs(self, weights: Weights, step: Any,
                      metadata: Any) -> tuple[int, dict[str, str], dict, "sharded.Boxes"]:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise PublishInputError(f"step must be a non-negative int, got {step!r}")
        metadata = dict(metadata or {})
        problem = metadata_problem(metadata)
        if problem is not None:
            raise PublishInputError(f"step {step}: {problem}; nothing was written")
        # a DTensor becomes this rank's box of it: a delta encodes boxes, never a gathered tensor
        sources, boxes = sharded.split_dtensors(gather_sources(weights, self._partition), self._box_cache)
        if not sources and self._comm.world == 1:
            raise PublishInputError("nothing to publish: no tensors")
        with self._lock:
            last = self._last_step
        if last is not None and step < last:
            raise PublishInputError(f"step {step} is lower than the run's last step {last} "
                                    f"(run {self.run_id} at {self.url}); steps may not go backwards")
        return step, metadata, (sources if self.dtype is None else Cast(sources, self.dtype)), boxes

    def wait_until_finished(self) -> None:
        """Block until every publish in flight is committed or failed; raise the first background failure."""
        while True:
            with self._lock:
                pending = list(self._jobs)
            if not pending:
                break
            for f in pending:
                f.exception()  # waits; the error itself is kept in _pending_error
            with self._lock:
                for f in pending:
                    if f.done():
                        self._jobs.pop(f, None)
        self._wait_head()
        attach_err = None
        if self._exact is not None:
            try:
                self._exact.join()
            except ExactAttachError as e:
                attach_err = e
        try:
            self._raise_pending()
        except BaseException:
            if attach_err is not None:       # said here: the error raised is the publish's own
                log.error("%s", attach_err)
            raise
        if attach_err is not None:
            raise attach_err

    def _wait_head(self) -> None:
        """Until HEAD names the newest commit (move_head never raises)."""
        moved = self._head_moved
        if moved is not None:
            moved.result()

    def close(self) -> None:
        """Finish what is in flight, then release threads and connections. Idempotent."""
        if self._closed:
            return
        try:
            self.wait_until_finished()
        finally:
            self._release()

    def _release(self) -> None:
        self._closed = True
        _LIVE.discard(self)
        self._explorer.close()
        self._join_prefault()
        self._worker.shutdown(wait=True)
        self._uploads.shutdown(wait=True)
        self._heads.shutdown(wait=True)
        if self._exact is not None:
            self._exact.close()
        self._store.close()

    def __enter__(self) -> "Publisher":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
            return
        if self._closed:
            return
        # The caller's error goes on once the publishes in flight are finished; what they became is logged
        # (the error a close() would raise is not: it would hide the caller's).
        try:
            self._finish(None, f"the with-block was left on {exc_type.__name__}")
        finally:
            self._release()

    # --- the end of the process ------------------------------------------------------------

    def _finish(self, timeout: float | None, why: str) -> None:
        """Wait for the publishes in flight (at most ``timeout`` seconds), logging each one's end: a commit on
        INFO, a failure on ERROR naming its step and version, as for any failure no call of the caller's
        raised yet. Past ``timeout`` the rest are given up on: they commit nothing (a commit already under
        way is waited for), and each is logged as lost."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            pending = dict(self._jobs)
        if pending:
            log.warning("run %s at %s: %d publish(es) in flight (%s) when %s; finishing them%s", self.run_id,
                        self.url, len(pending), _steps(pending.values()), why,
                        "" if timeout is None else f" (at most {self.exit_timeout:g}s: Publisher(exit_timeout=...))")
            _done, late = wait_futures(pending, timeout=timeout)
            if late:
                with self._lock:
                    self._abandoned = True
                    committing = [f for f in late if pending[f].committing]
                wait_futures(committing)     # past the point of no return: its answer is the truth
            for f, job in sorted(pending.items(), key=lambda fj: fj[1].step):
                if not f.done():
                    log.error("run %s at %s: %s was not committed: still running %gs after %s; given up on, it "
                              "commits nothing", self.run_id, self.url, job.describe(), self.exit_timeout, why)
                elif f.exception() is None:
                    r = f.result()
                    log.info("run %s at %s: %s committed as %s (%s) when %s", self.run_id, self.url,
                             job.describe(), r.name, r.kind, why)
                elif job.wait:      # its publish() call was interrupted (Ctrl-C): nobody else will say this
                    log.error("run %s at %s: %s was not published (%s: %s); nothing of it is committed",
                              self.run_id, self.url, job.describe(), type(f.exception()).__name__, f.exception())
        if self._exact is not None:
            self._exact.finish(None if deadline is None else max(0.0, deadline - time.monotonic()))
        with self._lock:
            lost, self._unreported = self._unreported, []
            self._pending_error = None
        for what, e in lost:
            log.error("run %s at %s: %s was not published (%s); nothing of it is committed", self.run_id, self.url,
                      what, e)

    # --- bookkeeping -----------------------------------------------------------------------

    def _start_prefault(self, like: Mapping[str, torch.Tensor]) -> None:
        """Fill buffers for the next host copy while the trainer steps (publisher/prefault.py); under the lock."""
        self._prefault.start(like, self._spare, lambda target: self._spare is target)

    def _join_prefault(self) -> None:
        self._prefault.join()

    def _check_open(self) -> None:
        if self._closed:
            raise PublishError(f"publisher for {self.url} is closed")
        if self._fatal is not None:
            raise self._fatal

    def _take_pending(self) -> BaseException | None:
        """The background failure not yet raised to the caller, who hears of it now (once)."""
        with self._lock:
            err, self._pending_error = self._pending_error, None
            if err is not None:
                self._unreported.clear()
        return err

    def _raise_pending(self) -> None:
        err = self._take_pending()
        if err is not None:
            raise err

    def _job_done(self, fut: Future) -> None:
        with self._lock:
            self._jobs.pop(fut, None)
        self._explorer.go()     # what this publish scheduled, now that its result is out: beside the next step

    def _explored(self, context: Measurement, fast: Measurement) -> None:
        """A measurement's pair, from its thread: the chooser learns from it unless this publisher is closed."""
        with self._choice_lock:
            if not self._closed and self._chooser is not None:
                self._chooser.observe_pair(context, fast)
                log.debug("run %s: measured both codecs on a sample: context %.4f s, %d bytes; fast %.4f s, %d "
                          "bytes (%d elements, %d changed)", self.run_id, context.encode_s, context.stored_bytes,
                          fast.encode_s, fast.stored_bytes, context.elements, context.changed)

    def _run_job(self, job: PublishJob) -> PublishResult:
        try:
            return self._execute(job)
        except BaseException as e:
            if job.version is not None and isinstance(e, Exception):
                # the version this publish was planned as, for whoever reports the failure (nothing committed)
                try:
                    e.publish_version = job.version     # type: ignore[attr-defined]
                except AttributeError:                 # an exception type that takes no attributes
                    pass
            with self._lock:
                self._last_step = self._committed_step
                if not job.wait and self._pending_error is None and not isinstance(e, Skipped):
                    self._pending_error = e
                if not job.wait:
                    self._unreported.append((job.describe(), f"{type(e).__name__}: {e}"))
            raise
        finally:
            self._slots.release()

    # --- one publish, in the worker thread ------------------------------------------------------

    def _execute(self, job: PublishJob) -> PublishResult:
        """One publish on this rank, as the rounds every rank runs in the same order (publisher/rounds.py)."""
        skip = job.failures_seen != self._n_failures
        try:
            plan, written, outcome = rounds.run(self._comm, _Steps(self), job, self._parents, skip=skip,
                                                shard_bytes=self.shard_bytes, run_id=self.run_id)
        except Skipped as e:
            failed = self._last_failure if skip else None
            if failed is None:
                raise
            raise Skipped(f"{e}: {failed}") from None
        except BaseException as e:
            # words, not the exception: its traceback would hold the failed publish's snapshot
            self._last_failure = f"{job.describe()} failed ({type(e).__name__}: {e})"
            self._n_failures += 1
            self._committed_here = None       # the next publish checks its version first (a lost commit, a race)
            if isinstance(e, ConcurrentPublisherError):
                self._fatal = e
            raise
        result = self._committed(plan, job, written, outcome)
        if job.exploration is not None:     # started by _job_done, once this result is out
            self._explorer.schedule(job.exploration)
            job.exploration = None
        return result

    def _plan_round(self, gathered: list[rounds.LocalState],
                    adapter: "lora.AdapterSnapshot | None") -> tuple[Plan, bool] | None:
        """Rank 0: None when a rank skips this publish, else the plan and whether every rank holds its parent."""
        calls = sorted({g.call for g in gathered})
        if len(calls) > 1:
            behind = ", ".join(f"rank {r}: call {g.call}" for r, g in enumerate(gathered))
            raise PublishInputError(f"the ranks of run {self.run_id} are out of step: their publish() calls pair "
                                    f"up differently ({behind}); every rank must call publish() as often as the "
                                    "others, a failed call included. Nothing of this publish is committed")
        if any(g.skip for g in gathered):
            return None
        plan = self._plan(gathered, adapter)
        held = plan.kind == "delta" and all(g.parent_version == plan.parent_version and g.holds_parent
                                            for g in gathered)
        return plan, held

    def _plan(self, gathered: list[rounds.LocalState], adapter: "lora.AdapterSnapshot | None" = None) -> Plan:
        # plain tensors held by one rank each; a DTensor's boxes tiling it (publisher/sharded.py)
        union, layout = sharded.plan_union([g.holdings for g in gathered], self.shard_bytes)
        if not union:
            raise PublishInputError("nothing to publish: no rank holds a tensor")
        steps = sorted({g.step for g in gathered})
        if len(steps) > 1:
            raise PublishInputError(f"ranks disagree on the step being published: {steps}")
        step = steps[0]
        if self._chain.last_step is not None and step < self._chain.last_step:
            raise PublishInputError(f"step {step} is lower than the last committed step {self._chain.last_step} "
                                    f"(version {self._chain.last_version} of run {self.run_id})")
        fraction = self.anchor_chain_fraction
        if fraction is None:
            fraction = lora.CHAIN_FRACTION if adapter is not None else 0.5
        plan = decide(self._chain, union, anchor_every=self.anchor_every, chain_fraction=fraction,
                      force_anchor=any(g.force_anchor for g in gathered), layout=layout.grids())
        plan = replace(plan, layout=layout)
        why = self._adapter.anchor_reason(adapter)    # a LoRA run's new base or adapter config
        if why is not None and (plan.kind == "delta" or plan.schema_change):   # the cause, not its symptom
            plan = replace(plan, kind="anchor", anchor_version=plan.version, reason=why)
        # for an anchor (also one a failed parent rebuild makes); a LoRA anchor is a PEFT adapter directory
        self._anchor_files = (self._files.for_schema(union, self.run_id) if adapter is None
                              else {**self._files.files, **adapter.extra_files})
        if self._committed_here is None or plan.version != self._committed_here + 1:
            # Fail a race with another publisher before uploading anything. Right after this session's own commit
            # of the version before, the request is left out: steady publishing would pay it on every publish for
            # a race that the manifest's create-only commit refuses anyway (the loser's data objects, under keys
            # of its own, are left for gc). The first publish of a session, where another trainer may still run,
            # and every one after a failure keep it.
            if self._own_lost_commit(plan.version):
                return self._plan(gathered, adapter)
        # Every attempt writes under keys of its own: a retry of a failed publish gets the same version, and a
        # PUT of the failed attempt that lands late (a stalled request completed by the server) must never
        # replace an object the retry committed. Rank 0 decides, so all ranks of one attempt share it.
        self._attempts += 1
        return replace(plan, data_id=f"{self.writer_id}-{self._attempts}")

    def _own_lost_commit(self, version: int) -> bool:
        """Fail a race with another publisher for ``version`` before uploading anything; True where ``version``
        is this session's own commit, whose create landed although every answer to it was lost (publish()
        said it failed, runs.py ``commit``): the run then goes on after it, as a new session would, instead of
        taking its own snapshot for another publisher's and stopping for good."""
        m = committed_manifest(self._store, version, self.run_id)
        if m is None:
            return False
        if m.writer_id != self.writer_id:
            raise ConcurrentPublisherError(
                f"run {self.run_id} at {self._store.url}: snapshot {m.name} (version {version}) is already committed "
                f"by another publisher (writer {m.writer_id}, step {m.step}); refusing to fork the run (one "
                "publisher per run)")
        log.warning("run %s: %s (step %s) was committed by this publisher although its commit reported a failure "
                    "(the answers were lost); continuing after it%s", self.run_id, m.where(), m.step,
                    "" if self._exact is None else "; its exact fp32 bits were not attached (keep_exact)")
        self._follow_chain(version, self.run_id)
        self._committed_here = version
        with self._lock:
            if self._committed_step is None or (m.step is not None and m.step > self._committed_step):
                self._committed_step = m.step
        return True

    def _may_commit(self, job: PublishJob, err: BaseException | None) -> BaseException | None:
        with self._lock:     # the last point where giving up at exit (_finish) stops the commit
            if err is None and self._abandoned:
                err = PublishError(f"{job.describe()} of run {self.run_id}: given up on at interpreter exit "
                                   "(Publisher(exit_timeout=...)); nothing is committed")
            job.committing = err is None
        return err

    def _write(self, plan: Plan, job: PublishJob, parent: dict[str, torch.Tensor] | None, shards: list[list[str]],
               first: int, total: int) -> Written:
        try:
            return self._write_files(plan, job, parent, shards, first, total)
        except StorageError:
            raise
        except OSError as e:    # the local files on their way to the bucket: a full disk, a file size limit
            if self._comm.world > 1:
                raise           # a sharded publish names the failing rank and this error on every rank
            raise PublishError(
                f"{job.describe()} of run {self.run_id}: writing this rank's {plan.kind} files in the temp dir "
                f"{tempfile.gettempdir()} failed ({type(e).__name__}: {e}); nothing was committed. Free space there, "
                "or point TMPDIR at a disk with room for the largest shard or part") from e

    def _write_files(self, plan: Plan, job: PublishJob, parent: dict[str, torch.Tensor] | None,
                     shards: list[list[str]], first: int, total: int) -> Written:
        assert job.snapshot is not None
        if plan.kind == "anchor":
            pieced = plan.layout.pieces if plan.layout is not None else {}
            failed: BaseException | None = None
            try:
                written = write_anchor(self._store, self._uploads,
                                       {n: t for n, t in job.snapshot.items() if n not in pieced}, shards,
                                       version=plan.version, writer_id=plan.data_id, first_shard=first,
                                       total_shards=total,
                                       extra_files=self._anchor_files if self._comm.rank == 0 else {},
                                       progress=self.progress,
                                       file_name=None if job.adapter is None else lora.ADAPTER_WEIGHTS_NAME)
            except Exception as e:  # noqa: BLE001 - the pieces' status round reports it to every rank
                if not pieced:
                    raise
                failed = e
            if pieced:      # gathered one tensor at a time into the rank that writes its shard
                pieces = sharded.write_piece_shards(
                    self._comm, self._store, self._uploads, job.snapshot, job.boxes, plan.layout,
                    version=plan.version, writer_id=plan.data_id, first_shard=first + len(shards),
                    total_shards=total, progress=self.progress, failed=failed,
                    context=f"{job.describe()} of run {self.run_id}")
                written = sharded.combine(written, pieces)
        else:
            assert parent is not None
            written = self._write_delta(plan, job, parent)
        self._warn_of_nans(plan, job, written)
        return written

    def _warn_of_nans(self, plan: Plan, job: PublishJob, written: Written) -> None:
        """Warn once per tensor name of NaNs among the published bits; remember which tensors are clean."""
        with_bytes = {n for n, e in written.entries.items() if e.object is not None}
        known = self._nan_clean if plan.kind == "delta" and plan.parent_version == self._nan_clean_version else set()
        known = known & job.snapshot.keys()        # a tensor this rank did not publish last time is not known
        found = [n for n in written.changed_nan if n not in self._nan_warned]
        # a tensor clean in the parent holds a NaN only where a changed element became one (the encoder saw
        # those); any other changed tensor is scanned whole
        scan = sorted(with_bytes - known - set(found))
        found += nan_tensor_names(job.snapshot, scan, self._nan_warned)
        for n in found:
            self._nan_warned.add(n)
            log.warning("tensor %r holds NaN values in version %d (step %d); published as-is, bit-exact",
                        n, plan.version, job.step)
        self._nan_next = (known | with_bytes) - self._nan_warned

    def _write_delta(self, plan: Plan, job: PublishJob, parent: dict[str, torch.Tensor]) -> Written:
        """This rank's delta objects, in the codec ``self.codec`` names or, with "auto", the one its chooser
        predicts to win; when the chooser asks to measure the other one, a sample of this delta is kept for
        that (:meth:`_job_done` starts it once the publish has returned: publisher/explore.py)."""
        assert job.snapshot is not None
        elements = sum(t.numel() for t in job.snapshot.values())
        grand = self._parents.grandparents_for(plan.parent_version)
        choice = None
        if self._chooser is None:
            codec, reason = self.codec, f"fixed: Publisher(codec={self.codec!r})"
        else:
            fresh = {t.dtype for t in job.snapshot.values()} - self._warmed
            if fresh:      # both codecs' kernels loaded before the first delta of a dtype, untimed
                warm_up(fresh)
                self._warmed |= fresh
            # A LoRA run's first delta after an anchor has no grandparent, the later ones do (the context coder's
            # encoding 6): a sample of it would measure a context coder its next deltas do not get.
            typical = job.adapter is None or self._diff is not None or grand is not None
            with self._choice_lock:
                choice = self._chooser.choose(elements, may_explore=typical and not self._explorer.busy)
            codec, reason = choice.codec, choice.reason
            if self._last_codec and codec != self._last_codec:
                log.info("run %s: v%d switches to the %s codec (%s)", self.run_id, plan.version, codec, reason)
            else:
                log.debug("run %s: v%d codec %s (%s)", self.run_id, plan.version, codec, reason)
        self._deltas += 1
        alone = frozenset(n for n, k in self._fast_won.items() if self._deltas - k < FAST_RETRY_EVERY) \
            if codec != CONTEXT else frozenset()
        threads = self.encode_threads or encode_threads_for(sum(t.nbytes for t in job.snapshot.values()),
                                                            os.cpu_count() or 1)
        written = write_delta_object(self._store, parent, job.snapshot, version=plan.version, writer_id=plan.data_id,
                                     rank=self._comm.rank, level=self.level, context=codec == CONTEXT,
                                     progress=self.progress, parent_digests=self._parents.digests,
                                     grandparents=grand, fast_alone=alone, pool=self._uploads, threads=threads)
        if codec != CONTEXT:
            won = set(written.fast_won)
            for name in job.snapshot:
                if name in won:
                    self._fast_won[name] = self._deltas
                elif name not in alone:
                    self._fast_won.pop(name, None)
        sharded.with_boxes(written, job.boxes, plan.layout)      # pieces of a DTensor: merged into one entry
        written.codec, written.codec_reason, written.encode_threads = codec, reason, threads
        if choice is not None:
            with self._choice_lock:
                self._chooser.observe(codec, elements=elements, changed=written.changed_elements,
                                      encode_s=written.encode_s, stored_bytes=sum(o.size for o in written.objects),
                                      upload_s=written.upload_s)
            self._last_codec = codec
            if choice.explore is not None:
                self._keep_sample(plan, job, parent, written, choice.explore, grand)
        return written

    def _keep_sample(self, plan: Plan, job: PublishJob, parent: dict[str, torch.Tensor], written: Written,
                     explored: str, grand: dict[str, torch.Tensor] | None) -> None:
        """Copy the sample the chooser's measurement will encode, now: the parent's buffers are recycled for the
        next host copy once this delta commits. Never fails the publish."""
        changed = {n for n, e in written.entries.items() if e.object is not None and n in job.snapshot}
        try:
            job.exploration = explore.take_sample(parent, job.snapshot, changed, version=plan.version,
                                                  explored=explored, digests=self._parents.digests,
                                                  grandparents=grand)
        except Exception as e:  # noqa: BLE001 - a measurement only informs the next choices
            log.warning("run %s: cannot sample v%d to measure the %s codec (%s: %s); the codec choice goes on "
                        "without it", self.run_id, plan.version, explored, type(e).__name__, e)

    def _commit(self, plan: Plan, job: PublishJob, parts: list[Written]) -> dict[str, Any]:
        t0 = time.perf_counter()
        store = self._store
        objects, entries, weight_map, extra = merge(parts, plan.layout)
        extra_bytes = sum(o.size for o in extra)
        stored = sum(o.size for o in objects) + extra_bytes
        full = sum(e.nbytes for e in entries.values())
        if plan.kind == "anchor":
            if len(objects) > 1:
                key = f"{anchor_prefix(plan.version, plan.data_id)}/{anchor_fmt.INDEX_FILE}"
                data = anchor_fmt.index_json(weight_map, full)
                store.put(key, data)
                objects.append(ObjectRef(key, len(data), digest_hex(xxhash.xxh3_64_intdigest(data))))
                stored += len(data)
            extra_refs = tuple(extra)
        else:
            extra_refs = self._anchor_extra  # the anchor's config/tokenizer, found from any snapshot
        manifest = Manifest(
            run_id=self.run_id, version=plan.version, kind=plan.kind, parent_version=plan.parent_version,
            anchor_version=plan.anchor_version, created=now_iso(), step=job.step, writer_id=self.writer_id,
            objects=tuple(objects), tensors=entries, extra_files=extra_refs, metadata=job.metadata,
            full_bytes=full, stored_bytes=stored, adapter=None if job.adapter is None else job.adapter.record)
        data = manifest.to_json()
        Manifest.from_json(data, run_id=self.run_id)  # never commit what a reader would refuse
        if not self._run_info_exists:                 # nor name a run in RUN.json that its manifests cannot hold
            ensure_run_info(store, self.run_id)
            self._run_info_exists = True
        h = commit(store, manifest, data)
        self._head_moved = self._heads.submit(move_head, store, manifest, h)
        self._committed_here = plan.version
        self._chain = self._chain.advanced(manifest)
        if plan.kind == "anchor":
            self._anchor_extra = extra_refs
        n_changed = sum(1 for e in entries.values() if e.has_data)
        return {"stored": stored, "full": full, "n_changed": n_changed, "n_tensors": len(entries),
                "commit_s": time.perf_counter() - t0, "extra": extra_bytes}

    def _committed(self, plan: Plan, job: PublishJob, written: Written | None, outcome: dict[str, Any]) -> PublishResult:
        assert job.snapshot is not None and written is not None
        # a LoRA delta's parent becomes the next delta's grandparent (small: an adapter); the superseded buffers
        # are the spares of the next copy
        recycled = self._parents.committed(
            job.snapshot, plan.version,
            {n: int(e.xxh3, 16) for n, e in written.entries.items() if n in job.snapshot}, job.boxes,
            keep_grandparent=plan.kind == "delta" and job.adapter is not None and self._diff is None)
        self._nan_clean, self._nan_clean_version = self._nan_next, plan.version
        self._adapter.committed(job.adapter)
        with self._lock:
            self._committed_step = job.step
            self._spare = spares(recycled)
            if not self._spare:
                self._start_prefault(job.snapshot)
        if self._diff is not None:
            self._diff.committed(plan.version)
        if job.exact is not None:
            self._exact.attach(plan.version, plan.data_id, job.snapshot, job.exact)
            job.exact = None
        del recycled
        r = PublishResult(
            version=plan.version, name=snapshot_name(plan.version), kind=plan.kind, parent_version=plan.parent_version,
            anchor_version=plan.anchor_version, step=job.step, stored_bytes=outcome["stored"],
            full_bytes=outcome["full"], ratio=(outcome["stored"] - outcome["extra"]) / max(1, outcome["full"]),
            copy_s=job.copy_s, encode_s=written.encode_s, upload_s=written.upload_s, commit_s=outcome["commit_s"],
            total_s=time.perf_counter() - job.t_start, n_changed_tensors=outcome["n_changed"],
            n_tensors=outcome["n_tensors"], reason=plan.reason, extra_bytes=outcome["extra"],
            schema_change=plan.schema_change, codec=written.codec, codec_reason=written.codec_reason,
            encode_threads=written.encode_threads)
        log.info("published %s of run %s: %s, %d of %d tensors changed, %d bytes (weights: %.2f%% of %d) in "
                 "%.2fs (%s)%s", r.name, self.run_id, r.kind, r.n_changed_tensors, r.n_tensors, r.stored_bytes,
                 100 * r.ratio, r.full_bytes, r.total_s, r.reason, f"; {r.codec} codec" if r.codec else "")
        if r.schema_change and self._comm.rank == 0:
            before = snapshot_name(plan.parent_version) if plan.parent_version is not None else "the previous snapshot"
            log.warning("run %s: %s is an anchor whose tensors differ from %s's (%s); a replica hot-loads only onto "
                        "live tensors of the same names, dtypes and shapes, so one whose live tensors are %s's "
                        "refuses it and every later version (ShapeMismatchError or HotLoadError) and keeps serving "
                        "them until restarted on it: ckptdelta serve --snapshot %s (docs/PUBLISHING.md, "
                        "'Changing tensors')", self.run_id, r.name, before, r.schema_change, before, r.name)
        return r


class _Steps:
    """A Publisher's local steps between the rounds of a publish, as publisher/rounds.py calls them."""

    def __init__(self, pub: Publisher) -> None:
        self._pub = pub

    def plan(self, gathered: list[rounds.LocalState], job: PublishJob) -> tuple[Plan, bool] | None:
        return self._pub._plan_round(gathered, job.adapter)

    def parent(self, plan: Plan, job: PublishJob) -> dict[str, torch.Tensor]:
        assert job.snapshot is not None
        return self._pub._parents.ensure(self._pub._store, self._pub.run_id, plan, job.snapshot, job.boxes)

    def write(self, plan: Plan, job: PublishJob, parent: dict[str, torch.Tensor] | None, shards: list[list[str]],
              first: int, total: int) -> Written:
        return self._pub._write(plan, job, parent, shards, first, total)

    def may_commit(self, job: PublishJob, err: BaseException | None) -> BaseException | None:
        return self._pub._may_commit(job, err)

    def commit(self, plan: Plan, job: PublishJob, parts: list[Written]) -> dict[str, Any]:
        return self._pub._commit(plan, job, parts)


class _Told(Exception):
    """publish(): this call raises an earlier background failure (see there), and publishes nothing."""


def _resolve_codec(codec: Any, context_coding: Any, upload_bandwidth: Any) -> str:
    """``codec`` checked against ``context_coding`` (its older spelling) and ``upload_bandwidth``."""
    choices = (*CODECS, "auto")
    if codec is not None and codec not in choices:
        raise ValueError(f"codec must be one of {', '.join(map(repr, choices))}, got {codec!r}")
    if codec is None:
        codec = "auto" if context_coding is None else CONTEXT if context_coding else FAST
    elif context_coding is not None and codec != (CONTEXT if context_coding else FAST):
        raise ValueError(f"context_coding={bool(context_coding)} asks for the "
                         f"{CONTEXT if context_coding else FAST} codec, but codec={codec!r}: pass codec alone")
    check_bandwidth(upload_bandwidth)
    if upload_bandwidth is not None and codec != "auto":
        raise ValueError(f"upload_bandwidth only seeds codec='auto'; with codec={codec!r} it would be ignored")
    return codec


def _last_readable(store: Store, versions: list[int], run_id: str | None) -> Manifest | None:
    """The newest manifest of ``versions`` that parses, skipping (and logging) damaged ones."""
    for v in reversed(versions):
        try:
            return read_manifest(store, v, run_id)
        except CkptDeltaError as e:
            log.warning("run %s at %s: manifest of version %d is unreadable (%s); skipping it", run_id, store.url, v, e)
    return None


def _steps(jobs: Any) -> str:
    return ", ".join(j.describe() for j in sorted(jobs, key=lambda j: j.step))


#: Publishers not closed yet: the interpreter's exit finishes their publishes in flight (_at_exit).
_LIVE: "weakref.WeakSet[Publisher]" = weakref.WeakSet()


def _at_exit() -> None:
    """Finish every open Publisher's publishes in flight before the interpreter's exit shuts down the thread
    pools they run on (a publish left to that would fail to schedule its uploads, its error unread: a
    trainer exiting 0 with its last publishes silently lost). threading calls its exit hooks last registered
    first, so this one, registered after concurrent.futures' own, runs before the pools are shut."""
    t0 = time.monotonic()
    for pub in list(_LIVE):     # each one's exit_timeout counts from here: they all run meanwhile
        try:
            pub._finish(max(0.0, t0 + pub.exit_timeout - time.monotonic()),
                        "the interpreter exits without Publisher.close()")
            pub._explorer.close()
        except Exception as e:  # noqa: BLE001 - never stop the exit; say what happened
            log.error("run %s at %s: finishing its publishes at exit failed: %s", pub.run_id, pub.url, e)


threading._register_atexit(_at_exit)   # type: ignore[attr-defined]   # the hook concurrent.futures uses too
# A forked child (a DataLoader worker) runs threading's exit hooks too when it ends, with copies of this process's
# publishers whose threads it does not have: theirs are not its to finish (it would wait exit_timeout for them).
os.register_at_fork(after_in_child=_LIVE.clear)
