"""In-place patches of vLLM's runtime weights: write only the changed elements, where the kernel reads them.

A whole-module reload costs the module's size whatever changed. Where vLLM's
kernels compute straight from a parameter laid out like the checkpoint tensor
(possibly as a block of rows of a fused one), the changed elements can be
written into that parameter directly and the pause follows the changed bytes.
This module decides which checkpoint tensors have such a target and writes them;
everything else goes through ``reload_weights``. Runs inside a vLLM worker.

Which parameters qualify (unquantized, same dtype as the checkpoint, not on the
meta device, not empty):

* RMSNorm / LayerNorm weights, and a ``VocabParallelEmbedding``'s weight (its
  first ``org_vocab_size`` rows; the lookup reads the parameter), except a
  tied embedding on CPU, whose LM head keeps a packed copy for its logits;
* on CUDA and other GPU platforms, unquantized linear layers and untied LM
  heads: their GEMMs read ``layer.weight`` itself; a member of a fused q/k/v or
  gate/up layer is the block of rows at its offset (vLLM's ``output_sizes``).
  On CPU, vLLM re-packs these for oneDNN/SGL kernels: they are reloaded.
* never experts (CPU packing, GPU shuffles) or quantized layers.

Under tensor parallelism a target is the part of the checkpoint tensor the rank
holds when that part is one run of elements: the rank's vocabulary rows of an
embedding (its padding rows are not written), the rank's rows of a
column-parallel linear or of each fused member (loader/engines/vllm/tp.py says
which). A changed element outside the run belongs to another rank and is not
written here. Row-parallel linears (input columns: not one run) are reloaded.

The patch reads the written positions back at once; the replica's proof after
resuming reads the patched tensors back whole like any other
(loader/engines/vllm/worker/readback.py), so a target chosen wrongly is caught and
pushed back by a reload.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch

_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True)
class Target:
    """Where the checkpoint tensor's elements ``lo .. lo + numel`` live in this rank: element ``i`` at
    ``param.view(-1)[base + i - lo]``; ``total``: the checkpoint tensor's size (the whole of it unless the
    rank holds a slice)."""

    param: torch.nn.Parameter
    base: int
    numel: int
    lo: int = 0
    total: int | None = None

    @property
    def size(self) -> int:
        return self.numel if self.total is None else self.total


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _usable(p: torch.Tensor | None) -> bool:
    return p is not None and not p.is_meta and p.numel() > 0 and p.is_contiguous()


def targets(model: torch.nn.Module) -> dict[str, Target]:
    """Checkpoint name -> in-place target, for every tensor that has one (see the module docstring)."""
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    from ckptdelta.loader.engines.vllm.worker.readback import _fused_members, _tied
    from ckptdelta.loader.engines.vllm.tp import linear_slices, vocab_slice

    cpu = _on_cpu()
    tied = _tied(model)
    out: dict[str, Target] = {}
    for path, mod in model.named_modules():
        if ".experts" in f".{path}.":
            continue
        if isinstance(mod, LinearBase):
            if cpu or not isinstance(getattr(mod, "quant_method", None), UnquantizedLinearMethod):
                continue
            w = mod.weight
            sizes = [int(s) for s in (getattr(mod, "output_partition_sizes", None) or
                                      getattr(mod, "output_sizes", None) or [w.shape[0] if w.dim() else 0])]
            if not _usable(w) or w.dim() != 2 or sum(sizes) != w.shape[0]:
                continue
            try:
                parts, cols, bias_sliced = linear_slices(mod)
            except ValueError:
                continue
            if cols is not None or len(parts) != len(sizes):
                continue          # a row-parallel rank holds input columns: not one run of elements
            members = _fused_members(model, path, len(sizes)) if len(sizes) > 1 else [path]
            n_in, row = int(w.shape[1]), 0
            bias = getattr(mod, "bias", None)
            for m, rows, part in zip(members, sizes, parts):
                start, total = (0, None) if part is None else (part.start, _member_rows(mod, len(sizes), m, members))
                if part is not None and total is None:
                    break
                out[f"{m}.weight"] = Target(w, row * n_in, rows * n_in, start * n_in,
                                            None if total is None else total * n_in)
                if _usable(bias) and bias.dim() == 1 and bias.dtype == w.dtype and (part is None or bias_sliced):
                    out[f"{m}.bias"] = Target(bias, row, rows, start, total)
                row += rows
        elif isinstance(mod, VocabParallelEmbedding):
            if isinstance(mod, ParallelLMHead) and (cpu or tied):
                continue
            if not isinstance(mod, ParallelLMHead) and cpu and tied:
                continue
            w = mod.weight
            if _usable(w) and w.dim() == 2 and not int(getattr(mod, "num_added_embeddings", 0) or 0):
                part, rows = vocab_slice(mod)
                dim = int(w.shape[1])
                out[f"{path}.weight"] = Target(w, 0, rows * dim, 0 if part is None else part.start * dim,
                                               int(mod.org_vocab_size) * dim)
        elif type(mod).__name__ in ("RMSNorm", "LayerNorm", "GemmaRMSNorm"):
            for pname, p in mod.named_parameters(recurse=False):
                if _usable(p):
                    out[f"{path}.{pname}"] = Target(p, 0, p.numel())
    return out


def _member_rows(layer: torch.nn.Module, n: int, member: str, members: list[str]) -> int | None:
    """The checkpoint rows of one member of a tensor-parallel column linear (None where not known here)."""
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear

    i = members.index(member)
    if isinstance(layer, QKVParallelLinear) and n == 3:
        heads = (layer.total_num_heads, layer.total_num_kv_heads, layer.total_num_kv_heads)[i]
        size = (layer.head_size, layer.head_size, getattr(layer, "v_head_size", layer.head_size))[i]
        return int(heads) * int(size)
    if isinstance(layer, MergedColumnParallelLinear):
        return int(layer.output_sizes[i])
    if n == 1 and getattr(layer, "output_size", None) is not None:
        return int(layer.output_size)
    return None


def patch(model: torch.nn.Module, shared: dict[str, torch.Tensor], positions: torch.Tensor,
          spans: Iterable[tuple[str, int, int]], *, check: bool = True) -> list[str]:
    """Copy ``shared[name]``'s elements at ``positions[off:off + n]`` into each name's target, bit for bit.

    Returns the names written. A name without a target, or whose host tensor does
    not fit it, raises before anything is written. ``check``: read the written
    positions back and compare their bits (the proof of what a pause wrote costs
    what it wrote; the rest of the tensor was proven before and was not touched)."""
    where = targets(model)
    plan = []
    for name, off, n in spans:
        t = where.get(name)
        src = shared.get(name)
        if t is None or src is None:
            raise KeyError(f"{name}: no in-place target in this worker")
        if src.numel() != t.size or src.dtype != t.param.dtype or t.lo + t.numel > src.numel():
            raise ValueError(f"{name}: host tensor {src.dtype}{list(src.shape)} does not fit its target "
                             f"({t.param.dtype}, {t.size} elements)")
        idx = positions[off:off + n].to(torch.int64)
        if t.lo or t.numel != t.size:      # this rank holds a slice: only the changed elements inside it
            idx = idx[(idx >= t.lo) & (idx < t.lo + t.numel)]
        plan.append((t, src, idx))
    with torch.no_grad():
        for t, src, idx in plan:
            bits = src.reshape(-1).view(_INTS[src.element_size()])[idx]
            dst = t.param.data.view(-1).view(_INTS[t.param.element_size()])
            dst.index_copy_(0, (idx + (t.base - t.lo)).to(dst.device), bits.to(dst.device))
        if check:
            for (t, src, idx), (name, _, _) in zip(plan, spans):
                want = src.reshape(-1).view(_INTS[src.element_size()])[idx]
                at = (idx + (t.base - t.lo)).to(t.param.device)
                got = t.param.data.view(-1).view(_INTS[t.param.element_size()])[at]
                if not torch.equal(want, got.to(want.device)):
                    raise ValueError(f"{name}: the written elements do not read back as the host copy's bits")
    return [name for name, _, _ in spans]
