"""One publish as it travels from the caller's thread to the worker that plans, writes and commits it."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ckptdelta.delta.errors import PublishError

from ckptdelta.publisher import explore, lora
from ckptdelta.publisher import sharded
from ckptdelta.publisher.host_copy import Schema


@dataclass
class PublishJob:
    """What publish() hands the worker. ``error`` is an input error carried so that every rank of a sharded
    publisher fails this publish together (each must take part in its rounds); ``failures_seen`` is the
    publisher's failure count when it was queued, so a publish queued behind one that failed is skipped."""

    snapshot: dict[str, torch.Tensor] | None
    schema: Schema | None
    step: int
    metadata: dict[str, str]
    force_anchor: bool
    error: BaseException | None
    failures_seen: int
    t_start: float
    wait: bool
    copy_s: float = 0.0
    adapter: "lora.AdapterSnapshot | None" = None   # a LoRA run's publish (publisher/lora.py)
    boxes: sharded.Boxes = field(default_factory=dict)     # this rank's boxes of the DTensors it publishes
    version: int | None = None       # the version planned for it (round 1)
    committing: bool = False         # past the last point where giving up at exit stops its commit
    exploration: "explore.Sample | None" = None   # codec="auto": what to measure once it has returned
    call: int = 0                    # which publish() call of this rank's publisher it is (from 1)
    exact: "dict[str, torch.Tensor] | None" = None   # keep_exact: the fp32 host copy, attached after the commit

    def describe(self) -> str:
        return f"step {self.step}" + (f" (version {self.version})" if self.version is not None else "")


class Skipped(PublishError):
    """An earlier publish failed; publishes queued behind it are not attempted."""
