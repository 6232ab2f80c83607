"""The house's rules: one installed import name, parts that import each other only one way, vLLM's two halves
apart (tests/layout.py reads the import graph; ``python -m tests.layout`` prints it)."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile

import pytest

from tests import layout

#: The one circle the layout keeps, on purpose: commit_ranges imports commit_team inside the function that first
#: needs the pause's OpenMP entry, so importing the codec never compiles that entry (delta/commit_team.py).
KEPT_CIRCLES = [["ckptdelta.delta.commit_ranges", "ckptdelta.delta.commit_team"]]


def test_no_import_crosses_the_layouts_lines():
    """delta/ imports neither side, publisher/ and loader/ never each other, no part imports the CLI, and
    vLLM's worker/ and replica side meet only in the shared modules (tp, proof)."""
    assert layout.crossings(layout.graph()) == []


def test_the_only_import_circle_is_the_lazy_commit_entry():
    assert layout.circles(layout.graph()) == KEPT_CIRCLES


def test_engine_packages_choose_full_or_lora_at_their_face_and_no_module_imports_a_siblings_build():
    g = layout.graph()
    for engine in ("reference", "vllm"):
        face = f"ckptdelta.loader.engines.{engine}"
        full, lora = f"{face}.replica", f"{face}.lora"
        assert lora not in g[full], f"{full} imports {lora}: the package face picks"
        assert {full, lora} <= g[face], f"{face} does not pick between {full} and {lora}"


def test_the_replica_server_depends_only_on_the_engine_contract():
    deps = layout.graph()["ckptdelta.loader.server"]
    engines = {d for d in deps if d.startswith("ckptdelta.loader.engines")}
    assert engines <= {"ckptdelta.loader.engines", "ckptdelta.loader.engines.base",
                       "ckptdelta.loader.engines.requests"}, engines


def test_a_checkout_cannot_import_a_part_under_a_second_name():
    root = os.path.dirname(layout.ROOT + os.sep)
    for part in ("delta", "publisher", "loader"):
        r = subprocess.run([sys.executable, "-c", f"import {part}"], cwd=root, capture_output=True, text=True,
                           timeout=120)
        assert r.returncode != 0 and f"this package is ckptdelta.{part}" in r.stderr, r.stderr[-2000:]


@pytest.mark.timeout(300)
def test_the_wheel_installs_one_top_level_name_and_no_benchmarks_or_tests(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                        "-w", str(tmp_path), layout.ROOT], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    (wheel,) = tmp_path.glob("ckptdelta-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
        top_level = [n for n in names if n.endswith("top_level.txt")]
        listed = z.read(top_level[0]).decode().split() if top_level else ["ckptdelta"]
    assert top == {"ckptdelta"} and listed == ["ckptdelta"], (top, listed)
    for must in ("ckptdelta/delta/codec.py", "ckptdelta/publisher/publisher.py", "ckptdelta/loader/reader.py",
                 "ckptdelta/loader/engines/vllm/worker/extension.py", "ckptdelta/cli/__init__.py",
                 "ckptdelta/integrations/hf.py", "ckptdelta/integrations/trl.py"):
        assert must in names, must
    assert not [n for n in names if n.startswith(("ckptdelta/benchmarks", "ckptdelta/tests"))]
