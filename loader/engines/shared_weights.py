"""One host copy of a replica's current weights, in checkpoint coordinates, in a shared-memory file.

An engine that keeps its weights in its own layout (vLLM re-packs CPU linears,
fuses q/k/v and gate/up, pads vocabularies) cannot be the decoder's parent: a
delta is defined on the checkpoint's tensors. So the replica keeps those tensors
itself, once per host, in a file on ``/dev/shm``: the replica process maps it
read-write and :class:`ckptdelta.loader.hotswap.HotSwapper` patches it in place (undo and
all); every engine worker of the host maps the same pages read-only-by-convention
and hands the changed tensors to the engine's own loader. Nothing is copied per
worker, and the file is exactly the model's checkpoint bytes plus alignment.

Layout: tensors back to back, each at a 64-byte aligned offset, described by an
index (name -> dtype, shape, offset, nbytes) stored beside the file as JSON.
Only torch is imported here: engine workers load this module.

The file's pages are reserved before anything is written (``posix_fallocate``):
a sparse file on a ``/dev/shm`` smaller than the model (Docker's default is
64 MiB) would kill the replica with SIGBUS halfway through the copy, with no
word of why. The replica holds a lock on the file while it lives
(delta/scratch.py): any replica of the host removes those nobody holds.
"""

from __future__ import annotations

import errno
import json
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import torch

from ckptdelta.delta.errors import CkptDeltaError
from ckptdelta.delta.scratch import SHM_DIR_ENV, shm_dir

ALIGN = 64
#: Where the host copy goes instead of /dev/shm (a tmpfs or a directory of its own; every engine worker of the
#: host must see it at the same path).
DIR_ENV = SHM_DIR_ENV
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2)}


def _dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"shared weights: unsupported dtype {name!r}") from None


class HostCopySpaceError(CkptDeltaError, OSError):
    """The directory of the host copy (``/dev/shm``) has less room than the model needs."""


def default_dir() -> str:
    """``$CKPTDELTA_SHM_DIR``, else ``/dev/shm`` where it exists (memory, visible to every process of the host),
    else the temp dir."""
    return shm_dir()


def _mib(n: int) -> str:
    return f"{n / (1 << 20):,.1f} MiB"


def reserve(fd: int, nbytes: int, directory: str) -> None:
    """Allocate ``nbytes`` for the file ``fd`` now (never a sparse file whose pages may be missing when
    written), or raise :class:`HostCopySpaceError` saying how much is needed, how much is free, and how to
    give it."""
    try:
        os.posix_fallocate(fd, 0, nbytes)
        return
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
            raise
    try:
        st = os.statvfs(directory)
        free, total = st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
        room = f"{_mib(free)} free of {_mib(total)}"
    except OSError:
        room = "less free"
    error = HostCopySpaceError(
        f"the host copy of the weights needs {_mib(nbytes)} in {directory}, which has {room}: "
        "give the replica more shared memory (docker run --shm-size=<model size + 10%> or --ipc=host; "
        "Kubernetes: an emptyDir with medium: Memory mounted at /dev/shm) or point "
        f"{DIR_ENV} at a tmpfs or directory with room")
    error.errno = errno.ENOSPC
    raise error


@dataclass
class SharedWeights:
    """The mapped file: ``tensors`` are writable views of it (name -> tensor, checkpoint shape and dtype)."""

    path: str
    index: dict[str, dict]
    tensors: dict[str, torch.Tensor]
    owner: Any = field(default=None, repr=False)   # ckptdelta.delta.scratch.Owned: the file, locked while we live

    @property
    def index_path(self) -> str:
        return self.path + ".json"

    @property
    def nbytes(self) -> int:
        return sum(e["nbytes"] for e in self.index.values())

    @classmethod
    def create(cls, tensors: Mapping[str, torch.Tensor], *, directory: str | None = None) -> "SharedWeights":
        """Write ``tensors`` (bit for bit) into a new shared file and map it."""
        index: dict[str, dict] = {}
        offset = 0
        for name, t in tensors.items():
            nbytes = t.numel() * t.element_size()
            index[name] = {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
                           "offset": offset, "nbytes": nbytes}
            offset += -(-max(nbytes, 1) // ALIGN) * ALIGN
        from ckptdelta.delta import scratch

        directory = directory or default_dir()
        remove_orphans(directory)
        owner = scratch.make("weights", directory)
        try:
            reserve(owner.fd, max(offset, 1), directory)
            shared = cls(owner.path, index, _map(owner.path, index, index), owner)
            for name, t in tensors.items():
                shared.tensors[name].copy_(t.detach().cpu().reshape(shared.tensors[name].shape))
            tmp = shared.index_path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(index, f)
            os.replace(tmp, shared.index_path)
        except BaseException:
            owner.release()
            raise
        return shared

    @property
    def positions_path(self) -> str:
        return self.path + ".pos"

    def close(self) -> None:
        """Unmap (drop the views) and remove the file, its index and its positions file."""
        self.tensors = {}
        if self.owner is not None:
            self.owner.release()       # the index and positions files first, the locked file last
            return
        for p in (self.index_path, self.positions_path, self.path):
            try:
                os.unlink(p)
            except FileNotFoundError:
                pass


def write_positions(path: str, arrays: Iterable[tuple[str, "object"]]) -> list[tuple[str, int, int]]:
    """Write each tensor's changed flat positions (int32, back to back) to ``path``; returns (name, offset, n).

    What an in-place patch needs from the replica: the new values are in the
    shared weights file already."""
    import numpy as np

    spans, parts, off = [], [], 0
    for name, pos in arrays:
        a = np.ascontiguousarray(pos, dtype=np.int32)
        spans.append((name, off, int(a.shape[0])))
        parts.append(a)
        off += int(a.shape[0])
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        for a in parts:
            f.write(memoryview(a).cast("B"))
    os.replace(tmp, path)
    return spans


def open_positions(path: str) -> torch.Tensor:
    """The int32 positions :func:`write_positions` wrote (a private mapping of the file)."""
    n = os.path.getsize(path) // 4
    if n == 0:
        return torch.empty(0, dtype=torch.int32)
    return torch.from_file(path, shared=False, size=n, dtype=torch.int32)


def remove_orphans(directory: str) -> list[str]:
    """Remove the host copies (and their index and positions files) of replicas that died without closing
    theirs: those no process holds locked (delta/scratch.py), whatever their pid says."""
    from ckptdelta.delta import scratch

    return scratch.sweep(directory, ("weights",))


def _map(path: str, index: Mapping[str, dict], names: Iterable[str]) -> dict[str, torch.Tensor]:
    size = os.path.getsize(path)
    storage = torch.UntypedStorage.from_file(path, shared=True, nbytes=size)
    flat = torch.empty(0, dtype=torch.uint8).set_(storage)
    out = {}
    for name in names:
        e = index[name]
        off, n = int(e["offset"]), int(e["nbytes"])
        if off < 0 or n < 0 or off + n > size or off % ALIGN:
            raise ValueError(f"shared weights {path}: tensor {name!r} lies outside the file")
        dt = _dtype(e["dtype"])
        out[name] = flat[off:off + n].view(dt).reshape(e["shape"])
    return out


_opened: dict[str, tuple[float, dict, dict[str, torch.Tensor]]] = {}
_opened_lock = threading.Lock()


def open_tensors(path: str, names: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """Views of the named tensors of a shared file (all of them without ``names``), for an engine worker.

    The mapping is kept per file (one per worker process, sharing the host's pages)."""
    with _opened_lock:
        mtime = os.path.getmtime(path + ".json")
        hit = _opened.get(path)
        if hit is None or hit[0] != mtime:
            with open(path + ".json") as f:
                index = json.load(f)
            # the replica's host copy and its staging file: drop mappings of removed files, keep a few
            for gone in [p for p in _opened if p != path and not os.path.exists(p + ".json")]:
                del _opened[gone]
            while len(_opened) >= 4:
                del _opened[next(iter(_opened))]
            _opened[path] = hit = (mtime, index, _map(path, index, index))
    _, index, tensors = hit
    if names is None:
        return dict(tensors)
    missing = [n for n in names if n not in tensors]
    if missing:
        raise KeyError(f"shared weights {path}: no tensors {missing[:5]}")
    return {n: tensors[n] for n in names}
