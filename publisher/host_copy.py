"""The trainer's weights, validated and copied to host memory that the publisher owns.

A publish must capture the weights *as they are when publish() is called*: the
trainer steps again right away and mutates them in place. So every tensor is
copied into a host buffer owned by the publisher before publish() returns, and
everything after that (encoding, hashing, uploading, keeping the copy as the
next delta's parent) reads only these copies. CUDA tensors are copied into
pinned buffers (the fast DMA path). Fresh host memory is expensive to fill (the
kernel maps and zeroes each page on first touch, which costs more than the copy
itself; pinned memory costs more still), so the publisher
hands the buffers of a superseded parent back here and every step after the
second copies into buffers it already owns (benchmarks/publish_host_copy.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping
from typing import Any, Union

import numpy as np
import torch

from ckptdelta.delta import dtypes
from ckptdelta.delta.errors import PublishInputError, UnsupportedDtypeError
from ckptdelta.delta.manifest import tensor_name_problem

from ckptdelta.publisher.tied import tied_aliases

log = logging.getLogger("ckptdelta.publisher")

Weights = Union[torch.nn.Module, Mapping[str, "torch.Tensor | np.ndarray"]]
Partition = Union[Callable[[str], bool], Collection[str], None]
#: name -> (dtype name, shape): what must stay equal for a delta to be possible.
Schema = dict[str, tuple[str, tuple[int, ...]]]


def gather_sources(weights: Weights, partition: Partition = None) -> dict[str, torch.Tensor | np.ndarray]:
    """The tensors to publish, by name, after every check that can refuse them.

    A module's tied weights are published once, as ``save_pretrained`` writes
    them: the aliases the model declares (publisher/tied.py) are left out.
    Other names holding one tensor (a mapping, a module that declares no tying)
    are each published on their own, which costs the bytes once per name in
    anchors and nothing extra in deltas when they do not change.
    """
    if isinstance(weights, torch.nn.Module):
        items: Mapping[str, Any] = weights.state_dict()
        aliases = tied_aliases(weights, items)
        if aliases:
            items = {n: t for n, t in items.items() if n not in aliases}
    elif isinstance(weights, Mapping):
        items = weights
    else:
        raise PublishInputError(
            f"publish() takes an nn.Module or a mapping of name -> tensor, not {type(weights).__name__}")
    keep = _partition_filter(partition)
    out: dict[str, torch.Tensor | np.ndarray] = {}
    for name, value in items.items():
        problem = tensor_name_problem(name)
        if problem is not None:
            raise PublishInputError(f"tensor {name!r} cannot be published: {problem}")
        if keep is not None and not keep(name):
            continue
        _check_value(name, value)
        out[name] = value
    return out


def _partition_filter(partition: Partition) -> Callable[[str], bool] | None:
    if partition is None:
        return None
    if callable(partition):
        return partition
    names = frozenset(partition)
    return names.__contains__


def _check_value(name: str, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        if type(value).__name__ == "DTensor":    # each rank publishes its box of it (publisher/sharded.py)
            with torch.no_grad():                # outside no_grad to_local() is an autograd call
                value = value.to_local()
        if value.is_meta:
            raise PublishInputError(f"tensor {name!r} is on the meta device: it has no data to publish")
        if value.layout != torch.strided:
            raise PublishInputError(f"tensor {name!r} has layout {value.layout}; only dense tensors are published")
    elif not isinstance(value, np.ndarray):
        raise PublishInputError(
            f"value {name!r} is a {type(value).__name__}, not a tensor; publish() takes tensors only "
            "(drop extra state, or pass a dict of tensors)")
    try:
        dtypes.of(value)
    except UnsupportedDtypeError as e:
        raise PublishInputError(f"tensor {name!r}: {e}") from e


def schema_of(tensors: Mapping[str, torch.Tensor | np.ndarray]) -> Schema:
    return {n: (dtypes.of(t).name, tuple(int(s) for s in t.shape)) for n, t in tensors.items()}


class Cast(Mapping):
    """``sources`` with every floating-point tensor cast to ``dtype`` (``Publisher(dtype=...)``), each one on its
    own device as it is read: a trainer's fp32 masters become the bf16 a replica serves before the host copy,
    so only the published bits cross to the host, and one tensor at a time is held in both dtypes. Integer and
    bool tensors (step counters, index buffers) are published as they are: a cast would change what they
    mean. numpy float arrays are cast on the host."""

    def __init__(self, sources: Mapping[str, "torch.Tensor | np.ndarray"], dtype: torch.dtype):
        self.sources, self.dtype = sources, dtype

    def __getitem__(self, name: str) -> "torch.Tensor | np.ndarray":
        src = self.sources[name]
        if isinstance(src, np.ndarray):
            return torch.from_numpy(np.ascontiguousarray(src)).to(self.dtype) if src.dtype.kind == "f" else src
        return src.detach().to(self.dtype) if src.is_floating_point() else src

    def __iter__(self):
        return iter(self.sources)

    def __len__(self) -> int:
        return len(self.sources)


def check_publish_dtype(dtype: Any) -> torch.dtype | None:
    """``Publisher(dtype=...)`` checked: None, or a floating-point torch dtype the format holds."""
    if dtype is None:
        return None
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point torch.dtype such as torch.bfloat16, got {dtype!r}")
    try:
        dtypes.of(torch.empty(0, dtype=dtype))
    except UnsupportedDtypeError as e:
        raise ValueError(f"dtype={dtype}: {e}") from None
    return dtype


#: CPU tensors at least this large are copied by torch's threads (faster than one memcpy on idle cores, not
#: much slower on busy ones); smaller ones by one memcpy on the calling thread.
THREADED_COPY_BYTES = 16 << 20


def copy_to_host(sources: Mapping[str, torch.Tensor | np.ndarray],
                 spare: dict[str, torch.Tensor] | None = None,
                 names: Collection[str] | None = None) -> dict[str, torch.Tensor]:
    """Contiguous CPU copies of ``sources`` (of ``names`` of them, when given), pinned for CUDA sources,
    complete on return. Each source is read once, as it is copied (a :class:`Cast` casts it then).

    ``spare`` holds buffers the caller no longer needs; one of the right dtype,
    shape and pinning is reused instead of allocating.
    """
    spare = spare or {}
    out: dict[str, torch.Tensor] = {}
    cuda_devices: set[torch.device] = set()
    with torch.no_grad():
        for name in (sources if names is None else names):
            raw = sources.sources[name] if isinstance(sources, Cast) else None
            if isinstance(raw, torch.Tensor) and raw.device.type == "cpu" and raw.is_floating_point() and \
                    raw.dtype != sources.dtype and raw.is_contiguous():
                # cast as it is copied, one pass: a cast tensor first and a copy of it then took 4-5x as long on a
                # LoRA adapter's small tensors. Contiguous sources only: there copy_ runs .to()'s very conversion;
                # from a permuted tensor .to() keeps the strides and takes another kernel, whose NaNs differ
                dst = _buffer(spare.get(name), sources.dtype, tuple(raw.shape), pin=False)
                dst.copy_(raw.detach())
                out[name] = dst
                continue
            src = sources[name]
            if isinstance(src, np.ndarray):
                dt = dtypes.of(src)
                bits = np.ascontiguousarray(src).reshape(-1).view(dt.bits_dtype)
                dst = _buffer(spare.get(name), dt.torch_dtype, tuple(src.shape), pin=False)
                dtypes.host_bits(dst)[:] = bits
                out[name] = dst
                continue
            t = src.detach()
            on_cuda = t.device.type == "cuda"
            dst = _buffer(spare.get(name), t.dtype, tuple(t.shape), pin=on_cuda)
            if t.device.type == "cpu" and t.is_contiguous() and dst.nbytes < THREADED_COPY_BYTES:
                # one memcpy on this thread: torch's copy_ splits even a small tensor over its intra-op
                # threads, which on a trainer's busy cores wait for each other: far slower than one memcpy
                # there, where on idle cores they save little
                np.copyto(dtypes.host_bits(dst), dtypes.host_bits(t))
            else:
                dst.copy_(t, non_blocking=on_cuda)
            if on_cuda:
                cuda_devices.add(t.device)
            out[name] = dst
    # The copies were queued on each device's current stream: wait for them so that
    # the trainer may overwrite its weights as soon as publish() returns.
    for dev in cuda_devices:
        torch.cuda.current_stream(dev).synchronize()
    return out


def _buffer(old: torch.Tensor | None, dtype: torch.dtype, shape: tuple[int, ...], *, pin: bool) -> torch.Tensor:
    if old is not None and old.dtype == dtype and tuple(old.shape) == shape and old.is_pinned() == pin:
        return old
    return torch.empty(shape, dtype=dtype, pin_memory=pin)


def spares(snapshot: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """The buffers of a superseded snapshot, kept for the next copy (pinned or not: a buffer already
    written is cheaper to fill again than fresh memory). Holds a second copy of the model between
    publishes."""
    return dict(snapshot or {})
