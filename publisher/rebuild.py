"""Rebuild a committed snapshot's tensors from the bucket: read the anchor, replay the deltas.

A restarted publisher needs the exact bits of the last published snapshot as
the parent of its next delta, and the trainer's weights are not those bits (the
trainer may hold fp32 masters, or have stepped since). This is the publisher's
own small reader: it range-reads only the tensors asked for, checks every byte
against the manifests (tensor digests, record checksums, parent digests), and
never imports loader/.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence

import numpy as np
import torch

from delta import codec, dtypes
from delta.batch import apply_many
from delta.codec import EncodedTensor
from delta.errors import ChecksumError, ManifestError, SnapshotNotFoundError
from delta.manifest import Manifest, TensorEntry
from delta.record import MAX_NAME_BYTES, header_size_for, max_record_size
from delta.storage import Store

from .runs import read_manifest, read_manifests

log = logging.getLogger("ckptdelta.publisher")


def read_chain(store: Store, version: int, run_id: str) -> list[Manifest]:
    """Manifests from ``version``'s anchor up to ``version``, anchor first, each checked to link to the last."""
    last = read_manifest(store, version, run_id)
    try:
        chain = read_manifests(store, range(last.anchor_version, version), run_id) + [last]
    except FileNotFoundError:
        raise SnapshotNotFoundError(f"a snapshot in the chain of {last.where()} at {store.url} is gone "
                                    "(deleted by gc?): the chain cannot be replayed") from None
    if chain[0].kind != "anchor":
        raise ManifestError(f"{chain[0].where()}: expected the anchor of {last.where()}, found a delta")
    for prev, m in zip(chain, chain[1:]):
        if m.kind != "delta" or m.parent_version != prev.version or m.anchor_version != chain[0].version:
            raise ManifestError(f"{m.where()}: does not continue the chain of anchor version {chain[0].version} "
                                f"(parent {m.parent_version}, anchor {m.anchor_version})")
    return chain


def rebuild(store: Store, chain: Sequence[Manifest], names: Collection[str] | None = None) -> dict[str, torch.Tensor]:
    """CPU tensors of the chain's last snapshot, for ``names`` (default: all) that it holds."""
    last = chain[-1]
    wanted = [n for n in (last.tensors if names is None else names) if n in last.tensors]
    anchor = chain[0]
    missing = [n for n in wanted if n not in anchor.tensors]
    if missing:
        raise ManifestError(f"{last.where()}: tensor {missing[0]!r} is not in its anchor {anchor.name}")
    out = _read_anchor(store, anchor, wanted)
    for m in chain[1:]:
        _apply_delta(store, m, out)
    for n in wanted:
        e = last.tensors[n]
        got = codec.digest_hex(codec.digest(out[n]))
        if got != e.xxh3:
            raise ChecksumError(f"{last.where()}: rebuilt tensor {n!r} hashes to {got}, the manifest says {e.xxh3}")
    log.info("rebuilt %d tensors of %s from its anchor and %d deltas", len(wanted), last.where(), len(chain) - 1)
    return out


def _read_anchor(store: Store, m: Manifest, names: list[str]) -> dict[str, torch.Tensor]:
    entries = [(n, m.tensors[n]) for n in names]
    datas = store.get_many([(m.objects[_obj(m, n, e)].key, (e.offset, e.offset + e.length)) for n, e in entries])
    out = {}
    for (n, e), data in zip(entries, datas):
        if len(data) != e.length or e.length != e.nbytes:
            raise ChecksumError(f"{m.where()}: tensor {n!r} read {len(data)} bytes, expected {e.nbytes}")
        dt = dtypes.by_name(e.dtype)
        bits = np.frombuffer(bytearray(data), dtype=dt.bits_dtype)
        if codec.digest_hex(codec.digest(bits)) != e.xxh3:
            raise ChecksumError(f"{m.where()}: anchor bytes of tensor {n!r} do not match the manifest's xxh3")
        out[n] = dtypes.from_bits(bits, dt, tuple(e.shape))
    return out


def _apply_delta(store: Store, m: Manifest, tensors: dict[str, torch.Tensor]) -> None:
    todo = [(n, m.tensors[n]) for n in tensors if n in m.tensors and m.tensors[n].object is not None]
    for n in tensors:
        if n not in m.tensors:
            raise ManifestError(f"{m.where()}: tensor {n!r} of its parent is missing (a delta cannot drop tensors)")
    datas = store.get_many([(m.objects[_obj(m, n, e)].key, (e.offset, e.offset + e.length)) for n, e in todo])
    in_place = []
    for (n, e), data in zip(todo, datas):
        what = f"{m.where()} tensor {n!r}"
        _check_record_size(e, len(data), what)
        enc = EncodedTensor.from_bytes(data, what=what)
        if not enc.header.has_parent:       # stored whole (its shape or dtype may have changed)
            tensors[n] = codec.decode(None, enc)
        else:
            in_place.append((tensors[n], enc))
    apply_many(in_place)                    # every tensor of the delta at once, on every core


def _check_record_size(e: TensorEntry, got: int, what: str) -> None:
    if got != e.length:
        raise ChecksumError(f"{what}: read {got} bytes of a {e.length}-byte record")
    dt = dtypes.by_name(e.dtype)
    if e.length < header_size_for(len(e.shape), 0, 0) or \
            e.length > max_record_size(e.numel, dt.itemsize, len(e.shape), MAX_NAME_BYTES):
        raise ManifestError(f"{what}: implausible record length {e.length}")


def _obj(m: Manifest, name: str, e: TensorEntry) -> int:
    if e.object is None:
        raise ManifestError(f"{m.where()}: tensor {name!r} has no object in an anchor")
    return e.object
