"""ckptdelta.loader.reader: resolving, reading, caching, materializing and verifying snapshots."""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from ckptdelta.delta.errors import ChecksumError, DeltaError, ManifestError, RunMismatchError, SnapshotNotFoundError
from ckptdelta.delta.manifest import HEAD_KEY, manifest_key
from ckptdelta.delta.storage import Store
from ckptdelta.cli import read as cli_read
from ckptdelta.loader.cache import DiskCache
from ckptdelta.loader.materialize import write_checkpoint
from ckptdelta.loader.reader import SnapshotReader
from tests.bucketgen import CONFIG_JSON, bits_equal, make_run, reference_weights, trajectory, write_run


@pytest.fixture
def run(tmp_path):
    """Anchors at 0 and 4, deltas 1-3 and 5-6."""
    return make_run(str(tmp_path / "run"), n_versions=7, anchors={4})


@pytest.fixture(scope="module")
def shared_run(tmp_path_factory):
    """Like ``run``, for tests that only read."""
    return make_run(str(tmp_path_factory.mktemp("shared") / "run"), n_versions=7, anchors={4})


def assert_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        assert bits_equal(got[k], want[k]), k


def flip_byte(store: Store, key: str, offset: int) -> None:
    data = bytearray(store.get(key))
    data[offset] ^= 0x40
    store.put(key, bytes(data))


# --- reading ---------------------------------------------------------------------------------

@pytest.mark.parametrize("store_url", ["local", "memory", "s3", "gcs"], indirect=True)
def test_every_version_reads_back_bit_exact_on_every_backend(store_url):
    url, opts = store_url
    run = make_run(url, opts, n_versions=4, anchors={2})
    r = SnapshotReader(url, storage_options=opts)
    assert r.versions() == [0, 1, 2, 3]
    for v in range(4):
        assert_same(r.read_tensors(v), run.truth[v])


def test_special_bit_patterns_survive_the_chain(run):
    r = SnapshotReader(run.url)
    for v in run.truth:
        got = r.read_tensors(v)
        assert_same(got, run.truth[v])
    q = r.read_tensor(3, "model.layers.0.self_attn.q_proj.weight").view(-1).view(torch.int16)
    assert q[0].item() == 0x7FC1 and q[1].item() == -0x8000          # NaN payload and -0.0 as stored
    n = r.read_tensor(3, "model.norm.weight").view(torch.int32)
    assert n[0].item() == 0x7FC00123 and n[1].item() == -0x80000000  # fp32 NaN payload, -0.0


def test_chain_runs_from_the_anchor(run):
    r = SnapshotReader(run.url)
    assert [m.version for m in r.chain(3)] == [0, 1, 2, 3]
    assert [m.version for m in r.chain(6)] == [4, 5, 6]
    assert [m.version for m in r.chain(4)] == [4]
    assert r.chain(6)[0].kind == "anchor"


def test_range_reads_fetch_only_the_requested_tensors(tmp_path, monkeypatch):
    from ckptdelta.loader import fetch_units

    monkeypatch.setattr(fetch_units, "FROM_START_BYTES", 0)     # this run's objects are a few KB: ranges alone
    run = make_run(str(tmp_path / "run"), n_versions=4, seed=3)
    total = sum(o.size for m in run.manifests.values() for o in m.objects)
    r = SnapshotReader(run.url)
    r.manifest(3), r.chain(3)
    before = r.stats["bytes_fetched"]
    t = r.read_tensor(3, "model.norm.weight")
    assert bits_equal(t, run.truth[3]["model.norm.weight"])
    fetched = r.stats["bytes_fetched"] - before
    assert 0 < fetched < total / 20
    # a tensor-parallel rank selecting its tensors with a predicate gets exactly those
    before = r.stats["bytes_fetched"]
    got = r.read_tensors(3, lambda n: "self_attn" in n)
    assert sorted(got) == ["model.layers.0.self_attn.o_proj.weight", "model.layers.0.self_attn.q_proj.weight"]
    assert_same(got, {k: run.truth[3][k] for k in got})
    assert r.stats["bytes_fetched"] - before < total / 3


def test_a_request_near_an_objects_start_begins_at_its_first_byte(tmp_path, monkeypatch):
    """A request that would start within FROM_START_BYTES of its object's start (a delta object's first record
    follows its magic) reads from byte 0 (rclone's S3 server answers a range starting inside an object's first
    4 KiB several times slower); the pieces are the same bytes, checked as before."""
    from ckptdelta.loader import fetch_units
    from ckptdelta.loader.update_path import rebuild_pieces

    run = make_run(str(tmp_path / "run"), n_versions=3, seed=5)
    r = SnapshotReader(run.url)
    chain = r.chain(2)
    pieces = [p for n in sorted(chain[-1].tensors) for p in rebuild_pieces(chain, n)]
    reqs = fetch_units.coalesce([(p, i) for i, p in enumerate(pieces)])
    firsts = {key: min(p.start for p, _i in members) for key, _s, _e, members in reqs}
    assert any(0 < s <= fetch_units.FROM_START_BYTES for s in firsts.values())
    for key, s, _e, members in reqs:
        assert s == (0 if firsts[key] <= fetch_units.FROM_START_BYTES else firsts[key])
    assert_same(r.read_tensors(2), run.truth[2])
    monkeypatch.setattr(fetch_units, "FROM_START_BYTES", 0)
    assert all(s == firsts[key] for key, s, _e, _m in fetch_units.coalesce([(p, i) for i, p in enumerate(pieces)]))


def test_stored_order_sorts_groups_by_where_their_first_piece_lies_and_leaves_empty_groups_in_place():
    """Version, then the object's place in its manifest (not its key's spelling), then the offset; a group with no
    piece (a tensor proven against the live bits, nothing to fetch) keeps its place, so that such groups stay spread
    over a hot-load's staging tasks."""
    from types import SimpleNamespace

    from ckptdelta.loader.fetch_units import stored_order

    def piece(version: int, obj: int, start: int) -> SimpleNamespace:
        return SimpleNamespace(manifest=SimpleNamespace(version=version), _stored=SimpleNamespace(object=obj),
                               start=start)

    groups = [[piece(3, 1, 500)], [], [piece(3, 0, 900)], [piece(2, 5, 0), piece(3, 0, 0)], [],
              [piece(3, 1, 8)], [piece(3, 0, 100)]]
    assert stored_order(groups) == [3, 1, 6, 2, 4, 5, 0]
    assert stored_order([]) == [] and stored_order([[], []]) == [0, 1]


def test_a_read_starts_on_a_small_first_batch_and_fetches_larger_ones_as_it_goes(shared_run, monkeypatch):
    """Decoding waits only for the first batch (about FIRST_BATCH_BYTES); each later batch may hold twice as
    much as the last, up to batch_bytes or 1/TAIL_SHARE of the read (what is left to decode once the link is
    quiet), and a batch always holds whole tensors. A read cuts its batches by this rule and by where its groups'
    objects begin (the next test); here the size rule, then that a read cuts as fetch_batches says."""
    import ckptdelta.loader.reader as reader_mod
    from ckptdelta.loader.reader import fetch_batches, object_starts
    from ckptdelta.loader.update_path import rebuild_pieces

    r = SnapshotReader(shared_run.url)
    chain = r.chain(3)
    names = sorted(chain[-1].tensors)
    groups = [rebuild_pieces(chain, n) for n in names]
    sizes = [sum(p.nbytes for p in g) for g in groups]
    monkeypatch.setattr(reader_mod, "FIRST_BATCH_BYTES", min(sizes))
    cap = max(min(sizes), sum(sizes) // reader_mod.TAIL_SHARE)
    batches = fetch_batches(sizes, sum(sizes))
    calls = [sum(sizes[gi] for gi in b) for b in batches]
    assert [gi for b in batches for gi in b] == list(range(len(groups)))
    assert calls[0] == sizes[0] and 1 < len(calls) < len(groups)
    limit, start = min(sizes), 0
    for k, c in enumerate(calls):            # batch k holds at most limit * 2**k bytes, or one tensor
        end = start
        while end < len(sizes) and sum(sizes[start:end + 1]) <= c:
            end += 1
        assert sum(sizes[start:end]) == c and (c <= limit or end == start + 1), (k, c, limit)
        if end < len(sizes):                 # and it stopped before the tensor that would pass its limit
            assert c + sizes[end] > limit, (k, c, limit)
        start, limit = end, min(cap, 2 * limit)
    fetched: list[int] = []
    real = r.fetch

    def counting(pieces, **kw):
        fetched.append(sum(p.nbytes for p in pieces))
        return real(pieces, **kw)

    monkeypatch.setattr(r, "fetch", counting)
    got = list(r.iter_fetched(groups, batch_bytes=sum(sizes)))
    assert [gi for gi, _ in got] == list(range(len(groups)))
    want = fetch_batches(sizes, sum(sizes), object_starts(groups))
    assert fetched == [sum(sizes[gi] for gi in b) for b in want]
    fetched.clear()
    list(r.iter_fetched(groups, batch_bytes=1))          # a cap below every tensor: one tensor per batch
    assert fetched == sizes


def test_a_groups_object_is_its_first_pieces_so_a_chain_read_follows_the_anchors_shards(tmp_path):
    """Each group of a read along a chain is its anchor's copy and the records after it: they begin another object
    only where the anchor's copies move to the next shard (here one shard: never), not at every group (its last
    piece, a record, lies in one of the delta's objects or the other)."""
    from ckptdelta.loader.reader import object_starts
    from ckptdelta.loader.update_path import rebuild_pieces

    run = write_run(str(tmp_path / "run"), versions=trajectory(3), n_shards=1, objects_per_delta=2)
    r = SnapshotReader(run.url)
    chain = r.chain(2)
    groups = [rebuild_pieces(chain, n) for n in sorted(chain[-1].tensors)]
    starts = object_starts(groups)
    firsts, lasts = [g[0].obj.key for g in groups], [g[-1].obj.key for g in groups]
    assert starts == [gi > 0 and firsts[gi] != firsts[gi - 1] for gi in range(len(groups))]
    by_last = [gi > 0 and firsts[gi] != lasts[gi - 1] for gi in range(len(groups))]
    assert sum(starts) == 0 and sum(by_last) >= len(groups) // 2
    assert object_starts([[], groups[0], [], groups[0], [], groups[-1]]) == \
        [False, False, False, False, False, firsts[-1] != firsts[0]]        # empty groups are skipped, never starts


def test_batches_follow_the_stored_objects_a_request_each_where_they_fit():
    """Where a read says which groups begin another object, a batch ends with an object once it is half full, and
    at its limit inside an object goes on to the object's end where that is within twice its limit: a LoRA step's
    parts of 1-2.4 MB then come as a batch each (one request) where cutting by size alone split most of them
    between two batches. A larger object is cut by the limits as before (the first batch FIRST_BATCH_BYTES, none
    past 1/TAIL_SHARE of the read) until the last batch takes what is left of it within twice its limit, and
    without object boundaries nothing changes."""
    from ckptdelta.loader.reader import FIRST_BATCH_BYTES, TAIL_SHARE, fetch_batches

    kib = 1 << 10
    # a rank-64 step as a publisher writes it: a first part of 1 MiB, then parts of ~2.3 MB, of 100-200 KiB records
    objects = [[128 * kib] * 8] + [[160 * kib, 96 * kib] * 7] * 5 + [[120 * kib] * 5]
    sizes = [n for o in objects for n in o]
    starts = [False] + [i == 0 for o in objects for i in range(len(o))][1:]
    batches = fetch_batches(sizes, starts=starts)
    ends = [sum(len(o) for o in objects[:k + 1]) for k in range(len(objects))]
    assert [b[-1] + 1 for b in batches] == ends                         # a batch per object
    assert sum(sizes[gi] for gi in batches[0]) == FIRST_BATCH_BYTES
    obj = [sum(starts[:gi + 1]) for gi in range(len(sizes))]           # each group's object

    def requests(bs: list[list[int]]) -> int:                          # coalesced: one per object a batch touches
        return sum(len({obj[gi] for gi in b}) for b in bs)

    by_size = fetch_batches(sizes)                                      # without them: cut by size alone
    assert by_size == fetch_batches(sizes, starts=None)
    assert requests(batches) == len(objects) and requests(by_size) >= len(objects) + 4, (requests(by_size), by_size)
    # an object that would pass twice a batch's limit is cut by the limits, as a read without boundaries is, until
    # what is left of it fits in twice the limit: the last batch takes it (one request, not two)
    big = [64 * kib] * 200
    alone, plain = fetch_batches(big, starts=[False] * 200), fetch_batches(big)
    assert alone[:-1] == plain[:-2] and alone[-1] == plain[-2] + plain[-1]
    held = [sum(big[gi] for gi in b) for b in alone]
    assert held[0] == FIRST_BATCH_BYTES and max(held[:-1]) <= sum(big) // TAIL_SHARE
    assert held[-1] <= 2 * (sum(big) // TAIL_SHARE)
    # ... and a part just past a batch's limit goes with it whole, never past batch_bytes
    part = [[300 * kib] * 4, [300 * kib] * 6]                           # 1.2 MB, then 1.8 MB
    flat = [n for o in part for n in o]
    marks = [False, False, False, False, True, False, False, False, False, False]
    assert fetch_batches(flat, starts=marks) == [[0, 1, 2, 3], [4, 5, 6, 7, 8, 9]]
    assert fetch_batches(flat, batch_bytes=1500 * kib, starts=marks) == [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]]


def test_a_read_of_tens_of_mb_leaves_at_most_an_eighth_of_it_to_decode_after_its_last_byte():
    """Batches double from FIRST_BATCH_BYTES but stop at 1/TAIL_SHARE of the read: the last batch, decoded only
    once all of it is in, is a small share of the read, not the half that doubling alone leaves."""
    from ckptdelta.loader.reader import FIRST_BATCH_BYTES, TAIL_SHARE, fetch_batches

    mib = 1 << 20
    sizes = [mib // 4] * 192                                            # a LoRA step: 48 MiB of 256 KiB tensors
    batches = fetch_batches(sizes)
    held = [sum(sizes[gi] for gi in b) for b in batches]
    assert [gi for b in batches for gi in b] == list(range(len(sizes)))
    assert held[:4] == [FIRST_BATCH_BYTES, 2 * mib, 4 * mib, 6 * mib] == [mib, 2 * mib, 4 * mib, 48 * mib // TAIL_SHARE]
    assert max(held) == 6 * mib and held[-1] == 5 * mib and len(batches) == 10
    assert fetch_batches(sizes, batch_bytes=3 * mib)[4] == list(range(36, 48))        # batch_bytes caps it lower
    small = fetch_batches([mib // 4] * 16)                              # 4 MiB: batches of FIRST_BATCH_BYTES
    assert [len(b) for b in small] == [4, 4, 4, 4]
    assert fetch_batches([10 * mib, mib, 10 * mib]) == [[0], [1], [2]]  # a group past the cap is its own batch
    assert fetch_batches([]) == [[]]


def test_a_fresh_resolve_confirms_the_manifest_beside_the_run_check_in_two_requests(run):
    """What a replica's hot-load asks: RUN.json and the version's manifest side by side (its GET for a version
    not read before, a HEAD for one cached; not a HEAD, then a GET, after the run check); a manifest deleted
    since it was cached is said to be gone, and a run deleted and published again wins over whatever the
    manifest's read found."""
    import shutil

    r = SnapshotReader(run.url)
    assert r.resolve(0) == 0
    before = r.stats["requests"]
    assert r.resolve(3, fresh=True) == 3
    assert r.stats["requests"] - before == 2
    cached = r.manifest(3)
    before = r.stats["requests"]
    assert r.resolve(3, fresh=True) == 3 and r.manifest(3) is cached           # confirmed, not read again
    assert r.stats["requests"] - before == 2
    os.remove(os.path.join(run.url, manifest_key(3)))                           # gc deleted it
    with pytest.raises(SnapshotNotFoundError, match=r"v00000003 .* any more \(deleted, by gc\?\)"):
        r.resolve(3, fresh=True)
    assert 3 not in r._manifests
    shutil.rmtree(run.url)
    make_run(run.url, n_versions=3, anchors=set())
    with pytest.raises(SnapshotNotFoundError, match="was deleted and the URL now holds run"):
        r.resolve(2, fresh=True)


def test_a_fresh_resolve_that_cannot_read_the_run_keeps_the_cached_manifests_and_joins_its_check(run,
                                                                                                  monkeypatch):
    """A storage error reading RUN.json fails the resolve, says so, and keeps what is cached (the run may be
    fine); an unexpected error reading the manifest still waits for the run's check beside it."""
    from ckptdelta.delta.errors import StorageError

    r = SnapshotReader(run.url)
    assert r.resolve(2) == 2 and 2 in r._manifests
    real_get = r._get

    def failing_run(key, *a, **k):
        if key == "RUN.json":
            raise StorageError("RUN.json: connection reset")
        return real_get(key, *a, **k)

    monkeypatch.setattr(r, "_get", failing_run)
    with pytest.raises(StorageError, match="connection reset"):
        r.resolve(2, fresh=True)
    assert 2 in r._manifests
    monkeypatch.setattr(r, "_get", real_get)
    real_check, ended = r.check_run, []

    def slow_check():                            # still running when the manifest's read fails
        time.sleep(0.2)
        real_check()
        ended.append(True)

    monkeypatch.setattr(r, "check_run", slow_check)
    monkeypatch.setattr(r, "_manifest", lambda v: (_ for _ in ()).throw(RuntimeError("a bug")))
    with pytest.raises(RuntimeError, match="a bug"):
        r.resolve(3, fresh=True)
    assert ended and r._threads.busy == 0        # the run's check was waited for, on the reader's kept thread


def test_unknown_tensor_name_is_not_found(run):
    r = SnapshotReader(run.url)
    with pytest.raises(SnapshotNotFoundError, match="no.such"):
        r.read_tensors(2, ["model.norm.weight", "no.such"])


def test_tensors_added_removed_and_reshaped_along_the_chain(tmp_path):
    v0 = reference_weights(5)
    v1 = {k: t.clone() for k, t in v0.items()}
    v1["extra.weight"] = torch.randn(7, 5).bfloat16()
    v1["model.norm.weight"] = torch.randn(40)                # shape change: stored without parent
    del v1["model.step_counter"]
    v2 = {k: t.clone() for k, t in v1.items()}
    v2["extra.weight"].view(torch.int16)[0, 0] += 1
    v2["model.step_counter"] = torch.tensor([9, 9], dtype=torch.int64)  # re-added
    run = write_run(str(tmp_path / "run"), versions=[v0, v1, v2])
    r = SnapshotReader(run.url)
    for v in range(3):
        assert_same(r.read_tensors(v), run.truth[v])


# --- names, versions, latest ------------------------------------------------------------------

def test_resolve_accepts_latest_numbers_names_and_decimal_strings(run):
    r = SnapshotReader(run.url)
    assert r.resolve("latest") == 6
    assert r.resolve(3) == 3
    assert r.resolve("v00000003") == 3
    assert r.resolve("3") == 3
    assert r.manifest("v00000005").version == 5


@pytest.mark.parametrize("bad", [
    "../manifests/000000000001.json", "/etc/passwd", "v00000001/..", "manifests/000000000001.json", "..",
    "v00000001\n", "3\n", " 3", "v1", "V00000001", "LATEST", "", "-1", "3.0", "0x3", "\u0663",
    "v0000000\u0663", "9" * 40, -1, True, 2.0, None, 99, "v00000099",
])
def test_resolve_refuses_anything_else(shared_run, bad):
    r = SnapshotReader(shared_run.url)
    with pytest.raises(SnapshotNotFoundError):
        r.resolve(bad)


def test_latest_looks_past_a_lagging_head(tmp_path):
    run = make_run(str(tmp_path / "run"), n_versions=5, head_lag=2)
    r = SnapshotReader(run.url)
    assert json.loads(run.store.get(HEAD_KEY))["version"] == 2
    assert r.latest() == 4


def test_latest_without_head_lists_manifests(run):
    run.store.delete([HEAD_KEY])
    assert SnapshotReader(run.url).latest() == 6


def test_run_id_mismatch_and_missing_run(run, tmp_path):
    assert SnapshotReader(run.url).run_id == "run-test"
    with pytest.raises(RunMismatchError):
        SnapshotReader(run.url, run_id="another-run").manifest(1)
    with pytest.raises(SnapshotNotFoundError):
        SnapshotReader(str(tmp_path / "nothing")).latest()


def test_manifest_claiming_unchanged_tensor_that_changed_is_refused(run):
    raw = json.loads(run.store.get(manifest_key(2)))
    entry = raw["tensors"]["model.layers.0.frozen.bias"]
    assert entry["object"] is None
    entry["xxh3"] = "0123456789abcdef"
    run.store.put(manifest_key(2), json.dumps(raw).encode())
    with pytest.raises(ManifestError, match="frozen.bias"):
        SnapshotReader(run.url).read_tensors(3)


# --- cache ---------------------------------------------------------------------------------------

def test_cache_is_shared_by_two_readers(run, tmp_path):
    cache = str(tmp_path / "cache")
    first = SnapshotReader(run.url, cache_dir=cache)
    assert_same(first.read_tensors(6), run.truth[6])
    second = SnapshotReader(run.url, cache_dir=cache)
    assert_same(second.read_tensors(6), run.truth[6])
    metadata = sum(len(run.store.get(k)) for k in ("RUN.json", *(manifest_key(v) for v in (4, 5, 6))))
    assert second.stats["cache_hits"] > 0
    assert second.stats["bytes_fetched"] <= metadata   # no tensor byte came from the store


def test_damaged_cache_entry_is_detected_and_refetched(run, tmp_path):
    cache_dir = str(tmp_path / "cache")
    SnapshotReader(run.url, cache_dir=cache_dir).read_tensors(6)
    entries = DiskCache(cache_dir).entries()
    assert entries
    path = max(entries, key=lambda e: e[1])[0]
    with open(path, "r+b") as f:                      # flip a payload byte: the entry's own checksum fails
        f.seek(-10, os.SEEK_END)
        b = f.read(1)
        f.seek(-10, os.SEEK_END)
        f.write(bytes([b[0] ^ 0xFF]))
    r = SnapshotReader(run.url, cache_dir=cache_dir)
    assert_same(r.read_tensors(6), run.truth[6])
    assert r.stats["bytes_fetched"] > 0
    again = SnapshotReader(run.url, cache_dir=cache_dir)  # the entry was rewritten whole
    again.read_tensors(6)
    assert again.stats["cache_hits"] == r.stats["cache_hits"] + 1


def test_well_formed_cache_entry_with_wrong_content_is_refetched(run, tmp_path):
    cache_dir = str(tmp_path / "cache")
    r0 = SnapshotReader(run.url, cache_dir=cache_dir)
    r0.read_tensors(6)
    m = r0.manifest(5)
    name, e = next((n, e) for n, e in sorted(m.tensors.items()) if e.object is not None)
    obj = m.objects[e.object]
    cache = DiskCache(cache_dir)
    good = cache.get(obj.xxh3, obj.size, e.offset, e.offset + e.length)
    cache.put(obj.xxh3, obj.size, e.offset, e.offset + e.length, bytes(len(good)))  # a valid entry, wrong bytes
    r = SnapshotReader(run.url, cache_dir=cache_dir)
    assert bits_equal(r.read_tensor(6, name), run.truth[6][name])
    assert cache.get(obj.xxh3, obj.size, e.offset, e.offset + e.length) == good


@pytest.mark.parametrize("bad", ["../../etc/passwd", "0123456789abcdeg", "0123456789ABCDEF", "01/3456789abcdef"])
def test_cache_keys_are_never_paths_from_strings(tmp_path, bad):
    with pytest.raises(ValueError):
        DiskCache(str(tmp_path)).path(bad, 10, 0, 5)
    with pytest.raises(ValueError):
        DiskCache(str(tmp_path)).path("0123456789abcdef", 10, 5, 11)


def test_cache_prune_drops_least_recently_used(tmp_path):
    c = DiskCache(str(tmp_path / "c"))
    for i in range(5):
        c.put(f"{i:016x}", 1000, 0, 1000, bytes([i]) * 1000)
        os.utime(c.path(f"{i:016x}", 1000, 0, 1000), (i, i))
    c.get(f"{0:016x}", 1000, 0, 1000)               # a hit refreshes entry 0
    c.prune(max_bytes=2 * 1100)
    assert c.get(f"{0:016x}", 1000, 0, 1000) is not None
    assert c.get(f"{4:016x}", 1000, 0, 1000) is not None
    assert c.get(f"{1:016x}", 1000, 0, 1000) is None


# --- materialize -----------------------------------------------------------------------------------

def test_materialize_writes_a_loadable_hf_directory(run, tmp_path):
    r = SnapshotReader(run.url)
    out = r.materialize(6, str(tmp_path / "ckpt"))
    files = sorted(os.listdir(out))
    assert files == ["config.json", "model.safetensors", "tokenizer.json"]
    assert_same(load_file(os.path.join(out, "model.safetensors")), run.truth[6])
    with open(os.path.join(out, "config.json"), "rb") as f:
        assert f.read() == CONFIG_JSON
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:
        assert f.metadata()["format"] == "pt" and f.metadata()["ckptdelta_version"] == "6"
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".ckpt")]


def test_materialize_shards_with_an_index(run, tmp_path):
    r = SnapshotReader(run.url)
    out = write_checkpoint(r, 3, str(tmp_path / "ckpt"), shard_bytes=8000)
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        index = json.load(f)
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    got = {}
    for s in shards:
        got.update(load_file(os.path.join(out, s)))
    assert_same(got, run.truth[3])
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in run.truth[3].values())


def test_materialize_refuses_a_non_empty_directory_and_leaves_nothing_on_failure(run, tmp_path):
    r = SnapshotReader(run.url)
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    with pytest.raises(FileExistsError):
        r.materialize(1, str(tmp_path / "busy"))
    (tmp_path / "empty").mkdir()
    r.materialize(1, str(tmp_path / "empty"))                   # an empty directory is fine
    assert_same(load_file(str(tmp_path / "empty" / "model.safetensors")), run.truth[1])
    m = r.manifest(0)
    flip_byte(run.store, m.objects[0].key, m.objects[0].size - 3)   # corrupt the last tensor's data
    with pytest.raises(ChecksumError):
        SnapshotReader(run.url).materialize(0, str(tmp_path / "out"))
    assert sorted(os.listdir(tmp_path)) == ["busy", "empty", "run"]


# --- verify -----------------------------------------------------------------------------------------

def test_verify_passes_on_a_good_run(run):
    rep = SnapshotReader(run.url).verify()
    assert rep.version == 6 and rep.chain == [4, 5, 6]
    assert rep.tensors_checked == 3 * len(run.truth[6])
    assert rep.objects_checked == sum(len(run.manifests[v].objects) + len(run.manifests[v].extra_files)
                                      for v in (4, 5, 6))


def test_verify_reads_each_object_of_the_chain_once_and_shows_progress(run, monkeypatch, capsys):
    """Regression (issue 15, item 7): verify read the chain twice (every object whole for its digest, then every
    tensor again to rebuild it). Bytes are counted where they leave fsspec, below the code under test."""
    reader = SnapshotReader(run.url)
    real = reader.store.fs.cat_file
    read: dict[str, int] = {}

    def counting(path, start=None, end=None, **kw):
        data = real(path, start=start, end=end, **kw)
        read[path] = read.get(path, 0) + len(data)
        return data

    monkeypatch.setattr(reader.store.fs, "cat_file", counting)
    rep = reader.verify(6, progress=True)
    objects = {o.key: o.size for v in (4, 5, 6) for o in (*run.manifests[v].objects, *run.manifests[v].extra_files)}
    assert len(objects) == rep.objects_checked and any(k.endswith(".safetensors") for k in objects)
    by_key = {p[len(reader.store.root) + 1:]: n for p, n in read.items()}
    assert {k: by_key.get(k) for k in objects} == objects        # each object's bytes exactly once
    others = {k: n for k, n in by_key.items() if k not in objects}
    assert set(others) <= {"RUN.json", "HEAD", *(manifest_key(v) for v in (4, 5, 6))}
    assert rep.bytes_read == sum(by_key.values())
    assert "verify v00000006" in capsys.readouterr().err         # tqdm, asked for; off when not a terminal


def test_verify_catches_a_flipped_byte_in_an_anchor_shard(run):
    key = run.manifests[4].objects[1].key
    flip_byte(run.store, key, run.store.size(key) // 2)
    with pytest.raises(ChecksumError, match=key):
        SnapshotReader(run.url).verify(6)
    SnapshotReader(run.url).verify(3)  # another anchor's chain is unaffected


def test_verify_catches_a_flipped_byte_in_a_delta_object(run):
    key = run.manifests[5].objects[0].key
    flip_byte(run.store, key, 20)
    with pytest.raises(ChecksumError, match=key):
        SnapshotReader(run.url).verify(6)


def test_verify_catches_a_flipped_byte_in_a_manifest(run):
    raw = run.store.get(manifest_key(5))
    e = json.loads(raw)["tensors"]["model.norm.weight"]["xxh3"]
    i = raw.index(e.encode())
    bad = bytearray(raw)
    bad[i] = ord("0") if bad[i] != ord("0") else ord("1")
    run.store.put(manifest_key(5), bytes(bad))
    with pytest.raises(ChecksumError, match="model.norm.weight"):
        SnapshotReader(run.url).verify(6)
    bad = bytearray(raw)
    bad[0] ^= 0x01                                       # not JSON any more
    run.store.put(manifest_key(5), bytes(bad))
    with pytest.raises(ManifestError):
        SnapshotReader(run.url).verify(6)


def test_verify_checks_the_head_manifest_digest(run):
    raw = json.loads(run.store.get(manifest_key(6)))
    raw["metadata"] = {"tampered": "yes"}               # schema-valid, but not what the head pointer hashed
    run.store.put(manifest_key(6), json.dumps(raw).encode())
    with pytest.raises(ChecksumError, match="head pointer"):
        SnapshotReader(run.url).verify(6)


def test_reads_refuse_corrupt_tensor_bytes(run):
    m = run.manifests[0]
    e = m.tensors["model.norm.weight"]
    flip_byte(run.store, m.objects[e.object].key, e.offset + 1)
    with pytest.raises(ChecksumError, match="model.norm.weight"):
        SnapshotReader(run.url).read_tensor(2, "model.norm.weight")
    m = run.manifests[2]
    e = m.tensors["lm_head.weight"]
    flip_byte(run.store, m.objects[e.object].key, e.offset + e.length - 1)
    with pytest.raises(DeltaError, match="lm_head.weight"):
        SnapshotReader(run.url).read_tensor(2, "lm_head.weight")


# --- CLI ---------------------------------------------------------------------------------------------

def test_cli_materialize_and_verify(run, tmp_path, capsys):
    out = str(tmp_path / "m")
    assert cli_read.main(["materialize", run.url, "v00000005", out, "--no-progress"]) == 0
    assert_same(load_file(os.path.join(out, "model.safetensors")), run.truth[5])
    assert cli_read.main(["verify", run.url]) == 0
    assert "ok: v00000006" in capsys.readouterr().out
    assert cli_read.main(["verify", run.url, "../etc"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("ckptdelta verify: error:") and err.count("\n") == 1
    flip_byte(run.store, run.manifests[6].objects[0].key, 30)
    assert cli_read.main(["verify", run.url, "6"]) == 1
    assert "ckptdelta verify: error:" in capsys.readouterr().err
    assert cli_read.main(["materialize", run.url, "1", out, "--storage-options", "[1]"]) == 2   # a usage error


def test_trajectory_really_changes_and_keeps_tensors():
    vs = trajectory(3)
    assert not bits_equal(vs[0]["lm_head.weight"], vs[1]["lm_head.weight"])
    assert bits_equal(vs[0]["model.layers.0.frozen.bias"], vs[2]["model.layers.0.frozen.bias"])


def test_runs_written_by_the_real_publisher_read_back(tmp_path):
    from ckptdelta.publisher.publisher import Publisher

    versions = trajectory(5, seed=4)
    with Publisher(str(tmp_path / "run"), anchor_every=3, shard_bytes=6000,
                   extra_files={"config.json": CONFIG_JSON}) as pub:
        for i, w in enumerate(versions):
            pub.publish(w, step=10 * i)
    r = SnapshotReader(str(tmp_path / "run"))
    assert r.versions() == [0, 1, 2, 3, 4] and r.latest() == 4
    assert [m.version for m in r.chain(4)] == [3, 4]
    for v in range(5):
        assert_same(r.read_tensors(v), versions[v])
    assert r.verify().chain == [3, 4]
    out = r.materialize(2, str(tmp_path / "m"))
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    assert_same(load_file(os.path.join(out, "model.safetensors")), versions[2])
