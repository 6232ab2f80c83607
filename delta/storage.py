"""One small key -> bytes interface over fsspec, so publisher/ and loader/ never see a backend.

Keys are '/'-separated paths relative to the run's root URL. Everything above this
module speaks in keys; only this module knows about fsspec filesystems, their
error types and how each backend makes a create-only write.
"""

from __future__ import annotations

# INTERFACE (implemented by the storage work item; see tests/test_storage.py):
#
# class Store:
#     url: str                                   # root URL, e.g. "file:///x", "s3://b/run", "gs://b/run", "memory://run"
#     atomic_create: bool                        # True when put_if_absent is enforced by the backend
#     @classmethod
#     def from_url(cls, url: str, storage_options: dict | None = None) -> "Store"
#     def get(self, key: str, byte_range: tuple[int, int] | None = None, *, max_size: int | None = None) -> bytes
#         # byte_range = (start, end) half-open; raises ObjectNotFoundError; raises FormatError/ManifestError? no:
#         # raises StorageError if the object is larger than max_size (checked via size() before reading)
#     def get_many(self, keys_and_ranges: list[tuple[str, tuple[int,int] | None]]) -> list[bytes]   # parallel
#     def size(self, key: str) -> int
#     def put(self, key: str, data: bytes | memoryview) -> None          # overwrite allowed; atomic visibility
#     def put_if_absent(self, key: str, data: bytes) -> None             # raises ObjectExistsError if present
#     def put_file(self, key: str, local_path: str) -> None              # large objects, multipart where supported
#     def exists(self, key: str) -> bool
#     def delete(self, keys: list[str]) -> None                           # missing keys ignored
#     def list_prefix(self, prefix: str) -> list[str]                     # keys (relative) under prefix, recursive, sorted
#     def info(self, key) -> dict with at least "size" and "mtime" (float seconds, may be None)
#
# Transient errors (throttling, 5xx, resets, timeouts) are retried with exponential backoff and
# jitter (RetryPolicy dataclass: attempts=6, base=0.1s, max=5s); after the last attempt a StorageError
# naming url/key is raised. fsspec not-found errors become ObjectNotFoundError where they enter.
