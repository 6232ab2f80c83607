"""publisher/: the trainer side. ``Publisher(url).publish(model, step)`` -> a committed snapshot.

Anchors are Hugging Face style sharded safetensors, deltas are records of the
codec in :mod:`delta`, and a create-only manifest per snapshot is the commit
(docs/PUBLISHING.md). :func:`ckptdelta.publisher.gc.collect` applies retention.
"""

if __name__ != "ckptdelta.publisher":   # a checkout's root on sys.path would give every module a second copy
    raise ImportError(f"this package is ckptdelta.publisher; import it under that name, not as {__name__!r}")

from ckptdelta.delta.errors import (CollectiveError, ConcurrentPublisherError, ExactAttachError, PublishError,
                                    PublishInputError)

from ckptdelta.publisher.lora import AdapterSpec, BaseModel
from ckptdelta.publisher.gc import GcReport, collect
from ckptdelta.publisher.job import Skipped
from ckptdelta.publisher.publisher import Publisher
from ckptdelta.publisher.result import PublishResult

__all__ = ["AdapterSpec", "BaseModel", "CollectiveError", "ConcurrentPublisherError", "ExactAttachError", "GcReport",
           "PublishError", "PublishInputError", "PublishResult", "Publisher", "Skipped", "collect"]
