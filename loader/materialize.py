"""Write a snapshot as a Hugging Face checkpoint directory (safetensors shards, index, config...).

So any engine can start from any version: ``from_pretrained(out_dir)`` and
``safetensors.safe_open`` read what this writes. Shards are streamed: each
shard's header is computed from the manifest (every dtype, shape and size is
known before a byte is fetched), then tensors are rebuilt a batch at a time and
appended, so memory stays at one batch whatever the model's size. The directory
appears whole or not at all (written under a temporary name, fsynced, renamed).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import secrets
import sys
from typing import TYPE_CHECKING

from ckptdelta.delta import dtypes
from ckptdelta.delta.lora_record import ADAPTER_WEIGHTS_NAME
from ckptdelta.delta.errors import ManifestError
from ckptdelta.delta.manifest import Manifest, snapshot_name
from ckptdelta.delta.storage import fsync_dir

if TYPE_CHECKING:
    from ckptdelta.loader.reader import SnapshotReader

log = logging.getLogger("ckptdelta.loader")

#: Hugging Face's default max_shard_size ("5GB").
SHARD_BYTES = 5 * 10**9
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


def plan_shards(m: Manifest, max_bytes: int = SHARD_BYTES) -> list[list[str]]:
    """Tensor names per shard, in name order, each shard at most ``max_bytes`` (or one tensor)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name in sorted(m.tensors):
        n = m.tensors[name].nbytes
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    return shards if shards[0] else []


def shard_names(n: int) -> list[str]:
    if n <= 1:
        return [WEIGHTS_NAME]
    return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def safetensors_header(m: Manifest, names: list[str], metadata: dict[str, str]) -> bytes:
    """The 8-byte length and JSON header of a safetensors file holding ``names`` back to back."""
    header: dict = {"__metadata__": metadata}
    off = 0
    for name in names:
        e = m.tensors[name]
        dtypes.by_name(e.dtype)
        header[name] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [off, off + e.nbytes]}
        off += e.nbytes
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-(8 + len(body)) % 8)
    return len(body).to_bytes(8, "little") + body


def write_checkpoint(reader: "SnapshotReader", version: int, out_dir: str, *, progress: bool | None = None,
                     shard_bytes: int = SHARD_BYTES, priors: dict | None = None) -> str:
    """Materialize ``version`` into ``out_dir`` (which must not exist, or be empty); returns ``out_dir``.
    ``priors``: filled with where each tensor last changed and its bits before (``SnapshotReader.iter_tensors``)."""
    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise FileExistsError(f"cannot materialize {snapshot_name(version)} into {out_dir}: it exists and is not empty")
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    m = reader.manifest(version)
    if m.adapter is None:
        shards = plan_shards(m, shard_bytes)
        files = shard_names(len(shards))
    else:           # a LoRA run's snapshot is a PEFT adapter directory: one adapter_model.safetensors
        shards, files = [sorted(m.tensors)], [ADAPTER_WEIGHTS_NAME]
    total = sum(e.nbytes for e in m.tensors.values())
    show = sys.stderr.isatty() if progress is None else progress
    tmp = _temp_dir(parent, f".{os.path.basename(out_dir)}.tmp-")
    try:
        from tqdm import tqdm
        with tqdm(total=total, unit="B", unit_scale=True, disable=not show,
                  desc=f"materialize {snapshot_name(version)}") as bar:
            meta = {"format": "pt", "ckptdelta_run": reader.run_id, "ckptdelta_version": str(version)}
            for names, fname in zip(shards, files):
                _write_shard(reader, m, version, names, os.path.join(tmp, fname), meta, bar, priors)
        if len(shards) > 1:
            index = {"metadata": {"total_size": total},
                     "weight_map": {n: f for names, f in zip(shards, files) for n in names}}
            _write_file(os.path.join(tmp, INDEX_NAME), json.dumps(index, indent=2, sort_keys=True).encode())
        for rel, obj in reader.extra_files(version):
            top = rel.split("/")[0]
            if rel.endswith(".safetensors") or top.endswith(".safetensors") or top == INDEX_NAME:
                continue     # the weights and their index are the ones written above
            _write_file(os.path.join(tmp, *rel.split("/")), reader.read_object(obj), m, rel)
        fsync_dir(tmp)
        try:
            os.rename(tmp, out_dir)
        except OSError as e:
            raise FileExistsError(f"cannot materialize into {out_dir}: {e}") from e
        fsync_dir(parent)
        log.info("materialized %s (%d tensors, %d bytes) into %s", snapshot_name(version), len(m.tensors), total,
                 out_dir)
        return out_dir
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write_shard(reader: "SnapshotReader", m: Manifest, version: int, names: list[str], path: str,
                 meta: dict[str, str], bar, priors: dict | None = None) -> None:
    with open(path, "wb") as f:
        f.write(safetensors_header(m, names, meta))
        with contextlib.closing(reader.iter_tensors(version, names, priors=priors)) as tensors:
            for name, t in tensors:
                bits = dtypes.host_bits(t)
                if bits.nbytes != m.tensors[name].nbytes:
                    raise AssertionError(f"tensor {name!r}: rebuilt {bits.nbytes} bytes, manifest says "
                                         f"{m.tensors[name].nbytes}")
                f.write(bits.view("u1").data)
                bar.update(bits.nbytes)
        f.flush()
        os.fsync(f.fileno())


def _temp_dir(parent: str, prefix: str) -> str:
    """A new directory in ``parent`` whose mode follows the umask, as the checkpoint's directory must (a server
    running as another user reads it): ``tempfile.mkdtemp`` makes it 0700, and the rename keeps that."""
    for _ in range(100):
        path = os.path.join(parent, prefix + secrets.token_hex(6))
        try:
            os.mkdir(path, 0o777)
            return path
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name in {parent} (prefix {prefix})")


def _write_file(path: str, data: bytes, m: Manifest | None = None, rel: str = "") -> None:
    """Write a new file (never one written before: two extra files of one name, or a name that differs from
    another only in case on a case-insensitive filesystem, fail here rather than one silently replacing the
    other)."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except (FileExistsError, NotADirectoryError, IsADirectoryError) as e:
        if m is None:
            raise
        raise ManifestError(f"{m.where()}: extra file {rel!r} cannot be written beside the snapshot's other "
                            f"files ({e.strerror}: a name clash, on a case-insensitive filesystem?)") from None
