"""Where the context coder's time goes: nanoseconds per element of each stage, beside the floor.

For one workload, every chunk the codec would cut (``ckptdelta.delta.codec.DEFAULT_CHUNK_ELEMS``)
is run through the context coder's kernels one stage at a time, and each stage is
timed over the whole model. The floor is this machine's memory bandwidth measured on
the same tensors in the same run: a copy pass (read one snapshot, write one) and an
XOR pass (read two, write one) into preallocated buffers, so the distance of every
stage to the limit is visible; the XOR pass also runs split over two threads, and
what that gains over one is the ceiling for a codec's two-thread scaling here.
Times are CPU time of the calling thread (``time.thread_time``), medians of repeats:
on a machine shared with other jobs that is what one thread costs, where wall time
also counts the waits for a core.

Stages (docs/FORMAT.md, encoding 5, which the context coder writes):

* encode: **scan** (compare parent and new bits 64 at a time, every change with its
  class and step, class sizes from a sample: one pass over the chunk), **statistics**
  (the groups, the second pass that finds each group's gaps from its masks, flag
  models and Golomb parameters), **coding** (both tables and the bit streams; the
  sparse encoding's arrays and estimate the encoder compares with), **hash** (xxh3 of
  the new tensor; the parent's digest a publisher has from the manifest it committed
  last);
* decode+apply: **scan** (the position sub-streams: group masks of every 64 parent
  elements, gaps skipped by counting their bits), **coding** (the step stream: new
  bits of each change), **apply** (keep the old bits for undo, scatter), **hash
  result** (it proves the bits; the parent is hashed only to name a failure).

``glue`` is what the end-to-end call (``ckptdelta.delta.encode_many`` / ``apply_many``, one
thread) costs beyond the stages: Python, allocation, the zstd tries of the chunks
where ctx is not sure to win.
"""

from __future__ import annotations

import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import xxhash

from ckptdelta.delta import dtypes, kernels
from ckptdelta.delta.codec import DEFAULT_CHUNK_ELEMS
from ckptdelta.delta.ctx_decoder import _decode_steps
from ckptdelta.delta.ctx_encoder import _sparse_parts, _step_models, sparse_estimate
from ckptdelta.delta.ctxcoder import layout_of, scan_scratch
from ckptdelta.delta.gctx import _assemble, _group_positions, _parse_table, _position_models, _scan, stream_words

ENCODE_STAGES = ("scan", "statistics", "coding", "hash")
DECODE_STAGES = ("scan", "coding", "apply", "hash result")


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
    c0 = time.thread_time()
    scratch = scan_scratch(o.shape[0])
    chgw = np.empty((o.shape[0] + 63) >> 6, np.uint64)
    nest, kcls, cpos, ccls, csign, ca = _scan(o, n, w, mb, eb, *scratch[:4], chgw)
    c1 = time.thread_time()
    t["scan"] += c1 - c0
    count = cpos.shape[0]
    if count == 0:
        return None
    groups = _position_models(o, mb, eb, nest, kcls, chgw, scratch[2], scratch[3])
    steps = _step_models(kcls, ccls, ca)
    c2 = time.thread_time()
    t["statistics"] += c2 - c1
    out = _assemble(*groups, kcls, ccls, *steps, csign, ca)
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
    err, G, tb, gmode, gpol, gj, P, lo, hi, zmode, zpol, zj, vj, q = _parse_table(buf, 1 << eb)
    words, wstart, sw, s = stream_words(buf, G, P, q)
    pos = np.empty(count, np.int64)
    vals = np.empty(count, dt.bits_dtype)
    ccls = np.empty(count, np.uint16)
    err |= _group_positions(words, wstart, P, o, count, mb, eb, G, tb, gmode, gpol, gj, pos, ccls)
    c1 = time.thread_time()
    L = buf.shape[0]
    err |= _decode_steps(sw, L - s, o, w, lo, hi, zmode, zpol, zj, vj, pos, ccls, vals)
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
    out["xor_two_threads_x"] = _two_threads_x(pairs, dst, repeats)
    return out


def _two_threads_x(pairs: list, dst: list, repeats: int) -> float:
    """How much faster two threads run the XOR pass than one (wall medians, interleaved): what two
    threads can gain on a pass bound by memory on this machine, the ceiling of a codec's scaling there."""
    half, rest, load = [], [], [0, 0]
    for i in sorted(range(len(pairs)), key=lambda i: -pairs[i][1].shape[0]):
        side = 0 if load[0] <= load[1] else 1
        (half, rest)[side].append(i)
        load[side] += pairs[i][1].shape[0]

    def xor(ix):
        for i in ix:
            np.bitwise_xor(pairs[i][0], pairs[i][1], out=dst[i])     # numpy gives up the GIL here

    one, two = [], []
    with ThreadPoolExecutor(1) as pool:
        pool.submit(xor, []).result()
        for _ in range(max(3, repeats)):
            t0 = time.perf_counter()
            xor(half + rest)
            one.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            other = pool.submit(xor, rest)
            xor(half)
            other.result()
            two.append(time.perf_counter() - t0)
    return statistics.median(one) / statistics.median(two)


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
