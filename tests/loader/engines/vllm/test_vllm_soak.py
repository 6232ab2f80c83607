"""Soak (``make stress``): a vLLM replica hot-loads a thousand versions while clients keep sampling from it.

The same load as tests/loader/test_soak.py, on the real engine: vLLM's CPU build behind
the replica app, the Publisher writing a new delta before each hot-load, three
client threads sampling through the replica all along. What must hold:

* no request fails or is aborted by a swap (every answer is 200);
* each client's policy versions (engine_data) never go backwards, and every
  hot-load ends READY with its full read-back proof;
* at the end the live weights, read back inside vLLM's worker, are the last
  version's bits;
* memory does not grow with the number of hot-loads: the replica process and
  vLLM's processes end within ``RSS_GROWTH_BOUND`` of their RSS after the warm-up,
  and the replica keeps no shared-memory file but its host copy.

Request latency is reported (p50/p99) without and with hot-loads; no timing is
asserted.
"""

from __future__ import annotations

import os

import psutil
import pytest

from tests.loader.test_soak import CLIENTS, Clients, SoakFigures, check, report
from tests.vllm_models import save_tiny_llama
from tests.vllm_replicas import publish_vllm_run, start_vllm_replica

HOTLOADS = int(os.environ.get("CKPTDELTA_SOAK_HOTLOADS", "1000"))   # fewer for a quick look
WARM_UP = min(20, HOTLOADS // 2)
#: Allowed RSS growth, replica process + vLLM's processes, from after the warm-up to the end.
RSS_GROWTH_BOUND = 256 << 20


def _rss(pid: int) -> int:
    """RSS of ``pid`` and all its children (vLLM's API server, engine core and worker)."""
    proc = psutil.Process(pid)
    total = proc.memory_info().rss
    for child in proc.children(recursive=True):
        try:
            total += child.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def _stray_shared_files() -> list[str]:
    """This replica's files in shared memory other than its host copy (and the host copy's index)."""
    from ckptdelta.loader.engines.shared_weights import default_dir

    return [f for f in os.listdir(default_dir()) if f.startswith("ckptdelta-") and f"-{os.getpid()}-" in f
            and not f.startswith(f"ckptdelta-weights-{os.getpid()}-")]


@pytest.mark.slow
@pytest.mark.timeout(3 * 3600)   # ~40 min on two cores; the suite's 600 s per test would cut it short
def test_a_thousand_vllm_hotloads_under_concurrent_sampling_fail_no_request_and_leak_nothing(tmp_path):
    run = publish_vllm_run(str(tmp_path / "bucket" / "run"), save_tiny_llama(str(tmp_path / "model")), deltas=0)
    rep = start_vllm_replica(run, 0, cache_dir=str(tmp_path / "cache"))
    fig = SoakFigures()
    rss: dict[str, int] = {}
    try:
        import time

        t0 = time.monotonic()
        with Clients(rep.url, fig, deadline_s=3 * 3600) as clients:
            clients.wait_for(20 * CLIENTS)                      # phase 1: serving only
            fig.baseline_end = time.time()
            for i in range(HOTLOADS):                            # phase 2: publish, hot-load, repeat
                v = run.step(seed=1000 + i)
                fig.record(v, rep.hotload(v, timeout=600))
                del run.truth[v - 1]                            # keep the trainer's memory flat too
                if i + 1 == WARM_UP:
                    rss["start"] = _rss(os.getpid())
                clients.wait_for(1)
                if (i + 1) % 100 == 0:
                    print(f"  {i + 1} hot-loads, {time.monotonic() - t0:.0f} s", flush=True)
            clients.wait_for_each()                             # every client sees the last version
        fig.seconds = time.monotonic() - t0
        rss["end"] = _rss(os.getpid())
        from tests.vllm_replicas import bit_diff

        if bit_diff(rep.live_weights(str(tmp_path)), run.truth[max(run.truth)]) != []:
            fig.errors.append("the live weights are not the last version's bits")
        if _stray_shared_files():
            fig.errors.append(f"files left in shared memory: {_stray_shared_files()[:3]}")
    finally:
        rep.close()
        run.publisher.close()
    growth = rss["end"] - rss["start"]
    print(f"\n  RSS (replica + vLLM processes): {rss['start'] / 2**20:.0f} MiB after {WARM_UP} hot-loads, "
          f"{rss['end'] / 2**20:.0f} MiB after {HOTLOADS} ({growth / 2**20:+.0f} MiB; bound "
          f"{RSS_GROWTH_BOUND / 2**20:.0f} MiB)")
    check(fig, "vllm", HOTLOADS)
    assert growth <= RSS_GROWTH_BOUND, report(fig, "vllm")
