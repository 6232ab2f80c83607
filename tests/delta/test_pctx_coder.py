"""Chunk encoding 6 (pctx, delta/pctx.py): each element's step coded in contexts of its parent and of the step
before it, with an adaptive binary range coder.

A plain-Python decoder written from docs/FORMAT.md alone ("Encoding 6: pctx") decodes what the kernel encodes,
so the document and the code say the same thing; the kernel round-trips Adam-like steps of every dtype it serves,
special values included; every truncation and flipped byte of a payload is refused or caught by the record's
digest, never decoded into wrong bits; a reader without the grandparent, or with another one, gets an error that
says so and leaves its tensor as it was."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import xxhash

from ckptdelta.delta import codec, errors, record
from ckptdelta.delta.pctx import pctx_decode, pctx_encode
from tests.golden.make_golden import _from_keys as from_keys, _keys_of as keys

LAYOUT = {"BF16": (16, 7, 8, np.uint16), "F16": (16, 10, 5, np.uint16), "F32": (32, 23, 8, np.uint32)}


def adam_like(dt: str, n: int, seed: int, moving: float = 0.8) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(grandparent, parent, new) bits: two steps, the second mostly in the first's direction and of a similar
    size in ulps (1 to hundreds), a share of elements moving; NaN payloads, infinities, -0.0, subnormals."""
    w, _m, _e, dtype = LAYOUT[dt]
    rng = np.random.default_rng(seed)
    f = (rng.standard_normal(n) * 0.02).astype(np.float32)
    g = {"BF16": lambda: (f.view(np.uint32) >> 16).astype(np.uint16), "F16": lambda: f.astype(np.float16).view(np.uint16),
         "F32": lambda: f.view(np.uint32)}[dt]()
    scale = 1 << 12 if w == 32 else 1
    size = np.maximum(1, (rng.pareto(1.5, n) * scale).astype(np.int64))
    direction = np.where(rng.random(n) < 0.5, 1, -1)
    step1 = direction * size * (rng.random(n) < moving)
    step2 = np.where(rng.random(n) < 0.15, -1, 1) * direction * size * (rng.random(n) < moving)
    old = from_keys(keys(g, w) + step1, w, dtype)
    new = from_keys(keys(old, w) + step2, w, dtype)
    if n >= 8:
        specials = ([0x7FC1, 0xFF80, 0x8000, 0x0001, 0x7C00] if w == 16 else
                    [0x7FC00001, 0xFF800000, 0x80000000, 0x00000001, 0x7F800000])
        new[:5] = specials
        old[5:7] = [(1 << w) - 1, 0]
    return g, old, new


# --- a decoder from docs/FORMAT.md alone -------------------------------------------------------------------

def reference_decode(payload: bytes, old: np.ndarray, grand: np.ndarray, count: int, w: int, M: int, E: int):
    """docs/FORMAT.md "Encoding 6: pctx", read literally: (positions, new bits), or raise ValueError."""
    R = int.from_bytes(payload[:4], "little")
    if not 5 <= R <= len(payload) - 4:
        raise ValueError("bad R")
    rc, raw = payload[4:4 + R], payload[4 + R:]
    if rc[0] != 0:
        raise ValueError("first byte")
    st = {"code": int.from_bytes(rc[1:5], "big"), "range": 0xFFFFFFFF, "pos": 5}

    def bit(probs: list, i: int) -> int:
        p = probs[i]
        bound = (st["range"] >> 11) * p
        if st["code"] < bound:
            st["range"], b = bound, 0
            probs[i] = p + ((2048 - p) >> 5)
        else:
            st["code"] -= bound
            st["range"] -= bound
            b = 1
            probs[i] = p - (p >> 5)
        if st["range"] < 1 << 24:
            if st["pos"] >= len(rc):
                raise ValueError("past the range stream")
            st["range"] = (st["range"] << 8) & 0xFFFFFFFF
            st["code"] = ((st["code"] << 8) | rc[st["pos"]]) & 0xFFFFFFFF
            st["pos"] += 1
        return b

    rawbits = "".join(f"{b:08b}" for b in raw)
    rpos = 0
    C, W = 1 << E, w + 1
    chg, flip, big = [1024] * (C * W), [1024] * (C * W), [1024] * (C * W)
    tree, top = [1024] * (W * 32), [1024] * (W + 2)
    T = 4 if w == 16 else 5
    mask = (1 << w) - 1
    ko_all, kg_all = keys(old, w), keys(grand, w)
    pos, vals = [], []
    for i in range(old.shape[0]):
        p = (int(ko_all[i]) - int(kg_all[i])) & mask
        if p >= 1 << (w - 1):
            p -= 1 << w
        pl, neg = abs(p).bit_length(), p < 0
        ci = ((int(old[i]) >> M) & (C - 1)) * W + pl
        if not bit(chg, ci):
            continue
        up = (bit(flip, ci) == 1) == neg
        if not bit(big, ci):
            a = 1
        else:
            node = 1
            for _ in range(T):
                node = 2 * node + bit(tree, pl * 32 + node)
            L = node - (1 << T) + 2
            if L > w:
                raise ValueError("L > w")
            a = (2 | bit(top, L)) << (L - 2)
            if L > 2:
                if rpos + L - 2 > len(rawbits):
                    raise ValueError("past the raw stream")
                a |= int(rawbits[rpos:rpos + L - 2], 2)
                rpos += L - 2
        k = (int(ko_all[i]) + (a if up else -a)) & mask
        pos.append(i)
        vals.append(int(from_keys(np.array([k]), w, old.dtype)[0]))
    if len(pos) != count or st["pos"] != len(rc) or rpos > len(rawbits) or -(-rpos // 8) != len(raw) \
            or "1" in rawbits[rpos:]:
        raise ValueError("end")
    return np.array(pos, np.int64), np.array(vals, old.dtype)


def kernel_decode(payload: bytes, old, grand, count, w, M, E):
    positions, values = np.empty(count, np.int64), np.empty(count, old.dtype)
    err = pctx_decode(np.frombuffer(payload, np.uint8), old, grand, count, w, M, E, positions, values)
    return err, positions, values


@pytest.mark.parametrize("dt", sorted(LAYOUT))
@pytest.mark.parametrize("n,moving", [(1, 1.0), (7, 1.0), (300, 0.8), (2000, 0.3)])
def test_the_kernel_round_trips_adam_like_steps_and_a_decoder_written_from_the_format_reads_its_payloads(
        dt, n, moving):
    w, M, E, _ = LAYOUT[dt]
    g, old, new = adam_like(dt, n, seed=n, moving=moving)
    payload, count = pctx_encode(old, new, g, w, M, E)
    if count == 0:
        assert payload.shape[0] == 0
        return
    payload = payload.tobytes()
    assert count == int((old != new).sum())
    err, positions, values = kernel_decode(payload, old, g, count, w, M, E)
    assert err == 0
    out = old.copy()
    out[positions] = values
    np.testing.assert_array_equal(out, new)
    if n <= 300:
        rpos, rvals = reference_decode(payload, old, g, count, w, M, E)
        np.testing.assert_array_equal(rpos, positions)
        np.testing.assert_array_equal(rvals, values)


def test_every_truncation_and_flipped_byte_is_refused_or_caught_by_the_digest_never_decoded_wrong():
    g, old, new = adam_like("BF16", 400, seed=5)
    gt, ot, nt = (torch.from_numpy(x.view(np.int16)).view(torch.bfloat16) for x in (g, old, new))
    enc = codec.encode(ot, nt, name="w", grandparent=gt)
    assert [c.encoding for c in enc.header.chunks] == [record.PCTX]
    payload = bytes(enc.payloads[0])
    count = enc.header.chunks[0].count

    def sealed(p: bytes) -> bytes:
        c = enc.header.chunks[0]
        entry = record.ChunkEntry(c.encoding, c.planes_a, c.planes_b, c.count, len(p), xxhash.xxh3_64_intdigest(p))
        h = enc.header
        header = record.RecordHeader(h.name, h.dtype, h.shape, h.numel, h.chunk_elems, h.digest, h.parent_digest,
                                     True, (entry,), h.header_size)
        return codec.EncodedTensor(header, [p]).to_bytes()

    variants = [payload[:k] for k in range(len(payload))]
    variants += [payload[:k] + bytes([payload[k] ^ 0x5A]) + payload[k + 1:] for k in range(len(payload))]
    variants.append(payload + b"\x00")
    refused = harmless = 0
    for p in variants:
        err, _pos, _vals = kernel_decode(p, old, g, count, 16, 7, 8)       # reads only p's bytes
        refused += err != 0
        live = ot.clone()
        try:
            codec.apply_(live, sealed(p), grandparent=gt)
        except errors.DeltaError as e:
            assert "'w'" in str(e)
            assert torch.equal(live.view(torch.int16), ot.view(torch.int16))     # left as it was
        else:     # a flip in the coder's last flushed bytes may leave every decision as it was: the same bits
            harmless += 1
            assert torch.equal(live.view(torch.int16), nt.view(torch.int16))
    assert refused > len(variants) // 2 and harmless <= 4


def test_a_reader_without_the_grandparent_or_with_another_is_told_so_and_keeps_its_tensor():
    g, old, new = adam_like("F32", 1000, seed=9)
    gt, ot, nt = (torch.from_numpy(x.view(np.int32)).view(torch.float32) for x in (g, old, new))
    enc = codec.encode(ot, nt, name="lora_B", grandparent=gt, chunk_elems=256)
    assert enc.needs_grandparent and set(enc.encoding_counts()) == {"pctx"}
    assert not codec.encode(ot, nt, name="lora_B").needs_grandparent      # none given: none needed
    assert torch.equal(codec.decode(ot, enc, grandparent=gt).view(torch.int32), nt.view(torch.int32))
    live = ot.clone()
    with pytest.raises(errors.GrandparentNeededError, match="'lora_B'.*before its parent"):
        codec.apply_(live, enc)
    with pytest.raises(errors.ParentMismatchError, match="'lora_B'.*grandparent given is not"):
        codec.apply_(live, enc, grandparent=ot)
    with pytest.raises(errors.ShapeMismatchError, match="grandparent"):
        codec.stage(live, enc, grandparent=gt[:10])
    assert torch.equal(live.view(torch.int32), ot.view(torch.int32))


def test_the_encoder_takes_pctx_only_with_a_grandparent_and_where_it_is_smaller():
    g, old, new = adam_like("BF16", 20000, seed=2)
    gt, ot, nt = (torch.from_numpy(x.view(np.int16)).view(torch.bfloat16) for x in (g, old, new))
    with_g = codec.encode(ot, nt, grandparent=gt, chunk_elems=4096)
    without = codec.encode(ot, nt, chunk_elems=4096)
    assert set(with_g.encoding_counts()) == {"pctx"} and "pctx" not in without.encoding_counts()
    assert with_g.nbytes < without.nbytes
    # a grandparent that predicts nothing (the parent itself: every previous step 0) is still a valid context,
    # and the fast codec (context=False) never uses it
    assert codec.decode(ot, codec.encode(ot, nt, grandparent=ot), grandparent=ot).view(torch.int16).equal(
        nt.view(torch.int16))
    assert "pctx" not in codec.encode(ot, nt, grandparent=gt, context=False).encoding_counts()
