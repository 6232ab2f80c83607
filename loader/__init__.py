"""loader/: the replica side. Read any committed snapshot of a run, bit-exact, and hot-swap live weights.

:class:`SnapshotReader` resolves, fetches (byte ranges, optional shared disk cache),
verifies and materializes snapshots; :class:`HotSwapper` moves a serving model
between versions with one short pause behind a :class:`ServingGate`.
"""

if __name__ != "ckptdelta.loader":   # a checkout's root on sys.path would give every module a second copy
    raise ImportError(f"this package is ckptdelta.loader; import it under that name, not as {__name__!r}")

from ckptdelta.loader.cache import DiskCache
from ckptdelta.loader.hotswap import HotLoadReport, HotSwapper, PreparedUpdate
from ckptdelta.loader.gate import Pause, ServingGate
from ckptdelta.loader.reader import SnapshotReader
from ckptdelta.loader.verify import HeadPointerError, VerifyReport

__all__ = ["DiskCache", "HeadPointerError", "HotLoadReport", "HotSwapper", "Pause", "PreparedUpdate", "ServingGate",
           "SnapshotReader", "VerifyReport"]
