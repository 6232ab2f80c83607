"""Numba's cache of the project's kernels is stamped by every source they may compile in (delta/kernel_cache.py).

numba stamps a cached function with its own file only; a kernel that calls one of
another file would load its old machine code after that file changed. These tests
run real processes over a copy of the delta package with a cache directory of their
own, and change the callee's file between them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np

import delta
from delta import kernel_cache

PROBE = textwrap.dedent('''
    """A cached kernel that compiles in one of kernels.py's."""
    import numpy as np
    from numba import njit

    from . import kernels


    @njit(cache=True)
    def probe(live, positions, values):
        kernels.scatter(live, positions, values)
        return live.sum()
''')

RUN = textwrap.dedent('''
    import numpy as np
    from delta import _probe
    live = np.zeros(8, np.uint16)
    _probe.probe(live, np.array([1, 3], np.int64), np.array([5, 7], np.uint16))
    s = _probe.probe.stats
    print(''.join(map(str, live.tolist())), sum(s.cache_hits.values()), sum(s.cache_misses.values()))
''')


def _copy_of_delta(tmp_path) -> str:
    root = tmp_path / "project"
    shutil.copytree(os.path.dirname(delta.__file__), root / "delta",
                    ignore=shutil.ignore_patterns("__pycache__", ".*"))
    (root / "delta" / "_probe.py").write_text(PROBE)
    os.symlink("user@host.1234:1700000000", root / "delta" / ".#kernels.py")   # an editor's lock file, dangling
    return str(root)


def _run(root: str, cache: str) -> tuple[str, int, int]:
    env = {**os.environ, "PYTHONPATH": root, "NUMBA_CACHE_DIR": cache, "CKPTDELTA_WARMUP": "0"}
    env.pop("NUMBA_CACHE_LOCATOR_CLASSES", None)
    out = subprocess.run([sys.executable, "-c", RUN], cwd=root, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    values, hits, misses = out.stdout.strip().rsplit(" ", 2)
    return values, int(hits), int(misses)


def test_a_cached_kernel_is_compiled_again_when_a_kernel_it_calls_changes_in_another_file(tmp_path):
    root, cache = _copy_of_delta(tmp_path), str(tmp_path / "numba-cache")
    first = _run(root, cache)
    assert first[1:] == (0, 1)                                  # compiled, and cached
    assert _run(root, cache)[1:] == (1, 0)                      # loaded from the cache
    kernels_py = os.path.join(root, "delta", "kernels.py")
    with open(kernels_py, "a") as f:                            # the callee's file changes, the probe's does not
        f.write("\n# an upgrade\n")
    again = _run(root, cache)
    assert again[1:] == (0, 1), "the probe's cache entry survived a change to kernels.py"
    assert again[0] == first[0] == "05070000"
    assert _run(root, cache)[1:] == (1, 0)
    os.unlink(os.path.join(root, "delta", ".#kernels.py"))     # the digest never read it: still fresh
    assert _run(root, cache)[1:] == (1, 0)


def test_a_cached_kernel_is_compiled_again_when_a_module_of_the_encodings_subpackage_changes(tmp_path):
    """delta/encodings/ holds the glue that passes the kernels their arguments; its files stamp the cache too."""
    root, cache = _copy_of_delta(tmp_path), str(tmp_path / "numba-cache")
    assert _run(root, cache)[1:] == (0, 1)
    assert _run(root, cache)[1:] == (1, 0)
    with open(os.path.join(root, "delta", "encodings", "sparse.py"), "a") as f:
        f.write("\n# an upgrade\n")
    again = _run(root, cache)
    assert again[1:] == (0, 1), "the probe's cache entry survived a change to delta/encodings/sparse.py"
    assert again[0] == "05070000"
    os.makedirs(os.path.join(root, "delta", "encodings", "__pycache__"), exist_ok=True)
    with open(os.path.join(root, "delta", "encodings", "__pycache__", "stale.py"), "w") as f:
        f.write("# not a source\n")                            # bytecode folders are not sources
    assert _run(root, cache)[1:] == (1, 0)


def test_the_sources_locator_takes_only_the_project_s_functions_and_keeps_numba_s_directory():
    from delta import kernels

    f = kernels.scatter.py_func
    ours = kernel_cache.SourcesLocator.from_function(f, kernels.__file__)
    assert ours is not None and ours.get_source_stamp()[1] == kernel_cache.delta_digest()
    theirs = next(loc for loc in (c.from_function(f, kernels.__file__) for c in kernel_cache._IMPL._locator_classes
                                  if c is not kernel_cache.SourcesLocator) if loc is not None)
    assert ours.get_cache_path() == theirs.get_cache_path()
    assert ours.get_disambiguator() == theirs.get_disambiguator()
    assert kernel_cache.SourcesLocator.from_function(lambda: None, np.__file__) is None   # numpy's: not ours
    from loader.engines import vllm_worker
    from publisher import nan

    for mod in (nan, vllm_worker):                              # another package, and a subfolder
        assert kernel_cache._ours(mod.__file__), mod
    assert kernel_cache._IMPL._locator_classes[0] is kernel_cache.SourcesLocator
    assert isinstance(kernels.scatter._cache._impl.locator, kernel_cache.SourcesLocator)
