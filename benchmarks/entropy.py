"""How small a delta can be when the parent's bits are the context: the bar for encoding 4 (ctx).

:func:`conditional_entropy` classifies every element by its parent's exponent field
(the context delta/ctxcoder.py uses; integers form one class) and measures, per
changed element,

* ``pos_bits``: the positions given the class, ``sum_c n_c * H(k_c / n_c) / K`` (each
  class's elements change independently with their class's empirical rate);
* ``step_bits``: the ordered-key step (the zigzag ``z`` of docs/FORMAT.md) given the
  class, the empirical entropy ``H(z | class)``;

and ``ratio_limit`` = dense bytes / ((pos_bits + step_bits) * K / 8). Classes are
pooled per dtype over the whole model (``per="dtype"``, the default, like
:func:`benchmarks.baselines.change_entropy`'s order-0 figures) or kept per tensor
(``per="tensor"``: tables per tensor, as a coder with per-chunk tables can use them).

These are empirical entropies of a fixed context model, not a bound for every coder:
a model with more context can go lower, and for steps of wide dtypes with few changes
per class (fp32) the empirical value is capped near log2 of the class's change count.

    python -m benchmarks.entropy [size] [lr] [window] [dtype]
"""

from __future__ import annotations

import sys
from collections import defaultdict

import numpy as np
import torch

from benchmarks import baselines

# (mantissa bits, exponent bits) of the sign-magnitude floats; other dtypes form one class
FLOAT_FIELDS = {
    torch.bfloat16: (7, 8), torch.float16: (10, 5), torch.float32: (23, 8), torch.float64: (52, 11),
    torch.float8_e4m3fn: (3, 4), torch.float8_e5m2: (2, 5),
}


def _nlogn(x: np.ndarray) -> float:
    x = x[x > 0].astype(np.float64)
    return float((x * np.log2(x)).sum())


def _binary_bits(n: np.ndarray, k: np.ndarray) -> float:
    """sum over classes of n * H(k / n), in bits."""
    return _nlogn(n) - _nlogn(k) - _nlogn(n - k)


def _conditional_bits(cls: np.ndarray, z: np.ndarray) -> float:
    """K * H(z | cls), in bits, from the joint empirical counts."""
    if cls.size == 0:
        return 0.0
    order = np.lexsort((z, cls))
    c, v = cls[order], z[order]
    new_pair = np.ones(c.size, bool)
    new_pair[1:] = (c[1:] != c[:-1]) | (v[1:] != v[:-1])
    pair_counts = np.diff(np.append(np.flatnonzero(new_pair), c.size))
    class_counts = np.bincount(c.astype(np.int64))
    return _nlogn(class_counts) - _nlogn(pair_counts)


def _zigzag(old_bits: np.ndarray, new_bits: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    w = 8 * old_bits.dtype.itemsize
    d = baselines.signed_step(old_bits, new_bits, dtype)       # int64, wraps for w = 64
    if w == 64:
        u = d.view(np.uint64)
        return np.where(d >= 0, u << np.uint64(1), ((~u) << np.uint64(1)) | np.uint64(1))
    return np.where(d >= 0, 2 * d, -2 * d - 1).astype(np.uint64)


def _classes(bits: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    if dtype not in FLOAT_FIELDS:
        return np.zeros(bits.shape, np.int64)
    m, e = FLOAT_FIELDS[dtype]
    return ((bits >> m) & ((1 << e) - 1)).astype(np.int64)


def conditional_entropy(old: dict, new: dict, *, per: str = "dtype") -> dict:
    """Bits per changed element of positions and steps given the parent's exponent class.

    ``old``/``new``: state dicts of the same names, shapes and dtypes. Returns
    ``n_elements``, ``n_changed``, ``pos_bits``, ``step_bits``, ``total_bytes``,
    ``dense_bytes``, ``ratio_limit`` and ``by_dtype`` (the same per dtype)."""
    if per not in ("dtype", "tensor"):
        raise ValueError(f"per must be 'dtype' or 'tensor', not {per!r}")
    if set(old) != set(new):
        raise ValueError("old and new hold different tensor names")
    pooled: dict = defaultdict(lambda: {"n": [], "k": [], "cls": [], "z": [], "elems": 0})
    by_dtype: dict = defaultdict(lambda: {"n_elements": 0, "n_changed": 0, "pos": 0.0, "step": 0.0})
    for name in sorted(new):
        o, nw = old[name], new[name]
        if o.shape != nw.shape or o.dtype != nw.dtype:
            raise ValueError(f"{name}: {o.dtype}{list(o.shape)} vs {nw.dtype}{list(nw.shape)}")
        ob, nb = baselines.to_bits(o), baselines.to_bits(nw)
        cls = _classes(ob, o.dtype)
        changed = ob != nb
        ncls = np.bincount(cls)
        kcls = np.bincount(cls[changed], minlength=ncls.size)
        z = _zigzag(ob[changed], nb[changed], o.dtype)
        key = str(o.dtype).replace("torch.", "")
        d = by_dtype[key]
        d["n_elements"] += ob.size
        d["n_changed"] += int(changed.sum())
        if per == "tensor":
            d["pos"] += _binary_bits(ncls, kcls)
            d["step"] += _conditional_bits(cls[changed], z)
        else:
            p = pooled[key]
            p["n"].append(ncls)
            p["k"].append(kcls)
            p["cls"].append(cls[changed])
            p["z"].append(z)
    for key, p in pooled.items():
        size = max(x.size for x in p["n"])
        n = sum(np.pad(x, (0, size - x.size)) for x in p["n"])
        k = sum(np.pad(x, (0, size - x.size)) for x in p["k"])
        by_dtype[key]["pos"] = _binary_bits(n, k)
        by_dtype[key]["step"] = _conditional_bits(np.concatenate(p["cls"]), np.concatenate(p["z"]))
    out_by = {}
    for key, d in by_dtype.items():
        c = d["n_changed"]
        out_by[key] = {"n_elements": d["n_elements"], "n_changed": c,
                       "pos_bits": d["pos"] / c if c else 0.0, "step_bits": d["step"] / c if c else 0.0}
    K = sum(d["n_changed"] for d in by_dtype.values())
    pos = sum(d["pos"] for d in by_dtype.values())
    step = sum(d["step"] for d in by_dtype.values())
    total = (pos + step) / 8
    dense = baselines.dense_nbytes(new)
    return {"n_elements": sum(d["n_elements"] for d in by_dtype.values()), "n_changed": K,
            "pos_bits": pos / K if K else 0.0, "step_bits": step / K if K else 0.0,
            "total_bytes": total, "dense_bytes": dense,
            "ratio_limit": dense / total if total else float("inf"), "per": per, "by_dtype": out_by}


def main(argv: list[str] | None = None) -> int:
    from benchmarks import workloads
    a = (argv if argv is not None else sys.argv[1:]) + [None] * 4
    size, lr, window, dtype = a[0] or "small", float(a[1] or 1e-6), int(a[2] or 1), a[3] or "bf16"
    w = workloads.pair(size, lr, window, dtype)
    o0 = baselines.change_entropy(w.old, w.new)
    print(f"{w.name} ({size}): order-0 positions {min(o0['pos_bits_gap'], o0['pos_bits_iid']):.3f} bits, "
          f"steps {o0['val_bits_step']:.3f} bits, limit ~{o0['ratio_limit']:.1f}x")
    for per in ("dtype", "tensor"):
        e = conditional_entropy(w.old, w.new, per=per)
        print(f"  exponent context (tables per {per}): positions {e['pos_bits']:.3f} bits, "
              f"steps {e['step_bits']:.3f} bits, limit ~{e['ratio_limit']:.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
