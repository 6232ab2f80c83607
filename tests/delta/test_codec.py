"""The codec round trip is bit-exact for every dtype, shape, layout and bit pattern.

Values are random bit patterns viewed as the dtype, mixed with the patterns
floats make hard (NaN payloads, signalling NaNs, +-inf, -0.0, subnormals) and
integer extremes; changes mix random bits, one-ulp moves, sign flips and jumps
to those specials. Equality is equality of bits, never of values.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptdelta.delta import chunks, codec, dtypes, record
from ckptdelta.delta.encodings import frames, sparse
from ckptdelta.delta.errors import ChecksumError, ParentMismatchError, ShapeMismatchError
from tests import naive
from tests import TESTS

ALL_DTYPES = sorted(dtypes.BY_NAME)
NUMPY_DTYPES = {  # dtypes numpy can hold itself; the others go through torch only
    "BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "I16": np.int16, "I32": np.int32, "I64": np.int64,
    "F16": np.float16, "F32": np.float32, "F64": np.float64,
    "U16": np.uint16, "U32": np.uint32, "U64": np.uint64,
}
FLOAT_LAYOUT = {"F16": (5, 10), "BF16": (8, 7), "F32": (8, 23), "F64": (11, 52), "F8_E4M3": (4, 3), "F8_E5M2": (5, 2)}
INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
SHAPES = [(), (0,), (1,), (7,), (3, 0, 2), (5, 3), (2, 3, 5), (13, 11), (1031,), (33, 31), (4, 1, 9)]
GOLDEN = Path(TESTS) / "golden"

# CKPTDELTA_EXAMPLES=2000 for a deeper hunt than CI's
SETTINGS = settings(max_examples=int(os.environ.get("CKPTDELTA_EXAMPLES", "120")), deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# --- building inputs from bits ------------------------------------------------------

def special_bits(name: str) -> list[int]:
    """The bit patterns of ``name`` most likely to break a codec that is not bit-exact."""
    dt = dtypes.BY_NAME[name]
    w = 8 * dt.itemsize
    if name == "BOOL":
        return [0, 1]
    mask, sign = (1 << w) - 1, 1 << (w - 1)
    out = {0, 1, mask, sign, sign - 1, sign + 1, mask - 1}
    if name in FLOAT_LAYOUT:
        e, m = FLOAT_LAYOUT[name]
        exp_all = ((1 << e) - 1) << m
        for s in (0, sign):
            out |= {
                s,                                  # +-0.0
                s | 1,                              # smallest subnormal
                s | ((1 << m) - 1),                 # largest subnormal
                s | (1 << m),                       # smallest normal
                s | (exp_all - 1),                  # largest finite
                s | exp_all,                        # +-inf
                s | exp_all | (1 << (m - 1)),       # quiet NaN
                s | exp_all | 1,                    # signalling NaN, payload 1
                s | exp_all | ((1 << m) - 1),       # NaN with every payload bit
                s | exp_all | (1 << (m - 1)) | 0x5 & ((1 << m) - 1),  # quiet NaN with a payload
            }
    return sorted(out)


def random_bits(rng: np.random.Generator, name: str, n: int, special_rate: float) -> np.ndarray:
    dt = dtypes.BY_NAME[name]
    if name == "BOOL":
        return rng.integers(0, 2, size=n, dtype=np.uint8)
    bits = rng.integers(0, 1 << (8 * dt.itemsize), size=n, dtype=dt.bits_dtype, endpoint=False)
    sp = np.array(special_bits(name), dtype=np.uint64).astype(dt.bits_dtype)
    pick = rng.random(n) < special_rate
    bits[pick] = sp[rng.integers(0, sp.shape[0], size=int(pick.sum()))]
    return bits


def mutate(rng: np.random.Generator, name: str, old: np.ndarray, fraction: float) -> np.ndarray:
    """``old`` with about ``fraction`` of its elements changed in every way a trainer or a bug can."""
    dt = dtypes.BY_NAME[name]
    new = old.copy()
    where = np.flatnonzero(rng.random(old.shape[0]) < fraction)
    if where.size == 0:
        return new
    if name == "BOOL":
        new[where] ^= 1
        return new
    w = 8 * dt.itemsize
    kind = rng.integers(0, 4, size=where.shape[0])
    sp = np.array(special_bits(name), dtype=np.uint64).astype(dt.bits_dtype)
    rand = random_bits(rng, name, where.shape[0], 0.0)
    keys = naive.key(old[where], w, dt.sign_magnitude).astype(object)
    step = rng.integers(-3, 4, size=where.shape[0]).astype(object)
    moved = naive.unkey(np.array([(k + s) % (1 << w) for k, s in zip(keys, step)], dtype=object).astype(np.uint64),
                        w, dt.sign_magnitude).astype(dt.bits_dtype)
    choice = np.select([kind == 0, kind == 1, kind == 2],
                       [rand, moved, old[where] ^ np.array(1 << (w - 1), np.uint64).astype(dt.bits_dtype)],
                       sp[rng.integers(0, sp.shape[0], size=where.shape[0])])
    new[where] = choice
    return new


def make(bits: np.ndarray, name: str, shape: tuple[int, ...], layout: str, kind: str):
    """A numpy array or torch tensor of dtype ``name`` and logical shape ``shape`` holding ``bits`` in C order,
    laid out contiguously, transposed, or strided (every other element of a wider buffer)."""
    dt = dtypes.BY_NAME[name]
    logical = bits.reshape(shape)
    if layout == "transposed" and len(shape) >= 2:
        base = np.transpose(logical).copy(order="C")
        perm = tuple(reversed(range(len(shape))))
        if kind == "numpy":
            return base.view(NUMPY_DTYPES[name]).transpose(perm)
        return torch.from_numpy(base.view(_np_int(dt))).view(dt.torch_dtype).permute(perm)
    if layout == "strided" and len(shape) >= 1:
        base = np.zeros(shape[:-1] + (2 * shape[-1] + 1,), dt.bits_dtype)
        base[..., 1::2] = logical
        if kind == "numpy":
            return base.view(NUMPY_DTYPES[name])[..., 1::2]
        return torch.from_numpy(base.view(_np_int(dt))).view(dt.torch_dtype)[..., 1::2]
    base = logical.copy(order="C")  # (np.ascontiguousarray would make a 0-d array 1-d)
    if kind == "numpy":
        return base.view(NUMPY_DTYPES[name])
    return torch.from_numpy(base.view(_np_int(dt))).view(dt.torch_dtype)


def _np_int(dt: dtypes.DType) -> np.dtype:
    return np.dtype(np.uint8) if dt.itemsize == 1 else np.dtype(f"<i{dt.itemsize}")


def bits_of(x) -> np.ndarray:
    """Logical C-order bits of ``x``, computed without the code under test (integer views only)."""
    if isinstance(x, torch.Tensor):
        w = x.element_size()
        return x.detach().cpu().view(INT_VIEW[w]).contiguous().reshape(-1).numpy().view(f"<u{w}").copy()
    return np.ascontiguousarray(x.view(f"<u{x.dtype.itemsize}")).reshape(-1).copy()


def assert_same_bits(got, want, msg: str = "") -> None:
    assert type(got) is type(want) or isinstance(got, type(want)), msg
    assert tuple(got.shape) == tuple(want.shape), msg
    assert got.dtype == want.dtype, msg
    np.testing.assert_array_equal(bits_of(got), bits_of(want), err_msg=msg)


@st.composite
def pairs(draw, with_numpy: bool = True, names: list[str] = ALL_DTYPES,
          fractions: tuple[float, ...] = (0.0, 0.002, 0.05, 0.3, 1.0)):
    name = draw(st.sampled_from(names))
    kinds = ["torch", "numpy"] if with_numpy and name in NUMPY_DTYPES else ["torch"]
    kind = draw(st.sampled_from(kinds))
    shape = draw(st.sampled_from(SHAPES))
    layout = draw(st.sampled_from(["contiguous", "transposed", "strided"]))
    fraction = draw(st.sampled_from(fractions))
    chunk_elems = draw(st.sampled_from([1, 3, 64, 500, 1 << 20]))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    n = int(np.prod(shape))
    old_bits = random_bits(rng, name, n, special_rate=0.3)
    new_bits = mutate(rng, name, old_bits, fraction)
    return dict(name=name, kind=kind, shape=shape, layout=layout, chunk_elems=chunk_elems,
                old=make(old_bits, name, shape, layout, kind), new=make(new_bits, name, shape, layout, kind),
                old_bits=old_bits, new_bits=new_bits,
                desc=f"{name} {kind} {shape} {layout} fraction={fraction} chunk_elems={chunk_elems} seed={seed}")


def fresh_copy(x, layout: str, name: str):
    """A copy of ``x`` with the same layout (so in-place applies see the same strides)."""
    kind = "torch" if isinstance(x, torch.Tensor) else "numpy"
    return make(bits_of(x), name, tuple(x.shape), layout, kind)


# --- round trips ----------------------------------------------------------------------

@SETTINGS
@given(pairs())
def test_encode_to_bytes_decode_is_bit_exact(p):
    enc = codec.encode(p["old"], p["new"], name="layers.0.w", chunk_elems=p["chunk_elems"], level=1)
    buf = enc.to_bytes()
    assert len(buf) == enc.nbytes == enc.header.record_size, p["desc"]
    out = codec.decode(p["old"], buf)
    assert_same_bits(out, p["new"], p["desc"])
    if isinstance(out, torch.Tensor):
        assert out.is_contiguous(), p["desc"]
    else:
        assert out.flags.c_contiguous, p["desc"]
    np.testing.assert_array_equal(bits_of(p["old"]), p["old_bits"], err_msg="decode modified old: " + p["desc"])
    assert codec.digest(out) == codec.digest(p["new"]) == enc.header.digest


def test_what_takes_a_delta_in_place_gets_a_view_of_its_own_memory():
    """codec._in_place() decides from attributes alone, and nothing checks pointers afterwards: so every
    tensor it admits must get from host_bits() a writable view of its own bytes, not a copy."""
    base = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    cases = [torch.nn.Parameter(base.clone()), base.clone()[2:5], torch.tensor(1.5), base.clone().t().contiguous(),
             base.to(torch.bfloat16), base.to(torch.float8_e4m3fn), base.to(torch.int64), base > 3,
             np.arange(12, dtype=np.int16).reshape(3, 4), np.zeros(5, np.uint8)]
    not_in_place = [base.clone().t(), np.arange(12, dtype=np.int16).reshape(3, 4)[:, ::2], torch.empty(0),
                    np.arange(4, dtype=np.int32)[::-1]]
    ro = np.arange(4, dtype=np.int32)
    ro.flags.writeable = False
    not_in_place.append(ro)
    for x in cases + not_in_place:
        dt = dtypes.of(x)
        h = codec.encode(None, x if isinstance(x, np.ndarray) else x.detach()).header
        admitted = codec._in_place(x, h, "auto")
        assert admitted == any(x is c for c in cases), x
        if admitted:
            bits = dtypes.host_bits(x)
            ptr, nbytes = (x.ctypes.data, x.nbytes) if isinstance(x, np.ndarray) else \
                (x.data_ptr(), x.numel() * x.element_size())
            assert bits.flags.writeable and bits.dtype == dt.bits_dtype
            assert (bits.ctypes.data, bits.nbytes) == (ptr, nbytes), x


@SETTINGS
@given(pairs(), st.sampled_from(["auto", "torch"]))
def test_apply_in_place_is_bit_exact_on_every_layout(p, method):
    enc = codec.encode(p["old"], p["new"], name="w", chunk_elems=p["chunk_elems"], level=1)
    live = fresh_copy(p["old"], p["layout"], p["name"])
    ptr = live.data_ptr() if isinstance(live, torch.Tensor) else live.__array_interface__["data"][0]
    codec.apply_(live, enc.to_bytes(), method=method)
    np.testing.assert_array_equal(bits_of(live), p["new_bits"], err_msg=f"{p['desc']} method={method}")
    assert ptr == (live.data_ptr() if isinstance(live, torch.Tensor) else live.__array_interface__["data"][0])


@SETTINGS
@given(pairs(with_numpy=False))
def test_stage_then_torch_apply_is_bit_exact(p):
    enc = codec.encode(p["old"], p["new"], name="w", chunk_elems=p["chunk_elems"], level=1)
    live = fresh_copy(p["old"], p["layout"], p["name"])
    staged = codec.stage(live, enc.to_bytes())
    np.testing.assert_array_equal(bits_of(live), p["old_bits"], err_msg="stage modified live: " + p["desc"])
    if staged.dense is None:
        assert staged.n_changed == int(np.count_nonzero(p["old_bits"] != p["new_bits"])), p["desc"]
    staged.apply_(live, method="torch")
    np.testing.assert_array_equal(bits_of(live), p["new_bits"], err_msg=p["desc"])
    again = codec.stage_full(fresh_copy(p["old"], p["layout"], p["name"]), p["new"], name="w",
                             expected_digest=enc.header.digest)
    live2 = fresh_copy(p["old"], p["layout"], p["name"])
    again.apply_(live2)
    np.testing.assert_array_equal(bits_of(live2), p["new_bits"], err_msg="stage_full: " + p["desc"])


@SETTINGS
@given(pairs(with_numpy=False, names=["BF16", "F16", "F8_E4M3", "F8_E5M2", "F32", "I16", "U8"],
             fractions=(0.05, 0.45, 0.6, 1.0)),
       st.sampled_from([None, 0.0, 0.5, 1.0]), st.integers(0, 2**32 - 1))
def test_the_fast_path_round_trips_every_dtype_with_and_without_the_step_before(p, before, seed):
    """The fast path's dense steps (encoding 7 in element order; 8 and 9, for 16- and 8-bit floats, in class order,
    9 against the step before): random bits with special values (NaN payloads, infinities, -0.0, subnormals), the
    floats and two integer dtypes, every layout and chunk size, most elements changed or few, the grandparent
    absent or differing from the parent in none, half or all of its elements. The record decodes, stages and
    applies in place to the new bits, with the grandparent where a chunk needs it, and only a record of such chunks
    needs it."""
    grand = None
    if before is not None:
        rng = np.random.default_rng(seed)
        grand = make(mutate(rng, p["name"], p["old_bits"], before), p["name"], p["shape"], p["layout"], "torch")
    enc = codec.encode(p["old"], p["new"], name="w", chunk_elems=p["chunk_elems"], context=False, grandparent=grand)
    kinds = set(enc.encoding_counts())
    assert kinds <= {"unchanged", "sparse", "dense_step", "grouped_step", "grouped_pstep", "dense_xor", "raw"}
    assert enc.needs_grandparent == ("grouped_pstep" in kinds), p["desc"]
    if grand is None or p["name"] not in ("BF16", "F16", "F8_E4M3", "F8_E5M2"):
        assert "grouped_pstep" not in kinds, p["desc"]
    buf = enc.to_bytes()
    assert_same_bits(codec.decode(p["old"], buf, grandparent=grand), p["new"], p["desc"])
    live = fresh_copy(p["old"], p["layout"], p["name"])
    staged = codec.stage(live, buf, grandparent=grand)
    staged.apply_(live, method="torch")
    np.testing.assert_array_equal(bits_of(live), p["new_bits"], err_msg=p["desc"])
    live = fresh_copy(p["old"], p["layout"], p["name"])
    codec.apply_(live, buf, grandparent=grand)
    np.testing.assert_array_equal(bits_of(live), p["new_bits"], err_msg="in place: " + p["desc"])


@SETTINGS
@given(pairs())
def test_records_without_parent_round_trip(p):
    enc = codec.encode(None, p["new"], name="w", chunk_elems=p["chunk_elems"], level=1)
    assert set(enc.encoding_counts()) <= {"raw"} and not enc.header.has_parent
    buf = enc.to_bytes()
    out = codec.decode(None, buf)
    assert isinstance(out, torch.Tensor) and out.dtype == dtypes.BY_NAME[p["name"]].torch_dtype
    assert tuple(out.shape) == p["shape"]
    np.testing.assert_array_equal(bits_of(out), p["new_bits"], err_msg=p["desc"])
    typed = codec.decode(p["old"], buf)  # an old tensor only picks the output type and device
    assert type(typed) is type(p["old"])
    np.testing.assert_array_equal(bits_of(typed), p["new_bits"], err_msg=p["desc"])
    live = fresh_copy(p["old"], p["layout"], p["name"])  # a raw record applies to any tensor of its shape
    codec.apply_(live, buf)
    np.testing.assert_array_equal(bits_of(live), p["new_bits"], err_msg=p["desc"])


def test_digest_is_of_logical_content_whatever_the_layout():
    rng = np.random.default_rng(0)
    bits = random_bits(rng, "BF16", 6 * 7, 0.3)
    layouts = [make(bits, "BF16", (6, 7), lay, "torch") for lay in ("contiguous", "transposed", "strided")]
    assert len({codec.digest(x) for x in layouts}) == 1
    assert codec.digest(layouts[0]) == codec.digest(bits)  # numpy bits of the same bytes hash alike


# --- errors -------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["numpy", "torch"])
def test_shape_or_dtype_mismatch_raises_and_leaves_live_untouched(kind):
    conv = (lambda a: a) if kind == "numpy" else torch.from_numpy
    a = conv(np.arange(12, dtype=np.float32).reshape(3, 4))
    b = conv(np.arange(12, dtype=np.float32).reshape(3, 4) + 1)
    enc = codec.encode(a, b, name="blk.w")
    for wrong in (conv(np.zeros((4, 3), np.float32)), conv(np.zeros(12, np.float32)),
                  conv(np.zeros((3, 4), np.float64)), conv(np.zeros((3, 4), np.int32))):
        before = bits_of(wrong)
        for call in (lambda: codec.decode(wrong, enc), lambda: codec.apply_(wrong, enc),
                     lambda: codec.stage(wrong, enc), lambda: codec.encode(wrong, b, name="blk.w"),
                     lambda: codec.stage_full(wrong, b, name="blk.w")):
            with pytest.raises(ShapeMismatchError, match="blk.w"):
                call()
        np.testing.assert_array_equal(bits_of(wrong), before)
    staged = codec.stage(a, enc)
    with pytest.raises(ShapeMismatchError, match="blk.w"):
        staged.apply_(conv(np.zeros((2, 6), np.float32)))


def test_parent_mismatch_names_the_tensor_and_leaves_live_untouched():
    a = torch.arange(1000, dtype=torch.bfloat16)
    b = a.clone()
    b[::10] += 1
    other = a.clone()
    other[999] = 0  # same shape and dtype, one element different: not the parent
    enc = codec.encode(a, b, name="model.layers.3.mlp.up_proj.weight", chunk_elems=100).to_bytes()
    before = bits_of(other)
    for call in (lambda: codec.apply_(other, enc), lambda: codec.decode(other, enc), lambda: codec.stage(other, enc)):
        with pytest.raises(ParentMismatchError, match="model.layers.3.mlp.up_proj.weight"):
            call()
    np.testing.assert_array_equal(bits_of(other), before)
    with pytest.raises(ParentMismatchError, match="up_proj"):
        codec.decode(None, enc)  # a delta cannot be decoded without its parent


def test_a_parent_whose_classes_differ_is_named_as_the_wrong_parent_not_as_a_corrupt_payload():
    """The context decoders read the parent's exponents: against another tensor their streams fall
    apart (a FormatError inside) and the error says what happened: the wrong parent."""
    a = _bf16_weights(5000)
    b = a.clone()
    b.view(torch.int16)[::50] += 1
    enc = codec.encode(a, b, name="w", chunk_elems=1000)
    assert "gctx" in enc.encoding_counts()
    other = (a.float() * 64).to(torch.bfloat16)     # every exponent moved: every class differs
    with pytest.raises(ParentMismatchError, match="'w'"):
        codec.stage(other, enc)


def test_stage_keeps_the_bits_its_change_overwrites_for_the_undo():
    a = _bf16_weights(5000)
    b = a.clone()
    b.view(torch.int16)[::7] += 3
    for kw in ({}, {"verify": False}, {"threads": 1}):
        st = codec.stage(a, codec.encode(a, b, chunk_elems=1000), **kw)
        assert st.dense is None and st.positions.shape[0] == len(range(0, 5000, 7))
        np.testing.assert_array_equal(st.old, bits_of(a)[st.positions])
        np.testing.assert_array_equal(st.values, bits_of(b)[st.positions])


def test_stage_full_rejects_bytes_that_do_not_match_the_manifest_digest():
    a, b = np.zeros(10, np.float32), np.ones(10, np.float32)
    with pytest.raises(ChecksumError, match="emb"):
        codec.stage_full(a, b, name="emb", expected_digest=codec.digest(b) ^ 1)


@pytest.mark.parametrize("changed", [3, 40, 130])   # undo: old bits at positions, a chunk's copy, both
def test_apply_whose_result_misses_the_digest_puts_every_old_bit_back(changed):
    a = _bf16_weights(1000)
    b = a.clone()
    b.view(torch.int16)[:changed] ^= 0x15
    enc = codec.encode(a, b, chunk_elems=100)
    lying = codec.EncodedTensor(dataclasses.replace(enc.header, digest=enc.header.digest ^ 1), enc.payloads)
    live = a.clone()
    with pytest.raises(ChecksumError, match="left unchanged"):
        codec.apply_(live, lying)
    np.testing.assert_array_equal(bits_of(live), bits_of(a))


def test_apply_to_read_only_array_raises_a_codec_error():
    a = np.arange(10, dtype=np.float32)
    b = a.copy()
    b[3] = 7
    for new in (b, np.zeros_like(a)):  # sparse and dense staged forms
        ro = a.copy()
        ro.setflags(write=False)
        with pytest.raises(ShapeMismatchError, match="read-only"):
            codec.apply_(ro, codec.encode(a, new, name="ro"))


# --- encoding choice ---------------------------------------------------------------------

def _bf16_weights(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * 0.02).to(torch.bfloat16)


@pytest.mark.parametrize("context", [True, False], ids=["ctx", "fast"])
@pytest.mark.parametrize("name", ["BF16", "F16", "F32", "F64", "F8_E4M3", "F8_E5M2"])
def test_the_encoder_reports_a_nan_only_where_a_changed_element_became_one(name, context):
    """The publisher warns of NaNs from this flag instead of scanning every changed tensor whole."""
    rng = np.random.default_rng(len(name) + context)
    dt = dtypes.BY_NAME[name]
    mask, threshold = dtypes.nan_rule(dt)
    keep = dt.bits_dtype.type(~mask & ((1 << 8 * dt.itemsize) - 1) | (mask >> 2))   # far from NaN

    def enc(o, n):
        return codec.encode(dtypes.from_bits(o, dt, o.shape), dtypes.from_bits(n, dt, n.shape),
                            chunk_elems=1000, context=context)

    old = random_bits(rng, name, 6000, 0.0) & keep
    for fraction in (0.01, 0.5):
        new = mutate(rng, name, old, fraction) & keep
        assert enc(old, new).changed_nan is False
        o2, n2 = old.copy(), new.copy()
        o2[10] = n2[10] = dt.bits_dtype.type(mask)       # a NaN in both versions: unchanged, not reported
        assert enc(o2, n2).changed_nan is False
        n2[4321] = dt.bits_dtype.type(threshold + 1)     # in the fifth chunk, a changed element becomes NaN
        e = enc(o2, n2)
        assert e.changed_nan is True
        n3 = n2.copy()
        n3[4321] = new[4321]
        n3[2345] = dt.bits_dtype.type(mask | (1 << (8 * dt.itemsize - 1)))   # a negative NaN, all bits set
        assert enc(o2, n3).changed_nan is True
        assert_same_bits(codec.decode(dtypes.from_bits(o2, dt, o2.shape), e.to_bytes()),
                         dtypes.from_bits(n2, dt, n2.shape))
    assert codec.encode(None, dtypes.from_bits(new, dt, new.shape)).changed_nan is None   # nothing compared


def test_unchanged_tensor_costs_only_its_header():
    a = _bf16_weights(10_000)
    enc = codec.encode(a, a.clone(), name="w", chunk_elems=1000)
    assert enc.encoding_counts() == {"unchanged": 10}
    assert enc.nbytes == enc.header.header_size == len(enc.to_bytes())
    assert all(len(p) == 0 for p in enc.payloads)


def test_few_changes_are_sparse_and_small():
    a = _bf16_weights(100_000)
    b = a.clone()
    b.view(torch.int16)[::1000] += 1  # 0.1% of elements move one ulp
    enc = codec.encode(a, b, name="w", chunk_elems=1 << 20)
    assert enc.encoding_counts() == {"sparse": 1}
    assert enc.nbytes < 100_000 * 2 // 50


def test_a_step_moving_every_element_by_noise_is_coded_sparse_without_compressing_the_dense_or_raw_planes(
        monkeypatch):
    """A LoRA-like step (every fp32 element moved by a noise-like amount): the dense and raw planes' order-0
    estimates are above sparse's planes', so neither is compressed; the record is the one they would lose to."""
    g = torch.Generator().manual_seed(3)
    a = torch.randn(200_000, generator=g) * 1e-3
    b = a + torch.randn(200_000, generator=g) * 1e-5   # sparse 525 KB; dense XOR 540 KB, estimated 531 KB
    before = codec.encode(a, b, name="w", chunk_elems=1 << 20).to_bytes()
    calls = []
    real = frames.compressor

    def counting(level):
        c = real(level)

        class Counting:
            def compress(self, data):
                calls.append(len(data))
                return c.compress(data)
        return Counting()

    monkeypatch.setattr(frames, "compressor", counting)
    enc = codec.encode(a, b, name="w", chunk_elems=1 << 20)
    assert enc.encoding_counts() == {"sparse": 1}
    assert len(calls) == 2, calls            # sparse's gaps and steps only: no dense or raw try
    assert enc.to_bytes() == before
    monkeypatch.setattr(frames, "may_beat", lambda *a: True)       # every try compressed: the same choice
    calls.clear()
    assert codec.encode(a, b, name="w", chunk_elems=1 << 20).to_bytes() == before and len(calls) == 4


def test_dense_xor_is_chosen_when_it_is_smaller():
    a = _bf16_weights(100_000)
    b = a.clone()
    b.view(torch.int16)[:] ^= 1  # every element flips its lowest bit: the XOR planes are constant
    enc = codec.encode(a, b, name="w", chunk_elems=1 << 20)
    assert enc.encoding_counts() == {"dense_xor": 1}
    *_, sparse_payload = sparse.encode_payload(dtypes.host_bits(a), dtypes.host_bits(b),
                                               dtypes.BY_NAME["BF16"], 100_000, chunks.DEFAULT_LEVEL)
    assert enc.header.chunks[0].length < len(sparse_payload)


def test_raw_is_chosen_for_a_chunk_reset_to_zeros():
    """Resetting a tensor XORs into the old noise; the new zeros alone cost almost nothing."""
    a = _bf16_weights(100_000)
    b = torch.zeros_like(a)
    enc = codec.encode(a, b, name="w", chunk_elems=1 << 20)
    assert enc.encoding_counts() == {"raw": 1}
    assert enc.nbytes < 1000
    assert_same_bits(codec.decode(a, enc.to_bytes()), b)


@pytest.mark.parametrize("fraction", [0.01, 0.1, 0.5, 1.0])
def test_chosen_encoding_is_never_larger_than_sparse(fraction):
    rng = np.random.default_rng(int(fraction * 100))
    old = random_bits(rng, "F32", 20_000, 0.0)
    new = mutate(rng, "F32", old, fraction)
    dt = dtypes.BY_NAME["F32"]
    enc = codec.encode(old.view(np.float32), new.view(np.float32), chunk_elems=5000)
    for i, entry in enumerate(enc.header.chunks):
        s, e = enc.header.chunk_range(i)
        k = int(np.count_nonzero(old[s:e] != new[s:e]))
        *_, sparse_payload = sparse.encode_payload(old[s:e], new[s:e], dt, k, chunks.DEFAULT_LEVEL)
        assert entry.length <= len(sparse_payload)


def test_zero_d_and_empty_tensors_round_trip():
    for old, new in [(torch.tensor(1.5), torch.tensor(-0.0)), (np.array(3, np.int64), np.array(-1, np.int64)),
                     (torch.empty(0, 5, dtype=torch.float16), torch.empty(0, 5, dtype=torch.float16)),
                     (np.empty((2, 0), np.uint8), np.empty((2, 0), np.uint8))]:
        enc = codec.encode(old, new, name="s")
        assert enc.header.shape == tuple(new.shape)
        assert_same_bits(codec.decode(old, enc.to_bytes()), new)
        assert_same_bits(codec.decode(None, codec.encode(None, new).to_bytes()),
                         torch.from_numpy(new) if isinstance(new, np.ndarray) else new)
        live = old.clone() if isinstance(old, torch.Tensor) else old.copy()
        codec.apply_(live, enc.to_bytes())
        assert_same_bits(live, new)
    empty = codec.encode(np.empty(0, np.float32), np.empty(0, np.float32))
    assert empty.header.chunks == () and empty.nbytes == empty.header.header_size


def test_chunk_size_requests_are_clamped_into_the_format_limits():
    a = np.arange(100, dtype=np.int32)
    for requested, expected in [(0, 1), (-5, 1), (7, 7), (1000, 100), (1 << 30, 100)]:
        enc = codec.encode(a, a + 1, chunk_elems=requested)
        assert enc.header.chunk_elems == expected
        record.parse_header(enc.to_bytes())  # what the encoder writes, the parser accepts


def test_staged_change_goes_dense_when_positions_would_cost_more():
    a = _bf16_weights(1000)
    b = a.clone()
    b.view(torch.int16)[:] += 3
    staged = codec.stage(a, codec.encode(a, b, chunk_elems=100))
    assert staged.dense is not None and staged.positions.shape[0] == 0 and staged.n_changed == 1000
    sparse = codec.stage(a, codec.encode(a, a.clone().index_fill_(0, torch.tensor([5]), 1.0)))
    assert sparse.dense is None and sparse.positions.tolist() == [5]


# --- large indices ----------------------------------------------------------------------

@pytest.mark.slow
def test_positions_past_2_pow_31_apply_at_the_right_place():
    """A real uint8 tensor of 2^31 + 16 elements (~2.1 GB resident), with changes around the 2^31 boundary.

    The record is built chunk by chunk (one array in memory, not two): unchanged chunks
    everywhere but the last two, which hold changes either side of 2^31."""
    n = (1 << 31) + 16
    ce = 1 << 24
    live = np.zeros(n, np.uint8)
    changes = np.array([(1 << 31) - 2, (1 << 31) - 1, 1 << 31, (1 << 31) + 1, n - 1], np.int64)
    parent_digest = codec.digest(live)
    n_chunks = record.n_chunks_for(n, ce)
    dt = dtypes.BY_NAME["U8"]
    entries, payloads = [], []
    for i in range(n_chunks):
        s, e = i * ce, min(n, (i + 1) * ce)
        mine = changes[(changes >= s) & (changes < e)]
        if mine.size == 0:
            entries.append(record.ChunkEntry(record.UNCHANGED, 0, 0, 0, 0, xxhash.xxh3_64_intdigest(b"")))
            payloads.append(b"")
            continue
        new_chunk = live[s:e].copy()
        new_chunk[mine - s] = 0xA5
        entry, payload, _ = chunks.encode_chunk(live[s:e], new_chunk, dt)
        entries.append(entry)
        payloads.append(payload)
    live[changes] = 0xA5
    new_digest = codec.digest(live)
    live[changes] = 0
    header = record.RecordHeader("big", dt, (n,), n, ce, new_digest, parent_digest, True, tuple(entries),
                                 record.header_size_for(1, 3, n_chunks))
    enc = codec.EncodedTensor.from_bytes(codec.EncodedTensor(header, payloads).to_bytes())
    staged = codec.stage(live, enc)
    assert staged.positions.dtype == np.int64
    assert staged.positions.tolist() == changes.tolist()
    staged.apply_(live)
    assert np.flatnonzero(live).tolist() == changes.tolist()
    assert codec.digest(live) == new_digest


# --- golden files -------------------------------------------------------------------------

def golden_cases():
    index = GOLDEN / "index.json"
    return json.loads(index.read_text())["cases"] if index.exists() else []


def test_golden_files_cover_every_encoding_and_dtype():
    cases = golden_cases()
    seen = {enc for c in cases for enc in c["encodings"]}
    assert seen == set(record.ENCODING_NAMES.values())
    assert {c["dtype"] for c in cases} >= {"BF16", "F16", "F32", "F64", "F8_E4M3", "F8_E5M2", "I8", "I32", "I64",
                                         "U8", "BOOL"}


@pytest.mark.parametrize("case", golden_cases(), ids=lambda c: c["name"])
def test_golden_record_still_decodes(case):
    """Records written by a released encoder decode to the same bits forever."""
    dt = dtypes.BY_NAME[case["dtype"]]
    buf = (GOLDEN / case["record"]).read_bytes()
    enc = codec.EncodedTensor.from_bytes(buf)
    assert enc.encoding_counts() == case["encodings"]
    assert enc.header.name == case["name"] and enc.header.dtype == dt
    expected = np.load(GOLDEN / case["expected"])
    assert expected.dtype == dt.bits_dtype and list(expected.shape) == case["shape"]
    parent = grand = None

    def tensor(key: str) -> torch.Tensor:
        bits = np.load(GOLDEN / case[key])
        return torch.from_numpy(bits.reshape(-1).view(_np_int(dt))).view(dt.torch_dtype).reshape(case["shape"])

    if case["parent"] is not None:
        parent = tensor("parent")
    if case.get("grandparent") is not None:     # encoding 6's cases
        grand = tensor("grandparent")
    out = codec.decode(parent, buf, grandparent=grand)
    np.testing.assert_array_equal(bits_of(out), expected.reshape(-1))
    assert tuple(out.shape) == tuple(case["shape"])
    if parent is not None:
        codec.apply_(parent, buf, grandparent=grand)
        np.testing.assert_array_equal(bits_of(parent), expected.reshape(-1))


def test_stage_decodes_each_chunk_into_its_slice_of_the_staged_arrays_as_chunk_by_chunk_staging_would():
    """stage() decodes sparse, dense and gctx chunks straight into the staged positions / values (each chunk
    into its slice, sized from the header's counts) and keeps chunk-by-chunk staging for records with raw
    chunks or changes staged densely: both give the same staged tensor, bit for bit."""
    g = torch.Generator().manual_seed(7)
    old = (torch.randn(50_000, generator=g) * 0.02).to(torch.bfloat16)
    seen = set()
    # zeros: raw chunks (smaller than XOR planes); flip: every element's lowest bit, dense XOR chunks
    for share in (0.0005, 0.01, 0.2, 0.6, 1.0, "zeros", "flip"):
        for context in (True, False):
            new = old.clone()
            if share == "zeros":
                new[:20_000] = 0
            elif share == "flip":
                new.view(torch.int16)[30_000:] ^= 1
            else:
                pick = torch.rand(old.shape, generator=g) < share
                noise = torch.randint(-(1 << 15), 1 << 15, old.shape, generator=g, dtype=torch.int16)
                moved = (old.float() * (1 + 2 ** -7)).to(torch.bfloat16).view(torch.int16)
                new.view(torch.int16)[pick] = (moved if share < 1 else noise)[pick]
            enc = codec.encode(old, new, chunk_elems=8192, context=context)
            seen |= {c.encoding for c in enc.header.chunks}
            got = codec.stage(old, enc)
            want = codec._stage_chunkwise(dtypes.host_bits(old), enc, True, None)
            for f in ("positions", "values", "old", "dense"):
                a, b = getattr(got, f), getattr(want, f)
                assert (a is None) == (b is None) and (a is None or np.array_equal(a, b)), (share, context, f)
            out = old.clone()
            got.apply_(out)
            assert torch.equal(out.view(torch.int16), new.view(torch.int16)), (share, context)
    assert {record.SPARSE, record.DENSE_XOR, record.GCTX, record.RAW} <= seen


def test_dense_and_unchanged_chunks_of_a_sparsely_staged_record_decode_into_the_staged_arrays(monkeypatch):
    """One chunk rewritten (dense XOR planes), one lightly changed (sparse or ctx), the rest untouched: the
    record is staged sparsely, on the direct path (chunk-by-chunk staging is not called), zero-length slices
    between the changed chunks; and a wrong parent is refused on that path as before."""
    g = torch.Generator().manual_seed(3)
    old = (torch.randn(8 * 8192, generator=g) * 0.02).to(torch.bfloat16)
    new = old.clone()
    new.view(torch.int16)[3 * 8192: 4 * 8192] ^= 1      # every element's lowest bit: XOR planes win
    new[6 * 8192: 6 * 8192 + 200] = (new[6 * 8192: 6 * 8192 + 200].float() * 1.01).to(torch.bfloat16)

    def refuse(*a, **k):
        raise AssertionError("chunk-by-chunk staging used")

    for context in (True, False):
        enc = codec.encode(old, new, chunk_elems=8192, context=context)
        kinds = [c.encoding for c in enc.header.chunks]
        assert kinds[3] == record.DENSE_XOR and kinds.count(record.UNCHANGED) == 6, kinds
        want = codec._stage_chunkwise(dtypes.host_bits(old), enc, True, None)
        with monkeypatch.context() as m:
            m.setattr(codec, "_stage_chunkwise", refuse)
            got = codec.stage(old, enc)
            assert got.dense is None and np.array_equal(got.positions, want.positions)
            assert np.array_equal(got.values, want.values) and np.array_equal(got.old, want.old)
            wrong = old.clone()
            wrong[5] = 1.0                                  # an unchanged chunk differs: not the parent
            with pytest.raises(ParentMismatchError):
                codec.stage(wrong, enc)


def test_a_chunk_decodes_into_given_arrays_only_of_its_count_and_encoding():
    old = (torch.randn(4096) * 0.02).to(torch.bfloat16)
    new = old.clone()
    new[::100] = (new[::100].float() * 1.01).to(torch.bfloat16)
    enc = codec.encode(old, new)
    c, bits = enc.header.chunks[0], dtypes.host_bits(old)
    ok = (np.empty(c.count, np.int64), np.empty(c.count, np.uint16))
    pos, vals = chunks.decode_changes(c, enc.payloads[0], bits, enc.header.dtype, "t", ok)
    assert pos is ok[0] and vals is ok[1] and np.array_equal(bits[pos] != vals, np.ones(c.count, bool))
    with pytest.raises(ValueError, match="of their count"):
        chunks.decode_changes(c, enc.payloads[0], bits, enc.header.dtype, "t",
                              (np.empty(c.count + 1, np.int64), np.empty(c.count + 1, np.uint16)))
    raw = codec.encode(old, torch.zeros_like(old))                  # raw chunks: smaller than XOR planes
    r = raw.header.chunks[0]
    assert r.encoding == record.RAW
    with pytest.raises(ValueError, match="only sparse, dense_xor, ctx, gctx, pctx, dense_step, grouped_step and "
                                         "grouped_pstep chunks"):
        chunks.decode_changes(r, raw.payloads[0], bits, raw.header.dtype, "t",
                              (np.empty(r.count, np.int64), np.empty(r.count, np.uint16)))


@pytest.mark.parametrize("dtype,dense", [(torch.bfloat16, record.GROUPED_STEP), (torch.float32, record.DENSE_STEP),
                                         (torch.int32, record.DENSE_STEP)],
                         ids=["grouped_step-bf16", "dense_step-f32", "dense_step-i32"])
def test_a_mostly_changed_dense_step_record_stages_densely_without_arrays_of_its_changes(monkeypatch, dtype, dense):
    """A LoRA step moves every element: its dense steps' chunks (grouped by class for a float dtype) decode
    straight into the staged copy (their sparse decode, a position and a value per change, is never called), as
    chunk-by-chunk staging would stage them, bit for bit; a wrong parent is still refused by name, and a chunk
    decodes densely only into an array of its own length."""
    from ckptdelta.delta.encodings.base import REGISTRY

    g = torch.Generator().manual_seed(5)
    old = (torch.randn(3 * 8192, generator=g) * 0.02).to(torch.float32 if dtype == torch.int32 else dtype).view(dtype)
    ints = torch.int16 if dtype == torch.bfloat16 else torch.int32
    new = old.clone()
    new.view(ints)[:] += torch.randint(-40, 40, old.shape, generator=g, dtype=ints)
    new.view(ints)[2 * 8192:] = old.view(ints)[2 * 8192:]                        # one chunk untouched
    enc = codec.encode(old, new, chunk_elems=8192, context=False)
    assert [c.encoding for c in enc.header.chunks] == [dense, dense, record.UNCHANGED]
    want = codec._stage_chunkwise(dtypes.host_bits(old), enc, True, None)

    def refuse(*a, **k):
        raise AssertionError("the dense steps' sparse decode used for a dense stage")

    monkeypatch.setattr(type(REGISTRY.by_id[dense]), "decode", refuse)
    got = codec.stage(old, enc)
    assert got.dense is not None and np.array_equal(got.dense, want.dense) and got.positions.shape[0] == 0
    assert got.parent_digest == want.parent_digest == codec.digest(old)
    assert np.array_equal(got.dense, dtypes.host_bits(new))
    wrong = old.clone()
    wrong.view(ints)[9] += 1
    with pytest.raises(ParentMismatchError):
        codec.stage(wrong, enc)
    c, bits = enc.header.chunks[0], dtypes.host_bits(old)[:8192]
    with pytest.raises(ValueError, match="a dense decode writes 8192 elements, not 8191"):
        chunks.decode_dense(c, enc.payloads[0], bits, enc.header.dtype, "t", np.empty(8191, bits.dtype))


def test_a_densely_staged_change_carries_the_digest_of_the_tensor_it_was_staged_against():
    """A dense swap checks in the pause that the live bits still hash to what prepare staged against. With
    the parent hashed only on failure, that must be the live tensor's own digest, not the header's claim
    (here a wrong one that the result's digest overrules): else every commit would report a foreign write."""
    g = torch.Generator().manual_seed(11)
    old = (torch.randn(40_000, generator=g) * 0.02).to(torch.bfloat16)
    new = (old.float() * (1 + 2 ** -6 * torch.randn(40_000, generator=g))).to(torch.bfloat16)
    enc = codec.encode(old, new, chunk_elems=8192, parent_digest=12345)
    assert enc.header.parent_digest == 12345
    st = codec.stage(old, enc)
    assert st.dense is not None and st.parent_digest == codec.digest(old)
    out = old.clone()
    st.apply_(out)
    assert torch.equal(out.view(torch.int16), new.view(torch.int16))


def test_a_tensor_named_fast_alone_tries_the_fast_path_s_own_encoding_only_and_its_record_decodes_exact():
    """``encode_many(fast_alone=...)``: where the publisher saw a tensor's dense and raw tries lose on its last
    step, its chunks try the fast path's own encoding alone (dense steps: every element changed). On a step where
    dense XOR would win (every lowest bit flips) the record is dense steps, larger, and decodes to the same bits;
    the other tensors still take the tries; the context coder ignores the hint."""
    from ckptdelta.delta import encode_many

    a = _bf16_weights(100_000)
    b = a.clone()
    b.view(torch.int16)[:] ^= 1
    tried, alone = (list(encode_many([(n, a, b)], threads=1, context=False, fast_alone={"alone"}))[0]
                    for n in ("tried", "alone"))
    assert tried.encoding_counts() == {"dense_xor": 1} and alone.encoding_counts() == {"grouped_step": 1}
    assert alone.nbytes > tried.nbytes
    assert_same_bits(codec.decode(a, alone.to_bytes()), b) and assert_same_bits(codec.decode(a, tried.to_bytes()), b)
    ctx = list(encode_many([("alone", a, b)], threads=1, context=True, fast_alone={"alone"}))[0]
    assert ctx.to_bytes() == codec.encode(a, b, name="alone").to_bytes()


@pytest.mark.parametrize("share,bf16,fp32", [(0.3, "sparse", "sparse"), (0.45, "grouped_step", "sparse"),
                                             (0.6, "grouped_step", "dense_step")])
def test_the_fast_path_codes_dense_steps_from_a_lower_share_changed_where_it_groups_them_by_class(share, bf16, fp32):
    """Sorted by class, dense steps cost less than sparse from about 35% of a chunk changed (their zeros code
    small), so the fast path takes them from chunks.GROUPED_DENSE_FRACTION changed for the dtypes it groups, and
    from half for the others, whose steps it codes in element order. Each record decodes exactly."""
    assert chunks.GROUPED_DENSE_FRACTION < 0.45 < chunks.DENSE_STEP_FRACTION < 0.6
    g = torch.Generator().manual_seed(7)
    for dtype, want in ((torch.bfloat16, bf16), (torch.float32, fp32)):
        old = (torch.randn(200_000, generator=g) * 0.02).to(dtype)
        new = old.clone()
        moved = torch.rand(old.numel(), generator=g) < share
        steps = torch.randint(1, 4, (old.numel(),), generator=g) * (torch.randint(0, 2, (old.numel(),),
                                                                                    generator=g) * 2 - 1)
        bits = new.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)
        bits[moved] += steps[moved].to(bits.dtype)
        assert abs(chunks.kernels.count_changed(dtypes.host_bits(old), dtypes.host_bits(new)) / old.numel() - share) \
            < 0.01
        enc = codec.encode(old, new, name="w", context=False)
        assert enc.encoding_counts() == {want: 1}, (dtype, share)
        assert_same_bits(codec.decode(old, enc.to_bytes()), new)
