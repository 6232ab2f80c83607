"""The trainer's host copy: buffers reused across steps, and Publisher(device_diff=True).

The device-diff path is torch ops on the weights' own device; here "the device"
is the CPU, which runs the same code. Every comparison is of bits (integer views),
never of float values: NaN payloads and -0.0 must survive.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ckptdelta.delta import dtypes
from ckptdelta.delta.errors import PublishError
from ckptdelta.delta.storage import Store
from ckptdelta.publisher import Publisher
from ckptdelta.publisher import publisher as publisher_mod
from ckptdelta.publisher.runs import read_manifest
from tests.publisher_helpers import assert_same, clone, perturb, snapshot

ALL_DTYPES = [d.torch_dtype for d in dtypes.BY_NAME.values()]


def _odd_weights(seed: int) -> dict[str, torch.Tensor | np.ndarray]:
    """One tensor per dtype with NaN payloads, -0.0 and infinities, a non-contiguous one and a numpy array."""
    rng = np.random.default_rng(seed)
    out: dict[str, torch.Tensor | np.ndarray] = {}
    for dt in ALL_DTYPES:
        w = torch.empty(0, dtype=dt).element_size()
        raw = torch.from_numpy(rng.integers(0, 256, 600 * w, dtype=np.uint8))
        t = (raw[:600] & 1).to(torch.bool) if dt == torch.bool else raw.view(dt).clone()
        if dt.is_floating_point:
            t[0::5] = -0.0
            t[1::9] = float("nan")
            t[2::9] = float("inf")
            if w > 1:
                ints = dtypes.torch_bits_view(t)
                ints[3::9] = int(torch.tensor(float("nan"), dtype=dt).view(ints.dtype)) ^ 3   # a NaN payload
        out[f"t.{str(dt).split('.')[-1]}"] = t.reshape(20, 30)
    out["strided"] = torch.randn(40, 30, dtype=torch.float32).to(torch.bfloat16).t()   # not contiguous
    out["numpy"] = rng.standard_normal((10, 10)).astype(np.float32)
    return out


def _step(w: dict, seed: int, frac: float) -> None:
    """Change ``frac`` of every tensor's elements in place: signs flipped (-0.0 <-> +0.0, NaN signs) or low bits."""
    rng = np.random.default_rng(seed)
    for k, t in w.items():
        if isinstance(t, np.ndarray):
            t.reshape(-1)[rng.random(t.size) < frac] *= -1
            continue
        flat = t.view(-1) if t.is_contiguous() else t.as_strided((t.numel(),), (1,))   # strided: its storage
        bits = dtypes.torch_bits_view(flat) if t.dtype != torch.bool else flat
        idx = torch.from_numpy(np.flatnonzero(rng.random(flat.numel()) < frac))
        if t.dtype == torch.bool:
            bits[idx] = ~bits[idx]
        elif t.element_size() == 1:
            bits[idx] = bits[idx] ^ 0x81
        else:
            bits[idx] = bits[idx] ^ ((-1 << (8 * t.element_size() - 1)) | 1)


def _copy(w: dict) -> dict:
    return {k: (v.copy() if isinstance(v, np.ndarray) else v.clone()) for k, v in w.items()}


def _records(store: Store, version: int) -> dict[str, bytes | None]:
    """Each tensor's stored record (or None when unchanged) of a delta version."""
    m = read_manifest(store, version, None)
    out = {}
    for n, e in m.tensors.items():
        out[n] = None if e.object is None else store.get(m.objects[e.object].key)[e.offset:e.offset + e.length]
    return out


def test_the_host_copy_reuses_two_sets_of_buffers_across_steps(tmp_path):
    w = {k: v for k, v in _odd_weights(0).items() if isinstance(v, torch.Tensor)}
    with Publisher(str(tmp_path / "run")) as pub:
        ptrs = []
        for step in range(5):
            pub.publish(w, step)
            ptrs.append({n: t.data_ptr() for n, t in pub._parents.tensors.items()})
            _step(w, step, 0.05)
    assert ptrs[2] == ptrs[0] and ptrs[3] == ptrs[1] and ptrs[4] == ptrs[0]   # no fresh buffer after step 1
    assert not set(ptrs[0].values()) & set(ptrs[1].values())


def test_the_second_copy_lands_in_buffers_filled_in_the_background_after_the_first_publish(tmp_path,
                                                                                            monkeypatch):
    """Without them, the first delta after a publisher starts copies into fresh memory (its first touch
    costs more than the copy); they are filled off the publish path, on one thread."""
    filled = []
    real = publisher_mod.Publisher._start_prefault
    monkeypatch.setattr(publisher_mod.Publisher, "_start_prefault", lambda self, like: filled.append(1) or real(self, like))
    w = {k: v for k, v in _odd_weights(0).items() if isinstance(v, torch.Tensor)}
    with Publisher(str(tmp_path / "run")) as pub:
        pub.publish(w, 0)
        first = {n: t.data_ptr() for n, t in pub._parents.tensors.items()}
        pub._prefault.thread.join()           # the trainer's step: time enough for the fill to finish
        background = {n: t.data_ptr() for n, t in pub._spare.items()}
        assert filled == [1] and background.keys() == first.keys()
        assert not set(background.values()) & set(first.values())
        _step(w, 0, 0.05)
        assert pub.publish(w, 1).kind == "delta"
        assert {n: t.data_ptr() for n, t in pub._parents.tensors.items()} == background
        _step(w, 1, 0.05)
        pub.publish(w, 2)                 # from here on the superseded parent comes back: nothing to fill
        assert filled == [1]
        assert {n: t.data_ptr() for n, t in pub._parents.tensors.items()} == first
        assert_same(snapshot(pub.store, 2), w)


# a fixed codec each: codec="auto" picks by the timings it measures, which the two publishers need not share
@pytest.mark.parametrize("frac, codec", [(0.0, "context"), (0.01, "context"), (0.3, "fast")])
def test_device_diff_publishes_the_same_bits_and_records_as_a_full_copy(tmp_path, frac, codec):
    urls = {mode: str(tmp_path / mode) for mode in ("full", "diff")}
    pubs = {mode: Publisher(urls[mode], device_diff=(mode == "diff"), anchor_every=4, codec=codec) for mode in urls}
    w = _odd_weights(1)
    history = []
    try:
        for step in range(7):                     # anchors at 0 and 4: the diff path carries on across them
            history.append(_copy(w))
            results = {mode: pub.publish(w, step) for mode, pub in pubs.items()}
            assert results["full"].kind == results["diff"].kind
            stats = pubs["diff"]._diff.stats
            torch_tensors = sum(isinstance(v, torch.Tensor) for v in w.values())
            assert (stats.full, stats.diffed) == ((len(w), 0) if step == 0 else (1, torch_tensors)), step
            if step and frac < 0.3:
                full = sum(v.nbytes if isinstance(v, np.ndarray) else v.numel() * v.element_size()
                           for v in w.values())
                assert stats.bytes_moved < full / 2
            _step(w, step, frac)
    finally:
        for pub in pubs.values():
            pub.close()
    stores = {mode: Store.from_url(url) for mode, url in urls.items()}
    for v, want in enumerate(history):
        want = {k: torch.from_numpy(t) if isinstance(t, np.ndarray) else t.contiguous() for k, t in want.items()}
        for mode in urls:
            assert_same(snapshot(stores[mode], v), want)
        if v not in (0, 4):
            assert _records(stores["full"], v) == _records(stores["diff"], v), v   # the very same bytes


def test_after_a_failed_publish_the_next_one_copies_whole_and_stays_exact(tmp_path, monkeypatch):
    url = str(tmp_path / "run")
    w = _odd_weights(2)
    real = publisher_mod.write_delta_object
    fail = {"armed": False}

    def flaky(*a, **kw):
        if fail["armed"]:
            fail["armed"] = False
            raise OSError("injected: the disk is full")
        return real(*a, **kw)

    monkeypatch.setattr(publisher_mod, "write_delta_object", flaky)
    history = {}
    with Publisher(url, device_diff=True) as pub:
        for step in range(6):
            fail["armed"] = step == 2
            try:
                r = pub.publish(w, step)
            except PublishError as e:            # naming the step and version, the disk's error its cause
                assert step == 2 and "injected" in str(e) and isinstance(e.__cause__, OSError)
            else:
                history[r.version] = _copy(w)
                diffed = pub._diff.stats.diffed
                assert diffed == (0 if step in (0, 3) else len(w) - 1), step   # after the failure: whole again
            _step(w, step, 0.02)
    store = Store.from_url(url)
    for v, want in history.items():
        assert_same(snapshot(store, v), {k: torch.from_numpy(t) if isinstance(t, np.ndarray) else t.contiguous()
                                         for k, t in want.items()})


def test_a_restarted_publisher_diffs_from_its_second_publish_and_new_tensors_copy_whole(tmp_path):
    url = str(tmp_path / "run")
    w = {k: v for k, v in _odd_weights(3).items() if isinstance(v, torch.Tensor)}
    with Publisher(url, device_diff=True) as pub:
        pub.publish(w, 0)
        _step(w, 0, 0.02)
        pub.publish(w, 1)
    history = {}
    with Publisher(url, device_diff=True) as pub:        # a new process: no device copy, parent from the bucket
        for step in (2, 3, 4):
            if step == 4:
                w["added"] = torch.randn(8, 8).to(torch.bfloat16)   # a new tensor: an anchor, copied whole
            r = pub.publish(w, step)
            history[r.version] = clone(w)
            assert pub._diff.stats.full == (len(w) if step == 2 else 1 if step == 4 else 0), step
            _step(w, step, 0.02)
        assert set(pub._diff._device) == set(w)
    store = Store.from_url(url)
    for v, want in history.items():
        assert_same(snapshot(store, v), {k: t.contiguous() for k, t in want.items()})


def test_device_diff_needs_one_publish_in_flight(tmp_path):
    with pytest.raises(ValueError, match="max_in_flight=1"):
        Publisher(str(tmp_path / "run"), device_diff=True, max_in_flight=2)
    w = {"a": torch.zeros(4)}
    with Publisher(str(tmp_path / "run2"), device_diff=True) as pub:
        pub.publish(w, 0)
        perturb(w, 0, frac=0.5)
        pub.publish(w, 1)
        assert pub._diff.device_bytes == 16
