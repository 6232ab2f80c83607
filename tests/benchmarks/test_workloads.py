"""benchmarks/workloads.py and benchmarks/baselines.py: fast checks on the tiny model."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from benchmarks import baselines as B
from benchmarks import workloads as W

_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _ibits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(_INT[t.element_size()])


def assert_bit_identical(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert tuple(a[k].shape) == tuple(b[k].shape), k
        assert torch.equal(_ibits(a[k]), _ibits(b[k])), k


@pytest.fixture(scope="module")
def quick():
    """The quick reference workloads (tiny), from the shared cache (cold: ~15-40 s, once)."""
    return {w.name: w for w in W.reference_workloads(quick=True)}


# --------------------------------------------------------------------------- workloads

def test_generation_deterministic_and_cache_round_trip(tmp_path, monkeypatch):
    monkeypatch.setattr(W, "WARMUP_STEPS", 2)  # keep the two cold generations short (the key includes it)
    a = W.snapshots("tiny", lr=1e-6, steps=2, seed=3, dtype="fp32", cache_dir=tmp_path / "a")
    b = W.snapshots("tiny", lr=1e-6, steps=2, seed=3, dtype="fp32", cache_dir=tmp_path / "b")
    assert len(a) == 3
    for x, y in zip(a, b):  # two cold generations
        assert_bit_identical(x, y)
    c = W.snapshots("tiny", lr=1e-6, steps=2, seed=3, dtype="fp32", cache_dir=tmp_path / "a")  # cache hit
    for x, y in zip(a, c):
        assert_bit_identical(x, y)
    # the published bf16 snapshot is exactly the cast of the fp32 master
    bf = W.snapshots("tiny", lr=1e-6, steps=2, seed=3, dtype="bf16", cache_dir=tmp_path / "a")
    for x, y in zip(a, bf):
        assert_bit_identical({k: v.to(torch.bfloat16) for k, v in x.items()}, y)
    # another seed gives other weights
    d = W.snapshots("tiny", lr=1e-6, steps=1, seed=4, dtype="fp32", cache_dir=tmp_path / "a")
    assert not torch.equal(_ibits(d[0]["lm_head.weight"]), _ibits(a[0]["lm_head.weight"]))
    assert not list(tmp_path.rglob("*.tmp")), "temp files left behind"
    assert not list(tmp_path.rglob("*.pkl")) and not list(tmp_path.rglob("*.pt"))


def test_quick_workloads_shape(quick):
    assert sorted(quick) == sorted(["bf16-lr1e-06-1step", "bf16-lr1e-05-1step", "bf16-lr1e-06-10step",
                                    "fp8-lr1e-06-1step", "fp32-lr1e-06-1step"])
    w = quick["bf16-lr1e-06-1step"]
    assert (w.lr, w.window, w.dtype) == (1e-6, 1, "bf16")
    assert quick["bf16-lr1e-06-10step"].window == 10
    n = sum(t.numel() for t in w.new.values())
    assert 2e6 <= n <= 4e6
    for t in list(w.old.values()) + list(w.new.values()):
        assert t.device.type == "cpu" and t.is_contiguous() and t.dtype == torch.bfloat16
    mats = torch.cat([t.float().abs().reshape(-1) for k, t in w.new.items() if t.dim() == 2])
    assert 0.012 < float(mats.median()) < 0.03
    norms = torch.cat([t.float().reshape(-1) for k, t in w.new.items() if t.dim() == 1])
    assert 0.8 < float(norms.mean()) < 1.2
    assert "model.embed_tokens.weight" in w.new and "lm_head.weight" in w.new
    assert {t.dtype for t in quick["fp32-lr1e-06-1step"].new.values()} == {torch.float32}
    fp8 = quick["fp8-lr1e-06-1step"].new
    assert fp8["model.layers.0.mlp.up_proj.weight"].dtype == torch.float8_e4m3fn
    assert fp8["model.layers.0.mlp.up_proj.weight_scale_inv"].dtype == torch.float32
    assert fp8["model.embed_tokens.weight"].dtype == torch.bfloat16
    # scaled into e4m3's normal range, not mostly subnormal / zero
    assert float((fp8["model.layers.0.mlp.up_proj.weight"].float() == 0).float().mean()) < 0.01


def test_change_fraction_in_field_band(quick):
    f1 = W.change_fraction(quick["bf16-lr1e-06-1step"].old, quick["bf16-lr1e-06-1step"].new)
    assert 0.005 <= f1 <= 0.02  # field: 98-99.5% of bf16 weights unchanged per step at lr ~1e-6
    f10 = W.change_fraction(quick["bf16-lr1e-06-10step"].old, quick["bf16-lr1e-06-10step"].new)
    f_hi = W.change_fraction(quick["bf16-lr1e-05-1step"].old, quick["bf16-lr1e-05-1step"].new)
    assert 3 * f1 < f10 < 0.25 and 3 * f1 < f_hi < 0.3
    f32 = W.change_fraction(quick["fp32-lr1e-06-1step"].old, quick["fp32-lr1e-06-1step"].new)
    assert f32 > 0.9


def test_scale_state_dict_keeps_pairing():
    g = torch.Generator().manual_seed(0)
    old = {"a": torch.randn(64, 32, generator=g).to(torch.bfloat16), "b": torch.randn(48, generator=g).to(torch.bfloat16),
           "s": torch.tensor([0.5])}
    new = {k: v.clone() for k, v in old.items()}
    new["a"].view(-1)[::17] = 1.0
    new["b"][::5] = -2.0
    target = 10 * sum(t.numel() * t.element_size() for t in old.values())
    for layout in ("concat", "copies"):
        so, sn = W.scale_state_dict(old, target, layout=layout), W.scale_state_dict(new, target, layout=layout)
        size = sum(t.numel() * t.element_size() for t in so.values())
        assert 0.8 * target <= size <= 1.2 * target
        assert W.change_fraction(so, sn, (torch.bfloat16,)) == pytest.approx(
            W.change_fraction(old, new, (torch.bfloat16,)))
        if layout == "concat":
            assert so["a"].shape == (640, 32) and torch.equal(_ibits(so["a"][:64]), _ibits(old["a"]))
            assert not torch.equal(_ibits(so["a"][64:128]), _ibits(old["a"]))  # copies are permuted
        else:
            assert "copy3.a" in so and so["s"].shape == (1,)


# --------------------------------------------------------------------------- baselines

@pytest.mark.parametrize("wname", ["bf16-lr1e-06-1step", "bf16-lr1e-05-1step", "fp8-lr1e-06-1step",
                                   "fp32-lr1e-06-1step"])
def test_baselines_round_trip(quick, wname):
    w = quick[wname]
    before = {k: v.clone() for k, v in w.old.items()}
    dense = B.dense_nbytes(w.new)
    sizes = {}
    for b in B.all_baselines():
        if not b.supports(w.new):
            with pytest.raises(B.Unsupported):
                b.encode(w.old, w.new)
            continue
        blobs = b.encode(w.old, w.new)
        out = b.decode(w.old, blobs)
        assert_bit_identical(out, w.new)
        sizes[b.name] = B.encoded_nbytes(blobs)
    assert_bit_identical(w.old, before)  # nobody wrote into old
    assert set(sizes) >= {"safetensors", "zstd3-full", "xor+zstd3", "sparse-idx+zstd3", "zipnn-delta"}
    assert sizes["safetensors"] >= dense
    if wname == "bf16-lr1e-06-1step":
        assert dense / sizes["xor+zstd3"] > 20 and dense / sizes["sparse-idx+zstd3"] > 20
        assert dense / sizes["zstd3-full"] < 2


def _special_pair():
    """bf16/fp16/fp32/fp8 tensors with NaN payloads, -0.0, inf and subnormals changing."""
    g = torch.Generator().manual_seed(1)
    old, new = {}, {}
    for dt in (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn):
        o = (torch.randn(1000, generator=g) * 0.05).to(dt)
        n = o.clone()
        bits = _ibits(n)
        bits[::7] ^= 1
        bits[3] = _ibits(torch.tensor([-0.0], dtype=dt))[0]
        if dt != torch.float8_e4m3fn:
            bits[5] = _ibits(torch.tensor([float("inf")], dtype=dt))[0]
        bits[9] = _ibits(torch.tensor([float("nan")], dtype=dt))[0] ^ 1  # a NaN with another payload
        old[str(dt)] = o
        new[str(dt)] = n
    old["empty"] = torch.zeros(0, dtype=torch.bfloat16)
    new["empty"] = torch.zeros(0, dtype=torch.bfloat16)
    old["same"] = torch.ones(10, 10, dtype=torch.bfloat16)
    new["same"] = old["same"].clone()
    return old, new


def test_baselines_special_values():
    old, new = _special_pair()
    for b in B.all_baselines():
        out = b.decode(old, b.encode(old, new))
        assert_bit_identical(out, new)


def test_zipnn_reports_unsupported_dtype():
    old = {"i": torch.arange(100, dtype=torch.int32)}
    new = {"i": torch.arange(100, dtype=torch.int32) + 1}
    z = B.ZipNNDelta()
    assert not z.supports(new)
    with pytest.raises(B.Unsupported):
        z.encode(old, new)
    for b in (B.XorZstd(), B.SparseIndexZstd(), B.ZstdFull()):  # the others take any dtype
        assert_bit_identical(b.decode(old, b.encode(old, new)), new)


def test_sparse_gap_type_widens():
    old = {"x": torch.zeros(200_000, dtype=torch.bfloat16)}
    new = {"x": old["x"].clone()}
    new["x"][[0, 150_000]] = 1.0  # a gap of 150000 needs u32
    b = B.SparseIndexZstd()
    assert_bit_identical(b.decode(old, b.encode(old, new)), new)


# --------------------------------------------------------------------------- entropy

def test_ordered_key_and_step():
    x = torch.tensor([1.0, -1.0, 0.0, -0.0, 2.0], dtype=torch.bfloat16)
    ob = B.to_bits(x)
    nb = ob.copy()
    # one bf16 ulp towards +inf: magnitude up for positives, down for negatives, -0 -> +0
    nb[0] += 1
    nb[1] -= 1
    nb[2] += 1
    nb[3] = 0x0000
    nb[4] += 1
    steps = B.signed_step(ob, nb, torch.bfloat16)
    assert steps.tolist() == [1, 1, 1, 1, 1]
    assert B.signed_step(nb, ob, torch.bfloat16).tolist() == [-1, -1, -1, -1, -1]
    keys = B.ordered_key(B.to_bits(torch.tensor([-2.0, -1.0, -0.0, 0.0, 1.0, 2.0], dtype=torch.float32)),
                         torch.float32)
    assert np.all(np.diff(keys.astype(np.int64)) > 0)


def test_change_entropy_known_answer():
    n, period = 10_000, 100
    old = {"w": torch.full((n,), 1.0, dtype=torch.bfloat16),
           "v": torch.full((n,), -1.0, dtype=torch.bfloat16)}
    new = {k: t.clone() for k, t in old.items()}
    wb, vb = B.to_bits(new["w"]), B.to_bits(new["v"])
    wb[period - 1::period] += 1   # +1 ulp: key step +1
    vb[period - 1::period] += 1   # -1.0 -> larger magnitude: key step -1
    ce = B.change_entropy(old, new)
    p = 1 / period
    assert ce["n_elements"] == 2 * n and ce["n_changed"] == 2 * n // period
    assert ce["frac_changed"] == pytest.approx(p)
    assert ce["pos_bits_gap"] == pytest.approx(0.0, abs=1e-12)  # every gap is exactly 100
    h = -(p * math.log2(p) + (1 - p) * math.log2(1 - p))
    assert ce["pos_bits_iid"] == pytest.approx(h / p)
    # new values: two equally likely bit patterns (one per tensor) -> 1 bit; steps +1 / -1 -> 1 bit
    assert ce["val_bits_new"] == pytest.approx(1.0)
    assert ce["val_bits_step"] == pytest.approx(1.0)
    assert ce["total_bytes"] == pytest.approx(ce["n_changed"] * (0.0 + 1.0) / 8)
    assert ce["dense_bytes"] == 4 * n
    assert ce["by_dtype"]["bfloat16"]["n_changed"] == ce["n_changed"]


def test_change_entropy_random_steps():
    rng = np.random.default_rng(0)
    old = {"w": torch.from_numpy(rng.integers(0x3C00, 0x3D00, size=50_000).astype(np.int16)).view(torch.bfloat16)}
    ob = B.to_bits(old["w"])
    nb = ob.copy()
    mask = rng.random(ob.size) < 0.05
    nb[mask] += rng.choice(np.array([1, 2, 3, 4], dtype=np.uint16), size=int(mask.sum()))
    new = {"w": B.from_bits(nb, torch.bfloat16, (ob.size,))}
    ce = B.change_entropy(old, new)
    assert ce["frac_changed"] == pytest.approx(0.05, rel=0.1)
    assert ce["val_bits_step"] == pytest.approx(2.0, abs=0.02)   # uniform over 4 steps
    assert ce["pos_bits_gap"] == pytest.approx(ce["pos_bits_iid"], rel=0.05)  # positions are iid
    assert ce["val_bits_new"] > ce["val_bits_step"]
    assert ce["ratio_limit"] > 10


def test_change_entropy_on_workload(quick):
    w = quick["bf16-lr1e-06-1step"]
    ce = B.change_entropy(w.old, w.new)
    assert ce["frac_changed"] == pytest.approx(W.change_fraction(w.old, w.new))
    assert 0 < ce["val_bits_step"] < ce["val_bits_new"] <= 16
    assert ce["pos_bits_gap"] <= ce["pos_bits_iid"] + 0.5
    # an order-0 coder of this pair beats XOR+zstd-3
    xz = B.encoded_nbytes(B.XorZstd().encode(w.old, w.new))
    assert ce["total_bytes"] < xz
