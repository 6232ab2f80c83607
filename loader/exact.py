"""Reading a version's exact bits: the bf16 snapshot, then its attachment's records decoded against it
(delta/exact.py, docs/FORMAT.md "Exact attachments")."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ckptdelta.delta import dtypes
from ckptdelta.delta.codec import EncodedTensor, decode, digest_hex
from ckptdelta.delta.errors import (ChecksumError, ExactBitsMissingError, FormatError, ObjectNotFoundError,
                                    ObjectTooLargeError)
from ckptdelta.delta.exact import MAX_INDEX_BYTES, ExactIndex, index_key, parse_index, widen

if TYPE_CHECKING:
    from ckptdelta.loader.reader import Names, SnapshotReader


def read_index(reader: "SnapshotReader", version: int) -> ExactIndex:
    """The version's attachment index, checked against its manifest (delta/exact.py ``parse_index``)."""
    m = reader.manifest(version)
    key = index_key(version)
    try:
        data = reader._get(key, max_size=MAX_INDEX_BYTES)      # counted with the reader's other reads
    except ObjectTooLargeError as e:
        raise FormatError(f"exact attachment {key} of {m.where()}: {e}") from None
    except ObjectNotFoundError:
        raise ExactBitsMissingError(
            f"{m.where()}: no exact bits are attached ({reader.store.key_url(key)} does not exist). A run "
            "keeps them only when published with Publisher(dtype=torch.bfloat16, keep_exact=True), and writes them "
            "just after each commit: a publisher that stopped in between never did") from None
    return parse_index(data, run_id=reader.run_id, manifest=m)


def attachment_where(reader: "SnapshotReader", version: int) -> str:
    return f"exact attachment of {reader.manifest(version).where()}"


def read_exact(reader: "SnapshotReader", ref: "str | int", names: "Names" = None, *,
               index: ExactIndex | None = None) -> dict[str, torch.Tensor]:
    """The snapshot's tensors as the trainer held them: each one with exact bits attached rebuilt from them,
    every other one as published (already exact: the cast left it as it was). ``index``: the version's, read
    already by the caller (:func:`read_index`), which then reads it once for all its batches."""
    version = reader.resolve(ref)
    if index is None:
        index = read_index(reader, version)
    elif index.version != version:
        raise ValueError(f"the exact index of version {index.version} given for version {version}")
    out = reader.read_tensors(version, names)
    todo = [n for n in out if n in index.tensors and index.tensors[n].has_record]
    entries = [index.tensors[n] for n in todo]
    where = attachment_where(reader, version)
    for i in sorted({e.object for e in entries}):
        o = index.objects[i]
        size = reader.store.size(o.key)
        if size != o.size:
            raise ChecksumError(f"{where}: {o.key} holds {size} bytes, its index says {o.size}")
    blobs = reader._get_many([(index.objects[e.object].key, (e.offset, e.offset + e.length)) for e in entries])
    for name, blob in zip(todo, blobs):
        out[name] = exact_tensor(index, name, blob, out[name], where)
    return out


def exact_tensor(index: ExactIndex, name: str, blob: bytes | memoryview, published: torch.Tensor,
                 where: str) -> torch.Tensor:
    """Tensor ``name`` as the trainer held it, from its attachment record ``blob`` (the bytes its index entry
    locates) and its ``published`` bf16 value (proven against the manifest by the caller): the record's header
    checked against the index entry, then decoded, the parent's digest, every payload's and the result's
    checked."""
    e = index.tensors[name]
    if len(blob) != e.length:
        raise FormatError(f"{where}: tensor {name!r}: {len(blob)} bytes where its index says {e.length} "
                          f"({index.objects[e.object].key} is shorter than its index says)")
    enc = EncodedTensor.from_bytes(memoryview(blob), what=f"tensor {name!r} of the {where}")
    h = enc.header
    if h.name != name or h.dtype.name != e.dtype or h.shape != tuple(published.shape) or not h.has_parent \
            or digest_hex(h.digest) != e.xxh3:
        raise FormatError(f"{where}: the record at [{e.offset}, +{e.length}) of "
                          f"{index.objects[e.object].key} is {h.dtype.name} {h.name!r} {list(h.shape)} (digest "
                          f"{digest_hex(h.digest)}), where the index says F32 {name!r} {list(published.shape)} "
                          f"(digest {e.xxh3})")
    parent = torch.from_numpy(widen(dtypes.host_bits(published))).reshape(published.shape)
    return decode(parent, enc)
