"""Write a snapshot as a Hugging Face checkpoint directory (safetensors shards, index, config...).

So any engine can start from any version: ``from_pretrained(out_dir)`` and
``safetensors.safe_open`` read what this writes. Shards are streamed: each
shard's header is computed from the manifest (every dtype, shape and size is
known before a byte is fetched), then tensors are rebuilt a batch at a time and
appended, so memory stays at one batch whatever the model's size. The directory
appears whole or not at all (written under a temporary name, fsynced, renamed).

``exact=True`` writes the trainer's own bits of a run published with
``keep_exact=True`` (loader/exact.py): each tensor the attachment holds as F32,
every other one as published, and a config.json that says so. That is the
checkpoint a trainer resumes from, where the bf16 one is what its replicas serve;
the attachment's index, read once, gives every dtype and size before a byte is
fetched, so a version without exact bits is refused before the output directory is
made.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import secrets
import sys
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from ckptdelta.delta import dtypes, untrusted_json
from ckptdelta.delta.lora_record import ADAPTER_WEIGHTS_NAME
from ckptdelta.delta.errors import CkptDeltaError, ManifestError
from ckptdelta.delta.manifest import Manifest, snapshot_name
from ckptdelta.delta.storage import fsync_dir
from ckptdelta.loader.exact import read_exact, read_index

if TYPE_CHECKING:
    import torch

    from ckptdelta.delta.exact import ExactIndex
    from ckptdelta.loader.reader import SnapshotReader

log = logging.getLogger("ckptdelta.loader")

#: Hugging Face's default max_shard_size ("5GB").
SHARD_BYTES = 5 * 10**9
#: The exact tensors rebuilt at once, in bytes (about: a batch ends with the tensor that reaches it), as a reader's
#: batches of published tensors (loader/reader.py's BATCH_BYTES).
EXACT_BATCH_BYTES = 256 << 20
WEIGHTS_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
INDEX_NAME = "model.safetensors.index.json"


def plan_shards(m: Manifest, max_bytes: int = SHARD_BYTES, layout: "Layout | None" = None) -> list[list[str]]:
    """Tensor names per shard, in name order, each shard at most ``max_bytes`` (or one tensor); sizes as
    ``layout`` writes them (default: as the manifest has them)."""
    layout = layout or Layout.published(m)
    shards: list[list[str]] = [[]]
    size = 0
    for name in sorted(m.tensors):
        n = layout.nbytes[name]
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


class Layout:
    """Each tensor's dtype and byte size in the written checkpoint: the manifest's, or the trainer's exact bits'."""

    def __init__(self, dtype: Mapping[str, str], nbytes: Mapping[str, int]) -> None:
        self.dtype, self.nbytes = dtype, nbytes

    @classmethod
    def published(cls, m: Manifest) -> "Layout":
        return cls({n: e.dtype for n, e in m.tensors.items()}, {n: e.nbytes for n, e in m.tensors.items()})

    @classmethod
    def exact(cls, m: Manifest, index: "ExactIndex") -> "Layout":
        """A tensor with an exact record is written in the record's dtype (F32, the widening of its published
        BF16: the index was checked against ``m``); every other one as published."""
        out = cls.published(m)
        for n, e in index.tensors.items():
            if e.has_record:
                elements = m.tensors[n].nbytes // dtypes.by_name(m.tensors[n].dtype).itemsize
                out.dtype[n], out.nbytes[n] = e.dtype, elements * dtypes.by_name(e.dtype).itemsize
        return out


def safetensors_header(m: Manifest, names: list[str], metadata: dict[str, str], layout: Layout | None = None) -> bytes:
    """The 8-byte length and JSON header of a safetensors file holding ``names`` back to back."""
    layout = layout or Layout.published(m)
    header: dict = {"__metadata__": metadata}
    off = 0
    for name in names:
        e, dtype, nbytes = m.tensors[name], layout.dtype[name], layout.nbytes[name]
        dtypes.by_name(dtype)
        header[name] = {"dtype": dtype, "shape": list(e.shape), "data_offsets": [off, off + nbytes]}
        off += nbytes
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-(8 + len(body)) % 8)
    return len(body).to_bytes(8, "little") + body


def write_checkpoint(reader: "SnapshotReader", version: int, out_dir: str, *, progress: bool | None = None,
                     shard_bytes: int = SHARD_BYTES, priors: dict | None = None, exact: bool = False) -> str:
    """Materialize ``version`` into ``out_dir`` (which must not exist, or be empty); returns ``out_dir``.
    ``priors``: filled with where each tensor last changed and its bits before (``SnapshotReader.iter_tensors``).
    ``exact``: the trainer's bits of a ``keep_exact`` run (ExactBitsMissingError where the version has none)."""
    if exact and priors is not None:
        raise ValueError("priors are the published bits a replica keeps; an exact checkpoint does not give them")
    out_dir = os.path.abspath(out_dir)
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise FileExistsError(f"cannot materialize {snapshot_name(version)} into {out_dir}: it exists and is not empty")
    m = reader.manifest(version)
    attachment = read_index(reader, version) if exact else None
    layout = Layout.published(m) if attachment is None else Layout.exact(m, attachment)
    parent = os.path.dirname(out_dir)
    os.makedirs(parent, exist_ok=True)
    if m.adapter is None:
        shards = plan_shards(m, shard_bytes, layout)
        files = shard_names(len(shards))
    else:           # a LoRA run's snapshot is a PEFT adapter directory: one adapter_model.safetensors
        shards, files = [sorted(m.tensors)], [ADAPTER_WEIGHTS_NAME]
    total = sum(layout.nbytes.values())
    show = sys.stderr.isatty() if progress is None else progress
    tmp = _temp_dir(parent, f".{os.path.basename(out_dir)}.tmp-")
    try:
        from tqdm import tqdm
        with tqdm(total=total, unit="B", unit_scale=True, disable=not show,
                  desc=f"materialize {snapshot_name(version)}") as bar:
            meta = {"format": "pt", "ckptdelta_run": reader.run_id, "ckptdelta_version": str(version),
                    **({"ckptdelta_bits": "exact"} if exact else {})}
            for names, fname in zip(shards, files):
                _write_shard(reader, m, version, names, os.path.join(tmp, fname), meta, bar, layout, priors,
                             attachment)
        if len(shards) > 1:
            index = {"metadata": {"total_size": total},
                     "weight_map": {n: f for names, f in zip(shards, files) for n in names}}
            _write_file(os.path.join(tmp, INDEX_NAME), json.dumps(index, indent=2, sort_keys=True).encode())
        for rel, obj in reader.extra_files(version):
            top = rel.split("/")[0]
            if rel.endswith(".safetensors") or top.endswith(".safetensors") or top == INDEX_NAME:
                continue     # the weights and their index are the ones written above
            data = reader.read_object(obj)
            if attachment is not None and rel == CONFIG_NAME:
                data = _config_of_exact(data, layout, m)
            _write_file(os.path.join(tmp, *rel.split("/")), data, m, rel)
        fsync_dir(tmp)
        try:
            os.rename(tmp, out_dir)
        except OSError as e:
            raise FileExistsError(f"cannot materialize into {out_dir}: {e}") from e
        fsync_dir(parent)
        log.info("materialized %s (%d tensors, %d bytes%s) into %s", snapshot_name(version), len(m.tensors), total,
                 ", the trainer's exact bits" if exact else "", out_dir)
        return out_dir
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write_shard(reader: "SnapshotReader", m: Manifest, version: int, names: list[str], path: str,
                 meta: dict[str, str], bar, layout: Layout, priors: dict | None = None,
                 attachment: "ExactIndex | None" = None) -> None:
    """``attachment``: the version's exact attachment index, whose bits are written (else the published ones)."""
    with open(path, "wb") as f:
        f.write(safetensors_header(m, names, meta, layout))
        tensors = reader.iter_tensors(version, names, priors=priors) if attachment is None else \
            _exact_tensors(reader, version, names, layout, attachment)
        with contextlib.closing(tensors):
            for name, t in tensors:
                bits = dtypes.host_bits(t)
                if bits.nbytes != layout.nbytes[name] or dtypes.of(t).name != layout.dtype[name]:
                    raise AssertionError(f"tensor {name!r}: rebuilt {dtypes.of(t).name}, {bits.nbytes} bytes, where "
                                         f"{layout.dtype[name]}, {layout.nbytes[name]} bytes were planned")
                f.write(bits.view("u1").data)
                bar.update(bits.nbytes)
        f.flush()
        os.fsync(f.fileno())


def _exact_tensors(reader: "SnapshotReader", version: int, names: list[str], layout: Layout,
                   index: "ExactIndex") -> Iterator[tuple[str, torch.Tensor]]:
    """(name, the trainer's bits) in ``names``' order, about :data:`EXACT_BATCH_BYTES` of them at a time, each
    batch from the index the layout was planned from (read once: every batch sees the same one)."""
    batch: list[str] = []
    size = 0
    for i, name in enumerate(names):
        batch.append(name)
        size += layout.nbytes[name]
        if size >= EXACT_BATCH_BYTES or i == len(names) - 1:
            got = read_exact(reader, version, batch, index=index)
            for n in batch:
                yield n, got.pop(n)
            batch, size = [], 0


def _config_of_exact(data: bytes, layout: Layout, m: Manifest) -> bytes:
    """The anchor's config.json for an exact checkpoint: its dtype (``dtype``, or transformers 4's
    ``torch_dtype``) is the one the run was published in, so ``from_pretrained`` with its default
    ``dtype="auto"`` would load the trainer's fp32 bits back in bf16; where the checkpoint holds exact tensors it
    says theirs, as the trainer's own ``save_pretrained`` would. Anything else of the file stays as it is, and a
    config that is not a JSON object with such a field is copied as it is."""
    exact = {layout.dtype[n] for n, e in m.tensors.items() if layout.dtype[n] != e.dtype}
    if len(exact) != 1:
        return data
    try:
        config = untrusted_json.loads(data, what=f"config.json of {m.where()}", max_bytes=len(data))
    except CkptDeltaError:
        return data
    if not isinstance(config, dict):
        return data
    name = str(dtypes.by_name(exact.pop()).torch_dtype).split(".")[1]      # "F32" -> "float32", as transformers
    changed = False
    for key in ("dtype", "torch_dtype"):
        if isinstance(config.get(key), str) and config[key] != name:
            config[key], changed = name, True
    return json.dumps(config, indent=2, sort_keys=True).encode() + b"\n" if changed else data


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
