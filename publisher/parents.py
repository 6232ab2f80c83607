"""The bits a delta is encoded against: this rank's host copy of the last committed snapshot (its parent), and
for a LoRA run the snapshot before it (its grandparent, whose step to the parent predicts the next one:
docs/FORMAT.md encoding 6).

A delta must be coded against exactly the bits a replica will hold, so the parent is the host copy the trainer
published, kept across publishes, and rebuilt from storage only when this rank does not hold it (a restarted
trainer, a failed publish, a DTensor box that moved)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ckptdelta.delta.errors import PublishError
from ckptdelta.delta.storage import Store

from ckptdelta.publisher import sharded
from ckptdelta.publisher.chain import Plan
from ckptdelta.publisher.rebuild import read_chain, rebuild, rebuild_boxes


class Parents:
    """This rank's parent and grandparent host copies, the version each holds, and the parent's digests."""

    def __init__(self) -> None:
        #: the exact host bits of this rank's tensors in version ``version``
        self.tensors: dict[str, torch.Tensor] = {}
        self.version: int | None = None
        self.digests: dict[str, int] = {}        # xxh3 of this rank's tensors as it committed them last
        self.boxes: sharded.Boxes = {}           # where this rank's parents of DTensors lie in them
        # a LoRA run's grandparent: the version ``grand_of`` (the parent) was encoded against; empty when not held
        self.grand: dict[str, torch.Tensor] = {}
        self.grand_of: int | None = None

    def holds(self, snapshot: Mapping[str, torch.Tensor] | None, boxes: sharded.Boxes) -> bool:
        """Whether the parent held (version ``version``) has every tensor of ``snapshot``, in the same dtype,
        shape and box: then a delta on that version needs no read and no agreement about it."""
        if snapshot is None or self.version is None:
            return False
        for n, t in snapshot.items():
            p = self.tensors.get(n)
            if p is None or p.dtype != t.dtype or p.shape != t.shape or self.boxes.get(n) != boxes.get(n):
                return False
        return True

    def ensure(self, store: Store, run_id: str, plan: Plan, snapshot: Mapping[str, torch.Tensor],
               boxes: sharded.Boxes) -> dict[str, torch.Tensor]:
        """The parent of ``plan`` for every tensor of ``snapshot``, read from the run where it is not held."""
        assert plan.parent_version is not None
        if self.version != plan.parent_version:
            self.tensors, self.version, self.digests, self.boxes = {}, plan.parent_version, {}, {}
            self.grand, self.grand_of = {}, None
        for n, box in boxes.items():    # a parent of another box of a DTensor is no parent
            if n in self.tensors and self.boxes.get(n) != box:
                del self.tensors[n]
                self.digests.pop(n, None)
        missing = [n for n in snapshot if n not in self.tensors]
        if missing:
            chain = read_chain(store, plan.parent_version, run_id)
            pieced = plan.layout.pieces if plan.layout is not None else {}
            whole = [n for n in missing if n not in pieced]
            if whole:
                self.tensors.update(rebuild(store, chain, whole))
            wanted = {n: (boxes[n].offsets, tuple(snapshot[n].shape)) for n in missing if n in pieced}
            if wanted:       # this rank's boxes only: the anchor's rows of them, then their records
                self.tensors.update(rebuild_boxes(store, chain, wanted))
            self.boxes.update({n: boxes[n] for n in missing if n in boxes})
        for n, t in snapshot.items():
            p = self.tensors.get(n)
            if p is None or p.dtype != t.dtype or p.shape != t.shape:
                raise PublishError(f"tensor {n!r} is not in version {plan.parent_version} as {t.dtype}{list(t.shape)}")
        return self.tensors

    def grandparents_for(self, parent_version: int | None) -> dict[str, torch.Tensor] | None:
        return self.grand if self.grand_of == parent_version else None

    def committed(self, snapshot: dict[str, torch.Tensor], version: int, digests: dict[str, int],
                  boxes: sharded.Boxes, keep_grandparent: bool) -> dict[str, torch.Tensor]:
        """``snapshot`` committed as ``version`` becomes the parent; returns the superseded buffers (the spares
        of the next host copy). ``keep_grandparent`` (a LoRA delta): the old parent becomes the grandparent and
        the old grandparent's buffers are returned instead."""
        old, self.tensors, self.version = self.tensors, snapshot, version
        self.digests, self.boxes = digests, dict(boxes)
        if keep_grandparent:
            recycled, self.grand, self.grand_of = self.grand, old, version
            return recycled
        self.grand, self.grand_of = {}, None
        return old
