"""ckptdelta.loader.cache: replicas of one host that miss the same entry at once fetch it once (single flight)."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

from ckptdelta.loader.cache import DiskCache

KEY = ("0123456789abcdef", 1000, 10, 110)
DATA = bytes(range(100))


def _claim_then_put(root: str, claimed, release, put: bool) -> None:
    c = DiskCache(root)
    assert c.get(*KEY) is None     # a miss: this process now holds the claim
    claimed.set()
    release.wait(30)
    if put:
        c.put(*KEY, DATA)
    os._exit(0)                     # no cleanup: a process that dies holding a claim frees it too


def test_a_miss_claimed_by_another_process_waits_for_its_put_and_reads_the_entry(tmp_path):
    ctx = mp.get_context("fork")
    claimed, release = ctx.Event(), ctx.Event()
    p = ctx.Process(target=_claim_then_put, args=(str(tmp_path), claimed, release, True))
    p.start()
    try:
        assert claimed.wait(30)
        ctx.Process(target=lambda: (time.sleep(0.3), release.set())).start()
        got = DiskCache(str(tmp_path), wait_s=30).get(*KEY)   # blocks until the other process puts
        assert got == DATA
    finally:
        release.set()
        p.join(30)


def test_a_claim_held_by_a_process_that_died_is_taken_over_at_once(tmp_path):
    ctx = mp.get_context("fork")
    claimed, release = ctx.Event(), ctx.Event()
    p = ctx.Process(target=_claim_then_put, args=(str(tmp_path), claimed, release, False))
    p.start()
    assert claimed.wait(30)
    release.set()
    p.join(30)
    c = DiskCache(str(tmp_path), wait_s=600)
    t0 = time.monotonic()
    assert c.get(*KEY) is None          # not 600 s: the dead holder's lock is gone; we claim it
    assert time.monotonic() - t0 < 60
    c.put(*KEY, DATA)
    assert DiskCache(str(tmp_path)).get(*KEY) == DATA
    assert [os.path.basename(e[0]) for e in c.entries()] == ["0123456789abcdef-1000-10-110"]  # no claim left


def test_a_claim_whose_fetch_never_put_is_passed_over_after_wait_s(tmp_path):
    ctx = mp.get_context("fork")
    claimed, release = ctx.Event(), ctx.Event()
    p = ctx.Process(target=_claim_then_put, args=(str(tmp_path), claimed, release, False))
    p.start()
    try:
        assert claimed.wait(30)
        assert DiskCache(str(tmp_path), wait_s=0.3).get(*KEY) is None   # gave up waiting: fetch it yourself
    finally:
        release.set()
        p.join(30)


def test_the_same_process_never_waits_on_its_own_claim_and_wait_s_0_turns_claims_off(tmp_path):
    a, b = DiskCache(str(tmp_path)), DiskCache(str(tmp_path))
    assert a.get(*KEY) is None
    assert b.get(*KEY) is None          # another reader in this process: fetches too, as without claims
    a.put(*KEY, DATA)
    assert b.get(*KEY) == DATA
    off = DiskCache(str(tmp_path / "off"), wait_s=0)
    assert off.get(*KEY) is None and not os.path.exists(tmp_path / "off" / "01")


def _fetch_version(url: str, cache: str, barrier, out) -> None:
    from ckptdelta.loader.reader import SnapshotReader

    r = SnapshotReader(url, cache_dir=cache)
    r.chain(3)
    before = r.stats["bytes_fetched"]
    barrier.wait(30)
    r.read_tensors(3)
    out.put(r.stats["bytes_fetched"] - before)


def test_readers_in_two_processes_fetch_a_version_once_between_them(tmp_path):
    from ckptdelta.loader.reader import SnapshotReader
    from tests.bucketgen import make_run

    run = make_run(str(tmp_path / "run"), n_versions=4, anchors=set())
    alone = SnapshotReader(run.url)
    alone.chain(3)
    before = alone.stats["bytes_fetched"]
    alone.read_tensors(3)
    one = alone.stats["bytes_fetched"] - before
    ctx = mp.get_context("fork")
    barrier, out = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_fetch_version, args=(run.url, str(tmp_path / "cache"), barrier, out))
             for _ in range(2)]
    for p in procs:
        p.start()
    got = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(30)
    assert one > 0 and sum(got) == one, (got, one)   # the bytes of version 3 crossed once, not twice


def _read_version(url: str, cache: str, version: int, out) -> None:
    from ckptdelta.loader.reader import SnapshotReader

    r = SnapshotReader(url, cache_dir=cache)
    r.cache.wait_s = 600                     # a held claim would keep this replica waiting for 10 minutes
    out.put(sorted(r.read_tensors(version)))


def test_a_fetch_that_fails_gives_back_its_claims_so_no_replica_of_the_host_waits_for_them(tmp_path):
    """A replica whose fetch fails (here a damaged delta object; also a storage error, or a hot-load
    interrupted mid-fetch) gives back the claims its misses took: another replica of the host that misses
    the same entries fetches them at once, instead of waiting ``wait_s`` (60 s) for a put that never comes."""
    import pytest

    from ckptdelta.delta.errors import DeltaError
    from ckptdelta.loader.reader import SnapshotReader
    from tests.bucketgen import make_run

    run = make_run(str(tmp_path / "run"), n_versions=2, anchors={0})
    cache = str(tmp_path / "cache")
    path = os.path.join(str(tmp_path / "run"), run.manifests[1].objects[0].key)
    original = open(path, "rb").read()
    damaged = bytearray(original)
    damaged[len(damaged) // 2] ^= 0x10
    open(path, "wb").write(bytes(damaged))
    with pytest.raises(DeltaError):
        SnapshotReader(run.url, cache_dir=cache).read_tensors(1)
    claims = [n for _d, _s, names in os.walk(cache) for n in names if n.startswith(".tmp-claim-")]
    assert claims == []                       # every claim given back: none is left locked for others
    open(path, "wb").write(original)          # repaired: the other replica reads it, fetching what it must
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    p = ctx.Process(target=_read_version, args=(run.url, cache, 1, out))
    p.start()
    assert out.get(timeout=120) == sorted(run.truth[1])
    p.join(30)
