"""The few collectives a sharded trainer's publishers need, and their single-process stand-in.

Every rank runs the same publish steps in the same order; between steps they
exchange small Python objects (schemas, tensor entries, object refs, errors):
rank 0 decides and commits, the others follow its answer. With one process the
collectives are identities, so one code path serves both cases.

By default the collectives run on a dedicated gloo group created when the
Publisher is built: publishes run in a background thread, and sharing the
trainer's own (often NCCL) group from there could interleave with its
collectives. That group waits at most ``collective_timeout`` seconds
(:data:`COLLECTIVE_TIMEOUT_S` by default, not torch's 30 minutes) for another
rank at any step; a rank that is gone or stuck past it fails the publish.

A rank's own failure never waits for that timeout: every local step of a publish
ends in a round every rank joins (:meth:`Comm.settle`, :meth:`Comm.exchange`),
which carries the failure, so every rank raises it together; and the anchor's
piece exchange, the one place ranks send each other data between rounds, is
followed to its end by a rank that failed during it (publisher/sharded.py).

What crosses between ranks is counted (``Comm.stats``): the pickled bytes of the
objects a rank receives, and the tensor bytes it receives. A delta of DTensor
pieces moves metadata only; an anchor of pieces sends each tensor's pieces, one
tensor at a time, to the rank that writes its shard (:meth:`Comm.send_bytes`).
"""

from __future__ import annotations

import logging
import math
import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from ckptdelta.delta import errors
from ckptdelta.delta.errors import CollectiveError

log = logging.getLogger("ckptdelta.publisher")

#: How long the publishers' own gloo group waits for another rank at any step of a publish (seconds): the
#: time it allows between two ranks reaching the same step, so it must pass the longest a healthy rank can
#: lag behind (publish() called later, a larger share of an anchor to write and upload), and it is what a
#: rank that hangs without failing costs the others. ``Publisher(collective_timeout=...)`` sets it.
COLLECTIVE_TIMEOUT_S = 300.0


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

    def settle(self, local_error: BaseException | None, payload: Any, fn: Any, context: str = "", *,
               commits: bool = False) -> Any:
        """One round trip through rank 0: every rank's ``payload`` (and its error, if it failed) goes to rank 0,
        which runs ``fn(payloads)`` when no rank failed, and its result (or the error: the first failing rank's,
        else ``fn``'s) comes back to every rank. A rank that failed raises its own error, the others that rank's
        (sharded, as a PublishError naming the rank, the error and ``context``: what was being published).

        Two exchanges, a gather then a broadcast, where an all-gather of the errors followed by a gather and
        a broadcast took three: a step's publish is two of these rounds (plan, then commit).

        ``commits``: ``fn`` commits the snapshot, so a broadcast that fails after it (a rank gone once every
        rank's part was in) does not mean that nothing was committed: rank 0 says that it was, the others that
        it may have been."""
        gathered = self.gather((payload, None if local_error is None else describe(local_error)))
        result, failed, exc = None, None, None
        if self.rank == 0:
            assert gathered is not None
            failed = next(((r, e) for r, (_p, e) in enumerate(gathered) if e is not None), None)
            if failed is None:
                try:
                    result = fn([p for p, _e in gathered])
                except Exception as e:  # noqa: BLE001 - forwarded to every rank, then re-raised
                    failed, exc = (0, describe(e)), e
        try:
            result, failed = self.broadcast((result, failed))
        except CollectiveError as e:
            if local_error is not None:     # this rank's own error: rank 0 committed nothing, and it says why
                raise self._own(local_error, context) from e
            if not commits or (self.rank == 0 and failed is not None):
                raise
            raise _outcome_unheard(e, self.rank, context) from e
        if local_error is not None:
            raise self._own(local_error, context)
        if exc is not None:
            raise self._own(exc, context)
        if failed is not None:
            raise publish_error(*failed, context)
        return result

    def exchange(self, local_error: BaseException | None, payload: Any = None, context: str = "") -> list[Any]:
        """A status round: every rank's ``payload`` on every rank, unless a rank failed (``local_error``): then
        every rank raises it, the failing rank its own error and the others a :class:`PublishError` naming
        that rank and its error. A local step that ranks must agree on before the next one (where a rank that
        went on alone would wait for a message the failed rank never sends) ends in one of these."""
        gathered = self.all_gather((payload, None if local_error is None else describe(local_error)))
        if local_error is not None:
            raise self._own(local_error, context)
        failed = next(((r, e) for r, (_p, e) in enumerate(gathered) if e is not None), None)
        if failed is not None:
            raise publish_error(*failed, context)
        return [p for p, _e in gathered]

    def _own(self, e: BaseException, context: str = "") -> BaseException:
        """This rank's failure as every rank sees it: a PublishError naming the rank (the error itself
        chained), so a sharded publish fails the same way everywhere; one process keeps the error as it is."""
        if self.world == 1 or isinstance(e, errors.PublishError) or not isinstance(e, Exception):
            return e
        out = publish_error(self.rank, describe(e), context)
        out.__cause__ = e
        return out

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

    # gather_object all-gathers every rank's size and pads each payload to the largest; rank 0 needs only
    # theirs: each rank sends its size and its pickled bytes to rank 0, which receives every rank's at once.
    def gather(self, obj: Any) -> list[Any] | None:
        data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        with _collective("gather", self.rank):
            if self.rank != 0:
                size = torch.tensor([len(data)], dtype=torch.int64)
                sends = [dist.isend(size, dst=self._src, group=self.group, tag=_GATHER_SIZE_TAG),
                         dist.isend(_bytes_tensor(data), dst=self._src, group=self.group, tag=_GATHER_TAG)]
                for w in sends:
                    w.wait()
                return None
            peers = range(1, self.world)
            sizes = {r: torch.empty(1, dtype=torch.int64) for r in peers}
            for w in [dist.irecv(sizes[r], src=self._global(r), group=self.group, tag=_GATHER_SIZE_TAG)
                      for r in peers]:
                w.wait()
            bufs = {r: torch.empty(int(sizes[r]), dtype=torch.uint8) for r in peers}
            for w in [dist.irecv(bufs[r], src=self._global(r), group=self.group, tag=_GATHER_TAG) for r in peers]:
                w.wait()
        self.stats["object_bytes"] += sum(b.numel() for b in bufs.values())
        return [obj, *(pickle.loads(bufs[r].numpy()) for r in peers)]

    def broadcast(self, obj: Any) -> Any:
        size = torch.empty(1, dtype=torch.int64)
        if self.rank == 0:
            data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            size[0] = len(data)
        with _collective("broadcast", self.rank):
            dist.broadcast(size, src=self._src, group=self.group)
            buf = _bytes_tensor(data) if self.rank == 0 else torch.empty(int(size), dtype=torch.uint8)
            dist.broadcast(buf, src=self._src, group=self.group)
        if self.rank == 0:
            return obj
        self.stats["object_bytes"] += buf.numel()
        return pickle.loads(buf.numpy())

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


#: Tags of gather()'s point-to-point messages (an anchor's pieces use tags from 0 up: publisher/sharded.py).
_GATHER_SIZE_TAG, _GATHER_TAG = 0x7FFF0000, 0x7FFF0001


def _bytes_tensor(data: bytes) -> torch.Tensor:
    """``data`` as a uint8 tensor for gloo (one copy, into memory torch may write; never empty)."""
    return torch.frombuffer(bytearray(data or b"\0"), dtype=torch.uint8)[:len(data)]


def make_comm(process_group: Any = None, distributed: bool | None = None, timeout: float | None = None) -> Comm:
    """The collectives for this process: torch.distributed when it is up with more than one rank, on
    ``process_group`` or on a new gloo group that waits at most ``timeout`` seconds for another rank
    (:data:`COLLECTIVE_TIMEOUT_S` when None). A group of the caller's keeps its own timeout."""
    if timeout is not None:
        if process_group is not None:
            raise ValueError("collective_timeout applies to the gloo group the Publisher creates; a process_group "
                             "of yours keeps the timeout it was created with (dist.new_group(timeout=...))")
        if not (isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and 0 < timeout < math.inf):
            raise ValueError(f"collective_timeout must be a positive number of seconds, got {timeout!r}")
    if distributed is False:
        return Comm()
    up = dist.is_available() and dist.is_initialized()
    if not up:
        if distributed:
            raise errors.PublishError("distributed=True but torch.distributed is not initialized")
        return Comm()
    if dist.get_world_size(process_group) == 1:
        return Comm()
    if process_group is None:
        seconds = COLLECTIVE_TIMEOUT_S if timeout is None else float(timeout)
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=seconds))
    else:
        group = process_group
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
        raise CollectiveError(f"rank {rank}: the publishers' {what} failed ({str(e).splitlines()[0][:300]}); "
                              "another rank died or stopped publishing: this publish commits nothing, and "
                              "the run keeps its last committed snapshot") from e


def _outcome_unheard(e: CollectiveError, rank: int, context: str) -> CollectiveError:
    """A commit round's broadcast failed: rank 0 had every rank's part, so the snapshot may be committed (on rank
    0: it is, as ``fn`` returned), unlike a round that fails before it (:func:`_collective`'s "commits nothing")."""
    cause = str(e.__cause__ or e).splitlines()[0][:300]
    if rank == 0:
        return CollectiveError(f"rank 0: {context} is committed, but the publishers' broadcast of the commit failed "
                               f"({cause}): another rank died or stopped publishing after it sent its part; the "
                               "other ranks were not told")
    return CollectiveError(f"rank {rank}: the publishers' broadcast of the commit of {context} failed ({cause}): "
                           "rank 0 or another rank died or stopped publishing after every rank had sent its part, "
                           "so the snapshot may be committed. `ckptdelta ls` lists it if it is")


def describe(e: BaseException) -> tuple[str, str]:
    return type(e).__name__, str(e)


def publish_error(rank: int, err: tuple[str, str], context: str = "") -> BaseException:
    """Rank ``rank``'s failure of a publish, as this rank raises it: the same class where it is a PublishError
    (bad input stays PublishInputError everywhere), else a PublishError naming the error's class and what was
    being published (``context``)."""
    name, msg = err
    cls = getattr(errors, name, None)
    if isinstance(cls, type) and issubclass(cls, errors.PublishError):
        # already named where it began (a failure of an earlier publish, raised again by the next one)
        return cls(msg if msg.startswith(f"rank {rank}: ") else f"rank {rank}: {msg}")
    where = f" (publishing {context}: nothing is committed)" if context else ""
    return errors.PublishError(f"rank {rank}: {name}: {msg}{where}")


def remote_error(rank: int, err: tuple[str, str]) -> BaseException:
    """Another rank's error, as the same ckptdelta class where there is one."""
    name, msg = err
    cls = getattr(errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, errors.CkptDeltaError)):
        cls = errors.PublishError
        msg = f"{name}: {msg}"
    return cls(f"rank {rank}: {msg}")
