"""Anchors: full snapshots as Hugging Face style sharded safetensors, with each tensor's byte range.

The shards are written here rather than by ``safetensors.torch.save`` because the
manifest must record where each tensor's data sits in its file (readers
range-read one tensor), and because the file is hashed as it is written.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON
header, then the data buffer; each tensor's ``data_offsets`` are relative to the
buffer, so its absolute range is ``8 + N + begin .. 8 + N + end``. The header is
padded with spaces to a multiple of 8 and, inside a shard, tensors are laid out
by decreasing element size, so every tensor starts aligned to its element size
(what zero-copy readers need).
"""

from __future__ import annotations

import json
import logging
import os
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import BinaryIO

import torch
import xxhash

from ckptdelta.delta import dtypes
from ckptdelta.delta.codec import digest_hex
from ckptdelta.delta.errors import PublishInputError
from ckptdelta.delta.manifest import MAX_EXTRA_FILE_BYTES, MAX_EXTRA_FILES, clash_text, extra_names_clash, is_safe_key

log = logging.getLogger("ckptdelta.publisher")

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
#: File names an anchor directory reserves for itself (extra files may not use them).
RESERVED_PREFIX = "model"
#: Files of a model directory that are weights in another format: never copied as extra files.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx", ".npz")


def shard_file_name(index: int, total: int) -> str:
    """HF naming: ``model.safetensors`` alone, else ``model-00001-of-00003.safetensors`` (1-based)."""
    if total == 1:
        return SINGLE_FILE
    return f"model-{index + 1:05d}-of-{total:05d}.safetensors"


def plan_shards(sizes: Sequence[tuple[str, int]], shard_bytes: int) -> list[list[str]]:
    """Split tensors, in order, into shards of at most ``shard_bytes`` (a larger tensor gets its own).

    The same greedy rule as ``transformers``' ``save_pretrained``, so a model's
    shards hold the same tensors as when it is saved there.
    """
    shards: list[list[str]] = []
    current: list[str] = []
    used = 0
    for name, n in sizes:
        if current and used + n > shard_bytes:
            shards.append(current)
            current, used = [], 0
        current.append(name)
        used += n
    if current:
        shards.append(current)
    return shards


@dataclass(frozen=True)
class ShardLayout:
    header: bytes                              # the 8-byte length and the padded JSON header
    order: list[str]                           # tensors in data order
    ranges: dict[str, tuple[int, int]]         # name -> (absolute offset, length)
    size: int                                  # total file size


def layout_shard(tensors: Mapping[str, torch.Tensor], names: Sequence[str],
                 metadata: Mapping[str, str] | None = None) -> ShardLayout:
    order = sorted(names, key=lambda n: -tensors[n].element_size())  # stable: keeps state_dict order per size
    header: dict[str, object] = {"__metadata__": dict(metadata or {"format": "pt"})}
    rel: dict[str, tuple[int, int]] = {}
    pos = 0
    for n in order:
        t = tensors[n]
        nbytes = t.numel() * t.element_size()
        header[n] = {"dtype": dtypes.of(t).name, "shape": list(t.shape), "data_offsets": [pos, pos + nbytes]}
        rel[n] = (pos, nbytes)
        pos += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    start = 8 + len(blob)
    return ShardLayout(struct.pack("<Q", len(blob)) + blob, order,
                       {n: (start + off, ln) for n, (off, ln) in rel.items()}, start + pos)


@dataclass(frozen=True)
class WrittenShard:
    size: int
    xxh3: str
    ranges: dict[str, tuple[int, int]]
    digests: dict[str, str]           # name -> xxh3 of the tensor's bytes


def write_shard(f: BinaryIO, tensors: Mapping[str, torch.Tensor], layout: ShardLayout,
                on_bytes: Callable[[int], None] | None = None) -> WrittenShard:
    """Write one shard to ``f`` (a binary file), hashing the file and each tensor on the way."""
    whole = xxhash.xxh3_64()
    f.write(layout.header)
    whole.update(layout.header)
    digests = {}
    for n in layout.order:
        bits = dtypes.host_bits(tensors[n])
        mv = memoryview(bits.view("u1"))
        digests[n] = digest_hex(xxhash.xxh3_64_intdigest(mv))
        f.write(mv)
        whole.update(mv)
        if on_bytes is not None:
            on_bytes(len(mv))
    return WrittenShard(layout.size, digest_hex(whole.intdigest()), layout.ranges, digests)


def index_json(weight_map: Mapping[str, str], total_size: int) -> bytes:
    """``model.safetensors.index.json`` as ``transformers`` writes and reads it."""
    return json.dumps({"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))},
                      indent=2).encode() + b"\n"


def model_dir_files(path: str | os.PathLike[str]) -> dict[str, str]:
    """The files of a Hugging Face model directory an anchor carries, name -> path: config.json,
    generation_config.json, the tokenizer's files, everything at its top level except weights (any format),
    the shard index and dotfiles. ``ckptdelta publish DIR`` and ``Publisher(extra_files=DIR)`` take these."""
    src = os.fspath(path)
    if not os.path.isdir(src):
        raise PublishInputError(f"extra_files={src!r}: not a directory (give a model directory, or a mapping of "
                                "file name -> path or bytes)")
    out = {}
    for name in sorted(os.listdir(src)):
        full = os.path.join(src, name)
        if not os.path.isfile(full) or name.startswith(".") or name == INDEX_FILE:
            continue
        if name.endswith(WEIGHT_SUFFIXES):
            log.info("%s: not copying %s (weights in another format)", src, name)
        elif not is_safe_key(name):
            log.warning("%s: not copying %s (name outside [A-Za-z0-9._-])", src, name)
        else:
            out[name] = full
    return out


def model_files(model: object, dtype: torch.dtype | None = None) -> dict[str, bytes]:
    """config.json (and generation_config.json) of a transformers model, as ``save_pretrained`` writes them
    (its class and dtype recorded: ``dtype``, the one it is published in, else the model's); {} for anything
    else. Duck-typed: transformers is not imported here."""
    config = getattr(model, "config", None)
    if config is None or not callable(getattr(config, "to_json_string", None)):
        return {}
    import copy

    config = copy.deepcopy(config)
    dtype = dtype or getattr(model, "dtype", None)
    if isinstance(dtype, torch.dtype):
        setattr(config, "dtype" if hasattr(config, "dtype") else "torch_dtype", str(dtype).split(".")[1])
    config.architectures = [type(model).__name__]
    out = {"config.json": config.to_json_string().encode()}
    gen = getattr(model, "generation_config", None)
    can_generate = getattr(model, "can_generate", None)
    if gen is not None and callable(getattr(gen, "to_json_string", None)) and callable(can_generate) \
            and can_generate():
        out["generation_config.json"] = gen.to_json_string().encode()
    return out


ExtraFiles = "Mapping[str, str | os.PathLike[str] | bytes] | str | os.PathLike[str] | None"


def read_extra_files(extra: ExtraFiles) -> dict[str, bytes]:
    """Extra files are read once, here: an anchor written later must not see a half-edited config.
    ``extra`` is a mapping (name -> path or bytes) or a model directory (:func:`model_dir_files`)."""
    if isinstance(extra, (str, os.PathLike)):
        extra = model_dir_files(extra)
    out: dict[str, bytes] = {}
    for name, src in (extra or {}).items():
        if not (isinstance(name, str) and is_safe_key(name)):
            raise PublishInputError(f"extra file name {name!r} must be a relative path of [A-Za-z0-9._-] segments")
        base = name.rsplit("/", 1)[-1]
        if name == INDEX_FILE or base.endswith(".safetensors") and name == base:
            raise PublishInputError(f"extra file {name!r} would collide with the anchor's own weight files")
        if isinstance(src, (bytes, bytearray, memoryview)):
            out[name] = bytes(src)
        else:
            try:
                if os.path.getsize(src) > MAX_EXTRA_FILE_BYTES:
                    raise PublishInputError(f"extra file {name!r} ({src}) is larger than {MAX_EXTRA_FILE_BYTES} "
                                            "bytes, the most a reader takes: publish weights as tensors, not as "
                                            "extra files")
                with open(src, "rb") as f:
                    out[name] = f.read()
            except OSError as e:
                raise PublishInputError(f"extra file {name!r}: cannot read {src}: {e.strerror or e}") from None
        if len(out[name]) > MAX_EXTRA_FILE_BYTES:
            raise PublishInputError(f"extra file {name!r} is larger than {MAX_EXTRA_FILE_BYTES} bytes, the most a "
                                    "reader takes")
    if len(out) > MAX_EXTRA_FILES:
        raise PublishInputError(f"{len(out)} extra files: at most {MAX_EXTRA_FILES}")
    clash = extra_names_clash(out)
    if clash is not None:    # readers refuse such a manifest: no model directory can hold both
        raise PublishInputError(f"extra files: {clash_text(clash)}; a model directory cannot hold both")
    return out
