"""Hostile or wrong input: each gets a clear error or a 4xx, and nothing is lost.

Trainer side: schema changes start an anchor (not an error), odd tensors publish
by their logical content, NaNs bit-exact, a step that goes back and a second
publisher are refused without touching the run. Replica side: malformed,
unsafe, unknown, oversized, unauthenticated and foreign-run hot-loads are
answered 4xx while the replica keeps serving. Bucket side: a hostile bucket
(a manifest declaring a 2^40-element tensor, lying object sizes, a record
header or a footer claiming huge sizes, keys that climb out of the run) makes a
reader, a HotSwapper and a live replica fail cleanly, with the memory they
allocate staying small (tracemalloc peak, RSS high-water mark) and nothing
written outside the cache directory.
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import threading
import tracemalloc
from collections import Counter

import httpx
import numpy as np
import pytest
import torch
import xxhash

from ckptdelta.delta import dtypes
from ckptdelta.delta.container import END_MAGIC, OBJECT_MAGIC, TRAILER, footer_length, read_index
from ckptdelta.delta.errors import (CkptDeltaError, ConcurrentPublisherError, FormatError, HotLoadError,
                                    PublishInputError, RunMismatchError, ShapeMismatchError)
from ckptdelta.delta.manifest import manifest_key
from ckptdelta.delta.record import RAW, ChunkEntry, RecordHeader, header_size_for, pack_header
from ckptdelta.loader.hotswap import HotSwapper
from ckptdelta.loader.reader import SnapshotReader
from ckptdelta.publisher import Publisher
from tests.publisher_helpers import assert_same, clone, perturb, weights
from tests.replicas import lm_dir, run, start_replica, state_bits_equal  # noqa: F401

API_KEY = "s3cret-token"
#: what a hostile bucket may make a reader or replica allocate while refusing it (the model is ~100 KB)
MEMORY_LIMIT = 64 << 20
RSS_GROWTH_LIMIT = 512 << 20


def _read_all(url: str) -> dict[int, dict[str, torch.Tensor]]:
    r = SnapshotReader(url)
    return {v: r.read_tensors(v) for v in r.versions()}


# --- the trainer's side -------------------------------------------------------------------------------

def test_changed_shapes_dtypes_and_tensor_sets_start_an_anchor_and_read_back_exactly(tmp_path):
    url = str(tmp_path / "run")
    w = weights()
    history, kinds = [], []
    with Publisher(url, progress=False) as pub:
        def publish(step: int, want: str) -> None:
            r = pub.publish(w, step)
            history.append(clone(w))
            kinds.append((r.kind, want, r.reason))
        publish(0, "anchor")
        perturb(w, 1)
        publish(1, "delta")
        w["layers.0.norm"] = torch.randn(48)                            # shape
        publish(2, "anchor")
        w["head.bias"] = w["head.bias"].to(torch.bfloat16)              # dtype
        publish(3, "anchor")
        w["layers.1.mlp.w"] = torch.randn(8, 8).to(torch.bfloat16)     # added
        publish(4, "anchor")
        del w["step_count"]                                             # removed
        publish(5, "anchor")
        perturb(w, 2)
        publish(6, "delta")
    for v, (kind, want, reason) in enumerate(kinds):
        assert kind == want, (v, kind, reason)
        if v in (2, 3, 4, 5):
            assert "tensors changed" in reason, reason
    got = _read_all(url)
    for v, want in enumerate(history):
        assert_same(got[v], want)
    live = clone(history[1])                  # a replica of the old schema refuses the new one, intact
    swapper = HotSwapper(live, SnapshotReader(url), version=1)
    with pytest.raises(ShapeMismatchError, match="layers.0.norm"):
        swapper.prepare(2)
    assert swapper.version == 1
    assert_same(live, history[1])


def test_odd_tensors_publish_by_content_nan_bit_exact_and_meta_is_refused(tmp_path):
    url = str(tmp_path / "run")
    base = torch.randn(16, 24).to(torch.bfloat16)
    nan = torch.zeros(64, dtype=torch.bfloat16)
    nan.view(torch.int16)[:6] = torch.tensor([0x7FC1, -0x3D, 0x7F80, -0x80, -0x8000, 0x0001], dtype=torch.int16)
    f32 = torch.zeros(8, dtype=torch.float32)
    f32.view(torch.int32)[:3] = torch.tensor([0x7FA00001, -0x00400001, 0x7F800000], dtype=torch.int32)  # sNaN
    w = {"t": base.t(), "strided": base[::2, 1::3], "nan": nan, "f32nan": f32, "np": np.arange(10, dtype=np.int32)}
    with Publisher(url, progress=False) as pub:
        assert pub.publish(w, 0).version == 0
        with pytest.raises(PublishInputError, match="meta"):
            pub.publish({**w, "m": torch.empty(4, device="meta")}, 1)
        assert SnapshotReader(url).versions() == [0]       # nothing of the refused publish is visible
        nan.view(torch.int16)[10] = 0x7FC5                  # another NaN payload
        assert pub.publish(w, 1).kind == "delta"
    got = _read_all(url)
    want = {k: (torch.from_numpy(v) if isinstance(v, np.ndarray) else v.contiguous()) for k, v in w.items()}
    assert_same(got[1], want)
    assert dtypes.host_bits(got[1]["nan"])[10] == 0x7FC5 and dtypes.host_bits(got[1]["f32nan"])[0] == 0x7FA00001


@pytest.mark.parametrize("name", ["__metadata__", "x" * 4097, "bad\udc80surrogate"])
def test_a_tensor_name_the_format_reserves_or_cannot_hold_is_refused_at_publish_naming_it(tmp_path, name):
    """Regression: a tensor named ``__metadata__`` replaced the shard header's metadata entry; the publisher
    committed an anchor its own verify refused and safetensors could not open."""
    url = str(tmp_path / "run")
    w = weights()
    with Publisher(url, progress=False) as pub:
        with pytest.raises(PublishInputError, match=re.escape(f"tensor {name!r}"[:20])):
            pub.publish({**w, name: torch.zeros(4)}, 0)
        assert not os.path.exists(os.path.join(url, "manifests"))     # nothing committed
        assert pub.publish(w, 0).version == 0                       # the publisher stays usable
    assert SnapshotReader(url).verify(0).tensors_checked == len(w)


def test_a_step_that_goes_back_is_refused_and_the_run_is_intact(tmp_path):
    url = str(tmp_path / "run")
    w = weights()
    with Publisher(url, progress=False) as pub:
        pub.publish(w, 10)
        before = clone(w)
        perturb(w, 3)
        with pytest.raises(PublishInputError, match="backwards|lower"):
            pub.publish(w, 9)
        assert pub.publish(w, 10).version == 1              # the same step again is allowed
    with Publisher(url, progress=False) as again:           # and a restarted publisher remembers
        with pytest.raises(PublishInputError):
            again.publish(w, 3)
    got = _read_all(url)
    assert sorted(got) == [0, 1]
    assert_same(got[0], before)
    assert_same(got[1], w)


def test_two_publishers_racing_on_one_run_commit_exactly_one_snapshot_per_version(tmp_path):
    url = str(tmp_path / "run")
    w = weights()
    with Publisher(url, progress=False) as first:
        first.publish(w, 0)
    truth = {0: clone(w)}
    outcomes: Counter = Counter()
    rounds = 4
    for rnd in range(1, rounds + 1):
        pubs = [Publisher(url, progress=False) for _ in range(2)]
        cands = [clone(truth[rnd - 1]) for _ in pubs]
        for i, c in enumerate(cands):
            perturb(c, 100 * rnd + i)
        barrier = threading.Barrier(2)
        results: list = [None, None]

        def race(i: int) -> None:
            barrier.wait()
            try:
                results[i] = pubs[i].publish(cands[i], rnd)
            except ConcurrentPublisherError as e:
                results[i] = e

        threads = [threading.Thread(target=race, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        won = [i for i, r in enumerate(results) if not isinstance(r, BaseException)]
        assert len(won) == 1, results
        loser = results[1 - won[0]]
        outcomes["lost before uploading" if "already committed" in str(loser) else "lost at the commit"] += 1
        truth[rnd] = cands[won[0]]
        with pytest.raises(ConcurrentPublisherError):         # the loser stays stopped
            pubs[1 - won[0]].publish(cands[1 - won[0]], rnd + 1)
        for p in pubs:
            try:
                p.close()
            except CkptDeltaError:
                pass
    print(f"\n  two publishers, {rounds} races: one winner each; losers: {dict(outcomes)}")
    got = _read_all(url)
    assert sorted(got) == list(range(rounds + 1))
    for v, want in truth.items():
        assert_same(got[v], want)


# --- the replica's front door -----------------------------------------------------------------------

def _raw(rep, body: bytes, headers: dict | None = None) -> httpx.Response:
    return rep.http.post("/v1/hotload", content=body, headers={"Content-Type": "application/json", **(headers or {})})


def test_hostile_hotload_requests_get_a_clear_4xx_and_the_replica_keeps_serving(start_replica, run):  # noqa: F811
    rep = start_replica(1, api_key=API_KEY)
    bad_token = {"Authorization": "Bearer wrong"}
    cases = [  # (what, response thunk, allowed statuses)
        ("unknown version", lambda: rep.post("/v1/hotload", {"snapshot": 99}), {404}),
        ("unknown name", lambda: rep.post("/v1/hotload", {"snapshot": "v00000099"}), {404}),
        ("version past 2^62", lambda: rep.post("/v1/hotload", {"snapshot": 2 ** 70}), {400, 404}),
        ("negative version", lambda: rep.post("/v1/hotload", {"snapshot": -1}), {400}),
        ("malformed JSON", lambda: _raw(rep, b'{"snapshot": 1'), {400}),
        ("not an object", lambda: _raw(rep, b"[1, 2]"), {400}),
        ("float", lambda: rep.post("/v1/hotload", {"snapshot": 1.5}), {400}),
        ("bool", lambda: rep.post("/v1/hotload", {"snapshot": True}), {400}),
        ("null", lambda: rep.post("/v1/hotload", {"snapshot": None}), {400}),
        ("list", lambda: rep.post("/v1/hotload", {"snapshot": [1]}), {400}),
        ("extra field", lambda: rep.post("/v1/hotload", {"snapshot": 1, "path": "/etc"}), {400}),
        ("empty body", lambda: _raw(rep, b""), {400}),
        ("binary body", lambda: _raw(rep, bytes(range(256))), {400}),
        ("oversized body", lambda: _raw(rep, b'{"snapshot": "' + b"a" * (2 << 20) + b'"}'), {413}),
        ("oversized chunked body", lambda: rep.http.post("/v1/hotload", content=iter([b"x" * (1 << 19)] * 4)),
         {413}),
        ("missing token", lambda: httpx.post(rep.url + "/v1/hotload", json={"snapshot": 2}), {401}),
        ("wrong token", lambda: rep.http.post("/v1/hotload", json={"snapshot": 2}, headers=bad_token), {401}),
        ("wrong scheme", lambda: rep.http.post("/v1/hotload", json={"snapshot": 2},
                                               headers={"Authorization": f"Basic {API_KEY}"}), {401}),
        ("unknown job id", lambda: rep.http.get("/v1/hotload/..%2F..%2Fetc%2Fpasswd"), {404}),
    ]
    for unsafe in ("../run", "../../etc/passwd", "/etc/passwd", "a/b", "..", "v1/../v2", "", "latest/..",
                   "C:\\windows", "v00000001\x00", "%2e%2e%2f", "~root", " latest"):
        cases.append((f"snapshot {unsafe!r}", lambda u=unsafe: rep.post("/v1/hotload", {"snapshot": u}), {400, 404}))
    statuses: Counter = Counter()
    for what, call, allowed in cases:
        r = call()
        statuses[r.status_code] += 1
        assert r.status_code in allowed, (what, r.status_code, r.text[:300])
        err = r.json()["error"]
        assert err["type"] and err["message"], (what, r.text[:300])
        status = rep.status()
        assert status["policy_version"] == 1 and status["last_hotload"] is None, (what, status)
    print(f"\n  {len(cases)} hostile hot-load requests -> {dict(sorted(statuses.items()))}; replica still at v1")
    assert rep.complete(max_tokens=2, return_engine_data=True)["engine_data"]["policy_version"] == 1
    assert state_bits_equal(rep.engine.model, run.truth[1]) == []
    assert not any(os.path.exists(p) for p in ("/etc/passwd.ckptdelta", os.path.join(run.url, "..", "run.tmp")))


def _copy_run(run, tmp_path) -> str:  # noqa: F811
    dst = str(tmp_path / "bucket" / "run")
    shutil.copytree(run.url, dst)
    return dst


def _write_manifest(url: str, doc: dict) -> None:
    with open(os.path.join(url, manifest_key(doc["version"])), "wb") as f:
        f.write(json.dumps(doc).encode())


def _manifest_doc(url: str, v: int) -> dict:
    with open(os.path.join(url, manifest_key(v)), "rb") as f:
        return json.loads(f.read())


def test_a_snapshot_of_another_run_is_refused(start_replica, run, tmp_path):  # noqa: F811
    url = _copy_run(run, tmp_path)
    doc = _manifest_doc(url, 3)
    doc.update(run_id="someone-elses-run", version=4, name="v00000004", parent_version=3)
    _write_manifest(url, doc)
    rep = start_replica(1, bucket=url)
    r = rep.post("/v1/hotload", {"snapshot": 4})
    assert r.status_code == 400 and "someone-elses-run" in r.json()["error"]["message"], r.text
    with pytest.raises(RunMismatchError, match="someone-elses-run"):
        SnapshotReader(url).read_tensors(4)
    with pytest.raises(RunMismatchError):
        SnapshotReader(url, run_id="another-run").read_tensors(1)
    assert rep.status()["policy_version"] == 1 and state_bits_equal(rep.engine.model, run.truth[1]) == []
    assert rep.hotload(3)["state"] == "READY"                  # the run itself is intact
    assert state_bits_equal(rep.engine.model, run.truth[3]) == []


# --- a hostile bucket ---------------------------------------------------------------------------------

def _huge_anchor(url: str, v: int) -> dict:
    """An anchor whose biggest tensor claims 2^40 elements, in an object claiming 2^50 bytes."""
    doc = _manifest_doc(url, 0)
    name = max(doc["tensors"], key=lambda n: doc["tensors"][n]["length"])
    e = doc["tensors"][name]
    e["shape"], e["length"] = [1 << 20, 1 << 20], (1 << 40) * dtypes.by_name(e["dtype"]).itemsize
    doc["objects"][e["object"]]["size"] = 1 << 50
    doc.update(version=v, name=f"v{v:08d}", parent_version=3, anchor_version=v)
    return doc


def _lying_sizes(url: str, v: int) -> dict:
    """An anchor whose objects claim 2^45 bytes (the entries still point at the real data)."""
    doc = _manifest_doc(url, 0)
    for o in doc["objects"]:
        o["size"] = 1 << 45
    doc.update(version=v, name=f"v{v:08d}", parent_version=3, anchor_version=v)
    return doc


def _huge_record(url: str, v: int) -> dict:
    """A delta re-adding a tensor as 2^36 elements: its record's header claims 4096 chunks of 1 GiB
    payload each, and the object holds none of them."""
    doc = _manifest_doc(url, 3)
    name = "model.norm.weight"
    e = doc["tensors"][name]
    n_chunks, chunk_elems = 1 << 12, 1 << 24
    dt = dtypes.by_name(e["dtype"])
    chunks = tuple(ChunkEntry(RAW, 0, dt.itemsize, chunk_elems, 1 << 30, 0) for _ in range(n_chunks))
    header = RecordHeader(name, dt, (n_chunks * chunk_elems,), n_chunks * chunk_elems, chunk_elems, 0, 0, False,
                          chunks, header_size_for(1, len(name.encode()), n_chunks))
    rec = pack_header(header)
    obj = OBJECT_MAGIC + rec
    key = f"deltas/{v:012d}-hostile/rank-00000.ckd"
    os.makedirs(os.path.join(url, os.path.dirname(key)), exist_ok=True)
    with open(os.path.join(url, key), "wb") as f:
        f.write(obj)
    for t in doc["tensors"].values():
        t.update(object=None, offset=0, length=0)
    doc["tensors"][name] = {"dtype": e["dtype"], "shape": [n_chunks * chunk_elems], "xxh3": "0" * 16,
                            "object": 0, "offset": len(OBJECT_MAGIC), "length": len(rec)}
    doc["objects"] = [{"key": key, "size": len(obj), "xxh3": f"{xxhash.xxh3_64_intdigest(obj):016x}"}]
    doc.update(version=v, name=f"v{v:08d}", parent_version=3, kind="delta")
    return doc


def _escaping(field: str, value: str):
    def make(url: str, v: int) -> dict:
        doc = _manifest_doc(url, 0)
        doc["objects"][0][field] = value
        doc.update(version=v, name=f"v{v:08d}", parent_version=3, anchor_version=v)
        return doc
    return make


HOSTILE = [
    ("2^40-element tensor", _huge_anchor),
    ("object sizes lying", _lying_sizes),
    ("record header claiming 4 TiB", _huge_record),
    ("key ../../escape.bin", _escaping("key", "../../escape.bin")),
    ("key /tmp/escape.bin", _escaping("key", "/tmp/escape.bin")),
    ("key anchors/../../../escape.bin", _escaping("key", "anchors/../../../escape.bin")),
    ("xxh3 ../../../escape", _escaping("xxh3", "../../../escape")),
]


def _files(root: str) -> set[str]:
    out = set()
    for d, _dirs, files in os.walk(root):
        out.update(os.path.join(d, f) for f in files)
    return out


def _measured(fn) -> tuple[object, int]:
    """(fn()'s result or exception, tracemalloc peak in bytes while it ran)."""
    tracemalloc.start()
    try:
        try:
            out: object = fn()
        except Exception as e:  # noqa: BLE001 - returned for the caller to judge
            out = e
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_hostile_bucket_cannot_make_a_reader_or_replica_allocate_or_write_what_it_claims(
        start_replica, run, tmp_path):  # noqa: F811
    url = _copy_run(run, tmp_path)
    cache = str(tmp_path / "cache")
    rep = start_replica(1, bucket=url)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    before = _files(str(tmp_path)) - _files(url)
    rows = []
    for i, (what, make) in enumerate(HOSTILE):
        v = 4 + i
        _write_manifest(url, make(url, v))
        exact = run.truth[0] if make is _lying_sizes else None

        def read(v=v):
            return SnapshotReader(url, cache_dir=cache).read_tensors(v)
        got, peak_read = _measured(read)
        if isinstance(got, Exception):
            assert isinstance(got, CkptDeltaError), (what, repr(got))
        else:   # the lies touched no byte the read needs: then it must be the truth
            assert exact is not None, (what, "read a hostile snapshot")
            assert state_bits_equal_dict(got, exact), what

        live = {k: t.clone() for k, t in run.truth[1].items()}
        swapper = HotSwapper(live, SnapshotReader(url), version=1)
        err, peak_swap = _measured(lambda v=v: swapper.prepare(v))
        if exact is None:
            assert isinstance(err, (CkptDeltaError, HotLoadError)), (what, repr(err))
            assert swapper.version == 1 and state_bits_equal_dict(live, run.truth[1]), what

        def hotload(v=v):
            r = rep.post("/v1/hotload", {"snapshot": v})
            if r.status_code != 202:
                return r.status_code, r.json()["error"]["message"]
            job = rep.wait(r.json()["id"])
            return job["state"], job.get("reason") or ""
        (state, reason), peak_replica = _measured(hotload)
        if exact is None:
            assert state in ("FAILED", 400, 404, 502), (what, state, reason)
            assert rep.status()["policy_version"] == 1 and state_bits_equal(rep.engine.model, run.truth[1]) == []
        else:   # a harmless lie: the replica went to v (exact) and comes back
            assert state == "READY" and state_bits_equal(rep.engine.model, exact) == [], (what, state, reason)
            assert rep.hotload(1)["state"] == "READY"
        peak = max(peak_read, peak_swap, peak_replica)
        rows.append((what, type(got).__name__ if isinstance(got, Exception) else "exact", state, peak))
        assert peak < MEMORY_LIMIT, (what, peak)
    rss_growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss0
    print("\n  hostile bucket: case -> reader / replica, tracemalloc peak")
    for what, r, s, peak in rows:
        print(f"    {what:<34} {r:<16} {str(s):<7} {peak / 2**20:7.2f} MiB")
    print(f"  RSS high-water growth over all cases: {rss_growth / 2**20:.1f} MiB")
    assert rss_growth < RSS_GROWTH_LIMIT
    new_files = (_files(str(tmp_path)) - _files(url)) - before
    assert all(p.startswith(cache + os.sep) for p in new_files), sorted(new_files)[:5]
    assert not any("escape" in p for p in _files(str(tmp_path.parent)) | _files("/tmp") if p.endswith("escape.bin"))
    assert rep.hotload(3)["state"] == "READY" and state_bits_equal(rep.engine.model, run.truth[3]) == []


def state_bits_equal_dict(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return sorted(got) == sorted(want) and all(
        got[k].dtype == want[k].dtype and got[k].shape == want[k].shape
        and torch.equal(got[k].contiguous().view(torch.uint8), want[k].contiguous().view(torch.uint8)) for k in want)


def test_footers_and_records_claiming_huge_sizes_are_refused_before_allocation():
    """The parsers a tool uses on a delta object (``ckptdelta inspect``) check every claimed size
    against the bytes present before allocating anything."""
    footer = json.dumps({"records": {"w": [8, 16]}}).encode()
    obj = OBJECT_MAGIC + b"\0" * 16 + footer + TRAILER.pack(len(footer), xxhash.xxh3_64_intdigest(footer), END_MAGIC)
    assert read_index(obj, len(obj)) == {"w": (8, 16)}
    claims = [1 << 60, (64 << 20) - 1, len(obj)]
    peaks = []
    for n in claims:
        bad = obj[:-TRAILER.size] + TRAILER.pack(n, 0, END_MAGIC)
        err, peak = _measured(lambda bad=bad: read_index(bad, len(bad)))
        assert isinstance(err, FormatError), repr(err)
        peaks.append(peak)
    big = json.dumps({"records": {"w": [8, 1 << 62]}}).encode()
    bad = OBJECT_MAGIC + big + TRAILER.pack(len(big), xxhash.xxh3_64_intdigest(big), END_MAGIC)
    with pytest.raises(FormatError, match="out of bounds"):
        read_index(bad, len(bad))
    assert footer_length(obj[-TRAILER.size:]) == len(footer)

    from ckptdelta.delta import EncodedTensor
    name = "w"
    chunks = tuple(ChunkEntry(RAW, 0, 2, 1 << 24, 1 << 40, 0) for _ in range(64))
    h = RecordHeader(name, dtypes.by_name("BF16"), (64 << 24,), 64 << 24, 1 << 24, 0, 0, False, chunks,
                     header_size_for(1, 1, 64))
    err, peak = _measured(lambda: EncodedTensor.from_bytes(pack_header(h)))
    assert isinstance(err, FormatError), repr(err)
    peaks.append(peak)
    print(f"\n  footers claiming {claims} bytes and a record claiming 64 TiB of payload: refused; "
          f"tracemalloc peak {max(peaks) / 2**10:.0f} KiB")
    assert max(peaks) < MEMORY_LIMIT


def test_a_local_range_read_never_allocates_the_length_a_manifest_claims(tmp_path):
    """Regression: the local backend read a range with read(end - start), which allocates the whole
    length first: a hostile manifest's 2 TiB entry became a MemoryError (or an 8 GiB buffer)."""
    from ckptdelta.delta.storage import Store
    store = Store.from_url(str(tmp_path))
    store.put("obj", b"x" * 1000)
    for n in (1 << 33, 1 << 41):
        data, peak = _measured(lambda n=n: store.get("obj", (8, 8 + n)))
        assert data == b"x" * 992 and peak < MEMORY_LIMIT, (n, peak)


# --- a record longer than its tensor ------------------------------------------------------------------

def _claiming_run(tmp_path, claim: int) -> tuple[str, dict]:
    """A run of one 16-element float32 tensor (anchor 0, delta 1), then a delta 2 whose manifest says the
    tensor's record is ``claim`` bytes long, in an object (sparse on disk) that big."""
    from tests.bucketgen import write_run
    w0 = torch.arange(16, dtype=torch.float32)
    run = write_run(str(tmp_path / "claims" / "run"), versions=[{"w": w0}, {"w": w0 + 1}], n_shards=1,
                    objects_per_delta=1)
    url = run.url
    doc = _manifest_doc(url, 1)
    key = "deltas/000000000002-hostile/rank-00000.ckd"
    os.makedirs(os.path.join(url, os.path.dirname(key)), exist_ok=True)
    with open(os.path.join(url, key), "wb") as f:
        f.truncate(claim + 64)
    doc["objects"] = [{"key": key, "size": claim + 64, "xxh3": "0" * 16}]
    doc["tensors"]["w"].update(object=0, offset=64, length=claim)
    doc.update(version=2, name="v00000002", parent_version=1)
    _write_manifest(url, doc)
    return url, run.truth


def test_a_record_claiming_more_than_its_tensor_can_take_is_refused_before_it_is_downloaded(tmp_path):
    """Regression: a 16-element float32 tensor's delta record claiming 256 MiB was downloaded whole (256 MiB
    allocated) before its header was refused. The manifest's length is now bounded by the tensor's size
    (ckptdelta.delta.record.max_record_size), on every path that reads it."""
    url, truth = _claiming_run(tmp_path, 256 << 20)
    live = {"w": truth[1]["w"].clone()}
    swapper = HotSwapper(live, SnapshotReader(url), version=1)
    out = str(tmp_path / "out")
    for what, fn in [("read_tensors", lambda: SnapshotReader(url).read_tensors(2)),
                     ("verify", lambda: SnapshotReader(url).verify(2)),
                     ("materialize", lambda: SnapshotReader(url).materialize(2, out)),
                     ("hot-load", lambda: swapper.prepare(2))]:
        err, peak = _measured(fn)
        assert peak < 2 << 20, (what, peak, repr(err))
        assert isinstance(err, CkptDeltaError), (what, repr(err))
        assert "manifests/000000000002.json" in str(err) and "'w'" in str(err), (what, str(err))
    assert swapper.version == 1 and torch.equal(live["w"], truth[1]["w"])
    assert SnapshotReader(url).read_tensors(1)["w"].equal(truth[1]["w"])     # the run before it still reads


def test_a_reader_refuses_an_oversized_record_before_fetching_it_even_from_a_manifest_built_in_memory(tmp_path):
    """The manifest parser bounds a record's length; the fetch checks it again for manifests that did not come
    through the parser (built in code), with the same bound."""
    import dataclasses

    from ckptdelta.loader.fetch_units import Piece
    url, _ = _claiming_run(tmp_path, 256 << 20)
    reader = SnapshotReader(url)
    m = reader.manifest(1)
    e = m.tensors["w"]
    o = m.objects[e.object]
    hostile = dataclasses.replace(o, key="deltas/000000000002-hostile/rank-00000.ckd", size=(256 << 20) + 64)
    big = dataclasses.replace(m, objects=(hostile,),
                              tensors={"w": dataclasses.replace(e, object=0, offset=64, length=256 << 20)})
    err, peak = _measured(lambda: reader.fetch([Piece(big, "w")], use_cache=False))
    assert peak < 2 << 20, (peak, repr(err))
    assert isinstance(err, FormatError) and "'w'" in str(err) and "at most" in str(err), repr(err)


def test_an_extra_file_claiming_more_than_a_reader_takes_is_refused_before_it_is_read(tmp_path):
    """Extra files (config, tokenizer) are read whole: their size is bounded by the format, at publish and read."""
    from ckptdelta.delta.manifest import MAX_EXTRA_FILE_BYTES
    from ckptdelta.loader.reader import SnapshotReader
    from ckptdelta.publisher import Publisher

    big = tmp_path / "huge.bin"
    with open(big, "wb") as f:   # sparse: costs no disk
        f.truncate(MAX_EXTRA_FILE_BYTES + 1)
    with pytest.raises(PublishInputError, match="huge.bin"):
        Publisher(str(tmp_path / "refused"), extra_files={"huge.bin": str(big)})
    url = str(tmp_path / "run")
    with Publisher(url, extra_files={"config.json": b"{}"}, progress=False) as pub:
        pub.publish({"w": torch.arange(16, dtype=torch.float32)}, 0)
    mpath = os.path.join(url, manifest_key(0))
    m = json.load(open(mpath))
    (extra,) = m["extra_files"]
    with open(os.path.join(url, extra["key"]), "r+b") as f:   # the store agrees with the lie
        f.truncate(MAX_EXTRA_FILE_BYTES + 1)
    extra["size"] = MAX_EXTRA_FILE_BYTES + 1
    json.dump(m, open(mpath, "w"))
    tracemalloc.start()
    try:
        with pytest.raises(CkptDeltaError, match="extra file"):
            SnapshotReader(url).materialize(0, str(tmp_path / "out"))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2 << 20, peak
    assert not os.path.exists(tmp_path / "out")
