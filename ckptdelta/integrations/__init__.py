"""Trainer integrations: where ckptdelta meets a training library's own loop.

:mod:`ckptdelta.integrations.hf`: :class:`PublishCallback`, a ``transformers.TrainerCallback`` that publishes the
model the HF Trainer or any TRL trainer trains. :mod:`ckptdelta.integrations.trl`: :class:`FleetRollout`, TRL's
``rollout_func`` that samples GRPO's groups from the replicas at the version the callback just published. They
touch both sides (the publisher, the replicas' clients), so they live here, above both; each is imported on
first use (``pip install ckptdelta[trl]``), and ``import ckptdelta`` imports neither transformers nor TRL.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {"PublishCallback": "ckptdelta.integrations.hf", "FleetRollout": "ckptdelta.integrations.trl",
            "RolloutRecord": "ckptdelta.integrations.trl"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    try:
        module = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'ckptdelta.integrations' has no attribute {name!r}") from None
    return getattr(importlib.import_module(module), name)


if TYPE_CHECKING:
    from ckptdelta.integrations.hf import PublishCallback
    from ckptdelta.integrations.trl import FleetRollout, RolloutRecord
