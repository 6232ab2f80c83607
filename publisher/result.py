"""What a publish returns: the committed snapshot and where the time went."""

from __future__ import annotations

from dataclasses import dataclass

from ckptdelta.delta.manifest import Kind


@dataclass(frozen=True)
class PublishResult:
    """A committed snapshot, as this publish saw it. Seconds are wall-clock; encode and upload overlap for anchors."""

    version: int
    name: str
    kind: Kind
    parent_version: int | None
    anchor_version: int
    step: int
    stored_bytes: int          # bytes this snapshot wrote (data objects, extra files; not the manifest)
    full_bytes: int            # sum of the tensors' sizes
    ratio: float               # the weights' stored bytes (stored_bytes - extra_bytes) / full_bytes: 0.017 = 1.7%
    copy_s: float              # weights -> host copy, in the caller's thread
    encode_s: float            # delta encoding, or anchor serialization (this rank)
    upload_s: float            # first upload start -> last upload end (this rank)
    commit_s: float            # index, manifest and HEAD (rank 0)
    total_s: float             # publish() call -> committed
    n_changed_tensors: int     # tensors with bytes in this snapshot (all of them for an anchor)
    n_tensors: int
    reason: str                # why an anchor or a delta
    extra_bytes: int = 0       # of stored_bytes, the extra files (config, tokenizer) an anchor wrote
    schema_change: str = ""    # tensors added, removed or with a new dtype/shape since the previous snapshot:
                               # replicas on the old tensors cannot hot-load this one (docs/PUBLISHING.md)
    codec: str = ""            # a delta's codec on this rank: "context" or "fast" (Publisher(codec=...)); anchor: ""
    codec_reason: str = ""     # why: "fixed: ...", or codec="auto"'s prediction of both ("auto: predicted ...")
    encode_threads: int = 0    # the threads this rank's delta encode ran on (Publisher(encode_threads=...), or one
                               # per 16 MiB of the step's tensors, at most every core); anchor: 0
