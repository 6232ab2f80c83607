"""loader/: the replica side. Read any committed snapshot of a run, bit-exact, and hot-swap live weights.

:class:`SnapshotReader` resolves, fetches (byte ranges, optional shared disk cache),
verifies and materializes snapshots; :class:`HotSwapper` moves a serving model
between versions with one short pause behind a :class:`ServingGate`.
"""

from .cache import DiskCache
from .hotswap import HotLoadReport, HotSwapper, Pause, PreparedUpdate, ServingGate
from .reader import SnapshotReader, VerifyReport

__all__ = ["DiskCache", "HotLoadReport", "HotSwapper", "Pause", "PreparedUpdate", "ServingGate", "SnapshotReader",
           "VerifyReport"]
