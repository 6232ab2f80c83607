"""One publish as rounds every rank runs in the same order, as torch.distributed.checkpoint layers a save:
local state -> global plan (rank 0) -> local writes -> commit (rank 0).

1. *Plan round*: every rank sends whether it skips this publish, what it holds (schemas, DTensor boxes), the
   step, whether it asks for an anchor and whether it holds the parent in memory; rank 0 plans (anchor or delta,
   the version, the shard layout) and every rank gets the plan back.
2. *Parent*: for a delta, each rank's parent bits; when some rank could not rebuild its own, a status round makes
   every rank write an anchor instead.
3. *Shard round* (anchors only): each rank's shard count, so shards are numbered across ranks.
4. *Write*: each rank writes and uploads its own objects.
5. *Commit round*: every rank's objects and entries (or its error) to rank 0, which commits the manifest.

A rank's local failure never leaves the others waiting: it is carried to the next round every rank joins, which
fails the publish on every rank together; only the collective itself failing (a rank gone, or the group's
``collective_timeout``) ends it at once (publisher/distributed.py). With one process every round is an
identity, so one path serves both."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any, NamedTuple, Protocol

import torch

from ckptdelta.delta.errors import CollectiveError

from ckptdelta.publisher import anchor as anchor_fmt
from ckptdelta.publisher import sharded
from ckptdelta.publisher.distributed import Comm, describe
from ckptdelta.publisher.job import PublishJob, Skipped
from ckptdelta.publisher.parents import Parents
from ckptdelta.publisher.chain import Plan
from ckptdelta.publisher.writer import Written

log = logging.getLogger("ckptdelta.publisher")


class LocalState(NamedTuple):
    """What one rank tells rank 0 in the plan round."""

    skip: bool                      # an earlier publish failed on this rank: this one is skipped everywhere
    holdings: sharded.Holdings      # its tensors' schemas and DTensor boxes
    step: int
    force_anchor: bool
    parent_version: int | None      # the version of the parent it holds in memory
    holds_parent: bool              # that parent has every tensor it publishes, as it publishes it
    call: int = 0                   # the publish() call of this rank's publisher: every rank's must match


class Steps(Protocol):
    """The local work between the rounds: what the Publisher does on each rank."""

    def plan(self, gathered: list[LocalState], job: PublishJob) -> tuple[Plan, bool] | None:
        """Rank 0: None when a rank skips, else the plan and whether every rank holds its parent."""

    def parent(self, plan: Plan, job: PublishJob) -> dict[str, torch.Tensor]:
        """This rank's parent bits of ``plan``, read from storage where not held."""

    def write(self, plan: Plan, job: PublishJob, parent: dict[str, torch.Tensor] | None, shards: list[list[str]],
              first: int, total: int) -> Written:
        """This rank's objects of the snapshot, written and uploaded."""

    def may_commit(self, job: PublishJob, err: BaseException | None) -> BaseException | None:
        """The last local check before the commit round (a publisher given up on at exit commits nothing)."""

    def commit(self, plan: Plan, job: PublishJob, parts: list[Written]) -> dict[str, Any]:
        """Rank 0: commit the manifest of every rank's ``parts``."""


def run(comm: Comm, steps: Steps, job: PublishJob, parents: Parents, *, skip: bool, shard_bytes: int,
        run_id: str) -> tuple[Plan, Written, dict[str, Any]]:
    """Run one publish's rounds on this rank: the plan, this rank's written part and the commit's outcome."""
    err: BaseException | None = job.error
    state = None
    try:
        state = LocalState(skip, sharded.holdings(job.schema, job.boxes), job.step, job.force_anchor,
                           parents.version, parents.holds(job.snapshot, job.boxes), job.call)
    except Exception as e:  # noqa: BLE001 - reported to every rank by this round
        err = err or e
    decided = comm.settle(err, state, lambda gathered: steps.plan(gathered, job), f"step {job.step} of run {run_id}")
    if decided is None:
        raise Skipped(f"step {job.step} was not published: an earlier publish of run {run_id} failed")
    plan, parents_held = decided
    job.version = plan.version
    context = f"{job.describe()} of run {run_id}"
    parent, err = None, None
    if plan.kind == "delta":
        try:
            parent = steps.parent(plan, job)
        except Exception as e:  # noqa: BLE001 - see below
            err = e
        if not parents_held:
            # any rank without its parent makes everyone anchor; when every rank said it holds its parent, there
            # was nothing to read and nothing that can differ between ranks, so the commit round reports errors
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
        shards, first, total = _number_shards(comm, plan, job, shard_bytes, context)
    written = None
    if err is None:
        try:
            written = steps.write(plan, job, parent, shards, first, total)
        except CollectiveError:
            raise
        except Exception as e:  # noqa: BLE001 - reported to every rank by the commit round
            err = e
    err = steps.may_commit(job, err)
    outcome = comm.settle(err, written.for_commit() if written is not None else None,
                          lambda parts: steps.commit(plan, job, parts), context, commits=True)
    assert written is not None       # settle raised on any rank's error
    return plan, written, outcome


def _number_shards(comm: Comm, plan: Plan, job: PublishJob, shard_bytes: int,
                   context: str) -> tuple[list[list[str]], int, int]:
    """This rank's anchor shards and where their numbers start among every rank's (a status round: every rank
    fails here together on any rank's error)."""
    pieced = plan.layout.pieces if plan.layout is not None else {}
    shards: list[list[str]] = []
    count, err = 0, None
    try:
        assert job.snapshot is not None
        shards = anchor_fmt.plan_shards([(n, t.numel() * t.element_size())
                                         for n, t in job.snapshot.items() if n not in pieced], shard_bytes)
        # then the shards of tensors in pieces this rank writes (sharded.write_piece_shards)
        count = len(shards) + (len(plan.layout.shards_of(comm.rank)) if pieced else 0)
    except Exception as e:  # noqa: BLE001 - reported by the round, on every rank
        err = e
    counts = comm.exchange(err, count, context)
    return shards, sum(counts[:comm.rank]), sum(counts)
