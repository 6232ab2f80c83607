"""The reference engine: ckptdelta's own decode loop over a transformers model, for tests and CPU-only demos
(replica), with streaming (stream) and LoRA runs through peft (lora)."""

from __future__ import annotations

from typing import Any


def build(*, bucket: str | None = None, snapshot: str | int = "latest", model_dir: str | None = None,
          storage_options: dict[str, Any] | None = None, **options: Any) -> Any:
    """``ckptdelta serve --engine reference``: a LoRA run's adapter on its base model through peft
    (:func:`ckptdelta.loader.engines.reference.lora.build`, ``base_model``: the base's directory), else full
    weights from a bucket's snapshot or an HF directory (:func:`ckptdelta.loader.engines.reference.replica.build`)."""
    where = {"bucket": bucket, "snapshot": snapshot, "storage_options": storage_options}
    if bucket is not None and model_dir is None:
        from ckptdelta.loader.engines.reference.lora import build as build_lora, is_lora_run

        if is_lora_run(bucket, snapshot, storage_options):
            return build_lora(**where, **options)
    from ckptdelta.loader.engines.reference.replica import build as build_full

    return build_full(**where, model_dir=model_dir, **options)
