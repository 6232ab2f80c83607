"""Storage faults: publishes and hot-loads through a proxy that throttles, resets, stalls and truncates.

tests/faultproxy.py sits between s3fs and the moto S3 server. The clients
below it are set to one attempt with a 1 s read timeout, so every injected
fault reaches the Store, whose retries must carry each publish and hot-load
through, or fail it with an error naming the object. Whatever happens:

* every committed snapshot is exactly the weights published for it (checked
  afterwards by a reader that bypasses the proxy: ``read_tensors`` bit-exact
  and ``verify``);
* the replica (a HotSwapper over a live state dict, reading through the proxy)
  never serves half-applied weights: a thread inside ``gate.serving()`` keeps
  hashing the live tensors, and they always equal one committed version's bits,
  a version that never goes backwards.

Figures are printed (``pytest -s``); the tests assert zero corruptions.
"""

from __future__ import annotations

import random
import re
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import pytest
import torch

from ckptdelta.delta import digest
from ckptdelta.delta.errors import CkptDeltaError, ConcurrentPublisherError
from ckptdelta.delta.manifest import manifest_key
from ckptdelta.delta.storage import RetryPolicy, Store
from ckptdelta.loader.hotswap import HotSwapper
from ckptdelta.loader.reader import SnapshotReader
from ckptdelta.publisher import Publisher
from tests.crashers.publish_loop import CONFIG, SHARD_BYTES, weights_for
from tests.faultproxy import FaultProxy, s3_options_through

SEED = 7
#: An error the user can act on names the object (or the snapshot) it is about.
NAMES_OBJECT = re.compile(r"(anchors|deltas|manifests)/|HEAD|RUN\.json|v\d{8}|version \d+")


@pytest.fixture
def proxy(s3_endpoint):
    with FaultProxy(s3_endpoint, seed=SEED, stall_s=2.0) as p:
        yield p


def _fingerprint(tensors: dict[str, torch.Tensor]) -> tuple[int, ...]:
    return tuple(digest(tensors[n]) for n in sorted(tensors))


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return _fingerprint(a) == _fingerprint(b) and sorted(a) == sorted(b)


def test_a_commit_whose_answer_is_lost_and_resent_by_the_http_client_is_recognised_as_ours(s3_root, proxy):
    """Regression: the manifest PUT lands, the connection drops before the answer, and aiohttp resends
    the PUT itself (it does so once for an idempotent method on a reused connection). The resend gets
    412 and surfaced as ObjectExistsError, which the commit reported as another publisher's commit
    (ConcurrentPublisherError) although the manifest holds exactly our bytes."""
    url, base = s3_root
    opts = s3_options_through(proxy.url, base)
    pub = Publisher(url, storage_options=opts, progress=False)
    pub.publish(weights_for(SEED, 0), 0)
    pub.publish(weights_for(SEED, 1), 10)   # connections are warm and kept alive
    proxy.inject("reset", after=True, match=lambda m, p: m == "PUT" and "/manifests/" in p)
    r = pub.publish(weights_for(SEED, 2), 20)
    assert r.version == 2 and proxy.snapshot().get("reset") == 1
    r = pub.publish(weights_for(SEED, 3), 30)            # the publisher carries on
    assert r.version == 3
    pub.close()
    reader = SnapshotReader(url, storage_options=base)
    for v in range(4):
        assert _same(reader.read_tensors(v), weights_for(SEED, v))


#: Retries of the Store under test: fewer and shorter than the default, so that a storm of faults
#: exhausts them now and then and the failure path is exercised too.
RETRY = RetryPolicy(attempts=4, base_delay=0.05, max_delay=0.4)
CALM = {"slowdown": 0.05, "reset": 0.04, "stall": 0.015, "truncate": 0.05}
STORM = {"slowdown": 0.3, "reset": 0.15, "stall": 0.04, "truncate": 0.2}


@dataclass
class FaultFigures:
    label: str
    publishes: int = 0
    publish_failed: int = 0
    landed_though_failed: int = 0     # the commit landed, its answer did not: found by the fault-free reader
    publisher_reopened: int = 0
    hotloads: int = 0
    hotload_failed: int = 0
    versions_committed: int = 0
    serving_checks: int = 0
    versions_served: set = field(default_factory=set)
    proxy: dict = field(default_factory=dict)
    retries: int = 0
    store_requests: int = 0
    corruptions: int = 0              # committed snapshots that are not the published bits
    half_applied: int = 0             # live weights that were no committed version's bits
    errors: Counter = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def report(self) -> str:
        faults = {k: self.proxy.get(k, 0) for k in ("slowdown", "reset", "stall", "truncate")}
        lines = [f"storage faults [{self.label}] seed={SEED}",
                 f"  operations={self.publishes + self.hotloads} (publishes {self.publishes}, "
                 f"hot-loads {self.hotloads}) in {self.seconds:.1f}s",
                 f"  proxy requests={self.proxy.get('requests', 0)} faults injected={sum(faults.values())} {faults}",
                 f"  Store requests={self.store_requests} retries={self.retries}",
                 f"  failures: publishes={self.publish_failed} (of which committed anyway: {self.landed_though_failed};"
                 f" publisher reopened {self.publisher_reopened}x) hot-loads={self.hotload_failed}",
                 f"  error types: {dict(self.errors)}",
                 f"  committed versions={self.versions_committed} served versions={len(self.versions_served)} "
                 f"serving checks={self.serving_checks}",
                 f"  corruptions={self.corruptions} half-applied={self.half_applied} violations={len(self.violations)}"]
        lines += [f"    - {v}" for v in self.violations[:20]]
        return "\n".join(lines)


class FaultCampaign:
    """Publishes and hot-loads alternately through the proxy; a serving thread watches the live weights."""

    def __init__(self, url: str, base: dict, proxy: FaultProxy, *, ops: int, label: str):
        self.url, self.base, self.proxy, self.ops = url, base, proxy, ops
        self.opts = s3_options_through(proxy.url, base)
        self.fig = FaultFigures(label)
        self.direct = Store.from_url(url, base)
        self.fingerprints = {_fingerprint(weights_for(SEED, v)): v for v in range(ops + 2)}
        self.stores: list[Store] = []
        self.rng = random.Random(SEED)

    def _store(self, store: Store) -> Store:
        store.retry = RETRY
        self.stores.append(store)
        return store

    def _failed(self, what: str, e: BaseException) -> None:
        self.fig.errors[type(e).__name__] += 1
        if not isinstance(e, CkptDeltaError):
            self.fig.violations.append(f"{what} failed with a foreign error {type(e).__name__}: {e}")
        elif not NAMES_OBJECT.search(str(e)):
            self.fig.violations.append(f"{what} failed with an error naming no object: {e}")

    def _open_publisher(self) -> Publisher:
        for _ in range(20):
            try:
                pub = Publisher(self.url, storage_options=self.opts, anchor_every=4, shard_bytes=2 * SHARD_BYTES,
                                extra_files={"config.json": CONFIG}, progress=False)
            except Exception as e:  # noqa: BLE001 - opening reads the run through the faults too
                self._failed("opening the publisher", e)
                continue
            self._store(pub.store)
            return pub
        raise AssertionError(f"could not open a publisher through the faults: {self.fig.report()}")

    def _committed(self) -> list[int]:
        return sorted(v for v in range(self.ops + 2) if self.direct.exists(manifest_key(v)))

    def publish(self, pub: Publisher, v: int) -> tuple[Publisher, int]:
        fig = self.fig
        fig.publishes += 1
        try:
            r = pub.publish(weights_for(SEED, v), 10 * v)
            if r.version != v:
                fig.violations.append(f"publish assigned version {r.version}, expected {v}")
            return pub, v + 1
        except ConcurrentPublisherError as e:
            # only ever our own earlier publish whose commit landed unanswered: reopen and go on
            fig.publish_failed += 1
            self._failed(f"publish of version {v}", e)
            pub.close()
            fig.publisher_reopened += 1
            pub = self._open_publisher()
            vs = self._committed()
            return pub, (vs[-1] + 1 if vs else 0)
        except Exception as e:  # noqa: BLE001
            fig.publish_failed += 1
            self._failed(f"publish of version {v}", e)
            if self.direct.exists(manifest_key(v)):
                fig.landed_though_failed += 1
                return pub, v + 1
            return pub, v

    def hotload(self, swapper: HotSwapper, live: dict[str, torch.Tensor]) -> None:
        fig = self.fig
        fig.hotloads += 1
        before = swapper.version
        try:
            swapper.hotload("latest")
        except Exception as e:  # noqa: BLE001
            fig.hotload_failed += 1
            self._failed(f"hot-load from version {before}", e)
            if swapper.version != before:
                fig.violations.append(f"a failed hot-load moved the version from {before} to {swapper.version}")
        v = swapper.version
        if v is None or self.fingerprints.get(_fingerprint(live)) != v:
            fig.violations.append(f"after a hot-load the live weights are not version {v}'s bits")

    def run(self) -> FaultFigures:
        fig, proxy = self.fig, self.proxy
        t0 = time.monotonic()
        proxy.set_rates(**CALM)
        pub = self._open_publisher()
        v = 0
        while v == 0:
            pub, v = self.publish(pub, 0)
        live = {n: t.clone() for n, t in weights_for(SEED, 0).items()}
        reader = SnapshotReader(self.url, storage_options=self.opts)
        self._store(reader.store)
        swapper = HotSwapper(live, reader, version=0)
        stop = threading.Event()
        served: list[int] = []

        def serve() -> None:     # a replica's forward steps: each sees one version's weights, whole
            deadline = time.monotonic() + 900
            while not stop.is_set() and time.monotonic() < deadline:
                with swapper.gate.serving():
                    fp = _fingerprint(live)
                    labelled = swapper.version
                got = self.fingerprints.get(fp)
                fig.serving_checks += 1
                if got is None or got != labelled:
                    fig.half_applied += 1
                    fig.violations.append(f"a forward step saw weights of no single version (labelled {labelled})")
                elif served and got < served[-1]:
                    fig.violations.append(f"served version went back from {served[-1]} to {got}")
                else:
                    served.append(got)
                time.sleep(0.002)

        server = threading.Thread(target=serve, name="serving", daemon=True)
        server.start()
        try:
            for i in range(self.ops):
                proxy.set_rates(**(STORM if i >= self.ops * 3 // 4 else CALM))
                if i % 2 == 0:
                    pub, v = self.publish(pub, v)
                else:
                    self.hotload(swapper, live)
        finally:
            stop.set()
            server.join(timeout=60)
            proxy.set_rates()
            try:
                pub.close()
            except Exception as e:  # noqa: BLE001
                self._failed("closing the publisher", e)
        fig.versions_served = set(served)
        fig.proxy = proxy.snapshot()
        fig.retries = sum(s.stats["retries"] for s in self.stores)
        fig.store_requests = sum(s.stats["requests"] for s in self.stores)
        self._check_committed(live, swapper)
        fig.seconds = time.monotonic() - t0
        return fig

    def _check_committed(self, live: dict[str, torch.Tensor], swapper: HotSwapper) -> None:
        """Every committed snapshot, read past the proxy, is exactly what was published for it."""
        fig = self.fig
        reader = SnapshotReader(self.url, storage_options=self.base)
        vs = reader.versions()
        fig.versions_committed = len(vs)
        if vs != list(range(len(vs))):
            fig.violations.append(f"committed versions are not 0..n: {vs}")
        for v in vs:
            try:
                if not _same(reader.read_tensors(v), weights_for(SEED, v)):
                    fig.corruptions += 1
                    fig.violations.append(f"committed snapshot {v} is not the published weights")
                reader.verify(v)
            except Exception as e:  # noqa: BLE001
                fig.corruptions += 1
                fig.violations.append(f"committed snapshot {v} does not verify: {type(e).__name__}: {e}")
        for v in fig.versions_served:
            if v not in vs:
                fig.violations.append(f"the replica served version {v}, which is not committed")
        if self.fingerprints.get(_fingerprint(live)) != swapper.version:
            fig.violations.append("the live weights at the end are not the version the replica reports")


def _assert_faults(fig: FaultFigures, *, every_kind: bool) -> None:
    assert fig.corruptions == 0 and fig.half_applied == 0, fig.report()
    assert fig.violations == [], fig.report()
    assert fig.retries > 0 and sum(fig.proxy.get(k, 0) for k in ("slowdown", "reset", "stall", "truncate")) > 10, \
        fig.report()
    if every_kind:   # which requests draw which fault depends on thread timing: only certain over many
        assert all(fig.proxy.get(k, 0) > 0 for k in ("slowdown", "reset", "stall", "truncate")), fig.report()
    assert fig.versions_committed > 1 and len(fig.versions_served) > 1, fig.report()


def test_publishes_and_hotloads_through_throttling_resets_stalls_and_truncation(s3_root, proxy):
    url, base = s3_root
    fig = FaultCampaign(url, base, proxy, ops=24, label="fast").run()
    print()
    print(fig.report())
    _assert_faults(fig, every_kind=False)


@pytest.mark.slow
def test_200_operations_through_storage_faults(s3_root, proxy):
    url, base = s3_root
    fig = FaultCampaign(url, base, proxy, ops=200, label="long").run()
    print()
    print(fig.report())
    _assert_faults(fig, every_kind=True)


def test_a_commit_that_landed_while_every_answer_was_lost_is_reported_as_committed(s3_root, proxy):
    """Regression: the manifest PUT is applied but its answer stalls past the timeout; every retry is
    throttled until the Store gives up. The snapshot is committed all the same, and the publish said
    it failed; the next publish then found "its" version taken and stopped the publisher for good."""
    url, base = s3_root
    opts = s3_options_through(proxy.url, base)
    pub = Publisher(url, storage_options=opts, progress=False)
    pub.store.retry = RETRY
    pub.publish(weights_for(SEED, 0), 0)
    is_manifest_put = lambda m, p: m == "PUT" and "/manifests/" in p  # noqa: E731
    proxy.inject("stall", after=True, match=is_manifest_put)
    proxy.inject("slowdown", match=is_manifest_put, times=RETRY.attempts - 1)
    r = pub.publish(weights_for(SEED, 1), 10)
    assert r.version == 1 and proxy.snapshot()["slowdown"] == RETRY.attempts - 1
    assert pub.publish(weights_for(SEED, 2), 20).version == 2
    pub.close()
    reader = SnapshotReader(url, storage_options=base)
    assert reader.versions() == [0, 1, 2]
    for v in range(3):
        assert _same(reader.read_tensors(v), weights_for(SEED, v))
