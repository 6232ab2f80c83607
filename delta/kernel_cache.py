"""Numba's on-disk cache of the project's kernels, kept fresh by every source file they may compile in.

Why: numba stamps a cached kernel with the modification time and size of the one
file that defines it, but a kernel compiles into itself every kernel it calls,
from other files too (the pause's OpenMP entry in commit_team.py holds
commit_ranges.py's loop and kernels.commit_task). After an upgrade that changed
only a callee's file, the caller's cache entry still matches its own file and
numba loads the old callee's machine code: a new commit mode would then run as
an old one, and an undo would no longer undo.

:func:`install` puts :class:`SourcesLocator` first among numba's cache locators.
For a function defined in this project's packages it keeps the directory numba
would have chosen (``NUMBA_CACHE_DIR``, the ``__pycache__`` beside the file, or
the user-wide cache) and stamps the entry with a digest of the contents of every
``delta/**/*.py`` and of the function's own file, so a change to any of them
recompiles (once: ``python -m delta.warmup`` does it at install). Functions of
other packages are left to numba's own locators, and so is a zip or frozen
install, where numba stamps the archive itself. ``NUMBA_CACHE_LOCATOR_CLASSES``,
when set, replaces numba's list and this one with it (a warning says so).
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
from functools import lru_cache

from numba.core import caching

log = logging.getLogger("ckptdelta.kernel_cache")

# numba's own (private) names: CacheImpl in the numba this project locks (0.65), _CacheImpl in older releases.
# Where they are missing, install() warns and leaves numba's locators as they are.
_IMPL = getattr(caching, "CacheImpl", None) or getattr(caching, "_CacheImpl", None)
_BASE = getattr(caching, "_CacheLocator", None)
_DELTA = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_DELTA)
#: The project's packages whose numba functions may call the codec's kernels (their subfolders too).
PACKAGES = ("delta", "publisher", "loader", "benchmarks")


@lru_cache(maxsize=None)
def _digest_of(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@lru_cache(maxsize=None)
def delta_digest() -> str:
    """A digest of every source file of the delta package and its subpackages (delta/encodings/: a kernel
    may call into whatever an encoding module passes it), by path and content (editors' lock files and
    other names starting with a dot, ``__pycache__``, and anything not a regular file, left out)."""
    h = hashlib.sha256()
    for name in _sources(_DELTA):
        h.update(f"{name}\0{_digest_of(os.path.join(_DELTA, name))}\0".encode())
    return h.hexdigest()


def _sources(root: str, prefix: str = "") -> list[str]:
    """The ``.py`` files under ``root``, as paths relative to it ("/"-separated), in sorted order."""
    out = []
    for name in sorted(os.listdir(os.path.join(root, prefix))):
        rel = prefix + name
        path = os.path.join(root, rel)
        if name.startswith(".") or name == "__pycache__":
            continue
        if os.path.isdir(path) and not os.path.islink(path):
            out += _sources(root, rel + "/")
        elif name.endswith(".py") and os.path.isfile(path):
            out.append(rel)
    return out


def _ours(py_file: str) -> bool:
    path = os.path.abspath(py_file)
    return any(path.startswith(os.path.join(_ROOT, p) + os.sep) for p in PACKAGES)


class SourcesLocator(_BASE or object):
    """Numba's own choice of cache directory, with the sources' digest as the stamp of freshness."""

    def __init__(self, inner, py_file: str) -> None:   # noqa: ANN001 - one of numba's locators
        self._inner = inner
        self._py_file = os.path.abspath(py_file)    # numba reads it (caching.CacheImpl.filename_base)

    def ensure_cache_path(self) -> None:
        self._inner.ensure_cache_path()

    def get_cache_path(self) -> str:
        return self._inner.get_cache_path()

    def get_source_stamp(self) -> tuple:
        try:
            return ("ckptdelta-sources", delta_digest(), _digest_of(self._py_file))
        except OSError:      # a source not readable as a file after all: numba's own stamp
            return self._inner.get_source_stamp()

    def get_disambiguator(self) -> str:
        return self._inner.get_disambiguator()

    @classmethod
    def from_function(cls, py_func, py_file):   # noqa: ANN001, ANN206 - numba's signature
        if not _ours(py_file):
            return None
        for other in _IMPL._locator_classes:
            if other is not cls:
                inner = other.from_function(py_func, py_file)
                if inner is not None:
                    # in a zip or a frozen executable numba stamps the archive itself, which covers every callee
                    if getattr(sys, "frozen", False) or type(inner).__name__ == "ZipCacheLocator" or \
                            not os.path.isdir(_DELTA):
                        return inner
                    return cls(inner, py_file)
        return None


def install() -> None:
    """Make :class:`SourcesLocator` numba's first choice (before any of the project's kernels is defined)."""
    classes = getattr(_IMPL, "_locator_classes", None)
    if _BASE is None or not isinstance(classes, list):
        log.warning("numba %s has no cache locator list this project knows: its kernels' cache entries are "
                    "stamped by their own file only; after upgrading ckptdelta, delete the __pycache__ folders "
                    "of delta/, loader/, publisher/ (or set NUMBA_CACHE_DIR to a new folder)",
                    getattr(sys.modules.get("numba"), "__version__", "?"))
        return
    if os.environ.get("NUMBA_CACHE_LOCATOR_CLASSES"):
        log.warning("NUMBA_CACHE_LOCATOR_CLASSES is set: numba uses those locators, and the project's kernels' "
                    "cache entries are stamped by their own file only (after an upgrade, clear that cache)")
    if SourcesLocator not in classes:
        classes.insert(0, SourcesLocator)
