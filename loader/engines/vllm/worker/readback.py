"""Read a vLLM model's live runtime weights back in Hugging Face checkpoint coordinates, bit-exact.

Runs inside a vLLM worker process (``model = self.model_runner.get_model()``
in a ``--worker-extension-cls`` method). :func:`checkpoint_tensors` returns CPU
tensors named as in the checkpoint (``model.layers.0.self_attn.q_proj.weight``,
``model.embed_tokens.weight``, ``model.layers.0.mlp.experts.3.gate_proj.weight``)
holding the bits vLLM computes with, so a hot-load can compare their
:func:`digests` with a manifest's per-tensor ``xxh3``.

How each runtime layout is read (vLLM 0.32, CPU build):

* Linear layers (``LinearBase`` with ``UnquantizedLinearMethod``): on CPU,
  ``process_weights_after_loading`` repacks the weight for oneDNN / sgl kernels
  (``layer.cpu_linear``) and leaves ``layer.weight`` an empty parameter. The
  weight is read through the layer's own kernel: an identity matrix is pushed
  through ``layer.quant_method.apply(layer, I, bias=None)``; every output is
  one product ``w * 1`` plus exact zeros, so finite nonzero values come back
  bit-exact. Where ``layer.weight`` still holds the full matrix (torch fallback,
  GPU), it is what the kernel multiplies with and is read directly.
* Fused ``qkv_proj`` / ``gate_up_proj`` are split by the layer's
  ``output_sizes``; member names come from the model's
  ``hf_to_vllm_mapper.orig_to_new_stacked`` (shard ids ``q``/``k``/``v`` or
  ints), falling back to ``packed_modules_mapping``.
* ``VocabParallelEmbedding``: ``layer.weight`` (what the lookup reads) sliced to
  ``org_vocab_size``. ``ParallelLMHead``: read through its logits kernel
  (``quant_method.apply``), sliced likewise. With tied embeddings
  (``config.tie_word_embeddings``) no ``lm_head.weight`` is emitted, but the
  logits kernel is checked against ``embed_tokens`` and a difference raises.
* FusedMoE (``RoutedExperts`` with ``UnquantizedFusedMoEMethod``) on CPU:
  ``w13_weight`` / ``w2_weight`` are zero-padded and then permuted by
  ``torch.ops._C.prepack_moe_weight(.., isa)``. The permutation is learnt by
  prepacking index-coded probes, inverted, and the result is re-packed and
  compared bit-for-bit with the live tensor before it is returned. ``w13`` is
  split into gate (``w1``) and up (``w3``) halves, padding is cut, and names
  come from the layer's ``get_expert_mapping()``.
* Everything else (RMSNorm weights, biases, ...) is read from its parameter.

Values a GEMM kernel cannot show: a weight row holding NaN or Inf poisons the
whole identity product of that row (``0 * NaN`` is NaN), so such a row raises
:class:`ReadbackError`. An output of exactly zero may be ``+0.0``, ``-0.0`` or
a subnormal the bf16 dot-product instructions (AVX512-BF16 ``VDPBF16PS``) treat
as zero; with ``strict=True`` (default) that raises, with ``strict=False`` it
is returned as ``+0.0``, which is what the kernel computes with. Plain tensors
(embeddings, norms, biases, MoE experts) have none of these limits.

Tensor parallelism: each rank reads back what it holds, as a slice of the
checkpoint tensor (rows of a column-parallel linear and of each fused member,
q/k/v by head group with GQA's kv heads replicated across ranks where there
are fewer than ranks, input columns of a row-parallel linear, the rank's
vocabulary rows of an embedding or LM head without its padding), and says
which slice (``checkpoint_tensors(..., slices=)``; the rules are in
loader/engines/vllm/tp.py). Linear layer kinds whose sharding is not known
there raise when read at tensor-parallel size > 1.

Not covered (raises :class:`ReadbackError` naming the parameter): pipeline or
expert parallelism > 1 and MoE experts at tensor parallelism > 1 (layers on
other stages, expert maps), quantized layers (any linear/MoE/embedding quant
method other than the unquantized one), MoE backends other than the CPU
grouped-GEMM / zentorch ones (e.g. CUDA kernels that shuffle expert weights),
non-gated MoE, and checkpoint names that vLLM renames through
``hf_to_vllm_mapper`` prefix/substring rules (the vLLM parameter name is used
as is). Tensors come back in the dtype vLLM serves; they equal the checkpoint
bits only when that is the checkpoint's dtype.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import os
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ckptdelta.loader.engines.vllm.tp import Slice, linear_slices, vocab_slice

__all__ = ["ReadbackError", "Slice", "checkpoint_tensors"]

#: Identity rows pushed through a linear kernel per call (bounds the temporary output).
_IDENTITY_CHUNK = 1024
#: Input columns read per kernel matrix while sampling (None: all); see checkpoint_tensors(sample_columns=...).
_SAMPLE_COLUMNS: contextvars.ContextVar[int | None] = contextvars.ContextVar("ckptdelta_sample_columns",
                                                                             default=None)
#: Entered around every kernel call a read-back makes. A read-back running beside vLLM's own steps (a thread
#: of the worker) sets it to the worker's kernel lock: vLLM's CPU GEMMs share one process-wide scratchpad.
KERNEL_GUARD: contextvars.ContextVar[Callable[[], Any]] = contextvars.ContextVar(
    "ckptdelta_kernel_guard", default=contextlib.nullcontext)


class ReadbackError(RuntimeError):
    """A runtime tensor that cannot be read back exactly; ``name`` is the parameter or checkpoint name."""

    def __init__(self, name: str, reason: str):
        self.name = name
        self.reason = reason
        super().__init__(f"{name}: {reason}")


# --- reading one layout ---------------------------------------------------------------------------

def _bits(t: torch.Tensor) -> torch.Tensor:
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.contiguous().reshape(-1).view(ints[t.element_size()])


def _plain(name: str, p: torch.Tensor) -> torch.Tensor:
    if p is None or p.is_meta:
        raise ReadbackError(name, "parameter is missing or on the meta device")
    if p.numel() == 0:
        raise ReadbackError(name, "parameter is empty (its data lives in a kernel this module cannot read)")
    return p.detach().to("cpu", copy=True).contiguous()


def _as_dtype(name: str, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cast ``t`` to ``dtype`` only if that is lossless (a bias vLLM widened to fp32, say)."""
    t = t.detach().to("cpu")
    if t.dtype == dtype:
        return t.clone().contiguous()
    out = t.to(dtype)
    back = out.to(t.dtype)
    same = (_bits(back) == _bits(t)) | (torch.isnan(back) & torch.isnan(t)).reshape(-1)
    if not bool(same.all()) or bool(torch.isnan(t).any()):
        raise ReadbackError(name, f"held as {t.dtype}; not exactly representable in {dtype}")
    return out.contiguous()


def _sampled_columns(n_in: int) -> torch.Tensor | None:
    """Random input columns to read (fresh each call, so a fault cannot hide in the same unread columns),
    or None for all of them."""
    k = _SAMPLE_COLUMNS.get()
    if k is None or k >= n_in:
        return None
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)
    return torch.randperm(n_in, generator=g)[:k].sort().values


def _kernel_matrix(name: str, layer: torch.nn.Module, n_out: int, n_in: int, dtype: torch.dtype,
                   strict: bool, keep_rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The [n_out, n_in] matrix a linear kernel multiplies with, via identity products, and None; or, under
    :func:`sampling`, the [n_out, k] columns at k random inputs and their indices.

    ``keep_rows`` keeps (and checks) only the first rows: vocabulary padding is
    zeros, or anything, and is not part of the checkpoint."""
    apply = layer.quant_method.apply
    cols = _sampled_columns(n_in)
    inputs = torch.arange(n_in) if cols is None else cols
    out = torch.empty(n_out, inputs.numel(), dtype=dtype)
    dev = _device_of(layer)
    with torch.no_grad():
        for r0 in range(0, inputs.numel(), _IDENTITY_CHUNK):
            r1 = min(inputs.numel(), r0 + _IDENTITY_CHUNK)
            eye = torch.zeros(r1 - r0, n_in, dtype=dtype, device=dev)
            idx = torch.arange(r1 - r0, device=dev)
            eye[idx, inputs[r0:r1].to(dev)] = 1
            with KERNEL_GUARD.get()():
                y = apply(layer, eye, bias=None)
            if isinstance(y, tuple):
                y = y[0]
            if y.dtype != dtype or tuple(y.shape) != (r1 - r0, n_out):
                raise ReadbackError(name, f"kernel returned {tuple(y.shape)} {y.dtype} for an identity of "
                                          f"{r1 - r0}x{n_in} {dtype}; expected ({r1 - r0}, {n_out}) {dtype}")
            out[:, r0:r1] = y.t().to("cpu")
    if keep_rows is not None:
        out = out[:keep_rows].contiguous()
    bad = ~torch.isfinite(out)
    if strict and bool(bad.any()):
        rows = bad.any(dim=1).nonzero().flatten().tolist()
        raise ReadbackError(name, f"{len(rows)} row(s) (first: {rows[:5]}) hold NaN/Inf; a GEMM multiplies "
                                  "them by the identity's zeros, so their bits cannot be read through the kernel")
    if strict:
        zeros = int((out == 0).sum())
        if zeros:
            raise ReadbackError(name, f"{zeros} element(s) read back as zero through the kernel, which cannot "
                                      "tell +0.0 from -0.0 or from a subnormal it flushes (pass strict=False "
                                      "to return them as +0.0, the value it computes with)")
    return out, cols


def _device_of(layer: torch.nn.Module) -> torch.device:
    for p in layer.parameters(recurse=False):
        return p.device
    return torch.device("cpu")


def _linear_weight(name: str, layer: torch.nn.Module, strict: bool) -> tuple[torch.Tensor, Any]:
    """The weight and how it was read: False (the parameter itself), True (all of it through the kernel) or
    the sampled input columns (a tensor of indices)."""
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    if not isinstance(layer.quant_method, UnquantizedLinearMethod):
        raise ReadbackError(name, f"quantized layer ({type(layer.quant_method).__name__}) is not supported")
    n_out = int(sum(layer.output_partition_sizes))
    n_in = int(layer.input_size_per_partition if hasattr(layer, "input_size_per_partition") else layer.input_size)
    w = layer.weight
    if not w.is_meta and tuple(w.shape) == (n_out, n_in):
        return _plain(name, w), False
    w, cols = _kernel_matrix(name, layer, n_out, n_in, w.dtype, strict)
    return w, (True if cols is None else cols)


# --- naming ---------------------------------------------------------------------------------------

def _fused_members(model: torch.nn.Module, path: str, n_parts: int) -> list[str]:
    """Checkpoint module paths of a fused linear's members, in shard order."""
    dotted = "." + path
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    stacked = dict(getattr(mapper, "orig_to_new_stacked", None) or {})
    best: dict[int, tuple[int, str]] = {}
    order = {"q": 0, "k": 1, "v": 2}
    for orig, (new, shard) in stacked.items():
        if not dotted.endswith(new):
            continue
        idx = order[shard] if isinstance(shard, str) and shard in order else shard
        if not isinstance(idx, int):
            continue
        cand = (dotted[: len(dotted) - len(new)] + orig)[1:]
        if idx not in best or len(new) > best[idx][0]:
            best[idx] = (len(new), cand)
    if sorted(best) == list(range(n_parts)):
        return [best[i][1] for i in range(n_parts)]
    parent, _, leaf = path.rpartition(".")
    members = (getattr(model, "packed_modules_mapping", None) or {}).get(leaf)
    if members and len(members) == n_parts:
        return [f"{parent}.{m}" if parent else m for m in members]
    raise ReadbackError(path, f"fused layer with {n_parts} parts and no checkpoint names in the model's "
                              "hf_to_vllm_mapper.orig_to_new_stacked or packed_modules_mapping")


def _tied(model: torch.nn.Module) -> bool:
    cfg = getattr(model, "config", None)
    return bool(getattr(cfg, "tie_word_embeddings", False))


# --- one producer per vLLM module -----------------------------------------------------------------

class _Producer:
    """``names``: the checkpoint tensors it emits; ``triggers``: requested names that make it run (a tied
    lm_head emits nothing but must check its logits kernel whenever the embedding is read)."""

    def __init__(self, names: list[str], read: Callable[[], dict[str, torch.Tensor]],
                 triggers: list[str] | None = None):
        self.names = names
        self.read = read
        self.triggers = list(names) + list(triggers or [])
        self.kernel_names: set[str] = set()  # set by read(): tensors it read through a GEMM kernel
        self.columns: dict[str, torch.Tensor] = {}  # set by read() when sampling: the input columns it read
        self.slices: dict[str, Slice] = {}  # tensors this rank holds part of: which part (vllm_tp.py)


def _linear_producer(model, path, layer, strict) -> _Producer:
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear

    # the rank's own rows per member (output_sizes are whole-model sizes, and with kv heads replicated
    # across ranks not even those of the checkpoint)
    sizes = [int(s) for s in (getattr(layer, "output_partition_sizes", None) or
                              getattr(layer, "output_sizes", None) or [])]
    fused = isinstance(layer, (MergedColumnParallelLinear, QKVParallelLinear)) or len(sizes) > 1
    members = _fused_members(model, path, len(sizes)) if fused else [path]
    has_bias = getattr(layer, "bias", None) is not None
    names = [f"{m}.weight" for m in members] + ([f"{m}.bias" for m in members] if has_bias else [])
    slices: dict[str, Slice] = {}
    unknown = None       # raised when the layer is read: a model may hold layers nobody asks about
    try:
        rows, cols, bias_sliced = linear_slices(layer)
        if len(rows) != len(members):
            raise ValueError(f"{len(rows)} output partitions for {len(members)} members")
        for m, r in zip(members, rows):
            if r is not None and cols is not None:
                raise ValueError("sliced along both dimensions")
            if r is not None or cols is not None:
                slices[f"{m}.weight"] = r if r is not None else cols
            if has_bias and bias_sliced and r is not None:
                slices[f"{m}.bias"] = r
    except ValueError as e:
        unknown = ReadbackError(f"{path}.weight", str(e))

    def read():
        if unknown is not None:
            raise unknown
        wname = f"{path}.weight"
        w, via_kernel = _linear_weight(wname, layer, strict)
        if via_kernel is not False:
            prod.kernel_names = {f"{m}.weight" for m in members}
            if via_kernel is not True:
                prod.columns = {f"{m}.weight": via_kernel for m in members}
        out = {}
        parts = [w] if not fused else list(torch.split(w, sizes, dim=0))
        if fused and sum(sizes) != w.shape[0]:
            raise ReadbackError(wname, f"output_sizes {sizes} do not add up to {w.shape[0]} rows")
        for m, p in zip(members, parts):
            out[f"{m}.weight"] = p.contiguous()
        if has_bias:
            b = _as_dtype(f"{path}.bias", _plain(f"{path}.bias", layer.bias), w.dtype)
            for m, p in zip(members, [b] if not fused else torch.split(b, sizes, dim=0)):
                out[f"{m}.bias"] = p.contiguous()
        return out

    prod = _Producer(names, read)
    prod.slices = slices
    return prod


def _embedding_producer(model, path, layer, strict, embed_of: dict) -> _Producer:
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, UnquantizedEmbeddingMethod

    wname = f"{path}.weight"
    is_head = isinstance(layer, ParallelLMHead)
    tied = is_head and (_tied(model) or any(layer.weight is e.weight for e in embed_of.values()))
    has_bias = getattr(layer, "bias", None) is not None
    names = ([] if tied else [wname]) + ([f"{path}.bias"] if has_bias else [])
    # with tensor parallelism the rank's first ``vocab`` rows are its vocabulary slice, the rest padding
    part, vocab = vocab_slice(layer)

    def read():
        if not isinstance(layer.quant_method, UnquantizedEmbeddingMethod):
            raise ReadbackError(wname, f"quantized embedding ({type(layer.quant_method).__name__}) is not supported")
        if int(getattr(layer, "num_added_embeddings", 0) or 0):
            raise ReadbackError(wname, "added (LoRA) vocabulary rows are not supported")
        out = {}
        if not is_head:
            out[wname] = _plain(wname, layer.weight)[:vocab].contiguous()
            return out
        rows = int(layer.num_embeddings_per_partition)
        w, cols = _kernel_matrix(wname, layer, rows, int(layer.embedding_dim), layer.weight.dtype, strict, vocab)
        if tied:
            src = next((p for p, e in embed_of.items() if e.weight is layer.weight), None)
            emb = embed_of[src].weight if src is not None else None
            if emb is None:
                raise ReadbackError(wname, "tied lm_head but no embedding module shares its weight")
            e = emb.detach().to("cpu")[:vocab]
            e = e if cols is None else e[:, cols]
            ok = (_bits(w) == _bits(e)) | ((w.reshape(-1) == 0) & (e.reshape(-1).float().abs()
                                                                    < torch.finfo(e.dtype).tiny))
            if not bool(ok.all()):
                raise ReadbackError(wname, f"the logits kernel holds {int((~ok).sum())} element(s) that differ "
                                           f"from {src}.weight it is tied to")
        else:
            out[wname] = w.contiguous()
            prod.kernel_names = {wname}
            if cols is not None:
                prod.columns = {wname: cols}
        if has_bias:
            out[f"{path}.bias"] = _as_dtype(f"{path}.bias", _plain(f"{path}.bias", layer.bias),
                                            layer.weight.dtype)[:vocab].contiguous()
        return out

    triggers = [f"{p}.weight" for p, e in embed_of.items() if e.weight is layer.weight] if tied else []
    prod = _Producer(names, read, triggers)
    if part is not None:
        prod.slices = {n: part for n in names}
    return prod


def _moe_unpack(name: str, packed: torch.Tensor, isa: str) -> torch.Tensor:
    """Invert ``prepack_moe_weight(.., isa)`` (a per-expert permutation), verified by re-packing."""
    from vllm import _custom_ops as ops

    if packed.dim() != 3 or packed.element_size() not in (2, 4):
        raise ReadbackError(name, f"unexpected packed MoE weight {tuple(packed.shape)} {packed.dtype}")
    e, r, c = packed.shape
    n = r * c
    ints = torch.int16 if packed.element_size() == 2 else torch.int32
    one = _bits(torch.ones(1, dtype=packed.dtype))[0].item()
    idx = torch.arange(n, dtype=torch.int64)
    src = torch.zeros(n, dtype=torch.int64)
    for d in range(max(1, math.ceil(math.log2(max(n, 2)) / 7))):
        probe = (((idx >> (7 * d)) & 0x7F) | one).to(ints).view(packed.dtype).reshape(1, r, c)
        with KERNEL_GUARD.get()():
            got = ops.cpu_prepack_moe_weight(probe.to(packed.device), isa).to("cpu")
        src |= (_bits(got).to(torch.int64) & 0x7F) << (7 * d)
    if not bool((torch.bincount(src, minlength=n) == 1).all()):
        raise ReadbackError(name, f"prepack_moe_weight(isa={isa!r}) is not a per-expert permutation")
    live = packed.detach().to("cpu").contiguous()
    flat = live.reshape(e, n)
    unpacked = torch.empty_like(flat)
    unpacked[:, src] = flat
    unpacked = unpacked.reshape(e, r, c)
    with KERNEL_GUARD.get()():
        again = ops.cpu_prepack_moe_weight(unpacked.to(packed.device), isa).to("cpu")
    if not torch.equal(_bits(again), _bits(live)):
        raise ReadbackError(name, "unpacked MoE weight does not re-pack to the live bits")
    return unpacked


def _moe_producer(model, path, layer) -> _Producer:
    mapping = layer.get_expert_mapping()
    # get_expert_mapping() names are relative to the module the checkpoint calls "experts" (vLLM 0.32
    # nests RoutedExperts under it: model.layers.0.mlp.experts.routed_experts).
    segs = path.split(".")
    cut = max((i for i, s in enumerate(segs) if s == "experts"), default=None)
    base = None if cut is None else ".".join(segs[:cut] + [""]).lstrip(".")
    per: dict[tuple[int, str], str] = {}
    for param_name, weight_name, expert_id, shard_id in mapping:
        if not weight_name.startswith("experts.") or base is None:
            raise ReadbackError(path, f"cannot place expert checkpoint name {weight_name!r} under {path!r}")
        per[(int(expert_id), shard_id)] = base + weight_name
    has_bias = getattr(layer, "w13_bias", None) is not None
    names = [f"{v}weight" for v in per.values()] + ([f"{v}bias" for v in per.values()] if has_bias else [])

    def read():
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

        wname = f"{path}.w13_weight"
        qm = layer.quant_method
        if not isinstance(qm, UnquantizedFusedMoEMethod):
            raise ReadbackError(wname, f"quantized MoE ({type(qm).__name__}) is not supported")
        cfg = layer.moe_config
        for attr in ("tp_size", "ep_size", "dp_size", "pcp_size"):  # TP > 1: see vllm_tp.py (experts not yet)
            if int(getattr(cfg, attr, 1) or 1) != 1:
                raise ReadbackError(wname, f"MoE {attr}={getattr(cfg, attr)} is not supported (only 1)")
        if int(layer.local_num_experts) != int(layer.global_num_experts):
            raise ReadbackError(wname, "expert parallel / redundant experts are not supported")
        if not getattr(cfg, "is_act_and_mul", True):
            raise ReadbackError(wname, "non-gated MoE (no gate/up pair) is not supported")
        fe = getattr(getattr(qm, "moe_kernel", None), "fused_experts", None)
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

        w13, w2 = layer.w13_weight, layer.w2_weight
        if isinstance(fe, CPUUnquantizedExperts) and not getattr(fe, "_use_zentorch", False):
            w13 = _moe_unpack(wname, w13, fe.isa)
            w2 = _moe_unpack(f"{path}.w2_weight", w2, fe.isa)
        elif isinstance(fe, CPUUnquantizedExperts):  # zentorch keeps the checkpoint layout
            w13, w2 = _plain(wname, w13), _plain(f"{path}.w2_weight", w2)
        else:
            raise ReadbackError(wname, f"MoE experts backend {type(fe).__name__} is not supported "
                                       "(its weight layout is unknown here)")
        inter = int(layer.intermediate_size_per_partition)
        padded = w13.shape[1] // 2
        if w13.shape[1] != 2 * padded or padded < inter or w2.shape[2] < inter:
            raise ReadbackError(wname, f"unexpected shapes w13 {tuple(w13.shape)} w2 {tuple(w2.shape)} "
                                       f"for intermediate size {inter}")
        b13 = _plain(f"{path}.w13_bias", layer.w13_bias) if has_bias else None
        b2 = _plain(f"{path}.w2_bias", layer.w2_bias) if has_bias else None
        out = {}
        for (eid, shard), stem in per.items():
            if shard == "w1":
                w, b = w13[eid, :inter], (b13[eid, :inter] if has_bias else None)
            elif shard == "w3":
                w, b = w13[eid, padded:padded + inter], (b13[eid, padded:padded + inter] if has_bias else None)
            elif shard == "w2":
                w, b = w2[eid, :, :inter], (b2[eid] if has_bias else None)
            else:
                raise ReadbackError(stem, f"unknown expert shard id {shard!r}")
            out[f"{stem}weight"] = w.contiguous()
            if has_bias:
                out[f"{stem}bias"] = _as_dtype(f"{stem}bias", b, w.dtype).contiguous()
        return out

    return _Producer(names, read)


def _producers(model: torch.nn.Module, strict: bool) -> list[_Producer]:
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    try:
        from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    except ImportError:  # pragma: no cover - older layouts
        RoutedExperts = ()

    embeds = {p: m for p, m in model.named_modules()
              if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)}
    out: list[_Producer] = []
    for path, mod in model.named_modules():
        if isinstance(mod, LinearBase):
            out.append(_linear_producer(model, path, mod, strict))
        elif isinstance(mod, VocabParallelEmbedding):
            out.append(_embedding_producer(model, path, mod, strict, embeds))
        elif (RoutedExperts and isinstance(mod, RoutedExperts)) or hasattr(mod, "w13_weight"):
            out.append(_moe_producer(model, path, mod))
        else:
            plain = [(f"{path}.{n}" if path else n, p) for n, p in mod.named_parameters(recurse=False)]
            if not plain:
                continue
            if getattr(mod, "quant_method", None) is not None:
                raise ReadbackError(plain[0][0], f"layer kind {type(mod).__name__} with a quant_method "
                                                 "is not supported")
            out.append(_Producer([n for n, _ in plain],
                                 lambda plain=plain: {n: _plain(n, p) for n, p in plain}))
    return out


# --- public API -----------------------------------------------------------------------------------

def checkpoint_tensors(model: torch.nn.Module, names: Iterable[str] | None = None, *,
                       strict: bool = True, kernel_read: set[str] | None = None,
                       sample_columns: int | None = None,
                       columns: dict[str, torch.Tensor] | None = None,
                       slices: dict[str, Slice] | None = None) -> dict[str, torch.Tensor]:
    """CPU tensors, keyed by checkpoint name, holding the bits ``model`` computes with.

    ``names`` restricts the work to the layers those tensors live in (a fused
    layer is read once for all its members); an unknown name raises
    :class:`ReadbackError`. ``strict``: see the module docstring (zeros read
    through a GEMM kernel). ``kernel_read``, when given, receives the names that
    were read through a GEMM kernel (compare those under :func:`kernel_view`).
    ``sample_columns=k`` reads only k random input columns of each matrix read
    through a kernel (k identity products instead of one per input: the cheap
    check for inside a pause); ``columns`` then receives which, per name, and
    those tensors come back as ``[rows, k]``.

    Under tensor parallelism a tensor this rank holds part of comes back as that
    part, and ``slices``, when given, receives which (a :class:`Slice` of the
    checkpoint tensor, loader/engines/vllm/tp.py); a name not there is whole."""
    token = _SAMPLE_COLUMNS.set(sample_columns)
    try:
        return _checkpoint_tensors(model, names, strict, kernel_read, columns, slices)
    finally:
        _SAMPLE_COLUMNS.reset(token)


def _checkpoint_tensors(model, names, strict, kernel_read, columns, slices) -> dict[str, torch.Tensor]:
    producers = _producers(model, strict)
    wanted = None if names is None else set(names)
    if wanted is not None:
        known = {n for p in producers for n in p.names}
        missing = sorted(wanted - known)
        if missing:
            raise ReadbackError(missing[0], f"{len(missing)} requested name(s) are not tensors of this model "
                                            f"(e.g. {missing[:5]})")
    out: dict[str, torch.Tensor] = {}
    for p in producers:
        if wanted is not None and not wanted.intersection(p.triggers):
            continue
        got = p.read()
        for n, t in got.items():
            if n in out:
                raise ReadbackError(n, "produced by two runtime layers")
            if wanted is None or n in wanted:
                out[n] = t
                if kernel_read is not None and n in p.kernel_names:
                    kernel_read.add(n)
                if columns is not None and n in p.columns:
                    columns[n] = p.columns[n]
                if n in p.slices:
                    _check_slice(n, t, p.slices[n])
                    if slices is not None:
                        slices[n] = p.slices[n]
    return out


def _check_slice(name: str, t: torch.Tensor, part: Slice) -> None:
    """The rank's tensor is as long as the slice it claims along the sliced dimension (sampled columns aside)."""
    if part.dim < t.dim() and t.shape[part.dim] != part.length and not (part.dim == 1 and _SAMPLE_COLUMNS.get()):
        raise ReadbackError(name, f"this rank holds {list(t.shape)}, not {part.length} along dim {part.dim} "
                                  f"(its slice {part.to_json()})")
