"""Numba's on-disk cache of the project's kernels, kept fresh by every source file they may compile in.

Why: numba stamps a cached kernel with the modification time and size of the one
file that defines it, but a kernel compiles into itself every kernel it calls,
from other files too (the pause's OpenMP entry in commit_team.py holds
commit_ranges.py's loop and kernels.commit_task). After an upgrade that changed
only a callee's file, the caller's cache entry still matches its own file and
numba loads the old callee's machine code: a new commit mode would then run as
an old one, and an undo would no longer undo.

:func:`install` puts :class:`SourcesLocator` first among numba's cache locators.
For a function defined in this project's packages it stamps the entry with a
digest of the contents of every ``delta/**/*.py`` and of the function's own file,
so a change to any of them recompiles (once: ``ckptdelta warmup`` does it at
install).

Where: never beside the sources. numba keeps one index file per function, and an
index written by another numba version (or llvmlite, or for another CPU) is
thrown away and rewritten: a trainer's venv and a replica's venv on one checkout
(or one shared filesystem) would recompile each other's kernels on every switch,
20-30 s each time. So the entries live under
``$CKPTDELTA_KERNEL_CACHE`` (default ``$XDG_CACHE_HOME/ckptdelta/kernels``, or
``~/.cache/...``) in a folder per :func:`environment_key` (Python, numba, llvmlite,
CPU name and features), each environment compiling once, ever. A
``NUMBA_CACHE_DIR`` the user set is respected as it is; a root that cannot be
written falls back to numba's own choice, with one warning.

The first compile in a process whose environment was never warmed up
(:func:`mark_warm`, written by a completed warm-up) logs one INFO line: what
compiles, about how long, where it goes, and that ``ckptdelta warmup`` does it
ahead. Functions of
other packages are left to numba's own locators, and so is a zip or frozen
install, where numba stamps the archive itself. ``NUMBA_CACHE_LOCATOR_CLASSES``,
when set, replaces numba's list and this one with it (a warning says so).
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
from collections.abc import Mapping
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
#: The root of the project's kernel cache (one folder per environment under it).
ENV = "CKPTDELTA_KERNEL_CACHE"


@lru_cache(maxsize=None)
def _host_cpu() -> tuple[str, str]:
    """The host's CPU name and features, as llvmlite reports them (not free: asked once, not once per kernel)."""
    import llvmlite.binding as ll

    return ll.get_host_cpu_name(), ll.get_host_cpu_features().flatten()


def environment() -> dict[str, str]:
    """What numba's machine code depends on besides the sources: a cache entry of another of any of these is
    thrown away by numba (and its index rewritten). The CPU is the one numba compiles for: ``NUMBA_CPU_NAME``
    and ``NUMBA_CPU_FEATURES`` when set (``generic`` for a cache shared by several kinds of host), else the
    host's, as llvmlite reports it."""
    import llvmlite
    import numba
    from numba.core import config

    if config.CPU_NAME:
        cpu, features = config.CPU_NAME, config.CPU_FEATURES or ""
    else:
        cpu, features = _host_cpu()
    return {"python": "%d.%d" % sys.version_info[:2] + getattr(sys, "abiflags", ""),
            "numba": numba.__version__, "llvmlite": llvmlite.__version__, "cpu": cpu, "features": features}


def environment_key(env: Mapping[str, str] | None = None) -> str:
    """The folder of one environment's kernels: readable parts, and a short hash of the CPU's features
    (a long list, which differs between hosts of one CPU name with features turned off)."""
    e = environment() if env is None else env
    features = hashlib.sha256(e["features"].encode()).hexdigest()[:12]
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in e["cpu"]) or "cpu"
    return f"py{e['python']}-numba{e['numba']}-llvmlite{e['llvmlite']}-{safe}-{features}"


def cache_root() -> str:
    """Where the project's kernels of every environment go, unless ``NUMBA_CACHE_DIR`` says otherwise."""
    root = os.environ.get(ENV)
    if not root:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(base, "ckptdelta", "kernels")
    return os.path.abspath(root)


def _user_dir() -> str | None:
    from numba.core import config

    return os.path.abspath(config.CACHE_DIR) if config.CACHE_DIR else None


def kernel_dir() -> str:
    """This environment's folder of kernels (``NUMBA_CACHE_DIR``, when set, is the user's choice: it is used
    as it is, and then the environments that share it are the user's to keep apart)."""
    return _user_dir() or os.path.join(cache_root(), environment_key())


def _marker() -> str:
    """Per environment, sources and checkout (numba files each source folder's kernels apart, by its path)."""
    where = hashlib.sha256(_DELTA.encode()).hexdigest()[:12]
    return os.path.join(kernel_dir(), f"warm-{environment_key()}-{where}-{delta_digest()[:16]}")


def is_warm() -> bool:
    """Whether a warm-up completed in this environment for these sources (then nothing should compile)."""
    try:
        return os.path.isfile(_marker())
    except OSError:
        return False


def mark_warm() -> None:
    """Record that every kernel of this environment and these sources is compiled (a warm-up completed)."""
    try:
        os.makedirs(kernel_dir(), exist_ok=True)
        with open(_marker(), "w") as f:
            f.write(environment_key() + "\n")
    except OSError as e:
        log.debug("cannot write the warm-up marker: %s", e)


_announce_lock = threading.Lock()
_announced = False
_fallback_warned = False


def quiet() -> None:
    """No announcement in this process (a warm-up reports its own progress)."""
    global _announced
    _announced = True


def _announce(what: str) -> None:
    """One INFO line, on the first kernel a process compiles in an environment never warmed up: without it a
    first publish or hot-load is silent while it compiles (benchmarks/kernel_envs.py measures how long)."""
    global _announced
    with _announce_lock:
        if _announced:
            return
        _announced = True
    if is_warm():
        return
    log.info("compiling the codec's numba kernels for this environment (first: %s): tens of seconds on "
             "first use, once; cached in %s. `ckptdelta warmup` compiles them ahead (in a Dockerfile: "
             "RUN ckptdelta warmup)", what, kernel_dir())


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

    def __init__(self, inner, py_file: str, cache_path: str | None = None) -> None:   # noqa: ANN001
        self._inner = inner
        self._py_file = os.path.abspath(py_file)    # numba reads it (caching.CacheImpl.filename_base)
        self._cache_path = cache_path or inner.get_cache_path()

    def ensure_cache_path(self) -> None:
        if self._cache_path == self._inner.get_cache_path():
            self._inner.ensure_cache_path()
        else:
            _BASE.ensure_cache_path(self)

    def get_cache_path(self) -> str:
        return self._cache_path

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
                    return cls._placed(inner, py_file)
        return None

    @classmethod
    def _placed(cls, inner, py_file: str) -> SourcesLocator:   # noqa: ANN001
        """In this environment's folder (one subfolder per source folder, as numba names them), unless the
        user chose NUMBA_CACHE_DIR or that folder cannot be written."""
        global _fallback_warned
        if _user_dir() is not None:
            return cls(inner, py_file)
        here = os.path.join(kernel_dir(), _BASE.get_suitable_cache_subpath(py_file))
        ours = cls(inner, py_file, here)
        try:
            ours.ensure_cache_path()
            return ours
        except OSError as e:
            if not _fallback_warned:
                _fallback_warned = True
                log.warning("cannot write the kernel cache under %s (%s): numba caches the project's kernels "
                            "in %s instead (set %s to a writable folder)", cache_root(), e,
                            inner.get_cache_path(), ENV)
            return cls(inner, py_file)


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
    load = getattr(caching.Cache, "load_overload", None)
    if load is not None and not getattr(load, "_ckptdelta", False):
        def load_overload(self, sig, target_context):   # noqa: ANN001, ANN202 - numba's signature
            found = load(self, sig, target_context)
            if found is None and not _announced and \
                    isinstance(getattr(getattr(self, "_impl", None), "locator", None), SourcesLocator):
                _announce(getattr(self._py_func, "__qualname__", self._name))   # a miss: a compile follows
            return found
        load_overload._ckptdelta = True
        caching.Cache.load_overload = load_overload
