"""Numba's cache of the project's kernels is stamped by every source they may compile in, and kept per
environment (delta/kernel_cache.py).

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

from ckptdelta import delta
from ckptdelta.delta import kernel_cache

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
    from ckptdelta.delta import _probe
    live = np.zeros(8, np.uint16)
    _probe.probe(live, np.array([1, 3], np.int64), np.array([5, 7], np.uint16))
    s = _probe.probe.stats
    print(''.join(map(str, live.tolist())), sum(s.cache_hits.values()), sum(s.cache_misses.values()))
''')


def _copy_of_delta(tmp_path) -> str:
    root = tmp_path / "project"
    (root / "ckptdelta").mkdir(parents=True)
    (root / "ckptdelta" / "__init__.py").write_text("")
    shutil.copytree(os.path.dirname(delta.__file__), root / "ckptdelta" / "delta",
                    ignore=shutil.ignore_patterns("__pycache__", ".*"))
    (root / "ckptdelta" / "delta" / "_probe.py").write_text(PROBE)
    os.symlink("user@host.1234:1700000000", root / "ckptdelta" / "delta" / ".#kernels.py")   # an editor's lock file, dangling
    return str(root)


def _run(root: str, cache: str | None, prelude: str = "", **env_vars: str) -> tuple[str, int, int]:
    """Run the probe in a fresh process: its values, and numba's cache hits and misses. ``cache``: the
    NUMBA_CACHE_DIR, or None for none (then the project's own kernel cache, under ``env_vars``' root)."""
    return _run_logged(root, cache, prelude, **env_vars)[0]


def _run_logged(root: str, cache: str | None, prelude: str = "", **env_vars: str) -> tuple[tuple[str, int, int], str]:
    env = {**os.environ, "PYTHONPATH": root, "CKPTDELTA_WARMUP": "0"}
    for name in ("NUMBA_CACHE_LOCATOR_CLASSES", "NUMBA_CACHE_DIR", kernel_cache.ENV):   # the user's own, if set
        env.pop(name, None)
    env.update(env_vars)
    if cache is not None:
        env["NUMBA_CACHE_DIR"] = cache
    code = "import logging; logging.basicConfig(level=logging.INFO)\n" + prelude + RUN
    out = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    values, hits, misses = out.stdout.strip().rsplit(" ", 2)
    return (values, int(hits), int(misses)), out.stderr


#: Run as another numba would, as far as numba's cache can tell: its index files carry numba.__version__, and
#: an index of another version is thrown away and written again (what a trainer's venv and a replica's venv
#: on one checkout did to each other's kernels).
OTHER_NUMBA = "import numba; numba.__version__ = '0.64.0'\n"


def _index_files(path) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs
                  if f.endswith(".nbi"))


def test_a_cached_kernel_is_compiled_again_when_a_kernel_it_calls_or_a_module_of_the_encodings_subpackage_changes(
        tmp_path):
    """Every source file of delta/ stamps the cache: the file of a kernel the probe calls (not the probe's own),
    and delta/encodings/, which holds the glue that passes the kernels their arguments. One copy of delta/ and
    one cache for both changes, each compiling again once and loading after."""
    root, cache = _copy_of_delta(tmp_path), str(tmp_path / "numba-cache")
    first = _run(root, cache)
    assert first[1:] == (0, 1)                                  # compiled, and cached
    assert _run(root, cache)[1:] == (1, 0)                      # loaded from the cache
    kernels_py = os.path.join(root, "ckptdelta", "delta", "kernels.py")
    with open(kernels_py, "a") as f:                            # the callee's file changes, the probe's does not
        f.write("\n# an upgrade\n")
    again = _run(root, cache)
    assert again[1:] == (0, 1), "the probe's cache entry survived a change to kernels.py"
    assert again[0] == first[0] == "05070000"
    assert _run(root, cache)[1:] == (1, 0)
    os.unlink(os.path.join(root, "ckptdelta", "delta", ".#kernels.py"))     # the digest never read it: still fresh
    assert _run(root, cache)[1:] == (1, 0)
    with open(os.path.join(root, "ckptdelta", "delta", "encodings", "sparse.py"), "a") as f:
        f.write("\n# an upgrade\n")
    again = _run(root, cache)
    assert again[1:] == (0, 1), "the probe's cache entry survived a change to delta/encodings/sparse.py"
    assert again[0] == "05070000"
    os.makedirs(os.path.join(root, "ckptdelta", "delta", "encodings", "__pycache__"), exist_ok=True)
    with open(os.path.join(root, "ckptdelta", "delta", "encodings", "__pycache__", "stale.py"), "w") as f:
        f.write("# not a source\n")                           # bytecode folders are not sources
    assert _run(root, cache)[1:] == (1, 0)


def test_the_sources_locator_takes_only_the_project_s_functions_and_keeps_numba_s_directory():
    from ckptdelta.delta import kernels

    f = kernels.scatter.py_func
    ours = kernel_cache.SourcesLocator.from_function(f, kernels.__file__)
    assert ours is not None and ours.get_source_stamp()[1] == kernel_cache.delta_digest()
    theirs = next(loc for loc in (c.from_function(f, kernels.__file__) for c in kernel_cache._IMPL._locator_classes
                                  if c is not kernel_cache.SourcesLocator) if loc is not None)
    if kernel_cache._user_dir() is not None:                    # NUMBA_CACHE_DIR: the user's, as it is
        assert ours.get_cache_path() == theirs.get_cache_path()
    else:                                                       # this environment's folder, named as numba would
        assert ours.get_cache_path() == os.path.join(kernel_cache.kernel_dir(),
                                                     kernel_cache._BASE.get_suitable_cache_subpath(kernels.__file__))
    assert ours.get_disambiguator() == theirs.get_disambiguator()
    assert kernel_cache.SourcesLocator.from_function(lambda: None, np.__file__) is None   # numpy's: not ours
    from ckptdelta.loader.engines.vllm.worker import extension as vllm_worker
    from ckptdelta.publisher import nan

    for mod in (nan, vllm_worker):                              # another package, and a subfolder
        assert kernel_cache._ours(mod.__file__), mod
    assert kernel_cache._IMPL._locator_classes[0] is kernel_cache.SourcesLocator
    assert isinstance(kernels.scatter._cache._impl.locator, kernel_cache.SourcesLocator)


def test_the_environment_key_differs_with_python_numba_llvmlite_cpu_name_and_cpu_features(monkeypatch):
    import llvmlite
    import numba

    here = kernel_cache.environment()
    key = kernel_cache.environment_key(here)
    assert kernel_cache.environment_key() == key and kernel_cache.environment_key(dict(here)) == key
    for field, other in (("python", "3.12"), ("numba", "0.68.1"), ("llvmlite", "0.46.0"), ("cpu", "skylake-avx512"),
                         ("features", here["features"].replace("+avx2", "-avx2") + ",-foo")):
        assert kernel_cache.environment_key({**here, field: other}) != key, field
    monkeypatch.setattr(numba, "__version__", "0.64.0")           # read from the modules themselves
    assert kernel_cache.environment()["numba"] == "0.64.0" and kernel_cache.environment_key() != key
    monkeypatch.setattr(llvmlite, "__version__", "0.1.0")
    assert "llvmlite0.1.0" in kernel_cache.environment_key()
    assert kernel_cache.environment_key({**here, "cpu": "a/b c"}).count("/") == 0     # one folder, whatever the CPU


def test_two_environments_with_another_numba_on_one_checkout_compile_once_each_and_never_evict_each_other(tmp_path):
    """The issue's trainer venv and replica venv, alternating on one checkout: each compiles once, ever; their
    kernels go to per-environment folders of the user's cache, nothing beside the sources."""
    root, xdg = _copy_of_delta(tmp_path), str(tmp_path / "xdg")
    runs = [_run(root, None, prelude, XDG_CACHE_HOME=xdg) for prelude in ("", OTHER_NUMBA) * 2]
    assert [r[1:] for r in runs] == [(0, 1), (0, 1), (1, 0), (1, 0)], runs
    assert {r[0] for r in runs} == {"05070000"}
    folders = sorted(os.listdir(os.path.join(xdg, "ckptdelta", "kernels")))
    assert len(folders) == 2 and sum("numba0.64.0" in f for f in folders) == 1, folders
    assert _index_files(root) == [], "numba wrote the kernel cache beside the sources"
    a, b = (_index_files(os.path.join(xdg, "ckptdelta", "kernels", f)) for f in folders)
    assert a == b and any("_probe.probe" in f for f in a), (a, b)      # each environment its own index files


def test_the_kernel_cache_root_comes_from_its_environment_variable_and_numba_cache_dir_wins(tmp_path):
    root = _copy_of_delta(tmp_path)
    mine, numba_dir = str(tmp_path / "mine"), str(tmp_path / "numba-cache")
    assert _run(root, None, **{kernel_cache.ENV: mine})[1:] == (0, 1)
    assert _run(root, None, **{kernel_cache.ENV: mine})[1:] == (1, 0)
    ours = _index_files(mine)
    assert ours and {p.split(os.sep)[0] for p in ours} == {kernel_cache.environment_key()}
    assert _run(root, numba_dir, **{kernel_cache.ENV: mine})[1:] == (0, 1)     # the user's choice: as it is
    assert _index_files(numba_dir) and _index_files(mine) == ours


def test_the_first_compile_in_an_environment_never_warmed_up_is_announced_once(tmp_path):
    root, cache = _copy_of_delta(tmp_path), str(tmp_path / "kernels")
    (counts, err) = _run_logged(root, None, **{kernel_cache.ENV: cache})
    assert counts[1:] == (0, 1)
    lines = [ln for ln in err.splitlines() if "compiling the codec's numba kernels" in ln]
    assert len(lines) == 1, err
    assert "INFO" in lines[0] and "probe" in lines[0] and "ckptdelta warmup" in lines[0] and cache in lines[0]
    (counts, err) = _run_logged(root, None, **{kernel_cache.ENV: cache})      # loaded: nothing compiles
    assert counts[1:] == (1, 0) and "compiling the codec" not in err
    # a completed warm-up marks the environment: a compile it left (here the probe, not one of its kernels)
    # is not announced as "the first" again
    (counts, err) = _run_logged(root, None, "from ckptdelta.delta import kernel_cache; kernel_cache.mark_warm()\n",
                                **{kernel_cache.ENV: str(tmp_path / "other")})
    assert counts[1:] == (0, 1) and "compiling the codec" not in err, err


def test_a_kernel_cache_root_that_cannot_be_written_falls_back_to_numba_s_own_choice_with_one_warning(
        tmp_path, monkeypatch, caplog):
    from ckptdelta.delta import kernels

    from numba.core import config

    monkeypatch.setattr(config, "CACHE_DIR", "")                # numba's own choice: beside the sources here
    (tmp_path / "a-file").write_text("not a folder")
    monkeypatch.setenv(kernel_cache.ENV, str(tmp_path / "a-file" / "kernels"))
    monkeypatch.setattr(kernel_cache, "_fallback_warned", False)
    f = kernels.scatter.py_func
    with caplog.at_level("WARNING", logger="ckptdelta.kernel_cache"):
        locs = [kernel_cache.SourcesLocator.from_function(f, kernels.__file__) for _ in range(2)]
    theirs = next(loc for loc in (c.from_function(f, kernels.__file__) for c in kernel_cache._IMPL._locator_classes
                                  if c is not kernel_cache.SourcesLocator) if loc is not None)
    assert all(loc.get_cache_path() == theirs.get_cache_path() for loc in locs)
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "a-file" in warnings[0].getMessage() and kernel_cache.ENV in warnings[0].getMessage()


def test_every_command_shows_the_announcement_of_a_first_compile_without_v(monkeypatch):
    import logging

    from ckptdelta.cli.console import set_up_logging

    logger = logging.getLogger("ckptdelta.kernel_cache")
    monkeypatch.setattr(logger, "level", logger.level)          # restored after the test
    for command in ("publish", "hotload", "materialize", "serve"):
        set_up_logging(0, command)
        assert logger.isEnabledFor(logging.INFO), command
