"""A LoRA run's record: which base model its adapters belong to, and which adapter config they follow.

A LoRA run publishes a PEFT adapter (its ``lora_A`` / ``lora_B`` tensors) rather
than a model. The adapter means nothing without the exact base weights it was
trained on, so every manifest of such a run carries an :class:`AdapterRecord`
(docs/FORMAT.md, "LoRA runs"): the base's name and a digest of its weights, and the
digest of the adapter config its anchor carries as ``adapter_config.json``. A
replica compares the base digest with the weights it loaded before it serves or
hot-loads anything, and the config digest with the adapter it holds (a change of
rank, alpha or target modules comes with a new anchor).

Both sides share this module: publisher/ writes the record, loader/ reads it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from ckptdelta.delta import dtypes
from ckptdelta.delta.errors import ManifestError

#: The file names of a PEFT adapter directory, as peft's save_pretrained writes them (and vLLM's
#: load_lora_adapter reads them): an anchor of a LoRA run is such a directory.
ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
ADAPTER_CONFIG_NAME = "adapter_config.json"
#: The longest base model name a record takes (a hub id or a path).
MAX_BASE_NAME = 1024

_HEX16 = re.compile(r"^[0-9a-f]{16}$")
#: Name segments peft inserts into a base module's own names when it wraps it.
_WRAPPER_SEGMENTS = ("base_layer", "original_module")
#: adapter_config.json fields that are sets (peft writes a set as a list in no particular order).
_SET_FIELDS = ("target_modules", "exclude_modules", "modules_to_save")
#: adapter_config.json fields named when a change of config starts an anchor, or a replica refuses one.
_DESCRIBED = ("r", "lora_alpha", "target_modules", "use_rslora", "use_dora", "rank_pattern", "alpha_pattern")


@dataclass(frozen=True)
class AdapterRecord:
    """The ``adapter`` field of a LoRA run's manifest."""

    base_model: str      # the base's name (adapter_config.json's base_model_name_or_path, or as given)
    base_xxh3: str       # base_digest() of the base's weights, 16 hex digits
    config_xxh3: str     # xxh3 of the adapter_config.json bytes the snapshot's anchor carries

    def to_dict(self) -> dict[str, str]:
        return {"base_model": self.base_model, "base_xxh3": self.base_xxh3, "config_xxh3": self.config_xxh3}

    @classmethod
    def from_dict(cls, d: Any, what: str) -> "AdapterRecord":
        """Validated: a malformed record is a ManifestError naming ``what``."""
        if not isinstance(d, dict) or set(d) != {"base_model", "base_xxh3", "config_xxh3"}:
            raise ManifestError(f"{what}: invalid adapter record (an object of base_model, base_xxh3 and "
                                "config_xxh3)")
        name = d["base_model"]
        if not isinstance(name, str) or not 0 < len(name) <= MAX_BASE_NAME:
            raise ManifestError(f"{what}: invalid adapter base_model {str(name)[:100]!r}")
        for k in ("base_xxh3", "config_xxh3"):
            if not isinstance(d[k], str) or not _HEX16.match(d[k]):
                raise ManifestError(f"{what}: invalid adapter {k} {str(d[k])[:40]!r}")
        return cls(name, d["base_xxh3"], d["config_xxh3"])

    def describe_base(self) -> str:
        return f"base {self.base_model!r} (weights xxh3 {self.base_xxh3})"


def base_digest(tensors: Iterable[tuple[str, torch.Tensor]]) -> str:
    """xxh3-64 of a base model's weights, 16 hex digits: over the tensors in sorted name order, each as its
    UTF-8 name, a NUL, its dtype and shape (``BF16[64, 320]``), a NUL, then its bytes (C order).

    The names are the base's own ``state_dict`` names as transformers loads it (a tied tensor under each
    of its names); a model wrapped by peft gives them through :func:`base_tensors`. Any dtype, shape or
    bit differs: another digest. Tensors on a device are copied to the host one at a time."""
    items = sorted(tensors, key=lambda kv: kv[0])
    h = xxhash.xxh3_64()
    for name, t in items:
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        h.update(name.encode() + b"\0")
        h.update(f"{dtypes.of(t).name}{list(t.shape)}".encode() + b"\0")
        h.update(memoryview(dtypes.host_bits(t).view("u1")))
    return f"{h.intdigest():016x}"


def base_tensors(model: torch.nn.Module, adapter_names: Iterable[str] = ()) -> list[tuple[str, torch.Tensor]]:
    """The base weights of ``model`` under the base's own names: a plain transformers model's state_dict,
    or, for a model peft has injected adapters into, the same without the adapters' tensors (any name with
    a segment equal to an adapter name, ``lora_A.default.weight``) and with peft's ``base_layer`` and
    ``original_module`` segments removed (``q_proj.base_layer.weight`` is the base's ``q_proj.weight``; a
    module peft trains whole, ``modules_to_save``, keeps its base copy as ``lm_head.original_module.weight``)."""
    skip = set(adapter_names)
    out = []
    for name, t in model.state_dict().items():
        parts = name.split(".")
        if skip.intersection(parts):
            continue
        out.append((".".join(p for p in parts if p not in _WRAPPER_SEGMENTS), t))
    return out


def canonical_config(config: Mapping[str, Any]) -> bytes:
    """adapter_config.json as peft's save_pretrained writes it (keys sorted, indent 2), with its sets as sorted
    lists (peft writes them in no particular order), so one config gives one digest however it reached the
    publisher: a peft model's config or the file peft saved."""
    def norm(v: Any) -> Any:
        if isinstance(v, (set, frozenset)):
            return sorted(norm(x) for x in v)
        if isinstance(v, Mapping):
            return {str(k): norm(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [norm(x) for x in v]
        if hasattr(v, "value") and type(v).__module__.startswith("peft"):   # peft's str enums (PeftType)
            return v.value
        return v

    d = norm(dict(config))
    for k in _SET_FIELDS:
        if isinstance(d.get(k), list):
            d[k] = sorted(d[k], key=str)
    return json.dumps(d, indent=2, sort_keys=True).encode()


def digest_bytes(data: bytes) -> str:
    return f"{xxhash.xxh3_64_intdigest(data):016x}"


def describe_config_change(old: Mapping[str, Any] | None, new: Mapping[str, Any]) -> str:
    """What changed between two adapter configs, for a message: the publisher's anchor reason, a replica's
    refusal (``the adapter config changed: r 4 -> 8``)."""
    if old is None:
        return "the adapter config changed"
    diffs = [f"{k} {_show(old.get(k))} -> {_show(new.get(k))}" for k in _DESCRIBED
             if _show(old.get(k)) != _show(new.get(k))]
    others = sorted(k for k in set(old) | set(new) if k not in _DESCRIBED and old.get(k) != new.get(k))
    if others:
        diffs.append("also " + ", ".join(others[:4]))
    return "the adapter config changed: " + ("; ".join(diffs) if diffs else "(same fields, other values)")


def _show(v: Any) -> str:
    if isinstance(v, (list, set, tuple, frozenset)):
        return "[" + ",".join(sorted(map(str, v))) + "]"
    return str(v)
