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
were not published.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from transformers import TrainerCallback

from ckptdelta.delta.errors import CkptDeltaError, PublishError
from ckptdelta.publisher.runs import committed_versions

if TYPE_CHECKING:
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from ckptdelta.publisher import Publisher, PublishResult

log = logging.getLogger("ckptdelta.integrations")


class PublishCallback(TrainerCallback):
    """Publishes the trained model through ``publisher`` at train begin, every ``every`` optimizer steps and at
    train end (its final weights, when the last step was not one of those), then closes the publisher.

    The snapshot's step is the Trainer's ``state.global_step``. What is published is the model the Trainer hands
    its callbacks: a transformers model (its state dict, config and generation config) or a peft model, whose
    adapter the publisher publishes as a LoRA run (docs/PUBLISHING.md "LoRA runs"). ``wait=True`` makes each
    publish finish before training goes on; the default overlaps it with the next steps, and a publish that
    failed raises at the next step's end or at train end, never later and never not at all.

    World size > 1: the Trainer calls callbacks on every process, and each calls ``publish()`` of the publisher
    it was given, at the same steps: the Publisher's rules for sharded trainers apply (build it on every rank;
    each rank publishes the tensors it holds, rank 0 commits one manifest). A LoRA adapter is published by one
    process (the Publisher refuses it at world size > 1)."""

    def __init__(self, publisher: "Publisher", *, every: int = 1, wait: bool = False, close: bool = True,
                 metadata: dict[str, str] | None = None) -> None:
        if type(every) is not int or every < 1:
            raise ValueError(f"every must be an int >= 1 (optimizer steps between publishes), got {every!r}")
        self.publisher, self.every, self.wait, self.close_publisher = publisher, every, wait, close
        self.metadata = dict(metadata or {})
        self._lock = threading.Lock()
        self._pending: list[tuple[int, Future]] = []    # (step, its publish), in call order, not yet looked at
        self._version: int | None = None                 # the newest version this callback's publishes committed
        self._failure: PublishError | None = None
        self._last_step: int | None = None               # the step of the newest publish() called
        #: PublishResult of every publish this callback saw committed, in order
        self.results: list["PublishResult"] = []

    # --- the Trainer's events ---------------------------------------------------------------------

    def on_train_begin(self, args: "TrainingArguments", state: "TrainerState", control: "TrainerControl",
                       model: Any = None, **kwargs: Any) -> None:
        self._publish(model, state.global_step)

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
            if self.close_publisher:
                try:
                    self.publisher.close()
                except BaseException:   # noqa: BLE001 - the failure being raised is this one, or came first
                    pass
            raise
        if self.close_publisher:
            self.publisher.close()

    # --- what a rollout needs -------------------------------------------------------------------------

    def published_version(self) -> int:
        """The version of the newest publish this callback made, once committed (waits for it); raises its
        failure (or an earlier one) as a PublishError naming the step and version."""
        self._settle(block=True)
        if self._version is None:
            raise PublishError(f"nothing published to {self.publisher.url} yet: the callback publishes at train "
                               "begin (pass it in the Trainer's callbacks)")
        return self._version

    # --- publishing and looking at what became of it ------------------------------------------------

    def _publish(self, model: Any, step: int) -> None:
        if model is None:
            raise ValueError("PublishCallback: the Trainer handed its callbacks no model to publish")
        try:
            fut = self.publisher.publish(model, step, metadata=self.metadata or None, wait=False)
        except BaseException:
            # The publisher raises an earlier publish's failure from the next publish() (its own error, which
            # may not name what it was): raise the one that names the step and version instead.
            self._settle(block=True)
            raise
        with self._lock:
            self._pending.append((step, fut))
            self._last_step = step
        self._settle(block=self.wait)

    def _settle(self, *, block: bool) -> None:
        """Look at the publishes started, oldest first (all of them with ``block``, else those finished), and
        raise the first failure. A failed publish is reported by its step and version (the one the publisher
        planned for it; one that failed before planning, the one after the newest committed: versions are
        consecutive, and publishes queued behind a failure are not attempted)."""
        first = False
        while True:
            with self._lock:
                if not self._pending or not (block or self._pending[0][1].done()):
                    break
                step, fut = self._pending.pop(0)
            err = fut.exception()
            with self._lock:
                if err is None:
                    r = fut.result()
                    self._version = r.version
                    self.results.append(r)
                elif self._failure is None:
                    self._failure = self._failed(step, err)
                    first = True
        if self._failure is not None:
            if first:
                # The publisher keeps a failure to raise from its next call; this callback reports it (named),
                # so the publisher's next call, or its close(), must not raise it a second time.
                try:
                    self.publisher.wait_until_finished()
                except BaseException:   # noqa: BLE001 - the same failure, or publishes skipped behind it
                    pass
            raise self._failure

    def _failed(self, step: int, err: BaseException) -> PublishError:
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
        out = PublishError(f"step {step} (version {version}) of run {getattr(pub, 'run_id', '?')} at {pub.url} "
                           f"was not published: {type(err).__name__}: {err}")
        out.__cause__ = err
        log.error("%s", out)
        return out


__all__ = ["PublishCallback"]
