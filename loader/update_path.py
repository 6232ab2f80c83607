"""Which stored bytes rebuild a tensor, and which way a replica should move between versions.

A version's tensor is its anchor's copy plus every record written for it since;
a replica already holding version ``c`` needs only the records after ``c`` — or,
when that is more bytes (a long forward jump, a rollback, a different anchor),
the target's anchor route. Only tensors whose digest differs between the live
version and the target are touched at all: going back three versions costs the
tensors those three versions changed, not the model.

Everything here is pure arithmetic on validated manifests; no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, Sequence

from ckptdelta.delta.errors import SnapshotNotFoundError
from ckptdelta.delta.manifest import Manifest, TensorEntry

from ckptdelta.loader.fetch_units import Piece, stored_pieces


def rebuild_pieces(chain: Sequence[Manifest], name: str) -> list[Piece]:
    """The pieces that rebuild ``name`` at ``chain[-1]``, in apply order.

    The first piece is a whole copy (the anchor's data, or the record of a version
    that re-added the tensor or changed its shape or dtype — such records have no
    parent); every later one is a record against the previous version: the
    tensor's, or one per changed box of a tensor stored in pieces."""
    pieces: list[Piece] = []
    prev: TensorEntry | None = None
    for m in chain:
        e = m.tensors.get(name)
        if e is None:
            pieces, prev = [], None
            continue
        if m.kind == "anchor":
            pieces = [Piece(m, name)]
        elif e.pieces:
            pieces.extend(stored_pieces(m, name))   # records of boxes: each needs the previous version
        elif e.object is not None:
            if prev is None or prev.dtype != e.dtype or prev.shape != e.shape:
                pieces = [Piece(m, name)]
            else:
                pieces.append(Piece(m, name))
        prev = e
    if not pieces or chain[-1].tensors.get(name) is None:
        raise SnapshotNotFoundError(f"tensor {name!r} is not in {chain[-1].where()}")
    return pieces


def cost(groups: Sequence[Sequence[Piece]]) -> int:
    return sum(p.nbytes for g in groups for p in g)


class _Manifests(Protocol):
    def chain(self, ref: int) -> list[Manifest]: ...
    def manifest(self, ref: int) -> Manifest: ...


@dataclass
class UpdatePlan:
    """How to move live weights from ``from_version`` to ``to_version``.

    ``groups[i]`` are the pieces for ``names[i]``. On the forward route they are the
    records after ``from_version`` (applied to the live tensor); on the anchor
    route they rebuild the target tensor from scratch."""

    from_version: int | None
    to_version: int
    chain: list[Manifest]
    path: list[int]
    via_anchor: bool
    names: list[str] = field(default_factory=list)
    groups: list[list[Piece]] = field(default_factory=list)

    @property
    def target(self) -> Manifest:
        return self.chain[-1]

    @property
    def fetch_bytes(self) -> int:
        return cost(self.groups)


def changed_names(current: Manifest | None, target: Manifest) -> list[str]:
    """Target tensors whose bits may differ from the live ones (all of them when unknown)."""
    if current is None:
        return sorted(target.tensors)
    out = []
    for name, te in sorted(target.tensors.items()):
        ce = current.tensors.get(name)
        if ce is None or ce.xxh3 != te.xxh3 or ce.dtype != te.dtype or ce.shape != te.shape:
            out.append(name)
    return out


def make_plan(manifests: _Manifests, current: int | None, target: int, *, force_anchor: bool = False) -> UpdatePlan:
    """The cheaper of the forward route (records after ``current`` along the target's chain)
    and the anchor route (the target's anchor plus its records), counted in stored bytes
    of the changed tensors only; ``force_anchor``: the anchor route."""
    chain = manifests.chain(target)
    tgt = chain[-1]
    versions = [m.version for m in chain]
    if current == target:
        return UpdatePlan(current, target, chain, [], False)
    cur = None if current is None else manifests.manifest(current)
    names = changed_names(cur, tgt)
    anchor_groups = [rebuild_pieces(chain, n) for n in names]
    if current is not None and current in versions and not force_anchor:
        forward = [[p for p in g if p.manifest.version > current] for g in anchor_groups]
        # a pieced entry's digest differs in form from the whole one the anchor gave it, so it may be "changed"
        # with no record since: the hot-load then proves the live bits against the target's pieces
        if all(g or tgt.tensors[n].pieces for n, g in zip(names, forward)) and cost(forward) <= cost(anchor_groups):
            return UpdatePlan(current, target, chain, versions[versions.index(current) + 1:], False, names, forward)
    return UpdatePlan(current, target, chain, versions, True, names, anchor_groups)
