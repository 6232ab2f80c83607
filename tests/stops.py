"""Stopping a ``ckptdelta serve`` process while its hot-load is held in a named phase (ckptdelta.loader.stopping.HOLD_ENV):
tests/loader/test_stops.py and tests/loader/engines/vllm/test_vllm_faults.py."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import httpx


def hotload_until_held(url: str, target: int, marker: str, proc: subprocess.Popen, log_path: str) -> str:
    """Start a hot-load to ``target`` and wait until it is held where the replica's hold says; its id."""
    r = httpx.post(url + "/v1/hotload", json={"snapshot": target}, timeout=60)
    assert r.status_code == 202, r.text
    deadline = time.monotonic() + 300
    while not os.path.exists(marker):
        assert proc.poll() is None, open(log_path, errors="replace").read()[-3000:]
        assert time.monotonic() < deadline, "the hot-load never reached its held phase"
        time.sleep(0.05)
    return r.json()["id"]


def stop_and_check(proc: subprocess.Popen, sig: str, job_id: str, phase: str, target: int, log_path: str) -> str:
    """Send ``sig``; the replica exits 0, without a traceback, having waited for the hot-load: dropped while
    preparing, else run to its end (READY) before the engine was closed. Returns the replica's log."""
    from ckptdelta.delta.manifest import snapshot_name

    proc.send_signal(getattr(signal, sig))
    rc = proc.wait(300)
    text = open(log_path, errors="replace").read()
    assert rc == 0, f"exit status {rc} after {sig}: " + text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    ended = f"hot-load {job_id} to {snapshot_name(target)} ended "
    assert ended in text, f"the replica did not wait for its hot-load: {text[-3000:]}"
    state = text.split(ended, 1)[1].split()[0].rstrip(";")
    assert state == ("FAILED" if phase == "prepare" else "READY"), text[-3000:]
    if phase == "prepare":
        assert "HotLoadCancelledError" in text.split(ended, 1)[1].splitlines()[0]
    assert text.index(ended) < text.index(f"replica stopped ({sig})"), text[-3000:]
    return text
