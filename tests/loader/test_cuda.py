"""The CUDA paths: Publisher(device_diff=True), the host copy and HotSwapper with weights on a GPU.

Every other test runs these code paths with "the device" being the CPU (the torch ops
are the same); here the tensors live on ``DEVICE``, so the copies between device and
pinned host memory, the synchronisation before publish() returns and the hot-load's
torch apply path (index_copy_, dense swaps, rollbacks read back from the device) run
as a trainer and a replica on a GPU run them. Every comparison is of bits, read back
to the CPU as integer views: NaN payloads, -0.0 and subnormals must survive.

``DEVICE`` is ``cuda`` unless ``CKPTDELTA_TEST_DEVICE`` says otherwise; without a CUDA
device every test here is skipped (CI has none). ``CKPTDELTA_TEST_DEVICE=cpu`` runs the
same bodies on the CPU, which checks the tests themselves on a machine without a GPU.
benchmarks/device_check.sh runs this module on a GPU machine.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from ckptdelta.delta import apply_many, digest, dtypes, encode
from ckptdelta.delta.errors import DeltaError, HotLoadError, NotServableError
from ckptdelta.delta.storage import Store
from ckptdelta.loader.hotswap import HotSwapper
from ckptdelta.loader.reader import SnapshotReader
from ckptdelta.publisher import Publisher
from ckptdelta.publisher import publisher as publisher_mod
from ckptdelta.publisher.runs import read_manifest
from ckptdelta.publisher.host_copy import copy_to_host
from tests.publisher_helpers import snapshot

DEVICE = os.environ.get("CKPTDELTA_TEST_DEVICE", "cuda")
ON_CUDA = torch.device(DEVICE).type == "cuda"

pytestmark = pytest.mark.skipif(
    ON_CUDA and not torch.cuda.is_available(),
    reason=f"no CUDA device here (torch {torch.__version__}: torch.cuda.is_available() is False); "
           "CKPTDELTA_TEST_DEVICE=cpu runs these tests on the CPU")

#: How the commits below write: "auto" takes the torch path for device tensors; on the CPU "torch" forces
#: that path, so a dry run there exercises what a GPU runs (and not the host batch "auto" takes on the CPU).
METHOD = "auto" if ON_CUDA else "torch"
#: One codec for both publishers compared: "auto" picks per delta from timings, which two publishers need not share.
CODEC = "context"
#: Mantissa bits of each float dtype: bits below them with a zero exponent are subnormals.
MANTISSA = {"F64": 52, "F32": 23, "F16": 10, "BF16": 7, "F8_E4M3": 3, "F8_E5M2": 2}


# --- weights with every bit pattern a float comparison would get wrong ---------------------------

def _odd(dt: dtypes.DType, n: int, rng: np.random.Generator) -> torch.Tensor:
    """``n`` elements of ``dt`` on the CPU: random bits, then -0.0, NaNs with payloads, infinities and
    subnormals of both signs (floats), or the extremes (integers)."""
    bits = rng.integers(0, 256, n * dt.itemsize, dtype=np.uint8).view(dt.bits_dtype).copy()
    if dt.name == "BOOL":
        return torch.from_numpy(bits & 1).to(torch.bool)
    width = 8 * dt.itemsize
    sign = dt.bits_dtype.type(1 << (width - 1))
    if dt.name in MANTISSA:
        m = MANTISSA[dt.name]
        inf = dt.bits_dtype.type(((1 << (width - 1 - m)) - 1) << m)   # every exponent bit set, no mantissa
        bits[0::11] = sign                                              # -0.0
        bits[1::11] = inf | dt.bits_dtype.type(1)                       # NaN, payload 1 (e4m3: a finite value)
        bits[2::11] = inf | dt.bits_dtype.type((1 << m) - 1) | sign     # NaN, all payload bits, negative
        bits[3::11] = inf                                               # +inf (e4m3fn: its largest finite)
        bits[4::11] = bits[4::11] & dt.bits_dtype.type((1 << m) - 1)    # subnormals (or +0.0)
        bits[5::11] = (bits[5::11] & dt.bits_dtype.type((1 << m) - 1)) | sign
        bits[6::11] = dt.bits_dtype.type(1)                             # the smallest subnormal
    else:
        bits[0::7] = 0
        bits[1::7] = ~dt.bits_dtype.type(0)
        bits[2::7] = sign
    return torch.from_numpy(bits).view(dt.torch_dtype)


def odd_weights(seed: int, rows: int = 24, cols: int = 40) -> dict[str, torch.Tensor]:
    """One CPU tensor per dtype the format holds (every float dtype torch has, fp8 included, and the integers)."""
    rng = np.random.default_rng(seed)
    return {f"t.{dt.name.lower()}": _odd(dt, rows * cols, rng).reshape(rows, cols) for dt in dtypes.BY_NAME.values()}


def flip(w: dict, seed: int, frac: float) -> None:
    """Change ``frac`` of every tensor's elements in place, on the tensor's own device: sign bits (-0.0 <-> +0.0,
    NaN signs) and low bits, through integer views. A strided tensor is changed through its storage."""
    g = torch.Generator().manual_seed(seed)
    for t in w.values():
        if isinstance(t, np.ndarray):
            idx = torch.rand(t.size, generator=g).numpy() < frac
            t.reshape(-1)[idx] *= -1
            continue
        flat = t.view(-1) if t.is_contiguous() else t.as_strided((t.numel(),), (1,))
        idx = torch.nonzero(torch.rand(flat.numel(), generator=g) < frac).reshape(-1).to(t.device)
        if t.dtype == torch.bool:
            flat[idx] = ~flat[idx]
            continue
        bits = dtypes.torch_bits_view(flat)
        mask = 0x81 if t.element_size() == 1 else (-1 << (8 * t.element_size() - 1)) | 1
        bits[idx] = bits[idx] ^ mask


def on_device(w: dict) -> dict:
    return {k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v.copy()) for k, v in w.items()}


def cpu_copy(w: dict) -> dict:
    """What a trainer without device_diff hands to publish(): host copies (numpy arrays as they are)."""
    return {k: (v.detach().cpu().clone() if isinstance(v, torch.Tensor) else v.copy()) for k, v in w.items()}


def host_bits(t: "torch.Tensor | np.ndarray") -> np.ndarray:
    """The bits of ``t`` read back to the CPU, as unsigned integers in C order."""
    if isinstance(t, torch.Tensor):
        t = t.detach().cpu().contiguous()
    return dtypes.host_bits(t)


def same_bits(a, b) -> bool:
    return (dtypes.of(a) == dtypes.of(b) and tuple(a.shape) == tuple(b.shape)
            and np.array_equal(host_bits(a), host_bits(b)))


def assert_same(got: dict, want: dict, what: str = "") -> None:
    assert sorted(got) == sorted(want), what
    bad = [k for k in want if not same_bits(got[k], want[k])]
    assert not bad, f"{what}: tensors differ: {bad}"


def records(store: Store, version: int) -> dict[str, bytes | None]:
    """Each tensor's stored record (None when unchanged) of a delta version."""
    m = read_manifest(store, version, None)
    return {n: None if e.object is None else store.get(m.objects[e.object].key)[e.offset:e.offset + e.length]
            for n, e in m.tensors.items()}


def as_torch(w: dict) -> dict:
    return {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v.contiguous() for k, v in w.items()}


# --- the trainer's side: device_diff and the host copy ---------------------------------------------

@pytest.mark.parametrize("frac", [0.0, 0.01, 0.3])
def test_device_diff_on_the_device_publishes_the_bits_and_records_of_a_plain_publish_of_host_copies(tmp_path,
                                                                                                    frac):
    w = on_device(odd_weights(1))
    w["strided"] = torch.randn(40, 30).to(torch.bfloat16).to(DEVICE).t()    # not contiguous, on the device
    w["numpy"] = np.random.default_rng(1).standard_normal((10, 10)).astype(np.float32)   # always copied whole
    n_torch = sum(isinstance(v, torch.Tensor) for v in w.values())
    model_bytes = sum(v.nbytes if isinstance(v, np.ndarray) else v.numel() * v.element_size() for v in w.values())
    urls = {mode: str(tmp_path / mode) for mode in ("plain", "diff")}
    diff = Publisher(urls["diff"], device_diff=True, anchor_every=4, anchor_chain_fraction=100.0, codec=CODEC)
    plain = Publisher(urls["plain"], anchor_every=4, anchor_chain_fraction=100.0, codec=CODEC)
    history = []
    try:
        for step in range(7):                     # anchors at 0 and 4: the diff carries on across them
            history.append(cpu_copy(w))
            r_plain = plain.publish(history[-1], step)
            r_diff = diff.publish(w, step)
            assert r_plain.kind == r_diff.kind and r_plain.version == r_diff.version == step
            stats = diff._diff.stats
            assert (stats.full, stats.diffed) == ((len(w), 0) if step == 0 else (1, n_torch)), step
            if step and frac < 0.3:
                assert stats.bytes_moved < model_bytes / 2, step
            copies = diff._diff._device
            assert set(copies) == set(w) - {"numpy"}
            assert all(c.device.type == torch.device(DEVICE).type for c in copies.values())
            flip(w, 100 + step, frac)
    finally:
        plain.close()
        diff.close()
    stores = {mode: Store.from_url(url) for mode, url in urls.items()}
    for v, want in enumerate(history):
        for mode in urls:
            assert_same(snapshot(stores[mode], v), as_torch(want), f"{mode} v{v}")
        if v not in (0, 4):
            assert records(stores["plain"], v) == records(stores["diff"], v), v   # the very same bytes


def test_device_diff_of_fp32_masters_cast_to_bf16_on_the_device_matches_a_plain_publish(tmp_path):
    """Publisher(dtype=torch.bfloat16): the cast runs on the weights' own device, one tensor at a time; only
    the changed bf16 elements cross to the host, and the bucket holds what a plain publish of host casts holds."""
    g = torch.Generator().manual_seed(5)
    masters = {f"layer{i}.w": (torch.randn(64, 48, generator=g) * 0.02).to(DEVICE) for i in range(3)}
    masters["step"] = torch.tensor([3], dtype=torch.int64, device=DEVICE)          # published as it is
    diff = Publisher(str(tmp_path / "diff"), device_diff=True, dtype=torch.bfloat16, codec=CODEC)
    plain = Publisher(str(tmp_path / "plain"), dtype=torch.bfloat16, codec=CODEC)
    want = []
    try:
        for step in range(4):
            host = {k: v.cpu() for k, v in masters.items()}
            want.append({k: v.to(torch.bfloat16) if v.is_floating_point() else v.clone() for k, v in host.items()})
            plain.publish(host, step)
            diff.publish(masters, step)
            if step:
                assert diff._diff.stats.diffed == len(masters)
                assert diff._diff.stats.bytes_moved < sum(v.numel() * v.element_size() for v in want[-1].values()) / 2
            with torch.no_grad():
                for k, v in masters.items():
                    if v.is_floating_point():
                        v.add_(torch.randn(v.shape, generator=g).to(DEVICE) * 1e-6)   # an optimizer step
    finally:
        plain.close()
        diff.close()
    stores = [Store.from_url(str(tmp_path / m)) for m in ("plain", "diff")]
    for v, w in enumerate(want):
        for store in stores:
            assert_same(snapshot(store, v), w, f"v{v}")
        if v:
            assert records(stores[0], v) == records(stores[1], v), v


def test_after_a_failed_publish_the_device_diff_copies_whole_again_and_stays_exact(tmp_path, monkeypatch):
    """Documented (publisher/device_diff.py): a capture whose publish is not committed leaves the device copy
    unknown, so the next publish copies every tensor whole and refills it."""
    real = publisher_mod.write_delta_object
    armed = {"fail": False}

    def flaky(*a, **kw):
        if armed["fail"]:
            armed["fail"] = False
            raise OSError("injected: the disk is full")
        return real(*a, **kw)

    monkeypatch.setattr(publisher_mod, "write_delta_object", flaky)
    w = on_device(odd_weights(2))
    url = str(tmp_path / "run")
    history = {}
    with Publisher(url, device_diff=True, codec=CODEC) as pub:
        for step in range(6):
            armed["fail"] = step == 2
            try:
                r = pub.publish(w, step)
            except OSError as e:
                assert step == 2 and "injected" in str(e)
            else:
                history[r.version] = cpu_copy(w)
                assert pub._diff.stats.diffed == (0 if step in (0, 3) else len(w)), step
            flip(w, 200 + step, 0.02)
    store = Store.from_url(url)
    for v, want in history.items():
        assert_same(snapshot(store, v), as_torch(want), f"v{v}")


def test_a_restarted_publisher_diffs_on_the_device_from_its_second_publish(tmp_path):
    url = str(tmp_path / "run")
    w = on_device(odd_weights(3))
    with Publisher(url, device_diff=True, codec=CODEC) as pub:
        pub.publish(w, 0)
        flip(w, 300, 0.02)
        pub.publish(w, 1)
    history = {}
    with Publisher(url, device_diff=True, codec=CODEC) as pub:   # a new process: no device copy, parent from the bucket
        for step in (2, 3, 4):
            if step == 4:
                w["added"] = torch.randn(8, 8).to(torch.bfloat16).to(DEVICE)   # a new tensor: an anchor, copied whole
            r = pub.publish(w, step)
            history[r.version] = cpu_copy(w)
            assert pub._diff.stats.full == (len(w) if step == 2 else 1 if step == 4 else 0), step
            flip(w, 300 + step, 0.02)
        assert set(pub._diff._device) == set(w)
    store = Store.from_url(url)
    for v, want in history.items():
        assert_same(snapshot(store, v), as_torch(want), f"v{v}")


def test_the_host_copy_of_device_tensors_is_pinned_complete_on_return_and_reuses_its_buffers():
    """The copies are queued without blocking (into pinned memory on a GPU): publish() may return, and the
    host side read them, only once they have landed. Read here straight after the call, before anything else
    could wait for the device."""
    w = on_device(odd_weights(4))
    w["strided"] = torch.randn(40, 30).to(torch.bfloat16).to(DEVICE).t()
    want = cpu_copy(w)
    first = copy_to_host(w)
    assert_same(first, want, "first copy")
    assert all(t.device.type == "cpu" and t.is_contiguous() and t.is_pinned() == ON_CUDA for t in first.values())
    ptrs = {k: t.data_ptr() for k, t in first.items()}
    flip(w, 400, 0.3)
    want = cpu_copy(w)
    second = copy_to_host(w, dict(first))
    assert_same(second, want, "second copy, into the first one's buffers")
    assert {k: t.data_ptr() for k, t in second.items()} == ptrs      # the spare buffers, not new ones


# --- the replica's side: HotSwapper over live tensors on the device ----------------------------------

def _published_run(url: str) -> list[dict]:
    """Versions 0-6 of the odd weights through the real publisher (anchors at 0 and 4); version 2 changes
    half of every tensor (staged densely), the others 2%."""
    w = odd_weights(6)
    truth = []
    with Publisher(url, anchor_every=4, anchor_chain_fraction=100.0, codec=CODEC) as pub:
        for step in range(7):
            pub.publish(w, step)
            truth.append({k: v.clone() for k, v in w.items()})
            flip(w, 600 + step, 0.5 if step == 1 else 0.02)
    return truth


def _proof(live: dict, reader: SnapshotReader, version: int, truth: dict) -> None:
    """The live tensors are the trainer's bits, and hash to the manifest's digests."""
    assert_same(live, truth, f"v{version}")
    m = reader.manifest(version)
    wrong = [n for n, e in m.tensors.items() if f"{digest(live[n]):016x}" != e.xxh3]
    assert not wrong, f"v{version}: live tensors not hashing to the manifest's digests: {wrong}"


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
def test_hot_loads_into_device_tensors_forward_across_an_anchor_and_back_are_bit_exact(tmp_path, layout):
    url = str(tmp_path / "run")
    truth = _published_run(url)
    reader = SnapshotReader(url)
    live = on_device(truth[0])
    if layout == "strided":
        live = {k: v.t().contiguous().t() for k, v in live.items()}
        assert not any(v.is_contiguous() for v in live.values())
    ptrs = {k: v.data_ptr() for k, v in live.items()}
    sw = HotSwapper(live, reader, version=0, apply_method=METHOD)
    for target, route, anchor in ((1, [1], False), (3, [2, 3], False), (6, [4, 5, 6], True),
                                  (2, [0, 1, 2], True), (5, [4, 5], True), (6, [6], False)):
        rep = sw.hotload(target)
        assert (rep.path, rep.via_anchor, sw.version) == (route, anchor, target)
        _proof(live, reader, target, truth[target])
    assert {k: v.data_ptr() for k, v in live.items()} == ptrs              # written in place, never replaced
    assert all(v.device.type == torch.device(DEVICE).type for v in live.values())
    assert reader.verify(6).chain == [4, 5, 6]                             # and the bucket proves itself


def test_a_first_load_into_zeroed_device_tensors_writes_every_element(tmp_path):
    url = str(tmp_path / "run")
    truth = _published_run(url)
    reader = SnapshotReader(url)
    live = {k: torch.zeros_like(v, device=DEVICE) for k, v in truth[0].items()}
    sw = HotSwapper(live, reader, apply_method=METHOD)
    rep = sw.load_initial(5)                                              # dense changes: the torch swap path
    assert rep.via_anchor and rep.path == [4, 5]
    _proof(live, reader, 5, truth[5])
    sw.hotload(3)
    _proof(live, reader, 3, truth[3])


def test_a_corrupt_object_is_refused_and_the_device_weights_keep_their_version(tmp_path):
    url = str(tmp_path / "run")
    truth = _published_run(url)
    store = Store.from_url(url)
    m = read_manifest(store, 3, None)
    name = max((n for n, e in m.tensors.items() if e.object is not None), key=lambda n: m.tensors[n].length)
    e = m.tensors[name]
    key = m.objects[e.object].key
    good = store.get(key)
    bad = bytearray(good)
    bad[e.offset + e.length - 2] ^= 0x10                                  # inside a chunk payload
    store.put(key, bytes(bad))
    reader = SnapshotReader(url)
    live = on_device(truth[1])
    sw = HotSwapper(live, reader, version=1, apply_method=METHOD)
    with pytest.raises(DeltaError, match=name):
        sw.hotload(3)
    assert sw.version == 1
    _proof(live, reader, 1, truth[1])
    with pytest.raises(DeltaError):
        reader.verify(3)
    store.put(key, good)                                                  # repaired: it goes through
    sw.hotload(3)
    _proof(live, reader, 3, truth[3])


def test_a_commit_failing_half_way_puts_back_every_device_tensor_it_wrote(tmp_path, monkeypatch):
    """The last sparse write fails (a device error), after every densely changed tensor was swapped and the other
    sparse ones scattered: each is put back, read from the host copies the commit kept."""
    import ckptdelta.delta.codec as codec

    url = str(tmp_path / "run")
    truth = _published_run(url)
    reader = SnapshotReader(url)
    live = on_device(truth[1])
    sw = HotSwapper(live, reader, version=1, apply_method=METHOD)
    prepared = sw.prepare(2)                                              # half of every tensor: dense and sparse
    sparse = sum(s.st.dense is None for s in prepared.staged)
    assert len(prepared.staged) == len(truth[2]) and 0 < sparse < len(truth[2])
    real, calls = codec._torch_apply, []

    def failing(t, st):
        calls.append(st.name)
        if len(calls) == sparse:
            real(t, st)                                                   # written, then the device fails
            raise RuntimeError("injected: CUDA error: an illegal memory access was encountered")
        real(t, st)

    monkeypatch.setattr(codec, "_torch_apply", failing)
    with pytest.raises(HotLoadError, match="restored"):
        sw.commit(prepared)
    assert len(calls) > sparse                                            # the rollback wrote the old bits back
    assert sw.version == 1
    _proof(live, reader, 1, truth[1])
    sw.commit(prepared)                                                   # the same prepared update, now whole
    _proof(live, reader, 2, truth[2])


def test_a_device_tensor_written_after_prepare_is_refused_and_the_other_write_kept(tmp_path):
    url = str(tmp_path / "run")
    truth = _published_run(url)
    reader = SnapshotReader(url)
    live = on_device(truth[3])
    sw = HotSwapper(live, reader, version=3, apply_method=METHOD)
    prepared = sw.prepare(5)                                              # through the anchor at 4: sparse changes
    s = next(s for s in prepared.staged if s.st.dense is None and s.st.positions.shape[0])
    pos = int(s.st.positions[0])
    bits = dtypes.torch_bits_view(live[s.live_name])
    foreign = bits[pos].clone() ^ 1
    bits[pos] = foreign                                                   # someone else writes in place
    with pytest.raises(HotLoadError, match="after prepare"):
        sw.commit(prepared)
    assert sw.version == 3 and int(bits[pos]) == int(foreign)
    for k, v in truth[3].items():
        if k != s.live_name:
            assert same_bits(live[k], v), k


def test_apply_many_on_device_tensors_is_all_or_nothing():
    g = torch.Generator().manual_seed(8)
    old = {f"w{i}": torch.randn(256, 64, generator=g).to(torch.bfloat16) for i in range(3)}
    new = {k: v.clone() for k, v in old.items()}
    flip(new, 800, 0.05)
    recs = {k: encode(old[k], new[k], name=k).to_bytes() for k in old}
    live = on_device(old)
    bad = bytearray(recs["w2"])
    bad[-3] ^= 0x40
    with pytest.raises(DeltaError, match="w2"):
        apply_many([(live[k], bytes(bad) if k == "w2" else recs[k]) for k in sorted(live)])
    assert_same(live, old, "after the refused batch")
    apply_many([(live[k], recs[k]) for k in sorted(live)])
    assert_same(live, new, "after the batch")


# --- the reference engine with --device -----------------------------------------------------------

def test_check_device_takes_this_device_and_refuses_a_cuda_device_that_is_not_there():
    from ckptdelta.loader.servable import check_device

    check_device(DEVICE)
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(NotServableError, match="cuda"):
        check_device(f"cuda:{n}")


def test_the_reference_engine_serves_from_the_device_and_hot_loads_there_bit_exact(tmp_path):
    pytest.importorskip("tokenizers")
    from safetensors.torch import load_file

    from ckptdelta.loader.engines.reference.model import Engine, SamplingParams, load_engine
    from ckptdelta.loader.hf_model import load_model
    from tests.lm import hf_extra_files, rl_step, save_tiny_lm

    lm_dir = save_tiny_lm(str(tmp_path / "lm"))
    url = str(tmp_path / "run")
    truth = [load_file(os.path.join(lm_dir, "model.safetensors"))]
    with Publisher(url, extra_files=hf_extra_files(lm_dir), anchor_every=3, codec=CODEC) as pub:
        for step in range(5):
            if step:
                truth.append(rl_step(truth[-1], seed=900 + step))
            pub.publish(truth[-1], step)
    engine, reader = load_engine(bucket=url, snapshot=1, device=DEVICE, cache_dir=str(tmp_path / "cache"))
    params = dict(engine.model.named_parameters())
    assert engine.version == 1 and all(p.device.type == torch.device(DEVICE).type for p in params.values())
    prompt = engine.encode("hello replica")
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    sampled = SamplingParams(max_tokens=6, temperature=1.0, seed=7, n=2, logprobs=2, ignore_eos=True)
    for target in (2, 4, 1, 3):                                           # 3 and 4 past the anchor at 3, then back
        engine.swapper.hotload(target)
        assert engine.version == target
        assert_same({k: params[k] for k in truth[target]}, truth[target], f"v{target}")
        m = reader.manifest(target)
        assert all(f"{digest(params[n]):016x}" == e.xxh3 for n, e in m.tensors.items())
        fresh, tok = load_model(reader.materialize(target, str(tmp_path / f"v{target}")), device=DEVICE)
        other = Engine(fresh, tok)
        assert (engine.generate(prompt, greedy).completions[0].token_ids
                == other.generate(prompt, greedy).completions[0].token_ids)
        out = engine.generate(prompt, sampled)
        assert out.policy_versions == [target] and all(len(c.token_ids) == 6 for c in out.completions)
        assert all(np.isfinite(c.logprobs).all() for c in out.completions)
