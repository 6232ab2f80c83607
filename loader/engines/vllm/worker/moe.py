"""Reload the routed experts of CPU MoE layers exactly, beside vLLM's ``reload_weights``.

Why this exists (vLLM 0.32, CPU build): the CPU grouped-GEMM experts
(``CPUUnquantizedExperts`` and its x86 / Arm / Power subclasses) zero-pad the
intermediate dimension and permute ``w13_weight`` / ``w2_weight`` with
``cpu_prepack_moe_weight(.., isa)`` in their ``process_weights_after_loading``.
That hook is called only from ``UnquantizedFusedMoEMethod._setup_kernel`` and
only on the first load (``if not is_weight_update``, i.e. while
``moe_kernel is None``). A layerwise reload (``model_executor/model_loader/
reload/layerwise.py``) therefore materialises the checkpoint-layout weights,
runs ``process_weights_after_loading`` (which skips pad + prepack because the
kernel exists) and ``copy_``s the *unpacked* tensors into the live, packed
storage: the kernel then reads the new values in the wrong order (and when
vLLM had to pad, the copy fails on the shape). So expert tensors must not go
through ``reload_weights`` on this backend.

What is done instead, per layer: the checkpoint tensors are written into
scratch tensors of the layer's checkpoint-layout shape with the layer's own
``weight_loader`` (names and shard ids from ``get_expert_mapping()``), then
padded with the experts object's own ``_pad_moe_intermediate`` and packed with
``cpu_prepack_moe_weight`` for its ``isa`` (what vLLM does on the first load),
and finally ``copy_``'d into the live parameters, so every reference the
kernel holds stays valid. Experts not sent keep their values: the scratch
starts from the live weights unpacked (verified by re-packing) unless every
expert tensor of the layer is sent.

Covered: tensor / expert parallel size 1 (as :mod:`ckptdelta.loader.engines.vllm.worker.readback`),
unquantized experts on the CPU grouped-GEMM backend. zentorch (which keeps the
checkpoint layout) and every non-CPU backend keep going through ``reload_weights``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ExpertTarget", "cpu_expert_layers", "reload_cpu_experts", "split_expert_tensors"]


@dataclass(frozen=True)
class ExpertTarget:
    """Where one checkpoint tensor lands: ``attr`` (``w13_weight``, ``w2_bias``, ...) of ``expert_id``.

    ``weight_name`` is the vLLM-side name the layer's ``weight_loader`` dispatches on
    (it looks for "weight" / "bias" in it)."""

    attr: str
    weight_name: str
    expert_id: int
    shard_id: str


def _prepacking_experts(layer: torch.nn.Module):
    """The layer's CPU experts object if it prepacks its weights (the case reload_weights breaks), else None."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
        from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod
    except ImportError:  # pragma: no cover - other vLLM layouts
        return None
    qm = getattr(layer, "quant_method", None)
    if not isinstance(qm, UnquantizedFusedMoEMethod):
        return None
    fe = getattr(getattr(qm, "moe_kernel", None), "fused_experts", None)
    if not isinstance(fe, CPUUnquantizedExperts) or getattr(fe, "_use_zentorch", False):
        return None
    return fe


def cpu_expert_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """Module path -> MoE experts layer whose weights live prepacked for the CPU kernel."""
    return {path: mod for path, mod in model.named_modules()
            if hasattr(mod, "w13_weight") and hasattr(mod, "get_expert_mapping")
            and _prepacking_experts(mod) is not None}


def _checkpoint_base(path: str) -> str:
    """The checkpoint prefix that ``get_expert_mapping()`` names are relative to.

    Those names start with ``experts.``; vLLM 0.32 nests the layer under the module
    the checkpoint calls ``experts`` (``model.layers.0.mlp.experts.routed_experts``),
    so the prefix is the path up to the last ``experts`` segment."""
    segs = path.split(".")
    cut = max((i for i, s in enumerate(segs) if s == "experts"), default=None)
    if cut is None:
        raise ValueError(f"MoE layer {path!r} has no 'experts' segment to place checkpoint names under")
    return ".".join(segs[:cut] + [""])


def expert_targets(path: str, layer: torch.nn.Module) -> dict[str, ExpertTarget]:
    """Checkpoint name -> target, for every per-expert weight and bias the layer holds."""
    base = _checkpoint_base(path)
    out: dict[str, ExpertTarget] = {}
    for param_name, weight_name, expert_id, shard_id in layer.get_expert_mapping():
        for suffix in ("weight", "bias"):
            attr = f"{param_name}{suffix}".rpartition(".")[2]
            if getattr(layer, attr, None) is None:
                continue
            out[f"{base}{weight_name}{suffix}"] = ExpertTarget(
                attr, f"{base}{param_name}{suffix}", int(expert_id), str(shard_id))
    return out


def split_expert_tensors(model: torch.nn.Module, tensors: dict[str, torch.Tensor]
                         ) -> tuple[dict[str, torch.Tensor], list[tuple[str, dict[str, torch.Tensor]]]]:
    """(tensors for ``reload_weights``, [(layer path, its expert tensors)] for :func:`reload_cpu_experts`).

    A name under a prepacking layer's ``experts.`` prefix that its mapping does not
    know (a fused ``gate_up_proj`` checkpoint, say) raises rather than fall back to
    ``reload_weights``, which would corrupt the layer."""
    rest = dict(tensors)
    per_layer: list[tuple[str, dict[str, torch.Tensor]]] = []
    for path, layer in cpu_expert_layers(model).items():
        targets = expert_targets(path, layer)
        mine = {n: rest.pop(n) for n in list(rest) if n in targets}
        prefix = _checkpoint_base(path) + "experts."
        unknown = [n for n in rest if n.startswith(prefix)]
        if unknown:
            raise ValueError(f"{len(unknown)} tensor(s) under {prefix!r} that the experts' mapping does not "
                             f"name (e.g. {unknown[:3]}); they cannot be reloaded exactly on the CPU build")
        if mine:
            per_layer.append((path, mine))
    return rest, per_layer


def _checkpoint_layout(path: str, layer: torch.nn.Module, fe, fresh: bool) -> dict[str, torch.Tensor]:
    """The layer's tensors as vLLM's loader first wrote them (before pad + prepack), as new CPU tensors.

    ``fresh``: every weight element is about to be written, so the weights start as
    zeros instead of being unpacked from the live ones. Biases are never packed."""
    from ckptdelta.loader.engines.vllm.worker.readback import _moe_unpack

    inter = int(fe.moe_config.intermediate_size_per_partition)
    padded = int(fe._padded_intermediate_size(fe.moe_config))
    e, two_p, hidden = layer.w13_weight.shape
    if two_p != 2 * padded or tuple(layer.w2_weight.shape) != (e, hidden, padded):
        raise ValueError(f"{path}: live w13 {tuple(layer.w13_weight.shape)} / w2 {tuple(layer.w2_weight.shape)} "
                         f"do not match intermediate {inter} padded to {padded}")
    out: dict[str, torch.Tensor] = {}
    if fresh:
        out["w13_weight"] = torch.zeros(e, 2 * inter, hidden, dtype=layer.w13_weight.dtype)
        out["w2_weight"] = torch.zeros(e, hidden, inter, dtype=layer.w2_weight.dtype)
    else:
        w13 = _moe_unpack(f"{path}.w13_weight", layer.w13_weight, fe.isa)
        out["w13_weight"] = torch.cat([w13[:, :inter], w13[:, padded:padded + inter]], dim=1).contiguous()
        out["w2_weight"] = _moe_unpack(f"{path}.w2_weight", layer.w2_weight, fe.isa)[:, :, :inter].contiguous()
    if getattr(layer, "w13_bias", None) is not None:
        b13 = layer.w13_bias.detach().to("cpu")
        out["w13_bias"] = torch.cat([b13[:, :inter], b13[:, padded:padded + inter]], dim=1).contiguous()
    if getattr(layer, "w2_bias", None) is not None:
        out["w2_bias"] = layer.w2_bias.detach().to("cpu").clone()
    return out


def _runtime_layout(fe, layout: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Pad and prepack checkpoint-layout tensors the way ``fe.process_weights_after_loading`` does.

    Runs on a stand-in module so vLLM's own padding code can be used without
    touching the live layer (``_pad_moe_intermediate`` re-registers parameters)."""
    from vllm._custom_ops import cpu_prepack_moe_weight

    stand_in = torch.nn.Module()
    for name, t in layout.items():
        stand_in.register_parameter(name, torch.nn.Parameter(t, requires_grad=False))
    fe._pad_moe_intermediate(stand_in)
    out = {name: getattr(stand_in, name).data for name in layout}
    out["w13_weight"] = cpu_prepack_moe_weight(out["w13_weight"], fe.isa)
    out["w2_weight"] = cpu_prepack_moe_weight(out["w2_weight"], fe.isa)
    return out


def _check_supported(path: str, layer: torch.nn.Module) -> None:
    cfg = layer.moe_config
    for attr in ("tp_size", "ep_size", "dp_size", "pcp_size"):
        if int(getattr(cfg, attr, 1) or 1) != 1:
            raise ValueError(f"{path}: MoE {attr}={getattr(cfg, attr)} is not supported (only 1)")
    if int(layer.local_num_experts) != int(layer.global_num_experts):
        raise ValueError(f"{path}: expert parallel / redundant experts are not supported")


@torch.no_grad()
def reload_cpu_experts(model: torch.nn.Module, path: str, tensors: dict[str, torch.Tensor]) -> int:
    """Write checkpoint expert tensors into the live prepacked layer at ``path``; returns how many.

    The live parameters are overwritten in place (``copy_``), after everything
    that can fail has run, so an error leaves the layer as it was."""
    layer = model.get_submodule(path)
    fe = _prepacking_experts(layer)
    if fe is None:
        raise ValueError(f"{path}: not a prepacked CPU MoE layer")
    _check_supported(path, layer)
    targets = expert_targets(path, layer)
    weight_names = {n for n, t in targets.items() if t.attr.endswith("_weight")}
    layout = _checkpoint_layout(path, layer, fe, fresh=weight_names <= set(tensors))
    scratch = {name: torch.nn.Parameter(t, requires_grad=False) for name, t in layout.items()}
    for name, tensor in tensors.items():
        t = targets[name]
        ok = layer.weight_loader(scratch[t.attr], tensor, t.weight_name,
                                 shard_id=t.shard_id, expert_id=t.expert_id, return_success=True)
        if not ok:
            raise ValueError(f"{name}: the layer's weight_loader did not load it (expert not local?)")
    runtime = _runtime_layout(fe, {n: p.data for n, p in scratch.items()})
    live = {name: getattr(layer, name) for name in runtime}
    for name, new in runtime.items():
        if tuple(new.shape) != tuple(live[name].shape) or new.dtype != live[name].dtype:
            raise ValueError(f"{path}.{name}: processed {tuple(new.shape)} {new.dtype} does not fit the live "
                             f"{tuple(live[name].shape)} {live[name].dtype}")
    for name, new in runtime.items():
        live[name].data.copy_(new)
    return len(tensors)
