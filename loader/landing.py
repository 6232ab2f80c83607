"""A snapshot's delta objects fetched while its publisher still uploads them, used once its manifest names them.

A replica told to hot-load the version being published (``POST /v1/hotload`` with
``await_commit_s``) would otherwise wait for the commit, then fetch every part: on a
link of 1 Gbit/s a LoRA step's 50 MB are 0.4 s of waiting after the trainer's own
0.4 s of upload. Parts are written once, create-only in effect (each key names the
version and the publisher's attempt, docs/FORMAT.md), and appear whole in S3, GCS and
the local backend's rename, so a part listed under the version's delta prefix can be
fetched the moment it lands, while the next one uploads.

Nothing fetched here is trusted until the manifest that commits the version names it:
an object is used only where its size and xxh3 equal the manifest's entry
(:meth:`Landing.take`), and every piece cut from it is then checked again as any
fetched piece is. Objects of a racing publisher, or of a failed attempt at the same
version, land here too and are simply never named. What is held is bounded
(``max_bytes`` in all, ``max_object_bytes`` each); an object past the bounds is left
to the ordinary fetch after the commit.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from ckptdelta.delta.errors import HotLoadCancelledError, HotLoadTimeoutError, ObjectNotFoundError, StorageError
from ckptdelta.delta.manifest import ObjectRef, delta_prefix
from ckptdelta.delta.storage import Store
from ckptdelta.loader.fetch_units import xxh_hex

log = logging.getLogger("ckptdelta.loader")

#: Bytes of objects held for one version, at most; the rest is fetched after the commit. A LoRA step's delta
#: is tens of MB, a full model's tens to hundreds: most of it lands while the trainer uploads.
MAX_LANDING_BYTES = 2 << 30
#: One object's bytes, at most (a publisher's parts are 64 MiB at most: publisher/deltas.py).
MAX_OBJECT_BYTES = 256 << 20
#: The first pause between two looks at the store, and the longest: it grows with the wait (1/50 of it), so a
#: replica asked long before the commit does not list the bucket 100 times a second meanwhile.
FIRST_POLL_S = 0.01
MAX_POLL_S = 0.2


class Landing:
    """The delta objects of one uncommitted version that have landed so far (bytes not yet trusted)."""

    def __init__(self, store: Store, version: int, *, max_bytes: int = MAX_LANDING_BYTES,
                 max_object_bytes: int = MAX_OBJECT_BYTES) -> None:
        self.store, self.version = store, version
        self.prefix = delta_prefix(version, "")      # every writer's objects of ``version``
        self.max_bytes, self.max_object_bytes = max_bytes, max_object_bytes
        self._objects: dict[str, bytes] = {}
        self._verified: set[str] = set()
        self._skipped: set[str] = set()
        self._lock = threading.Lock()
        self.held_bytes = 0
        self.fetched_bytes = 0
        self.requests = 0

    def poll(self) -> int:
        """List the version's delta prefix once and fetch every object not seen yet; how many were fetched."""
        keys = self.store.list_prefix(self.prefix)
        self.requests += 1
        got = 0
        for key in keys:
            if key in self._objects or key in self._skipped:
                continue
            room = min(self.max_object_bytes, self.max_bytes - self.held_bytes)
            try:
                # one ranged read, at most one byte past the room: an object that fills it is too large
                data = self.store.get(key, (0, room + 1)) if room > 0 else None
            except ObjectNotFoundError:
                continue                       # listed, then gone (gc of a failed attempt): not ours to want
            except StorageError as e:
                log.debug("%s: not fetched ahead of the commit (%s); fetched after it if the manifest names it",
                          self.store.key_url(key), e)
                data = None
            self.requests += 1
            if data is None or len(data) > room:
                self._skipped.add(key)
                continue
            with self._lock:
                self._objects[key] = data
                self.held_bytes += len(data)
                self.fetched_bytes += len(data)
            got += 1
        return got

    def take(self, obj: ObjectRef) -> bytes | None:
        """The landed bytes of ``obj`` if they are exactly what its manifest entry says (size and xxh3), else
        None (and the bytes are dropped: the ordinary fetch reads the object again)."""
        with self._lock:
            data = self._objects.get(obj.key)
            if data is None:
                return None
            if obj.key in self._verified:
                return data
            if len(data) == obj.size and xxh_hex(data) == obj.xxh3:
                self._verified.add(obj.key)
                return data
            del self._objects[obj.key]
            self.held_bytes -= len(data)
        log.warning("%s: the bytes fetched before the commit (%d) do not match the manifest's entry (%d bytes, "
                    "xxh3 %s); fetching the object again", self.store.key_url(obj.key), len(data), obj.size,
                    obj.xxh3)
        return None


def await_commit(landing: Landing, committed: Callable[[], bool], timeout_s: float,
                 cancelled: Callable[[], str | None] = lambda: None) -> float:
    """Fetch ``landing``'s objects as they land until ``committed()`` says the version's manifest exists;
    the seconds waited. Raises HotLoadTimeoutError past ``timeout_s``, HotLoadCancelledError (with
    ``cancelled()``'s reason) once that says why to stop."""
    t0 = time.monotonic()
    while True:
        why = cancelled()
        if why is not None:
            raise HotLoadCancelledError(why)
        if committed():
            return time.monotonic() - t0
        fetched = landing.poll()
        waited = time.monotonic() - t0
        if waited > timeout_s:
            raise HotLoadTimeoutError(f"snapshot version {landing.version} was not committed within {timeout_s:g} s")
        if not fetched:
            time.sleep(min(MAX_POLL_S, FIRST_POLL_S + waited / 50))
