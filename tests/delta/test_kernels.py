"""Every numba kernel agrees with its plain-numpy reference (tests/naive.py).

Inputs are random bit patterns of every width, sign-magnitude on and off, with
changes of every kind (random bits, one-ulp moves, sign flips across zero,
NaN payloads). The seed is printed and in every failure message; rerun with
CKPTDELTA_TEST_SEED=<seed> to reproduce.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ckptdelta.delta import commit_ranges, kernels
import tests
from tests import naive

SEED = int(os.environ.get("CKPTDELTA_TEST_SEED") or secrets.randbits(32))
WIDTHS = [8, 16, 32, 64]
SIZES = [0, 1, 2, 17, 257, 3000]
REPO = Path(tests.REPO)


def setup_module() -> None:
    print(f"\ntests/delta/test_kernels.py: CKPTDELTA_TEST_SEED={SEED}")


def rng_for(*salt: int) -> np.random.Generator:
    return np.random.default_rng([SEED, *salt])


def udtype(width: int) -> np.dtype:
    return np.dtype(f"<u{width // 8}")


def random_bits(rng: np.random.Generator, n: int, width: int) -> np.ndarray:
    return rng.integers(0, 1 << width, size=n, dtype=udtype(width), endpoint=False)


def changed_copy(rng: np.random.Generator, old: np.ndarray, width: int, fraction: float) -> np.ndarray:
    """``old`` with about ``fraction`` of its elements changed in assorted ways."""
    new = old.copy()
    n = old.shape[0]
    if n == 0:
        return new
    where = np.flatnonzero(rng.random(n) < fraction)
    kind = rng.integers(0, 4, size=where.shape[0])
    mask = (1 << width) - 1
    for pos, k in zip(where.tolist(), kind.tolist()):
        o = int(old[pos])
        if k == 0:    # random bits
            v = int(random_bits(rng, 1, width)[0])
        elif k == 1:  # one step up or down in the raw bits
            v = (o + (1 if rng.random() < 0.5 else -1)) & mask
        elif k == 2:  # flip the sign bit (crosses zero for floats)
            v = o ^ (1 << (width - 1))
        else:         # flip one bit
            v = o ^ (1 << int(rng.integers(0, width)))
        new[pos] = v
    return new


def cases():
    for w in WIDTHS:
        for n in SIZES:
            for frac in (0.0, 0.01, 0.3, 1.0):
                yield w, n, frac


CASES = list(cases())


def ids(c):
    return f"w{c[0]}-n{c[1]}-f{c[2]}"


@pytest.mark.parametrize("case", CASES, ids=ids)
def test_change_kernels_match_reference(case):
    w, n, frac = case
    rng = rng_for(w, n, int(frac * 100))
    old = random_bits(rng, n, w)
    new = changed_copy(rng, old, w, frac)
    msg = f"seed={SEED} width={w} n={n} fraction={frac}"

    k = kernels.count_changed(old, new)
    assert k == naive.count_changed(old, new), msg

    pos, vals = np.empty(k, np.int64), np.empty(k, old.dtype)
    assert kernels.diff_positions(old, new, pos, vals) == k, msg
    ref_pos, ref_vals = naive.diff_positions(old, new)
    np.testing.assert_array_equal(pos, ref_pos, err_msg=msg)
    np.testing.assert_array_equal(vals, ref_vals, err_msg=msg)

    saved = np.empty(k, old.dtype)
    kernels.gather(new, pos, saved)
    np.testing.assert_array_equal(saved, naive.gather(new, pos), err_msg=msg)
    live = old.copy()
    kernels.gather(live, pos, saved)
    np.testing.assert_array_equal(saved, naive.gather(old, pos), err_msg=msg)
    kernels.scatter(live, pos, vals)
    np.testing.assert_array_equal(live, new, err_msg=msg)
    kernels.scatter(live, pos, saved)  # the undo of an in-place apply
    np.testing.assert_array_equal(live, old, err_msg=msg)

    for sm in (False, True):
        gaps, steps, max_gap, max_step = kernels.sparse_extract(old, new, k, w, sm)
        r_gaps, r_steps, r_max_gap, r_max_step = naive.sparse_extract(old, new, w, sm)
        np.testing.assert_array_equal(gaps, r_gaps, err_msg=f"{msg} sm={sm}")
        np.testing.assert_array_equal(steps, r_steps, err_msg=f"{msg} sm={sm}")
        assert (int(max_gap), int(max_step)) == (r_max_gap, r_max_step), f"{msg} sm={sm}"

        positions, ok = kernels.sparse_positions(gaps, n)
        assert ok, msg
        np.testing.assert_array_equal(positions, ref_pos, err_msg=msg)
        out = np.empty(k, old.dtype)
        kernels.sparse_new_values(old, positions, steps, w, sm, out)
        np.testing.assert_array_equal(out, new[positions], err_msg=f"{msg} sm={sm}: sparse round trip")

        if k:       # the dense step form (encoding 7): every element's step, zero where unchanged
            sp, used = kernels.step_planes(old, new, w, sm)
            r_sp, r_used = naive.step_planes(old, new, w, sm)
            assert used == r_used, f"{msg} sm={sm}"
            np.testing.assert_array_equal(sp, r_sp, err_msg=f"{msg} sm={sm}")
            dp, dv = np.empty(k, np.int64), np.empty(k, old.dtype)
            assert kernels.step_apply_planes(old, sp, used, w, sm, dp, dv) == k, msg
            rp, rv = naive.step_apply_planes(old, sp, used, w, sm)
            np.testing.assert_array_equal(dp, rp, err_msg=f"{msg} sm={sm}")
            np.testing.assert_array_equal(dv, rv, err_msg=f"{msg} sm={sm}")
            np.testing.assert_array_equal(dv, new[dp], err_msg=f"{msg} sm={sm}: dense step round trip")
            # an array too short for the changes found is refused, not overrun
            assert kernels.step_apply_planes(old, sp, used, w, sm, dp[:-1], dv[:-1]) == -1, msg
            # and so are planes shorter than they say, arrays of two lengths, more planes than the width
            assert kernels.step_apply_planes(old, sp[:-1], used, w, sm, dp, dv) == -1, msg
            assert kernels.step_apply_planes(old, sp, used, w, sm, dp, dv[:-1]) == -1, msg
            assert kernels.step_apply_planes(old, np.zeros(n * (w // 8 + 1), np.uint8), w // 8 + 1, w, sm, dp,
                                             dv) == -1, msg
            # densely (a dense stage): every element's new bits, the unchanged ones exactly the old bits
            whole = np.full(n, 0x5A, old.dtype)          # junk first: the kernel writes every element
            assert kernels.step_apply_planes_dense(old, sp, used, w, sm, whole) == k, msg
            np.testing.assert_array_equal(whole, new, err_msg=f"{msg} sm={sm}: dense step, decoded densely")
            assert kernels.step_apply_planes_dense(old, sp[:-1], used, w, sm, whole) == -1, msg
            assert kernels.step_apply_planes_dense(old, sp, used, w, sm, whole[:-1]) == -1, msg
            assert kernels.step_apply_planes_dense(old, np.zeros(n * (w // 8 + 1), np.uint8), w // 8 + 1, w, sm,
                                                   whole) == -1, msg

    nbytes = w // 8
    planes = kernels.xor_planes(old, new, nbytes)
    np.testing.assert_array_equal(planes, naive.xor_planes(old, new, nbytes), err_msg=msg)
    xp, xv = np.empty(k, np.int64), np.empty(k, old.dtype)
    assert kernels.xor_apply_planes(old, planes, nbytes, xp, xv) == k, msg
    rp, rv = naive.xor_apply_planes(old, planes, nbytes)
    np.testing.assert_array_equal(xp, rp, err_msg=msg)
    np.testing.assert_array_equal(xv, rv, err_msg=msg)


@pytest.mark.parametrize("dtype", ["F8_E4M3", "F8_E5M2", "BF16", "F16", "F32", "F64"])
def test_nan_at_gaps_sees_a_nan_among_the_changed_elements_only(dtype):
    from ckptdelta.delta import dtypes

    dt = dtypes.by_name(dtype)
    mask, threshold = dtypes.nan_rule(dt)
    w = 8 * dt.itemsize
    rng = rng_for(w, 7)
    old = random_bits(rng, 5000, w)
    old &= old.dtype.type(~mask & ((1 << w) - 1) | (mask >> 2))    # no NaN in old: exponents far from all ones
    nan = old.dtype.type(threshold + 1)
    for frac in (0.0, 0.01, 0.3, 1.0):
        new = changed_copy(rng, old, w, frac)
        new &= old.dtype.type(~mask & ((1 << w) - 1) | (mask >> 2))
        k = kernels.count_changed(old, new)
        gaps = kernels.sparse_extract(old, new, k, w, True)[0]
        msg = f"seed={SEED} {dtype} fraction={frac}"
        assert not kernels.nan_at_gaps(new, gaps, old.dtype.type(mask), old.dtype.type(threshold)), msg
        assert kernels.count_changed_nan(old, new, old.dtype.type(mask), old.dtype.type(threshold)) == (k, False)
        both = old.copy(), new.copy()
        for a in both:          # a NaN both versions hold is no change: not reported
            a[0] = nan
        gaps = kernels.sparse_extract(*both, kernels.count_changed(*both), w, True)[0]
        assert kernels.nan_at_gaps(both[1], gaps, old.dtype.type(mask), old.dtype.type(threshold)) is False, msg
        assert kernels.count_changed_nan(*both, old.dtype.type(mask), old.dtype.type(threshold))[1] is False, msg
        assert naive.nan_at_gaps(*both, mask, threshold) is False
        for where in (0, old.size // 2, old.size - 1):    # a changed element becoming NaN (any payload, sign)
            n2 = new.copy()
            n2[where] = nan | old.dtype.type(1 << (w - 1)) if where % 2 else old.dtype.type(mask)
            gaps = kernels.sparse_extract(old, n2, kernels.count_changed(old, n2), w, True)[0]
            got = kernels.nan_at_gaps(n2, gaps, old.dtype.type(mask), old.dtype.type(threshold))
            assert got is True and naive.nan_at_gaps(old, n2, mask, threshold) is True, f"{msg} at {where}"
            assert kernels.count_changed_nan(old, n2, old.dtype.type(mask), old.dtype.type(threshold)) == \
                naive.count_changed_nan(old, n2, mask, threshold) == (kernels.count_changed(old, n2), True)


@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("sm", [False, True], ids=["int", "signmag"])
def test_sparse_new_values_matches_reference_for_arbitrary_steps(width, sm):
    """Decoding must be defined for every step a payload can hold, not only the ones an encoder writes."""
    rng = rng_for(width, int(sm), 7)
    n = 500
    old = random_bits(rng, n, width)
    positions = np.sort(rng.choice(n, size=200, replace=False)).astype(np.int64)
    nplanes = int(rng.integers(1, width // 8 + 1))
    steps = rng.integers(0, 1 << (8 * nplanes), size=200, dtype=np.uint64, endpoint=False)
    steps[:4] = [0, 1, 2, (1 << (8 * nplanes)) - 1]
    out = np.empty(200, old.dtype)
    kernels.sparse_new_values(old, positions, steps, width, sm, out)
    ref = naive.sparse_new_values(old, positions, steps, width, sm)
    np.testing.assert_array_equal(out, ref, err_msg=f"seed={SEED} width={width} sm={sm} nplanes={nplanes}")


@pytest.mark.parametrize("n", [0, 1, 5, 1000])
def test_sparse_positions_matches_reference_and_flags_overflow(n):
    rng = rng_for(n, 11)
    gaps = rng.integers(0, 4, size=n, dtype=np.uint32)
    limit = int(gaps.astype(np.int64).sum()) + n  # last position is limit - 1
    pos, ok = kernels.sparse_positions(gaps, limit)
    ref, ref_ok = naive.sparse_positions(gaps, limit)
    np.testing.assert_array_equal(pos, ref, err_msg=f"seed={SEED}")
    assert ok and ref_ok
    if n:
        assert not kernels.sparse_positions(gaps, limit - 1)[1], "position past the chunk not flagged"
    huge = np.full(3, 0xFFFFFFFF, np.uint32)  # sums past 2^32: positions must not wrap
    pos, ok = kernels.sparse_positions(huge, 1 << 40)
    assert pos.tolist() == [0xFFFFFFFF, 2 * 0xFFFFFFFF + 1, 3 * 0xFFFFFFFF + 2] and ok


@pytest.mark.parametrize("width", WIDTHS)
def test_planes_round_trip_and_match_reference(width):
    rng = rng_for(width, 13)
    for n in SIZES:
        values = random_bits(rng, n, width)
        for nplanes in range(1, width // 8 + 1):
            v = values & np.array((1 << (8 * nplanes)) - 1, dtype=np.uint64).astype(values.dtype)
            planes = kernels.to_planes(v, nplanes)
            np.testing.assert_array_equal(planes, naive.to_planes(v, nplanes), err_msg=f"seed={SEED}")
            for out_dtype in (values.dtype, np.dtype(np.uint64)):
                out = np.full(n, 0xAB, out_dtype)  # from_planes must overwrite, not OR into, old contents
                kernels.from_planes(planes, n, nplanes, out)
                np.testing.assert_array_equal(out, naive.from_planes(planes, n, nplanes, out_dtype))
                np.testing.assert_array_equal(out, v.astype(out_dtype), err_msg=f"seed={SEED} nplanes={nplanes}")


def test_planes_entropy_is_per_plane_block_the_smaller_of_order0_and_two_bytes_a_run_sampled_by_stride_as_the_reference_says():
    rng = np.random.default_rng(SEED)
    for n, plane_len, block in [(1, 1, 4), (1000, 1000, 1000), (1000, 250, 64), (3000, 1500, 1 << 14),
                                (4000, 1000, 300)]:
        for planes in (rng.integers(0, 256, n, dtype=np.uint8), np.zeros(n, np.uint8),
                       (rng.geometric(0.3, n) % 256).astype(np.uint8), np.repeat(rng.integers(0, 256, n // 50 + 1,
                                                                                              dtype=np.uint8), 50)[:n]):
            for stride in (1, 2, 5):
                got = kernels.planes_entropy_bytes(planes, plane_len, block, stride)
                assert got == pytest.approx(naive.planes_entropy_bytes(planes, plane_len, block, stride), rel=1e-9,
                                            abs=1e-9), f"seed={SEED} n={n} plane_len={plane_len} block={block} {stride=}"
    # one block of 256 distinct bytes repeated evenly: exactly 8 bits each
    assert kernels.planes_entropy_bytes(np.tile(np.arange(256, dtype=np.uint8), 4), 1024, 1024) == pytest.approx(1024)
    # two planes, each constant: nothing, whatever the block (no block spans two planes)
    two = np.concatenate([np.ones(1000, np.uint8), np.zeros(1000, np.uint8)])
    assert kernels.planes_entropy_bytes(two, 1000, 1 << 14) == 0.0
    # long runs: two bytes a run, below the order-0 entropy of the mix
    runs = np.repeat(np.arange(4, dtype=np.uint8), 500)
    assert kernels.planes_entropy_bytes(runs, 2000, 2000) == 8.0
    # a sample of every other block scaled to the plane: a plane of two halves, each of one statistics
    halves = np.concatenate([np.tile(np.arange(256, dtype=np.uint8), 4), np.zeros(1024, np.uint8)])
    assert kernels.planes_entropy_bytes(halves, 2048, 512, 2) == pytest.approx(1024)   # blocks 0 and 2: 512, 0


def test_gap_planes_use_uint32():
    gaps = np.array([0, 255, 65535, (1 << 24) - 1, 0xFFFFFFFF], np.uint32)
    planes = kernels.to_planes(gaps, 4)
    out = np.empty(5, np.uint32)
    kernels.from_planes(planes, 5, 4, out)
    np.testing.assert_array_equal(out, gaps)


@pytest.mark.parametrize("width", [8, 16])
def test_key_and_zigzag_are_bijections_exhaustively(width):
    """Every bit pattern (NaN payloads, -0.0, subnormals) maps to a distinct key and back."""
    allbits = np.arange(1 << width, dtype=np.uint64).astype(udtype(width))
    for sm in (False, True):
        keys = naive.key(allbits, width, sm)
        assert np.unique(keys).shape[0] == 1 << width
        np.testing.assert_array_equal(naive.unkey(keys, width, sm).astype(allbits.dtype), allbits)
    d = np.arange(1 << width, dtype=np.uint64)
    z = naive.zigzag(d, width)
    assert np.unique(z).shape[0] == 1 << width and int(z.max()) == (1 << width) - 1
    np.testing.assert_array_equal(naive.unzigzag(z, width), d)


def test_float16_keys_follow_numeric_order_and_zeros_are_neighbours():
    allbits = np.arange(1 << 16, dtype=np.uint64).astype(np.uint16)
    f = allbits.view(np.float16)
    finite = ~np.isnan(f)
    keys = naive.key(allbits[finite], 16, True)
    order = np.argsort(keys, kind="stable")
    vals = f[finite][order].astype(np.float64)
    assert np.all(np.diff(vals) >= 0), "key order is not numeric order"
    k_neg0 = int(naive.key(np.array([0x8000], np.uint16), 16, True)[0])
    k_pos0 = int(naive.key(np.array([0x0000], np.uint16), 16, True)[0])
    assert k_pos0 - k_neg0 == 1


@pytest.mark.parametrize("sm", [False, True], ids=["int", "signmag"])
def test_all_byte_pairs_round_trip_through_sparse_steps(sm):
    """Width 8, every (old, new) pair: the kernel's steps decode back to exactly ``new``."""
    old = np.repeat(np.arange(256, dtype=np.uint16), 256).astype(np.uint8)
    new = np.tile(np.arange(256, dtype=np.uint16), 256).astype(np.uint8)
    k = kernels.count_changed(old, new)
    assert k == 256 * 255
    gaps, steps, _mg, max_step = kernels.sparse_extract(old, new, k, 8, sm)
    assert int(max_step) <= 255
    pos, ok = kernels.sparse_positions(gaps, old.shape[0])
    assert ok
    out = np.empty(k, np.uint8)
    kernels.sparse_new_values(old, pos, steps, 8, sm, out)
    np.testing.assert_array_equal(out, new[pos])
    np.testing.assert_array_equal(steps, naive.sparse_extract(old, new, 8, sm)[1])


@pytest.mark.parametrize("sm", [False, True], ids=["int", "signmag"])
def test_all_byte_pairs_and_unchanged_elements_round_trip_through_dense_steps(sm):
    """Width 8, every (old, new) pair, unchanged pairs among them: one byte plane holds every step, and it
    decodes to exactly the changed positions and their new bits."""
    old = np.repeat(np.arange(256, dtype=np.uint16), 256).astype(np.uint8)
    new = np.tile(np.arange(256, dtype=np.uint16), 256).astype(np.uint8)
    planes, used = kernels.step_planes(old, new, 8, sm)
    assert used == 1 and planes.shape == (old.shape[0],)
    assert int(np.count_nonzero(planes)) == 256 * 255        # a step is zero exactly where nothing changed
    pos, vals = np.empty(256 * 255, np.int64), np.empty(256 * 255, np.uint8)
    assert kernels.step_apply_planes(old, planes, 1, 8, sm, pos, vals) == 256 * 255
    np.testing.assert_array_equal(pos, np.flatnonzero(old != new))
    np.testing.assert_array_equal(vals, new[pos])
    whole = np.empty_like(old)
    assert kernels.step_apply_planes_dense(old, planes, 1, 8, sm, whole) == 256 * 255
    np.testing.assert_array_equal(whole, new)


#: (width, mantissa bits, exponent bits) of float layouts encodings 8 and 9 serve.
GROUPED = [(8, 3, 4), (8, 2, 5), (16, 7, 8), (16, 10, 5), (32, 23, 8), (64, 52, 11)]


@pytest.mark.parametrize("w,mant,exp_bits", GROUPED, ids=["e4m3", "e5m2", "bf16", "f16", "f32", "f64"])
@pytest.mark.parametrize("by_prev", [False, True], ids=["grouped_step", "grouped_pstep"])
def test_grouped_steps_are_format_md_s_class_order_and_decode_to_the_exact_bits(w, mant, exp_bits, by_prev):
    """Random bit patterns (NaN payloads, infinities, -0.0, subnormals among them) and Adam-like small steps,
    some elements unchanged: the kernel's planes are byte for byte the reference's (docs/FORMAT.md's class order,
    a stable sort by class, and the negation where the step before went down), and they decode, densely, in
    place and into the sparse form, to exactly the new bits; an unchanged element keeps its bits as they are."""
    rng = np.random.default_rng(w * 100 + mant + by_prev)
    dt = {8: np.uint8, 16: np.uint16, 32: np.uint32, 64: np.uint64}[w]
    n = 5003
    old = rng.integers(0, 1 << min(w, 63), n, dtype=np.uint64).astype(dt)
    old[:64] = rng.integers(0, 1 << min(w, 63), 64, dtype=np.uint64).astype(dt) | dt((1 << (w - 1)) - (1 << mant))
    grand = (old.astype(np.uint64) + rng.integers(-3, 4, n).astype(np.uint64)).astype(dt)
    new = (old.astype(np.uint64) + rng.integers(-9, 10, n).astype(np.uint64)).astype(dt)
    new[::7] = rng.integers(0, 1 << min(w, 63), new[::7].shape[0], dtype=np.uint64).astype(dt)     # big moves
    new[::5] = old[::5]                                                                 # unchanged
    g = grand if by_prev else old
    planes, nplanes = kernels.grouped_step_planes(old, new, g, by_prev, mant, exp_bits, w, True)
    want, want_n = naive.grouped_step_planes(old, new, grand if by_prev else None, mant, exp_bits, w, True)
    assert nplanes == want_n
    np.testing.assert_array_equal(planes, want)
    k = int(np.count_nonzero(old != new))
    whole = np.empty_like(old)
    assert kernels.grouped_step_apply_dense(old, g, by_prev, planes, nplanes, mant, exp_bits, w, True, whole) == k
    np.testing.assert_array_equal(whole, new)
    inplace = old.copy()
    g2 = g if by_prev else inplace
    assert kernels.grouped_step_apply_dense(inplace, g2, by_prev, planes, nplanes, mant, exp_bits, w, True,
                                            inplace) == k
    np.testing.assert_array_equal(inplace, new)
    pos, vals = np.empty(k, np.int64), np.empty(k, dt)
    assert kernels.grouped_step_apply(old, g, by_prev, planes, nplanes, mant, exp_bits, w, True, pos, vals) == k
    np.testing.assert_array_equal(pos, np.flatnonzero(old != new))
    np.testing.assert_array_equal(vals, new[pos])
    short = (np.empty(k - 1, np.int64), np.empty(k - 1, dt))
    assert kernels.grouped_step_apply(old, g, by_prev, planes, nplanes, mant, exp_bits, w, True, *short) == -1
    assert kernels.grouped_step_apply_dense(old, g, by_prev, planes[:-1], nplanes, mant, exp_bits, w, True,
                                            whole) == -1          # planes shorter than they say: refused


def test_one_ulp_moves_cost_one_step_across_zero():
    """+0.0 -> -0.0 and 1 ulp moves are steps of 1 (zigzag 1 or 2), so they need one byte plane."""
    old = np.array([0x0000, 0x8000, 0x3C00, 0x3C00, 0x8001, 0x7BFF], np.uint16)
    new = np.array([0x8000, 0x0000, 0x3C01, 0x3BFF, 0x8000, 0x7C00], np.uint16)
    _g, steps, _mg, max_step = kernels.sparse_extract(old, new, 6, 16, True)
    assert sorted(set(steps.tolist())) == [1, 2] and max_step == 2


def test_python_path_round_trips_with_jit_disabled():
    """The kernels as plain Python (NUMBA_DISABLE_JIT=1) give the same round trip: the coverage run."""
    script = r"""
import numpy as np
from numba.core import config
assert config.DISABLE_JIT
from ckptdelta.delta import codec, kernels, record
from tests import naive
assert not hasattr(kernels.count_changed, "py_func"), "numba still compiling"
rng = np.random.default_rng(5)
a = rng.standard_normal(300).astype(np.float32)
cases = {"sparse": a.copy(), "dense_xor": a.copy(), "raw": np.zeros_like(a), "unchanged": a.copy()}
cases["sparse"][::37] += 1
cases["dense_xor"].view(np.uint32)[:] ^= 1
seen = set()
for want, b in cases.items():
    enc = codec.encode(a, b, chunk_elems=64)
    seen |= set(enc.encoding_counts())
    out = codec.decode(a, enc.to_bytes())
    assert (out.view(np.uint32) == b.view(np.uint32)).all(), want
    live = a.copy(); codec.apply_(live, enc.to_bytes())
    assert (live.view(np.uint32) == b.view(np.uint32)).all(), want
enc = codec.encode(None, a, chunk_elems=100)
assert (codec.decode(None, enc.to_bytes()).numpy().view(np.uint32) == a.view(np.uint32)).all()
old = rng.integers(0, 1 << 16, 200, dtype=np.uint16); new = old.copy(); new[::3] ^= 5
k = kernels.count_changed(old, new)
g, s, _, _ = kernels.sparse_extract(old, new, k, 16, True)
rg, rs, _, _ = naive.sparse_extract(old, new, 16, True)
assert (g == rg).all() and (s == rs).all()
print("ENCODINGS", sorted(seen))
"""
    env = {**os.environ, "NUMBA_DISABLE_JIT": "1", "PYTHONWARNINGS": "ignore"}
    r = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "ENCODINGS ['dense_xor', 'raw', 'sparse', 'unchanged']" in r.stdout, r.stdout


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.uint32])
def test_scatter_if_unchanged_writes_all_or_leaves_live_as_it_was(dtype):
    rng = np.random.default_rng(7)
    old = rng.integers(0, np.iinfo(dtype).max, 4096, dtype=dtype)
    pos = np.sort(rng.choice(old.size, 300, replace=False)).astype(np.int64)
    vals = (old[pos] + 1).astype(dtype)
    live, ref = old.copy(), old.copy()
    assert kernels.scatter_if_unchanged(live, pos, old[pos].copy(), vals) == -1
    assert naive.scatter_if_unchanged(ref, pos, old[pos].copy(), vals) == -1
    np.testing.assert_array_equal(live, ref)
    for bad_at in (0, 150, 299):  # someone else wrote one of the positions since the bits were saved
        live, ref = old.copy(), old.copy()
        live[pos[bad_at]] ^= 1
        ref[pos[bad_at]] ^= 1
        before = live.copy()
        assert kernels.scatter_if_unchanged(live, pos, old[pos].copy(), vals) == bad_at
        assert naive.scatter_if_unchanged(ref, pos, old[pos].copy(), vals) == bad_at
        np.testing.assert_array_equal(live, before)   # nothing written
        np.testing.assert_array_equal(ref, before)


# --- the hot-swap commit kernels --------------------------------------------------------------------------

@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 63, 64, 65, 71, 200, 4099])
def test_block_hash_matches_reference(n):
    rng = rng_for(n, 99)
    b8 = random_bits(rng, n, 8)
    assert int(kernels.block_hash(b8)) == naive.block_hash(b8), f"seed={SEED} n={n}"


@pytest.mark.parametrize("n", [0, 1, 63, 64, 65, 200, 8192, 8195])
def test_hash_while_copying_hashes_as_block_hash_and_copies_or_swaps(n):
    """The commit's pipelined step: the hash of the next block is block_hash's, for any length of it, and the
    words copied meanwhile (a whole 64 KiB block, or none) are copied exactly, whether the copy outlasts the
    hash (a short next block) or not."""
    rng = rng_for(n, 95)
    b8 = random_bits(rng, n, 8)
    src = random_bits(rng, 8192, 64)
    for m in (0, 8192):
        dst = np.zeros(m, np.uint64)
        assert int(kernels.hash_while_copying(b8, dst, src[:m])) == naive.block_hash(b8), f"seed={SEED} n={n}"
        np.testing.assert_array_equal(dst, src[:m])
        a, b = random_bits(rng, m, 64), random_bits(rng, m, 64)
        a0, b0 = a.copy(), b.copy()
        assert int(kernels.hash_while_copying(b8, a, b, True)) == naive.block_hash(b8), f"seed={SEED} n={n}"
        np.testing.assert_array_equal(a, b0)       # swapped
        np.testing.assert_array_equal(b, a0)


@pytest.mark.parametrize("width", WIDTHS)
def test_block_hash_changes_whenever_one_element_changes_and_when_two_sign_bits_flip(width):
    """Any one element changed (random bits, one step, its sign) changes the hash; so do two sign flips in one
    lane, which a plain multiply-xor hash would miss (its high bits never reach the low ones)."""
    rng = rng_for(width, 98)
    bits = random_bits(rng, (1 << 16) // (width // 8) + 3, width)
    h0 = kernels.block_hash(bits.view(np.uint8))
    sign = np.array(1 << (width - 1), bits.dtype)
    for pos in rng.choice(bits.shape[0], 200, replace=False).tolist() + [0, bits.shape[0] - 1]:
        for change in (sign, np.array(1, bits.dtype), random_bits(rng, 1, width)[0] | np.array(1, bits.dtype)):
            b = bits.copy()
            b[pos] ^= change
            assert kernels.block_hash(b.view(np.uint8)) != h0, f"seed={SEED} width={width} pos={pos}"
    per_word = 64 // width
    b = bits.copy()
    top = per_word - 1                  # the element holding bit 63 of word 0, and of word 8 (same lane)
    b[top] ^= sign
    b[top + 8 * per_word] ^= sign
    assert kernels.block_hash(b.view(np.uint8)) != h0


def test_block_hashes_and_count_lines_match_reference():
    rng = rng_for(97)
    bits = random_bits(rng, 10_000, 16)
    out = np.empty(-(-bits.shape[0] // 4096), np.uint64)
    kernels.block_hashes(bits, 4096, out)
    assert [int(h) for h in out] == [naive.block_hash(bits[s:s + 4096]) for s in range(0, 10_000, 4096)]
    for frac in (0.0, 0.001, 0.05, 1.0):
        pos = np.flatnonzero(rng.random(10_000) < frac).astype(np.int64)
        for shift in (0, 3, 5, 6):
            assert kernels.count_lines(pos, shift) == naive.count_lines(pos, shift), (SEED, frac, shift)


def _commit_case(rng, width, n_tensors=4, n=9000, block=1024):
    """Live tensors of one width, their changes (one array per tensor), and tasks covering the three modes
    (each tensor cut in pieces): scatter, copy, scatter, swap."""
    olds, news, rows, hashes = [], [], [], []
    pos_all, exp_all, val_all = [], [], []
    hoff = 0
    for ti in range(n_tensors):
        old = random_bits(rng, n + 37 * ti, width)
        new = changed_copy(rng, old, width, (0.01, 0.2, 0.6)[ti % 3])
        pos = np.flatnonzero(old != new).astype(np.int64)
        olds.append(old)
        news.append(new)
        pos_all.append(pos)
        exp_all.append(old[pos])
        val_all.append(new[pos])
        if ti % 2 == 0:   # scatter, in tasks of 50 changes
            for a in range(0, pos.shape[0], 50):
                rows.append((ti, kernels.MODE_SCATTER, a, min(pos.shape[0], a + 50), 0, 0, 0))
            hashes.append(np.empty(0, np.uint64))
        else:             # copy, or swap (no changes listed: a dense change), in tasks of 3 blocks
            swap = ti == 3
            if swap:
                pos_all[-1], exp_all[-1], val_all[-1] = (np.empty(0, np.int64), old[:0].copy(), old[:0].copy())
            nb = -(-old.shape[0] // block)
            h = np.empty(nb, np.uint64)
            kernels.block_hashes(old, block, h)
            hashes.append(h)
            for ba in range(0, nb, 3):
                bb = min(nb, ba + 3)
                ja, jb = (0, 0) if swap else (int(np.searchsorted(pos, ba * block)), int(np.searchsorted(pos, bb * block)))
                rows.append((ti, kernels.MODE_SWAP if swap else kernels.MODE_COPY, ja, jb, ba, bb, hoff))
            hoff += nb
    arrays = (pos_all, exp_all, val_all, np.concatenate(hashes), np.array(rows, np.int64))
    return olds, news, arrays, block


@pytest.mark.parametrize("width", WIDTHS)
def test_commit_kernel_matches_reference_writes_each_mode_and_refuses_foreign_writes(width):
    """The pause's batch kernel (ckptdelta.delta.commit_ranges over kernels.commit_task), one range of every task, one
    thread, against the reference; its undo puts back exactly what it wrote."""
    rng = rng_for(width, 96)
    olds, news, (pos, exp, val, hashes, tasks), block = _commit_case(rng, width)
    kinds = set(tasks[:, 1].tolist())
    assert kinds == {kernels.MODE_SCATTER, kernels.MODE_COPY, kernels.MODE_SWAP}
    wholes = None

    def ours(lives, t0=0, t1=None, aborted=False):
        nonlocal wholes
        t1 = tasks.shape[0] if t1 is None else t1
        wholes = [nw.copy() for nw in news]
        tensors = list(zip(lives, wholes, pos, exp, val))
        tables = commit_ranges.Tables([(block, tensors, hashes, tasks)], [(0, t0, t1)])
        tables.reset()
        if aborted:
            tables.abort()
        commit_ranges.commit_ranges(tables.ctl)
        return tuple(int(x) for x in tables.results[0, 1:]), tables     # (done, kind, where)

    def reference(lives):
        wholes = [nw.copy() for nw in news]
        abort = np.zeros(1, np.int64)
        return tuple(int(x) for x in naive.commit_tasks(lives, wholes, pos, exp, val, hashes, tasks, 0,
                                                        tasks.shape[0], block, abort))

    lives, ref = [o.copy() for o in olds], [o.copy() for o in olds]
    got, tables = ours(lives)
    assert got == reference(ref) == (tasks.shape[0], -1, -1)
    for a, b, nw in zip(lives, ref, news):
        np.testing.assert_array_equal(a, nw, err_msg=f"seed={SEED}")
        np.testing.assert_array_equal(b, nw)
    np.testing.assert_array_equal(wholes[3], olds[3])      # the swap left the old bits in the staged array
    tables.undo(0, 0, tasks.shape[0])
    for a, o in zip(lives, olds):
        np.testing.assert_array_equal(a, o)
    np.testing.assert_array_equal(wholes[3], news[3])      # and its undo the new ones again

    # another writer, after prepare: at a scattered change, at a change inside a copied block (a task's
    # first block, hashed alone, and a later one, hashed while the block before it is written), and at an
    # element a copied block does not change (only the copy sees that one: it hashes whole blocks)
    unchanged_in_copy = int(np.flatnonzero(olds[1] == news[1])[-1])
    second = tasks[tasks[:, 0] == 1][1]
    in_later_block = int(pos[1][np.searchsorted(pos[1], (second[4] + 1) * block)])
    assert in_later_block < (second[4] + 2) * block and second[5] - second[4] >= 2
    swap_second = tasks[tasks[:, 0] == 3][1]               # a swap task's first block, and a later one
    for ti, where in ((0, int(pos[0][tasks[tasks[:, 0] == 0][-1, 2]])), (1, int(pos[1][second[2]])),
                      (1, in_later_block), (1, unchanged_in_copy), (3, int(swap_second[4]) * block + 5),
                      (3, (int(swap_second[4]) + 1) * block + 7)):
        lives, ref = [o.copy() for o in olds], [o.copy() for o in olds]
        for lv in (lives, ref):
            lv[ti][where] ^= np.array(1, lv[ti].dtype)
        got, tables = ours(lives)
        want = reference(ref)
        assert got == want and got[1] == (0 if ti == 0 else 1) and tables.aborted, (SEED, ti, where, got, want)
        for a, b in zip(lives, ref):
            np.testing.assert_array_equal(a, b, err_msg=f"seed={SEED}")
        tables.undo(0, 0, got[0])   # as the caller: the tasks written whole
        np.testing.assert_array_equal(wholes[3], news[3], err_msg=f"seed={SEED}: the staged swap is whole again")
        for i, (a, o) in enumerate(zip(lives, olds)):
            o = o.copy()
            if i == ti:
                o[where] ^= np.array(1, o.dtype)
            np.testing.assert_array_equal(a, o, err_msg=f"seed={SEED}: the other writer's bits are kept")

    lives = [o.copy() for o in olds]
    got, _ = ours(lives, 1, 4, aborted=True)   # another thread refused
    assert got == (0, 2, -1)
    for a, o in zip(lives, olds):
        np.testing.assert_array_equal(a, o)
