"""The context coders, encodings 4 (ctx, what the codec wrote before) and 5 (gctx, what it writes):
kernels agree with the plain-Python references, round trips are bit-exact on every bit pattern,
and a corrupt payload is always reported, never crashes, hangs or reads out of bounds. Tests that
hold for both take the ``coder`` fixture; what only one has is here (encoding 4) or in
tests/delta/test_gctx_coder.py (encoding 5).

The references (tests/naive_ctx.py, tests/naive_gctx.py) are written from docs/FORMAT.md; the
kernels live in delta/ctxcoder.py and the modules it names. Seeds are printed in assertion
messages so a failure can be replayed.
"""

from __future__ import annotations

import dataclasses
import json
import types
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash

from benchmarks import entropy
from ckptdelta.delta import chunks, codec, ctxcoder, dtypes, errors, kernels, record
from ckptdelta.delta.encodings import sparse as sparse_encoding
from tests import naive_ctx, naive_gctx
import tests

REPO = Path(tests.REPO)
GOLDEN = Path(tests.TESTS) / "golden"
CTX_DTYPES = sorted(record.CTX_LAYOUT)


CODERS = {
    "ctx": types.SimpleNamespace(name="ctx", id=record.CTX, encode=ctxcoder.encode_ctx, decode=ctxcoder.decode_ctx,
                                 naive=naive_ctx),
    "gctx": types.SimpleNamespace(name="gctx", id=record.GCTX, encode=ctxcoder.encode_gctx,
                                  decode=ctxcoder.decode_gctx, naive=naive_gctx),
}


@pytest.fixture(params=sorted(CODERS))
def coder(request, monkeypatch):
    """Each context coder in turn, the codec writing it (every record written before encoding 5
    must still decode, so encoding 4 is written again here)."""
    monkeypatch.setattr(chunks, "CONTEXT_ENCODING", CODERS[request.param].id)
    return CODERS[request.param]


@pytest.fixture
def ctx4(monkeypatch):
    """The codec writing encoding 4, for the tests of encoding 4 alone."""
    monkeypatch.setattr(chunks, "CONTEXT_ENCODING", record.CTX)


# --- inputs -------------------------------------------------------------------------------

def specials(name: str) -> list[int]:
    """Bit patterns a non-bit-exact codec breaks on: zeros, subnormals, extremes, inf, NaN payloads."""
    w, m, e = naive_ctx.LAYOUT[name]
    sign, exp_all = 1 << (w - 1), ((1 << e) - 1) << m
    out = set()
    for s in (0, sign):
        out |= {s, s | 1, s | ((1 << m) - 1), s | (1 << m), s | (exp_all - 1), s | exp_all,
                s | exp_all | 1, s | exp_all | (1 << (m - 1)), s | exp_all | ((1 << m) - 1)}
    return sorted(out)


def nan_bits(name: str) -> np.ndarray:
    """Every NaN bit pattern of ``name`` (float8_e4m3fn has only S.1111.111)."""
    w, m, e = naive_ctx.LAYOUT[name]
    exp_all = ((1 << e) - 1) << m
    payloads = [(1 << m) - 1] if name == "F8_E4M3" else range(1, 1 << m)
    return np.array([s | exp_all | x for s in (0, 1 << (w - 1)) for x in payloads], dtypes.BY_NAME[name].bits_dtype)


def weights(rng: np.random.Generator, name: str, n: int) -> np.ndarray:
    """Trained-looking weights of dtype ``name`` as bits (|w| ~ 0.02; fp8 scaled into its range)."""
    dt = dtypes.BY_NAME[name]
    scale = 64.0 if name.startswith("F8") else 1.0
    t = torch.from_numpy(rng.standard_normal(n).astype(np.float32) * 0.02 * scale).to(dt.torch_dtype)
    return dtypes.host_bits(t).copy()


def optimizer_step(rng: np.random.Generator, old: np.ndarray, name: str, p_small: float, p_large: float) -> np.ndarray:
    """Move elements one or a few ulps, small-magnitude ones (small ulp) far more often."""
    w, m, _e = naive_ctx.LAYOUT[name]
    mask = (1 << w) - 1
    mag = old.astype(np.int64) & (mask >> 1)
    p = np.where(mag < np.median(mag), p_small, p_large)
    moves = rng.random(old.size) < p
    step = rng.choice([-1, 1, -2, 2, -7, 30], size=old.size, p=[.43, .43, .05, .05, .02, .02])
    keys = np.where(old.astype(np.int64) & (1 << (w - 1)), mask - old.astype(np.int64), old.astype(np.int64) | (1 << (w - 1)))
    keys = (keys + np.where(moves, step, 0)) & mask
    new = np.where(keys & (1 << (w - 1)), keys ^ (1 << (w - 1)), mask - keys)
    return new.astype(old.dtype)


def as_tensor(bits: np.ndarray, name: str) -> torch.Tensor:
    return dtypes.from_bits(bits.copy(), dtypes.BY_NAME[name], bits.shape)


def same_bits(a, b) -> bool:
    return np.array_equal(dtypes.host_bits(a), dtypes.host_bits(b))


def kernel_round_trip(old: np.ndarray, new: np.ndarray, name: str, coder=CODERS["ctx"]) -> bytes | None:
    """Encode one chunk with the kernel, decode it with kernel and reference, check both."""
    dt = dtypes.BY_NAME[name]
    k = int(np.count_nonzero(old != new))
    if k == 0:
        return None
    res = coder.encode(old, new, dt, k)
    payload, sparse = res.payload, res.sparse_parts
    pos, val = coder.decode(payload, old, k, dt, "t")
    want = np.flatnonzero(old != new)
    ref = kernels.sparse_extract(old, new, k, 8 * dt.itemsize, True)   # what encoding 1 would store
    assert all(np.array_equal(a, b) for a, b in zip(sparse, ref))
    assert np.array_equal(pos, want) and np.array_equal(val, new[want])
    rp, rv = coder.naive.decode(payload, old, k, name)
    assert rp == want.tolist() and rv == new[want].tolist()
    return payload


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
        pos, flag, val, _ = naive_ctx.parse_table(payload, naive_ctx.LAYOUT[name][2])
        assert naive_ctx.encode(old, new, name, pos, flag, val) == payload, f"seed {seed}"


@pytest.mark.parametrize("name", CTX_DTYPES)
def test_kernel_decodes_payloads_with_parameters_its_encoder_never_picks(name):
    """Any valid model choice (either polarity, any Golomb parameter) decodes: the format, not the
    encoder's policy, defines what a reader accepts."""
    w, mbits, ebits = naive_ctx.LAYOUT[name]
    dt = dtypes.BY_NAME[name]
    for seed in range(10):
        rng = np.random.default_rng(100 + seed)
        n = int(rng.integers(2, 800))
        old = weights(rng, name, n)
        new = optimizer_step(rng, old, name, 0.3, 0.05)
        changed = old != new
        if not changed.any():
            continue
        cls = np.array(naive_ctx.classes(old, mbits, ebits))
        pos, flag, val = {}, {}, {}
        for c in np.unique(cls[changed]).tolist():
            members = cls == c
            k, nc = int(changed[members].sum()), int(members.sum())
            pos[c] = naive_ctx.FlagModel(naive_ctx.ALL, 1) if k == nc and rng.random() < 0.5 else \
                naive_ctx.FlagModel(naive_ctx.GOLOMB, int(rng.integers(2)), int(rng.integers(0, 30)))
            z = [naive_ctx.step_z(int(o), int(v), w) for o, v in zip(old[members & changed], new[members & changed])]
            big = [((x - 1) >> 1) > 0 for x in z]
            flag[c] = naive_ctx.FlagModel(naive_ctx.GOLOMB, int(rng.integers(2)), int(rng.integers(0, 12)))
            if not any(big):
                flag[c] = naive_ctx.FlagModel(naive_ctx.NONE)
            val[c] = 0 if flag[c].mode == naive_ctx.NONE else int(rng.integers(0, 20))
        payload = naive_ctx.encode(old, new, name, pos, flag, val)
        p, v = ctxcoder.decode_ctx(payload, old, int(changed.sum()), dt, "t")
        want = np.flatnonzero(changed)
        assert np.array_equal(p, want) and np.array_equal(v, new[want]), f"seed {seed}"


def test_golomb_parameters_follow_the_documented_grid():
    assert [naive_ctx.golomb_m(j) for j in range(17)] == [1, 1, 1, 1, 2, 2, 3, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16]
    assert all(ctxcoder.golomb_m(j) == naive_ctx.golomb_m(j) for j in range(ctxcoder.MAX_J + 1))
    for m in (1, 2, 3, 5, 7, 10, 1 << 20):
        for v in (0, 1, m - 1, m, 3 * m + 1, 1000):
            bits = naive_ctx.golomb_code(v, m)
            assert naive_ctx.Bits(naive_ctx._pack(bits)).golomb(m, 1 << 30) == v


# --- round trips through the codec ------------------------------------------------------------

@pytest.mark.parametrize("name", CTX_DTYPES)
def test_optimizer_like_changes_choose_the_context_coder_and_round_trip(name, coder):
    rng = np.random.default_rng(7)
    old = weights(rng, name, 50_000)
    new = optimizer_step(rng, old, name, 0.03, 0.002)
    enc = codec.encode(as_tensor(old, name), as_tensor(new, name), name="w", chunk_elems=20_000)
    assert enc.encoding_counts().get(coder.name, 0) == 3
    out = codec.decode(as_tensor(old, name), enc.to_bytes())
    assert same_bits(out, as_tensor(new, name))
    live = as_tensor(old, name)
    codec.apply_(live, enc.to_bytes())
    assert same_bits(live, as_tensor(new, name))
    st = codec.stage(as_tensor(old, name), enc.to_bytes())   # decodes straight into the staged arrays
    live = as_tensor(old, name)
    st.apply_(live)
    assert same_bits(live, as_tensor(new, name))


@pytest.mark.parametrize("name", CTX_DTYPES)
def test_unaligned_or_odd_length_chunks_give_the_same_payload(name):
    """The encoder reads four elements as one word where the memory allows; a chunk that starts
    off a word boundary, or whose length is not a multiple of four, goes element by element
    and must give the same bytes."""
    rng = np.random.default_rng(11)
    base_old = weights(rng, name, 40_003)
    base_new = optimizer_step(rng, base_old, name, 0.05, 0.003)
    dt = dtypes.BY_NAME[name]
    for start in range(4):
        old, new = base_old[start:], base_new[start:]
        k = kernels.count_changed(old, new)
        got = ctxcoder.encode_ctx(old, new, dt, k).payload
        want = ctxcoder.encode_ctx(old.copy(), new.copy(), dt, k).payload
        assert got == want, f"start {start}"
        pos, vals = ctxcoder.decode_ctx(got, old, k, dt, "w")
        rebuilt = old.copy()
        rebuilt[pos] = vals
        assert rebuilt.tobytes() == new.tobytes(), f"start {start}"


@pytest.mark.parametrize("name", CTX_DTYPES)
def test_special_values_round_trip_bit_exactly(name, coder):
    """NaN payloads, infinities, -0.0 and subnormals as parents and as results, in every pairing."""
    sp = np.array(specials(name), dtype=dtypes.BY_NAME[name].bits_dtype)
    old = np.repeat(sp, sp.size)
    new = np.tile(sp, sp.size)
    rng = np.random.default_rng(11)
    for o, nw in ((old, new), (np.concatenate([old, weights(rng, name, 3000)]),
                               np.concatenate([new, optimizer_step(rng, weights(rng, name, 3000), name, .1, .1)]))):
        kernel_round_trip(o, nw, name, coder)
        enc = codec.encode(as_tensor(o, name), as_tensor(nw, name), name="s", chunk_elems=512)
        assert same_bits(codec.decode(as_tensor(o, name), enc.to_bytes()), as_tensor(nw, name))


@pytest.mark.parametrize("name", CTX_DTYPES)
def test_adversarial_change_patterns_round_trip(name, coder):
    dt = dtypes.BY_NAME[name]
    w = 8 * dt.itemsize
    rng = np.random.default_rng(13)
    n = 4096
    base = weights(rng, name, n)
    every = optimizer_step(rng, base, name, 1.0, 1.0)
    every[every == base] ^= dt.bits_dtype.type(1)
    single = base.copy()
    single[1234] ^= dt.bits_dtype.type(1)
    edges = base.copy()
    for s in range(0, n, 1000):                      # first and last element of each chunk of 1000
        edges[s] ^= dt.bits_dtype.type(1)
        edges[min(n, s + 1000) - 1] ^= dt.bits_dtype.type(1 << (w - 1))
    nan = nan_bits(name)
    all_nan_old = nan[rng.integers(0, nan.size, n)]
    all_nan_new = nan[rng.integers(0, nan.size, n)]
    cases = {
        "every element changes": (base, every),
        "random bits": (rng.integers(0, 1 << w, n, dtype=dt.bits_dtype), rng.integers(0, 1 << w, n, dtype=dt.bits_dtype)),
        "all NaN, other payloads": (all_nan_old, all_nan_new),
        "a single change": (base, single),
        "changes at chunk edges": (base, edges),
        "sign flips": (base, base ^ dt.bits_dtype.type(1 << (w - 1))),
        "every 64th element": (base, np.where(np.arange(n) % 64 == 63, base ^ dt.bits_dtype.type(1), base)),
    }
    for what, (old, new) in cases.items():
        kernel_round_trip(old, new, name, coder)
        for s in range(0, n, 1000):
            kernel_round_trip(old[s:s + 1000], new[s:s + 1000], name, coder)
        enc = codec.encode(as_tensor(old, name), as_tensor(new, name), name="a", chunk_elems=1000)
        assert same_bits(codec.decode(as_tensor(old, name), enc.to_bytes()), as_tensor(new, name)), what


def test_chunks_of_one_element_and_a_chunk_tail_round_trip(coder):
    rng = np.random.default_rng(17)
    old = weights(rng, "BF16", 37)
    new = optimizer_step(rng, old, "BF16", 0.5, 0.5)
    for ce in (1, 2, 5, 36):
        enc = codec.encode(as_tensor(old, "BF16"), as_tensor(new, "BF16"), name="t", chunk_elems=ce)
        assert same_bits(codec.decode(as_tensor(old, "BF16"), enc.to_bytes()), as_tensor(new, "BF16"))


def test_the_context_coder_is_only_used_where_it_is_smaller_and_only_for_its_dtypes(coder):
    rng = np.random.default_rng(19)
    for name in ("BF16", "F8_E5M2", "F32", "I16", "U8"):
        dt = dtypes.BY_NAME[name]
        old = rng.integers(0, 1 << (8 * dt.itemsize), 30_000, dtype=dt.bits_dtype, endpoint=False)
        new = old.copy()
        new[rng.random(old.size) < 0.01] += dt.bits_dtype.type(1)
        enc = codec.encode(as_tensor(old, name), as_tensor(new, name), chunk_elems=10_000)
        assert not {"ctx", "gctx"} - {coder.name} & set(enc.encoding_counts()), name
        if name not in record.CTX_LAYOUT:
            assert coder.name not in enc.encoding_counts(), name
        for i, c in enumerate(enc.header.chunks):
            s, e = enc.header.chunk_range(i)
            k = int(np.count_nonzero(old[s:e] != new[s:e]))
            *_, sparse = sparse_encoding.encode_payload(old[s:e], new[s:e], dt, k, chunks.DEFAULT_LEVEL)
            assert c.length <= len(sparse)
            if c.encoding == coder.id:
                assert c.length < len(sparse) and (c.planes_a, c.planes_b) == record.CTX_LAYOUT[name]


def test_sparse_estimate_is_the_order0_entropy_of_sparse_byte_planes():
    """The estimate is each byte plane's order-0 entropy (as many planes as the largest gap and
    step need), plus 24 bytes of frames: computed here plainly, for gaps and steps of every width."""
    rng = np.random.default_rng(44)
    for n, gap_hi, step_hi in ((1, 2, 2), (7, 300, 3), (5000, 1 << 20, 1 << 9), (20_000, 1 << 31, 1 << 40)):
        gaps = rng.integers(0, gap_hi, n).astype(np.uint32)
        steps = rng.integers(1, step_hi, n).astype(np.uint64)
        planes = [((gaps >> np.uint32(8 * p)) & np.uint32(0xFF)) for p in range(4)
                  if p == 0 or int(gaps.max()) >> (8 * p)]
        planes += [((steps >> np.uint64(8 * p)) & np.uint64(0xFF)) for p in range(8)
                   if p == 0 or int(steps.max()) >> (8 * p)]
        bits = 0.0
        for plane in planes:
            counts = np.bincount(plane.astype(np.int64), minlength=256)
            counts = counts[counts > 0]
            bits -= float(np.sum(counts * np.log2(counts / n)))
        got = ctxcoder.sparse_estimate(gaps, steps, int(gaps.max()), int(steps.max()))
        assert got == pytest.approx(bits / 8 + 24, rel=1e-12), (n, gap_hi, step_hi)
    assert ctxcoder.sparse_estimate(np.empty(0, np.uint32), np.empty(0, np.uint64), 0, 0) == 0.0


def test_sparse_estimate_is_below_what_sparse_actually_needs(coder):
    """The encoder skips compressing sparse's planes when ctx is far below this estimate; the
    estimate must not exceed the real sparse payload (zstd does not beat order-0 without repeats)."""
    rng = np.random.default_rng(43)
    for name in CTX_DTYPES:
        dt = dtypes.BY_NAME[name]
        for p_small, p_large in ((0.001, 0.0001), (0.02, 0.002), (0.3, 0.05), (0.9, 0.6)):
            old = weights(rng, name, 40_000)
            new = optimizer_step(rng, old, name, p_small, p_large)
            k = int(np.count_nonzero(old != new))
            if k == 0:
                continue
            res = coder.encode(old, new, dt, k)
            *_, payload = sparse_encoding.encode_payload(old, new, dt, k, chunks.DEFAULT_LEVEL)
            assert ctxcoder.sparse_estimate(*res.sparse_parts) <= len(payload), (name, p_small)
            if res.beats_sparse:
                assert len(res.payload) < len(payload)
    strided = weights(rng, "BF16", 40_000)          # a pattern zstd finds: the estimate must not decide
    new = strided.copy()
    new[::100] += np.uint16(1)
    res = coder.encode(strided, new, dtypes.BY_NAME["BF16"], 400)
    assert not res.beats_sparse


# --- corruption --------------------------------------------------------------------------------

def _ctx_record(coder, name: str = "BF16", n: int = 3000, seed: int = 23):
    """(old bits, new bits, a record of three chunks in ``coder``'s encoding)."""
    rng = np.random.default_rng(seed)
    old = weights(rng, name, n)
    new = optimizer_step(rng, old, name, 0.05, 0.01)
    enc = codec.encode(as_tensor(old, name), as_tensor(new, name), name="model.layers.3.mlp.w", chunk_elems=1000)
    assert [c.encoding for c in enc.header.chunks] == [coder.id] * 3
    return old, new, enc


def _with_payload(enc: codec.EncodedTensor, i: int, payload: bytes) -> bytes:
    """The record with chunk i's payload replaced, its length and checksum made consistent."""
    h = enc.header
    chunks_ = list(h.chunks)
    chunks_[i] = dataclasses.replace(chunks_[i], length=len(payload),
                                     checksum=xxhash.xxh3_64_intdigest(payload))
    h2 = dataclasses.replace(h, chunks=tuple(chunks_))
    pays = [bytes(p) for p in enc.payloads]
    pays[i] = payload
    return record.pack_header(h2) + b"".join(pays)


def _must_reject_or_be_exact(old, new, name, data: bytes, what: str) -> None:
    try:
        out = codec.decode(as_tensor(old, name), data)
    except errors.DeltaError as e:
        assert "model.layers.3.mlp.w" in str(e), f"{what}: error does not name the tensor: {e}"
        if isinstance(e, errors.FormatError):
            assert "chunk" in str(e), f"{what}: format error does not name the chunk: {e}"
        return
    assert same_bits(out, as_tensor(new, name)), f"{what}: decoded a wrong tensor without an error"


@pytest.mark.parametrize("name", ["BF16", "F8_E4M3"])
def test_flipped_payload_bytes_are_detected_even_with_a_valid_checksum(name, coder):
    old, new, enc = _ctx_record(coder, name)
    payload = bytes(enc.payloads[1])
    for pos in range(len(payload)):
        for x in (0x01, 0x80, 0xFF):
            bad = bytearray(payload)
            bad[pos] ^= x
            _must_reject_or_be_exact(old, new, name, _with_payload(enc, 1, bytes(bad)), f"byte {pos} ^ {x:#x}")
    flipped = bytearray(enc.to_bytes())
    flipped[-5] ^= 1                                  # without resealing: the payload checksum catches it
    with pytest.raises(errors.ChecksumError, match="chunk 2"):
        codec.decode(as_tensor(old, name), bytes(flipped))


def test_truncated_and_extended_payloads_are_rejected(coder):
    old, _new, enc = _ctx_record(coder)
    payload = bytes(enc.payloads[0])
    for cut in range(len(payload)):
        with pytest.raises(errors.DeltaError):
            codec.decode(as_tensor(old, "BF16"), _with_payload(enc, 0, payload[:cut]))
    for extra in (b"\0", b"\x80", b"\0" * 9):
        with pytest.raises(errors.FormatError, match="chunk 0"):
            codec.decode(as_tensor(old, "BF16"), _with_payload(enc, 0, payload + extra))


def test_a_count_that_disagrees_with_the_payload_is_rejected(coder):
    old, _new, enc = _ctx_record(coder)
    dt = dtypes.BY_NAME["BF16"]
    c = enc.header.chunks[0]
    s, e = enc.header.chunk_range(0)
    for count in (c.count - 1, c.count + 1, 1, e - s):
        if count == c.count:
            continue
        with pytest.raises(errors.FormatError, match=f" {coder.name} "):
            coder.decode(bytes(enc.payloads[0]), old[s:e], count, dt, "tensor 't' chunk 0")


def test_hostile_class_tables_are_rejected_before_decoding():
    old = weights(np.random.default_rng(29), "BF16", 100)
    dt = dtypes.BY_NAME["BF16"]
    f8 = dtypes.BY_NAME["F8_E4M3"]
    cases = {
        "empty": b"",
        "short": b"\x00\x00",
        "lo > hi": b"\x05\x00\x04\x00" + b"\x02" * 8,
        "hi past the classes": b"\x00\x00\x10\x00" + b"\x02" * 40,
        "bad model byte": b"\x70\x00\x70\x00\xc2" + b"\0" * 10,
        "NONE at the range's end": b"\x70\x00\x71\x00\x02\x00\x00\x00" + b"\0" * 10,
        "magnitude index too large": b"\x70\x00\x70\x00\x02\x00\x60" + b"\0" * 10,
        "P past the payload": b"\x70\x00\x70\x00\x01\x00\x00\xff\xff\xff\xff",
        "unary run of ones": b"\x70\x00\x70\x00\x02\x00\x00\x40\x00\x00\x00" + b"\xff" * 64,
        "all ones": b"\xff" * 300,
    }
    for what, payload in cases.items():
        for d, o in ((dt, old), (f8, old.astype(np.uint8))):
            with pytest.raises(errors.FormatError, match="chunk 0"):
                ctxcoder.decode_ctx(payload, o, 3, d, "tensor 't' chunk 0")
    with pytest.raises(errors.FormatError, match="U8"):
        ctxcoder.decode_ctx(b"\0" * 16, old.astype(np.uint8), 1, dtypes.BY_NAME["U8"], "tensor 't' chunk 0")


def test_random_payloads_never_crash_the_decoder():
    rng = np.random.default_rng(31)
    old = weights(rng, "BF16", 2000)
    dt = dtypes.BY_NAME["BF16"]
    for trial in range(300):
        payload = rng.integers(0, 256, int(rng.integers(0, 400)), dtype=np.uint8).tobytes()
        if trial % 3 == 0 and len(payload) > 8:   # a plausible table in front of random streams
            payload = bytes([0x70, 0, 0x7d, 0]) + bytes(rng.integers(2, 40, 14, dtype=np.uint8)) + payload
        try:
            ctxcoder.decode_ctx(payload, old, int(rng.integers(1, 50)), dt, "t")
        except errors.FormatError:
            pass


@pytest.mark.slow  # ~15-40 s per coder: a fresh compile of the decoder with bounds checks
def test_decoder_stays_in_bounds_under_numba_boundscheck(tmp_path, coder):
    """Numba checks no index by default: recompile the decoder with bounds checks on and feed it
    corrupt and random payloads; an out-of-bounds access would raise IndexError there."""
    rng = np.random.default_rng(37)
    cases = {}
    for name in ("BF16", "F8_E5M2"):
        dt = dtypes.BY_NAME[name]
        old = weights(rng, name, 1500)
        new = optimizer_step(rng, old, name, 0.2, 0.02)
        k = int((old != new).sum())
        good = coder.encode(old, new, dt, k)[0]
        payloads = [good]
        for _trial in range(300):
            bad = bytearray(good)
            for _ in range(int(rng.integers(1, 4))):
                bad[int(rng.integers(len(bad)))] ^= int(rng.integers(1, 256))
            payloads.append(bytes(bad[: len(bad) - int(rng.integers(0, 3))]))
        payloads += [rng.integers(0, 256, int(rng.integers(0, 200)), dtype=np.uint8).tobytes() for _ in range(100)]
        cases[name] = (old, k, payloads)
    np.save(tmp_path / "cases.npy", np.array([cases], dtype=object), allow_pickle=True)
    script = r"""
import sys
import numpy as np
from numba.core import config
assert config.BOUNDSCHECK
from ckptdelta.delta import ctxcoder, dtypes, errors
decode = getattr(ctxcoder, "decode_" + sys.argv[2])
cases = np.load(sys.argv[1], allow_pickle=True)[0]
for name, (old, k, payloads) in cases.items():
    dt = dtypes.BY_NAME[name]
    decode(payloads[0], old, k, dt, "t")
    for i, p in enumerate(payloads):
        for count in (k, k - 1, k + 1):
            try:
                decode(p, old, count, dt, "t")
            except errors.FormatError:
                pass
print("IN BOUNDS")
"""
    env = {**os.environ, "NUMBA_BOUNDSCHECK": "1", "NUMBA_CACHE_DIR": str(tmp_path), "PYTHONWARNINGS": "ignore"}
    r = subprocess.run([sys.executable, "-c", script, str(tmp_path / "cases.npy"), coder.name], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "IN BOUNDS" in r.stdout, r.stderr[-3000:]


def test_kernels_give_the_same_bytes_as_plain_python(tmp_path, coder):
    """The kernels (encoding 5's vector masks included) run unchanged as Python under
    NUMBA_DISABLE_JIT (coverage runs): same payloads, same decodes, so their integer arithmetic
    does not depend on LLVM."""
    rng = np.random.default_rng(41)
    cases = {}
    for name in CTX_DTYPES:
        old = weights(rng, name, 1500)
        old[:20] = np.resize(np.array(specials(name), old.dtype), 20)
        new = optimizer_step(rng, old, name, 0.6, 0.01)
        k = int((old != new).sum())
        cases[name] = (old, new, coder.encode(old, new, dtypes.BY_NAME[name], k)[0])
    np.save(tmp_path / "cases.npy", np.array([cases], dtype=object), allow_pickle=True)
    script = r"""
import sys
import numpy as np
from numba.core import config
assert config.DISABLE_JIT
from ckptdelta.delta import ctxcoder, dtypes
encode, decode = getattr(ctxcoder, "encode_" + sys.argv[2]), getattr(ctxcoder, "decode_" + sys.argv[2])
for name, (old, new, payload) in np.load(sys.argv[1], allow_pickle=True)[0].items():
    dt = dtypes.BY_NAME[name]
    k = int((old != new).sum())
    assert encode(old, new, dt, k)[0] == payload, name
    pos, val = decode(payload, old, k, dt, "t")
    assert (pos == np.flatnonzero(old != new)).all() and (val == new[pos]).all(), name
print("SAME")
"""
    env = {**os.environ, "NUMBA_DISABLE_JIT": "1", "PYTHONWARNINGS": "ignore"}
    r = subprocess.run([sys.executable, "-c", script, str(tmp_path / "cases.npy"), coder.name], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "SAME" in r.stdout, r.stderr[-3000:]


# --- golden records ------------------------------------------------------------------------------

def test_golden_records_decode_with_kernel_and_reference(coder):
    cases = [c for c in json.loads((GOLDEN / "index.json").read_text())["cases"] if coder.name in c["encodings"]]
    assert {c["dtype"] for c in cases} >= {"BF16", "F8_E5M2" if coder.name == "ctx" else "F8_E4M3"}
    for case in cases:
        buf = (GOLDEN / case["record"]).read_bytes()
        parent = np.load(GOLDEN / case["parent"]).reshape(-1)
        expected = np.load(GOLDEN / case["expected"]).reshape(-1)
        enc = codec.EncodedTensor.from_bytes(buf)
        live = as_tensor(parent, case["dtype"])
        codec.apply_(live, buf)
        assert np.array_equal(dtypes.host_bits(live), expected)
        for i, c in enumerate(enc.header.chunks):
            if c.encoding != coder.id:
                continue
            s, e = enc.header.chunk_range(i)
            p, v = coder.naive.decode(bytes(enc.payloads[i]), parent[s:e], c.count, case["dtype"])
            assert np.array_equal(expected[s:e][p], np.array(v, expected.dtype))


# --- the entropy estimate the benchmark prints -----------------------------------------------------

def test_conditional_entropy_of_a_known_mixture():
    """Two exponent classes of 1000 elements: one changes half its elements by +-1 ulp (1 bit
    each for position and sign), the other never changes: 2 bits per change in all."""
    a = np.full(2000, 0x3C00, np.uint16)              # exponent 120
    a[1000:] = 0x4000                                 # exponent 128
    b = a.copy()
    b[0:1000:2] += 1                                  # every other element of class 120 moves
    b[1:1000:4] -= 1                                  # and every fourth moves down
    old = {"w": as_tensor(a, "BF16")}
    new = {"w": as_tensor(b, "BF16")}
    e = entropy.conditional_entropy(old, new)
    k = int(np.count_nonzero(a != b))
    assert e["n_changed"] == k == 750
    p = 750 / 1000
    h = -(p * np.log2(p) + (1 - p) * np.log2(1 - p))
    assert e["pos_bits"] == pytest.approx(1000 * h / k)
    assert e["step_bits"] == pytest.approx(-(2 / 3 * np.log2(2 / 3) + 1 / 3 * np.log2(1 / 3)))
    assert entropy.conditional_entropy(old, new, per="tensor")["pos_bits"] == pytest.approx(e["pos_bits"])
    assert e["ratio_limit"] == pytest.approx(4000 / ((e["pos_bits"] + e["step_bits"]) * k / 8))
