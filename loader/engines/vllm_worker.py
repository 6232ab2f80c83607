"""What ckptdelta adds to each vLLM worker (``--worker-extension-cls loader.engines.vllm_worker.CkptDeltaWorker``).

The replica process holds the one host copy of the current weights, in checkpoint
coordinates, in a shared-memory file (loader/engines/shared_weights.py). During a
swap the replica calls these methods on every worker through vLLM's
``/collective_rpc``: they map the shared file (no copy per worker), hand the named
tensors to vLLM's own ``reload_weights`` (so names, fused qkv / gate_up groups,
tied embeddings and tensor-parallel slicing follow vLLM's loaders, and CPU
layers are re-packed), and read the live weights back in checkpoint coordinates
to prove they are the published bits. Arguments travel as one JSON string:
vLLM's HTTP RPC passes strings only.

Method names carry a ``ckptdelta_`` prefix so they can never clash with the
worker's own.
"""

from __future__ import annotations

import json
import time
from typing import Any

import torch


class CkptDeltaWorker:
    """Mixed into vLLM's worker class; ``self`` is the worker (``self.model_runner`` is vLLM's)."""

    def _ckptdelta_model(self) -> torch.nn.Module:
        return self.model_runner.get_model()  # type: ignore[attr-defined]

    def ckptdelta_reload(self, spec: str) -> dict[str, Any]:
        """Reload the named tensors from the shared weights file through vLLM's own loader."""
        from loader.engines.shared_weights import open_tensors

        req = json.loads(spec)
        t0 = time.perf_counter()
        tensors = open_tensors(req["path"], req.get("names"))
        t1 = time.perf_counter()
        self.model_runner.reload_weights(  # type: ignore[attr-defined]
            weights_iterator=iter(tensors.items()), is_checkpoint_format=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return {"tensors": len(tensors), "map_s": t1 - t0, "reload_s": time.perf_counter() - t1}

    def ckptdelta_layout(self, spec: str = "") -> dict[str, Any]:
        """What the replica needs to group tensors into whole vLLM modules (fused q/k/v, gate/up, experts)."""
        model = self._ckptdelta_model()
        packed = getattr(model, "packed_modules_mapping", None) or {}
        return {"packed": {k: list(v) for k, v in dict(packed).items()}}

    def ckptdelta_digests(self, spec: str) -> dict[str, str]:
        """xxh3 digests of the live weights in checkpoint coordinates (all of them, or ``names``)."""
        from loader.engines.vllm_readback import checkpoint_tensors, digests

        req = json.loads(spec) if spec else {}
        return digests(checkpoint_tensors(self._ckptdelta_model(), req.get("names")))

    def ckptdelta_read(self, spec: str) -> dict[str, Any]:
        """The live weights in checkpoint coordinates, written to ``path`` as safetensors (tests, verify)."""
        from safetensors.torch import save_file

        from loader.engines.vllm_readback import checkpoint_tensors

        req = json.loads(spec)
        tensors = checkpoint_tensors(self._ckptdelta_model(), req.get("names"))
        save_file({k: v.contiguous() for k, v in tensors.items()}, req["path"])
        return {"tensors": len(tensors)}
