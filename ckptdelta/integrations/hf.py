"""A ``transformers.TrainerCallback`` that publishes the policy the HF Trainer (and every TRL trainer) trains.

A trainer's loop is not ours to write: TRL's and the HF Trainer's own loops call
callbacks at train begin, after each optimizer step and at train end, and that is
where a publish belongs. Publishes are asynchronous by default: ``publish()`` returns
once the weights are copied to host memory, so encoding and upload overlap the next
steps. An asynchronous failure must still stop the run that depends on it (replicas
would keep serving an old policy while the trainer believes otherwise), so this
callback looks at every publish it started and raises the first failure into the
training loop at the next step, or at train end, as a
:class:`ckptdelta.delta.errors.PublishError` naming the step and the version that
were not published; a publish refused at once (bad input, a closed publisher) is
reported the same way.

Several processes (DDP, FSDP2): the Trainer calls callbacks on every process, so
each process's callback decides at train begin, from what every rank was given
(one exchange on a gloo group of its own), how that rank takes part in each
publish, the same way on every rank (:func:`_roles`). A model every rank holds
whole (DDP) is published once, by rank 0, while the other ranks join the
Publisher's rounds holding no tensors (a distributed Publisher runs every publish
as rounds every rank must join); a LoRA adapter is published by rank 0 through a
Publisher of its own and the other ranks learn each committed version by a
broadcast. A set-up that cannot work is refused at train begin, on every rank,
saying what to build instead.

A run resumed from a checkpoint older than its last published step cannot label
its snapshots with its own steps (a run's steps never go backwards), yet its
weights are not the ones published at those steps unless training is
deterministic: the callback publishes them anyway, labelled with the run's last
step and carrying the trainer's own step in their metadata, so replicas (and
:class:`ckptdelta.integrations.trl.FleetRollout`) serve the policy being trained.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from transformers import TrainerCallback

from ckptdelta.delta.errors import CkptDeltaError, PublishError, PublishInputError
from ckptdelta.delta.manifest import metadata_problem
from ckptdelta.publisher.lora import is_peft_model
from ckptdelta.publisher.runs import committed_versions, read_manifest
from ckptdelta.publisher.sharded import is_dtensor

if TYPE_CHECKING:
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from ckptdelta.publisher import Publisher, PublishResult

log = logging.getLogger("ckptdelta.integrations")

#: The metadata key of a snapshot published below the run's last step (a resumed run): the trainer's own step.
TRAINER_STEP_KEY = "trainer_step"

# How this process takes part in each publish (decided at train begin, the same way on every rank: _roles):
_MODEL = "model"        # hands the model to publish(): world size 1, an FSDP2 model's DTensors, a Publisher's partition
_NOTHING = "nothing"    # joins the publish's rounds holding no tensors: another rank publishes a model all ranks hold
_SKIP = "skip"          # does not publish: rank 0 does, through a Publisher of its own; versions come by broadcast


class PublishCallback(TrainerCallback):
    """Publishes the trained model through ``publisher`` at train begin, every ``every`` optimizer steps and at
    train end (its final weights, when the last step was not one of those), then closes the publisher.

    The snapshot's step is the Trainer's ``state.global_step``. What is published is the model the Trainer hands
    its callbacks: a transformers model (its state dict, config and generation config) or a peft model, whose
    adapter the publisher publishes as a LoRA run (docs/PUBLISHING.md "LoRA runs"). ``wait=True`` makes each
    publish finish before training goes on; the default overlaps it with the next steps, and a publish that
    failed raises at the next step's end or at train end, never later and never not at all.

    World size > 1 (docs/INTEGRATIONS.md, "Several processes"): the Trainer calls callbacks on every process.
    Give every rank's callback the Publisher built on every rank (``Publisher(url)``, a collective call): an
    FSDP2 model's DTensors are published by every rank, each its own boxes; a model every rank holds whole (DDP)
    is published once, by rank 0, the others taking part in each publish's rounds with no tensors (unless the
    Publisher was built with a ``partition=``, which then says which rank publishes which name). A LoRA adapter
    is published by one process: build ``Publisher(url, distributed=False)`` on rank 0 alone and pass
    ``PublishCallback(None)`` on the other ranks; their :meth:`published_version` then learns each version
    rank 0 committed by a broadcast (a collective call: every rank calls it, as FleetRollout does). Any other
    set-up is refused at train begin on every rank (PublishInputError saying what to build).

    Resumed runs: a step below the run's last committed step (a checkpoint older than the last publish) is
    published labelled with that last step, its metadata's ``trainer_step`` the trainer's own (a warning names
    both, once): replicas serve the weights this trainer holds, which equal the ones published at those steps
    only if training is deterministic."""

    def __init__(self, publisher: "Publisher | None", *, every: int = 1, wait: bool = False, close: bool = True,
                 metadata: dict[str, str] | None = None) -> None:
        if type(every) is not int or every < 1:
            raise ValueError(f"every must be an int >= 1 (optimizer steps between publishes), got {every!r}")
        problem = metadata_problem(dict(metadata or {}))
        if problem is not None:     # refused here, not at the first publish inside the Trainer
            raise ValueError(f"PublishCallback: {problem}")
        self.publisher, self.every, self.wait, self.close_publisher = publisher, every, wait, close
        self.metadata = dict(metadata or {})
        self._lock = threading.Lock()
        # (the step it is labelled with, the trainer's step, its publish), in call order, not yet looked at
        self._pending: list[tuple[int, int, Future]] = []
        self._version: int | None = None                 # the newest version this callback's publishes committed
        self._failure: PublishError | None = None
        self._last_step: int | None = None               # the trainer's step of the newest publish asked for
        self._role = _MODEL
        self._shared = False         # versions come from rank 0 by a broadcast (published_version is collective)
        self._rank = 0
        self._group: Any = None      # this callback's gloo group (world size > 1)
        # (step, version) of the run's newest snapshot when training began: a lower step is labelled with it
        self._floor: tuple[int, int] | None = None
        self._floor_said = False
        #: PublishResult of every publish this callback saw committed, in order (rank 0's alone in the set-up where
        #: rank 0 publishes through a Publisher of its own)
        self.results: list["PublishResult"] = []

    # --- the Trainer's events ---------------------------------------------------------------------

    def on_train_begin(self, args: "TrainingArguments", state: "TrainerState", control: "TrainerControl",
                       model: Any = None, **kwargs: Any) -> None:
        try:
            self._setup(model)
            self._publish(model, state.global_step)
        except BaseException:     # a set-up refused, or the first publish: train() stops, and no end event follows
            self._close_after_failure()
            raise

    def on_step_end(self, args: "TrainingArguments", state: "TrainerState", control: "TrainerControl",
                    model: Any = None, **kwargs: Any) -> None:
        self._settle(block=False)
        if state.global_step % self.every == 0:
            self._publish(model, state.global_step)

    def on_train_end(self, args: "TrainingArguments", state: "TrainerState", control: "TrainerControl",
                     model: Any = None, **kwargs: Any) -> None:
        try:
            self._settle(block=False)
            if self._last_step != state.global_step:
                self._publish(model, state.global_step)
            self._settle(block=True)
        except BaseException:
            self._close_after_failure()
            raise
        if self.close_publisher and self.publisher is not None:
            self.publisher.close()

    def _close_after_failure(self) -> None:
        """Close the publisher (when this callback owns it) as a failure leaves training: its threads and, on
        several ranks, its process group are let go now, not at interpreter exit."""
        if self.close_publisher and self.publisher is not None:
            try:
                self.publisher.close()
            except BaseException:   # noqa: BLE001 - the failure being raised is this one, or came first
                pass

    # --- what a rollout needs -------------------------------------------------------------------------

    def published_version(self) -> int:
        """The version of the newest publish this callback made, once committed (waits for it); raises its
        failure (or an earlier one) as a PublishError naming the step and version.

        Where rank 0 publishes through a Publisher of its own (a LoRA adapter at world size > 1), every rank
        learns the version from rank 0 by a broadcast: then this is a collective call, made by every rank the
        same number of times (FleetRollout calls it once per rollout on every rank), and a failure on rank 0
        raises on every rank."""
        if self._shared:
            return self._broadcast_version()
        return self._own_version()

    def _own_version(self) -> int:
        self._settle(block=True)
        if self._version is None:
            where = self.publisher.url if self.publisher is not None else "the run"
            raise PublishError(f"nothing published to {where} yet: the callback publishes at train "
                               "begin (pass it in the Trainer's callbacks)")
        return self._version

    def _broadcast_version(self) -> int:
        import torch.distributed as dist

        answer: tuple[int | None, str | None] = (None, None)
        own: BaseException | None = None
        if self._rank == 0:
            try:
                answer = (self._own_version(), None)
            except Exception as e:  # noqa: BLE001 - every rank raises it, rank 0 its own
                own, answer = e, (None, f"{type(e).__name__}: {e}")
        box = [answer]
        dist.broadcast_object_list(box, src=0, group=self._group)
        if own is not None:
            raise own
        version, problem = box[0]
        if problem is not None:
            raise PublishError(f"rank 0, which publishes for every rank: {problem}")
        assert version is not None
        self._version = version
        return version

    # --- how this process takes part (train begin) ----------------------------------------------------

    def _setup(self, model: Any) -> None:
        """Decide this rank's part in each publish and the run's step floor (see the module's docstring). At
        world size > 1 every rank sends what it was given to every other (one all-gather on a gloo group this
        callback creates: the Trainer calls on_train_begin on every rank), so all of them decide the same, and
        raise the same error for a set-up that cannot work, before anything is published."""
        if model is None:
            raise ValueError("PublishCallback: the Trainer handed its callbacks no model to publish")
        import torch.distributed as dist

        world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        rank = dist.get_rank() if world > 1 else 0
        pub = self.publisher
        floor, failure = None, None
        if pub is not None and rank == 0:
            try:
                floor = self._run_floor()
            except Exception as e:  # noqa: BLE001 - every rank raises it (below), rank 0 its own
                failure = e
        self._rank = rank
        if world == 1:
            if pub is None:
                raise ValueError("PublishCallback(None) is for the ranks other than 0 of a multi-process run, where "
                                 "rank 0 publishes through a Publisher of its own; this process is alone: pass "
                                 "it a Publisher")
            if failure is not None:
                raise failure
            self._role, self._shared, self._floor = _MODEL, False, floor
            return
        if self._group is None:
            self._group = dist.new_group(backend="gloo")
        mine = (None if pub is None else int(pub.world_size), _has_partition(pub), floor,
                None if failure is None else f"{type(failure).__name__}: {failure}")
        views: list[Any] = [None] * world
        dist.all_gather_object(views, mine, group=self._group)
        if failure is not None:
            raise failure
        if views[0][3] is not None:
            raise PublishError(f"rank 0: reading the run's last snapshot at train begin failed: {views[0][3]}")
        self._role, self._shared = _roles([(w, p) for w, p, _f, _e in views], rank, world, lora=is_peft_model(model),
                                          sharded=_holds_dtensors(model), fsdp1=_is_fsdp1(model))
        self._floor = views[0][2]
        if self._role == _SKIP and pub is not None:
            log.info("rank %d: rank 0 publishes for every rank; this rank's Publisher for %s is not used", rank,
                     pub.url)

    def _run_floor(self) -> tuple[int, int] | None:
        """(step, version) of the run's newest readable snapshot, as the Publisher resumes after it, once
        publishes already in flight are done; None for a new run."""
        pub = self.publisher
        assert pub is not None
        pub.wait_until_finished()
        store = pub.store
        for v in reversed(committed_versions(store)):
            try:
                m = read_manifest(store, v, pub.run_id)
            except CkptDeltaError as e:     # the publisher skips a damaged manifest the same way
                log.warning("run %s: manifest of version %d is unreadable (%s); skipping it", pub.run_id, v, e)
                continue
            return None if m.step is None else (m.step, v)
        return None

    def _label(self, step: int) -> tuple[int, dict[str, str] | None]:
        """The step a publish at the trainer's ``step`` is labelled with, and its metadata: below the run's last
        step (a resumed run) the last step, the trainer's own in the metadata."""
        floor = self._floor
        if floor is None or step >= floor[0]:
            return step, self.metadata or None
        if not self._floor_said and self._rank == 0:
            pub = self.publisher
            log.warning("run %s at %s: training resumed at step %d, below the run's last published step %d "
                        "(version %d): the weights of steps %d to %d are published labelled step %d, with "
                        "metadata %s=<the trainer's step>, so that replicas serve the policy this trainer holds "
                        "(equal to the one published before at a step only if training is deterministic)",
                        getattr(pub, "run_id", "?"), getattr(pub, "url", "?"), step, floor[0], floor[1], step,
                        floor[0] - 1, floor[0], TRAINER_STEP_KEY)
        self._floor_said = True
        return floor[0], {**self.metadata, TRAINER_STEP_KEY: str(step)}

    # --- publishing and looking at what became of it ------------------------------------------------

    def _publish(self, model: Any, step: int) -> None:
        if model is None:
            raise ValueError("PublishCallback: the Trainer handed its callbacks no model to publish")
        with self._lock:
            self._last_step = step
        if self._role == _SKIP:
            return
        assert self.publisher is not None
        label, metadata = self._label(step)
        try:
            fut = self.publisher.publish(model if self._role == _MODEL else {}, label, metadata=metadata, wait=False)
        except Exception as e:
            # The publisher raises an earlier publish's failure from the next publish() (its own error, which
            # may not name what it was): the one that names its step and version goes first. A refusal of this
            # one (bad input, a closed publisher) is reported the same way, naming this step and version.
            self._settle(block=True)
            with self._lock:
                if self._failure is None:
                    self._failure = self._failed(label, step, e)
                failure = self._failure
            raise failure
        with self._lock:
            self._pending.append((label, step, fut))
        self._settle(block=self.wait)

    def _settle(self, *, block: bool) -> None:
        """Look at the publishes started, oldest first (all of them with ``block``, else those finished), and
        raise the first failure. A failed publish is reported by its step and version (the one the publisher
        planned for it; one that failed before planning, the one after the newest committed: versions are
        consecutive, and publishes queued behind a failure are not attempted)."""
        first = False
        while True:
            with self._lock:
                if not self._pending or not (block or self._pending[0][2].done()):
                    break
                label, step, fut = self._pending.pop(0)
            err = fut.exception()
            with self._lock:
                if err is None:
                    r = fut.result()
                    self._version = r.version
                    self.results.append(r)
                elif self._failure is None:
                    self._failure = self._failed(label, step, err)
                    first = True
        if self._failure is not None:
            if first and self.publisher is not None:
                # The publisher keeps a failure to raise from its next call; this callback reports it (named),
                # so the publisher's next call, or its close(), must not raise it a second time.
                try:
                    self.publisher.wait_until_finished()
                except BaseException:   # noqa: BLE001 - the same failure, or publishes skipped behind it
                    pass
            raise self._failure

    def _failed(self, label: int, step: int, err: BaseException) -> PublishError:
        # the version the publisher planned for it, where it got that far; else the one after the newest
        # committed (versions are consecutive)
        planned = getattr(err, "publish_version", None)
        version: int | str = "unknown"
        if isinstance(planned, int):
            version = planned
        elif self._version is not None:
            version = self._version + 1
        else:
            try:
                versions = committed_versions(self.publisher.store)
                version = versions[-1] + 1 if versions else 0
            except CkptDeltaError:
                pass
        pub = self.publisher
        trainer = "" if label == step else f" (the trainer's step {step}, resumed below the run's last step)"
        out = PublishError(f"step {label} (version {version}){trainer} of run {getattr(pub, 'run_id', '?')} at "
                           f"{getattr(pub, 'url', '?')} was not published: {type(err).__name__}: {err}")
        out.__cause__ = err
        log.error("%s", out)
        return out


def _roles(views: list[tuple[int | None, bool]], rank: int, world: int, *, lora: bool, sharded: bool,
           fsdp1: bool) -> tuple[str, bool]:
    """This rank's part in each publish (_MODEL, _NOTHING or _SKIP) and whether versions come from rank 0 by a
    broadcast, from every rank's (publisher world size or None, Publisher built with a partition): the same
    answer on every rank, or the same PublishInputError saying what to build instead.

    A distributed Publisher runs each publish as rounds every rank must join (publisher/rounds.py), and refuses
    a tensor two ranks hand it; so a model every rank holds whole goes through rank 0 alone, the others joining
    with nothing (one host copy and one encode of each tensor, where every rank's own copy would be refused),
    unless the Publisher's partition spreads the names. It refuses a LoRA adapter at world size > 1, so an
    adapter goes through a Publisher of rank 0's own, which no other rank has rounds with."""
    worlds = [w for w, _p in views]

    def given() -> str:
        return "; ".join(f"rank {r}: " + ("no Publisher" if w is None else "Publisher(..., distributed=False)"
                                          if w == 1 else f"a Publisher over {w} ranks") for r, w in enumerate(worlds))

    if fsdp1:
        raise PublishInputError("PublishCallback: the model is wrapped in FSDP1 (FullyShardedDataParallel), whose "
                                "state_dict() gathers every parameter on every rank in a collective call: train an "
                                "FSDP2 model (fully_shard; accelerate's fsdp_version: 2), whose DTensors every rank "
                                "publishes as its own boxes")
    if any(w is not None and w > 1 for w in worlds):
        if any(w != world for w in worlds):
            raise PublishInputError(f"PublishCallback: the {world} ranks were given different publishers ({given()}): "
                                    f"build Publisher(url) on every rank (one publisher over all {world} ranks, "
                                    "the default where torch.distributed is up), or, for a LoRA adapter, "
                                    "Publisher(url, distributed=False) on rank 0 alone and PublishCallback(None) "
                                    "on the others")
        if lora:
            raise PublishInputError(f"PublishCallback: a LoRA adapter is published by one process, and this "
                                    f"Publisher publishes with all {world} ranks together (the adapter is the same "
                                    "on every rank): build it on rank 0 alone, Publisher(url, distributed=False), "
                                    "and pass PublishCallback(None) on the other ranks; rank 0 publishes, and "
                                    "published_version() gives every rank the version it committed (docs/"
                                    "INTEGRATIONS.md, 'Several processes')")
        partitions = {p for _w, p in views}
        if len(partitions) > 1:
            raise PublishInputError("PublishCallback: some ranks' Publisher was built with a partition= and others' "
                                    "without: give every rank the same partition, or none (a model every rank "
                                    "holds whole is then published by rank 0)")
        if sharded or partitions == {True}:
            return _MODEL, False
        return (_MODEL if rank == 0 else _NOTHING), False
    if worlds[0] is None:
        raise PublishInputError(f"PublishCallback: rank 0 was given no Publisher ({given()}): build Publisher(url) "
                                "on every rank (after torch.distributed is up, e.g. after TrainingArguments), or "
                                "Publisher(url, distributed=False) on rank 0 and PublishCallback(None) on the others")
    if sharded:
        raise PublishInputError("PublishCallback: the model's parameters are DTensors (FSDP2), each rank holding its "
                                f"own shards, but the ranks were given no Publisher over all of them ({given()}): "
                                "build Publisher(url) on every rank (distributed, the default), and every rank "
                                "publishes its own boxes")
    return (_MODEL if rank == 0 else _SKIP), True


def _has_partition(pub: "Publisher | None") -> bool:
    """Whether ``pub`` was built with ``partition=`` (each rank then hands it the whole model and publishes the
    names the partition gives it)."""
    return pub is not None and pub.partition is not None


def _holds_dtensors(model: Any) -> bool:
    params = getattr(model, "parameters", None)
    return callable(params) and any(is_dtensor(p) for p in params())


def _is_fsdp1(model: Any) -> bool:
    modules = getattr(model, "modules", None)
    if not callable(modules):
        return False
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:     # a torch built without distributed
        return False
    return any(isinstance(m, FullyShardedDataParallel) for m in modules())


__all__ = ["PublishCallback", "TRAINER_STEP_KEY"]
