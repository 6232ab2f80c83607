"""One exception hierarchy for the whole project.

Every class derives from :class:`CkptDeltaError` so a caller can catch everything
ckptdelta raises with one clause, and each category also derives from the builtin
it refines (a corrupt object is a ``ValueError``, a missing one a
``FileNotFoundError``) so code that already catches builtins keeps working.
Messages name the object, tensor, chunk or snapshot involved: the user must be
able to act on them without a debugger.
"""

from __future__ import annotations


class CkptDeltaError(Exception):
    """Root of everything ckptdelta raises on purpose."""


# --- codec / format -------------------------------------------------------

class DeltaError(CkptDeltaError, ValueError):
    """An encoded tensor or delta object cannot be trusted or decoded."""


class FormatError(DeltaError):
    """Bytes that do not follow docs/FORMAT.md: bad magic, version, header or size field."""


class TruncatedError(FormatError):
    """A record, chunk or object is shorter than its header says."""


class ChecksumError(DeltaError):
    """A chunk payload, object or reconstructed tensor does not match its recorded digest."""


class ParentMismatchError(DeltaError):
    """A delta was applied to a tensor that is not the one it was encoded against."""


class GrandparentNeededError(DeltaError):
    """A record's chunks are coded against the tensor's version before its parent too (docs/FORMAT.md,
    encoding 6), and the caller did not pass it: rebuild that version, or take the anchor route."""


class GrandparentMismatchError(ParentMismatchError):
    """A record decoded against its right parent but another grandparent than it was encoded against."""


class UnsupportedDtypeError(CkptDeltaError, TypeError):
    """A tensor's dtype has no exact byte representation in the format."""


class ShapeMismatchError(DeltaError):
    """A live tensor's shape or dtype differs from what a delta expects."""


# --- storage --------------------------------------------------------------

class StorageError(CkptDeltaError, OSError):
    """A storage operation failed after retries; the message names the URL and key."""


class ObjectNotFoundError(StorageError, FileNotFoundError):
    """A key does not exist in the store."""


class ObjectTooLargeError(StorageError):
    """An object is larger than the limit its reader sets for it (a manifest, HEAD, RUN.json): refused before
    more than the limit is read."""


class ObjectExistsError(StorageError, FileExistsError):
    """A create-only write found the key already present."""


class InvalidKeyError(StorageError, ValueError):
    """A storage key is not a safe relative '/'-separated path (absolute, '..', '\\', NUL, empty segment)."""


class StorageURLError(StorageError, ValueError):
    """A URL no storage backend serves: an unknown protocol, a client library not installed, rejected options."""


# --- snapshots, manifests, runs --------------------------------------------

class ManifestError(DeltaError):
    """A manifest or head pointer fails schema, size or consistency checks."""


class SnapshotNotFoundError(CkptDeltaError, LookupError):
    """No committed snapshot matches the requested name or version."""


class ExactBitsMissingError(SnapshotNotFoundError):
    """A version has no exact attachment (``SnapshotReader.read_exact``): published without ``keep_exact``, its
    publisher stopped before writing it, or a reader is early (it lands just after the commit)."""


class RunMismatchError(CkptDeltaError, ValueError):
    """An object or snapshot belongs to a different run than the one expected."""


# --- publishing -------------------------------------------------------------

class PublishError(CkptDeltaError, RuntimeError):
    """A publish could not complete; nothing was committed."""


class ExactAttachError(PublishError):
    """A version's exact attachment (``Publisher(keep_exact=True)``) was not written. The version is committed
    and served; only its fp32 bits are missing. Raised once, by the next publish() (before it copies anything:
    that step is not published), ``wait_until_finished()`` or ``close()``."""


class ConcurrentPublisherError(PublishError):
    """Another publisher committed to the same run: refusing to fork it."""


class PublishInputError(PublishError, ValueError):
    """The weights handed to publish() cannot be published as given (meta tensors, bad step...)."""


class CollectiveError(PublishError):
    """A sharded publish's collective itself failed: another rank died, or stopped taking part for longer than
    the publishers' ``collective_timeout``. Nothing was committed; the publishers' group is of no further use."""


# --- loading / serving -------------------------------------------------------

class HotLoadError(CkptDeltaError, RuntimeError):
    """A hot-load failed; the live weights and policy version are unchanged."""


class HotLoadConflictError(HotLoadError):
    """A different hot-load is already running on this replica."""


class HotLoadCancelledError(HotLoadError):
    """The replica is stopping: a hot-load not begun, or still preparing, was dropped; the live weights and
    policy version are unchanged."""


class HotLoadTimeoutError(HotLoadError, TimeoutError):
    """Replicas did not reach the requested policy version in time."""


class PolicyVersionTimeoutError(HotLoadTimeoutError):
    """Replicas kept answering 408 (below the request's min_policy_version) past the ready timeout."""


class NotServableError(CkptDeltaError, ValueError):
    """A snapshot or model directory lacks what serving needs (config.json, a tokenizer, weights)."""


class ReplicaError(CkptDeltaError, RuntimeError):
    """A replica refused a request or could not be reached; the message names the replica and its answer."""


class SampleTimeoutError(ReplicaError, TimeoutError):
    """A replica took a sampling request but gave no answer within the client's ``sample_timeout``. Not sent
    again: the replica may still be generating it, and a second try would end the same way."""
