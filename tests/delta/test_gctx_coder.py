"""Encoding 5 (gctx), what the codec's context coder writes, where it differs from encoding 4:
groups and models its encoder never picks decode, the vector masks agree with numpy, every chunk
length round trips through whole and partial 64-element words, hostile group tables are
rejected, and the grouping costs little. What holds for both context coders (round trips through
the codec, corruption, bounds checks, plain-Python runs, golden records) is in
tests/delta/test_ctx_coder.py, over both.

The reference (tests/naive_gctx.py) is written from docs/FORMAT.md; the kernels live in
delta/gctx.py and delta/masks.py. Seeds are in assertion messages so a failure can be replayed.
"""

from __future__ import annotations

import numpy as np
import pytest

from ckptdelta.delta import ctxcoder, dtypes, errors, gctx, kernels
from tests import naive_ctx, naive_gctx
from tests.delta import test_ctx_coder as both
from tests.delta.test_ctx_coder import CTX_DTYPES, optimizer_step, weights


def kernel_round_trip(old: np.ndarray, new: np.ndarray, name: str) -> bytes | None:
    return both.kernel_round_trip(old, new, name, both.CODERS["gctx"])


# --- kernels against the reference ---------------------------------------------------------

@pytest.mark.parametrize("name", CTX_DTYPES)
def test_kernel_payload_equals_the_reference_encoder_with_the_same_parameters(name):
    for seed in range(12):
        rng = np.random.default_rng(seed)
        n = int(rng.integers(1, 2500))
        old = weights(rng, name, n)
        new = optimizer_step(rng, old, name, *rng.choice([0.0, 0.005, 0.1, 0.6, 1.0], size=2))
        payload = kernel_round_trip(old, new, name)
        if payload is None:
            continue
        bounds, models, _lens, flag, val, _ = naive_gctx.parse_table(payload, naive_ctx.LAYOUT[name][2])
        assert naive_gctx.encode(old, new, name, bounds, models, flag, val) == payload, f"seed {seed}"


@pytest.mark.parametrize("name", CTX_DTYPES)
def test_kernel_decodes_payloads_with_groups_and_models_its_encoder_never_picks(name):
    """Any valid choice (one to four groups anywhere, either polarity, any parameter, classes
    outside every group) decodes: the format, not the encoder's policy, defines what a reader
    accepts."""
    w, mbits, ebits = naive_ctx.LAYOUT[name]
    dt = dtypes.BY_NAME[name]
    for seed in range(16):
        rng = np.random.default_rng(100 + seed)
        n = int(rng.integers(2, 900))
        old = weights(rng, name, n)
        new = optimizer_step(rng, old, name, 0.3, 0.05)
        changed = old != new
        if not changed.any():
            continue
        cls = np.array(naive_ctx.classes(old, mbits, ebits))
        lo, hi = int(cls[changed].min()), int(cls[changed].max())
        G = int(rng.integers(1, 5))
        inner = sorted(rng.choice(np.arange(lo + 1, hi + 1), size=min(G - 1, hi - lo), replace=False).tolist()) \
            if hi > lo else []
        bounds = [max(0, lo - int(rng.integers(0, 3)))] + inner + [min(1 << ebits, hi + 1 + int(rng.integers(0, 3)))]
        models = []
        for k in range(len(bounds) - 1):
            members = (cls >= bounds[k]) & (cls < bounds[k + 1])
            kk, nk = int(changed[members].sum()), int(members.sum())
            if kk == 0 and rng.random() < 0.5:
                models.append(naive_ctx.FlagModel(naive_ctx.NONE))
            elif kk == nk and rng.random() < 0.5:
                models.append(naive_ctx.FlagModel(naive_ctx.ALL, 1))
            else:
                models.append(naive_ctx.FlagModel(naive_ctx.GOLOMB, int(rng.integers(2)), int(rng.integers(0, 30))))
        flag, val = {}, {}
        for c in range(lo, hi + 1):
            members = (cls == c) & changed
            z = [naive_ctx.step_z(int(o), int(v), w) for o, v in zip(old[members], new[members])]
            if any(((x - 1) >> 1) > 0 for x in z):
                flag[c] = naive_ctx.FlagModel(naive_ctx.GOLOMB, int(rng.integers(2)), int(rng.integers(0, 12)))
                val[c] = int(rng.integers(0, 20))
        payload = naive_gctx.encode(old, new, name, bounds, models, flag, val)
        p, v = ctxcoder.decode_gctx(payload, old, int(changed.sum()), dt, "t")
        want = np.flatnonzero(changed)
        assert np.array_equal(p, want) and np.array_equal(v, new[want]), f"seed {seed}"


def test_masks_agree_with_numpy_on_every_offset_and_width():
    """The vector masks (delta/masks.py) at word offsets a slice or a chunk puts anywhere."""
    from numba import njit

    from ckptdelta.delta.masks import neq_mask64 as neq
    from ckptdelta.delta.masks import range_mask64 as rng_mask
    range_mask64, neq_mask64 = njit(lambda x, b, e, lo, wd: rng_mask(x, b, e, lo, wd)), njit(lambda x, y, b: neq(x, y, b))
    rng = np.random.default_rng(5)
    for bits_dtype in (np.uint8, np.uint16):
        top = np.iinfo(bits_dtype).max
        x = rng.integers(0, top + 1, 1000, dtype=bits_dtype)
        y = x.copy()
        y[rng.random(1000) < 0.1] ^= bits_dtype(1)
        for base in (0, 1, 63, 500, 1000 - 64):
            em, lo, wd = (0x7C, 8, 20) if bits_dtype == np.uint8 else (0x7F80, 118 << 7, 3 << 7)
            want = sum(1 << j for j in range(64) if (((int(x[base + j]) & em) - lo) & top) < wd)
            assert int(range_mask64(x, base, np.uint32(em), np.uint32(lo), np.uint32(wd))) == want
            want = sum(1 << j for j in range(64) if x[base + j] != y[base + j])
            assert int(neq_mask64(x, y, base)) == want


# --- size and chunk shapes -------------------------------------------------------------------

def test_grouped_positions_cost_little_against_encoding_4():
    """The grouping's price on trained-looking weights: within 6% of encoding 4's bytes."""
    rng = np.random.default_rng(9)
    dt = dtypes.BY_NAME["BF16"]
    for p_small, p_large in ((0.02, 0.002), (0.2, 0.02)):
        old = weights(rng, "BF16", 200_000)
        new = optimizer_step(rng, old, "BF16", p_small, p_large)
        k = kernels.count_changed(old, new)
        g, c = ctxcoder.encode_gctx(old, new, dt, k).payload, ctxcoder.encode_ctx(old, new, dt, k).payload
        assert len(g) <= 1.06 * len(c), (p_small, len(g), len(c))


@pytest.mark.parametrize("name", CTX_DTYPES)
def test_every_chunk_length_round_trips_through_whole_and_partial_words(name):
    """Lengths around multiples of 64, at every start offset of a word (unaligned memory)."""
    rng = np.random.default_rng(11)
    base_old = weights(rng, name, 20_000)
    base_new = optimizer_step(rng, base_old, name, 0.05, 0.003)
    for start in (0, 1, 3, 63):
        for n in (1, 63, 64, 65, 127, 128, 129, 4097, 19_000):
            old, new = base_old[start:start + n], base_new[start:start + n]
            got = kernel_round_trip(old, new, name)
            if got is not None:
                assert got == kernel_round_trip(old.copy(), new.copy(), name), (start, n)


# --- corruption --------------------------------------------------------------------------------

def test_hostile_tables_are_rejected_before_decoding():
    old = weights(np.random.default_rng(29), "BF16", 100)
    dt = dtypes.BY_NAME["BF16"]
    f8 = dtypes.BY_NAME["F8_E4M3"]
    one = b"\x01"                                              # G = 1
    grp = b"\x70\x00\x72\x00"                                  # classes 0x70..0x71
    steps = b"\x00\x00"                                        # no class with big steps
    cases = {
        "empty": b"",
        "no groups": b"\x00" + b"\0" * 40,
        "five groups": b"\x05" + b"\0" * 60,
        "short": one + grp,
        "bounds not increasing": one + b"\x72\x00\x70\x00" + b"\x02" + b"\0" * 4 + steps,
        "bounds past the classes": one + b"\x70\x00\x01\x01" + b"\x02" + b"\0" * 4 + steps,
        "bad model byte": one + grp + b"\xc2" + b"\0" * 4 + steps,
        "a stream for an ALL group": one + grp + b"\x01" + b"\x01\0\0\0" + steps + b"\0",
        "step classes not increasing": one + grp + b"\x02" + b"\0" * 4 + b"\x02\x00\x71\x02\x00\x70\x02\x00",
        "a step entry of model NONE": one + grp + b"\x02" + b"\0" * 4 + b"\x01\x00\x70\x00\x00",
        "magnitude index too large": one + grp + b"\x02" + b"\0" * 4 + b"\x01\x00\x70\x02\x60",
        "more step entries than classes": one + grp + b"\x02" + b"\0" * 4 + b"\x01\x01" + b"\0" * 800,
        "stream past the payload": one + grp + b"\x02" + b"\xff\xff\xff\x00" + steps,
        "unary run of ones": one + grp + b"\x02" + b"\x40\0\0\0" + steps + b"\xff" * 64,
        "all ones": b"\xff" * 300,
    }
    for what, payload in cases.items():
        for d, o in ((dt, old), (f8, old.astype(np.uint8))):
            with pytest.raises(errors.FormatError, match="chunk 0"):
                ctxcoder.decode_gctx(payload, o, 3, d, "tensor 't' chunk 0")


def test_random_payloads_never_crash_the_decoder():
    rng = np.random.default_rng(31)
    old = weights(rng, "BF16", 2000)
    dt = dtypes.BY_NAME["BF16"]
    for trial in range(300):
        payload = rng.integers(0, 256, int(rng.integers(0, 400)), dtype=np.uint8).tobytes()
        if trial % 3 == 0 and len(payload) > 8:   # a plausible table in front of random streams
            payload = bytes([2, 0x70, 0, 0x76, 0, 0x7d, 0]) + bytes(rng.integers(2, 40, 2, dtype=np.uint8)) \
                + bytes([20, 0, 0, 0, 20, 0, 0, 0, 1, 0, 0x75, 4, 3]) + payload
        try:
            ctxcoder.decode_gctx(payload, old, int(rng.integers(1, 50)), dt, "t")
        except errors.FormatError:
            pass


def test_group_choice_covers_every_changed_class():
    """The encoder's groups span the changed classes exactly and number at most GMAX."""
    rng = np.random.default_rng(47)
    for name in CTX_DTYPES:
        w, mbits, ebits = naive_ctx.LAYOUT[name]
        old = weights(rng, name, 30_000)
        new = optimizer_step(rng, old, name, 0.4, 0.01)
        payload = kernel_round_trip(old, new, name)
        bounds, models, *_ = naive_gctx.parse_table(payload, ebits)
        cls = np.array(naive_ctx.classes(old, mbits, ebits))[old != new]
        assert 1 <= len(models) <= gctx.GMAX
        assert bounds[0] == cls.min() and bounds[-1] == cls.max() + 1
