"""The proof, computed the same way on both sides of vLLM's process boundary: what a GEMM kernel can
show of a weight (kernel_view) and the xxh3 of each tensor's bytes (digests). A worker reports digests of
what it reads back; the replica compares them with the host copy's, which it verified against the manifest.
"""

from __future__ import annotations

import sys

import torch



def kernel_view(t: torch.Tensor) -> torch.Tensor:
    """What a GEMM kernel can show of a weight matrix: the bits, except what no identity product tells apart.

    -0.0 and subnormals become +0.0 (a product with them is a zero the kernel
    cannot sign, and bf16 dot-product units flush subnormals), and a row holding a
    NaN or an Inf becomes all NaN (its zeros times the NaN poison the row).
    Applied to both the live read-back and the expected tensor, equality then
    means the kernel computes with the published values."""
    if not t.is_floating_point() or t.dim() != 2:
        return t
    x = t.detach().to("cpu").clone()
    tiny = torch.finfo(x.dtype).tiny
    x[x.abs() < tiny] = 0.0          # -0.0 and subnormals become +0.0 (NaN compares False: left alone)
    rows = (~torch.isfinite(x)).any(dim=1)
    if bool(rows.any()):
        x[rows] = float("nan")
    return x


def digests(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """xxh3-64 (16 hex digits) of each tensor's bytes in C order, little-endian.

    The same string as a manifest's per-tensor ``xxh3`` field
    (``ckptdelta.delta.codec.digest_hex(ckptdelta.delta.codec.digest(t))``)."""
    import xxhash

    out = {}
    for n, t in tensors.items():
        flat = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
        if sys.byteorder != "little" and t.element_size() > 1:
            flat = flat.reshape(-1, t.element_size())[:, ::-1].copy()
        out[n] = xxhash.xxh3_64_hexdigest(flat)
    return out
