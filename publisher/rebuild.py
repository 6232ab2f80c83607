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

from ckptdelta.delta import codec, dtypes
from ckptdelta.delta.batch import apply_many
from ckptdelta.delta.codec import EncodedTensor
from ckptdelta.delta.errors import ChecksumError, ManifestError, PublishError, SnapshotNotFoundError
from ckptdelta.delta.manifest import Manifest, TensorEntry
from ckptdelta.delta.pieces import Box, PieceEntry, box_view, describe_box, flat_range, tensor_digest
from ckptdelta.delta.record import MAX_NAME_BYTES, header_size_for, max_record_size
from ckptdelta.delta.storage import Store

from ckptdelta.publisher.runs import read_manifest, read_manifests

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
    # a LoRA run's records may be coded against the snapshot before their parent too (encoding 6): keep the
    # tensors a delta changed as they were before it, for the next delta (adapters are small; a full model's
    # publisher never writes such records, so nothing is copied there)
    older: dict[str, torch.Tensor] | None = {} if last.adapter is not None else None
    for m in chain[1:]:
        _apply_delta(store, m, out, older)
    for n in wanted:
        e = last.tensors[n]
        got = tensor_digest(e.pieces, out[n])     # a pieced tensor's: the digest of its boxes' digests
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


def _apply_delta(store: Store, m: Manifest, tensors: dict[str, torch.Tensor],
                 older: dict[str, torch.Tensor] | None = None) -> None:
    """Apply ``m``'s records to whole tensors: a tensor's record, or each changed box's record to its box.
    ``older``: each tensor as it was before the last delta that changed it, when that was ``m``'s parent (a
    record's grandparent, docs/FORMAT.md encoding 6), updated for the next delta; None: not kept."""
    todo: list[tuple[str, "TensorEntry | PieceEntry", str]] = []
    for n in tensors:
        if n not in m.tensors:
            raise ManifestError(f"{m.where()}: tensor {n!r} of its parent is missing (a delta cannot drop tensors)")
        e = m.tensors[n]
        todo += [(n, p, m.tensors[n].dtype) for p in e.pieces if p.object is not None]
        if e.object is not None:
            todo.append((n, e, e.dtype))
    datas = store.get_many([(m.objects[st.object].key, (st.offset, st.offset + st.length)) for _, st, _ in todo])
    in_place, through_copy = [], []
    for (n, st, dtype), data in zip(todo, datas):
        piece = isinstance(st, PieceEntry)
        what = f"{m.where()} tensor {n!r}" + (f" piece {describe_box(*st.box)}" if piece else "")
        _check_record_size(dtype, st.shape, st.length, len(data), what)
        enc = EncodedTensor.from_bytes(data, what=what)
        if not piece and not enc.header.has_parent:       # stored whole (its shape or dtype may have changed)
            tensors[n] = codec.decode(None, enc)
        elif not piece:
            grand = None
            if enc.needs_grandparent:
                # the parent's record of n left its before-image in older; no record there: the parent's bits
                grand = older.get(n, tensors[n]) if older is not None else None
            in_place.append((tensors[n], enc, grand))
        else:
            _check_piece_record(enc, n, st, what)
            t = tensors[n]
            if t.is_contiguous() and flat_range(st.offsets, st.shape, tuple(t.shape)) is not None:
                in_place.append((box_view(t, st.offsets, st.shape), enc))   # rows: a contiguous view, in place
            else:
                through_copy.append((box_view(t, st.offsets, st.shape), enc))
    if older is not None:
        changed = {id(item[0]) for item in in_place}
        before = {n: t.clone() for n, t in tensors.items() if id(t) in changed}
        older.clear()
        older.update(before)
    apply_many(in_place)                    # every tensor of the delta at once, on every core
    for view, enc in through_copy:          # column boxes: decoded from a copy, written back
        view.copy_(codec.decode(view.contiguous(), enc))


def _check_piece_record(enc: EncodedTensor, name: str, p: PieceEntry, what: str) -> None:
    h = enc.header
    if h.name != name or tuple(h.shape) != p.shape or codec.digest_hex(h.digest) != p.xxh3 or not h.has_parent:
        raise ChecksumError(f"{what}: the record holds {h.name!r}{list(h.shape)} with digest "
                            f"{codec.digest_hex(h.digest)}, the manifest's piece is {list(p.shape)} with {p.xxh3}")


def _check_record_size(dtype: str, shape: tuple[int, ...], length: int, got: int, what: str) -> None:
    if got != length:
        raise ChecksumError(f"{what}: read {got} bytes of a {length}-byte record")
    dt = dtypes.by_name(dtype)
    numel = 1
    for s in shape:
        numel *= s
    if length < header_size_for(len(shape), 0, 0) or \
            length > max_record_size(numel, dt.itemsize, len(shape), MAX_NAME_BYTES):
        raise ManifestError(f"{what}: implausible record length {length}")


def rebuild_boxes(store: Store, chain: Sequence[Manifest], boxes: dict[str, Box]) -> dict[str, torch.Tensor]:
    """CPU tensors of boxes of the chain's last snapshot's tensors, for a rank that publishes its box of each.

    The box comes from the anchor (a range read of its rows when the chain's last snapshot gives the box's
    digest, which then proves them; else the whole tensor, checked, one at a time), then each delta's record
    for the same box is applied. A chain whose deltas hold the tensor in other boxes, or whole, cannot give
    this box without rebuilding more: :class:`PublishError` (the publish then writes an anchor)."""
    last, anchor = chain[-1], chain[0]
    out: dict[str, torch.Tensor] = {}
    target: dict[str, PieceEntry | None] = {}
    for n, box in boxes.items():
        e = last.tensors.get(n)
        if e is None or n not in anchor.tensors:
            raise ManifestError(f"{last.where()}: tensor {n!r} is not in it or in its anchor {anchor.name}")
        target[n] = next((p for p in e.pieces if p.box == box), None)
        if e.pieces and target[n] is None:
            raise PublishError(f"{last.where()} holds tensor {n!r} in other pieces than {describe_box(*box)}")
        for m in chain[1:]:
            me = m.tensors.get(n)
            if me is None or (me.pieces and all(p.box != box for p in me.pieces)) or \
                    (not me.pieces and me.object is not None):
                how = "whole" if me is not None and not me.pieces else "in other pieces"
                raise PublishError(f"{m.where()} holds tensor {n!r} {how}: its box {describe_box(*box)} cannot be "
                                   "rebuilt alone")
    rows = {n: b for n, b in boxes.items() if target[n] is not None
            and flat_range(b[0], b[1], anchor.tensors[n].shape) is not None}
    ranged = [(n, anchor.tensors[n], flat_range(b[0], b[1], anchor.tensors[n].shape)) for n, b in rows.items()]
    datas = store.get_many([(anchor.objects[_obj(anchor, n, e)].key,
                             (e.offset + r[0] * _itemsize(e), e.offset + r[1] * _itemsize(e))) for n, e, r in ranged])
    for (n, e, _r), data in zip(ranged, datas):
        dt = dtypes.by_name(e.dtype)
        if len(data) != _numel(boxes[n][1]) * dt.itemsize:
            raise ChecksumError(f"{anchor.where()}: rows of tensor {n!r}: read {len(data)} bytes")
        out[n] = dtypes.from_bits(np.frombuffer(bytearray(data), dtype=dt.bits_dtype), dt, boxes[n][1])
    for n in boxes:                      # the rest from whole tensors, one at a time
        if n not in out:
            whole = _read_anchor(store, anchor, [n])[n]
            out[n] = box_view(whole, *boxes[n]).contiguous().clone()
            del whole
    for m in chain[1:]:
        todo = [(n, p) for n in boxes for p in m.tensors[n].pieces if p.box == boxes[n] and p.object is not None]
        datas = store.get_many([(m.objects[p.object].key, (p.offset, p.offset + p.length)) for _, p in todo])
        items = []
        for (n, p), data in zip(todo, datas):
            what = f"{m.where()} tensor {n!r} piece {describe_box(*p.box)}"
            _check_record_size(m.tensors[n].dtype, p.shape, p.length, len(data), what)
            enc = EncodedTensor.from_bytes(data, what=what)
            _check_piece_record(enc, n, p, what)
            items.append((out[n], enc))
        apply_many(items)
    for n, p in target.items():
        if p is not None and codec.digest_hex(codec.digest(out[n])) != p.xxh3:
            raise ChecksumError(f"{last.where()}: rebuilt piece {describe_box(*p.box)} of tensor {n!r} does not "
                                f"hash to the manifest's {p.xxh3}")
    log.info("rebuilt %d boxes of %s from its anchor and %d deltas", len(boxes), last.where(), len(chain) - 1)
    return out


def _itemsize(e: TensorEntry) -> int:
    return dtypes.by_name(e.dtype).itemsize


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _obj(m: Manifest, name: str, e: TensorEntry) -> int:
    if e.object is None:
        raise ManifestError(f"{m.where()}: tensor {name!r} has no object in an anchor")
    return e.object
