"""The few collectives a sharded trainer's publishers need, and their single-process stand-in.

Every rank runs the same publish steps in the same order; between steps they
exchange small Python objects (schemas, tensor entries, object refs, errors):
rank 0 decides and commits, the others follow its answer. With one process the
collectives are identities, so one code path serves both cases.

By default the collectives run on a dedicated gloo group created when the
Publisher is built: publishes run in a background thread, and sharing the
trainer's own (often NCCL) group from there could interleave with its
collectives.
"""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist

from delta import errors

log = logging.getLogger("ckptdelta.publisher")


class Comm:
    """One process: gathers return ``[obj]``, broadcasts return ``obj``."""

    rank = 0
    world = 1

    def all_gather(self, obj: Any) -> list[Any]:
        return [obj]

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (the others pass anything)."""
        return obj

    def agree(self, local_error: BaseException | None, payload: Any = None) -> list[Any]:
        """Gather every rank's ``payload``; if any rank failed, all raise (the failing rank its own error)."""
        err = None if local_error is None else describe(local_error)
        gathered = self.all_gather((payload, err))
        if local_error is not None:
            raise local_error
        for r, (_, e) in enumerate(gathered):
            if e is not None:
                raise remote_error(r, e)
        return [p for p, _ in gathered]

    def decide(self, fn: Any) -> Any:
        """Run ``fn()`` on rank 0 and hand its result (or its error) to every rank."""
        result, err, exc = None, None, None
        if self.rank == 0:
            try:
                result = fn()
            except Exception as e:  # noqa: BLE001 - forwarded to every rank, then re-raised
                err, exc = describe(e), e
        result, err = self.broadcast((result, err))
        if exc is not None:
            raise exc
        if err is not None:
            raise remote_error(0, err)
        return result


class TorchComm(Comm):
    def __init__(self, group: Any):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self._src = dist.get_global_rank(group, 0) if group is not None else 0

    def all_gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast(self, obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=self._src, group=self.group)
        return box[0]


def make_comm(process_group: Any = None, distributed: bool | None = None) -> Comm:
    """The collectives for this process: torch.distributed when it is up with more than one rank."""
    if distributed is False:
        return Comm()
    up = dist.is_available() and dist.is_initialized()
    if not up:
        if distributed:
            raise errors.PublishError("distributed=True but torch.distributed is not initialized")
        return Comm()
    if dist.get_world_size(process_group) == 1:
        return Comm()
    group = process_group if process_group is not None else dist.new_group(backend="gloo")
    comm = TorchComm(group)
    log.info("publishing as rank %d of %d", comm.rank, comm.world)
    return comm


def describe(e: BaseException) -> tuple[str, str]:
    return type(e).__name__, str(e)


def remote_error(rank: int, err: tuple[str, str]) -> BaseException:
    """Another rank's error, as the same ckptdelta class where there is one."""
    name, msg = err
    cls = getattr(errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, errors.CkptDeltaError)):
        cls = errors.PublishError
        msg = f"{name}: {msg}"
    return cls(f"rank {rank}: {msg}")
