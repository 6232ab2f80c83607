"""Load: a replica hot-loads version after version while clients keep sampling from it.

The real replica (loader/server.py under uvicorn on 127.0.0.1, the tiny LM of
tests/lm.py) starts at v0 of a run written by the real Publisher. A few
client threads send completions in a loop; meanwhile the test publishes the
next version and hot-loads it over HTTP, again and again. What must hold:

* no request fails (every answer is 200), none is aborted by a swap;
* the policy versions each client sees (engine_data) never go backwards;
* every hot-load ends READY, and at the end the live weights are exactly the
  last version's bits.

Request latency is reported (p50/p99) for a phase without hot-loads and for
requests that overlapped a hot-load; no timing is asserted.
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest

from ckptdelta.loader.engines.reference.model import load_engine
from tests.replicas import PROMPT, Replica, lm_dir, publish_run, state_bits_equal  # noqa: F401

CLIENTS = 3
BODY = {"prompt": PROMPT, "max_tokens": 4, "temperature": 1.0, "ignore_eos": True, "return_engine_data": True}


@dataclass
class Sample:
    client: int
    start: float
    end: float
    status: int
    versions: list


@dataclass
class SoakFigures:
    hotloads: int = 0
    hotloads_ready: int = 0
    samples: list[Sample] = field(default_factory=list)
    windows: list[tuple[float, float]] = field(default_factory=list)    # hot-load jobs: created -> finished
    pauses: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    baseline_end: float = 0.0
    seconds: float = 0.0

    def record(self, v: int, job: dict) -> None:
        """One finished hot-load job to version ``v``."""
        self.hotloads += 1
        self.windows.append((job["created"], job["finished"]))
        if job["state"] == "READY":
            self.hotloads_ready += 1
            self.pauses.append(job["report"]["pause_s"])
        else:
            self.errors.append(f"hot-load to {v}: {job['state']} {job.get('reason')}")


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _overlaps(s: Sample, windows: list[tuple[float, float]]) -> bool:
    return any(s.start < b and a < s.end for a, b in windows)


class Clients:
    """``CLIENTS`` threads sampling in a loop until stopped or past ``deadline_s``.

    Bounded by time, not by a count of requests: a count runs out on a slow machine before the last
    hot-load, and every client must see the last version (:func:`check`)."""

    def __init__(self, url: str, fig: SoakFigures, *, deadline_s: float):
        self.url, self.fig = url, fig
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.done = [0] * CLIENTS
        self.deadline = time.monotonic() + deadline_s
        self.threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(CLIENTS)]

    def _loop(self, i: int) -> None:
        with httpx.Client(base_url=self.url, timeout=60) as http:
            while not self.stop.is_set() and time.monotonic() < self.deadline:
                t0 = time.time()
                try:
                    r = http.post("/v1/completions", json={**BODY, "n": 1 + i % 2})
                    status = r.status_code
                    versions = r.json()["engine_data"]["policy_versions"] if status == 200 else []
                    if status != 200:
                        self.fig.errors.append(f"client {i}: {status} {r.text[:200]}")
                except httpx.HTTPError as e:
                    status, versions = 0, []
                    self.fig.errors.append(f"client {i}: {type(e).__name__}: {e}")
                with self.lock:
                    self.fig.samples.append(Sample(i, t0, time.time(), status, versions))
                    self.done[i] += 1

    def total(self) -> int:
        with self.lock:
            return sum(self.done)

    def wait_for(self, n: int, timeout: float = 120) -> None:
        """Until ``n`` more requests are done in all (or the clients stopped)."""
        target, end = self.total() + n, time.monotonic() + timeout
        while self.total() < target and time.monotonic() < end and any(t.is_alive() for t in self.threads):
            time.sleep(0.005)

    def wait_for_each(self, timeout: float = 120) -> None:
        """Until every client has finished a request it started after this call (two more each: the one
        in flight may have started before), so each has seen what the replica serves now."""
        with self.lock:
            target = [d + 2 for d in self.done]
        end = time.monotonic() + timeout
        while time.monotonic() < end and any(t.is_alive() for t in self.threads):
            with self.lock:
                if all(d >= t for d, t in zip(self.done, target)):
                    return
            time.sleep(0.005)

    def __enter__(self) -> "Clients":
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=120)


def soak(tmp_path, lm_dir_path: str, *, hotloads: int, baseline_requests: int) -> SoakFigures:  # noqa: F811
    fig = SoakFigures()
    run = publish_run(str(tmp_path / "bucket" / "run"), lm_dir_path, n_versions=1)
    engine, reader = load_engine(bucket=run.url, snapshot=0)
    rep = Replica(engine, reader=reader, replica_id="soak-0")
    t0 = time.monotonic()
    try:
        with Clients(rep.url, fig, deadline_s=900) as clients:
            clients.wait_for(baseline_requests * CLIENTS)      # phase 1: serving only
            fig.baseline_end = time.time()
            for _ in range(hotloads):                           # phase 2: publish, hot-load, repeat
                v = run.publish_next()
                fig.record(v, rep.hotload(v))
                clients.wait_for(2)                             # a few requests between hot-loads
            clients.wait_for_each()                             # every client sees the last version
        fig.seconds = time.monotonic() - t0
        if state_bits_equal(engine.model, run.truth[run.latest]) != []:
            fig.errors.append("the live weights are not the last version's bits")
        if rep.status()["policy_version"] != run.latest:
            fig.errors.append(f"the replica reports {rep.status()['policy_version']}, not {run.latest}")
    finally:
        rep.close()
        run.close()
    return fig


def report(fig: SoakFigures, label: str) -> str:
    base = [s for s in fig.samples if s.end <= fig.baseline_end]
    during = [s for s in fig.samples if s.start >= fig.baseline_end]
    hit = [s for s in during if _overlaps(s, fig.windows)]
    crossed = sum(1 for s in fig.samples if len(s.versions) > 1)

    def lat(xs: list[Sample]) -> str:
        ms = [1000 * (s.end - s.start) for s in xs]
        return f"n={len(ms)} p50={_pct(ms, 0.5):.1f}ms p99={_pct(ms, 0.99):.1f}ms"

    failed = sum(1 for s in fig.samples if s.status != 200)
    pauses = [1000 * p for p in fig.pauses]
    return "\n".join([
        f"soak [{label}]: {fig.hotloads} hot-loads ({fig.hotloads_ready} READY) under {CLIENTS} sampling clients, "
        f"{len(fig.samples)} requests in {fig.seconds:.1f}s",
        f"  failed requests={failed} requests that crossed a swap={crossed} errors={len(fig.errors)}",
        f"  latency without hot-loads:    {lat(base)}",
        f"  latency during the hot-loads: {lat(during)}",
        f"  ... overlapping a hot-load:   {lat(hit)}",
        f"  swap pause p50={statistics.median(pauses) if pauses else float('nan'):.2f}ms "
        f"max={max(pauses, default=float('nan')):.2f}ms",
    ] + [f"    - {e}" for e in fig.errors[:10]])


def check(fig: SoakFigures, label: str, hotloads: int) -> None:
    text = report(fig, label)
    print()
    print(text)
    assert fig.errors == [], text
    assert fig.hotloads == fig.hotloads_ready == hotloads, text
    assert all(s.status == 200 for s in fig.samples), text
    for i in range(CLIENTS):
        seen = [v for s in sorted((s for s in fig.samples if s.client == i), key=lambda s: s.start)
                for v in s.versions]
        assert seen == sorted(seen), (i, seen)      # each client's view only moves forward
        assert seen and seen[-1] == hotloads, (i, seen[-5:])
    during = [s for s in fig.samples if s.start >= fig.baseline_end]
    assert any(_overlaps(s, fig.windows) for s in during), text   # the load really overlapped the hot-loads


def test_ten_hotloads_under_concurrent_sampling_fail_no_request(tmp_path, lm_dir):  # noqa: F811
    check(soak(tmp_path, lm_dir, hotloads=10, baseline_requests=8), "fast", 10)


@pytest.mark.slow
def test_soak_of_a_hundred_hotloads_under_concurrent_sampling(tmp_path, lm_dir):  # noqa: F811
    check(soak(tmp_path, lm_dir, hotloads=120, baseline_requests=60), "long", 120)
