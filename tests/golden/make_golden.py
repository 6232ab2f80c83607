"""Write the golden records once: small tensors of several dtypes in every chunk encoding.

    python -m tests.golden.make_golden            # writes only new cases; released ones stay as they are
    python -m tests.golden.make_golden --force    # rewrites everything (only for a new format version)

tests/delta/test_codec.py decodes every record listed in index.json on each run and
compares the result with the stored bits, so data written by this release keeps
decoding in every later one. Never regenerate the files of a released version to
make a failing test pass: the failure is the point.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from ckptdelta.delta import codec, dtypes, record

HERE = Path(__file__).resolve().parent


def _tensor(bits: np.ndarray, name: str) -> torch.Tensor:
    dt = dtypes.BY_NAME[name]
    as_int = bits.view(np.uint8 if dt.itemsize == 1 else f"<i{dt.itemsize}")
    return torch.from_numpy(as_int.copy()).view(dt.torch_dtype)


def _bits(rng: np.random.Generator, name: str, shape: tuple[int, ...]) -> np.ndarray:
    dt = dtypes.BY_NAME[name]
    n = int(np.prod(shape))
    if name == "BOOL":
        return rng.integers(0, 2, size=n, dtype=np.uint8).reshape(shape)
    return rng.integers(0, 1 << (8 * dt.itemsize), size=n, dtype=dt.bits_dtype, endpoint=False).reshape(shape)


def _bf16_weights(rng: np.random.Generator, n: int) -> np.ndarray:
    f32 = (rng.standard_normal(n) * 0.02).astype(np.float32)
    return (f32.view(np.uint32) >> 16).astype(np.uint16)


def cases() -> list[dict]:
    """(name, dtype, old bits or None, new bits, chunk_elems, encodings the case must contain)."""
    rng = np.random.default_rng(20240601)
    out = []

    def add(name, dtype, old, new, chunk_elems, must, grand=None, context=True):
        out.append(dict(name=name, dtype=dtype, old=old, new=new, chunk_elems=chunk_elems, must=must, grand=grand,
                        context=context))

    a = _bits(rng, "F32", (4, 5))
    add("f32_unchanged", "F32", a, a.copy(), 8, {"unchanged"})

    w = _bf16_weights(rng, 300)
    w2 = w.copy()
    w2[[3, 4, 298, 299]] += 1
    add("bf16_sparse", "BF16", w, w2, 128, {"sparse", "unchanged"})

    h = _bits(rng, "F16", (257,))
    add("f16_dense_xor", "F16", h, h ^ np.uint16(1), 1 << 20, {"dense_xor"})

    add("i32_raw_without_parent", "I32", None, _bits(rng, "I32", (7, 3)), 8, {"raw"})

    r = _bf16_weights(rng, 2000)
    add("bf16_raw_reset_to_zero", "BF16", r, np.zeros_like(r), 1000, {"raw"})

    e4 = _bits(rng, "F8_E4M3", (64, 3))
    e4n = e4.copy()
    flat = e4n.reshape(-1)
    flat[64:67] ^= np.uint8(0x80)         # sign flips: a sparse chunk
    flat[128:] ^= np.uint8(0x01)          # every element of the last chunk: dense
    add("f8e4m3_mixed", "F8_E4M3", e4, e4n, 64, {"unchanged", "sparse", "dense_xor"})

    e5 = _bits(rng, "F8_E5M2", (33,))
    e5n = e5.copy()
    e5n[[0, 32]] = [0x7C, 0xFF]           # +inf, a NaN
    add("f8e5m2_sparse", "F8_E5M2", e5, e5n, 16, {"sparse"})

    specials = np.array([0, 1 << 63, 0x7FF0000000000000, 0xFFF0000000000000, 0x7FF8000000000000,
                         0x7FF0000000000001, 0xFFF000000000BEEF, 1, 0x800FFFFFFFFFFFFF, 0x7FEFFFFFFFFFFFFF],
                        dtype=np.uint64)
    add("f64_special_values", "F64", specials, np.roll(specials, 1), 4, set())

    i8 = _bits(rng, "I8", (5, 5))
    i8n = i8.copy()
    i8n[2, :] = [0x7F, 0x80, 0xFF, 0x00, 0x01]
    add("i8_row_changed", "I8", i8, i8n, 10, set())

    i64 = _bits(rng, "I64", (6,))
    add("i64_raw_without_parent", "I64", None, i64, 4, {"raw"})

    u8 = _bits(rng, "U8", (100,))
    add("u8_dense_xor", "U8", u8, u8 ^ np.uint8(0xF0), 100, {"dense_xor"})

    b = _bits(rng, "BOOL", (50,))
    bn = b.copy()
    bn[7] ^= 1
    add("bool_sparse", "BOOL", b, bn, 32, {"sparse", "unchanged"})

    add("f16_scalar", "F16", np.array(0x3C00, np.uint16), np.array(0x8000, np.uint16), 1, set())
    add("f32_empty", "F32", np.zeros((0, 4), np.uint32), np.zeros((0, 4), np.uint32), 16, set())

    for name in ("U16", "U32", "U64"):
        if name in dtypes.BY_NAME:
            u = _bits(rng, name, (9,))
            un = u.copy()
            un[4] = 0
            add(f"{name.lower()}_sparse", name, u, un, 1 << 20, {"sparse"})
    _ctx_cases(add)
    _gctx_cases(add)
    _pctx_cases(add)
    _dense_step_cases(add)
    _grouped_step_cases(add)
    return out


def _ctx_cases(add) -> None:
    """Encoding 4 (ctx): optimizer-like one-ulp moves, most likely for the smallest weights,
    plus special values changing (NaN payloads, infinities, -0.0, subnormals). Its own
    generator, so the cases above keep their random streams."""
    rng = np.random.default_rng(20250107)
    w = _bf16_weights(rng, 3000)
    w[:8] = [0x7FC1, 0xFF80, 0x8000, 0x0001, 0x807F, 0x7F80, 0x0000, 0xFFFF]
    ulp_small = (w & 0x7FFF) < 0x3C00        # |w| < 2**-7
    moves = rng.random(3000) < np.where(ulp_small, 0.2, 0.01)
    keys = np.where(w & 0x8000, 0xFFFF - w.astype(np.int64), w.astype(np.int64) + 0x8000)
    keys = (keys + np.where(moves, rng.choice([-1, 1, -3, 2], size=3000, p=[.45, .45, .05, .05]), 0)) % 65536
    w2 = np.where(keys & 0x8000, keys - 0x8000, 0xFFFF - keys).astype(np.uint16)
    w2[:8] = [0x7FC2, 0x7F80, 0x0000, 0x8001, 0x007F, 0xFF80, 0x0000, 0xFFFF]
    add("bf16_ctx", "BF16", w, w2, 1024, {"ctx"})

    e5 = rng.integers(0x30, 0x48, size=600, dtype=np.uint8) | (rng.integers(0, 2, 600, dtype=np.uint8) << 7)
    e5n = e5.copy()
    idx = rng.choice(600, 90, replace=False)
    e5n[idx] = (e5n[idx].astype(np.int64) + rng.choice([-1, 1], size=90)) & 0xFF
    e5n[[0, 1]] = [0x7D, 0x80]            # a NaN, -0.0
    add("f8e5m2_ctx", "F8_E5M2", e5, e5n, 1 << 20, {"ctx"})


def _gctx_cases(add) -> None:
    """Encoding 5 (gctx): the same kind of moves over several 64-element words and a partial
    last word, three or four groups of classes, a group of mostly changed elements (coded by
    its unchanged ones), special values; and F8_E4M3. Its own generator, as above."""
    rng = np.random.default_rng(20261202)
    w = _bf16_weights(rng, 5000)
    w[:8] = [0x7FC1, 0xFF80, 0x8000, 0x0001, 0x807F, 0x7F80, 0x0000, 0xFFFF]
    mag = w & 0x7FFF
    p = np.where(mag < 0x3800, 0.97, np.where(mag < 0x3A00, 0.5, np.where(mag < 0x3C00, 0.1, 0.01)))
    moves = rng.random(5000) < p
    keys = np.where(w & 0x8000, 0xFFFF - w.astype(np.int64), w.astype(np.int64) + 0x8000)
    keys = (keys + np.where(moves, rng.choice([-1, 1, -3, 2, 40], size=5000, p=[.44, .44, .05, .05, .02]), 0)) % 65536
    w2 = np.where(keys & 0x8000, keys - 0x8000, 0xFFFF - keys).astype(np.uint16)
    w2[:8] = [0x7FC2, 0x7F80, 0x0000, 0x8001, 0x007F, 0xFF80, 0x0000, 0xFFFF]
    add("bf16_gctx", "BF16", w, w2, 4000, {"gctx"})

    t = torch.from_numpy((rng.standard_normal(700) * 40).astype(np.float32)).to(torch.float8_e4m3fn)
    e4 = t.view(torch.uint8).numpy().copy()
    e4n = e4.copy()
    idx = rng.choice(700, 120, replace=False)
    e4n[idx] = (e4n[idx].astype(np.int64) + rng.choice([-1, 1], size=120)) & 0xFF
    e4n[e4n & 0x7F == 0x7F] = e4[e4n & 0x7F == 0x7F]      # keep NaN (S.1111.111) only where it was
    e4n[0] = 0x7F                                          # ... and one new NaN
    add("f8e4m3_gctx", "F8_E4M3", e4, e4n, 1 << 20, {"gctx"})


def _keys_of(bits: np.ndarray, w: int) -> np.ndarray:
    b = bits.astype(np.int64)
    sign, mask = 1 << (w - 1), (1 << w) - 1
    return np.where(b & sign, ~b & mask, b | sign)


def _from_keys(keys: np.ndarray, w: int, dtype) -> np.ndarray:
    sign, mask = 1 << (w - 1), (1 << w) - 1
    keys = keys % (1 << w)
    return np.where(keys & sign, keys ^ sign, ~keys & mask).astype(dtype)


def _adam_like(rng: np.random.Generator, name: str, n: int, scale: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``n`` weight-like bits of the case's dtype (its name's prefix: bf16, f16 or f32), then Adam-like step sizes
    in ulps (from one, heavy-tailed, times ``scale``) and directions (+1 or -1), drawn in that order."""
    if name.startswith("bf16"):
        bits = _bf16_weights(rng, n)
    elif name.startswith("f16"):
        bits = (rng.standard_normal(n) * 0.05).astype(np.float16).view(np.uint16)
    else:
        bits = (rng.standard_normal(n) * 0.02).astype(np.float32).view(np.uint32)
    size = np.maximum(1, (rng.pareto(1.5, n) * scale).astype(np.int64))
    return bits, size, np.where(rng.random(n) < 0.5, 1, -1)


def _pctx_cases(add) -> None:
    """Encoding 6 (pctx): two Adam-like steps, the second mostly in the first's direction and of a
    similar size in ulps (from one to hundreds: weights near zero), every element moving; special values
    (NaN payloads, infinities, -0.0, subnormals) changing; BF16, F16 and F32, several chunks. Its own
    generator, as above."""
    rng = np.random.default_rng(20261204)
    for name, w, dtype, n, scale in (("bf16_pctx", 16, np.uint16, 3000, 1), ("f16_pctx", 16, np.uint16, 900, 4),
                                     ("f32_pctx", 32, np.uint32, 1500, 1 << 12)):
        g, size, direction = _adam_like(rng, name, n, scale)
        step1 = direction * size * (rng.random(n) < 0.8)
        flip = np.where(rng.random(n) < 0.15, -1, 1)
        step2 = flip * direction * np.maximum(1, size + rng.integers(-1, 2, n) * (size // 4)) * (rng.random(n) < 0.8)
        kg = _keys_of(g, w)
        old = _from_keys(kg + step1, w, dtype)
        new = _from_keys(_keys_of(old, w) + step2, w, dtype)
        top = (1 << w) - 1
        specials = [0x7FC1, 0xFF80, 0x8000, 0x0001] if w == 16 else [0x7FC00001, 0xFF800000, 0x80000000, 0x00000001]
        new[:4] = specials                     # a NaN payload, -inf, -0.0, the smallest subnormal
        old[4:6] = [top >> 1, 0]               # a NaN (all ones) and +0.0 become ordinary values
        add(name, name.split("_")[0].upper(), old, new, 1024 if w == 16 else 512, {"pctx"}, grand=g)


def _dense_step_cases(add) -> None:
    """Encoding 7 (dense_step), written by the fast path: Adam-like steps of one to thousands of ulps moving
    every element of some chunks and half of another (its unchanged elements are zero steps), one chunk left
    as it was; special values (NaN payloads, infinities, -0.0, subnormals) changing. BF16 and F32. Its own
    generator, as above."""
    rng = np.random.default_rng(20261205)
    for name, w, dtype, n, scale in (("bf16_dense_step", 16, np.uint16, 2000, 1), ("f32_dense_step", 32, np.uint32,
                                                                                    1200, 1 << 10)):
        old = _bf16_weights(rng, n) if w == 16 else (rng.standard_normal(n) * 0.02).astype(np.float32).view(np.uint32)
        size = np.maximum(1, (rng.pareto(1.5, n) * scale).astype(np.int64))
        step = np.where(rng.random(n) < 0.5, 1, -1) * size
        step[n // 2: n // 2 + n // 8] *= rng.random(n // 8) < 0.55     # a chunk about half changed
        step[-(n // 8):] = 0                                            # the last chunk unchanged
        new = _from_keys(_keys_of(old, w) + step, w, dtype)
        top = (1 << w) - 1
        specials = [0x7FC1, 0xFF80, 0x8000, 0x0001] if w == 16 else [0x7FC00001, 0xFF800000, 0x80000000, 0x00000001]
        new[:4] = specials                     # a NaN payload, -inf, -0.0, the smallest subnormal
        old[4:6] = [top >> 1, 0]               # a NaN (all ones) and +0.0 become ordinary values
        new[4:6] = [0x3F80, 0x0001] if w == 16 else [0x3F800000, 0x00000001]
        add(name, name.split("_")[0].upper(), old, new, n // 8, {"dense_step", "unchanged"}, context=False)


def _grouped_step_cases(add) -> None:
    """Encodings 8 (grouped_step) and 9 (grouped_pstep), written by the fast path for float dtypes: dense_step's
    steps (every element of some chunks, half of another, one chunk unchanged, special values changing), coded
    class by class; 9 against a grandparent whose step went up, down or nowhere. BF16, F16 and F32. Its own
    generator, as above."""
    rng = np.random.default_rng(20261207)
    for name, w, dtype, n, scale in (("bf16_grouped", 16, np.uint16, 2000, 1), ("f16_grouped", 16, np.uint16, 800, 4),
                                     ("f32_grouped", 32, np.uint32, 1200, 1 << 10)):
        old, size, direction = _adam_like(rng, name, n, scale)
        step = direction * size
        step[n // 2: n // 2 + n // 8] *= rng.random(n // 8) < 0.55     # a chunk about half changed
        step[-(n // 8):] = 0                                            # the last chunk unchanged
        before = np.where(rng.random(n) < 0.8, direction, -direction) * size * (rng.random(n) < 0.85)
        new = _from_keys(_keys_of(old, w) + step, w, dtype)
        grand = _from_keys(_keys_of(old, w) - before, w, dtype)
        top = (1 << w) - 1
        specials = [0x7FC1, 0xFF80, 0x8000, 0x0001] if w == 16 else [0x7FC00001, 0xFF800000, 0x80000000, 0x00000001]
        new[:4] = specials                     # a NaN payload, -inf, -0.0, the smallest subnormal
        old[4:6] = [top >> 1, 0]               # a NaN (all ones) and +0.0 become ordinary values
        new[4:6] = [0x3F80, 0x0001] if w == 16 else [0x3F800000, 0x00000001]
        grand[6:8] = [top >> 1, 0x8000 if w == 16 else 0x80000000]    # a grandparent NaN and -0.0
        add(f"{name}_step", name.split("_")[0].upper(), old.copy(), new, n // 8, {"grouped_step", "unchanged"},
            context=False)
        add(f"{name}_pstep", name.split("_")[0].upper(), old.copy(), new, n // 8, {"grouped_pstep", "unchanged"},
            grand=grand, context=False)


@contextlib.contextmanager
def _grouped_written(dtype: str | None) -> Iterator[None]:
    """The fast path writes encodings 8 and 9 for 16- and 8-bit floats only, a reader decodes them for every float
    dtype: the F32 grouped cases' records pin that, so their dense chunks are written grouped here too."""
    from ckptdelta.delta.encodings.grouped_step import GROUPED_LAYOUT, WRITTEN

    extra = dtype in GROUPED_LAYOUT and dtype not in WRITTEN
    if extra:
        WRITTEN.add(dtype)
    try:
        yield
    finally:
        if extra:
            WRITTEN.discard(dtype)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--force", action="store_true", help="overwrite existing golden files")
    args = ap.parse_args(argv)
    index = []
    wrote = 0
    idx = HERE / "index.json"
    frozen = {} if args.force or not idx.exists() else {c["name"]: c for c in json.loads(idx.read_text())["cases"]}
    for c in cases():
        if c["name"] in frozen and (HERE / frozen[c["name"]]["record"]).exists():
            index.append(frozen[c["name"]])   # released: never re-encoded (the encoder may choose differently now)
            continue
        shape = list(c["new"].shape)
        new = _tensor(c["new"], c["dtype"]).reshape(shape)
        old = None if c["old"] is None else _tensor(c["old"], c["dtype"]).reshape(shape)
        grand = None if c.get("grand") is None else _tensor(c["grand"], c["dtype"]).reshape(shape)
        with _grouped_written(c["dtype"] if "grouped" in c["name"] else None):
            enc = codec.encode(old, new, name=c["name"], chunk_elems=c["chunk_elems"], grandparent=grand,
                               context=c["context"])
        counts = enc.encoding_counts()
        if not c["must"] <= set(counts):
            raise SystemExit(f"{c['name']}: encoded as {counts}, expected to contain {sorted(c['must'])}")
        files = {"record": f"{c['name']}.ckdt", "expected": f"{c['name']}.expected.npy",
                 "parent": None if c["old"] is None else f"{c['name']}.parent.npy"}
        payloads = {files["record"]: enc.to_bytes(), files["expected"]: c["new"]}
        if c["old"] is not None:
            payloads[files["parent"]] = c["old"]
        if grand is not None:
            files["grandparent"] = f"{c['name']}.grandparent.npy"
            payloads[files["grandparent"]] = c["grand"]
        for fname, data in payloads.items():
            path = HERE / fname
            if path.exists() and not args.force:
                continue
            if isinstance(data, bytes):
                path.write_bytes(data)
            else:
                np.save(path, np.ascontiguousarray(data) if data.ndim else data, allow_pickle=False)
            wrote += 1
        record.parse_header((HERE / files["record"]).read_bytes())
        index.append({"name": c["name"], "dtype": c["dtype"], "shape": shape, "encodings": counts,
                      "record_format_version": record.FORMAT_VERSION, **files})
    if [c["name"] for c in index] != list(frozen) or args.force:
        idx.write_text(json.dumps({"cases": index}, indent=1) + "\n")
        wrote += 1
    print(f"{wrote} files written under {HERE.name}/", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
