"""Compile the codec's numba kernels ahead of use: ``python -m delta.warmup`` (make runs it at install).

The kernels are compiled with ``cache=True``, so a fresh checkout compiles them
on first use: the first publish and the first hot-load then take seconds
instead of milliseconds, and a benchmark would report compile time as publish
time. Running every encoding and staging path once, on small tensors of each
dtype, fills numba's on-disk cache; later processes load the machine code.
"""

from __future__ import annotations

import logging
import sys
import time

import torch

log = logging.getLogger("ckptdelta.warmup")

#: Dtypes whose kernels are specialised separately.
DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)


def _pair(dtype: torch.dtype, n: int, frac: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    old = (torch.randn(n, generator=g) * 0.05).to(dtype)
    mask = torch.rand(n, generator=g) < frac
    new = torch.where(mask, (old.float() * (1 + 0.01 * torch.randn(n, generator=g))).to(dtype), old)
    return old, new.contiguous()


def warm_up() -> float:
    """Run encode (both codec modes), the batch paths, stage and apply once per dtype, and the hot-swap commit
    kernels once per element width, each checked bit-exact; returns the seconds it took."""
    from delta import apply_, apply_many, encode, encode_many, stage, stage_full

    t0 = time.perf_counter()
    for i, dtype in enumerate(DTYPES):
        for frac in (0.01, 0.5):  # sparse and dense chunk encodings
            old, new = _pair(dtype, 1 << 15, frac, seed=i)
            outs = []
            for context in (True, False):
                blob = encode(old, new, name="warmup", context=context).to_bytes()
                live = old.clone()
                stage(live, blob).apply_(live)
                outs.append(live)
                live = old.clone()
                apply_(live, blob)
                outs.append(live)
            recs = [e.to_bytes() for e in encode_many([("a", old, new), ("b", old, new)])]
            lives = [old.clone(), old.clone()]
            apply_many(zip(lives, recs))
            outs += lives
            live = old.clone()
            stage_full(live, new, name="warmup").apply_(live)
            outs.append(live)
            live = torch.zeros_like(new)
            apply_(live, encode(None, new, name="warmup").to_bytes())
            outs.append(live)
            want = new.view(torch.uint8)
            if not all(torch.equal(o.view(torch.uint8), want) for o in outs):
                raise AssertionError(f"warm-up round trip of {dtype} is not bit-exact")
    _warm_commit()
    return time.perf_counter() - t0


def _warm_commit() -> None:
    """The hot-swap commit kernels (both ways, undo) for every element width, and the int32-position scatter
    of Publisher(device_diff=True), each checked bit-exact."""
    import numpy as np
    from numba import typed

    from . import kernels

    rng = np.random.default_rng(0)
    for width in (1, 2, 4, 8):
        dt = np.dtype(f"<u{width}")
        old = rng.integers(0, np.iinfo(dt).max, 3 << 14, dtype=dt)
        pos = np.flatnonzero(rng.random(old.shape[0]) < 0.05).astype(np.int64)
        new = old.copy()
        new[pos] ^= dt.type(1)
        block = kernels.HASH_BLOCK_BYTES // width
        hashes = np.empty(-(-old.shape[0] // block), np.uint64)
        kernels.block_hashes(old, block, hashes)
        kernels.count_lines(pos, 5)
        m = pos.shape[0]
        tasks = np.array([[0, kernels.MODE_SCATTER, 0, m, 0, 0, 0],
                          [1, kernels.MODE_COPY, 0, m, 0, hashes.shape[0], 0]], np.int64)
        lives = typed.List([old.copy(), old.copy()])
        done, _kind, _where = kernels.commit_tasks(lives, typed.List([new, new]), pos, old[pos], new[pos], hashes,
                                                   tasks, 0, 2, block, np.zeros(1, np.int64))
        ok = done == 2 and all(np.array_equal(x, new) for x in lives)
        kernels.undo_tasks(lives, pos, old[pos], tasks, 0, 2)
        live = old.copy()
        kernels.scatter(live, pos.astype(np.int32), new[pos])
        if not (ok and all(np.array_equal(x, old) for x in lives) and np.array_equal(live, new)):
            raise AssertionError(f"warm-up of the commit kernels ({width}-byte elements) is not bit-exact")


def main() -> int:
    print("compiling codec kernels (numba caches them: seconds the first time on a checkout)...",
          file=sys.stderr, flush=True)
    s = warm_up()
    print(f"codec kernels ready ({s:.1f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
