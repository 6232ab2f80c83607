"""Which tensors hold a NaN, at memory speed.

The publisher warns once per tensor name when published weights hold NaNs (they
are published as-is, bit-exact). ``torch.isnan(t).any()`` is slow on bf16 on a
CPU, far slower than reading the bytes, which would add a lot to each publish of a
large model; this numba scan over the raw bits (a vectorized max per 64K-element
block, stopping at the first block with a NaN) runs near memory speed, but is still
a pass over every byte. So a delta's tensors
are not scanned: a NaN can only appear where bits changed, and the encoder, which
visits every changed element anyway, reports whether one of them became a NaN
(``EncodedTensor.changed_nan``). The scan runs where nothing is known of the parent:
anchors, and the first delta after the publisher (re)starts on a parent it did not check.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import numpy as np
import torch
from numba import njit

from ckptdelta.delta import dtypes


@njit(cache=True, nogil=True)
def _any_above(bits, mask, threshold):
    """Whether any ``bits & mask`` exceeds ``threshold``; a max per block vectorizes, the exit is per block."""
    n = bits.shape[0]
    block = 1 << 16
    for start in range(0, n, block):
        top = bits.dtype.type(0)
        for i in range(start, min(n, start + block)):
            top = max(top, bits[i] & mask)
        if top > threshold:
            return True
    return False


def has_nan(t: torch.Tensor | np.ndarray) -> bool:
    dt = dtypes.of(t)
    rule = dtypes.nan_rule(dt)
    if rule is None:
        return False
    bits = dtypes.host_bits(t)
    if bits.size == 0:
        return False
    mask, threshold = (bits.dtype.type(v) for v in rule)
    return bool(_any_above(bits, mask, threshold))


def nan_tensor_names(tensors: Mapping[str, torch.Tensor], names: Collection[str], already: set[str]) -> list[str]:
    """Tensors among ``names`` holding a NaN, skipping names already reported."""
    return [n for n in names if n not in already and has_nan(tensors[n])]
