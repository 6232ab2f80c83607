"""vLLM as the replica engine, in two halves that meet only at a few named seams.

- The replica side (this package's modules): vLLM's server process and control RPC
  (replica), the applier and the take-over proof, LoRA slots seen from the replica
  (lora), streaming (stream), the liveness watch (watch), the dtype vLLM is started
  with (dtype), and the clean-up of its shared memory (shm).
- worker/: what runs inside vLLM's own worker processes, loaded there through
  ``--worker-extension-cls ckptdelta.loader.engines.vllm.worker.extension.CkptDeltaWorker``.

They meet through the worker extension's RPC method names, the shared host copy of
the weights (loader/engines/shared_weights.py), the tensor-parallel slices (tp) and
the proof digests; neither half imports the other (tests/test_layout.py). Importing
this package imports neither, so vLLM's workers load only what they call.
"""

from __future__ import annotations

from typing import Any


def build(*, bucket: str | None = None, snapshot: str | int = "latest", storage_options: dict[str, Any] | None = None,
          cache_dir: str | None = None, **options: Any) -> Any:
    """``ckptdelta serve --engine vllm``: a LoRA run's adapter goes into vLLM's LoRA slots
    (:func:`ckptdelta.loader.engines.vllm.lora.build`), a full model's weights into vLLM's modules
    (:func:`ckptdelta.loader.engines.vllm.replica.build`); the snapshot's manifest says which."""
    if bucket is None:
        raise ValueError("serve --engine vllm needs --bucket URL (the run whose snapshots it hot-loads)")
    from ckptdelta.loader.reader import SnapshotReader

    reader = SnapshotReader(bucket, storage_options=storage_options, cache_dir=cache_dir)
    try:
        version = reader.resolve(snapshot)
        lora = reader.manifest(version).adapter is not None
    finally:
        reader.store.close()
    where = {"bucket": bucket, "snapshot": version, "storage_options": storage_options, "cache_dir": cache_dir}
    if lora:
        from ckptdelta.loader.engines.vllm.lora import build as build_lora

        return build_lora(**where, **options)
    from ckptdelta.loader.engines.vllm.replica import build as build_full

    return build_full(**where, **options)
