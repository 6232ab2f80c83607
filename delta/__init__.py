"""delta/: the codec and the format. Two snapshots in, a small lossless delta out, and back.

Also home to what both sides of a run share: the manifest model and bucket layout
(:mod:`delta.manifest`) and the storage interface (:mod:`delta.storage`).
"""

from . import kernel_cache

kernel_cache.install()   # before any kernel is defined: numba picks a function's cache locator as it is decorated

from .batch import apply_many, encode_many  # noqa: E402
from .codec import (EncodedTensor, StagedTensor, apply_, decode, digest, digest_hex, encode, stage,  # noqa: E402
                    stage_full)
from .errors import CkptDeltaError, DeltaError  # noqa: E402

__all__ = ["CkptDeltaError", "DeltaError", "EncodedTensor", "StagedTensor", "apply_", "apply_many", "decode",
           "digest", "digest_hex", "encode", "encode_many", "stage", "stage_full"]
