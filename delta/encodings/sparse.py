"""Encoding 1, sparse: the changed positions as gaps and their steps, each list in byte planes, zstd.

Payload (docs/FORMAT.md, "Chunk encodings", and "Element bits, keys and steps"):
``u32 L``, a zstd frame (L bytes) of the gaps in ``planes_a`` byte planes, then a zstd
frame (the rest) of the zigzagged steps in ``planes_b`` byte planes. ``count`` is the
number of changed elements. The kernels are in delta/kernels.py.

The chunk coder tries it on every changed chunk, in both codec modes: it is the
fast path's own encoding (``codec="fast"``), so it carries that codec's cost model.
"""

from __future__ import annotations

import struct

import numpy as np

from ckptdelta.delta import kernels
from ckptdelta.delta.errors import FormatError
from ckptdelta.delta.encodings import frames
from ckptdelta.delta.encodings.base import ALWAYS, Candidate, Cost, Encoding, register
from ckptdelta.delta.encodings.dense_xor import DENSE_TRY_FRACTION


def encode_payload(old: np.ndarray, new: np.ndarray, dt, changed: int, level: int,
                   extracted: tuple | None = None, *, estimate: bool = False) -> tuple:
    """(planes_a, planes_b, payload) of a chunk with ``changed`` changes (``extracted``: the
    ``kernels.sparse_extract`` of it, when the caller has it); with ``estimate``, a fourth item: the
    planes' order-0 estimate (frames.estimate), for later tries to weigh theirs against."""
    gaps, steps, max_gap, max_step = extracted or kernels.sparse_extract(
        old, new, changed, 8 * dt.itemsize, dt.sign_magnitude)
    pa, pb = frames.planes_needed(max_gap), frames.planes_needed(max_step)
    c = frames.compressor(level)
    gap_planes, step_planes = kernels.to_planes(gaps, pa), kernels.to_planes(steps, pb)
    pos = c.compress(gap_planes)
    val = c.compress(step_planes)
    out = (pa, pb, struct.pack("<I", len(pos)) + pos + val)
    if estimate:
        out += (frames.estimate(gap_planes, changed) + frames.estimate(step_planes, changed),)
    return out


class Sparse(Encoding):
    id = 1
    name = "sparse"
    tried = ALWAYS
    order = 10
    #: ``ckptdelta.delta.encode_many`` on the reference workload (benchmarks.workloads "small", 23M bf16 elements,
    #: 0.13-31% changed, 2 cores) fitted ~1.3 ns/element + ~45 ns/changed element for the fast path; its
    #: decode over its encode at 1 GB (benchmarks/at_scale.py, 2 cores each side) 0.55-0.70 at lr 1e-6
    #: (1.0% changed) and 0.49-0.60 at lr 1e-5 (6.8%). Priors: 1.3 / 2.2 ns per element of the context
    #: coder's first fit, and 1.50-1.63x its bytes per changed element on the reference workloads.
    cost = Cost(work_per_changed=35.0, decode_work=(0.63, 17.5), prior_per_work=0.6, prior_bytes_per_changed=1.6)

    def check_fields(self, planes_a, planes_b, count, n, itemsize, length, dtype_name):
        if not (1 <= count <= n and 1 <= planes_a <= 4 and 1 <= planes_b <= itemsize):
            return f"sparse chunk fields out of range (count={count}, planes={planes_a}/{planes_b})"
        return None

    def encode(self, chunk):
        if chunk.beats_sparse or chunk.dense_step:  # the context coder's payload is surely smaller (no zstd for
            return None                             # nothing), or the fast path codes the chunk as dense steps
        # a dense or raw try follows where this many elements changed: it weighs its planes against these
        tries = not chunk.alone and chunk.changed > DENSE_TRY_FRACTION * chunk.n
        pa, pb, payload, *est = encode_payload(chunk.old, chunk.new, chunk.dt, chunk.changed, chunk.level,
                                               chunk.sparse_parts, estimate=tries)
        return Candidate(self.id, pa, pb, chunk.changed, payload, est[0] if est else None)

    def decode(self, entry, payload, old, dt, where, out, grand):
        if len(payload) < 4:
            raise FormatError(f"{where}: sparse payload shorter than its 4-byte prefix")
        (pos_len,) = struct.unpack_from("<I", payload, 0)
        if pos_len > len(payload) - 4:
            raise FormatError(f"{where}: sparse position stream length {pos_len} exceeds the payload")
        n = old.shape[0]
        k = entry.count
        gap_planes = np.frombuffer(frames.unzstd(payload[4: 4 + pos_len], k * entry.planes_a, where + " positions"),
                                   np.uint8)
        step_planes = np.frombuffer(frames.unzstd(payload[4 + pos_len:], k * entry.planes_b, where + " values"),
                                    np.uint8)
        gaps = np.empty(k, np.uint32)
        kernels.from_planes(gap_planes, k, entry.planes_a, gaps)
        positions, values = (np.empty(k, np.int64), np.empty(k, dt.bits_dtype)) if out is None else out
        if not kernels.sparse_positions_into(gaps, n, positions):
            raise FormatError(f"{where}: a changed position falls outside the chunk's {n} elements")
        steps = np.empty(k, np.uint64)
        kernels.from_planes(step_planes, k, entry.planes_b, steps)
        kernels.sparse_new_values(old, positions, steps, 8 * dt.itemsize, dt.sign_magnitude, values)
        return positions, values


ENCODING = register(Sparse())
