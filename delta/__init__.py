"""delta/: the codec and the format. Two snapshots in, a small lossless delta out, and back.

Also home to what both sides of a run share: the manifest model and bucket layout
(:mod:`ckptdelta.delta.manifest`) and the storage interface (:mod:`ckptdelta.delta.storage`).
"""

if __name__ != "ckptdelta.delta":   # a checkout's root on sys.path would give every module a second copy
    raise ImportError(f"this package is ckptdelta.delta; import it under that name, not as {__name__!r}")

from ckptdelta.delta import kernel_cache

kernel_cache.install()   # before any kernel is defined: numba picks a function's cache locator as it is decorated

from ckptdelta.delta.batch import apply_many, encode_many  # noqa: E402
from ckptdelta.delta.codec import (EncodedTensor, StagedTensor, apply_, decode, digest, digest_hex,  # noqa: E402
                                   encode, stage, stage_full)
from ckptdelta.delta.errors import CkptDeltaError, DeltaError  # noqa: E402

__all__ = ["CkptDeltaError", "DeltaError", "EncodedTensor", "StagedTensor", "apply_", "apply_many", "decode",
           "digest", "digest_hex", "encode", "encode_many", "stage", "stage_full"]
