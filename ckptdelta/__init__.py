"""ckptdelta: bit-exact policy weights from an RL trainer to its replicas, as small deltas through object storage.

The parts are subpackages: :mod:`ckptdelta.delta` (the codec and the format),
:mod:`ckptdelta.publisher` (the trainer side), :mod:`ckptdelta.loader` (the replica
side and its clients), :mod:`ckptdelta.cli` (the ``ckptdelta`` command). The names
below are the ones a training loop or a sampler needs, loaded on first use (PEP 562):
``import ckptdelta`` imports none of them, and ``ckptdelta.SamplingClient`` loads the
sampling client alone, never the replica server (a trainer needs neither FastAPI nor vLLM)::

    from ckptdelta import ModelInput, SamplingClient, SamplingParams, save_weights_and_get_sampling_client
    from ckptdelta import Publisher, RolloutClient, AsyncRolloutClient, SnapshotReader
    from ckptdelta import PublishCallback, FleetRollout   # GRPOTrainer(callbacks=[...], rollout_func=...)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: public name -> the module that defines it
_EXPORTS: dict[str, str] = {
    # trainer side
    "Publisher": "ckptdelta.publisher",
    "PublishResult": "ckptdelta.publisher",
    "AdapterSpec": "ckptdelta.publisher",
    "BaseModel": "ckptdelta.publisher",
    "collect": "ckptdelta.publisher",
    "GcReport": "ckptdelta.publisher",
    # sampling, Loops-shaped
    "ModelInput": "ckptdelta.loader.sampling",
    "SamplingParams": "ckptdelta.loader.sampling",
    "SamplingClient": "ckptdelta.loader.sampling",
    "SampleResponse": "ckptdelta.loader.sampling",
    "SampledSequence": "ckptdelta.loader.sampling",
    "PromptLogprobs": "ckptdelta.loader.sampling",
    "save_weights_and_get_sampling_client": "ckptdelta.loader.sampling",
    # trainer integrations (pip install ckptdelta[trl]): the HF Trainer / TRL callback, TRL's rollout_func
    "PublishCallback": "ckptdelta.integrations.hf",
    "FleetRollout": "ckptdelta.integrations.trl",
    # replica side and clients
    "SnapshotReader": "ckptdelta.loader",
    "VerifyReport": "ckptdelta.loader",
    "HotSwapper": "ckptdelta.loader",
    "DiskCache": "ckptdelta.loader",
    "RolloutClient": "ckptdelta.loader.client",
    "AsyncRolloutClient": "ckptdelta.loader.async_client",
    # the one exception hierarchy
    "CkptDeltaError": "ckptdelta.delta.errors",
    "DeltaError": "ckptdelta.delta.errors",
    "PublishError": "ckptdelta.delta.errors",
    "PublishInputError": "ckptdelta.delta.errors",
    "ConcurrentPublisherError": "ckptdelta.delta.errors",
    "HotLoadError": "ckptdelta.delta.errors",
    "StorageError": "ckptdelta.delta.errors",
    "SnapshotNotFoundError": "ckptdelta.delta.errors",
    "ExactBitsMissingError": "ckptdelta.delta.errors",
    "ExactAttachError": "ckptdelta.delta.errors",
    "ReplicaError": "ckptdelta.delta.errors",
    "PolicyVersionTimeoutError": "ckptdelta.delta.errors",
    "SampleTimeoutError": "ckptdelta.delta.errors",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    try:
        module = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'ckptdelta' has no attribute {name!r}") from None
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value      # once loaded, an ordinary attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:   # for type checkers and IDEs; at run time the names above load on first use
    from ckptdelta.delta.errors import (CkptDeltaError, ConcurrentPublisherError, DeltaError, ExactAttachError,
                                        ExactBitsMissingError, HotLoadError, PolicyVersionTimeoutError, PublishError,
                                        PublishInputError, ReplicaError, SampleTimeoutError, SnapshotNotFoundError,
                                        StorageError)
    from ckptdelta.integrations.hf import PublishCallback
    from ckptdelta.integrations.trl import FleetRollout
    from ckptdelta.loader import DiskCache, HotSwapper, SnapshotReader, VerifyReport
    from ckptdelta.loader.async_client import AsyncRolloutClient
    from ckptdelta.loader.client import RolloutClient
    from ckptdelta.loader.sampling import (ModelInput, PromptLogprobs, SampledSequence, SampleResponse, SamplingClient,
                                           SamplingParams, save_weights_and_get_sampling_client)
    from ckptdelta.publisher import AdapterSpec, BaseModel, GcReport, Publisher, PublishResult, collect
