"""Anchor policy, input checks and background-publish behaviour (memory/local buckets: the logic, not the wire)."""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import threading
import uuid

import numpy as np
import pytest
import torch

from ckptdelta.delta.errors import (ConcurrentPublisherError, PublishError, PublishInputError, RunMismatchError,
                                    StorageError)
from ckptdelta.delta.manifest import RUN_KEY
from ckptdelta.publisher import Publisher, Skipped
from ckptdelta.publisher.chain import MAX_CHAIN, ChainState, decide
from ckptdelta.publisher.runs import read_manifest
from tests import REPO
from tests.publisher_helpers import assert_same, clone, perturb, snapshot, versions, weights


@pytest.fixture
def url():
    return f"memory://ckd-policy-{uuid.uuid4().hex}/run"


def kinds(pub: Publisher, w: dict, steps: range, **kw) -> list[str]:
    out = []
    for s in steps:
        out.append(pub.publish(w, s, **kw).kind)
        perturb(w, seed=s)
    return out


def test_anchor_every_n_versions(url):
    with Publisher(url, anchor_every=3) as pub:
        assert kinds(pub, weights(), range(7)) == ["anchor", "delta", "delta"] * 2 + ["anchor"]


def test_anchor_when_the_chain_outgrows_a_fraction_of_the_anchor(url):
    w = weights()
    with Publisher(url, anchor_chain_fraction=0.05) as pub:
        a = pub.publish(w, 0)
        perturb(w, seed=1, frac=0.2)
        d1 = pub.publish(w, 1)
        assert d1.kind == "delta" and d1.stored_bytes > 0.05 * a.stored_bytes
        perturb(w, seed=2)
        r = pub.publish(w, 2)
    assert r.kind == "anchor" and "passed 0.05" in r.reason


@pytest.mark.parametrize("change", ["shape", "dtype", "added", "removed"])
def test_anchor_when_tensor_names_shapes_or_dtypes_change(url, change):
    w = weights()
    with Publisher(url) as pub:
        pub.publish(w, 0)
        perturb(w, seed=0)
        assert pub.publish(w, 1).kind == "delta"
        if change == "shape":
            w["head.bias"] = torch.zeros(17, dtype=torch.float16)
        elif change == "dtype":
            w["layers.0.norm"] = w["layers.0.norm"].to(torch.bfloat16)
        elif change == "added":
            w["new.lora"] = torch.ones(4, 4, dtype=torch.bfloat16)
        else:
            del w["head.bias"]
        r = pub.publish(w, 2)
        assert r.kind == "anchor" and "tensors changed" in r.reason
        assert_same(snapshot(pub.store, 2), w)
        perturb(w, seed=3)
        assert pub.publish(w, 3).kind == "delta"


def test_anchor_on_request(url):
    w = weights()
    with Publisher(url) as pub:
        pub.publish(w, 0)
        assert pub.publish(w, 1, anchor=True).kind == "anchor"
        assert pub.publish(w, 2).kind == "delta"


def test_delta_chain_never_exceeds_128():
    schema = {"w": ("BF16", (4,))}
    state = ChainState(last_version=MAX_CHAIN, anchor_version=0, anchor_bytes=1 << 30, chain_bytes=0, schema=schema)
    assert decide(state, schema, anchor_every=10_000, chain_fraction=1.0).kind == "anchor"
    shorter = ChainState(last_version=MAX_CHAIN - 1, anchor_version=0, anchor_bytes=1 << 30, schema=schema)
    assert decide(shorter, schema, anchor_every=10_000, chain_fraction=1.0).kind == "delta"


def test_unchanged_tensors_cost_no_object_bytes(url):
    w = weights()
    with Publisher(url) as pub:
        pub.publish(w, 0)
        same = pub.publish(w, 1)
        assert (same.kind, same.stored_bytes, same.n_changed_tensors) == ("delta", 0, 0)
        m = read_manifest(pub.store, 1, None)
        assert m.objects == () and all(e.object is None for e in m.tensors.values())
        perturb(w, seed=0, names=["layers.0.attn.w"])
        one = pub.publish(w, 2)
        m = read_manifest(pub.store, 2, None)
        assert one.n_changed_tensors == 1 and [n for n, e in m.tensors.items() if e.object is not None] == \
            ["layers.0.attn.w"]
        assert one.stored_bytes == m.objects[0].size
        assert_same(snapshot(pub.store, 2), w)


def test_step_may_not_go_backwards_even_after_a_restart(url):
    w = weights()
    with Publisher(url) as pub:
        pub.publish(w, 5)
        pub.publish(w, 5)  # the same step again is allowed (a re-publish)
        with pytest.raises(PublishInputError, match="step 4"):
            pub.publish(w, 4)
    with Publisher(url) as again:
        with pytest.raises(PublishInputError, match="step 3"):
            again.publish(w, 3)
        assert again.publish(w, 6).version == 2


@pytest.mark.parametrize("bad, match", [
    ({"w": torch.empty(3, device="meta")}, "meta"),
    ({"w": torch.zeros(3), "extra": {"not": "a tensor"}}, "not a tensor"),
    ({"w": torch.zeros(3, dtype=torch.complex64)}, "complex"),
    ({}, "nothing to publish"),
    ([torch.zeros(3)], "mapping"),
])
def test_weights_that_cannot_be_published_are_refused(url, bad, match):
    with Publisher(url) as pub:
        with pytest.raises(PublishInputError, match=match):
            pub.publish(bad, 0)
        assert versions(pub.store) == []


@pytest.mark.parametrize("metadata, match", [
    ({"notes": "x" * (1 << 20)}, r"metadata is 1048589 bytes as JSON, over the limit of 1048576"),
    ({"k": 1}, "metadata must map strings to strings"),
])
def test_metadata_a_manifest_cannot_hold_is_refused_before_anything_is_written(url, metadata, match):
    with Publisher(url) as pub:
        with pytest.raises(PublishInputError, match=match):
            pub.publish(weights(), 0, metadata=metadata)
        assert pub.store.list_prefix("") == []
        assert pub.publish(weights(), 0, metadata={"notes": "fits"}).version == 0


def test_a_run_id_its_manifests_could_not_hold_is_refused_and_the_bucket_stays_usable(url):
    with pytest.raises(ValueError, match="run_id must be valid UTF-8 text"):
        Publisher(url, run_id="exp-\udc80")
    with Publisher(url, run_id="exp-ok") as pub:
        assert pub.publish(weights(), 0).version == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_FSIZE's EFBIG is the full disk here")
def test_a_full_local_disk_fails_the_publish_with_an_error_naming_the_step_and_the_temp_dir(tmp_path):
    """The anchor's shard and a delta's part are written to the trainer's temp dir before they upload; a disk
    that refuses them (here the kernel's file size limit: EFBIG) fails that publish with a PublishError naming
    the step, the version and the temp dir, nothing committed, and the next publish with room goes on."""
    script = r"""
import os, resource, signal, sys, tempfile
import torch
from ckptdelta.delta.errors import PublishError
from ckptdelta.publisher import Publisher
tempfile.tempdir = sys.argv[2]
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
unlimited = (resource.RLIM_INFINITY, resource.RLIM_INFINITY)
w = {"a": torch.arange(40000, dtype=torch.float32), "b": torch.ones(300)}
with Publisher(sys.argv[1], codec="fast") as pub:
    for step in (0, 1):
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
        try:
            pub.publish(w, step)
        except PublishError as e:
            print("REFUSED", type(e).__name__, type(e.__cause__).__name__, e)
        resource.setrlimit(resource.RLIMIT_FSIZE, unlimited)
        print("VERSION", pub.publish(w, step).version)
        w["a"] += torch.randn(40000, generator=torch.Generator().manual_seed(step))   # a delta of > 4 KiB
print("TEMP", os.listdir(sys.argv[2]))
"""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    r = subprocess.run([sys.executable, "-c", script, str(tmp_path / "run"), str(tmp)], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    refused = [l for l in r.stdout.splitlines() if l.startswith("REFUSED")]
    assert len(refused) == 2, r.stdout
    for line, (step, kind) in zip(refused, ((0, "anchor"), (1, "delta"))):
        assert f"REFUSED PublishError OSError step {step} (version {step}) of run " in line
        assert f"writing this rank's {kind} files in the temp dir {tmp} failed (OSError: [Errno 27] File too " \
               "large); nothing was committed" in line
    assert [l for l in r.stdout.splitlines() if l.startswith("VERSION")] == ["VERSION 0", "VERSION 1"]
    assert "TEMP []" in r.stdout                        # the refused publishes' files went with their temp dirs


def test_non_contiguous_numpy_and_module_weights_publish_by_logical_content(url):
    base = torch.randn(16, 24).to(torch.bfloat16)
    arr = np.arange(60, dtype=np.float32).reshape(6, 10)
    w = {"t": base.t(), "slice": base[:, ::3], "np": arr[:, ::2], "np_int": np.arange(5, dtype=np.int32)}
    with Publisher(url) as pub:
        pub.publish(w, 0)
        got = snapshot(pub.store, 0)
    assert_same(got, {"t": base.t().contiguous(), "slice": base[:, ::3].contiguous(),
                      "np": np.ascontiguousarray(arr[:, ::2]), "np_int": np.arange(5, dtype=np.int32)})

    model = torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 10, bias=False))
    model[1].weight = model[0].weight  # tied: published under both names
    with Publisher(url + "-module") as pub:
        pub.publish(model, 0)
        got = snapshot(pub.store, 0)
    assert_same(got, {k: v for k, v in model.state_dict().items()})


def test_nan_weights_are_published_bit_exactly_with_one_warning_per_tensor(url, caplog):
    w = weights()
    w["layers.0.norm"][3] = float("nan")
    w["layers.0.norm"][4] = torch.tensor(np.array([0x7FC00123], dtype=np.uint32).view(np.float32))[0]  # a payload
    with caplog.at_level(logging.WARNING, logger="ckptdelta.publisher"), Publisher(url) as pub:
        pub.publish(w, 0)
        perturb(w, seed=0)
        pub.publish(w, 1)
        assert_same(snapshot(pub.store, 1), w)
    nan_warnings = [r for r in caplog.records if "NaN" in r.getMessage()]
    assert len(nan_warnings) == 1 and "layers.0.norm" in nan_warnings[0].getMessage()


def test_a_delta_finds_new_nans_among_the_changed_elements_without_scanning_tensors_it_checked(url, caplog,
                                                                                               monkeypatch):
    import ckptdelta.publisher.nan as nan_mod

    scanned: list[str] = []
    real = nan_mod.has_nan
    monkeypatch.setattr(nan_mod, "has_nan", lambda t: scanned.append(t.numel()) or real(t))
    w = weights()
    names = ["embed.weight", "layers.0.attn.w"]
    with caplog.at_level(logging.WARNING, logger="ckptdelta.publisher"):
        with Publisher(url) as pub:
            pub.publish(w, 0)                       # an anchor: every tensor scanned whole
            assert sorted(scanned) == sorted(t.numel() for t in w.values())
            scanned.clear()
            perturb(w, seed=1, names=names)
            pub.publish(w, 1)
            w["layers.0.attn.w"].view(-1)[100] = float("nan")   # a changed element becomes NaN
            perturb(w, seed=2, names=names)
            pub.publish(w, 2)
            perturb(w, seed=3, names=names)
            pub.publish(w, 3)
            assert scanned == []
            assert_same(snapshot(pub.store, 3), w)
        warned = [r.getMessage() for r in caplog.records if "NaN" in r.getMessage()]
        assert len(warned) == 1 and "'layers.0.attn.w'" in warned[0] and "version 2" in warned[0]
        caplog.clear()
        with Publisher(url) as pub:                 # a new process: the parent's bits were checked by no one
            perturb(w, seed=4, names=names)
            assert pub.publish(w, 4).kind == "delta"
            assert sorted(scanned) == sorted(w[n].numel() for n in names)   # the changed tensors, whole
            scanned.clear()
            perturb(w, seed=5, names=names)
            pub.publish(w, 5)
            assert scanned == []
        warned = [r.getMessage() for r in caplog.records if "NaN" in r.getMessage()]
        assert len(warned) == 1 and "'layers.0.attn.w'" in warned[0] and "version 4" in warned[0]


def test_a_failed_background_publish_surfaces_from_its_future_and_the_next_publish(url):
    w = weights()
    with Publisher(url) as pub:
        pub.publish(w, 0)
        real = pub.store.put_file
        calls = []

        def fail_once(key, path):
            calls.append(key)
            if len(calls) == 1:
                raise StorageError(f"simulated outage writing {key}")
            return real(key, path)

        pub.store.put_file = fail_once
        perturb(w, seed=0)
        fut = pub.publish(w, 1, wait=False)
        assert isinstance(fut.exception(timeout=60), StorageError)
        with pytest.raises(StorageError, match="simulated outage"):
            pub.publish(w, 2)
        r = pub.publish(w, 2)  # the error was reported once; publishing carries on at the next free version
        assert (r.version, r.kind, r.parent_version) == (1, "delta", 0)
        assert_same(snapshot(pub.store, 1), w)


def test_a_commit_whose_answers_were_lost_is_taken_as_this_publishers_own_and_the_run_goes_on(url, caplog):
    """The manifest's create lands, its answer is lost and so is the read-back that would recognise it: publish()
    says it failed. The next publish finds the version committed under this publisher's own writer id and goes on
    after it, where it took its own snapshot for another publisher's and stopped for good."""
    w = weights()
    with Publisher(url) as pub:
        pub.publish(w, 0)
        store = pub.store
        real_create, real_size = store.put_if_absent, store.size
        armed = {"create": True, "size": True}

        def create_then_drop_the_answer(key, data):
            real_create(key, data)
            if armed.pop("create", False):
                raise StorageError(f"simulated reset after {key} landed")

        def size_fails_once(key):
            if key.startswith("manifests/") and armed.pop("size", False):
                raise StorageError(f"simulated reset reading {key}")
            return real_size(key)

        store.put_if_absent, store.size = create_then_drop_the_answer, size_fails_once
        perturb(w, seed=0)
        one = clone(w)
        with pytest.raises(StorageError, match=r"could not be read back.*next publish"):
            pub.publish(w, 1)
        assert read_manifest(store, 1, pub.run_id).writer_id == pub.writer_id     # it did land
        with caplog.at_level(logging.WARNING, logger="ckptdelta"):
            r = pub.publish(w, 1)                        # the retry of the same step
        assert "committed by this publisher although its commit reported a failure" in caplog.text
        assert (r.version, r.parent_version) == (2, 1)
        perturb(w, seed=1)
        r = pub.publish(w, 2)
        assert (r.version, r.kind, r.parent_version) == (3, "delta", 2)
        assert_same(snapshot(store, 1), one)
        assert_same(snapshot(store, 2), one)
        assert_same(snapshot(store, 3), w)


def test_a_version_committed_by_another_publisher_is_refused_before_uploading_naming_its_writer(url):
    w = weights()
    with Publisher(url) as first:
        first.publish(w, 0)
    with Publisher(url) as a:             # its first publish looks before it uploads
        with Publisher(url) as b:
            perturb(w, seed=0)
            b.publish(w, 1)
        perturb(w, seed=1)
        with pytest.raises(ConcurrentPublisherError, match=rf"version 1\) is already committed by another "
                                                           rf"publisher \(writer {b.writer_id}, step 1\)"):
            a.publish(w, 2)


def test_publishes_beyond_max_in_flight_wait_for_a_slot(url):
    w = weights()
    with Publisher(url, max_in_flight=1) as pub:
        pub.publish(w, 0)
        gate = threading.Event()
        real = pub.store.put_if_absent

        def held(key, data):
            assert gate.wait(60)
            return real(key, data)

        pub.store.put_if_absent = held
        perturb(w, seed=1)
        first = pub.publish(w, 1, wait=False)
        second_returned = threading.Event()
        snapshot_2 = clone(w)
        perturb(snapshot_2, seed=2)

        def second():
            pub.publish(snapshot_2, 2, wait=False)
            second_returned.set()

        t = threading.Thread(target=second)
        t.start()
        assert not second_returned.wait(0.5)  # blocked: the one slot is taken by the held publish
        gate.set()
        t.join(60)
        assert second_returned.is_set() and first.result(60).version == 1
        pub.wait_until_finished()
        assert versions(pub.store) == [0, 1, 2]
        assert_same(snapshot(pub.store, 2), snapshot_2)


def test_background_publishes_in_flight_together_each_publish_their_own_bits(url):
    """Several publishes queued at once: each one's host copy (the first into buffers a background
    thread is still filling) holds the bits of its own call."""
    w = weights()
    history, futures = [], []
    with Publisher(url, max_in_flight=3) as pub:
        for step in range(10):
            history.append(clone(w))
            futures.append(pub.publish(w, step, wait=False))
            perturb(w, seed=100 + step)
        results = [f.result() for f in futures]
        assert [r.kind for r in results][:2] == ["anchor", "delta"]
        for r, want in zip(results, history):
            assert_same(snapshot(pub.store, r.version), want)


def test_queued_publishes_behind_a_failure_are_not_attempted(url):
    w = weights()
    with Publisher(url, max_in_flight=2) as pub:
        pub.publish(w, 0)
        gate = threading.Event()
        real = pub.store.put_file

        def fail_after_gate(key, path):
            assert gate.wait(60)
            raise StorageError("simulated outage")

        pub.store.put_file = fail_after_gate
        perturb(w, seed=1)
        f1 = pub.publish(w, 1, wait=False)
        f2 = pub.publish(w, 2, wait=False)
        gate.set()
        assert isinstance(f1.exception(60), StorageError)
        skipped = f2.exception(60)
        assert isinstance(skipped, Skipped) and isinstance(skipped, PublishError)
        # it says which publish failed and why
        assert re.search(r"step 2 was not published: an earlier publish of run .* failed: step 1 .* failed "
                         r"\(StorageError: simulated outage\)", str(skipped)), str(skipped)
        with pytest.raises(StorageError):
            pub.wait_until_finished()
        pub.store.put_file = real
        assert pub.publish(w, 3).version == 1


def test_run_id_is_kept_across_publishers_and_a_different_one_is_refused(url):
    with Publisher(url, run_id="exp-7") as pub:
        pub.publish(weights(), 0)
        assert pub.store.exists(RUN_KEY)
    with Publisher(url) as again:
        assert again.run_id == "exp-7"
    with pytest.raises(RunMismatchError):
        Publisher(url, run_id="exp-8")


def test_a_run_that_lost_run_json_and_whose_newest_manifest_is_damaged_is_continued_by_an_anchor(url):
    """RUN.json gone (a partial copy, a hand clean-up) and the newest manifest damaged: the run id comes from the
    newest manifest that reads, and the next publish anchors after the newest version, rewriting nothing."""
    w = weights()
    with Publisher(url, run_id="exp-9") as pub:
        pub.publish(w, 0)
        perturb(w, seed=0)
        pub.publish(w, 1)
        store = pub.store
    store.delete([RUN_KEY])
    store.put("manifests/000000000001.json", b"{damaged")
    with Publisher(url) as again:
        assert again.run_id == "exp-9"
        perturb(w, seed=1)
        r = again.publish(w, 2)
        assert (r.version, r.kind) == (2, "anchor")
        assert_same(snapshot(again.store, 2), w)


def test_extra_files_may_not_shadow_the_anchor_weights(url, tmp_path):
    with pytest.raises(PublishInputError):
        Publisher(url, extra_files={"model.safetensors": b"x"})
    with pytest.raises(PublishInputError):
        Publisher(url, extra_files={"../config.json": b"x"})
    cfg = tmp_path / "config.json"
    cfg.write_bytes(b"{}")
    with Publisher(url, extra_files={"config.json": cfg, "tokenizer/vocab.txt": b"a\nb\n"}) as pub:
        pub.publish(weights(), 0)
        m = read_manifest(pub.store, 0, None)
    assert sorted(o.key.split("/", 2)[2] for o in m.extra_files) == ["config.json", "tokenizer/vocab.txt"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64,
                                   torch.float8_e4m3fn, torch.float8_e5m2])
def test_nan_scan_agrees_with_torch_isnan_on_every_bit_pattern_class(dtype):
    from ckptdelta.delta import dtypes
    from ckptdelta.publisher.nan import has_nan

    width = torch.finfo(dtype).bits
    rng = np.random.default_rng(width)
    bits = rng.integers(0, 2**min(width, 63), size=200_000, dtype=np.uint64).astype(f"<u{width // 8}")
    dt = dtypes.of(torch.empty(0, dtype=dtype))
    t = dtypes.from_bits(bits, dt, (bits.size,))
    is_nan = torch.isnan(t.double()).numpy()  # the reference: torch's own NaN test, after an exact widening
    assert is_nan.any() and has_nan(t)
    finite = bits.copy()
    finite[is_nan] = 0
    assert not has_nan(dtypes.from_bits(finite, dt, (bits.size,)))
    finite[-1] = bits[np.flatnonzero(is_nan)[0]]
    assert has_nan(dtypes.from_bits(finite, dt, (bits.size,)))


def test_progress_bars_over_bytes_when_asked(url, capsys):
    w = weights()
    with Publisher(url, progress=True) as pub:
        pub.publish(w, 0)
        perturb(w, seed=0)
        pub.publish(w, 1)
    err = capsys.readouterr().err
    assert "anchor v0" in err and "delta v1" in err


def test_a_stale_publisher_is_stopped_before_it_uploads_anything(url):
    w = weights()
    with Publisher(url) as first:
        first.publish(w, 0)
    a, b = Publisher(url), Publisher(url)
    a.publish(w, 1)
    before = a.store.list_prefix("")
    with pytest.raises(ConcurrentPublisherError, match="version 1"):
        b.publish(w, 1)
    assert a.store.list_prefix("") == before   # b found version 1 taken before writing any data
    a.close()
    b.close()


def test_close_raises_a_background_failure_not_yet_reported(url):
    w = weights()
    pub = Publisher(url)

    def outage(key, path):
        raise StorageError("simulated outage")

    pub.store.put_file = outage
    fut = pub.publish(w, 0, wait=False)
    with pytest.raises(StorageError):
        pub.close()
    assert isinstance(fut.exception(), StorageError)
    with pytest.raises(PublishError, match="closed"):
        pub.publish(w, 1)
