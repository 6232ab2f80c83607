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
import threading
import time
import weakref
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from typing import Any

import torch
import xxhash

from ckptdelta.delta import dtypes
from ckptdelta.delta.codec import digest_hex
from ckptdelta.delta.errors import (CkptDeltaError, CollectiveError, ConcurrentPublisherError, PublishError,
                                    PublishInputError, RunMismatchError)
from ckptdelta.delta.hf import CONFIG_FILE, config_differences, reconcile_config, serving_gaps
from ckptdelta.delta.manifest import Manifest, ObjectRef, anchor_prefix, now_iso, snapshot_name
from ckptdelta.delta.storage import Store

from ckptdelta.publisher import adapter as adapter_mod
from ckptdelta.publisher import anchor as anchor_fmt
from ckptdelta.publisher.codec_choice import CODECS, CONTEXT, FAST, CodecChooser, check_bandwidth, warm_up
from ckptdelta.publisher.distributed import describe, make_comm
from ckptdelta.publisher.nan import nan_tensor_names
from ckptdelta.publisher.plan import ChainState, Plan, decide
from ckptdelta.publisher.rebuild import read_chain, rebuild, rebuild_boxes
from ckptdelta.publisher.result import PublishResult
from ckptdelta.publisher import sharded, tempdirs
from ckptdelta.publisher.runs import (check_not_committed, commit, committed_versions, ensure_run_info, new_writer_id,
                                      read_manifest, read_run_info)
from ckptdelta.publisher.device_diff import DeviceDiff
from ckptdelta.publisher.snapshot import (Cast, Partition, Schema, Weights, check_publish_dtype, copy_to_host,
                                          gather_sources, schema_of, spares)
from ckptdelta.publisher.tied import tied_aliases
from ckptdelta.publisher.writer import Written, merge, write_anchor, write_delta_object

log = logging.getLogger("ckptdelta.publisher")

#: ``Publisher(exit_timeout=...)``'s default: how long the interpreter's exit waits for publishes still in flight.
EXIT_TIMEOUT_S = 600.0


@dataclass
class _Job:
    snapshot: dict[str, torch.Tensor] | None
    schema: Schema | None
    step: int
    metadata: dict[str, str]
    force_anchor: bool
    error: BaseException | None      # an input error, carried so every rank fails this publish together
    failures_seen: int
    t_start: float
    wait: bool
    copy_s: float = 0.0
    adapter: "adapter_mod.AdapterSnapshot | None" = None   # a LoRA run's publish (publisher/adapter.py)
    boxes: "sharded.Boxes" = field(default_factory=dict)   # this rank's boxes of the DTensors it publishes
    version: int | None = None       # the version planned for it (round 1)
    committing: bool = False         # past the last point where giving up at exit stops its commit

    def describe(self) -> str:
        return f"step {self.step}" + (f" (version {self.version})" if self.version is not None else "")


class _Skipped(PublishError):
    """An earlier publish failed; publishes queued behind it are not attempted."""


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
    ``"fast"``: zstd alone, ``context=False``: ~1.6x larger, encodes 1.4-2.7x and
    decodes 2-3x faster (``context_coding=False`` says the same). Replicas decode
    both, so any mix is bit-exact.

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

    LoRA runs: ``publish(peft_model, step)`` publishes the model's adapter (its tensors under peft's saved
    names; anchors are PEFT adapter directories, and every manifest records the base model and the adapter
    config); ``adapter=AdapterSpec(config, base)`` lets publish() take adapter state dicts instead
    (publisher/adapter.py, docs/PUBLISHING.md "LoRA runs").
    """

    def __init__(self, url: str, *, anchor_every: int = 20, anchor_chain_fraction: float | None = None,
                 storage_options: dict[str, Any] | None = None,
                 extra_files: Mapping[str, str | os.PathLike[str] | bytes] | str | os.PathLike[str] | None = None,
                 shard_bytes: int = 5 * 2**30, level: int = 3, max_in_flight: int = 1, run_id: str | None = None,
                 process_group: Any = None, distributed: bool | None = None, partition: Partition = None,
                 progress: bool | None = None, context_coding: bool | None = None, device_diff: bool = False,
                 codec: str | None = None, upload_bandwidth: float | None = None, dtype: torch.dtype | None = None,
                 adapter: "adapter_mod.AdapterSpec | None" = None, collective_timeout: float | None = None,
                 exit_timeout: float = EXIT_TIMEOUT_S):
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
        if run_id is not None and not (isinstance(run_id, str) and 0 < len(run_id) <= 256):
            raise ValueError(f"run_id must be a non-empty string of at most 256 characters, got {run_id!r}")
        if isinstance(exit_timeout, bool) or not (isinstance(exit_timeout, (int, float)) and exit_timeout >= 0):
            raise ValueError(f"exit_timeout must be a number of seconds >= 0, got {exit_timeout!r}")
        self.exit_timeout = float(exit_timeout)
        self.url = url
        self.dtype = check_publish_dtype(dtype)
        self.anchor_every = anchor_every
        # None: 0.5, or for a LoRA run's adapters adapter_mod.CHAIN_FRACTION (their deltas are dense)
        self.anchor_chain_fraction = None if anchor_chain_fraction is None else float(anchor_chain_fraction)
        self.shard_bytes, self.level, self.progress = shard_bytes, level, progress
        self.codec = _resolve_codec(codec, context_coding, upload_bandwidth)
        self._chooser = CodecChooser(check_bandwidth(upload_bandwidth)) if self.codec == "auto" else None
        self._last_codec = ""          # the codec of this rank's previous delta (logged when auto switches)
        self._partition = partition
        self._extra = anchor_fmt.read_extra_files(extra_files)
        self._config_where = "extra_files' config.json"   # where the anchors' config.json comes from
        self._config_said: set[tuple] = set()              # config fixes and warnings already logged
        self._anchor_files: dict[str, bytes] = {}          # rank 0: the extra files of the anchor being planned
        tempdirs.sweep()         # what publishers killed mid-publish on this host left in the temp dir
        self._store = Store.from_url(url, storage_options)
        self._comm = make_comm(process_group, distributed, collective_timeout)
        if self._comm.world > 1 and max_in_flight > 1:
            # Ranks must agree on which publishes run; with one slot each publish() starts only after
            # the previous one finished on this rank, so every rank sees the same failures.
            log.warning("max_in_flight=%d is reduced to 1 for a sharded publisher", max_in_flight)
            max_in_flight = 1
        # rank 0's view of the run (others follow its decisions)
        self._chain = ChainState()
        self._anchor_extra: tuple[ObjectRef, ...] = ()
        self._run_info_exists = False
        self._adapter = adapter_mod.RunAdapter(adapter)
        self.run_id, self.writer_id, last_step = self._comm.decide(lambda: self._open_run(run_id))
        # this rank's parent: the exact host bits of its tensors in version _parent_version
        self._parent: dict[str, torch.Tensor] = {}
        self._parent_version: int | None = None
        self._parent_digests: dict[str, int] = {}   # xxh3 of this rank's tensors as it committed them last
        self._parent_boxes: sharded.Boxes = {}         # where this rank's parents of DTensors lie in them
        # a LoRA run's grandparent: the snapshot version _grand_of (the parent) was encoded against, whose step to
        # the parent predicts the next one (docs/FORMAT.md encoding 6); empty when not held
        self._grand: dict[str, torch.Tensor] = {}
        self._grand_of: int | None = None
        self._box_cache: sharded.BoxCache = {}         # where this rank's boxes of DTensors lie, by layout
        self._lock = threading.Lock()
        self._committed_step: int | None = last_step
        self._last_step: int | None = last_step
        self._spare: dict[str, torch.Tensor] = {}
        self._prefault: tuple[threading.Thread, threading.Event] | None = None   # filling the first spares
        self._diff = DeviceDiff() if device_diff else None   # the device copy of the last published bits
        self._nan_warned: set[str] = set()
        # Tensors whose bits at version _nan_clean_version were checked free of NaNs: in a delta on that
        # version only their changed elements need a look (the encoder's), not a scan of the whole tensor.
        self._nan_clean: set[str] = set()
        self._nan_clean_version: int | None = None
        self._nan_next: set[str] = set()
        self._files_checked = False   # the model's own config added and serving gaps warned about (first publish)
        self._n_failures = 0
        self._attempts = 0          # publish attempts planned by this session (rank 0): each one's data prefix
        self._pending_error: BaseException | None = None
        self._fatal: BaseException | None = None
        self._closed = False
        self._abandoned = False     # given up on at interpreter exit: nothing commits any more
        self._slots = threading.BoundedSemaphore(max_in_flight)
        self._jobs: dict[Future, _Job] = {}      # publishes in flight
        # wait=False publishes that failed (or were skipped behind a failure) while no call of the caller's
        # raised it yet: logged at exit, or when a with-block is left on an error, so no loss goes unsaid
        self._unreported: list[tuple[str, str]] = []    # (the publish, its error), no job: it holds a snapshot
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="ckptdelta-publish")
        self._warmed: set[torch.dtype] = set()   # dtypes whose kernels auto loaded before a timed delta
        self._uploads = ThreadPoolExecutor(4, thread_name_prefix="ckptdelta-upload")
        _LIVE.add(self)

    @property
    def rank(self) -> int:
        return self._comm.rank

    @property
    def world_size(self) -> int:
        return self._comm.world

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
        if existing is None and versions:
            existing = read_manifest(store, versions[-1], None).run_id
        if run_id is not None and existing is not None and run_id != existing:
            raise RunMismatchError(f"{store.url} holds run {existing!r}, not run {run_id!r}")
        rid = existing or run_id or f"{datetime.now(timezone.utc):%Y%m%d-%H%M%S}-{new_writer_id()[:8]}"
        self._run_info_exists = info is not None
        if versions:
            try:
                chain = read_chain(store, versions[-1], rid)
                self._chain = ChainState.from_chain(chain)
                self._anchor_extra = chain[0].extra_files
                self._adapter.resume(store, chain)
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

    # --- public verbs --------------------------------------------------------------------

    def publish(self, weights: Weights, step: int, *, metadata: dict[str, str] | None = None, wait: bool = True,
                anchor: bool = False) -> "PublishResult | Future[PublishResult]":
        """Publish ``weights`` as the run's next snapshot, for trainer step ``step``.

        ``weights``: an nn.Module (its state_dict), or a mapping of name -> torch
        tensor (any device) or numpy array. With ``wait=False`` returns a Future
        once the weights are copied to host memory; encoding and upload continue
        in the background, and a failure surfaces from the Future and from the
        next publish(), wait_until_finished() or close().
        """
        t_start = time.perf_counter()
        if self._closed:
            raise PublishError(f"publisher for {self.url} is closed")
        self._slots.acquire()  # with one slot, every earlier publish has finished once this returns
        try:
            self._check_usable()
            err: BaseException | None = None
            snapshot, copy_s, snap, boxes = None, 0.0, None, {}
            try:
                weights, snap = self._adapter.split(weights, f"run {self.run_id} at {self.url}")
                if snap is not None and self._comm.world > 1:
                    raise PublishInputError("a LoRA adapter is published by one process (world size 1): gather "
                                            "it on one rank")
                step, metadata, sources, boxes = self._check_inputs(weights, step, metadata)
                if not self._files_checked and snap is None:
                    self._check_files(weights)
                t0 = time.perf_counter()
                self._join_prefault()
                with self._lock:
                    spare, self._spare = self._spare, {}
                if self._diff is None:
                    snapshot = copy_to_host(sources, spare)
                else:   # one slot: the last publish has finished, so the parent and its version are settled
                    snapshot = self._diff.capture(sources, self._parent, self._parent_version, spare)
                copy_s = time.perf_counter() - t0
            except Exception as e:
                if self._comm.world == 1:
                    raise
                err = e  # every rank must take part in this publish, so the error travels with it
            with self._lock:
                self._last_step = step if err is None else self._last_step
                failures = self._n_failures
            job = _Job(snapshot, None if snapshot is None else schema_of(snapshot), step,
                       metadata if err is None else {}, anchor, err, failures, t_start, wait, copy_s, snap,
                       boxes if err is None else {})
            fut = self._worker.submit(self._run_job, job)
        except BaseException:
            self._slots.release()
            raise
        with self._lock:
            self._jobs[fut] = job
        fut.add_done_callback(self._job_done)
        return fut.result() if wait else fut

    def _check_inputs(self, weights: Weights, step: Any,
                      metadata: Any) -> tuple[int, dict[str, str], dict, "sharded.Boxes"]:
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise PublishInputError(f"step must be a non-negative int, got {step!r}")
        metadata = dict(metadata or {})
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise PublishInputError("metadata must map strings to strings")
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

    def _check_files(self, weights: Weights) -> None:
        """First publish: a transformers model's own config (in the dtype published) replaces extra_files'
        (the model is what is published), its generation config is added where extra_files has none, its
        tied aliases are named; warn (once) when anchors would lack what serving needs."""
        self._files_checked = True
        is_model = isinstance(weights, torch.nn.Module)
        rank0 = self._comm.rank == 0
        if is_model:
            own = anchor_fmt.model_files(weights, self.dtype)
            if own:
                given = self._extra.get(CONFIG_FILE)
                differ = config_differences(given, own[CONFIG_FILE]) if given is not None else []
                if differ and rank0:
                    log.warning("run %s: extra_files' config.json differs from the config of the %s published "
                                "(%s); anchors carry the model's own", self.run_id, type(weights).__name__,
                                ", ".join(differ))
                # one assignment: an anchor being written keeps its dict
                self._extra = {**own, **self._extra, CONFIG_FILE: own[CONFIG_FILE]}
                self._config_where = f"the config of the {type(weights).__name__} published"
            aliases = tied_aliases(weights, weights.state_dict())
            if aliases and rank0:
                log.info("run %s: tied weights are published once, as save_pretrained writes them: %s",
                         self.run_id, ", ".join(f"{a} (= {s})" for a, s in sorted(aliases.items())))
        gaps = serving_gaps(self._extra)
        if gaps and (is_model or self._extra) and self._comm.rank == 0:
            log.warning("run %s at %s: anchors will carry no %s, so `ckptdelta serve` refuses them; pass "
                        "extra_files=MODEL_DIR (the directory the model and its tokenizer were saved to)",
                        self.run_id, self.url, " and no ".join(gaps))

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
        self._raise_pending()

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
        self._join_prefault()
        self._worker.shutdown(wait=True)
        self._uploads.shutdown(wait=True)
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
        with self._lock:
            lost, self._unreported = self._unreported, []
            self._pending_error = None
        for what, e in lost:
            log.error("run %s at %s: %s was not published (%s); nothing of it is committed", self.run_id, self.url,
                      what, e)

    # --- bookkeeping -----------------------------------------------------------------------

    def _start_prefault(self, like: Mapping[str, torch.Tensor]) -> None:
        """Fill buffers for the next host copy in the background. Until a second publish hands its
        superseded parent back, the next copy would land in fresh memory, and first-touching it (the
        kernel maps and zeroes every page) costs 0.2-0.4 s per GB, more than the copy itself: the first
        delta after the publisher starts would pay it inside publish(). Here it is paid while the trainer
        steps (one thread, no torch threads). A publish that comes first stops the fill and takes the
        buffers filled so far. They would be allocated at the next publish anyway."""
        shapes = [(n, t.dtype, tuple(t.shape), t.is_pinned()) for n, t in like.items()]
        stop = threading.Event()
        target = self._spare        # called under self._lock; filled only while it is still the spare set

        def fill() -> None:
            try:
                for n, dtype, shape, pin in shapes:
                    if stop.is_set():
                        return
                    t = torch.empty(shape, dtype=dtype, pin_memory=pin)
                    dtypes.host_bits(t).fill(0)
                    with self._lock:
                        if stop.is_set() or self._spare is not target:
                            return
                        target[n] = t
            except Exception as e:  # noqa: BLE001 - an optimisation only: the next copy allocates instead
                log.debug("filling spare host buffers failed (%s); the next publish allocates them", e)

        thread = threading.Thread(target=fill, name="ckptdelta-prefault", daemon=True)
        thread.start()
        self._prefault = (thread, stop)

    def _join_prefault(self) -> None:
        """Stop a fill still running (what it filled stays in the spare buffers) and wait for it."""
        with self._lock:
            p, self._prefault = self._prefault, None
        if p is not None:
            p[1].set()
            p[0].join()

    def _check_usable(self) -> None:
        if self._closed:
            raise PublishError(f"publisher for {self.url} is closed")
        if self._fatal is not None:
            raise self._fatal
        self._raise_pending()

    def _raise_pending(self) -> None:
        with self._lock:
            err, self._pending_error = self._pending_error, None
            if err is not None:
                self._unreported.clear()     # the caller hears of the failure now
        if err is not None:
            raise err

    def _job_done(self, fut: Future) -> None:
        with self._lock:
            self._jobs.pop(fut, None)

    def _run_job(self, job: _Job) -> PublishResult:
        try:
            return self._execute(job)
        except BaseException as e:
            with self._lock:
                self._last_step = self._committed_step
                if not job.wait and self._pending_error is None and not isinstance(e, _Skipped):
                    self._pending_error = e
                if not job.wait:
                    self._unreported.append((job.describe(), f"{type(e).__name__}: {e}"))
            raise
        finally:
            self._slots.release()

    # --- one publish, in the worker thread ------------------------------------------------------

    def _execute(self, job: _Job) -> PublishResult:
        """One publish on this rank. Sharded, every rank runs the same collective rounds in the same order
        whatever fails on it: a local failure (its input, its parent, its writes, its temp dir, its uploads) is
        carried to the next round every rank joins (the commit round, or a status round before the anchor's
        piece exchange), which fails the publish on every rank together, so none waits on a collective for a
        rank that left the publish; only the collective itself failing (a rank gone, or the group's
        ``collective_timeout``) ends it at once."""
        comm = self._comm
        skip = job.failures_seen != self._n_failures
        try:
            # Round 1: every rank's error or skip, its schemas and DTensor boxes (only rank 0 needs them: it
            # plans, the others follow) and whether it holds the parent in memory; the plan comes back.
            err: BaseException | None = job.error
            state = None
            try:
                state = (skip, sharded.holdings(job.schema, job.boxes), job.step, job.force_anchor,
                         self._parent_version, self._holds_parent(job))
            except Exception as e:  # noqa: BLE001 - reported to every rank by this round
                err = err or e
            decided = comm.settle(err, state, lambda gathered: self._plan_round(gathered, job.adapter),
                                  f"step {job.step} of run {self.run_id}")
            if decided is None:
                raise _Skipped(f"step {job.step} was not published: an earlier publish of run {self.run_id} failed")
            plan, parents_held = decided
            job.version = plan.version
            context = f"{job.describe()} of run {self.run_id}"
            pieced = plan.layout.pieces if plan.layout is not None else {}
            parent, err = None, None
            if plan.kind == "delta" and parents_held:
                # every rank said it holds its parent: nothing to read, nothing that can differ between ranks
                try:
                    parent = self._ensure_parent(plan, job)
                except Exception as e:  # noqa: BLE001 - reported to every rank by the commit round
                    err = e
            elif plan.kind == "delta":
                try:
                    parent = self._ensure_parent(plan, job)
                except Exception as e:  # noqa: BLE001 - any rank without its parent makes everyone anchor
                    err = e
                failed = [f for f in comm.all_gather(None if err is None else describe(err)) if f]
                err = None
                if failed:
                    log.warning("cannot rebuild the parent %d of version %d (%s); writing an anchor instead",
                                plan.parent_version, plan.version, failed[0][1])
                    plan = replace(plan, kind="anchor", anchor_version=plan.version,
                                   reason=f"the parent snapshot could not be rebuilt: {failed[0][1]}")
            shards: list[list[str]] = []
            first = total = 0
            if plan.kind == "anchor":
                count = 0
                try:
                    assert job.snapshot is not None
                    shards = anchor_fmt.plan_shards([(n, t.numel() * t.element_size())
                                                     for n, t in job.snapshot.items() if n not in pieced],
                                                    self.shard_bytes)
                    # then the shards of tensors in pieces this rank writes (sharded.write_piece_shards)
                    count = len(shards) + (len(plan.layout.shards_of(comm.rank)) if pieced else 0)
                except Exception as e:  # noqa: BLE001 - a status round: every rank fails here together
                    err = e
                counts = comm.exchange(err, count, context)
                first, total = sum(counts[:comm.rank]), sum(counts)
            written = None
            if err is None:
                try:
                    written = self._write(plan, job, parent, shards, first, total)
                except CollectiveError:
                    raise
                except Exception as e:  # noqa: BLE001 - reported to every rank by the commit round
                    err = e
            with self._lock:     # the last point where giving up at exit (_finish) stops the commit
                if err is None and self._abandoned:
                    err = PublishError(f"{job.describe()} of run {self.run_id}: given up on at interpreter exit "
                                       "(Publisher(exit_timeout=...)); nothing is committed")
                job.committing = err is None
            # Round 2: every rank's written objects and entries (or its error) to rank 0, which commits them
            outcome = comm.settle(err, written.for_commit() if written is not None else None,
                                  lambda parts: self._commit(plan, job, parts), context)
        except _Skipped:
            raise
        except BaseException as e:
            self._n_failures += 1
            if isinstance(e, ConcurrentPublisherError):
                self._fatal = e
            raise
        return self._committed(plan, job, written, outcome)

    def _holds_parent(self, job: _Job) -> bool:
        """Whether this rank's parent in memory (version ``_parent_version``) has every tensor of the job, in the
        same dtype, shape and box: then a delta on that version needs no read and no agreement about it."""
        if job.snapshot is None or self._parent_version is None:
            return False
        for n, t in job.snapshot.items():
            p = self._parent.get(n)
            if p is None or p.dtype != t.dtype or p.shape != t.shape or self._parent_boxes.get(n) != job.boxes.get(n):
                return False
        return True

    def _plan_round(self, gathered: list[tuple], adapter: "adapter_mod.AdapterSnapshot | None") -> tuple[Plan, bool] | None:
        """Rank 0: None when a rank skips this publish, else the plan and whether every rank holds its parent."""
        if any(g[0] for g in gathered):
            return None
        plan = self._plan([g[1:4] for g in gathered], adapter)
        held = plan.kind == "delta" and all(g[4] == plan.parent_version and g[5] for g in gathered)
        return plan, held

    def _plan(self, gathered: list[tuple["sharded.Holdings", int, bool]],
              adapter: "adapter_mod.AdapterSnapshot | None" = None) -> Plan:
        # plain tensors held by one rank each; a DTensor's boxes tiling it (publisher/sharded.py)
        union, layout = sharded.plan_union([g[0] for g in gathered], self.shard_bytes)
        if not union:
            raise PublishInputError("nothing to publish: no rank holds a tensor")
        steps = sorted({g[1] for g in gathered})
        if len(steps) > 1:
            raise PublishInputError(f"ranks disagree on the step being published: {steps}")
        step = steps[0]
        if self._chain.last_step is not None and step < self._chain.last_step:
            raise PublishInputError(f"step {step} is lower than the last committed step {self._chain.last_step} "
                                    f"(version {self._chain.last_version} of run {self.run_id})")
        fraction = self.anchor_chain_fraction
        if fraction is None:
            fraction = adapter_mod.CHAIN_FRACTION if adapter is not None else 0.5
        plan = decide(self._chain, union, anchor_every=self.anchor_every, chain_fraction=fraction,
                      force_anchor=any(g[2] for g in gathered), layout=layout.grids())
        plan = replace(plan, layout=layout)
        why = self._adapter.anchor_reason(adapter)    # a LoRA run's new base or adapter config
        if why is not None and (plan.kind == "delta" or plan.schema_change):   # the cause, not its symptom
            plan = replace(plan, kind="anchor", anchor_version=plan.version, reason=why)
        # for an anchor (also one a failed parent rebuild makes); a LoRA anchor is a PEFT adapter directory
        self._anchor_files = self._files_for(union) if adapter is None else {**self._extra, **adapter.extra_files}
        check_not_committed(self._store, plan.version, self.run_id)
        # Every attempt writes under keys of its own: a retry of a failed publish gets the same version, and a
        # PUT of the failed attempt that lands late (a stalled request completed by the server) must never
        # replace an object the retry committed. Rank 0 decides, so all ranks of one attempt share it.
        self._attempts += 1
        return replace(plan, data_id=f"{self.writer_id}-{self._attempts}")

    def _files_for(self, schema: Schema) -> dict[str, bytes]:
        """The extra files an anchor of ``schema`` carries: its config.json made to describe those tensors
        (ckptdelta.delta.hf.reconcile_config: a wrong dtype fixed, a wrong tying refused), each fix logged once."""
        config = self._extra.get(CONFIG_FILE)
        if config is None:
            return self._extra
        floats = sorted({d for d, _ in schema.values() if dtypes.by_name(d).torch_dtype.is_floating_point})
        if len(floats) > 1 and ("mixed", *floats) not in self._config_said and self._comm.rank == 0:
            self._config_said.add(("mixed", *floats))
            log.warning("run %s: the tensors published hold several floating-point dtypes (%s); replicas load a "
                        "model's weights in the one dtype of its config.json, so they cannot serve these bits "
                        "exactly: publish one (Publisher(dtype=torch.bfloat16))", self.run_id, ", ".join(floats))
        fixed, fixes = reconcile_config(config, {n: d for n, (d, _) in schema.items()},
                                        where=f"run {self.run_id}: {self._config_where}")
        if not fixes:
            return self._extra
        if ("fix", *fixes) not in self._config_said:
            self._config_said.add(("fix", *fixes))
            own = self._config_where.startswith("the config of")
            log.log(logging.INFO if own else logging.WARNING,
                    "run %s: %s does not describe the tensors published; anchors carry it with %s",
                    self.run_id, self._config_where, ", ".join(fixes))
        return {**self._extra, CONFIG_FILE: fixed}

    def _ensure_parent(self, plan: Plan, job: _Job) -> dict[str, torch.Tensor]:
        assert job.snapshot is not None and plan.parent_version is not None
        if self._parent_version != plan.parent_version:
            self._parent, self._parent_version, self._parent_digests = {}, plan.parent_version, {}
            self._parent_boxes = {}
            self._grand, self._grand_of = {}, None
        for n, box in job.boxes.items():    # a parent of another box of a DTensor is no parent
            if n in self._parent and self._parent_boxes.get(n) != box:
                del self._parent[n]
                self._parent_digests.pop(n, None)
        missing = [n for n in job.snapshot if n not in self._parent]
        if missing:
            chain = read_chain(self._store, plan.parent_version, self.run_id)
            pieced = plan.layout.pieces if plan.layout is not None else {}
            whole = [n for n in missing if n not in pieced]
            if whole:
                self._parent.update(rebuild(self._store, chain, whole))
            boxes = {n: (job.boxes[n].offsets, tuple(job.snapshot[n].shape)) for n in missing if n in pieced}
            if boxes:       # this rank's boxes only: the anchor's rows of them, then their records
                self._parent.update(rebuild_boxes(self._store, chain, boxes))
            self._parent_boxes.update({n: job.boxes[n] for n in missing if n in job.boxes})
        for n, t in job.snapshot.items():
            p = self._parent.get(n)
            if p is None or p.dtype != t.dtype or p.shape != t.shape:
                raise PublishError(f"tensor {n!r} is not in version {plan.parent_version} as {t.dtype}{list(t.shape)}")
        return self._parent

    def _write(self, plan: Plan, job: _Job, parent: dict[str, torch.Tensor] | None, shards: list[list[str]],
               first: int, total: int) -> Written:
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
                                       file_name=None if job.adapter is None else adapter_mod.ADAPTER_WEIGHTS_NAME)
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

    def _warn_of_nans(self, plan: Plan, job: _Job, written: Written) -> None:
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

    def _write_delta(self, plan: Plan, job: _Job, parent: dict[str, torch.Tensor]) -> Written:
        """This rank's delta objects, in the codec ``self.codec`` names or, with "auto", its chooser picks."""
        assert job.snapshot is not None
        elements = sum(t.numel() for t in job.snapshot.values())
        exploring = False
        if self._chooser is None:
            codec, reason = self.codec, f"fixed: Publisher(codec={self.codec!r})"
        else:
            fresh = {t.dtype for t in job.snapshot.values()} - self._warmed
            if fresh:      # both codecs' kernels loaded before the first delta of a dtype, untimed
                warm_up(fresh)
                self._warmed |= fresh
            choice = self._chooser.choose(elements)
            codec, reason, exploring = choice.codec, choice.reason, choice.exploring
            if self._last_codec and codec != self._last_codec and not exploring:
                log.info("run %s: v%d switches to the %s codec (%s)", self.run_id, plan.version, codec, reason)
            else:
                log.debug("run %s: v%d codec %s (%s)", self.run_id, plan.version, codec, reason)
        grand = self._grand if self._grand_of == plan.parent_version else None
        written = write_delta_object(self._store, parent, job.snapshot, version=plan.version, writer_id=plan.data_id,
                                     rank=self._comm.rank, level=self.level, context=codec == CONTEXT,
                                     progress=self.progress, parent_digests=self._parent_digests,
                                     grandparents=grand)
        sharded.with_boxes(written, job.boxes, plan.layout)      # pieces of a DTensor: merged into one entry
        written.codec, written.codec_reason = codec, reason
        if self._chooser is not None:
            self._chooser.observe(codec, elements=elements, changed=written.changed_elements,
                                  encode_s=written.encode_s, stored_bytes=sum(o.size for o in written.objects),
                                  upload_s=written.upload_s)
            if not exploring:
                self._last_codec = codec
        return written

    def _commit(self, plan: Plan, job: _Job, parts: list[Written]) -> dict[str, Any]:
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
        if not self._run_info_exists:
            ensure_run_info(store, self.run_id)
            self._run_info_exists = True
        manifest = Manifest(
            run_id=self.run_id, version=plan.version, kind=plan.kind, parent_version=plan.parent_version,
            anchor_version=plan.anchor_version, created=now_iso(), step=job.step, writer_id=self.writer_id,
            objects=tuple(objects), tensors=entries, extra_files=extra_refs, metadata=job.metadata,
            full_bytes=full, stored_bytes=stored, adapter=None if job.adapter is None else job.adapter.record)
        data = manifest.to_json()
        Manifest.from_json(data, run_id=self.run_id)  # never commit what a reader would refuse
        commit(store, manifest, data)
        self._chain = self._chain.advanced(manifest)
        if plan.kind == "anchor":
            self._anchor_extra = extra_refs
        n_changed = sum(1 for e in entries.values() if e.has_data)
        return {"stored": stored, "full": full, "n_changed": n_changed, "n_tensors": len(entries),
                "commit_s": time.perf_counter() - t0, "extra": extra_bytes}

    def _committed(self, plan: Plan, job: _Job, written: Written | None, outcome: dict[str, Any]) -> PublishResult:
        assert job.snapshot is not None and written is not None
        old, self._parent, self._parent_version = self._parent, job.snapshot, plan.version
        self._parent_digests = {n: int(e.xxh3, 16) for n, e in written.entries.items() if n in job.snapshot}
        self._parent_boxes = dict(job.boxes)
        self._nan_clean, self._nan_clean_version = self._nan_next, plan.version
        self._adapter.committed(job.adapter)
        recycled = old
        if plan.kind == "delta" and job.adapter is not None and self._diff is None:
            # the parent's bits become the next delta's grandparent (small: an adapter); the superseded
            # grandparent's buffers take the parent's place as the spares of the next copy
            recycled, self._grand, self._grand_of = self._grand, old, plan.version
        else:
            self._grand, self._grand_of = {}, None
        with self._lock:
            self._committed_step = job.step
            self._spare = spares(recycled)
            if not self._spare:
                self._start_prefault(job.snapshot)
        if self._diff is not None:
            self._diff.committed(plan.version)
        del old
        r = PublishResult(
            version=plan.version, name=snapshot_name(plan.version), kind=plan.kind, parent_version=plan.parent_version,
            anchor_version=plan.anchor_version, step=job.step, stored_bytes=outcome["stored"],
            full_bytes=outcome["full"], ratio=(outcome["stored"] - outcome["extra"]) / max(1, outcome["full"]),
            copy_s=job.copy_s, encode_s=written.encode_s, upload_s=written.upload_s, commit_s=outcome["commit_s"],
            total_s=time.perf_counter() - job.t_start, n_changed_tensors=outcome["n_changed"],
            n_tensors=outcome["n_tensors"], reason=plan.reason, extra_bytes=outcome["extra"],
            schema_change=plan.schema_change, codec=written.codec, codec_reason=written.codec_reason)
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


def _last_readable(store: Store, versions: list[int], run_id: str) -> Manifest | None:
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
        except Exception as e:  # noqa: BLE001 - never stop the exit; say what happened
            log.error("run %s at %s: finishing its publishes at exit failed: %s", pub.run_id, pub.url, e)


threading._register_atexit(_at_exit)   # type: ignore[attr-defined]   # the hook concurrent.futures uses too
# A forked child (a DataLoader worker) runs threading's exit hooks too when it ends, with copies of this process's
# publishers whose threads it does not have: theirs are not its to finish (it would wait exit_timeout for them).
os.register_at_fork(after_in_child=_LIVE.clear)
