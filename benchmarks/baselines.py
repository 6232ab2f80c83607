"""What people ship today, as baselines for benchmarks/codec.py, and the entropy bound.

Each baseline is a small class with

* ``name``: a short label for tables;
* ``encode(old, new) -> list[bytes]``: the blobs that would be uploaded (their total
  length is the transfer size; see :func:`encoded_nbytes`);
* ``decode(old, blobs) -> dict``: the new snapshot rebuilt from ``old`` and the blobs,
  bit for bit (new tensors; ``old`` is not modified);
* ``supports(sd) -> bool``: False where the tool cannot take a dtype of ``sd``; encode
  then raises :class:`Unsupported` and a benchmark reports n/a.

Per-tensor baselines emit one blob per tensor in ``sorted(new)`` order and take names,
shapes and dtypes from ``old`` when decoding (both snapshots have the same structure;
a structure change raises ``ValueError``). Everything works on raw bits (unsigned
integer views), never on float values, so NaN payloads, -0.0 and subnormals survive.

Baselines:

* :class:`FullSafetensors`: the new snapshot as one safetensors file (the "just
  upload the checkpoint" default).
* :class:`ZstdFull`: that file through zstd level 3.
* :class:`XorZstd`: old ^ new on raw bits, zstd level 3 per tensor (slime / Cognition /
  Fireworks, the Megatron-LM RL note).
* :class:`SparseIndexZstd`: positions of changed elements as gaps, in the smallest
  unsigned type that holds the largest gap, plus the new raw values, zstd level 3 per
  tensor (PULSE; TRL's delta sync with a better index type).
* :class:`ZipNNDelta`: ZipNN's delta mode (XOR, byte grouping, Huffman/zstd), one
  call per dtype over that dtype's tensors concatenated.

:func:`change_entropy` gives what an order-0 coder could reach on a pair, to judge a
codec against.
"""

from __future__ import annotations

import math
import struct
from collections import defaultdict

import numpy as np
import torch
import zstandard

__all__ = [
    "Unsupported",
    "Baseline",
    "FullSafetensors",
    "ZstdFull",
    "XorZstd",
    "SparseIndexZstd",
    "ZipNNDelta",
    "all_baselines",
    "encoded_nbytes",
    "change_entropy",
    "to_bits",
    "from_bits",
    "ordered_key",
    "signed_step",
]

ZSTD_LEVEL = 3

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_UINT_NP = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_SIGN_MAGNITUDE = {torch.float16, torch.bfloat16, torch.float32, torch.float64,
                   torch.float8_e4m3fn, torch.float8_e5m2}
_SIGNED_INT = {torch.int8, torch.int16, torch.int32, torch.int64}


class Unsupported(Exception):
    """This baseline cannot take a dtype in the snapshot (report n/a)."""


# --------------------------------------------------------------------------- bits

def to_bits(t: torch.Tensor) -> np.ndarray:
    """Flat unsigned-integer numpy view of a CPU tensor's bits (shares memory when contiguous)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    w = t.element_size()
    return t.view(_INT_VIEW[w]).numpy().view(_UINT_NP[w])


def from_bits(bits: np.ndarray, dtype: torch.dtype, shape) -> torch.Tensor:
    """A CPU tensor of ``dtype``/``shape`` over ``bits`` (copied to a fresh, writable array)."""
    w = torch.empty((), dtype=dtype).element_size()
    arr = np.array(bits, dtype=_UINT_NP[w], copy=True)
    t = torch.from_numpy(arr.view(np.uint8) if w == 1 else arr.view(f"<i{w}"))
    return t.view(dtype).reshape(tuple(shape))


def _check_structure(old: dict, new: dict) -> list[str]:
    names = sorted(new)
    if sorted(old) != names:
        raise ValueError(f"old and new hold different tensors: only in old {sorted(set(old) - set(new))[:5]}, "
                         f"only in new {sorted(set(new) - set(old))[:5]}")
    for n in names:
        if old[n].dtype != new[n].dtype or tuple(old[n].shape) != tuple(new[n].shape):
            raise ValueError(f"tensor {n!r}: old {old[n].dtype}{tuple(old[n].shape)} "
                             f"vs new {new[n].dtype}{tuple(new[n].shape)}")
    return names


def encoded_nbytes(blobs) -> int:
    if isinstance(blobs, (bytes, bytearray, memoryview)):
        return len(blobs)
    return sum(len(b) for b in blobs)


def dense_nbytes(sd: dict) -> int:
    return sum(t.numel() * t.element_size() for t in sd.values())


# --------------------------------------------------------------------------- baselines

class Baseline:
    name = "baseline"

    def supports(self, sd: dict) -> bool:
        return True

    def know_parent(self, old: dict) -> None:
        """Untimed, once per workload: what a trainer already holds about the parent before it encodes
        (nothing, for most codecs)."""

    def encode(self, old: dict, new: dict) -> list[bytes]:
        raise NotImplementedError

    def decode(self, old: dict, blobs: list[bytes]) -> dict:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


class FullSafetensors(Baseline):
    """(a) The whole new snapshot as a safetensors file."""

    name = "safetensors"

    def encode(self, old, new):
        from safetensors.torch import save
        return [save({k: v.contiguous() for k, v in new.items()})]

    def decode(self, old, blobs):
        from safetensors.torch import load
        return load(bytes(blobs[0]))


class ZstdFull(Baseline):
    """(b) zstd (level 3) of the whole new snapshot's safetensors bytes."""

    def __init__(self, level: int = ZSTD_LEVEL, threads: int = 0):
        self.level, self.threads = level, threads
        self.name = f"zstd{level}-full"

    def encode(self, old, new):
        from safetensors.torch import save
        raw = save({k: v.contiguous() for k, v in new.items()})
        return [zstandard.ZstdCompressor(level=self.level, threads=self.threads).compress(raw)]

    def decode(self, old, blobs):
        from safetensors.torch import load
        return load(zstandard.ZstdDecompressor().decompress(blobs[0]))


class XorZstd(Baseline):
    """(c) old ^ new on raw bits, zstd (level 3) per tensor."""

    def __init__(self, level: int = ZSTD_LEVEL):
        self.level = level
        self.name = f"xor+zstd{level}"

    def encode(self, old, new):
        cz = zstandard.ZstdCompressor(level=self.level)
        return [cz.compress(np.bitwise_xor(to_bits(old[n]), to_bits(new[n])).tobytes())
                for n in _check_structure(old, new)]

    def decode(self, old, blobs):
        dz = zstandard.ZstdDecompressor()
        names = sorted(old)
        if len(blobs) != len(names):
            raise ValueError(f"{len(blobs)} blobs for {len(names)} tensors")
        out = {}
        for n, b in zip(names, blobs):
            ob = to_bits(old[n])
            x = np.frombuffer(dz.decompress(b, max_output_size=ob.nbytes), dtype=ob.dtype)
            if x.size != ob.size:
                raise ValueError(f"tensor {n!r}: XOR stream has {x.size} elements, expected {ob.size}")
            out[n] = from_bits(np.bitwise_xor(ob, x), old[n].dtype, old[n].shape)
        return out


def _gap_dtype(max_gap: int):
    for dt in (np.uint8, np.uint16, np.uint32, np.uint64):
        if max_gap <= np.iinfo(dt).max:
            return np.dtype(dt)
    raise OverflowError(max_gap)


class SparseIndexZstd(Baseline):
    """(d) changed positions as gaps in the smallest unsigned type, plus new raw values; zstd per tensor.

    Per tensor: ``<count u64><gap itemsize u8>`` then ``count`` gaps then ``count`` values,
    the whole record compressed with zstd. Gap ``i`` is ``idx[i] - idx[i-1]`` with
    ``idx[-1] = -1``, so every gap is >= 1 and ``idx = cumsum(gaps) - 1``.
    """

    def __init__(self, level: int = ZSTD_LEVEL):
        self.level = level
        self.name = f"sparse-idx+zstd{level}"

    def encode(self, old, new):
        cz = zstandard.ZstdCompressor(level=self.level)
        blobs = []
        for n in _check_structure(old, new):
            ob, nb = to_bits(old[n]), to_bits(new[n])
            idx = np.flatnonzero(ob != nb)
            gaps = np.diff(idx, prepend=-1)
            gdt = _gap_dtype(int(gaps.max()) if gaps.size else 0)
            rec = b"".join((struct.pack("<QB", idx.size, gdt.itemsize), gaps.astype(gdt).tobytes(),
                            nb[idx].tobytes()))
            blobs.append(cz.compress(rec))
        return blobs

    def decode(self, old, blobs):
        dz = zstandard.ZstdDecompressor()
        names = sorted(old)
        if len(blobs) != len(names):
            raise ValueError(f"{len(blobs)} blobs for {len(names)} tensors")
        out = {}
        for n, b in zip(names, blobs):
            ob = to_bits(old[n])
            rec = dz.decompress(b, max_output_size=9 + ob.size * (8 + ob.itemsize))
            count, gw = struct.unpack_from("<QB", rec)
            gdt = np.dtype(_UINT_NP[gw])
            gaps = np.frombuffer(rec, dtype=gdt, count=count, offset=9)
            vals = np.frombuffer(rec, dtype=ob.dtype, count=count, offset=9 + count * gw)
            idx = np.cumsum(gaps, dtype=np.int64) - 1
            if count and (idx[-1] >= ob.size or idx[0] < 0):
                raise ValueError(f"tensor {n!r}: index {int(idx[-1])} out of range {ob.size}")
            nb = ob.copy()
            nb[idx] = vals
            out[n] = from_bits(nb, old[n].dtype, old[n].shape)
        return out


_ZIPNN_DTYPE = {
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
    torch.float32: "float32",
    torch.float8_e4m3fn: "float8_e4m3fn",
    torch.float8_e5m2: "float8_e5m2",
}


class ZipNNDelta(Baseline):
    """(e) ZipNN delta mode (XOR then byte-grouped compression), one call per dtype.

    The tensors of each dtype (``sorted`` name order) are concatenated and passed as
    ``ZipNN(input_format="byte", bytearray_dtype=..., delta_compressed_type="byte")
    .compress(new_bytes, delta_second_data=old_bytes)``. ZipNN rewrites its input
    buffers in place, so it only ever gets copies. Blobs: one per dtype, in the order
    of first appearance among the sorted names. dtypes ZipNN has no float mode for
    (integers, bool, float64) are :class:`Unsupported`.
    """

    name = "zipnn-delta"

    def __init__(self, threads: int = 1):
        self.threads = threads

    def supports(self, sd):
        return all(t.dtype in _ZIPNN_DTYPE for t in sd.values())

    def _zipnn(self, dtype):
        from zipnn import ZipNN
        return ZipNN(input_format="byte", bytearray_dtype=_ZIPNN_DTYPE[dtype],
                     delta_compressed_type="byte", threads=self.threads)

    @staticmethod
    def _groups(sd, names):
        groups: dict[torch.dtype, list[str]] = {}
        for n in names:
            groups.setdefault(sd[n].dtype, []).append(n)
        return groups

    def encode(self, old, new):
        names = _check_structure(old, new)
        if not self.supports(new):
            bad = sorted({str(t.dtype) for t in new.values() if t.dtype not in _ZIPNN_DTYPE})
            raise Unsupported(f"zipnn has no delta mode for {bad}")
        blobs = []
        for dt, ns in self._groups(new, names).items():
            nbuf = bytearray(b"".join(to_bits(new[n]).tobytes() for n in ns))
            obuf = bytearray(b"".join(to_bits(old[n]).tobytes() for n in ns))
            blobs.append(bytes(self._zipnn(dt).compress(nbuf, delta_second_data=obuf)))
        return blobs

    def decode(self, old, blobs):
        names = sorted(old)
        groups = self._groups(old, names)
        if len(blobs) != len(groups):
            raise ValueError(f"{len(blobs)} blobs for {len(groups)} dtype groups")
        out = {}
        for (dt, ns), blob in zip(groups.items(), blobs):
            obuf = bytearray(b"".join(to_bits(old[n]).tobytes() for n in ns))
            raw = self._zipnn(dt).decompress(bytes(blob), delta_second_data=obuf)
            if len(raw) != len(obuf):
                raise ValueError(f"zipnn returned {len(raw)} bytes for {dt}, expected {len(obuf)}")
            pos = 0
            for n in ns:
                nbytes = old[n].numel() * old[n].element_size()
                bits = np.frombuffer(raw, dtype=_UINT_NP[old[n].element_size()],
                                     count=old[n].numel(), offset=pos)
                out[n] = from_bits(bits, dt, old[n].shape)
                pos += nbytes
        return out


def all_baselines(threads: int = 1) -> list[Baseline]:
    """The standard set, in table order."""
    return [FullSafetensors(), ZstdFull(), XorZstd(), SparseIndexZstd(), ZipNNDelta(threads=threads)]


# --------------------------------------------------------------------------- entropy

def ordered_key(bits: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """Map raw bits to keys whose unsigned order is the numeric order (same width).

    Sign-magnitude floats: ``b | sign`` if the sign bit is clear, ``~b & mask`` if set
    (so -0.0 and +0.0 are adjacent keys and one ulp up is +1 away from zero outwards).
    Two's-complement ints: ``b ^ sign``. Unsigned ints and bool: ``b``.
    """
    w = bits.dtype.itemsize * 8
    sign = np.array(1 << (w - 1), dtype=bits.dtype)
    if dtype in _SIGN_MAGNITUDE:
        neg = (bits & sign) != 0
        return np.where(neg, ~bits, bits | sign)
    if dtype in _SIGNED_INT:
        return bits ^ sign
    return bits.copy()


def signed_step(old_bits: np.ndarray, new_bits: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    """``key(new) - key(old) mod 2**w`` as a signed int64 (int64 wrap for w = 64)."""
    ko, kn = ordered_key(old_bits, dtype), ordered_key(new_bits, dtype)
    w = old_bits.dtype.itemsize * 8
    d = (kn - ko).astype(old_bits.dtype)  # wraps mod 2**w
    if w == 64:
        return d.view(np.int64)
    return d.view(np.dtype(f"<i{w // 8}")).astype(np.int64)


def _entropy_bits(x: np.ndarray) -> float:
    """Empirical order-0 entropy of the values in ``x``, bits per element."""
    if x.size == 0:
        return 0.0
    if x.dtype.itemsize <= 2 and x.dtype.kind == "u":
        counts = np.bincount(x.astype(np.int64))
        counts = counts[counts > 0]
    else:
        counts = np.unique(x, return_counts=True)[1]
    p = counts / x.size
    return float(-(p * np.log2(p)).sum())


def _h2(p: float) -> float:
    if p <= 0.0 or p >= 1.0:
        return 0.0
    return -(p * math.log2(p) + (1 - p) * math.log2(1 - p))


def _stats(n: int, gaps: list, vals: list, steps: list) -> dict:
    g = np.concatenate(gaps) if gaps else np.zeros(0, np.int64)
    v = np.concatenate(vals) if vals else np.zeros(0, np.uint8)
    s = np.concatenate(steps) if steps else np.zeros(0, np.int64)
    c = int(g.size)
    p = c / n if n else 0.0
    pos_gap, pos_iid = _entropy_bits(g), (_h2(p) / p if c else 0.0)
    val_new, val_step = _entropy_bits(v), _entropy_bits(s)
    return {
        "n_elements": n,
        "n_changed": c,
        "frac_changed": p,
        "pos_bits_gap": pos_gap,        # bits per changed element, entropy of the gap distribution
        "pos_bits_iid": pos_iid,        # bits per changed element, H(p)/p (positions iid)
        "val_bits_new": val_new,        # bits per changed element, entropy of the new raw value
        "val_bits_step": val_step,      # bits per changed element, entropy of the signed ordered-key step
        "bytes_pos_gap": c * pos_gap / 8,
        "bytes_pos_iid": c * pos_iid / 8,
        "bytes_val_new": c * val_new / 8,
        "bytes_val_step": c * val_step / 8,
        "total_bytes": c * (min(pos_gap, pos_iid) + min(val_new, val_step)) / 8,
    }


def change_entropy(old: dict, new: dict) -> dict:
    """How small a delta of ``old`` -> ``new`` can be under simple (order-0) models.

    Returns the fraction of elements changed and, per changed element, bits for the
    positions (``pos_bits_gap``: entropy of the pooled gap distribution, gaps as in
    :class:`SparseIndexZstd`; ``pos_bits_iid``: H(p)/p, positions iid with probability
    p) and for the values (``val_bits_new``: entropy of the new raw value given that it
    changed; ``val_bits_step``: entropy of the signed step ``key(new) - key(old)`` in
    ordered-integer space, see :func:`ordered_key`), each also as bytes for the whole
    pair, and ``total_bytes`` = best position model + best value model, with
    ``dense_bytes`` and ``ratio_limit`` = dense / total. Values and steps are pooled
    per dtype (``by_dtype``) and summed; the top-level ``val_bits_*`` are averages
    weighted by changed elements.

    These are order-0 empirical entropies: a coder with context (per-tensor tables,
    magnitude-conditioned steps) can beat them, and for wide dtypes with few changes
    (fp32) the empirical value entropy is capped at log2(n_changed) and so understates
    the true cost; read ``val_bits_step`` for those.
    """
    names = _check_structure(old, new)
    per: dict[torch.dtype, dict[str, list]] = defaultdict(lambda: {"n": 0, "gaps": [], "vals": [], "steps": []})
    for n in names:
        ob, nb = to_bits(old[n]), to_bits(new[n])
        idx = np.flatnonzero(ob != nb)
        d = per[old[n].dtype]
        d["n"] += ob.size
        d["gaps"].append(np.diff(idx, prepend=-1))
        d["vals"].append(nb[idx])
        d["steps"].append(signed_step(ob[idx], nb[idx], old[n].dtype))
    by_dtype = {str(dt).replace("torch.", ""): _stats(d["n"], d["gaps"], d["vals"], d["steps"])
                for dt, d in per.items()}
    allgaps = [g for d in per.values() for g in d["gaps"]]
    n_all = sum(d["n"] for d in per.values())
    top = _stats(n_all, allgaps, [], [])
    c = top["n_changed"]
    for key in ("val_bits_new", "val_bits_step"):
        b = sum(s["n_changed"] * s[key] for s in by_dtype.values())
        top[key] = b / c if c else 0.0
        top[key.replace("val_bits", "bytes_val")] = b / 8
    val_best = sum(s["n_changed"] * min(s["val_bits_new"], s["val_bits_step"]) for s in by_dtype.values())
    top["total_bytes"] = (c * min(top["pos_bits_gap"], top["pos_bits_iid"]) + val_best) / 8
    top["dense_bytes"] = dense_nbytes(new)
    top["ratio_limit"] = top["dense_bytes"] / top["total_bytes"] if top["total_bytes"] else float("inf")
    top["by_dtype"] = by_dtype
    return top
