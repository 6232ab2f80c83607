"""The few collectives a sharded trainer's publishers need, and their single-process stand-in.

Every rank runs the same publish steps in the same order; between steps they
exchange small Python objects (schemas, tensor entries, object refs, errors):
rank 0 decides and commits, the others follow its answer. With one process the
collectives are identities, so one code path serves both cases.

By default the collectives run on a dedicated gloo group created when the
Publisher is built: publishes run in a background thread, and sharing the
trainer's own (often NCCL) group from there could interleave with its
collectives.

What crosses between ranks is counted (``Comm.stats``): the pickled bytes of the
objects a rank receives, and the tensor bytes it receives. A delta of DTensor
pieces moves metadata only; an anchor of pieces sends each tensor's pieces, one
tensor at a time, to the rank that writes its shard (:meth:`Comm.send_bytes`).
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from delta import errors

log = logging.getLogger("ckptdelta.publisher")


class Comm:
    """One process: gathers return ``[obj]``, broadcasts return ``obj``."""

    rank = 0
    world = 1

    def __init__(self) -> None:
        #: bytes this rank received from the others: pickled objects (metadata), tensor bytes (anchors' pieces);
        #: the most bytes of other ranks' pieces an anchor's writer held at once (publisher/sharded.py)
        self.stats = {"object_bytes": 0, "tensor_bytes": 0, "largest_gather": 0}

    def all_gather(self, obj: Any) -> list[Any]:
        return [obj]

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` on rank 0 (None on the others)."""
        return [obj]

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (the others pass anything)."""
        return obj

    def send_bytes(self, data: np.ndarray, dst: int, tag: int) -> None:
        """Send ``data`` (a contiguous array, as bytes) to rank ``dst``, which receives it with ``tag``."""
        raise errors.PublishError("send_bytes needs more than one rank")

    def recv_bytes(self, nbytes: int, src: int, tag: int) -> np.ndarray:
        """The ``nbytes`` bytes rank ``src`` sends with ``tag`` (uint8)."""
        raise errors.PublishError("recv_bytes needs more than one rank")

    def agree(self, local_error: BaseException | None, payload: Any = None, *, to_root: bool = False) -> list[Any]:
        """Gather every rank's ``payload``; if any rank failed, all raise (the failing rank its own error).

        ``to_root``: only rank 0 needs the payloads (the others get ``[]``): every rank learns of every error,
        but a rank's payload (its tensor schemas, its written entries) is not sent to all the others."""
        err = None if local_error is None else describe(local_error)
        if to_root and self.world > 1:
            errs = self.all_gather(err)
            if local_error is not None:
                raise local_error
            for r, e in enumerate(errs):
                if e is not None:
                    raise remote_error(r, e)
            return self.gather(payload) or []
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
        super().__init__()
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        self._src = dist.get_global_rank(group, 0) if group is not None else 0

    def _global(self, r: int) -> int:
        return dist.get_global_rank(self.group, r) if self.group is not None else r

    def all_gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world
        with _collective("all_gather", self.rank):
            dist.all_gather_object(out, obj, group=self.group)
        self._count(o for r, o in enumerate(out) if r != self.rank)
        return out

    def gather(self, obj: Any) -> list[Any] | None:
        out: list[Any] | None = [None] * self.world if self.rank == 0 else None
        with _collective("gather", self.rank):
            dist.gather_object(obj, out, dst=self._src, group=self.group)
        if out is not None:
            self._count(o for r, o in enumerate(out) if r != self.rank)
        return out

    def broadcast(self, obj: Any) -> Any:
        box = [obj]
        with _collective("broadcast", self.rank):
            dist.broadcast_object_list(box, src=self._src, group=self.group)
        if self.rank != 0:
            self._count([box[0]])
        return box[0]

    # Point to point, not gloo's gather: that one pads every rank's bytes to the largest and, on the receiving
    # rank, gathers into a flat buffer it then copies out (3x a tensor held at once where 1x will do), and
    # the sender would copy its piece into the padded buffer.
    def send_bytes(self, data: np.ndarray, dst: int, tag: int) -> None:
        t = torch.from_numpy(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
        with _collective("send of an anchor tensor's piece", self.rank):
            dist.send(t, dst=self._global(dst), group=self.group, tag=tag)

    def recv_bytes(self, nbytes: int, src: int, tag: int) -> np.ndarray:
        t = torch.empty(nbytes, dtype=torch.uint8)
        with _collective("receive of an anchor tensor's piece", self.rank):
            dist.recv(t, src=self._global(src), group=self.group, tag=tag)
        self.stats["tensor_bytes"] += nbytes
        return t.numpy()

    def _count(self, objs: Any) -> None:
        self.stats["object_bytes"] += sum(len(pickle.dumps(o, protocol=pickle.HIGHEST_PROTOCOL)) for o in objs)


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


@contextmanager
def _collective(what: str, rank: int) -> Iterator[None]:
    """A collective that fails (gloo: a peer's connection closed, or a timeout) fails the publish on this rank
    with a PublishError that says so: another rank died or stopped taking part, and nothing is committed."""
    try:
        yield
    except RuntimeError as e:
        raise errors.PublishError(f"rank {rank}: the publishers' {what} failed ({str(e).splitlines()[0][:300]}); "
                                  "another rank died or stopped publishing: this publish commits nothing, and "
                                  "the run keeps its last committed snapshot") from e


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
