"""``python -m delta.warmup`` (run by make at install) compiles every codec path on the real code, bit-exact."""

from __future__ import annotations

import subprocess
import sys


def test_the_warm_up_runs_every_dtype_and_codec_path_bit_exact_in_a_fresh_process():
    r = subprocess.run([sys.executable, "-m", "delta.warmup"], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "codec kernels ready" in r.stderr
