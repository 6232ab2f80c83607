"""The reference engine: ckptdelta's own decode loop over a transformers model, for tests and CPU-only demos
(replica), with streaming (stream) and LoRA runs through peft (lora)."""

from __future__ import annotations

from typing import Any


def build(**options: Any) -> Any:
    """``ckptdelta serve --engine reference``: see :func:`ckptdelta.loader.engines.reference.replica.build`."""
    from ckptdelta.loader.engines.reference.replica import build as build_replica

    return build_replica(**options)
