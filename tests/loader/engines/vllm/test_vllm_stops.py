"""A replica that started its own vLLM, stopped by a signal in a phase of a hot-load, ends the hot-load, then
stops vLLM (none of its processes left). The reference engine's cells and the helpers they share:
tests/loader/test_stops.py."""

from __future__ import annotations

import os

import psutil
import pytest

from ckptdelta.loader.stopping import PHASES
from tests.loader.test_replica_hygiene import _leftovers, short_tmp, vllm_run  # noqa: F401 (fixtures)
from tests.loader.test_stops import SIGNALS, serve_held
from tests.stops import hotload_until_held, stop_and_check
from tests.vllm_replicas import ONE_GPU_LAYOUT_ENV, VLLM_ARGS


# --- a vLLM the replica started (owning) ---------------------------------------------------------------------

def _owning_cell(vllm_run, short_tmp, tmp_path, phase: str, sig: str) -> None:
    cache = os.path.join(short_tmp, "cache")
    log_path = str(tmp_path / "serve.log")
    proc, url, marker = serve_held(["--engine", "vllm", "--bucket", vllm_run.url, "--snapshot", "0", "--cache-dir",
                                    cache, "--drain-timeout", "5", "--", *VLLM_ARGS], phase, short_tmp, log_path,
                                   env=ONE_GPU_LAYOUT_ENV)
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
        assert children                                  # vLLM's server (and its engine core)
        job = hotload_until_held(url, 1, marker, proc, log_path)
        text = stop_and_check(proc, sig, job, phase, 1, log_path)
        assert f"the engine serves v{0 if phase == 'prepare' else 1:08d}" in text, text[-3000:]
        if phase != "prepare":
            assert "v00000001 READY" in text             # the replica's own line: proven (loader/server.py)
        psutil.wait_procs(children, timeout=60)
        assert not [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
        assert _leftovers(proc.pid, short_tmp, cache) == []
    finally:
        if proc.poll() is None:
            proc.kill()


def test_a_replica_owning_its_vllm_stopped_in_the_pause_ends_the_hotload_then_stops_vllm(vllm_run, short_tmp,
                                                                                         tmp_path):
    """It used to close the engine under the hot-load, which then failed half-way (its client closed, vLLM
    stopped under it) and left the version unknown."""
    _owning_cell(vllm_run, short_tmp, tmp_path, "pause", "SIGTERM")


@pytest.mark.slow      # a vLLM start each (~25 s)
@pytest.mark.parametrize("phase,sig", [(p, s) for p in PHASES for s in SIGNALS if (p, s) != ("pause", "SIGTERM")])
def test_a_replica_owning_its_vllm_stopped_by_every_signal_in_every_phase_ends_the_hotload(vllm_run, short_tmp,
                                                                                           tmp_path, phase, sig):
    _owning_cell(vllm_run, short_tmp, tmp_path, phase, sig)
