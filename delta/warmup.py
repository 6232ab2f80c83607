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
    """Run encode (both codec modes), the batch paths, stage and apply once per dtype, each checked bit-exact;
    returns the seconds it took."""
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
    return time.perf_counter() - t0


def main() -> int:
    print("compiling codec kernels (numba caches them: seconds the first time on a checkout)...",
          file=sys.stderr, flush=True)
    s = warm_up()
    print(f"codec kernels ready ({s:.1f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
