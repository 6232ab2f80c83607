"""Which part of each checkpoint tensor a tensor-parallel vLLM rank holds, and how the replica proves the parts.

Why: with ``--tensor-parallel-size N`` no worker holds a whole linear layer, a
whole embedding or a whole LM head; each holds a slice, laid out its own way
(q, k and v heads, gate and up rows, vocabulary rows with padding). The proof
stays exact without moving slices around: every worker reads back only what it
holds, in *checkpoint coordinates* (a :class:`Slice` of the checkpoint tensor:
one dimension, a start and a length), and hashes it where it is; the replica
hashes the same slice of its host copy (verified against the manifest's
whole-tensor digests) and compares. No weight bytes cross a process boundary,
the workers hash in parallel, and the replica's side costs one pass over the
host copy, as with one worker. The replica also checks that the workers'
slices together cover every element of every tensor it proves, so a rule that
claimed too little (or a worker that answered for less) cannot pass as a proof.

The slices follow vLLM 0.32's weight loaders (vllm/model_executor/layers/linear.py,
vocab_parallel_embedding.py), from each layer's own ``tp_rank`` / ``tp_size``
(a layer built with ``disable_tp`` is whole on every rank):

* ``ColumnParallelLinear``: rows ``[r * p, (r + 1) * p)`` of the weight (and bias),
  ``p`` its output size per partition; ``MergedColumnParallelLinear`` (gate/up)
  the same per member, the members stacked in the rank's tensor.
* ``QKVParallelLinear``: q rows ``[r * q, (r + 1) * q)``; k and v rows of kv head
  group ``r // num_kv_head_replicas`` (with fewer kv heads than ranks, GQA's kv
  heads are replicated: several ranks prove the same rows).
* ``RowParallelLinear``: input columns ``[r * c, (r + 1) * c)``; its bias is whole
  on every rank.
* ``VocabParallelEmbedding`` / ``ParallelLMHead``: vocabulary rows
  ``shard_indices.org_vocab_start_index`` to ``org_vocab_end_index`` (the
  padding after them in the rank's tensor is not part of the checkpoint).
* Everything else (norms, ``ReplicatedLinear``) is whole on every rank.

A rule that were wrong would not pass silently: the slice a worker claims is
hashed on both sides, so a claim that does not match the bits vLLM loaded fails
the proof.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["Slice", "linear_slices", "vocab_slice", "uncovered", "sliced"]


@dataclass(frozen=True)
class Slice:
    """Elements ``start .. start + length`` along ``dim`` of a checkpoint tensor (all of the other dims)."""

    dim: int
    start: int
    length: int

    def of(self, t: torch.Tensor) -> torch.Tensor:
        """This slice of the whole checkpoint tensor ``t`` (a view); ValueError if ``t`` cannot hold it."""
        if not 0 <= self.dim < t.dim() or self.start < 0 or self.length < 0 \
                or self.start + self.length > t.shape[self.dim]:
            raise ValueError(f"slice {self.to_json()} (dim, start, length) does not fit a tensor of shape "
                             f"{list(t.shape)}")
        return t.narrow(self.dim, self.start, self.length)

    def to_json(self) -> list[int]:
        return [self.dim, self.start, self.length]

    @classmethod
    def from_json(cls, v: Sequence[int]) -> "Slice":
        if not isinstance(v, (list, tuple)) or len(v) != 3 or not all(isinstance(x, int) for x in v):
            raise ValueError(f"a slice is [dim, start, length] of integers, not {v!r}")
        return cls(*v)


def _tp(layer: Any) -> tuple[int, int]:
    return int(getattr(layer, "tp_rank", 0) or 0), int(getattr(layer, "tp_size", 1) or 1)


def linear_slices(layer: Any) -> tuple[list[Slice | None], Slice | None, bool]:
    """For a vLLM linear layer: the checkpoint rows each member's weight holds on this rank (None: all), the
    input columns it holds (None: all), and whether its bias is sliced like the rows (else whole).

    Members are in the order of ``output_partition_sizes`` (q, k, v; gate, up). Raises ValueError for a
    layer kind whose sharding this module does not know, at tensor-parallel size > 1."""
    from vllm.model_executor.layers.linear import (ColumnParallelLinear, MergedColumnParallelLinear,
                                                   QKVParallelLinear, ReplicatedLinear, RowParallelLinear)

    parts = [int(s) for s in layer.output_partition_sizes]
    rank, size = _tp(layer)
    if size == 1 or isinstance(layer, ReplicatedLinear):
        return [None] * len(parts), None, False
    if isinstance(layer, RowParallelLinear):
        cols = int(layer.input_size_per_partition)
        return [None] * len(parts), Slice(1, rank * cols, cols), False
    if isinstance(layer, QKVParallelLinear):
        if len(parts) != 3:
            raise ValueError(f"QKVParallelLinear with {len(parts)} output partitions, expected 3 (q, k, v)")
        kv_rank = rank // int(layer.num_kv_head_replicas)
        q, k, v = parts
        return [Slice(0, rank * q, q), Slice(0, kv_rank * k, k), Slice(0, kv_rank * v, v)], None, True
    if isinstance(layer, MergedColumnParallelLinear):
        full = [int(s) for s in layer.output_sizes]
        if full != [p * size for p in parts]:
            raise ValueError(f"output_sizes {full} are not {size} x the partitions {parts}")
        return [Slice(0, rank * p, p) for p in parts], None, True
    if isinstance(layer, ColumnParallelLinear):
        if len(parts) != 1:
            raise ValueError(f"{type(layer).__name__} with {len(parts)} output partitions and no known members")
        return [Slice(0, rank * parts[0], parts[0])], None, True
    raise ValueError(f"{type(layer).__name__} at tensor-parallel size {size}: its sharding is not known here")


def vocab_slice(layer: Any) -> tuple[Slice | None, int]:
    """For a ``VocabParallelEmbedding`` / ``ParallelLMHead``: the checkpoint vocabulary rows this rank holds
    (None: all) and how many of the rank's own first rows they are (the rest is padding)."""
    rank, size = _tp(layer)
    if size == 1:
        return None, int(layer.org_vocab_size)
    si = layer.shard_indices
    start, end = int(si.org_vocab_start_index), int(si.org_vocab_end_index)
    return Slice(0, start, end - start), end - start


# --- the replica's side -----------------------------------------------------------------------------

def sliced(tensors: Mapping[str, torch.Tensor], names: Iterable[str],
           slices: Mapping[str, Any] | None) -> dict[str, torch.Tensor]:
    """``tensors[n]`` for each name, cut to the slice a worker reported for it (``[dim, start, length]``; a
    name it reported no slice for is whole)."""
    slices = slices or {}
    out = {}
    for n in names:
        s = slices.get(n)
        out[n] = tensors[n] if s is None else Slice.from_json(s).of(tensors[n])
    return out


def uncovered(shapes: Mapping[str, Sequence[int]], answers: Sequence[Mapping[str, Any] | None]) -> list[str]:
    """Names (of ``shapes``) that the workers' slices do not cover together, or that a worker claims a slice
    of that the tensor cannot hold; ``answers``: each worker's ``{name: [dim, start, length]}`` (a name missing
    there: that worker holds it whole).

    Slices of one tensor must share their dimension to cover it; they may overlap (replicated kv heads)."""
    bad = []
    for n, shape in shapes.items():
        spans: list[tuple[int, int]] = []
        dims = set()
        whole = fits = True
        for a in answers:
            s = (a or {}).get(n)
            if s is None:
                continue
            whole = False
            try:
                sl = Slice.from_json(s)
            except ValueError:
                fits = False
                break
            dims.add(sl.dim)
            spans.append((sl.start, sl.start + sl.length))
            if not 0 <= sl.dim < len(shape) or sl.start < 0 or sl.length < 0 \
                    or sl.start + sl.length > int(shape[sl.dim]):
                fits = False
        if not fits:
            bad.append(n)
            continue
        if whole or len(spans) < len(answers):
            continue          # some worker holds it whole (replicated): proven whole there
        if len(dims) != 1:
            bad.append(n)
            continue
        reach, end = 0, int(shape[next(iter(dims))])
        for a, b in sorted(spans):
            if a > reach:
                break
            reach = max(reach, b)
        if reach < end:
            bad.append(n)
    return bad
