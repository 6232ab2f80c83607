"""The dtypes a checkpoint holds, and how each maps to raw bits.

The codec never does float arithmetic on weights: every element is handled as an
unsigned integer of the dtype's width, so equality is equality of bits (NaN
payloads, -0.0, subnormals). Float dtypes are sign-magnitude, so "one ulp up"
is not "+1" on the raw bits; :func:`is_sign_magnitude` tells the kernels when to
map bits to the ordered-integer key space first.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ckptdelta.delta.errors import UnsupportedDtypeError


@dataclass(frozen=True)
class DType:
    name: str            # safetensors spelling, also used in manifests and records
    code: int            # one byte in binary records (docs/FORMAT.md)
    torch_dtype: torch.dtype
    itemsize: int
    sign_magnitude: bool  # True for IEEE-style floats: map to ordered keys before differencing

    @property
    def bits_dtype(self) -> np.dtype:
        return _BITS_DTYPE[self.itemsize]


#: Unsigned integers of each width (built once: np.dtype("<u2") parses its string on every call).
_BITS_DTYPE = {w: np.dtype(f"<u{w}") for w in (1, 2, 4, 8)}


_TABLE = [
    DType("BOOL", 1, torch.bool, 1, False),
    DType("U8", 2, torch.uint8, 1, False),
    DType("I8", 3, torch.int8, 1, False),
    DType("I16", 4, torch.int16, 2, False),
    DType("I32", 5, torch.int32, 4, False),
    DType("I64", 6, torch.int64, 8, False),
    DType("F16", 7, torch.float16, 2, True),
    DType("BF16", 8, torch.bfloat16, 2, True),
    DType("F32", 9, torch.float32, 4, True),
    DType("F64", 10, torch.float64, 8, True),
    DType("F8_E4M3", 11, torch.float8_e4m3fn, 1, True),
    DType("F8_E5M2", 12, torch.float8_e5m2, 1, True),
]
for _name, _code, _attr, _w in (("U16", 13, "uint16", 2), ("U32", 14, "uint32", 4), ("U64", 15, "uint64", 8)):
    if hasattr(torch, _attr):  # unsigned wide ints exist from torch 2.3
        _TABLE.append(DType(_name, _code, getattr(torch, _attr), _w, False))

BY_NAME: dict[str, DType] = {d.name: d for d in _TABLE}
BY_CODE: dict[int, DType] = {d.code: d for d in _TABLE}
BY_TORCH: dict[torch.dtype, DType] = {d.torch_dtype: d for d in _TABLE}
_BY_NUMPY: dict[np.dtype, DType] = {
    np.dtype(np.bool_): BY_NAME["BOOL"],
    np.dtype(np.uint8): BY_NAME["U8"],
    np.dtype(np.int8): BY_NAME["I8"],
    np.dtype(np.int16): BY_NAME["I16"],
    np.dtype(np.int32): BY_NAME["I32"],
    np.dtype(np.int64): BY_NAME["I64"],
    np.dtype(np.float16): BY_NAME["F16"],
    np.dtype(np.float32): BY_NAME["F32"],
    np.dtype(np.float64): BY_NAME["F64"],
}
for _n, _u in (("U16", np.uint16), ("U32", np.uint32), ("U64", np.uint64)):
    if _n in BY_NAME:
        _BY_NUMPY[np.dtype(_u)] = BY_NAME[_n]
_UINT_FOR_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

#: dtype name -> (mask without the sign bit, largest non-NaN magnitude bits): a value is NaN when its
#: bits without the sign exceed the dtype's infinity (for float8 e4m3fn, which has none, its largest finite).
_NAN_ABOVE = {
    "BF16": (0x7FFF, 0x7F80),
    "F16": (0x7FFF, 0x7C00),
    "F32": (0x7FFFFFFF, 0x7F800000),
    "F64": (0x7FFFFFFFFFFFFFFF, 0x7FF0000000000000),
    "F8_E4M3": (0x7F, 0x7E),
    "F8_E5M2": (0x7F, 0x7C),
}


def nan_rule(dt: DType) -> tuple[int, int] | None:
    """``(mask, threshold)``: bits ``b`` of ``dt`` are a NaN when ``b & mask > threshold``; None when
    the dtype has no NaN (integers, bool)."""
    return _NAN_ABOVE.get(dt.name)


def by_name(name: str) -> DType:
    try:
        return BY_NAME[name]
    except KeyError:
        raise UnsupportedDtypeError(f"unknown dtype {name!r}; known: {sorted(BY_NAME)}") from None


def by_code(code: int) -> DType:
    try:
        return BY_CODE[code]
    except KeyError:
        raise UnsupportedDtypeError(f"unknown dtype code {code}") from None


def of(x: "torch.Tensor | np.ndarray") -> DType:
    """The DType of a torch tensor or numpy array."""
    if isinstance(x, torch.Tensor):
        try:
            return BY_TORCH[x.dtype]
        except KeyError:
            raise UnsupportedDtypeError(f"torch dtype {x.dtype} is not supported") from None
    try:
        return _BY_NUMPY[np.dtype(x.dtype)]
    except KeyError:
        raise UnsupportedDtypeError(f"numpy dtype {x.dtype} is not supported") from None


def host_bits(x: "torch.Tensor | np.ndarray") -> np.ndarray:
    """A flat, C-contiguous host view of ``x`` as unsigned integers of its width.

    Shares memory with ``x`` when it is already a contiguous host array (so the
    result may be written to apply a delta in place); copies otherwise (device
    tensors, non-contiguous views), which encodes by logical content.
    """
    dt = of(x)
    if isinstance(x, torch.Tensor):
        if x.device.type == "cpu" and not x.requires_grad and x.is_contiguous():
            # Two torch calls, not five: each releases and retakes the GIL, which costs tens of microseconds
            # per tensor while codec threads hold it between kernels (a batch apply's caller does this per tensor).
            return x.view(_UINT_FOR_WIDTH[dt.itemsize]).numpy().reshape(-1).view(dt.bits_dtype)
        t = x.detach()
        if t.device.type != "cpu":
            t = t.to("cpu")
        t = t.contiguous().reshape(-1)
        arr = t.view(_UINT_FOR_WIDTH[dt.itemsize]).numpy()
    else:
        arr = np.ascontiguousarray(x).reshape(-1)
    return arr.view(dt.bits_dtype)


def torch_bits_view(t: torch.Tensor) -> torch.Tensor:
    """A flat integer view of a contiguous tensor, on its own device, for in-place scatter."""
    dt = of(t)
    return t.view(-1).view(_UINT_FOR_WIDTH[dt.itemsize])


def from_bits(bits: np.ndarray, dtype: DType, shape: tuple[int, ...]) -> torch.Tensor:
    """A CPU torch tensor of ``dtype`` and ``shape`` sharing memory with ``bits``."""
    t = torch.from_numpy(np.ascontiguousarray(bits).view(np.dtype(f"<i{dtype.itemsize}") if dtype.itemsize > 1 else np.uint8))
    return t.view(dtype.torch_dtype).reshape(shape)
