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


def build(**options: Any) -> Any:
    """``ckptdelta serve --engine vllm``: see :func:`ckptdelta.loader.engines.vllm.replica.build`."""
    from ckptdelta.loader.engines.vllm.replica import build as build_replica

    return build_replica(**options)
