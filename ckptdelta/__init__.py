"""ckptdelta: bit-exact policy weights from an RL trainer to its replicas, as small deltas through object storage.

The names users reach for are here, loaded on first use (PEP 562): ``import ckptdelta`` imports none of them,
and ``ckptdelta.SamplingClient`` loads the sampling client alone, never the replica server (a trainer needs
neither FastAPI nor vLLM)::

    from ckptdelta import ModelInput, SamplingClient, SamplingParams, save_weights_and_get_sampling_client
    from ckptdelta import Publisher, RolloutClient, AsyncRolloutClient, SnapshotReader
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_SAMPLING = ("ModelInput", "SampleResponse", "SampledSequence", "SamplingClient", "SamplingParams",
             "save_weights_and_get_sampling_client")
__all__ = [*_SAMPLING, "AsyncRolloutClient", "Publisher", "RolloutClient", "SnapshotReader", "__version__"]


def __getattr__(name: str) -> Any:
    if name in _SAMPLING:
        from loader import sampling as module
    elif name == "RolloutClient":
        from loader import client as module
    elif name == "AsyncRolloutClient":
        from loader import async_client as module
    elif name == "SnapshotReader":
        from loader import reader as module
    elif name == "Publisher":
        import publisher as module
    else:
        raise AttributeError(f"module 'ckptdelta' has no attribute {name!r}")
    value = getattr(module, name)
    globals()[name] = value      # once loaded, an ordinary attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
