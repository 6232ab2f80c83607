"""Whether the next snapshot is an anchor or a delta, decided from the run's committed chain.

The decision is a pure function of the chain so far and the tensors about to be
published, so every rank of a sharded trainer (and a restarted publisher that
re-read the chain from the bucket) reaches the same answer.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ckptdelta.delta.manifest import Kind, Manifest

from ckptdelta.publisher.host_copy import Schema

#: A delta chain longer than this forces an anchor (a reader replays at most this many deltas).
MAX_CHAIN = 128


@dataclass(frozen=True)
class ChainState:
    """What the anchor policy needs to know about the run's committed snapshots."""

    last_version: int | None = None      # None: nothing committed yet
    last_step: int | None = None
    anchor_version: int | None = None
    anchor_bytes: int = 0                 # stored size of the anchor's data objects
    chain_bytes: int = 0                  # stored bytes of the deltas since that anchor
    schema: Schema = field(default_factory=dict)
    last_kind: str | None = None
    layout: dict = field(default_factory=dict)   # the last snapshot's tensors held in pieces: name -> grid

    @property
    def chain_length(self) -> int:
        if self.last_version is None or self.anchor_version is None:
            return 0
        return self.last_version - self.anchor_version

    @classmethod
    def from_chain(cls, chain: Sequence[Manifest]) -> "ChainState":
        """From the manifests of the newest chain: its anchor first, then each delta in order."""
        if not chain:
            return cls()
        state = cls()
        for m in chain:
            state = state.advanced(m)
        return state

    def advanced(self, m: Manifest) -> "ChainState":
        """The state once ``m`` is committed on top of this one."""
        schema = {n: (e.dtype, tuple(e.shape)) for n, e in m.tensors.items()}
        if m.kind == "anchor":
            return ChainState(m.version, m.step, m.version, sum(o.size for o in m.objects), 0, schema, m.kind)
        layout = {n: e.grid for n, e in m.tensors.items() if e.pieces}
        return replace(self, last_version=m.version, last_step=m.step, chain_bytes=self.chain_bytes + m.stored_bytes,
                       schema=schema, last_kind=m.kind, layout=layout)


@dataclass(frozen=True)
class Plan:
    version: int
    kind: Kind
    parent_version: int | None
    anchor_version: int
    reason: str
    data_id: str = ""       # names this attempt's data prefix (<v>-<data_id>/): no two attempts share a key
    schema_change: str = ""  # tensor names, dtypes or shapes that differ from the previous snapshot's ('' if none)
    layout: Any = None      # the tensors held in pieces and an anchor's shards of them (publisher/sharded.py)


def decide(state: ChainState, schema: Schema, *, anchor_every: int, chain_fraction: float,
           force_anchor: bool = False, max_chain: int = MAX_CHAIN, layout: dict | None = None) -> Plan:
    """The next snapshot's version and kind, with the reason (logged, and in PublishResult). ``layout``: the
    grids of the tensors published in pieces (name -> :attr:`TensorEntry.grid`: their boxes are its cells); a
    delta may follow a delta only in the same."""
    version = 0 if state.last_version is None else state.last_version + 1
    reason = _anchor_reason(state, schema, anchor_every, chain_fraction, force_anchor, max_chain)
    if reason is None and state.last_kind == "delta" and (layout or {}) != state.layout:
        reason = ("tensors are held in other pieces than in the previous delta: "
                  f"{_layout_change(state.layout, layout or {})}")
    # said whatever else made this an anchor: replicas on the old tensors cannot hot-load it
    change = describe_schema_change(state.schema, schema) if state.schema else ""
    if reason is not None:
        return Plan(version, "anchor", state.last_version, version, reason, schema_change=change)
    assert state.anchor_version is not None
    return Plan(version, "delta", state.last_version, state.anchor_version, "delta against the previous snapshot")


def _anchor_reason(state: ChainState, schema: Schema, anchor_every: int, chain_fraction: float,
                   force: bool, max_chain: int) -> str | None:
    if state.last_version is None:
        return "first publish of the run"
    if state.anchor_version is None:
        return "the run's newest chain could not be read"
    if force:
        return "anchor=True"
    if state.chain_length + 1 >= anchor_every:
        return f"every {anchor_every} versions"
    if state.chain_length + 1 > max_chain:
        return f"a delta chain may be at most {max_chain} long"
    if state.chain_bytes > chain_fraction * state.anchor_bytes:
        return (f"the chain's {state.chain_bytes} delta bytes passed {chain_fraction:g} of the anchor's "
                f"{state.anchor_bytes} bytes")
    change = describe_schema_change(state.schema, schema)
    if change:
        return f"tensors changed: {change}"
    return None


def _layout_change(old: dict, new: dict) -> str:
    """Which tensors a publish holds in other pieces than the last delta (another world size or mesh)."""
    names = sorted(n for n in set(old) | set(new) if old.get(n) != new.get(n))
    first = names[0]
    how = f"{_cells(old[first])} -> {_cells(new[first])} pieces" if first in old and first in new else \
        ("now in pieces" if first in new else "now whole")
    more = f" (+{len(names) - 1} more)" if len(names) > 1 else ""
    return f"{first!r} {how}{more}; the ranks' parents are the old pieces (another world size or mesh?)"


def _cells(grid: tuple[tuple[int, ...], ...]) -> int:
    return math.prod(len(c) - 1 for c in grid)


def describe_schema_change(old: Schema, new: Schema, limit: int = 3) -> str:
    """'' when names, dtypes and shapes all match; otherwise a short account of what differs."""
    if old == new:
        return ""
    added = [n for n in new if n not in old]
    removed = [n for n in old if n not in new]
    changed = [n for n in new if n in old and old[n] != new[n]]
    parts = []
    for label, names in (("added", added), ("removed", removed), ("dtype/shape changed", changed)):
        if names:
            more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
            parts.append(f"{label} {', '.join(repr(n) for n in names[:limit])}{more}")
    return "; ".join(parts)
