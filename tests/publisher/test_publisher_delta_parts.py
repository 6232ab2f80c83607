"""A rank's delta is written as parts: each finished part uploads while the next tensors encode,
and a snapshot spread over many parts reads back bit-exactly."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import xxhash

import ckptdelta.publisher.deltas as deltas
from ckptdelta.delta.storage import Store
from ckptdelta.loader import SnapshotReader
from ckptdelta.publisher import Publisher
from ckptdelta.publisher.writer import write_delta_object


def _weights(seed: int, n: int = 6) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layer{i}.w": (torch.randn(64, 64, generator=g) * 0.02).to(torch.bfloat16) for i in range(n)}


def _step(w: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: (v.float() + torch.randn(v.shape, generator=g) * 1e-4).to(torch.bfloat16) for k, v in w.items()}


def test_a_finished_part_uploads_while_later_tensors_are_still_encoding(tmp_path, monkeypatch):
    events: list[tuple[str, str]] = []
    lock = threading.Lock()
    real_encode_many = deltas.encode_many

    def slow_encode_many(*a, **k):
        for enc in real_encode_many(*a, **k):
            with lock:
                events.append(("encode", enc.name))
            time.sleep(0.05)
            yield enc

    monkeypatch.setattr(deltas, "encode_many", slow_encode_many)
    store = Store.from_url(str(tmp_path / "run"))
    real_put = store.put_file

    def logged_put(key, path):
        with lock:
            events.append(("upload", key))
        return real_put(key, path)

    monkeypatch.setattr(store, "put_file", logged_put)
    old = _weights(0)
    new = _step(old, 1)
    written = write_delta_object(store, old, new, version=1, writer_id="w", rank=0, level=3,
                                 progress=False, part_bytes=1)
    assert len(written.objects) == len(new)                       # one record per part at part_bytes=1
    first_upload = next(i for i, e in enumerate(events) if e[0] == "upload")
    last_encode = max(i for i, e in enumerate(events) if e[0] == "encode")
    assert first_upload < last_encode                             # upload overlapped encoding
    assert {e.object for e in written.entries.values()} == set(range(len(new)))
    assert all(store.size(o.key) == o.size for o in written.objects)


def test_a_delta_spread_over_many_parts_reads_back_bit_exactly(tmp_path, monkeypatch):
    monkeypatch.setattr(deltas, "DEFAULT_PART_BYTES", 2000)
    url = str(tmp_path / "run")
    w = _weights(0)
    versions = [w]
    with Publisher(url, progress=False) as pub:
        pub.publish(w, 0)
        for s in range(1, 3):
            w = _step(w, s)
            versions.append(w)
            res = pub.publish(w, s)
            assert res.kind == "delta"
    r = SnapshotReader(url)
    assert len(r.manifest(2).objects) > 1
    for v, expected in enumerate(versions):
        got = r.read_tensors(v)
        for k, t in expected.items():
            assert torch.equal(got[k].view(torch.int16), t.view(torch.int16)), (v, k)
    r.verify(2)


def test_context_coding_off_writes_only_zstd_encodings_and_reads_back(tmp_path):
    from ckptdelta.delta.codec import EncodedTensor

    url = str(tmp_path / "run")
    w0 = {"w": (torch.randn(256, 256) * 0.02).to(torch.bfloat16)}
    w1 = _step(w0, 3)
    with Publisher(url, progress=False, context_coding=False) as pub:
        pub.publish(w0, 0)
        pub.publish(w1, 1)
    r = SnapshotReader(url)
    m = r.manifest(1)
    e = m.tensors["w"]
    blob = Store.from_url(url).get(m.objects[e.object].key, (e.offset, e.offset + e.length))
    assert set(EncodedTensor.from_bytes(blob).encoding_counts()) <= {"sparse", "dense_step", "grouped_step", "dense_xor",
                                                                          "raw"}
    assert torch.equal(r.read_tensor(1, "w").view(torch.int16), w1["w"].view(torch.int16))


def test_write_delta_writes_encode_records_in_snapshot_order_across_parts(tmp_path):
    """Tensors encode in parallel, yet each record is encode()'s bytes and parts fill in the snapshot's order."""
    from ckptdelta.delta import codec
    from ckptdelta.delta.container import read_index

    old = _weights(0, n=12)
    new = _step(old, 1)
    new["layer4.w"] = old["layer4.w"].clone()                     # unchanged: an entry, no record
    seen = []
    part = deltas.write_delta(lambda i: open(tmp_path / f"part{i}", "wb"), old, new, level=3, part_bytes=12_000,
                              on_bytes=seen.append)
    assert list(part.entries) == list(new)
    assert part.changed == [k for k in new if k != "layer4.w"] and part.entries["layer4.w"].object is None
    assert seen == [t.numel() * t.element_size() for t in new.values()]
    objects = [part.entries[k].object for k in part.changed]
    assert objects == sorted(objects) and len(part.objects) == objects[-1] + 1 > 1
    for i, (size, xxh3) in enumerate(part.objects):
        data = (tmp_path / f"part{i}").read_bytes()
        assert len(data) == size and f"{xxhash.xxh3_64_intdigest(data):016x}" == xxh3
        mine = [k for k in part.changed if part.entries[k].object == i]
        assert sorted(read_index(data, size)) == sorted(mine)
        offsets = [part.entries[k].offset for k in mine]
        assert offsets == sorted(offsets)                         # records in snapshot order within a part
    for k in part.changed:
        e = part.entries[k]
        record = (tmp_path / f"part{e.object}").read_bytes()[e.offset: e.offset + e.length]
        assert record == codec.encode(old[k], new[k], name=k, level=3).to_bytes(), k


def test_a_delta_s_parts_start_small_and_double_up_to_the_part_size(tmp_path):
    """The first part closes early (its upload starts while most of the delta still encodes); each next one
    holds up to twice as much as the last, and none more than ``part_bytes``."""
    old = _weights(0, n=40)
    new = _step(old, 1)
    part = deltas.write_delta(lambda i: open(tmp_path / f"part{i}", "wb"), old, new, level=3, part_bytes=16_000,
                              first_part_bytes=2_000)
    by_part: dict[int, list] = {}
    for k in part.changed:
        by_part.setdefault(part.entries[k].object, []).append(part.entries[k])
    limits = [min(16_000, 2_000 << i) for i in range(len(part.objects))]
    assert limits[:4] == [2_000, 4_000, 8_000, 16_000] and len(part.objects) > 4
    for i, (size, _h) in enumerate(part.objects[:-1]):
        last = max(by_part[i], key=lambda e: e.offset)
        assert last.offset < limits[i] <= size, (i, last.offset, limits[i], size)   # closed at the first record past it
    r = sorted(by_part)
    assert r == list(range(len(part.objects)))


def test_a_publisher_hands_the_encoder_the_parent_digests_it_committed(tmp_path, monkeypatch):
    """The parent of a delta is what this publisher committed last, whose digests are in that manifest: the
    encoder takes them instead of reading every parent tensor once more to hash it. Parents rebuilt from the
    bucket (a new publisher) are hashed."""
    seen: list[dict] = []
    real = deltas.encode_many

    def spy(items, **kw):
        items = list(items)
        seen.append({it[0]: it[3] for it in items})
        return real(items, **kw)

    monkeypatch.setattr(deltas, "encode_many", spy)
    w0 = _weights(0)
    w1, w2 = _step(w0, 1), _step(_step(w0, 1), 2)
    url = str(tmp_path / "run")
    with Publisher(url, progress=False, codec="context") as pub:
        pub.publish(w0, 0)
        pub.publish(w1, 1)
    with Publisher(url, progress=False, codec="context") as pub:     # a restart: the parent is rebuilt
        pub.publish(w2, 2)
    reader = SnapshotReader(url)
    want = [{n: int(e.xxh3, 16) for n, e in reader.manifest(v).tensors.items()} for v in (0, 1)]
    assert seen == [want[0], {n: None for n in w0}]
    for v, w in ((1, w1), (2, w2)):
        got = reader.read_tensors(v)
        assert all(torch.equal(got[k].view(torch.int16), w[k].view(torch.int16)) for k in w)


def test_a_wrong_parent_digest_handed_to_the_encoder_never_gives_a_replica_wrong_bits(tmp_path):
    """A record whose header names the wrong parent digest (a caller's bug) still holds steps from the
    parent it was encoded against: applied to that parent it gives the new bits exactly (the result's
    digest proves them), applied to any other tensor it is refused as a wrong parent, nothing written."""
    from ckptdelta.delta import codec
    from ckptdelta.delta.errors import ParentMismatchError

    old = _weights(0, n=2)
    new = _step(old, 1)
    part = deltas.write_delta(lambda i: open(tmp_path / f"part{i}", "wb"), old, new, level=3,
                              parent_digests={"layer0.w": 12345})
    for k in new:
        e = part.entries[k]
        record = (tmp_path / f"part{e.object}").read_bytes()[e.offset: e.offset + e.length]
        live = old[k].clone()
        codec.apply_(live, record)
        assert torch.equal(live.view(torch.int16), new[k].view(torch.int16))
        if k == "layer0.w":
            other = _step(old, 7)[k]
            live = other.clone()
            with pytest.raises(ParentMismatchError, match="layer0.w"):
                codec.apply_(live, record)
            assert torch.equal(live.view(torch.int16), other.view(torch.int16))    # nothing written

def test_a_deltas_upload_time_is_how_long_any_of_its_parts_was_uploading_two_at_once_counted_once():
    """Two parts upload at once (a part's request has a fixed cost each would otherwise pay in turn); the upload
    time the codec chooser divides the bytes by is the union of their spans, not their sum."""
    from ckptdelta.publisher.writer import UPLOADS_IN_FLIGHT, busy_seconds

    assert UPLOADS_IN_FLIGHT == 2
    assert busy_seconds([]) == 0.0
    assert busy_seconds([(0.0, 1.0), (0.5, 2.0), (3.0, 4.0)]) == 3.0
    assert busy_seconds([(1.0, 2.0), (0.0, 5.0)]) == 5.0


def test_encode_threads_bounds_a_deltas_encode_and_changes_no_byte(tmp_path, monkeypatch):
    """A co-located trainer gives the encode its own cores: ``Publisher(encode_threads=1)`` encodes on one
    thread (encode_many's ``threads``), and its deltas are byte for byte the default's."""
    seen: list[int | None] = []
    real_encode_many = deltas.encode_many

    def recording(*a, **k):
        seen.append(k.get("threads"))
        return real_encode_many(*a, **k)

    monkeypatch.setattr(deltas, "encode_many", recording)
    monkeypatch.setattr(deltas, "ENCODE_BYTES_PER_THREAD", 1)     # the default: every core, on these small steps
    monkeypatch.setattr("os.cpu_count", lambda: 4)
    steps = [_weights(0)]
    for s in range(1, 4):
        steps.append(_step(steps[-1], s))
    stored = {}
    for threads in (1, None):
        url = str(tmp_path / f"run-{threads}")
        with Publisher(url, encode_threads=threads, codec="fast", run_id="r", progress=False,
                       anchor_chain_fraction=100.0) as pub:
            for i, w in enumerate(steps):
                pub.publish(w, i)
        store = Store.from_url(url)
        # deltas/<version>-<writer id>-<attempt>/<part>: the writer id differs from run to run
        stored[threads] = {(k.split("/")[1].split("-")[0], k.rsplit("/", 1)[-1]): store.get(k)
                           for k in store.list_prefix("deltas/")}
        got = SnapshotReader(url).read_tensors(3)
        assert all(torch.equal(got[k].view(torch.int16), steps[3][k].view(torch.int16)) for k in steps[3])
    assert seen == [1, 1, 1, 4, 4, 4]
    assert len(stored[1]) == 3 and stored[1] == stored[None]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_encode_threads_below_one_or_not_an_int_is_refused(tmp_path, bad):
    with pytest.raises(ValueError, match="encode_threads must be an int >= 1 or None"):
        Publisher(str(tmp_path / "run"), encode_threads=bad)


def test_a_small_steps_delta_encodes_on_one_thread_and_a_large_ones_on_a_thread_per_16_mib(tmp_path, monkeypatch):
    """Hundreds of small tensors encode faster on one thread than on two (the second waits for the GIL between
    the first one's short kernels): the encode takes one thread per ENCODE_BYTES_PER_THREAD of the step's
    tensors, at most one per core, unless Publisher(encode_threads=...) says; PublishResult.encode_threads
    reports it."""
    assert [deltas.encode_threads_for(n << 20, 8) for n in (0, 9, 16, 38, 76, 10_000)] == [1, 1, 1, 2, 4, 8]
    assert deltas.encode_threads_for(10_000 << 20, 2) == 2
    asked: list = []
    real_encode_many = deltas.encode_many

    def recorded(*a, **k):
        asked.append(k.get("threads"))
        return real_encode_many(*a, **k)

    monkeypatch.setattr(deltas, "encode_many", recorded)
    monkeypatch.setattr(deltas, "ENCODE_BYTES_PER_THREAD", 16 << 10)   # the test's 8 KB tensors as MBs
    monkeypatch.setattr("os.cpu_count", lambda: 4)
    w = _weights(0, n=6)                                      # 48 KB: 3 threads of 16 KB each
    for url, kw, want in ((tmp_path / "a", {}, 3), (tmp_path / "b", {"encode_threads": 1}, 1)):
        asked.clear()
        with Publisher(str(url), codec="fast", **kw) as pub:
            anchor = pub.publish(w, 0)
            r = pub.publish(_step(w, 1), 1)
        assert asked == [want], (kw, asked)
        assert (anchor.encode_threads, r.encode_threads) == (0, want)      # what each publish says it ran on
    monkeypatch.setattr(deltas, "ENCODE_BYTES_PER_THREAD", 16 << 20)
    asked.clear()
    with Publisher(str(tmp_path / "c"), codec="fast") as pub:
        pub.publish(w, 0)
        pub.publish(_step(w, 1), 1)
    assert asked == [1]
