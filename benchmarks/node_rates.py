"""What a replica node spends per GB of model on a hot-load, per core and per tensor-parallel worker.

The projection in docs/PERFORMANCE.md ("The projection for 8-GPU nodes") is built from these rates. One
bf16 step (benchmarks.workloads.scaled_pair, lr 1e-6, ``--gb`` of model) is published to a local
directory by a real Publisher (each codec), then hot-loaded by a real HotSwapper over host tensors, as a
vLLM replica's process does into its host copy:

- **replica process, per core**: prepare (read, decode, verify, stage) with ``stage_threads`` 1 and 2,
  wall and the process's CPU seconds, and the pause that writes the host copy; seconds per GB of model.
- **per worker, 1 and 2 workers**: what each tensor-parallel worker then does with its own slice (the
  slices of loader/engines/vllm/tp.py: q/k/v and gate/up rows, o and down input columns, embedding
  vocabulary rows, norms whole), emulated in plain torch on the host, not in vLLM: (a) the shadow load of
  every *changed module*, its slice copied out of the host copy into the worker's own tensors (vLLM's weight
  loaders narrow and copy), then hashed whole (the proof's read-back); and (b) for comparison, writing only
  the slice's *changed elements* in place and hashing them (loader/engines/vllm/worker/patch.py's path for
  the tensors it can patch). Each worker is its own process pinned to its own core, all at once, the host
  copy a file in shared memory they map (one untimed pass first: a worker's mapping stays warm between
  hot-loads). vLLM's own CPU re-packing of linears (oneDNN) is not in (a): on a GPU its place is taken by
  the host-to-device copy of the same bytes, which the projection adds at PCIe rates.

Rates are CPU seconds (the thread's, the process's for the replica), beside wall times: on a shared machine
the waits for a core inflate the wall clock, not the CPU clock. A real TP-2 vLLM hot-load is not timed here
(tests/loader/engines/vllm/test_vllm_tp.py runs and proves one): inside vLLM's CPU build a worker's share is mostly that
re-packing, which a GPU does not do. The run also writes the projection for an 8-GPU node
(:func:`projection`; its constants below) from its own rates.

    python -m benchmarks.node_rates             # 1 GB, 3 deltas per codec
    python -m benchmarks.node_rates --gb 0.25 --steps 2

Writes benchmarks/results/node_rates.{md,json,png}.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time
import warnings

import numpy as np
import torch
import xxhash

from benchmarks import harness


def _slice_of(name: str, shape: tuple[int, ...], rank: int, world: int) -> tuple[int, int, int] | None:
    """(dim, start, length) of the worker's slice, as loader/engines/vllm/tp.py lays it out; None: whole."""
    if len(shape) != 2 or world == 1:
        return None
    dim = 1 if any(k in name for k in ("o_proj", "down_proj")) else 0
    n = shape[dim] // world
    return dim, rank * n, n


def _load(blob, meta, own, changed, rank, world, mode) -> int:
    """One hot-load's work in a worker: every changed tensor's slice loaded (``mode``) and hashed."""
    nbytes = 0
    for name, off, shape in meta:
        if name not in own:
            continue
        full = torch.from_numpy(blob[off:off + int(np.prod(shape))].reshape(shape))
        s = _slice_of(name, shape, rank, world)
        part = full if s is None else full.narrow(*s)
        dst = own[name]
        if mode == "module":                 # the shadow: the worker's slice of the whole module, then proven
            dst.copy_(part)
            xxhash.xxh3_64_intdigest(dst.numpy())
            nbytes += dst.numel() * 2
        else:                                # in place: only the changed elements of the slice, then proven
            pos = changed[name]
            r, c = np.divmod(pos, shape[1]) if len(shape) == 2 else (pos, None)
            if s is not None:
                d, st, ln = s
                keep = ((r if d == 0 else c) >= st) & ((r if d == 0 else c) < st + ln)
                r, c = r[keep], (None if c is None else c[keep])
                if d == 0:
                    r = r - st
                else:
                    c = c - st
            src = full
            if c is None:
                vals = src[torch.from_numpy(r)]
                dst[torch.from_numpy(r)] = vals
            else:
                rr, cc = torch.from_numpy(r), torch.from_numpy(c)
                vals = (src.narrow(*s) if s is not None else src)[rr, cc]
                dst[rr, cc] = vals
            xxhash.xxh3_64_intdigest(vals.numpy())
            nbytes += vals.numel() * 2
    return nbytes


def _worker(path: str, meta: list, changed: dict, rank: int, world: int, core: int, mode: str, q) -> None:
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="The given NumPy array is not writable")   # only read here
    blob = np.memmap(path, dtype=np.int16, mode="r")
    own = {}
    for name, off, shape in meta:
        if name not in changed:
            continue
        s = _slice_of(name, shape, rank, world)
        full = torch.from_numpy(blob[off:off + int(np.prod(shape))].reshape(shape))
        part = full if s is None else full.narrow(*s)
        own[name] = torch.empty(part.shape, dtype=torch.int16) if mode == "module" else part.clone()
    _load(blob, meta, own, changed, rank, world, mode)            # untimed: the worker's mapping is warm
    c0, t0 = time.thread_time(), time.perf_counter()
    nbytes = _load(blob, meta, own, changed, rank, world, mode)
    q.put({"rank": rank, "wall_s": time.perf_counter() - t0, "cpu_s": time.thread_time() - c0, "bytes": nbytes})


def workers(host: dict[str, torch.Tensor], changed: dict[str, np.ndarray], world: int, mode: str) -> dict:
    """``world`` worker processes at once, each on its own core, each loading its slice (``mode``)."""
    fd, path = tempfile.mkstemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None, prefix="ckptdelta-node-")
    try:
        meta, off = [], 0
        with os.fdopen(fd, "wb") as f:
            for name, t in host.items():
                b = t.contiguous().view(torch.int16).numpy()
                f.write(b.tobytes())
                meta.append((name, off, tuple(t.shape)))
                off += b.size
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        cores = sorted(os.sched_getaffinity(0))
        ps = [ctx.Process(target=_worker, args=(path, meta, changed, r, world, cores[r % len(cores)], mode, q))
              for r in range(world)]
        for p in ps:
            p.start()
        out = [q.get() for _ in ps]
        for p in ps:
            p.join()
        return {"wall_s": max(o["wall_s"] for o in out), "cpu_s": max(o["cpu_s"] for o in out),
                "bytes": max(o["bytes"] for o in out)}
    finally:
        os.unlink(path)


def replica(url: str, versions: list[int], threads: int) -> dict:
    """The replica process's own share: HotSwapper.prepare (read, decode, verify, stage) and commit."""
    from ckptdelta.loader.hotswap import HotSwapper
    from ckptdelta.loader.reader import SnapshotReader

    reader = SnapshotReader(url)
    start = versions[0] - 1
    live = {n: t.clone() for n, t in reader.read_tensors(start).items()}
    swapper = HotSwapper(live, reader, version=start, stage_threads=threads, progress=False)
    prep, cpu, pause = [], [], []
    for v in versions:
        c0, t0 = time.process_time(), time.perf_counter()
        p = swapper.prepare(v)
        prep.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        pause.append(swapper.commit(p).pause_s)
    return {"prepare_s": statistics.median(prep), "prepare_cpu_s": statistics.median(cpu),
            "pause_s": statistics.median(pause)}


def main(argv: list[str] | None = None) -> int:
    ap = harness.parser("node_rates", __doc__, full_doc=True, out="--out")
    ap.add_argument("--gb", type=float, default=1.0)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--from-json", metavar="PATH", help="write the tables (and projection) of an earlier run again")
    args = ap.parse_args(argv)
    if args.from_json:
        data = harness.read_json(args.from_json)
        data["projection"] = projection(data)
        harness.write(args.from_json[:-len(".json")], render(data), data, lambda p: plot(data, p))
        return 0
    from benchmarks.workloads import scaled_pair
    from ckptdelta.publisher import Publisher

    torch.set_num_threads(1)
    old, new = scaled_pair(int(args.gb * 1e9))
    gb = sum(t.numel() * t.element_size() for t in new.values()) / 1e9
    changed = {}
    for n in new:
        d = np.flatnonzero(old[n].view(torch.int16).numpy().ravel() != new[n].view(torch.int16).numpy().ravel())
        if d.size:
            changed[n] = d
    n_el = sum(t.numel() for t in new.values())
    data = {"command": harness.command("node_rates", argv if argv is not None else __import__("sys").argv[1:]),
            "gb": gb, "tensors": len(new), "tensors_changed": len(changed),
            "elements_changed": sum(v.size for v in changed.values()) / n_el, "codecs": {}, "workers": {}}
    with tempfile.TemporaryDirectory(prefix="ckptdelta-node-") as root:
        for codec in ("fast", "context"):
            url = f"{root}/{codec}"
            enc = []
            with Publisher(url, codec=codec, anchor_every=1000, anchor_chain_fraction=1e9, progress=False) as pub:
                pub.publish(old, 0)
                versions = []
                for step in range(1, 2 * args.steps + 1):
                    t0 = time.perf_counter()
                    r = pub.publish(new if step % 2 else old, step)
                    enc.append(time.perf_counter() - t0)
                    versions.append(r.version)
            row = {"publish_s": statistics.median(enc)}
            for threads in (1, 2):
                row[f"t{threads}"] = replica(url, versions[1:], threads)       # the first delta warms up
                print(codec, threads, row[f"t{threads}"], flush=True)
            data["codecs"][codec] = row
    del old                                  # the workers' phase holds the new bits (the host copy) only
    for mode in ("module", "elements"):
        for world in (1, 2):
            reps = [workers(new, changed, world, mode) for _ in range(args.steps)]
            data["workers"][f"{mode}-{world}"] = {k: statistics.median(r[k] for r in reps) for k in reps[0]}
            print(mode, world, data["workers"][f"{mode}-{world}"], flush=True)
    data["projection"] = projection(data)
    harness.write(f"{args.out}/node_rates", render(data), data, lambda p: plot(data, p))
    return 0


#: The node the projection is for: an 8-GPU replica (H100 80 GB or H200 141 GB), tensor-parallel over its 8
#: GPUs, two sockets of 56 cores; DECODE_CORES of them left to the replica process's decode (the workers and
#: vLLM's own processes keep the rest). Assumed, not measured here: NODE_MEM_BW, what the decode's passes over
#: the model can stream from DRAM at once; H2D, one GPU's host-to-device copy from ordinary (pageable)
#: memory, as the host copy in /dev/shm is.
TP = 8
NODE_CORES = 112
DECODE_CORES = 96
NODE_MEM_BW = 250e9
H2D = 25e9
DECODE_PASSES = 2          # the decode reads every changed tensor's parent bits and hashes its result

#: Models: G bytes; delta bytes per codec; the share of the model's bytes in modules a worker must reload
#: whole (row-parallel linears on a GPU; every layer of an fp8 model, quantized layers are never patched in
#: place); GPU memory per GPU; trainer-side publish() -> committed (the sharded projection above: 64 and 256
#: ranks). 70B: Llama-3-70B shapes at lr 1e-6, r = delta/model bytes of the at-scale run (fast 0.0071,
#: context 0.0044); o_proj + down_proj are 35% of its linear bytes. 1T fp8: Fireworks' measured 1T fp8 XOR
#: delta, 20.3 GiB (1.98% changed), divided by ckptdelta's byte advantage over XOR + zstd-3 on the Qwen2.5
#: shapes (benchmarks/results/codec_small.md: fast 2.05x, context 3.17x).
MODELS = {
    "70B bf16": {"G": 140e9, "delta": {"fast": 0.0071 * 140e9, "context": 0.0044 * 140e9}, "reload_share": 0.35,
                 "changed": 0.010, "gpu_mem": 80e9, "trainer_s": 0.34},
    "1T fp8": {"G": 1e12, "delta": {"fast": 20.3 * 2**30 / 2.05, "context": 20.3 * 2**30 / 3.17},
               "reload_share": 1.0, "changed": 0.0198, "gpu_mem": 141e9, "trainer_s": 1.5},
}
LINKS = (10e9, 100e9)


def projection(d: dict) -> list[dict]:
    """publish() -> serving per model, link and codec from this run's rates (docs/PERFORMANCE.md gives the
    formula): trainer + both legs of the wire + the replica's decode + the slowest worker's load + the pause."""
    w_module = d["workers"]["module-2"]["cpu_s"] / max(d["workers"]["module-2"]["bytes"], 1) * 1e9
    w_elems = d["workers"]["elements-2"]["cpu_s"] / max(d["workers"]["elements-2"]["bytes"], 1) * 1e9
    out = []
    for model, m in MODELS.items():
        G = m["G"]
        per_gpu = G / TP
        reload = m["reload_share"] * per_gpu                     # bytes each worker loads whole
        patched = (1 - m["reload_share"]) * per_gpu * m["changed"]   # bytes it writes in place
        shadow_fits = per_gpu + reload <= 0.9 * m["gpu_mem"]
        # a worker's host side (reading and hashing its slice, one core) overlaps its host-to-device copy: the
        # slower sets the pace. The in-place writes at this run's CPU rate per changed byte (torch fancy indexing
        # on the host: an upper bound), or at their transfer alone (8-byte position + value per element: a
        # GPU scatter kernel costs next to nothing beside it).
        whole = reload * max(w_module / 1e9, 1 / H2D)
        worker = whole + patched * w_elems / 1e9
        worker_lo = whole + patched * (1 + 8 / 2) / H2D
        for codec in ("fast", "context"):
            dps = d["codecs"][codec]["t1"]["prepare_cpu_s"] / d["gb"]      # CPU s per GB, one core
            decode = max(G / 1e9 * dps / DECODE_CORES, DECODE_PASSES * G / NODE_MEM_BW)
            for B in LINKS:
                wire = 2 * m["delta"][codec] * 8 / B
                # with no room for a shadow the changed modules are reloaded inside the pause (vLLM's reload_weights)
                pause = 0.05 + (0.0 if shadow_fits else worker)
                total = m["trainer_s"] + wire + decode + worker + 0.05
                total_lo = m["trainer_s"] + wire + decode + worker_lo + 0.05
                out.append({"model": model, "codec": codec, "link_bits": B, "trainer_s": m["trainer_s"],
                            "delta_bytes": m["delta"][codec], "wire_s": wire, "decode_s": decode,
                            "decode_cpu_bound_s": G / 1e9 * dps / DECODE_CORES,
                            "worker_s": worker, "worker_lo_s": worker_lo, "shadow_fits": shadow_fits,
                            "pause_s": pause, "total_s": total, "total_lo_s": total_lo,
                            "host_copy_bytes": G})
    return out


def render(d: dict) -> str:
    gb = d["gb"]
    lines = ["# A replica node's costs per GB of model", "",
             f"{harness.machine()}; `{d['command']}`: {gb:.2f} GB bf16, {d['tensors']} tensors "
             f"({d['tensors_changed']} changed), {100 * d['elements_changed']:.2f}% of elements changed; medians.", "",
             "## The replica process (HotSwapper over the host copy: read, decode, verify, stage; then the pause)", "",
             "| codec | trainer publish() | prepare, 1 thread | CPU s/GB, 1 thread | prepare, 2 threads | "
             "2 threads / 1 | CPU s/GB, 2 threads | pause (host copy written) |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for c, r in d["codecs"].items():
        a, b = r["t1"], r["t2"]
        lines.append(f"| {c} | {r['publish_s']:.3f} s | {a['prepare_s']:.3f} s | {a['prepare_cpu_s'] / gb:.3f} | "
                     f"{b['prepare_s']:.3f} s | {b['prepare_s'] / a['prepare_s']:.2f}x | {b['prepare_cpu_s'] / gb:.3f} | "
                     f"{1e3 * a['pause_s']:.1f} ms |")
    lines += ["", "## Per tensor-parallel worker, its own slice (one process and one core each, all at once)", "",
              "| what each worker loads | workers | bytes per worker | slowest worker (wall) | its CPU | "
              "CPU s per GB of model | CPU s per GB of the worker's slice |", "|---|---:|---:|---:|---:|---:|---:|"]
    for k, r in d["workers"].items():
        mode, world = k.split("-")
        what = ("shadow: its slice of every changed module, copied and hashed" if mode == "module"
                else "in place: its slice's changed elements, written and hashed")
        lines.append(f"| {what} | {world} | {r['bytes'] / 1e6:,.1f} MB | {r['wall_s']:.3f} s | {r['cpu_s']:.3f} s | "
                     f"{r['cpu_s'] / gb:.3f} | {r['cpu_s'] / max(r['bytes'], 1) * 1e9:.3f} |")
    lines += ["", f"## Projection: an {TP}-GPU node, TP-{TP}, {DECODE_CORES} of {NODE_CORES} cores decoding "
              "(not a measurement; docs/PERFORMANCE.md)", "",
              "| model | codec | link | trainer | delta | wire (both legs) | decode (CPU-bound / DRAM floor) | "
              "slowest worker (in-place writes at the host rate / at transfer only) | pause | "
              "**publish() -> serving** |", "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for p in projection(d):
        worker = f"{p['worker_s']:.2f} / {p['worker_lo_s']:.2f} s" + ("" if p["shadow_fits"] else
                                                                   ", in the pause (no room for a shadow)")
        lines.append(f"| {p['model']} | {p['codec']} | {p['link_bits'] / 1e9:.0f} Gbit/s | {p['trainer_s']:.2f} s | "
                     f"{p['delta_bytes'] / 1e9:.2f} GB | {p['wire_s']:.2f} s | {p['decode_s']:.2f} s "
                     f"({p['decode_cpu_bound_s']:.2f} / {DECODE_PASSES * p['host_copy_bytes'] / NODE_MEM_BW:.2f}) | "
                     f"{worker} | {p['pause_s']:.2f} s | **{p['total_s']:.1f} s** / {p['total_lo_s']:.1f} s |")
    return "\n".join(lines) + "\n"


def plot(d: dict, path: str) -> None:
    with harness.figure(path, figsize=(7, 3.5)) as (_, ax):
        labels, vals = [], []
        for c, r in d["codecs"].items():
            for t in (1, 2):
                labels.append(f"{c}\nprepare t{t}")
                vals.append(r[f"t{t}"]["prepare_s"] / d["gb"])
        for k, r in d["workers"].items():
            labels.append(k.replace("-", "\n") + " w")
            vals.append(r["cpu_s"] / d["gb"])
        ax.bar(range(len(vals)), vals)
        ax.set_xticks(range(len(vals)), labels, fontsize=7)
        ax.set_ylabel("s per GB of model (workers: CPU s)")
        ax.set_title("Replica-side costs per GB (this machine)")


if __name__ == "__main__":
    raise SystemExit(main())
