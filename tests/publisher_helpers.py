"""Shared helpers of the publisher tests: small models, perturbations, bit comparisons, rebuilds."""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable

import numpy as np
import torch

from ckptdelta.delta import dtypes
from ckptdelta.delta.storage import Store
from ckptdelta.publisher.rebuild import read_chain, rebuild
from ckptdelta.publisher.runs import committed_versions, read_manifest


def weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """A few tensors of the dtypes a policy holds (bf16 mostly), small enough to publish in milliseconds."""
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(64, 32, generator=g).to(torch.bfloat16),
        "layers.0.attn.w": torch.randn(32, 32, generator=g).to(torch.bfloat16),
        "layers.0.mlp.w": torch.randn(32, 96, generator=g).to(torch.bfloat16),
        "layers.0.norm": torch.randn(32, generator=g).to(torch.float32),
        "head.bias": torch.randn(16, generator=g).to(torch.float16),
        "step_count": torch.tensor([7], dtype=torch.int64),
    }


def perturb(w: dict[str, torch.Tensor], seed: int, frac: float = 0.02, names: list[str] | None = None) -> None:
    """Move ``frac`` of the elements of each float tensor by a few ulps, in place (an optimizer step's worth)."""
    rng = np.random.default_rng(seed)
    for name in names or list(w):
        t = w[name]
        if not t.is_floating_point():
            continue
        bits = dtypes.host_bits(t)
        n = max(1, int(frac * bits.size))
        idx = rng.choice(bits.size, size=n, replace=False)
        bits[idx] = (bits[idx].astype(np.int64) + rng.integers(1, 4, size=n)).astype(bits.dtype)


def clone(w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in w.items()}


def same_bits(a: torch.Tensor | np.ndarray, b: torch.Tensor | np.ndarray) -> bool:
    return (dtypes.of(a) == dtypes.of(b) and tuple(a.shape) == tuple(b.shape)
            and np.array_equal(dtypes.host_bits(a), dtypes.host_bits(b)))


def assert_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        assert same_bits(got[k], want[k]), f"tensor {k!r} differs"


def open_store(store_url) -> Store:
    url, opts = store_url
    return Store.from_url(url, opts)


def snapshot(store: Store, version: int) -> dict[str, torch.Tensor]:
    """A committed snapshot rebuilt from the bucket (anchor + deltas), every digest checked."""
    return rebuild(store, read_chain(store, version, read_manifest(store, version, None).run_id))


def versions(store: Store) -> list[int]:
    return committed_versions(store)


def run_ranks(target: Callable[..., None], world: int, args: Callable[[int], tuple], join_s: float) -> list[int | None]:
    """Run ``target(rank, *args(rank))`` in ``world`` spawned processes (torch.distributed ranks) and wait at most
    ``join_s`` seconds for all of them together; fails naming the ranks still running then (a publish that left
    them waiting on a collective), after killing them. Returns the exit codes."""
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=target, args=(r, *args(r))) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + join_s
    for p in procs:
        p.join(max(1.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    assert not hung, f"ranks {hung} still running after {join_s}s: a publish left them waiting on a collective"
    return [p.exitcode for p in procs]
