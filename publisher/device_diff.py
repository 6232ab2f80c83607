"""``Publisher(device_diff=True)``: move only the changed elements from the trainer's device to the host.

A delta is encoded on the host from two host copies, the parent (the last
committed snapshot, which the publisher holds) and the new weights. Copying the
new weights to the host whole costs the model's bytes over PCIe every step,
although nearly all of them are the parent's. With ``device_diff`` the publisher
keeps the last published bits on the weights' own device (one extra copy of them
there), finds the elements whose bits differ with torch ops on that device
(integer views: NaN payloads and -0.0 are bits like any other), and moves only
their positions (int32 below 2**31 elements) and values. On the host the new snapshot is built in the buffers
of the snapshot before the parent (which the publisher keeps for reuse): they are
brought up to the parent by the changes the parent's own publish moved (kept for
this), then to the new weights by this step's. No host buffer is allocated after
the first two steps and no whole tensor crosses to the host; the result is the
same bits as a full copy (tests/publisher/test_publisher_device_diff.py checks it on CPU
tensors, where "the device" is the CPU: the code is the same torch ops).

Invariant: the device copy holds the bits of the version recorded in
``version``; a capture whose publish is not committed (it failed) leaves that
unknown, and the next capture copies everything again (and refills the device
copy). The same when a tensor is new, changed shape or dtype, or is a numpy array.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from ckptdelta.delta import dtypes, kernels

from ckptdelta.publisher.host_copy import copy_to_host


_INT32_MAX = (1 << 31) - 1


@dataclass
class CaptureStats:
    """What the last capture moved: tensors copied whole, tensors diffed, changed elements moved, bytes moved."""

    full: int = 0
    diffed: int = 0
    changed: int = 0
    bytes_moved: int = 0


@dataclass
class _Pending:
    changes: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)


class DeviceDiff:
    """The device copy of the last published bits, and the changes that bring the spare host buffers up to
    the parent. Used by one Publisher, one capture at a time (``max_in_flight=1``)."""

    def __init__(self) -> None:
        self._device: dict[str, torch.Tensor] = {}   # flat integer views of the last captured bits
        self.version: int | None = None              # the committed version the device copy holds
        self._pending: _Pending | None = None        # captured, not (yet) committed
        self._lag: dict[str, tuple[np.ndarray, np.ndarray]] = {}   # spare buffers -> version ``_lag_version``
        self._lag_version: int | None = None
        self.stats = CaptureStats()

    @property
    def device_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._device.values())

    def capture(self, sources: Mapping[str, "torch.Tensor | np.ndarray"], parent: Mapping[str, torch.Tensor],
                parent_version: int | None, spare: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Host copies of ``sources`` with the same bits as :func:`copy_to_host` makes, complete on return.

        ``parent`` holds the bits of ``parent_version`` (the last committed snapshot), ``spare`` the buffers of
        the one before it (they are written)."""
        if self._pending is not None:        # the last capture's publish was not committed
            self.version, self._lag_version, self._lag = None, None, {}
        self._pending = _Pending()
        stats = CaptureStats()
        try:
            out = self._capture(sources, parent, parent_version, spare, stats)
        except BaseException:
            self.version = None
            raise
        self.stats = stats
        return out

    def committed(self, version: int) -> None:
        """The captured snapshot was committed as ``version``: the device copy and the lag are valid."""
        if self._pending is None:
            return
        self.version, self._lag, self._lag_version = version, self._pending.changes, version
        self._pending = None

    def _capture(self, sources, parent, parent_version, spare, stats: CaptureStats) -> dict[str, torch.Tensor]:
        valid = self.version is not None and self.version == parent_version
        lag_ok = self._lag_version is not None and self._lag_version == parent_version
        out: dict[str, torch.Tensor] = {}
        whole: list[str] = []    # copied whole after the loop, read from ``sources`` again (a Cast casts again)
        devices: set[torch.device] = set()
        with torch.no_grad():
            for name, src in sources.items():
                if not isinstance(src, torch.Tensor):
                    whole.append(name)
                    self._device.pop(name, None)
                    continue
                bits = dtypes.torch_bits_view(src.detach().contiguous())
                dev = self._device.get(name)
                p = parent.get(name)
                usable = (valid and dev is not None and p is not None and dev.device == bits.device
                          and dev.dtype == bits.dtype and dev.numel() == bits.numel() and p.dtype == src.dtype
                          and tuple(p.shape) == tuple(src.shape))
                if not usable:
                    whole.append(name)
                    if dev is not None and dev.device == bits.device and dev.dtype == bits.dtype \
                            and dev.numel() == bits.numel():
                        dev.copy_(bits)             # refill the device copy in place
                    else:
                        self._device[name] = bits.clone()
                    devices.add(bits.device)
                    continue
                pos = torch.nonzero(bits != dev).reshape(-1)
                vals = bits[pos]
                dev[pos] = vals                     # the device copy takes the new bits
                if bits.numel() <= _INT32_MAX:      # 4 bytes a position over the bus, not 8
                    pos = pos.to(torch.int32)
                pos_h = pos.cpu().numpy()
                vals_h = vals.cpu().numpy().view(dtypes.of(src).bits_dtype)
                devices.add(bits.device)
                out[name] = self._host_new(name, p, spare.get(name), lag_ok, pos_h, vals_h)
                self._pending.changes[name] = (pos_h, vals_h)
                stats.diffed += 1
                stats.changed += int(pos_h.shape[0])
                stats.bytes_moved += pos_h.nbytes + vals_h.nbytes
        if whole:
            copied = copy_to_host(sources, spare, whole)    # one source held at a time, not all of them
            stats.full += len(copied)
            stats.bytes_moved += sum(t.numel() * t.element_size() for t in copied.values())
            out.update(copied)
        for name in [n for n in self._device if n not in sources]:   # no longer published: free its copy
            del self._device[name]
        for d in devices:
            if d.type == "cuda":
                torch.cuda.current_stream(d).synchronize()
        return {n: out[n] for n in sources}

    def _host_new(self, name: str, parent: torch.Tensor, buf: torch.Tensor | None, lag_ok: bool,
                  pos: np.ndarray, vals: np.ndarray) -> torch.Tensor:
        """The new host tensor: the spare buffer brought up to the parent (by the parent's own changes, or
        by a copy of the parent when they are not known), then this step's changes scattered into it."""
        if buf is None or buf.dtype != parent.dtype or tuple(buf.shape) != tuple(parent.shape) \
                or not buf.is_contiguous():
            buf = parent.clone()
        elif lag_ok and name in self._lag:
            kernels.scatter(dtypes.host_bits(buf), *self._lag[name])
        else:
            buf.copy_(parent)
        kernels.scatter(dtypes.host_bits(buf), pos, vals)
        return buf
