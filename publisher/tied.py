"""Tied weights of a transformers model: which state-dict names are aliases, published once.

A model with ``tie_word_embeddings`` computes its logits with the input
embedding; ``state_dict()`` lists that one tensor twice (``model.embed_tokens.weight``
and ``lm_head.weight``). ``save_pretrained`` writes it once, under the name the
model declares as the source, and ``from_pretrained`` and vLLM tie the head back
from the config; vLLM's loaders skip a tied ``lm_head.weight`` and its model has
no such tensor to read back, so a snapshot that carries the alias cannot be
proven on vLLM. The publisher therefore drops the aliases too, by the same
rule: a name the model declares tied (transformers' ``all_tied_weights_keys``
of v5, the ``_tied_weights_keys`` patterns of v4) that is the very same tensor
view as another published name. Modules that declare nothing keep every name
(their aliases cost bytes once per name in anchors, nothing in deltas).
Duck-typed: transformers is not imported here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch


def tied_aliases(module: torch.nn.Module, state: Mapping[str, Any]) -> dict[str, str]:
    """alias name -> the name published in its place, for the declared tied weights of ``module`` that
    ``state`` (its state dict) holds as one tensor under several names."""
    declared = _declared(module)
    if not declared:
        return {}
    views: dict[tuple, list[str]] = {}
    for name, t in state.items():
        if isinstance(t, torch.Tensor) and not t.is_meta and t.numel():
            views.setdefault(_view_key(t), []).append(name)
    out: dict[str, str] = {}
    for names in views.values():
        if len(names) < 2:
            continue
        kept = [n for n in names if not declared(n)]
        source = kept[0] if kept else sorted(names)[-1]   # all declared: keep one, as save_pretrained does
        for n in names:
            if n != source and declared(n):
                out[n] = source
    return out


def _view_key(t: torch.Tensor) -> tuple:
    """Equal for two tensors that are the same elements in the same layout (not merely the same storage)."""
    return (t.device.type, t.device.index, t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))


def _declared(module: torch.nn.Module) -> Any:
    """A predicate on state-dict names: does the model declare this name a tied alias (None: it declares none)."""
    expanded = getattr(module, "all_tied_weights_keys", None)      # transformers 5: {target: source}, full names
    if isinstance(expanded, Mapping):
        names = frozenset(expanded)
        return names.__contains__ if names else None
    patterns = []                                                   # transformers 4: per-module patterns
    for prefix, sub in module.named_modules():
        keys = getattr(sub, "_tied_weights_keys", None)
        if isinstance(keys, Mapping):
            keys = list(keys)
        for k in keys or ():
            if isinstance(k, str):
                patterns.append(re.compile(re.escape(f"{prefix}.") + k if prefix else k))
    if not patterns:
        return None
    return lambda name: any(p.search(name) for p in patterns)
