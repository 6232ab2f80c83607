"""Replica engines, by name: each is a package whose ``build(**options)`` returns a ReplicaEngine.

The registry imports an engine only when asked for, so the reference replica
never imports vLLM (and vLLM's workers import only what they call).
"""

from __future__ import annotations

import importlib
from typing import Any

from ckptdelta.loader.engines.base import EngineApplier, EngineResult, ReplicaAPIError, ReplicaEngine

ENGINES: dict[str, str] = {
    "reference": "ckptdelta.loader.engines.reference",
    "vllm": "ckptdelta.loader.engines.vllm",
}


def replica_engine(engine: Any, **options: Any) -> ReplicaEngine:
    """``engine`` as a ReplicaEngine: itself, or a bare decode loop (loader/engines/reference/model.py's ``Engine``, as tests and
    embedders hand one over) behind the reference engine's replica, built with ``options``."""
    if isinstance(engine, ReplicaEngine):
        return engine
    from ckptdelta.loader.engines.reference.replica import ReferenceReplica

    return ReferenceReplica(engine, **options)


def build_engine(kind: str, **options: Any) -> ReplicaEngine:
    """Build the engine ``kind`` ("reference", "vllm") from serve's options."""
    try:
        module = ENGINES[kind]
    except KeyError:
        raise ValueError(f"unknown engine {kind!r}: expected one of {sorted(ENGINES)}") from None
    return importlib.import_module(module).build(**options)


__all__ = ["ENGINES", "EngineApplier", "EngineResult", "ReplicaAPIError", "ReplicaEngine", "build_engine", "replica_engine"]
