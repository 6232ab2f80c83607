"""The reference engine on a LoRA run: the base model with the run's adapter, through peft.

``ckptdelta serve --engine reference --bucket URL`` on a run of adapters
(delta/lora_record.py) lands here: the base is loaded from ``--base-model DIR`` (or the
directory the run records) and its weights hashed and checked against the run's
record (loader/lora.py), the snapshot is materialized as a PEFT adapter directory and
loaded with ``PeftModel.from_pretrained``, and the adapter's parameters are then set
to exactly the stored bits, in the stored dtype (peft may create them in another
dtype: its autocast makes a bf16 adapter fp32, which would not be the policy the
trainer published). A hot-load writes the adapter's tensors in place through
:class:`ckptdelta.loader.lora.LoraHotSwapper`; the decode loop (loader/engines/reference/model.py) runs the
peft-injected model, so the replica computes with the trainer's modules and
numerics: its logprobs equal the trainer's, bit for bit, on the same bits.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import xxhash

from ckptdelta.delta import dtypes
from ckptdelta.delta.lora_record import ADAPTER_WEIGHTS_NAME, base_digest
from ckptdelta.delta.errors import NotServableError
from ckptdelta.delta.manifest import Manifest

from ckptdelta.loader.lora import LoraHotSwapper, base_dir_for, check_base
from ckptdelta.loader.engines.reference.replica import ReferenceReplica

log = logging.getLogger("ckptdelta.engine")


def is_lora_run(bucket: str, snapshot: "str | int", storage_options: dict[str, Any] | None = None) -> bool:
    """Whether ``snapshot`` of the run at ``bucket`` is a LoRA adapter (its manifest records a base)."""
    from ckptdelta.loader.reader import SnapshotReader

    reader = SnapshotReader(bucket, storage_options=storage_options)
    try:
        return reader.manifest(reader.resolve(snapshot)).adapter is not None
    finally:
        reader.store.close()


def load_adapter(base: torch.nn.Module, adapter_dir: str, m: Manifest) -> tuple[Any, dict[str, torch.Tensor]]:
    """(the peft model, peft's saved name -> live adapter tensor), the live tensors holding exactly the
    snapshot's bits and dtypes, each checked against the manifest's digest."""
    from peft import PeftModel, get_peft_model_state_dict
    from safetensors.torch import load_file

    model = PeftModel.from_pretrained(base, adapter_dir, is_trainable=False)
    stored = load_file(os.path.join(adapter_dir, ADAPTER_WEIGHTS_NAME))
    live = get_peft_model_state_dict(model)
    if set(live) != set(m.tensors):
        missing = sorted(set(m.tensors) - set(live))[:3]
        extra = sorted(set(live) - set(m.tensors))[:3]
        raise NotServableError(f"{m.where()}: peft loads the adapter with other tensors than the snapshot holds "
                               f"(not in peft's model: {missing}; not in the snapshot: {extra})")
    params = {p.data_ptr(): p for p in model.parameters()}
    with torch.no_grad():
        for name, t in live.items():
            p, want = params.get(t.data_ptr()), stored[name]
            if p is None or tuple(p.shape) != tuple(want.shape):
                raise NotServableError(f"{m.where()}: tensor {name!r} is not one parameter of peft's model")
            if p.dtype == want.dtype:
                p.copy_(want)
            else:       # peft created it in another dtype: the live adapter is the one published
                p.data = want.to(p.device)
    live = get_peft_model_state_dict(model)
    for name, t in live.items():
        got = f"{xxhash.xxh3_64_intdigest(dtypes.host_bits(t.detach().cpu().contiguous())):016x}"
        if got != m.tensors[name].xxh3:
            raise NotServableError(f"{m.where()}: tensor {name!r} loads as xxh3 {got}, the manifest says "
                                   f"{m.tensors[name].xxh3}")
    return model, live


def build(*, bucket: str, snapshot: "str | int" = "latest", base_model: str | None = None,
          storage_options: dict[str, Any] | None = None, cache_dir: str | None = None, device: str = "cpu",
          cache_policy: str = "recompute", model_name: str | None = None, **_: Any) -> ReferenceReplica:
    """``ckptdelta serve --engine reference --bucket URL [--base-model DIR]`` on a LoRA run."""
    from ckptdelta.loader.engines.reference.model import Engine
    from ckptdelta.loader.hf_model import load_model
    from ckptdelta.loader.reader import SnapshotReader
    from ckptdelta.delta.scratch import make as make_scratch
    from ckptdelta.loader.servable import check_device, check_model_dir

    check_device(device)
    reader = SnapshotReader(bucket, storage_options=storage_options, cache_dir=cache_dir)
    version = reader.resolve(snapshot)
    m = reader.manifest(version)
    if m.adapter is None:
        raise NotServableError(f"{m.where()} at {bucket} is not a LoRA adapter: serve it without --base-model")
    where = f"{m.where()} at {bucket}"
    base_dir = base_dir_for(m.adapter, base_model, where)
    check_model_dir(base_dir)
    base, tokenizer = load_model(base_dir, device=device)
    digest = base_digest(base.state_dict().items())     # the base alone, as the publisher hashed it
    check_base(m.adapter, digest, base_dir, where)
    if cache_dir:
        os.makedirs(cache_dir, exist_ok=True)
    scratch = make_scratch("serve", cache_dir)
    try:
        priors: dict = {}     # each tensor's bits before its last change: the next deltas are coded against them
        path = reader.materialize(version, os.path.join(scratch.path, "adapter"), priors=priors)
        model, live = load_adapter(base, path, m)
    finally:
        scratch.release()
    swapper = LoraHotSwapper(live, reader, version=version, record=m.adapter, base_xxh3=digest, priors=priors)
    # the peft-injected transformers model: peft's wrapper only forwards to it, and the decode loop passes
    # the KV cache under the keyword the transformers model itself takes
    engine = Engine(model.get_base_model(), tokenizer, swapper=swapper, cache_policy=cache_policy,
                    model_name=model_name or reader.run_id)
    log.info("serving %s of LoRA run %s from %s on base %s", m.name, reader.run_id, bucket, base_dir)
    return ReferenceReplica(engine)
