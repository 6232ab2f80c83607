"""keep_exact: a run published as bf16 keeps the trainer's fp32 bits as an attachment to each version
(publisher/exact.py, delta/exact.py, loader/exact.py), on every storage backend."""

from __future__ import annotations

import json
import os
import threading

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptdelta.delta.errors import (ChecksumError, CkptDeltaError, ExactAttachError, ExactBitsMissingError, FormatError,
                                    PublishInputError, RunMismatchError)
from ckptdelta.delta.exact import index_key
from ckptdelta.loader import SnapshotReader
from ckptdelta.publisher import Publisher, collect
from tests.publisher_helpers import assert_same, clone, open_store, perturb, versions

#: fp32 bit patterns a cast to bf16 must round, or must not lose: NaNs (quiet and signalling, both signs, with
#: payloads in the half the cast drops), +-0, +-inf, subnormals, the largest float (rounds to inf), and values
#: whose dropped half is exactly 0x8000 (ties to even, from an odd and an even kept half)
SPECIAL = np.array([0x7FC00000, 0xFFC00001, 0x7F800001, 0xFF81234F, 0x7FFFFFFF, 0x00000000, 0x80000000,
                    0x7F800000, 0xFF800000, 0x00000001, 0x807FFFFF, 0x7F7FFFFF, 0x3F818000, 0x3F808000,
                    0xBF818000, 0x3F80FFFF, 0x3F807FFF], dtype=np.uint32)


def fp32_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = {"layers.0.lora_A.weight": torch.randn(8, 96, generator=g) * 0.05,
         "layers.0.lora_B.weight": torch.randn(96, 8, generator=g) * 1e-4,
         "layers.0.norm": torch.randn(96, generator=g),
         "embed.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16),    # published as it is
         "step_count": torch.tensor([7], dtype=torch.int64)}
    w["layers.0.norm"].view(torch.int32)[:SPECIAL.size] = torch.from_numpy(SPECIAL.view(np.int32))
    return w


def adam_like(w: dict[str, torch.Tensor], seed: int, lr: float = 1e-5) -> None:
    """Every fp32 element moves by about ``lr``, as an AdamW step moves an adapter (the NaNs and infs stay)."""
    g = torch.Generator().manual_seed(1000 + seed)
    for k, t in w.items():
        if t.dtype == torch.float32:
            t.add_(lr * torch.randn(t.shape, generator=g))


def bf16_of(w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.to(torch.bfloat16) if v.dtype == torch.float32 else v for k, v in w.items()}


def publish_history(url: str, opts: dict, steps: int = 5, **kw) -> list[dict[str, torch.Tensor]]:
    w, history = fp32_weights(), []
    with Publisher(url, storage_options=opts, dtype=torch.bfloat16, keep_exact=True, anchor_every=3, **kw) as pub:
        for step in range(steps):         # anchors at 0 and 3
            history.append(clone(w))
            pub.publish(w, step)
            adam_like(w, step)
            perturb(w, seed=step, names=["embed.weight"])
    return history


def test_every_version_rebuilds_the_trainers_fp32_bits_while_its_snapshot_holds_the_bf16_cast(store_url):
    url, opts = store_url
    history = publish_history(url, opts)
    reader = SnapshotReader(url, storage_options=opts)
    assert [reader.manifest(v).kind for v in range(5)] == ["anchor", "delta", "delta", "anchor", "delta"]
    for v, want in enumerate(history):
        assert_same(reader.read_tensors(v), bf16_of(want))      # what replicas fetch: the cast, nothing more
        assert_same(reader.read_exact(v), want)                 # NaN payloads, -0.0, ties, subnormals included
    assert_same(reader.read_exact(4, ["layers.0.norm"]), {"layers.0.norm": history[4]["layers.0.norm"]})
    store = open_store(store_url)
    index = json.loads(store.get(index_key(4)))
    assert sorted(n for n, e in index["tensors"].items() if e["dtype"] == "F32") == \
        ["layers.0.lora_A.weight", "layers.0.lora_B.weight", "layers.0.norm"]
    assert index["tensors"]["embed.weight"] == {"dtype": "BF16"}       # the trainer's own bf16: as published
    # an element's fp32 bits past its bf16 cast cost about two bytes: the attachment is no whole fp32 copy
    fp32 = sum(t.numel() for t in history[4].values() if t.dtype == torch.float32)
    assert sum(o["size"] for o in index["objects"]) < 2.6 * fp32


def hold_puts(pub: Publisher, prefix: str) -> tuple[threading.Event, threading.Event]:
    """Writes of keys under ``prefix`` wait for the second event once they set the first."""
    held, release = threading.Event(), threading.Event()
    put = pub.store.put

    def slow_put(key, data):
        if key.startswith(prefix):
            held.set()
            assert release.wait(30)
        put(key, data)

    pub.store.put = slow_put
    return held, release


def fail_puts(pub: Publisher, prefix: str, why: str) -> None:
    """Writes of keys under ``prefix`` fail with OSError(why)."""
    put = pub.store.put

    def failing_put(key, data):
        if key.startswith(prefix):
            raise OSError(why)
        put(key, data)

    pub.store.put = failing_put


def test_publish_returns_at_the_commit_and_the_attachment_lands_after_it(tmp_path):
    url = str(tmp_path / "run")
    pub = Publisher(url, dtype=torch.bfloat16, keep_exact=True)
    held, release = hold_puts(pub, "exact/")
    w = fp32_weights()
    r = pub.publish(w, 0)
    assert held.wait(30)
    reader = SnapshotReader(url)
    assert reader.latest() == r.version == 0        # committed and readable while its attachment is held back
    assert_same(reader.read_tensors(0), bf16_of(w))
    with pytest.raises(ExactBitsMissingError, match="v00000000.*no exact bits are attached"):
        reader.read_exact(0)
    release.set()
    pub.wait_until_finished()
    assert_same(reader.read_exact(0), w)
    pub.close()


def test_a_failed_attachment_is_raised_by_the_next_publish_naming_its_version_and_the_version_stays_served(tmp_path):
    url = str(tmp_path / "run")
    w = fp32_weights()
    with Publisher(url, dtype=torch.bfloat16, keep_exact=True) as pub:
        pub.publish(w, 0)
        fail_puts(pub, "exact/000000000001-", "disk full (simulated)")
        adam_like(w, 0)
        v1 = clone(w)
        assert pub.publish(w, 1).version == 1
        adam_like(w, 1)
        with pytest.raises(ExactAttachError, match="exact fp32 bits of version 1 were not attached.*disk full"):
            pub.publish(w, 2)
        r = pub.publish(w, 2)                  # raised once: the next publish goes on
        assert r.version == 2
    reader = SnapshotReader(url)
    assert_same(reader.read_tensors(1), bf16_of(v1))
    with pytest.raises(ExactBitsMissingError, match="v00000001"):
        reader.read_exact(1)
    assert_same(reader.read_exact(2), w)


def test_a_damaged_or_foreign_attachment_is_refused_naming_what_is_wrong(tmp_path):
    url = str(tmp_path / "run")
    history = publish_history(url, {}, steps=2)
    reader = SnapshotReader(url)
    store = reader.store
    key = index_key(1)
    good = json.loads(store.get(key))

    def with_index(change) -> None:
        d = json.loads(json.dumps(good))
        change(d)
        store.put(key, json.dumps(d).encode())

    with_index(lambda d: d.update(run_id="another-run"))
    with pytest.raises(RunMismatchError, match="another-run"):
        reader.read_exact(1)
    with_index(lambda d: d["tensors"]["layers.0.norm"].update(length=1 << 40))
    with pytest.raises(FormatError, match="layers.0.norm.*not inside"):
        reader.read_exact(1)
    with_index(lambda d: d["tensors"].update({"nope": d["tensors"]["layers.0.norm"]}))
    with pytest.raises(FormatError, match="'nope' is not in the snapshot"):
        reader.read_exact(1)
    with_index(lambda d: d["objects"][0].update(key="deltas/000000000001-x/rank-00000.ckd"))
    with pytest.raises(FormatError, match="not one of this version's attachments"):
        reader.read_exact(1)
    other = json.loads(store.get(index_key(0)))["objects"][0]["key"]        # version 0's attachment
    with_index(lambda d: d["objects"][0].update(key=other))
    with pytest.raises(FormatError, match="not one of this version's attachments"):
        reader.read_exact(1)
    with_index(lambda d: d.update(version=0))
    with pytest.raises(FormatError, match="names version 0"):
        reader.read_exact(1)
    with_index(lambda d: d["tensors"]["layers.0.norm"].update(offset=d["tensors"]["layers.0.lora_A.weight"]["offset"]))
    with pytest.raises(FormatError, match="overlap"):
        reader.read_exact(1)
    with_index(lambda d: d["objects"][0].update(size=d["objects"][0]["size"] + 1))
    with pytest.raises(ChecksumError, match="holds .* bytes, its index says"):
        reader.read_exact(1)
    # two entries swapped: each record names its own tensor
    with_index(lambda d: d["tensors"].update({"layers.0.norm": d["tensors"]["layers.0.lora_A.weight"],
                                              "layers.0.lora_A.weight": d["tensors"]["layers.0.norm"]}))
    with pytest.raises(FormatError, match="the index says F32 'layers.0.lora_A.weight'"):
        reader.read_exact(1)
    store.put(key, json.dumps(good).encode())
    assert_same(reader.read_exact(1), history[1])
    # one flipped bit in a record's payload
    e = good["tensors"]["layers.0.lora_B.weight"]
    key = good["objects"][e["object"]]["key"]
    blob = bytearray(store.get(key))
    blob[e["offset"] + e["length"] - 1] ^= 1
    store.put(key, bytes(blob))
    with pytest.raises(ChecksumError, match="layers.0.lora_B.weight"):
        reader.read_exact(1)


def test_a_strided_source_is_published_as_the_cast_without_keep_exact_makes_and_kept_exact(tmp_path):
    """torch casts a NaN to bf16 one way in its contiguous kernel (0xFFFF) and another in its strided one
    (0x7FC0): a strided fp32 tensor is cast from itself, as without keep_exact, not from its contiguous copy."""
    whole = torch.from_numpy(np.repeat(SPECIAL, 4).view(np.float32).copy())
    w = {"strided": whole[::2], "contiguous": whole.clone()}
    assert not w["strided"].is_contiguous()
    runs = {keep: str(tmp_path / f"run-{keep}") for keep in (True, False)}
    for keep, url in runs.items():
        with Publisher(url, dtype=torch.bfloat16, keep_exact=keep) as pub:
            pub.publish(w, 0)
    exact, plain = (SnapshotReader(runs[k]) for k in (True, False))
    assert_same(exact.read_tensors(0), plain.read_tensors(0))
    assert_same(exact.read_tensors(0), {k: v.to(torch.bfloat16) for k, v in w.items()})
    assert_same(exact.read_exact(0), {k: v.contiguous() for k, v in w.items()})


def test_the_next_publish_waits_for_the_attachment_before_it_copies_into_buffers_it_may_reuse(tmp_path):
    url = str(tmp_path / "run")
    pub = Publisher(url, dtype=torch.bfloat16, keep_exact=True)
    held, release = hold_puts(pub, "exact/000000000000-")
    w = fp32_weights()
    history = [clone(w)]
    pub.publish(w, 0)
    assert held.wait(30)
    adam_like(w, 0)
    history.append(clone(w))
    second = threading.Thread(target=pub.publish, args=(w, 1))
    second.start()
    second.join(1.0)
    assert second.is_alive() and versions(open_store((url, {}))) == [0]    # held before its copy
    release.set()
    second.join(30)
    assert not second.is_alive()
    adam_like(w, 1)
    history.append(clone(w))
    pub.publish(w, 2, wait=False)           # a Future; its attachment follows its commit all the same
    pub.close()
    reader = SnapshotReader(url)
    for v in range(3):
        assert_same(reader.read_exact(v), history[v])


def test_close_raises_a_failed_attachment_and_a_with_block_left_on_an_error_logs_it(tmp_path, caplog):
    pub = Publisher(str(tmp_path / "a"), dtype=torch.bfloat16, keep_exact=True)
    fail_puts(pub, "exact/", "bucket gone (simulated)")
    pub.publish(fp32_weights(), 0)
    with pytest.raises(ExactAttachError, match="version 0 were not attached.*bucket gone"):
        pub.close()
    with pytest.raises(KeyError):
        with Publisher(str(tmp_path / "b"), dtype=torch.bfloat16, keep_exact=True) as pub:
            fail_puts(pub, "exact/", "bucket gone (simulated)")
            pub.publish(fp32_weights(), 0)
            raise KeyError("the trainer's own error")
    assert "exact fp32 bits of version 0 were not attached" in caplog.text


def test_keep_exact_is_refused_where_it_cannot_keep_every_bit(tmp_path):
    url = str(tmp_path / "run")
    with pytest.raises(ValueError, match="needs dtype=torch.bfloat16"):
        Publisher(url, keep_exact=True)
    with pytest.raises(ValueError, match="needs dtype=torch.bfloat16"):
        Publisher(url, dtype=torch.float16, keep_exact=True)
    with pytest.raises(ValueError, match="max_in_flight=1"):
        Publisher(url, dtype=torch.bfloat16, keep_exact=True, max_in_flight=2)
    with pytest.raises(ValueError, match="device_diff"):
        Publisher(url, dtype=torch.bfloat16, keep_exact=True, device_diff=True)
    with Publisher(url, dtype=torch.bfloat16, keep_exact=True) as pub:
        with pytest.raises(PublishInputError, match="'x' is torch.float64"):
            pub.publish({"x": torch.zeros(4, dtype=torch.float64)}, 0)
    assert versions(open_store((url, {}))) == []


def test_a_run_published_without_keep_exact_says_it_has_no_exact_bits(tmp_path):
    url = str(tmp_path / "run")
    with Publisher(url, dtype=torch.bfloat16) as pub:
        pub.publish(fp32_weights(), 0)
    with pytest.raises(ExactBitsMissingError, match="keep_exact=True"):
        SnapshotReader(url).read_exact(0)


def test_verify_rebuilds_a_versions_exact_bits_and_fails_naming_a_damaged_or_missing_part(tmp_path, capsys):
    from ckptdelta.cli import main as cli

    url = str(tmp_path / "run")
    publish_history(url, {}, steps=3)
    reader = SnapshotReader(url)
    for v in range(3):      # an anchor's attachment and two deltas', each beside its chain
        report = reader.verify(v)
        assert report.exact_tensors_checked == 3 and report.tensors_checked == 5 * (v + 1)
    assert cli(["verify", url, "2"]) == 0
    assert "the exact bits of 3 tensors (keep_exact)" in capsys.readouterr().out
    store = open_store((url, {}))
    part = json.loads(store.get(index_key(2)))["objects"][0]["key"]
    data = bytearray(store.get(part))
    data[len(data) // 2] ^= 0x01
    store.put(part, bytes(data))
    with pytest.raises(ChecksumError, match=f"{part}: content hashes to .*the index of the exact attachment"):
        SnapshotReader(url).verify(2)
    assert SnapshotReader(url).verify(1).exact_tensors_checked == 3     # the other versions' stay good
    store.delete([part])
    with pytest.raises(CkptDeltaError, match=f"{part}, listed by the index of the exact attachment"):
        SnapshotReader(url).verify(2)
    assert cli(["verify", url, "2"]) == 1
    assert part in capsys.readouterr().err


def test_verify_of_a_run_without_exact_bits_says_none_were_checked(tmp_path, capsys):
    from ckptdelta.cli import main as cli

    url = str(tmp_path / "run")
    with Publisher(url, dtype=torch.bfloat16) as pub:
        pub.publish(fp32_weights(), 0)
    assert SnapshotReader(url).verify(0).exact_tensors_checked is None
    assert cli(["verify", url]) == 0 and "exact bits" not in capsys.readouterr().out


def test_gc_deletes_an_attachment_with_its_version_and_keeps_those_of_kept_versions(store_url):
    url, opts = store_url
    history = publish_history(url, opts, steps=6)           # anchors at 0 and 3
    store = open_store(store_url)
    report = collect(url, keep_anchors=1, storage_options=opts, grace_seconds=0)
    assert report.deleted_versions == (0, 1, 2)
    assert {k.split("/")[1][:12] for k in store.list_prefix("exact/")} == {f"{v:012d}" for v in (3, 4, 5)}
    assert sum(k.startswith("exact/") for k in report.deleted_objects) == 6    # an object and an index each
    reader = SnapshotReader(url, storage_options=opts)
    for v in (3, 4, 5):
        assert_same(reader.read_exact(v), history[v])


def test_gc_deletes_an_attachment_left_half_written_once_its_version_goes_and_stale_temp_files(tmp_path):
    url = str(tmp_path / "run")
    history = publish_history(url, {}, steps=6)             # anchors at 0 and 3
    store = open_store((url, {}))
    store.delete([index_key(1)])                            # an object whose index never landed
    tmp = tmp_path / "run" / "exact" / ".ckptdelta-tmp-dead-writer"
    tmp.write_bytes(b"half an attachment")                  # a local write killed mid-way
    assert store.list_prefix("exact/", include_temp=True).count("exact/.ckptdelta-tmp-dead-writer") == 1
    report = collect(url, keep_anchors=1, grace_seconds=0)
    assert report.deleted_versions == (0, 1, 2) and not tmp.exists()
    assert "exact/.ckptdelta-tmp-dead-writer" in report.deleted_objects
    assert not [k for k in store.list_prefix("exact/") if k.startswith(("exact/000000000001", "exact/000000000000"))]
    assert_same(SnapshotReader(url).read_exact(5), history[5])


def test_a_large_attachment_is_written_in_parts_and_read_back_from_them(tmp_path, monkeypatch):
    """The writer holds one part of an attachment at a time (a 7B fp32 model's would be 14 GB whole)."""
    monkeypatch.setattr("ckptdelta.publisher.exact.PART_BYTES", 1000)
    url = str(tmp_path / "run")
    history = publish_history(url, {}, steps=2)
    index = json.loads(open_store((url, {})).get(index_key(1)))
    assert len(index["objects"]) == 3 and {e.get("object") for e in index["tensors"].values()} == {0, 1, 2, None}
    reader = SnapshotReader(url)
    for v in (0, 1):
        assert_same(reader.read_exact(v), history[v])


#: JSON values a hostile index may put anywhere: every JSON type, out-of-range numbers, keys of other versions
HOSTILE = st.one_of(st.none(), st.booleans(), st.integers(min_value=-2**70, max_value=2**70),
                    st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=40),
                    st.sampled_from(["exact/000000000000-x-00000.ckd", "exact/000000000001-../../RUN.json",
                                     "F32", "BF16", "0" * 16, "layers.0.norm"]),
                    st.lists(st.integers(-5, 5), max_size=3), st.dictionaries(st.text(max_size=8), st.integers(),
                                                                               max_size=3))


def _paths(d, prefix=()):
    """Every (path, value) of a JSON document, containers included."""
    yield prefix, d
    if isinstance(d, dict):
        for k, v in d.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(d, list):
        for i, v in enumerate(d):
            yield from _paths(v, prefix + (i,))


def _every_exact_reader(url: str) -> list:
    """What read_exact, verify and an exact materialize (its safetensors read back) make of version 1 of the run at
    ``url``: each one's result, or None where it raised a CkptDeltaError; a refused materialize must leave
    nothing behind."""
    import shutil
    import tempfile

    from safetensors.torch import load_file

    scratch = tempfile.mkdtemp(prefix="exact-")

    def materialized(r: SnapshotReader) -> dict[str, torch.Tensor]:
        return load_file(os.path.join(r.materialize(1, os.path.join(scratch, "out"), exact=True), "model.safetensors"))

    outcomes = []
    try:
        for read in (lambda r: r.read_exact(1), lambda r: r.verify(1), materialized):
            try:
                outcomes.append(read(SnapshotReader(url)))
            except CkptDeltaError:
                outcomes.append(None)
                assert os.listdir(scratch) == []          # a refused materialize leaves nothing behind
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return outcomes


@pytest.fixture(scope="module")
def kept_run(tmp_path_factory):
    url = str(tmp_path_factory.mktemp("hostile") / "run")
    return url, publish_history(url, {}, steps=2)


@settings(max_examples=150, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_value_anywhere_in_an_index_is_read_and_verified_exactly_or_refused_with_a_ckptdelta_error(kept_run,
                                                                                                       data):
    """A hostile index (any JSON value at any place of it, or a field dropped) never gets another exception out
    of read_exact, verify or an exact materialize, nor wrong bits: what comes back is the trainer's, or a
    CkptDeltaError says why not (and materialize leaves nothing behind); and what verify passes, read_exact reads
    (verify also hashes the objects whole)."""
    url, history = kept_run
    store = open_store((url, {}))
    good = store.get(index_key(1))
    doc = json.loads(good)
    path, _ = data.draw(st.sampled_from(list(_paths(doc))[1:]), label="where")
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    if data.draw(st.booleans(), label="drop") and isinstance(parent, dict):
        del parent[path[-1]]
    else:
        parent[path[-1]] = data.draw(HOSTILE, label="value")
    store.put(index_key(1), json.dumps(doc).encode())
    try:
        got, report, written = _every_exact_reader(url)
    finally:
        store.put(index_key(1), good)
    if got is not None:
        assert_same(got, history[1])
    if report is not None:
        assert got is not None and report.exact_tensors_checked == 3
    assert (written is None) == (got is None)
    if written is not None:
        assert_same(written, history[1])


@settings(max_examples=60, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_hostile_record_resealed_in_an_attachment_is_read_exactly_or_refused_by_every_reader(kept_run, data):
    """A record of an attachment's part rewritten as a writer of the bucket could (tests/bucket_grammar.py: a
    header field, a shape, the name, a chunk entry or payload at an edge value, another dtype of the same width or
    a permuted shape), resealed (its header checksum, the part's size and xxh3 and the records' places in the
    index), so that it reaches the record parser and the decode: read_exact, verify and an exact materialize
    give the trainer's bits or a CkptDeltaError (materialize leaving nothing behind), never another exception."""
    from tests import bucket_grammar as g

    url, history = kept_run
    store = open_store((url, {}))
    good_index = store.get(index_key(1))
    doc = json.loads(good_index)
    obj = data.draw(st.integers(0, len(doc["objects"]) - 1), label="part")
    key = doc["objects"][obj]["key"]
    good = store.get(key)
    recs = g.records_of(good)
    i = data.draw(st.integers(0, len(recs) - 1), label="record")
    rec, _what, _agreed = g.hostile_record(data.draw, recs, i)
    recs[i] = (recs[i][0], rec)
    blob, where = g.object_bytes(recs)
    doc["objects"][obj]["size"], doc["objects"][obj]["xxh3"] = len(blob), f"{xxhash.xxh3_64_intdigest(blob):016x}"
    for name, e in doc["tensors"].items():
        if e.get("object") == obj and name in where:
            e["offset"], e["length"] = where[name]
    store.put(key, blob)
    store.put(index_key(1), json.dumps(doc).encode())
    try:
        got, report, written = _every_exact_reader(url)
    finally:
        store.put(key, good)
        store.put(index_key(1), good_index)
    for tensors in (got, written):
        if tensors is not None:
            assert_same(tensors, history[1])     # a field the result's digest does not cover may change: the bits
    assert (report is None) == (got is None) == (written is None), _what     # every reader, the same answer


def test_a_step_without_fp32_tensors_attaches_an_index_of_no_objects_and_reads_back_as_published(tmp_path):
    url = str(tmp_path / "run")
    w = {"embed.weight": torch.randn(8, 4).to(torch.bfloat16), "step_count": torch.tensor([3])}
    with Publisher(url, dtype=torch.bfloat16, keep_exact=True) as pub:
        pub.publish(w, 0)
    index = json.loads(open_store((url, {})).get(index_key(0)))
    assert index["objects"] == [] and index["tensors"] == {"embed.weight": {"dtype": "BF16"}}
    assert_same(SnapshotReader(url).read_exact(0), w)


def test_materialize_exact_writes_the_trainers_fp32_checkpoint_and_the_default_the_bf16_one(store_url, tmp_path,
                                                                                           monkeypatch, capsys):
    """``materialize(exact=True)`` / ``ckptdelta materialize --exact``: the checkpoint a trainer resumes from (its
    fp32 bits, NaN payloads and ties included, beside the tensors published as they were), streamed in batches;
    the default stays the bf16 the replicas serve."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    from ckptdelta.cli import main as cli
    from ckptdelta.loader import exact as exact_module
    from ckptdelta.loader import materialize

    url, opts = store_url
    history = publish_history(url, opts)
    reader = SnapshotReader(url, storage_options=opts)
    monkeypatch.setattr(materialize, "EXACT_BATCH_BYTES", 1)   # a batch per tensor: the stream, not one read
    batches, index_reads = [], []
    monkeypatch.setattr(materialize, "read_exact", lambda r, v, names, **kw: batches.append(list(names))
                        or exact_module.read_exact(r, v, names, **kw))
    for module in (materialize, exact_module):
        monkeypatch.setattr(module, "read_index", lambda r, v, _read=module.read_index: index_reads.append(v)
                            or _read(r, v))
    for v in (2, 3):        # a delta's and an anchor's attachment
        batches.clear(), index_reads.clear()
        out = reader.materialize(v, str(tmp_path / f"exact{v}"), exact=True)
        assert_same(load_file(f"{out}/model.safetensors"), history[v])
        assert batches == [[n] for n in sorted(history[v])] and index_reads == [v]   # the index read once
        with safe_open(f"{out}/model.safetensors", "pt") as f:
            assert f.metadata()["ckptdelta_bits"] == "exact" and f.metadata()["ckptdelta_version"] == str(v)
        served = reader.materialize(v, str(tmp_path / f"served{v}"))
        assert_same(load_file(f"{served}/model.safetensors"), bf16_of(history[v]))
        with safe_open(f"{served}/model.safetensors", "pt") as f:
            assert "ckptdelta_bits" not in f.metadata()
    # shards cut at the fp32 sizes: each at most 4096 bytes of data or a single tensor (planned at the published
    # bf16 sizes, lora_A and lora_B would share one, 6144 bytes in fp32)
    sharded = materialize.write_checkpoint(reader, 4, str(tmp_path / "shards"), shard_bytes=4096, exact=True)
    index = json.loads(open(f"{sharded}/{materialize.INDEX_NAME}").read())
    shards = {f: load_file(f"{sharded}/{f}") for f in set(index["weight_map"].values())}
    assert len(shards) > 1
    for held in shards.values():
        assert len(held) == 1 or sum(t.numel() * t.element_size() for t in held.values()) <= 4096, sorted(held)
    assert_same({n: t for held in shards.values() for n, t in held.items()}, history[4])
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in history[4].values())
    assert cli(["materialize", url, "latest", str(tmp_path / "cli"), "--exact",
                *(["--storage-options", json.dumps(opts)] if opts else [])]) == 0
    assert "(the trainer's exact bits)" in capsys.readouterr().out
    assert_same(load_file(str(tmp_path / "cli" / "model.safetensors")), history[4])


def test_materialize_exact_is_refused_leaving_nothing_where_the_exact_bits_are_missing_or_damaged(tmp_path, capsys):
    from ckptdelta.cli import main as cli

    plain = str(tmp_path / "plain")
    with Publisher(plain, dtype=torch.bfloat16) as pub:
        pub.publish(fp32_weights(), 0)
    with pytest.raises(ExactBitsMissingError, match="v00000000.*no exact bits are attached"):
        SnapshotReader(plain).materialize(0, str(tmp_path / "out"), exact=True)
    assert cli(["materialize", plain, "0", str(tmp_path / "out"), "--exact"]) == 1
    err = capsys.readouterr().err
    assert "no exact bits are attached" in err and len(err.strip().splitlines()) == 1
    url = str(tmp_path / "run")
    publish_history(url, {}, steps=2)
    store = open_store((url, {}))
    part = json.loads(store.get(index_key(1)))["objects"][0]["key"]
    data = bytearray(store.get(part))
    data[len(data) // 2] ^= 0x01
    store.put(part, bytes(data))
    with pytest.raises(CkptDeltaError, match="exact attachment"):
        SnapshotReader(url).materialize(1, str(tmp_path / "out"), exact=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain", "run"]      # no output, no temporary directory
    with pytest.raises(ValueError, match="priors"):
        SnapshotReader(url).materialize(0, str(tmp_path / "out"), exact=True, priors={})


def test_an_exact_checkpoint_of_a_transformers_model_says_fp32_in_its_config_and_loads_back_exact(tmp_path):
    """The anchor's config.json records the dtype the run was published in (bf16), which from_pretrained's
    default dtype="auto" would load the trainer's fp32 bits back in; the exact checkpoint's config says float32,
    as the trainer's own save_pretrained would, and loads the trainer's bits with no argument. The served
    checkpoint keeps bfloat16."""
    from transformers import AutoModelForCausalLM

    from tests.replicas import make_lm_dir

    lm = make_lm_dir(str(tmp_path / "lm"))
    model = AutoModelForCausalLM.from_pretrained(lm, dtype=torch.float32)
    url = str(tmp_path / "run")
    with Publisher(url, dtype=torch.bfloat16, keep_exact=True, progress=False) as pub:
        pub.publish(model, 0)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1e-4 * torch.randn_like(p))
        pub.publish(model, 1)
    reader = SnapshotReader(url)
    exact = reader.materialize(1, str(tmp_path / "exact"), exact=True)
    served = reader.materialize(1, str(tmp_path / "served"))
    assert json.loads(open(f"{exact}/config.json").read())["dtype"] == "float32"
    assert json.loads(open(f"{served}/config.json").read())["dtype"] == "bfloat16"
    loaded = AutoModelForCausalLM.from_pretrained(exact)
    assert loaded.dtype == torch.float32
    assert_same(dict(loaded.state_dict()), {n: t for n, t in model.state_dict().items() if n in loaded.state_dict()})
    assert AutoModelForCausalLM.from_pretrained(served).dtype == torch.bfloat16
