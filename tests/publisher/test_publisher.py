"""Publisher over every storage backend: round trips, the commit protocol, restarts, races, crashes, gc."""

from __future__ import annotations

import io
import json

import pytest
import safetensors.torch
import torch

from ckptdelta.delta.errors import ConcurrentPublisherError, StorageError
from ckptdelta.delta.manifest import HEAD_KEY, RUN_KEY, Head, RunInfo
from ckptdelta.publisher import Publisher, collect
from ckptdelta.publisher.runs import read_manifest
from tests.publisher_helpers import assert_same, clone, open_store, perturb, snapshot, versions, weights

CONFIG = b'{"model_type": "llama", "hidden_size": 32}'


def test_anchor_then_deltas_round_trip_bit_exactly(store_url):
    url, opts = store_url
    w = weights()
    history = []
    with Publisher(url, storage_options=opts, shard_bytes=6000, extra_files={"config.json": CONFIG}) as pub:
        for step in range(4):
            history.append(clone(w))
            r = pub.publish(w, step * 10)
            assert (r.version, r.kind, r.step) == (step, "anchor" if step == 0 else "delta", step * 10)
            perturb(w, seed=step)
    store = open_store(store_url)
    assert versions(store) == [0, 1, 2, 3]
    for v, want in enumerate(history):
        assert_same(snapshot(store, v), want)

    # The anchor is a Hugging Face directory: shards + index load with plain safetensors.
    m0 = read_manifest(store, 0, None)
    files = {o.key.rsplit("/", 1)[1]: store.get(o.key) for o in m0.objects + m0.extra_files}
    index = json.loads(files["model.safetensors.index.json"])
    shards = sorted({f for f in index["weight_map"].values()})
    assert len(shards) > 1 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    loaded = {}
    for name in shards:
        loaded.update(safetensors.torch.load(files[name]))
        assert all(index["weight_map"][k] == name for k in safetensors.torch.load(files[name]))
    assert_same(loaded, history[0])
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in history[0].values())
    assert files["config.json"] == CONFIG
    # Each manifest entry's byte range is exactly that tensor's data in its shard.
    for name, e in m0.tensors.items():
        raw = store.get(m0.objects[e.object].key, (e.offset, e.offset + e.length))
        assert raw == history[0][name].contiguous().view(torch.uint8).numpy().tobytes()
    # HEAD and RUN.json name the run; deltas carry the anchor's extra files.
    head = Head.from_json(store.get(HEAD_KEY))
    assert head.version == 3 and head.run_id == RunInfo.from_json(store.get(RUN_KEY)).run_id == m0.run_id
    assert read_manifest(store, 3, None).extra_files == m0.extra_files


def test_single_shard_anchor_is_model_safetensors_loadable_from_its_directory(tmp_path):
    w = weights()
    with Publisher(str(tmp_path / "run"), extra_files={"config.json": CONFIG}) as pub:
        pub.publish(w, 0)
    anchor_dir = next((tmp_path / "run" / "anchors").iterdir())
    assert sorted(p.name for p in anchor_dir.iterdir()) == ["config.json", "model.safetensors"]
    assert_same(safetensors.torch.load_file(anchor_dir / "model.safetensors"), w)


def test_restarted_publisher_continues_the_run_from_the_bucket(store_url):
    url, opts = store_url
    w = weights()
    with Publisher(url, storage_options=opts) as first:
        for step in range(3):
            first.publish(w, step)
            perturb(w, seed=step)
    # A new process: no host copy, the trainer's weights moved on; the parent comes from the bucket.
    with Publisher(url, storage_options=opts) as second:
        assert second.run_id == first.run_id and second.writer_id != first.writer_id
        r = second.publish(w, 3)
    assert (r.version, r.kind, r.parent_version) == (3, "delta", 2)
    store = open_store(store_url)
    assert_same(snapshot(store, 3), w)
    assert read_manifest(store, 3, None).writer_id == second.writer_id


def test_second_publisher_on_a_run_fails_and_leaves_the_committed_snapshot_intact(store_url):
    url, opts = store_url
    w = weights()
    with Publisher(url, storage_options=opts) as a:
        a.publish(w, 0)
    b = Publisher(url, storage_options=opts)   # both now believe version 1 is next
    a = Publisher(url, storage_options=opts)
    winner = clone(w)
    perturb(winner, seed=1)
    loser = clone(w)
    perturb(loser, seed=2)

    # b passes its early check, then a commits version 1 while b uploads, then b tries to commit.
    real_put_file = b.store.put_file

    def put_file_racing(key, path):
        a.publish(winner, 1)
        return real_put_file(key, path)

    b.store.put_file = put_file_racing
    with pytest.raises(ConcurrentPublisherError) as e:
        b.publish(loser, 1)
    assert a.run_id in str(e.value) and "version 1" in str(e.value)
    with pytest.raises(ConcurrentPublisherError):  # it does not move on to version 2 either
        b.publish(loser, 2)
    b.close()
    a.close()
    store = open_store(store_url)
    assert versions(store) == [0, 1]
    assert_same(snapshot(store, 1), winner)
    assert Head.from_json(store.get(HEAD_KEY)).version == 1


def test_publish_killed_at_the_commit_leaves_no_snapshot_and_gc_removes_its_debris(store_url):
    url, opts = store_url
    w = weights()
    with Publisher(url, storage_options=opts, shard_bytes=6000) as pub:
        pub.publish(w, 0)
        perturb(w, seed=0)
        pub.publish(w, 1)
    v1 = clone(w)
    crashed = Publisher(url, storage_options=opts)

    def die(key, data):
        raise StorageError(f"simulated crash before writing {key}")

    crashed.store.put_if_absent = die
    perturb(w, seed=1)
    with pytest.raises(StorageError):
        crashed.publish(w, 2, anchor=True)
    crashed.close()
    store = open_store(store_url)
    assert versions(store) == [0, 1]
    debris = [k for k in store.list_prefix("anchors/") if f"-{crashed.writer_id}-" in k]
    assert debris  # its shards were uploaded, but nothing points at them

    young = collect(url, storage_options=opts)               # within the grace period: kept
    assert young.deleted_objects == () and set(debris) <= set(young.young_orphans)
    report = collect(url, storage_options=opts, grace_seconds=0)
    assert set(report.deleted_objects) == set(debris) and report.deleted_versions == ()
    assert not any(f"-{crashed.writer_id}-" in k for k in store.list_prefix(""))
    assert_same(snapshot(store, 1), v1)  # still readable after gc
    with Publisher(url, storage_options=opts) as again:
        r = again.publish(w, 2)
    assert r.version == 2 and r.kind == "delta"
    assert_same(snapshot(store, 2), w)


def test_gc_keeps_the_last_anchors_and_their_chains(store_url):
    url, opts = store_url
    w = weights()
    history = []
    with Publisher(url, storage_options=opts, anchor_every=3, extra_files={"config.json": CONFIG}) as pub:
        for step in range(8):   # anchors at 0, 3, 6
            history.append(clone(w))
            pub.publish(w, step)
            perturb(w, seed=step)
    store = open_store(store_url)
    before = store.list_prefix("")
    dry = collect(url, keep_anchors=2, storage_options=opts, dry_run=True)
    assert dry.deleted_versions == (0, 1, 2) and store.list_prefix("") == before
    report = collect(url, keep_anchors=2, storage_options=opts)
    assert report.kept_versions == (3, 4, 5, 6, 7) and report.deleted_versions == (0, 1, 2)
    assert versions(store) == [3, 4, 5, 6, 7]
    assert not any(k.split("/")[1].startswith(("000000000000-", "000000000001-", "000000000002-"))
                   for k in store.list_prefix("") if k.startswith(("anchors/", "deltas/")))
    assert store.exists(RUN_KEY) and store.exists(HEAD_KEY)
    for v in range(3, 8):
        assert_same(snapshot(store, v), history[v])
    assert collect(url, keep_anchors=2, storage_options=opts).deleted_objects == ()



@pytest.mark.parametrize("store_url", ["local", "s3"], indirect=True)
def test_runs_sharing_a_prefix_or_nested_in_one_another_never_touch_each_others_objects(store_url, monkeypatch):
    """Runs at .../runs/a, .../runs/ab (a's name is a prefix of it) and .../runs/a/sub (inside a's prefix), each
    with debris of a killed publish: each run's ls, reads and verify give its own snapshots, and its gc (grace 0)
    deletes its own old versions and debris, never another run's; on an object store it lists only its own
    anchors/ and deltas/. (gc of runs/a deleted runs/a/sub's temp files on a local disk, its writes in flight, and
    on S3 listed the whole prefix, the nested run's objects included.)"""
    from ckptdelta.delta.storage import Store
    from ckptdelta.loader import SnapshotReader

    url, opts = store_url
    root = url.rsplit("/", 1)[0] + "/runs"
    names = ["a", "ab", "a/sub"]
    truth: dict[str, dict[int, dict]] = {}
    debris: dict[str, set[str]] = {}
    for i, name in enumerate(names):
        w = weights(seed=i)
        truth[name] = {}
        with Publisher(f"{root}/{name}", storage_options=opts, anchor_every=2) as pub:
            for step in range(3):                            # v0 anchor, v1 delta, v2 anchor
                truth[name][pub.publish(w, step).version] = clone(w)
                perturb(w, seed=10 * i + step)
        store = Store.from_url(f"{root}/{name}", opts)
        debris[name] = {"anchors/000000000009-dead/model.safetensors"}   # uploaded, never committed
        store.put(next(iter(debris[name])), b"debris")
        if store.backend == "local":       # temp files of writes killed midway: beside a shard, and HEAD's
            for key in ("anchors/000000000009-dead/.ckptdelta-tmp-1", ".ckptdelta-tmp-2"):
                with open(f"{store.root}/{key}", "wb") as f:
                    f.write(b"half")
                debris[name].add(key)
    whole = Store.from_url(root, opts)

    def owner(key: str) -> str:
        return max((n for n in names if key.startswith(n + "/")), key=len)

    listed: list[str] = []
    real = Store.list_prefix

    def spy(self, prefix="", **kw):
        keys = real(self, prefix, **kw)
        listed.extend(f"{self.root}/{k}" for k in keys)
        return keys

    for name in ["a", "ab", "a/sub"]:
        before = set(whole.list_prefix("", include_temp=True))
        listed.clear()
        monkeypatch.setattr(Store, "list_prefix", spy)
        report = collect(f"{root}/{name}", keep_anchors=1, storage_options=opts, grace_seconds=0)
        monkeypatch.setattr(Store, "list_prefix", real)
        gone = before - set(whole.list_prefix("", include_temp=True))
        assert {owner(k) for k in gone} == {name}, sorted(gone)
        assert {f"{name}/{k}" for k in debris[name]} <= gone and report.deleted_versions == (0, 1)
        if whole.backend != "local":     # (a local gc walks its directory for temp files; it deletes none of theirs)
            mine = f"{whole.root}/{name}/"
            assert [k for k in listed if not k.startswith(mine) or owner(k[len(whole.root) + 1:]) != name] == []
        for other in names:
            reader = SnapshotReader(f"{root}/{other}", storage_options=opts)
            kept = [2] if names.index(other) <= names.index(name) else [0, 1, 2]
            assert reader.versions() == kept, other
            for v in kept:
                assert_same(reader.read_tensors(v), truth[other][v])
            assert reader.verify().version == 2

def test_background_publish_copies_before_returning_and_trainer_may_mutate_at_once(store_url):
    url, opts = store_url
    w = weights()
    with Publisher(url, storage_options=opts) as pub:
        pub.publish(w, 0)
        gate = _gate(pub, "put_file")
        perturb(w, seed=5)
        published = clone(w)
        fut = pub.publish(w, 1, wait=False)
        assert not fut.done()               # returned while the upload is held
        for t in w.values():                # the trainer steps again, in place
            t.zero_()
        gate.set()
        r = fut.result(timeout=60)
    assert (r.version, r.kind) == (1, "delta") and r.copy_s >= 0
    assert_same(snapshot(open_store(store_url), 1), published)


def _gate(pub: Publisher, method: str):
    import threading

    gate = threading.Event()
    real = getattr(pub.store, method)

    def held(*a, **k):
        assert gate.wait(60), "test gate never opened"
        return real(*a, **k)

    setattr(pub.store, method, held)
    return gate


def test_manifest_written_is_valid_json_with_the_documented_fields(tmp_path):
    with Publisher(str(tmp_path / "run")) as pub:
        pub.publish(weights(), 0, metadata={"git": "abc123"})
    raw = json.load(io.open(tmp_path / "run" / "manifests" / "000000000000.json"))
    assert raw["format"] == "ckptdelta-manifest" and raw["name"] == "v00000000"
    assert raw["metadata"] == {"git": "abc123"} and raw["kind"] == "anchor" and raw["parent_version"] is None
    assert raw["full_bytes"] == sum(t.numel() * t.element_size() for t in weights().values())


@pytest.mark.parametrize("kind", ["delta", "anchor"])
def test_a_retried_publish_writes_keys_of_its_own_so_a_late_write_of_the_failed_attempt_changes_nothing(
        tmp_path, kind):
    """Regression: a retry of a failed publish (same version) rewrote the failed attempt's data keys, so a
    PUT of that attempt landing late (a stalled request the server completes after the client gave up)
    replaced an object of the committed snapshot: reads and verify of it failed, and the publisher's next
    deltas (against its in-memory parent) were unreadable until the next anchor."""
    from ckptdelta.loader.reader import SnapshotReader
    url = str(tmp_path / "run")
    w = weights()
    with Publisher(url, shard_bytes=6000, progress=False) as pub:
        pub.publish(w, 0)
        store = pub.store
        real = store.put_if_absent

        def manifest_create_fails(key, data):
            if key.startswith("manifests/"):
                raise StorageError(f"simulated: every try of the create of {key} failed")
            return real(key, data)

        perturb(w, seed=1)
        store.put_if_absent = manifest_create_fails
        before = set(store.list_prefix(""))
        with pytest.raises(StorageError) as raised:
            pub.publish(w, 1, anchor=kind == "anchor")
        assert raised.value.publish_version == 1            # the version it was planned as, for its reporter
        failed = {k: store.get(k) for k in set(store.list_prefix("")) - before}
        assert failed                                       # the failed attempt left its data objects
        store.put_if_absent = real
        perturb(w, seed=2)                                  # the trainer stepped: the retry publishes other bits
        r = pub.publish(w, 1, anchor=kind == "anchor")
        assert r.version == 1 and r.kind == kind
        v1 = clone(w)
        committed = {o.key for o in read_manifest(store, 1, None).objects}
        assert not committed & set(failed)                  # the retry wrote none of the failed attempt's keys
        for key, data in failed.items():                    # the failed attempt's PUTs land late
            store.put(key, data)
        perturb(w, seed=3)
        assert pub.publish(w, 2).kind == "delta"            # against the in-memory parent: the committed v1
    reader = SnapshotReader(url)
    assert reader.verify(1) and reader.verify(2)
    assert_same(reader.read_tensors(1), v1)
    assert_same(reader.read_tensors(2), w)


def test_a_damaged_newest_manifest_is_skipped_by_readers_and_a_reopened_publisher_anchors_after_it(
        tmp_path, caplog, capsys):
    """Regression: an unreadable newest manifest made ``Publisher(url)`` raise ManifestError (the run stayed
    stuck until someone deleted it by hand) and ``latest`` fail for every replica."""
    from ckptdelta.delta.manifest import manifest_key
    from ckptdelta.loader.reader import SnapshotReader
    url = str(tmp_path / "run")
    w = weights()
    with Publisher(url, progress=False) as pub:
        pub.publish(w, 0)
        v0 = clone(w)
        perturb(w, seed=1)
        pub.publish(w, 1)
    path = tmp_path / "run" / manifest_key(1)
    damaged = path.read_bytes()[:-40] + b"garbage"
    path.write_bytes(damaged)
    reader = SnapshotReader(url)
    with caplog.at_level("WARNING", logger="ckptdelta.loader"):
        assert reader.resolve("latest") == 0
    assert "version 1" in caplog.text and "unreadable" in caplog.text
    assert_same(reader.read_tensors("latest"), v0)
    report = SnapshotReader(url).verify()
    assert report.version == 0 and len(report.damaged) == 1 and manifest_key(1) in report.damaged[0], report
    from ckptdelta.cli import main
    capsys.readouterr()
    assert main(["ls", url]) == 0
    listed = capsys.readouterr().out
    assert "unreadable" in next(line for line in listed.splitlines() if line.split()[:1] == ["1"])
    assert main(["verify", url]) == 0
    out = capsys.readouterr()
    assert "ok: v00000000" in out.out and manifest_key(1) in out.err and "unreadable" in out.err
    perturb(w, seed=2)
    with Publisher(url, progress=False) as again:
        r = again.publish(w, 2)
    assert r.version == 2 and r.kind == "anchor"
    assert path.read_bytes() == damaged                     # never rewritten
    reader = SnapshotReader(url)
    assert reader.resolve("latest") == 2 and reader.verify().damaged == ()
    assert_same(reader.read_tensors("latest"), w)


@pytest.mark.parametrize("numel", [1, 4099, (16 << 20) // 2 + 1], ids=["one", "small-memcpy", "threaded-copy"])
def test_the_host_copy_keeps_every_bit_on_both_copy_paths(numel):
    """Small CPU tensors are copied by one memcpy, large ones by torch's threads; views by torch: all of them bit
    for bit (NaN payloads, -0.0), into reused buffers as into fresh ones."""
    from ckptdelta.publisher.host_copy import copy_to_host

    g = torch.Generator().manual_seed(numel)
    bits = torch.randint(-2**15, 2**15, (numel,), dtype=torch.int16, generator=g)
    bits[: min(numel, 3)] = torch.tensor([0x7FC1, -32768, 0x7F81], dtype=torch.int16)[: min(numel, 3)]  # NaN, -0.0
    src = {"w": bits.view(torch.bfloat16), "f32": bits.to(torch.int32).view(torch.float32),
           "view": bits.view(torch.bfloat16)[::2]}
    first = copy_to_host(src)
    again = copy_to_host(src, spare={k: torch.full_like(v, 1.0) for k, v in first.items()})

    def raw(t):
        return t.contiguous().view(-1).view(torch.int16 if t.element_size() == 2 else torch.int32)

    for out in (first, again):
        for k, t in src.items():
            assert out[k].is_contiguous() and out[k].data_ptr() != t.data_ptr()
            assert torch.equal(raw(out[k]), raw(t)), k


def test_a_tensors_dense_and_raw_tries_that_lost_run_again_only_every_few_deltas_and_every_version_reads_back(
        tmp_path, monkeypatch):
    """Dense fp32 steps (every element moves, as a LoRA step's): sparse wins every chunk, so after a delta whose
    tries lost, a tensor's chunks try sparse alone until FAST_RETRY_EVERY deltas later, when the tries run
    again. A tensor whose tries win (here every element's lowest bit flips: dense XOR) keeps them every delta.
    Every version reads back exact."""
    from ckptdelta.delta.encodings.dense_xor import DenseXor
    from ckptdelta.loader.reader import SnapshotReader
    from ckptdelta.publisher.publisher import FAST_RETRY_EVERY

    tried: list[int] = []          # the chunk sizes the dense try ran on
    real = DenseXor.encode

    def counting(self, chunk):
        tried.append(chunk.n)
        return real(self, chunk)

    monkeypatch.setattr(DenseXor, "encode", counting)
    g = torch.Generator().manual_seed(0)
    w = {"a": torch.randn(4096, generator=g), "b": torch.randn(8192, generator=g),
         "c": (0.02 * torch.randn(100_000, generator=g)).to(torch.bfloat16)}
    url = str(tmp_path / "run")
    truth, per_delta = {}, []
    with Publisher(url, codec="fast", anchor_every=1000, anchor_chain_fraction=1000.0) as pub:
        truth[pub.publish(w, 0).version] = w
        for step in range(1, 2 * FAST_RETRY_EVERY + 2):
            w = {k: t + 1e-3 * torch.randn(t.shape, generator=g) for k, t in w.items() if k != "c"} | \
                {"c": (w["c"].view(torch.int16) ^ 1).view(torch.bfloat16)}
            tried.clear()
            r = pub.publish(w, step)
            truth[r.version] = w
            assert r.kind == "delta"
            per_delta.append(sorted(tried))
    assert all(100_000 in t for t in per_delta), per_delta         # "c": its tries win, they run every delta
    retries = [k for k, t in enumerate(per_delta) if set(t) - {100_000}]
    assert retries == [0, FAST_RETRY_EVERY, 2 * FAST_RETRY_EVERY], per_delta
    reader = SnapshotReader(url)
    for v, want in truth.items():
        assert_same(reader.read_tensors(v), want)


def test_publish_returns_at_the_commit_and_head_follows_in_commit_order(tmp_path):
    """HEAD is a hint, moved on a thread of its own: publish() returns once the manifest is committed, a
    reader resolving "latest" finds that version while HEAD still lags, and wait_until_finished() (as close())
    returns only once HEAD names the newest commit, never having moved it backwards."""
    import threading

    from ckptdelta.loader.reader import SnapshotReader

    url = str(tmp_path / "run")
    pub = Publisher(url)
    pub.publish(weights(), 0)
    pub.wait_until_finished()
    release, heads = threading.Event(), []
    real_put = pub.store.put

    def held_head(key, data, *a, **kw):
        if key == HEAD_KEY:
            assert release.wait(30)
            heads.append(Head.from_json(data).version)
        return real_put(key, data, *a, **kw)

    pub.store.put = held_head
    w = weights()
    for step in (1, 2):
        perturb(w, seed=step)
        r = pub.publish(w, step)              # returns while HEAD's PUT is held
        assert r.version == step
    store = open_store((url, {}))
    assert Head.from_json(store.get(HEAD_KEY)).version == 0
    assert SnapshotReader(url).resolve("latest") == 2
    release.set()
    pub.wait_until_finished()
    assert heads == [1, 2] and Head.from_json(store.get(HEAD_KEY)).version == 2
    pub.close()
