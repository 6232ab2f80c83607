"""The dense swap: tensors staged whole swap their storage with their staged new bits in the pause
instead of being copied, in chunks, with the old bits kept for an undo.
"""

from __future__ import annotations


import numpy as np
import torch
import xxhash

from ckptdelta.delta import StagedTensor, dtypes
from ckptdelta.delta.errors import HotLoadError, ShapeMismatchError

from ckptdelta.loader.staging import Staged, old_bits


_SWAP_CHUNK = 1 << 20


class DenseSwap:
    """Exchange a live tensor's bits with ``st.dense``, undoably at every point.

    After :meth:`apply` the live tensor holds the new bits and ``st.dense`` the old
    ones. :meth:`undo` may be called whenever apply stopped (it raised anywhere, or
    finished) and puts back exactly what was there: the commit records it before
    anything is written, so a failure in an allocation (a non-contiguous tensor's
    copy, the device upload) writes nothing, and one half-way through a copy is
    rolled back from the bits it has not overwritten yet. Afterwards ``st.dense``
    holds the new bits again, so the prepared update can still be committed.

    Before or while writing, the bits swapped out are hashed and must equal the
    parent digest prepare() checked: a tensor someone else wrote in place since
    then is refused (HotLoadError) instead of being silently half-replaced.

    Nothing the size of the tensor is allocated on the host on the contiguous CPU
    path (the pause must not page-fault in a copy of the model); the device path
    uploads the new bits, as any dense apply must."""

    def __init__(self, live: torch.Tensor, st: StagedTensor, method: str, live_name: str) -> None:
        self.live, self.st, self.method, self.live_name = live, st, method, live_name
        self.swapped = False        # apply() finished: undo swaps back
        self._new: torch.Tensor | None = None   # torch path: a copy of the new bits on the live device
        self._stage = 0             # torch path: 1 = st.dense being overwritten, 2 = live being overwritten
        self._tmp: np.ndarray | None = None     # numpy path: the old bits of chunk [_s, _e)
        self._s = self._e = 0
        self._done = 0              # numpy path: elements [0, _done) swapped completely

    def apply(self, check: bool = True) -> None:
        live = self.live
        if self.method == "auto" and live.device.type == "cpu" and live.is_contiguous():
            self._apply_host(check)
        else:
            self._apply_torch(check)
        self.swapped = True

    def undo(self) -> None:
        if self.swapped:            # a finished swap: swapping again restores both sides
            self.swapped = False
            self.apply(check=False)
            self.swapped = False
        elif self._tmp is not None:
            self._undo_host()
        else:
            self._undo_torch()

    # --- contiguous host memory: chunked swap through a small scratch buffer ------------------

    def _apply_host(self, check: bool) -> None:
        bits, dense = self._host_bits(), self.st.dense
        n = bits.shape[0]
        tmp = np.empty(min(_SWAP_CHUNK, n), bits.dtype)  # may fail (memory): nothing written yet
        h = xxhash.xxh3_64()
        self._tmp, self._done, self._stage = tmp, 0, 0
        for s in range(0, n, _SWAP_CHUNK):
            e = min(n, s + _SWAP_CHUNK)
            tmp[:e - s] = bits[s:e]
            if check:
                h.update(tmp[:e - s])
            self._s, self._e, self._stage = s, e, 1   # live's chunk [s, e) takes the new bits
            bits[s:e] = dense[s:e]
            self._stage = 2                           # dense's chunk takes the old bits
            dense[s:e] = tmp[:e - s]
            self._done, self._stage = e, 0
        self._tmp = None
        if check and h.intdigest() != self.st.parent_digest:
            self.swapped = True            # so the commit's rollback swaps it back
            raise self._written_error(h.intdigest())

    def _undo_host(self) -> None:
        bits, dense, tmp = self._host_bits(), self.st.dense, self._tmp
        s, e = self._s, self._e
        if self._stage == 2:               # live's chunk holds the new bits, dense's some old ones
            dense[s:e] = bits[s:e]
        if self._stage >= 1:               # tmp holds the chunk's old bits
            bits[s:e] = tmp[:e - s]
        for s in range(0, self._done, _SWAP_CHUNK):
            e = min(self._done, s + _SWAP_CHUNK)
            tmp[:e - s] = bits[s:e]
            bits[s:e] = dense[s:e]
            dense[s:e] = tmp[:e - s]
        self._tmp, self._done, self._stage = None, 0, 0

    def _host_bits(self) -> np.ndarray:
        bits = dtypes.host_bits(self.live)
        if bits.ctypes.data != self.live.data_ptr():
            raise ShapeMismatchError(f"tensor {self.st.name!r}: cannot get a writable view of the live tensor")
        return bits

    # --- device or strided tensors: torch copies -----------------------------------------------

    def _apply_torch(self, check: bool) -> None:
        live, st = self.live, self.st
        host = self._host()
        with torch.no_grad():
            self._new = host.to(live.device, copy=True)            # may fail (memory): nothing written yet
            old = live.detach().contiguous().view(-1).view(host.dtype)  # a copy when strided: may fail too
            self._stage = 1                                        # st.dense takes the old bits
            host.copy_(old)
            del old
            got = xxhash.xxh3_64_intdigest(st.dense) if check else st.parent_digest
            if got != st.parent_digest:
                raise self._written_error(got)                     # live not written yet
            self._stage = 2                                        # live takes the new bits
            live.copy_(self._new.view(st.dtype.torch_dtype).reshape(st.shape))
        self._new, self._stage = None, 0

    def _undo_torch(self) -> None:
        live, st = self.live, self.st
        host = self._host()
        with torch.no_grad():
            if self._stage == 2:           # st.dense holds every old bit; live may hold some new ones
                live.copy_(host.to(live.device).view(st.dtype.torch_dtype).reshape(st.shape))
            if self._stage >= 1:           # st.dense may hold some old bits: give it back the new ones
                host.copy_(self._new)
        self._new, self._stage = None, 0

    def _host(self) -> torch.Tensor:
        st = self.st
        np_int = np.dtype(f"<i{st.dtype.itemsize}") if st.dtype.itemsize > 1 else np.dtype(np.uint8)
        return torch.from_numpy(st.dense.view(np_int))             # shares memory with st.dense

    def _written_error(self, got: int) -> HotLoadError:
        return HotLoadError(f"tensor {self.st.name!r}: the live tensor {self.live_name!r} hashes to {got:016x}, "
                            f"prepare() saw {self.st.parent_digest:016x}: it was written after prepare(); "
                            "prepare again")


def _unchanged_since_prepare(live: torch.Tensor, s: Staged) -> StagedTensor:
    """The old bits at a sparse change's positions, gathered now (in the pause), as its undo.

    They must equal the ones prepare() gathered: a live tensor written in place since
    then (by anything but this swapper) is refused before it is touched, so neither the
    commit nor its rollback overwrites another writer's bits. Costs a gather of the
    changed elements only; a write elsewhere in the tensor is not seen (docs/GUARANTEES.md)."""
    old = old_bits(live, s.st)
    if s.undo is not None and not np.array_equal(old.values, s.undo.values):
        n = int(np.count_nonzero(old.values != s.undo.values))
        raise HotLoadError(f"tensor {s.name!r}: {n} of the {old.values.shape[0]} elements this update changes in "
                           f"the live tensor {s.live_name!r} were written after prepare(); prepare again")
    return old


def _scatter_if_unchanged(live: torch.Tensor, s: Staged) -> None:
    """A sparse change written into contiguous host memory, each old bit compared with the one prepare()
    saved as it is overwritten; a difference leaves the tensor as it was (the kernel puts back what it wrote)
    and refuses, as :func:`_unchanged_since_prepare` does."""
    from ckptdelta.delta import kernels

    bits = dtypes.host_bits(live)
    j = kernels.scatter_if_unchanged(bits, s.st.positions, s.undo.values, s.st.values)
    if j >= 0:
        raise HotLoadError(f"tensor {s.name!r}: element {int(s.st.positions[j])} of the live tensor {s.live_name!r}, "
                           "which this update changes, was written after prepare(); prepare again")


def _synchronize(applied: list[tuple[torch.Tensor | None, object]]) -> None:
    devices = {t.device for t, _ in applied if t is not None and t.device.type == "cuda"}
    for d in devices:
        torch.cuda.synchronize(d)
