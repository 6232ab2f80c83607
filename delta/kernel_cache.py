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
``delta/*.py`` and of the function's own file, so a change to any of them
recompiles (once: ``python -m delta.warmup`` does it at install). Functions of
other packages are left to numba's own locators. ``NUMBA_CACHE_LOCATOR_CLASSES``,
when set, replaces numba's list and this one with it.
"""

from __future__ import annotations

import hashlib
import os
from functools import lru_cache

from numba.core import caching

# CacheImpl in the numba this project locks (0.65), _CacheImpl in older releases
_IMPL = getattr(caching, "CacheImpl", None) or getattr(caching, "_CacheImpl")
_DELTA = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(_DELTA)
#: The project's packages whose numba functions may call the codec's kernels.
PACKAGES = ("delta", "publisher", "loader", "benchmarks")


@lru_cache(maxsize=None)
def _digest_of(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


@lru_cache(maxsize=None)
def delta_digest() -> str:
    """A digest of every source file of the delta package, by name and content."""
    h = hashlib.sha256()
    for name in sorted(os.listdir(_DELTA)):
        if name.endswith(".py"):
            h.update(f"{name}\0{_digest_of(os.path.join(_DELTA, name))}\0".encode())
    return h.hexdigest()


def _ours(py_file: str) -> bool:
    path = os.path.abspath(py_file)
    return any(os.path.dirname(path) == os.path.join(_ROOT, p) for p in PACKAGES)


class SourcesLocator(caching._CacheLocator):
    """Numba's own choice of cache directory, with the sources' digest as the stamp of freshness."""

    def __init__(self, inner: caching._CacheLocator, py_file: str) -> None:
        self._inner = inner
        self._py_file = os.path.abspath(py_file)

    def ensure_cache_path(self) -> None:
        self._inner.ensure_cache_path()

    def get_cache_path(self) -> str:
        return self._inner.get_cache_path()

    def get_source_stamp(self) -> tuple[str, str, str]:
        return ("ckptdelta-sources", delta_digest(), _digest_of(self._py_file))

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
                    return cls(inner, py_file)
        return None


def install() -> None:
    """Make :class:`SourcesLocator` numba's first choice (before any of the project's kernels is defined)."""
    classes = _IMPL._locator_classes
    if SourcesLocator not in classes:
        classes.insert(0, SourcesLocator)
