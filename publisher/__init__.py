"""publisher/: the trainer side. ``Publisher(url).publish(model, step)`` -> a committed snapshot.

Anchors are Hugging Face style sharded safetensors, deltas are records of the
codec in :mod:`delta`, and a create-only manifest per snapshot is the commit
(docs/PUBLISHING.md). :func:`publisher.gc.collect` applies retention.
"""

from delta.errors import CollectiveError, ConcurrentPublisherError, PublishError, PublishInputError

from .adapter import AdapterSpec, BaseModel
from .gc import GcReport, collect
from .publisher import Publisher
from .result import PublishResult

__all__ = ["AdapterSpec", "BaseModel", "CollectiveError", "ConcurrentPublisherError", "GcReport", "PublishError",
           "PublishInputError", "PublishResult", "Publisher", "collect"]
