"""Where the context coder's time goes: nanoseconds per element of each stage, beside the floor.

For one workload, every chunk the codec would cut (``delta.codec.DEFAULT_CHUNK_ELEMS``)
is run through the context coder's kernels one stage at a time, and each stage is
timed over the whole model. The floor is this machine's memory bandwidth measured on
the same tensors in the same run: a copy pass (read one snapshot, write one) and an
XOR pass (read two, write one) into preallocated buffers, so the distance of every
stage to the limit is visible. Times are CPU time of the calling thread
(``time.thread_time``), medians of repeats: on a machine shared with other jobs that
is what one thread costs, where wall time also counts the waits for a core.

Stages (docs/FORMAT.md, encoding 4):

* encode: **scan** (compare parent and new bits, class histogram, every change with
  its class, rank and step: one pass over the chunk), **statistics** (flag models and
  Golomb parameters per class, gaps, the second pass over classes coded by their
  unchanged elements), **coding** (class table and both bit streams; the sparse
  encoding's arrays and estimate the encoder compares with), **hash** (xxh3 of the new
  tensor; the parent's digest a publisher has from the manifest it committed last);
* decode+apply: **hash parent**, **scan** (the position stream: one countdown per class,
  every parent element), **coding** (the step stream: new bits of each change),
  **apply** (keep the old bits for undo, scatter), **hash result**.

``glue`` is what the end-to-end call (``delta.encode_many`` / ``apply_many``, one
thread) costs beyond the stages: Python, allocation, the zstd tries of the chunks
where ctx is not sure to win.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import xxhash

from delta import dtypes, kernels
from delta.codec import DEFAULT_CHUNK_ELEMS
from delta.ctx_bits import U64
from delta.ctx_decoder import _decode_positions, _decode_steps, _parse_table, _words
from delta.ctx_encoder import (_assemble, _position_gaps, _position_models, _scan, _sparse_parts, _step_models,
                               _unchanged_events, sparse_estimate)
from delta.ctxcoder import _words_of_four, layout_of, scan_scratch

ENCODE_STAGES = ("scan", "statistics", "coding", "hash")
DECODE_STAGES = ("hash parent", "scan", "coding", "apply", "hash result")


def _chunks(old: dict, new: dict):
    """(parent bits, new bits, dtype) of every chunk of every tensor the context coder serves."""
    out = []
    for k in sorted(new):
        dt = dtypes.of(new[k])
        if layout_of(dt) is None or k not in old:
            continue
        o, n = dtypes.host_bits(old[k]), dtypes.host_bits(new[k])
        for s in range(0, o.shape[0], DEFAULT_CHUNK_ELEMS):
            out.append((o[s:s + DEFAULT_CHUNK_ELEMS], n[s:s + DEFAULT_CHUNK_ELEMS], dt))
    return out


def _encode_chunk_staged(o, n, dt, t: dict) -> tuple | None:
    mb, eb = layout_of(dt)
    w = 8 * dt.itemsize
    C = 1 << eb
    mask = U64((1 << w) - 1)
    signbit = U64(1 << (w - 1))
    o4, n4 = _words_of_four(o), _words_of_four(n)
    if o4.shape[0] != n4.shape[0]:
        o4, n4 = o4[:0], n4[:0]
    c0 = time.thread_time()
    scratch = scan_scratch(o.shape[0])
    ncls, kcls, cpos, ccls, crank, csign, ca = _scan(o, n, o4, n4, w, mb, C, signbit, mask, *scratch)
    c1 = time.thread_time()
    t["scan"] += c1 - c0
    count = cpos.shape[0]
    if count == 0:
        return None
    pmode, ppol, pj, ucount = _position_models(ncls, kcls, count)
    upos, ucls, urank = _unchanged_events(o, n, o4, n4, w, mb, pmode, ppol, ucount)
    cgap, ugap, pinit = _position_gaps(ncls, ccls, crank, pmode, ppol, ucls, urank)
    zmode, zpol, zj, zgap, zinit, vj, vsum = _step_models(kcls, ccls, ca)
    c2 = time.thread_time()
    t["statistics"] += c2 - c1
    out = _assemble(ncls, kcls, pmode, ppol, pj, pinit, cpos, ccls, cgap, upos, ucls, ugap,
                    zmode, zpol, zj, zinit, zgap, vj, vsum, csign, ca)
    sparse_estimate(*_sparse_parts(cpos, csign, ca))
    payload = out.tobytes()
    c3 = time.thread_time()
    t["coding"] += c3 - c2
    return payload, count


def _decode_chunk_staged(payload, count, o, dt, t: dict) -> None:
    mb, eb = layout_of(dt)
    w = 8 * dt.itemsize
    c0 = time.thread_time()
    buf = np.frombuffer(payload, np.uint8)
    err, lo, hi, pmode, ppol, pj, zmode, zpol, zj, vj, q, P = _parse_table(buf, 1 << eb)
    pos = np.empty(count, np.int64)
    vals = np.empty(count, dt.bits_dtype)
    ccls = np.empty(count, np.uint16)
    err |= _decode_positions(_words(buf, q, q + P), P, o, count, mb, lo, hi, pmode, ppol, pj, pos, ccls)
    c1 = time.thread_time()
    L = buf.shape[0]
    err |= _decode_steps(_words(buf, q + P, L), L - q - P, o, w, lo, hi, zmode, zpol, zj, vj, pos, ccls, vals)
    c2 = time.thread_time()
    if err:
        raise AssertionError(f"stage decode failed with error {err}")
    undo = np.empty_like(vals)
    kernels.gather(o, pos, undo)
    kernels.scatter(o, pos, vals)
    c3 = time.thread_time()
    kernels.scatter(o, pos, undo)      # put the parent back for the next repeat (untimed)
    t["scan"] += c1 - c0
    t["coding"] += c2 - c1
    t["apply"] += c3 - c2


def floors(old: dict, new: dict, repeats: int) -> dict[str, float]:
    """ns per element of a copy pass and an XOR pass over the model, into preallocated buffers."""
    pairs = [(dtypes.host_bits(old[k]), dtypes.host_bits(new[k])) for k in sorted(new) if k in old]
    dst = [np.empty_like(n) for _, n in pairs]
    numel = sum(n.shape[0] for _, n in pairs)
    out = {}
    for name, fn in (("copy", lambda: [np.copyto(d, n) for d, (_, n) in zip(dst, pairs)]),
                     ("xor", lambda: [np.bitwise_xor(o, n, out=d) for d, (o, n) in zip(dst, pairs)])):
        ts = []
        for _ in range(repeats):
            t0 = time.thread_time()
            fn()
            ts.append(time.thread_time() - t0)
        out[name] = 1e9 * statistics.median(ts) / numel
    return out


def measure(old: dict, new: dict, repeats: int = 5) -> dict:
    """Stage times (ns per element of the whole model, median of ``repeats``) and the floors."""
    numel = sum(t.numel() for t in new.values())
    work = _chunks(old, new)
    parents = {k: dtypes.host_bits(old[k]).copy() for k in sorted(new) if k in old}
    enc = {s: [] for s in ENCODE_STAGES}
    dec = {s: [] for s in DECODE_STAGES}
    for _ in range(repeats):
        t = dict.fromkeys(ENCODE_STAGES, 0.0)
        payloads = []
        for o, n, dt in work:
            payloads.append(_encode_chunk_staged(o, n, dt, t))
        c0 = time.thread_time()
        for k in sorted(new):     # the new bits only: a publisher knows its parent's digest (its last manifest)
            xxhash.xxh3_64_intdigest(dtypes.host_bits(new[k]))
        t["hash"] = time.thread_time() - c0
        for s in ENCODE_STAGES:
            enc[s].append(t[s])
        t = dict.fromkeys(DECODE_STAGES, 0.0)
        c0 = time.thread_time()
        for b in parents.values():
            xxhash.xxh3_64_intdigest(b)
        t["hash parent"] = time.thread_time() - c0
        i = 0
        for k in sorted(new):
            dt = dtypes.of(new[k])
            if layout_of(dt) is None or k not in old:
                continue
            b = parents[k]
            for s in range(0, b.shape[0], DEFAULT_CHUNK_ELEMS):
                got = payloads[i]
                i += 1
                if got is not None:
                    _decode_chunk_staged(got[0], got[1], b[s:s + DEFAULT_CHUNK_ELEMS], dt, t)
        c0 = time.thread_time()
        for b in parents.values():
            xxhash.xxh3_64_intdigest(b)
        t["hash result"] = time.thread_time() - c0
        for s in DECODE_STAGES:
            dec[s].append(t[s])
    med = lambda xs: 1e9 * statistics.median(xs) / numel  # noqa: E731
    return {"encode": {s: med(v) for s, v in enc.items()}, "decode": {s: med(v) for s, v in dec.items()},
            "floor": floors(old, new, repeats), "numel": numel}
