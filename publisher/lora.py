"""LoRA runs on the trainer side: what a publish of an adapter becomes, and when it must anchor.

``Publisher.publish(peft_model, step)`` (or an adapter state dict, with
``Publisher(url, adapter=AdapterSpec(...))``) publishes the adapter's tensors under
the names peft saves them with (``...q_proj.lora_A.weight``), and its anchors are
PEFT adapter directories: ``adapter_model.safetensors`` beside ``adapter_config.json``,
which load as-is in peft and in vLLM's ``load_lora_adapter``. Every manifest records
the base the adapter belongs to (a name and :func:`ckptdelta.delta.lora_record.base_digest` of its
weights) and the digest of the adapter config (delta/lora_record.py). A new base or a new
config (rank, alpha, target modules, anything in adapter_config.json) starts an anchor,
and a run holds either full models or adapters, never both.
"""

from __future__ import annotations

import json
import logging
import os
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from ckptdelta.delta.lora_record import (ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME, AdapterRecord, base_digest,
                                     base_tensors, canonical_config, describe_config_change, digest_bytes)
from ckptdelta.delta.errors import CkptDeltaError, PublishInputError
from ckptdelta.delta.manifest import Manifest
from ckptdelta.delta.storage import Store

log = logging.getLogger("ckptdelta.publisher")

#: Segments that mark a tensor of a LoRA adapter in peft's saved names.
LORA_SEGMENTS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B", "lora_magnitude_vector")
#: A LoRA run's default ``anchor_chain_fraction``: an adapter's step changes every element, so a delta is
#: 0.25-0.7 of an anchor (docs/PUBLISHING.md); at a full model's 0.5 every other version would anchor and a
#: replica hot-loading each step would read more than XOR deltas would send. An adapter is small, so a fresh
#: replica replaying four adapters' worth of deltas reads a few of them.
CHAIN_FRACTION = 4.0


@dataclass(frozen=True)
class BaseModel:
    """The base model an adapter belongs to: a name and the digest of its weights."""

    name: str
    xxh3: str

    @classmethod
    def of(cls, source: "torch.nn.Module | Mapping[str, torch.Tensor] | str | os.PathLike[str]",
           name: str | None = None) -> "BaseModel":
        """From the base itself: a transformers model (a peft model's base weights are taken without its
        adapters), a state dict, or a model directory (loaded with transformers on the CPU, as a replica
        loads it). ``name`` defaults to the directory or the model's ``name_or_path``."""
        if isinstance(source, (str, os.PathLike)):
            path = os.fspath(source)
            return cls(name or path, base_digest(load_base_tensors(path)))
        if isinstance(source, torch.nn.Module):
            adapters = getattr(source, "peft_config", {}) or {}
            model = source.get_base_model() if is_peft_model(source) else source
            found = getattr(getattr(model, "config", None), "_name_or_path", "") or type(model).__name__
            tensors = base_tensors(model, adapters)
            odd = next(((n, t) for n, t in tensors if not _plain(t)), None)
            if odd is not None:
                # an FSDP2 model's DTensor holds one shard; gathering it would wait for every rank of its mesh
                raise PublishInputError(
                    f"the base weight {odd[0]!r} is a {type(odd[1]).__name__} (a sharded or wrapped tensor, such as "
                    "an FSDP2 model's DTensor), not a plain tensor: ckptdelta cannot hash that base from the model; "
                    "declare it instead: Publisher(url, adapter=AdapterSpec(model.peft_config[name], "
                    "BaseModel.of(BASE_MODEL_DIR)))")
            return cls(name or found, base_digest(tensors))
        if isinstance(source, Mapping):
            return cls(name or "base", base_digest(source.items()))
        raise PublishInputError(f"BaseModel.of takes a model, a state dict or a model directory, not "
                                f"{type(source).__name__}")

    def record(self, config_xxh3: str) -> AdapterRecord:
        return AdapterRecord(self.name, self.xxh3, config_xxh3)

    def describe(self) -> str:
        return f"{self.name} (weights xxh3 {self.xxh3})"


@dataclass(frozen=True)
class AdapterSpec:
    """What ``Publisher(url, adapter=...)`` needs to publish adapter state dicts: the adapter config (a peft
    config, its dict, adapter_config.json or the adapter directory holding it) and the base."""

    config: Any
    base: BaseModel


@dataclass
class AdapterSnapshot:
    """One publish of an adapter: its tensors, its anchor's adapter_config.json and the manifest record."""

    tensors: dict[str, Any]
    config_json: bytes
    record: AdapterRecord
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def extra_files(self) -> dict[str, bytes]:
        return {ADAPTER_CONFIG_NAME: self.config_json}


def is_peft_model(obj: Any) -> bool:
    """A peft model (duck-typed, so that importing publisher/ never imports peft)."""
    return isinstance(obj, torch.nn.Module) and isinstance(getattr(obj, "peft_config", None), dict) \
        and callable(getattr(obj, "get_base_model", None))


def load_base_tensors(path: str) -> list[tuple[str, torch.Tensor]]:
    """A base model directory's weights as transformers loads them (its state dict), on the CPU."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise PublishInputError(f"base model directory {path} holds no config.json (give the directory the base "
                                "was saved to with save_pretrained)")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype="auto")
    return list(model.state_dict().items())


def read_config(config: Any) -> dict[str, Any]:
    """An adapter config as a dict, from a peft config, a dict, adapter_config.json or its directory."""
    if hasattr(config, "to_dict") and callable(config.to_dict):
        d = config.to_dict()
    elif isinstance(config, Mapping):
        d = dict(config)
    elif isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        if os.path.isdir(path):
            path = os.path.join(path, ADAPTER_CONFIG_NAME)
        try:
            with open(path, "rb") as f:
                d = json.loads(f.read())
        except OSError as e:
            raise PublishInputError(f"adapter config {path}: cannot read it: {e.strerror or e}") from None
        except ValueError as e:
            raise PublishInputError(f"adapter config {path}: not valid JSON ({e})") from None
    else:
        raise PublishInputError(f"adapter config: a peft config, a dict or a path to {ADAPTER_CONFIG_NAME}, not "
                                f"{type(config).__name__}")
    return check_config(d, "adapter config")


def check_config(d: Any, what: str) -> dict[str, Any]:
    if not isinstance(d, dict):
        raise PublishInputError(f"{what}: not a JSON object")
    kind = d.get("peft_type")
    kind = getattr(kind, "value", kind)
    if kind != "LORA":
        raise PublishInputError(f"{what}: peft_type is {kind!r}; ckptdelta publishes LoRA adapters (peft_type "
                                "'LORA') only")
    for k in ("r", "lora_alpha", "target_modules"):
        if d.get(k) is None:
            raise PublishInputError(f"{what}: no {k!r}: not a LoRA adapter config as peft writes it")
    return d


def check_adapter_tensors(names: list[str], what: str) -> None:
    """Adapter tensors under peft's saved names, or one line saying what was given instead."""
    if not names:
        raise PublishInputError(f"{what}: no tensors")
    lora = [n for n in names if any(s in n.split(".") for s in LORA_SEGMENTS)]
    if not lora:
        raise PublishInputError(f"{what}: not a LoRA adapter: none of its {len(names)} tensors is a lora_A or "
                                f"lora_B ({names[0]!r}, ...); publish peft's adapter state dict "
                                "(get_peft_model_state_dict(model)) or the peft model itself")
    live = [n for n in lora if ".lora_A.default." in n or ".lora_B.default." in n]
    if live:
        raise PublishInputError(f"{what}: tensor {live[0]!r} carries peft's adapter name (a module's "
                                "state_dict); publish get_peft_model_state_dict(model), which names it as peft "
                                "saves it")


def check_tensors_fit_config(tensors: Mapping[str, Any], config: Mapping[str, Any], what: str) -> None:
    """An adapter state dict whose tensors are not the adapter the config describes is refused, naming the
    tensor: a rank the config gives no module (``r`` and ``rank_pattern``; lora_A and lora_B of one module
    agreeing), or a module a list of ``target_modules`` does not name (peft's rule: the module's name or its
    last dotted parts). Published under that config, its anchor's adapter_config.json would lie about its
    tensors: peft refuses such a directory, and an engine that takes the rank from the tensors and the
    scaling from the config computes another policy. Tuners that shape their tensors otherwise
    (``target_parameters``) are not checked."""
    if config.get("target_parameters"):
        return
    r = config.get("r")
    ranks = {r, *(config.get("rank_pattern") or {}).values()}
    targets = config.get("target_modules")
    targets = sorted(map(str, targets)) if isinstance(targets, (list, tuple, set, frozenset)) else None
    seen: dict[str, tuple[str, int]] = {}
    for name, t in tensors.items():
        parts = name.split(".")
        seg = next((p for p in parts if p in LORA_SEGMENTS), None)
        shape = tuple(getattr(t, "shape", ()))
        if seg is None or seg == "lora_magnitude_vector" or len(shape) < 2 or parts[-1] == "bias":
            continue
        module = ".".join(parts[:parts.index(seg)])
        rank = shape[0] if seg in ("lora_A", "lora_embedding_A") else shape[1]
        if rank not in ranks:
            pattern = f" (rank_pattern {config.get('rank_pattern')})" if config.get("rank_pattern") else ""
            raise PublishInputError(f"{what}: tensor {name!r} has rank {rank}, but the adapter config says r "
                                    f"{r}{pattern}: an adapter of another rank is published with its own config "
                                    "(a new AdapterSpec, or the peft model itself), which starts an anchor")
        other = seen.setdefault(module, (name, rank))
        if other[1] != rank:
            raise PublishInputError(f"{what}: tensor {name!r} has rank {rank} and {other[0]!r} rank {other[1]}: "
                                    "not one LoRA module")
        if targets is not None and not any(module == x or module.endswith("." + x) for x in targets):
            raise PublishInputError(f"{what}: tensor {name!r} is on module {module!r}, which the adapter config's "
                                    f"target_modules {targets} do not name: an adapter on other modules is "
                                    "published with its own config (a new AdapterSpec, or the peft model "
                                    "itself), which starts an anchor")


def base_key(model: torch.nn.Module) -> tuple:
    """What :meth:`BaseModel.of` of a peft model depends on, read without a byte of the weights: each base
    tensor's name, storage address, torch version counter, dtype, shape and strides. Another base, a parameter
    replaced or reloaded, or an in-place write torch counts (an optimizer step, ``load_state_dict``, ``copy_``
    under ``no_grad``) gives another key; a write through ``.data`` bypasses the counter and does not."""
    adapters = getattr(model, "peft_config", {}) or {}
    return tuple((n, t.data_ptr(), t._version, t.dtype, tuple(t.shape), tuple(t.stride()), str(t.device))
                 for n, t in base_tensors(model.get_base_model(), adapters))


def _named_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter and buffer of ``model`` with its name, tied ones under each name."""
    yield from model.named_parameters(remove_duplicate=False)
    yield from model.named_buffers(remove_duplicate=False)


def _plain(t: Any) -> bool:
    """A tensor ckptdelta reads in place: a plain strided torch tensor or parameter with data (not a DTensor or
    another wrapper, whose storage is not its data's)."""
    return type(t) in (torch.Tensor, torch.nn.Parameter) and t.layout == torch.strided and t.device.type != "meta"


def _views_of(model: torch.nn.Module, tensors: Mapping[str, Any]) -> bool:
    """Whether every one of ``tensors`` is a plain CPU or device tensor viewing the storage of one of the model's
    own plain parameters or buffers: only such a state dict shows the next step through itself. One peft
    computed (a copy, a product), or tensors of another kind (an FSDP2 model's DTensors, whose storage and address
    are not their shards'), is taken again on every publish."""
    owned = {(t.untyped_storage().data_ptr(), t.device) for _, t in _named_tensors(model) if _plain(t)}
    return all(_plain(t) and (t.untyped_storage().data_ptr(), t.device) in owned for t in tensors.values())


def adapter_key(model: torch.nn.Module) -> tuple:
    """What peft's state dict of a peft model depends on besides its config, read without a byte of the weights:
    every parameter's and buffer's name, identity, storage address, dtype, shape, strides and device. A module
    added, replaced or renamed, a parameter replaced or its ``.data`` reassigned, or an adapter added, gives
    another key; values written in place (an optimizer step) do not, and need not: the state dict's entries
    are views of these tensors."""
    return tuple((n, id(t), t.data_ptr(), t.dtype, tuple(t.shape), t.stride(), t.device)
                 for n, t in _named_tensors(model))


class RunAdapter:
    """A Publisher's knowledge of its run's adapter: the spec it was given, the base of the peft model it
    publishes (hashed at its first publish, and again whenever the model's base is not the one hashed:
    :func:`base_key`), and what the run committed last."""

    def __init__(self, spec: AdapterSpec | None) -> None:
        if spec is not None and not isinstance(spec, AdapterSpec):
            raise PublishInputError(f"adapter= takes an AdapterSpec, not {type(spec).__name__}")
        self.spec = spec
        self._spec_config = None if spec is None else read_config(spec.config)
        self._base: BaseModel | None = None if spec is None else spec.base
        # the peft model _base was hashed from and its base_key(); None while a spec declares the base
        self._hashed: tuple[weakref.ref, tuple] | None = None
        # the peft model whose adapter state dict was taken last, its key, the state dict (_adapter_tensors)
        self._peft_sd: tuple[weakref.ref, tuple, dict[str, torch.Tensor]] | None = None
        self.known = False                       # the run has a committed snapshot we could read
        self.last: AdapterRecord | None = None   # the newest snapshot's record (None: a full-model run)
        self.last_config: dict[str, Any] | None = None

    # --- the run so far ------------------------------------------------------------------

    def resume(self, store: Store, chain: list[Manifest]) -> None:
        """From the run's newest chain (its anchor first): its record and the config its anchor carries."""
        if not chain:
            return
        self.known, self.last = True, chain[-1].adapter
        if self.last is None:
            return
        ref = next((o for o in chain[0].extra_files if o.key.rsplit("/", 1)[-1] == ADAPTER_CONFIG_NAME), None)
        try:
            self.last_config = None if ref is None else json.loads(store.get(ref.key, max_size=ref.size))
        except (CkptDeltaError, ValueError) as e:   # only names the change in a message
            log.debug("cannot read the anchor's %s (%s)", ADAPTER_CONFIG_NAME, e)

    def committed(self, snap: AdapterSnapshot | None) -> None:
        self.known = True
        self.last = None if snap is None else snap.record
        self.last_config = None if snap is None else snap.config

    # --- one publish -------------------------------------------------------------------------

    def split(self, weights: Any, where: str) -> tuple[Any, AdapterSnapshot | None]:
        """(the tensors to publish, the adapter snapshot or None for a full model); refuses a full model on a
        LoRA run and an adapter on a full-model run."""
        snap = None
        if is_peft_model(weights):
            snap = self._of_peft_model(weights)
        elif self.spec is not None:
            if isinstance(weights, torch.nn.Module):
                raise PublishInputError(f"{where}: Publisher(adapter=...) publishes adapter state dicts or peft "
                                        f"models; a {type(weights).__name__} holds no adapter")
            if not isinstance(weights, Mapping):
                raise PublishInputError(f"{where}: publish() takes an adapter state dict here, not "
                                        f"{type(weights).__name__}")
            check_adapter_tensors(list(weights), f"{where}: the adapter state dict")
            check_tensors_fit_config(weights, self._spec_config, f"{where}: the adapter state dict")
            config_json = canonical_config(self._spec_config)
            snap = AdapterSnapshot(dict(weights), config_json, self._base.record(digest_bytes(config_json)),
                                   self._spec_config)
        if self.known and (snap is None) != (self.last is None):
            if snap is None:
                raise PublishInputError(f"{where} is a LoRA run (adapters for {self.last.describe_base()}); "
                                        "these weights are not a LoRA adapter (a peft model, or an adapter "
                                        "state dict with Publisher(adapter=...)): publish them to a run of their "
                                        "own")
            raise PublishInputError(f"{where} holds full-model snapshots; a LoRA adapter for "
                                    f"{snap.record.describe_base()} goes to a run of its own")
        return (weights if snap is None else snap.tensors), snap

    def _of_peft_model(self, model: Any) -> AdapterSnapshot:
        name = model.active_adapter if isinstance(getattr(model, "active_adapter", None), str) else "default"
        cfg = model.peft_config[name]
        d = check_config(cfg.to_dict(), f"peft model's adapter {name!r}")
        d["inference_mode"] = True              # as peft's save_pretrained writes it: what a replica loads
        if d.get("task_type") is None and d.get("auto_mapping") is None:     # ditto (AutoPeftModel's hint)
            base = type(model.get_base_model())
            d["auto_mapping"] = {"base_model_class": base.__name__, "parent_library": base.__module__}
        config_json = canonical_config(d)
        tensors = self._adapter_tensors(model, name, config_json)
        if self.spec is None:
            self._hash_base(model, d.get("base_model_name_or_path") or None)
        return AdapterSnapshot(tensors, config_json, self._base.record(digest_bytes(config_json)), d)

    def _adapter_tensors(self, model: Any, name: str, config_json: bytes) -> dict[str, torch.Tensor]:
        """peft's ``get_peft_model_state_dict`` of adapter ``name``, taken again only where the model is not the
        one it was taken from last (:func:`adapter_key`: its tensors, names and places, and the adapter's config,
        ``config_json``).
        Its entries are views of the model's own tensors, so an optimizer step shows through them; peft's walk
        of every module, its config lookups included, cost 12 ms a publish on a 0.5 GB model (24 where vLLM
        shares the cores), against 2 ms for the key."""
        key = (name, config_json, adapter_key(model))
        if self._peft_sd is not None and self._peft_sd[0]() is model and self._peft_sd[1] == key:
            return dict(self._peft_sd[2])
        from peft import get_peft_model_state_dict

        tensors = get_peft_model_state_dict(model, adapter_name=name)
        check_adapter_tensors(list(tensors), f"peft model's adapter {name!r}")
        self._peft_sd = (weakref.ref(model), key, dict(tensors)) if _views_of(model, tensors) else None
        return tensors

    def _hash_base(self, model: Any, name: str | None) -> None:
        """Hash the base of ``model`` unless it is the very base hashed last (the same model, its base tensors
        where they were, written by nothing torch counts): a second peft model on another base, or a base the
        trainer reloaded or changed, is recorded as the base it is, never as the first one."""
        key = base_key(model)
        if self._hashed is not None and self._hashed[0]() is model and self._hashed[1] == key:
            return
        base = BaseModel.of(model, name=name)
        if self._base is not None and base != self._base:
            log.warning("LoRA run: the peft model's base is now %s (was %s)", base.describe(), self._base.describe())
        else:
            log.info("LoRA run: base %s", base.describe())
        self._base, self._hashed = base, (weakref.ref(model), key)

    def anchor_reason(self, snap: AdapterSnapshot | None) -> str | None:
        """Why this adapter must start an anchor (a new base or config), or None."""
        if snap is None or self.last is None:
            return None
        if snap.record.base_xxh3 != self.last.base_xxh3:
            return f"the base model changed: {self.last.describe_base()} -> {snap.record.describe_base()}"
        if snap.record.config_xxh3 != self.last.config_xxh3:
            return describe_config_change(self.last_config, snap.config)
        return None


__all__ = ["ADAPTER_CONFIG_NAME", "ADAPTER_WEIGHTS_NAME", "AdapterSnapshot", "AdapterSpec", "BaseModel",
           "RunAdapter", "is_peft_model"]
