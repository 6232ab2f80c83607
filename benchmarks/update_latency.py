"""Weight-update latency: ``publish()`` called -> the replica's live weights swapped, beside full checkpoints.

For bf16 snapshots of about 0.1 and 1 GB (``--sizes 0.1,1,4`` adds 4 GB; it
needs ~16 GB of RAM) built by :func:`benchmarks.workloads.scaled_pair` (real
AdamW steps at lr 1e-6, tiled), through a real S3 API (moto on 127.0.0.1, or
``--s3-url`` with ``--storage-options``) and through a local directory:

- **ckptdelta**: the previous step is the run's anchor (published, not timed);
  then ``Publisher.publish(new)`` and a :class:`ckptdelta.loader.HotSwapper` over a live
  state dict in this process hot-loads it. Broken into host copy, encode,
  upload, commit (PublishResult) and fetch, decode, pause (HotLoadReport).
- **a sparse step** at the same model size with ~10x fewer changed elements
  (1 ulp at random positions), to show that the pause follows the changed
  bytes, not the model size.
- **the pause against a full copy of the model**, on the local backend: steps
  changing 0.5% to ~40% of the elements (1 ulp at random positions: the worst
  case for a scatter, every changed element on a cache line of its own as far as
  possible) hot-loaded forward, back and forward, each beside a plain
  ``live[k].copy_(staged[k])`` of every tensor measured in the same run (the same
  bits, so the live weights stay the version they are). The commit writes each
  tensor the cheaper way, scatter or whole copy, and swaps a densely staged one
  (loader/batch_commit.py); the table says how many it wrote whole.
- **full checkpoint** (what a user does today): ``safetensors.torch.save_file``
  of the whole snapshot (to a temp file then uploaded by fsspec for S3), then
  downloaded, ``load_file`` and ``copy_`` into the live tensors (the copy is the
  pause: the model cannot serve half-copied weights).

With ``--device cuda`` the replica's live state dict is on the GPU (the trainer's weights and the
publisher stay on the host): the hot-load writes them with torch ops on the device and synchronizes
before its pause ends, the full copy is a device-to-device ``copy_`` of the model and the full
checkpoint's pause the host-to-device ``copy_`` of the loaded file; the bare scatter and the cache-line
share are host-memory figures and are left out there.

Every swap is checked bit-exact against the trainer's tensors (untimed).
Timings are wall-clock; each ckptdelta step is the median of ``--repeats`` publishes and hot-loads (the
step forward, back and forward again: the same elements change each time), the full checkpoint one run.

    python -m benchmarks.update_latency                    # 0.1 and 1 GB, local dir + S3 (moto)
    python -m benchmarks.update_latency --sizes 0.1,1,4
    python -m benchmarks.update_latency --quick            # 0.02 GB, local dir only, < 30 s
    python -m benchmarks.update_latency --device cuda --backends local --sizes 1 --sweep 0.01,0.05,0.25

Writes benchmarks/results/update_latency{,-quick}{,-cuda}.{md,json,png} (-cuda: live weights on a GPU).
"""

from __future__ import annotations

import gc
import logging
import os
import statistics
import tempfile
import time
from typing import Any

import torch

from benchmarks import harness
from benchmarks.harness import median_sample, ms
DELTA_PARTS = ("copy_s", "encode_s", "upload_s", "commit_s", "fetch_s", "decode_s", "pause_s")
FULL_PARTS = ("save_s", "upload_s", "download_s", "load_s", "copy_s")
SPARSE_FACTOR = 10  # the sparse step changes ~1/10 of the elements a real step changes
#: Shares of elements changed (drawn with replacement: 0.25 and 0.5 change ~22% and ~39%), for the pause vs a
#: full copy; past ~20% a bf16 tensor is staged densely and swapped whole.
SWEEP = (0.005, 0.01, 0.02, 0.035, 0.05, 0.1, 0.25, 0.5)
QUICK_SWEEP = (0.01, 0.05)
#: One codec for every delta (not the default, auto, which alternates codecs while it learns): the figures
#: here are the pause and the stages of one codec, comparable from run to run.
CODEC = "context"

log = logging.getLogger("ckptdelta.bench")


# --- one size on one backend --------------------------------------------------------------------

def _bits_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    from ckptdelta.delta import dtypes

    return a.keys() == b.keys() and all(
        torch.equal(dtypes.torch_bits_view(a[k].reshape(-1).cpu()), dtypes.torch_bits_view(b[k].reshape(-1).cpu()))
        for k in a)


def _on_host(device: str) -> bool:
    """Whether live weights on ``device`` are in host memory (then they are the trainer's tensors themselves,
    and the bare scatter and cache-line share are measured beside the pause)."""
    return torch.device(device).type == "cpu"


def _device_name(device: str) -> str:
    dev = torch.device(device)
    return torch.cuda.get_device_name(dev) if dev.type == "cuda" else "host memory" if dev.type == "cpu" else device


def _sync(live: dict[str, torch.Tensor]) -> None:
    """Wait for the devices of ``live`` (copies on a GPU are queued, not done, when copy_ returns)."""
    for d in {t.device for t in live.values() if t.device.type == "cuda"}:
        torch.cuda.synchronize(d)


def _changed_elements(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> int:
    from ckptdelta.delta import dtypes

    return sum(int((dtypes.torch_bits_view(old[k].reshape(-1)) != dtypes.torch_bits_view(new[k].reshape(-1))).sum())
               for k in old)


def _sparse_step(weights: dict[str, torch.Tensor], fraction: float, seed: int) -> int:
    """Move ~``fraction`` of the elements of every tensor by one ulp, in place; returns the count."""
    from ckptdelta.delta import dtypes

    g = torch.Generator().manual_seed(seed)
    n = 0
    for t in weights.values():
        k = max(1, int(t.numel() * fraction))
        pos = torch.unique(torch.randint(t.numel(), (k,), generator=g))
        bits = dtypes.torch_bits_view(t.reshape(-1))
        bits[pos] ^= 1  # the lowest mantissa bit: the neighbouring representable value
        n += pos.numel()
    return n


def _diff_positions(live: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Per tensor, the flat positions where ``new`` differs from ``live`` (numpy int64, sorted)."""
    from ckptdelta.delta import dtypes

    return {k: (dtypes.host_bits(live[k]) != dtypes.host_bits(new[k])).nonzero()[0] for k in live}


CACHE_LINE = 64


def _lines_share(live: dict[str, torch.Tensor], changed: dict[str, Any]) -> float:
    """The share of the model's 64-byte cache lines that hold a change. An in-place write must bring each
    of them into the cache and write it back, where a copy streams every line: a scatter's pause over a
    copy tends to this share as its own overheads go (1% of bf16 elements spread at random hold 27% of the
    lines: 1 - 0.99 ** 32)."""
    from ckptdelta.delta import kernels

    touched = total = 0
    for k, pos in changed.items():
        t = live[k]
        start, size = t.data_ptr() % CACHE_LINE, t.element_size()
        total += (start + t.numel() * size - 1) // CACHE_LINE + 1
        touched += kernels.count_lines(pos * size + start, CACHE_LINE.bit_length() - 1)   # byte offsets, sorted
    return touched / max(1, total)


def _bare_scatter(live: dict[str, torch.Tensor], changed: dict[str, Any], threads: int, repeats: int = 1) -> float:
    """Seconds to write the changed elements' bits over themselves (live is already the new version, so
    nothing changes): a plain scatter of the same positions and values with no check of the old bits, no
    undo and no per-tensor work, each tensor's positions cut in ``threads`` contiguous parts on as many
    threads (the commit's own count, and its own kind: torch's OpenMP team where the commit uses it, else
    Python threads), once right after the commit as the copies are measured once before and after it (the
    fastest of ``repeats`` with more: later runs find the pages mapped and part of the data in cache, which
    the commit does not). The floor under the commit's scatter on this machine: its memory traffic (every
    cache line that holds a change read and written back, the positions and values streamed) is all that
    is left."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np

    from ckptdelta.delta import dtypes, kernels, omp

    parts: list[list[tuple[Any, Any, Any]]] = [[] for _ in range(threads)]
    for k, pos in changed.items():
        if pos.shape[0] == 0:
            continue
        bits = dtypes.host_bits(live[k])        # a view: contiguous CPU tensors
        for i, p in enumerate(np.array_split(pos, threads)):
            parts[i].append((bits, p, bits[p]))
    best = float("inf")
    team = omp.team() if threads > 1 else None
    if team is not None:
        from benchmarks.bare_scatter import table, team_entry

        tab, keep = table(parts)
        for _ in range(repeats):
            tab[0] = 0
            t0 = time.perf_counter()
            team.run(team_entry(), tab.ctypes.data, threads)
            best = min(best, time.perf_counter() - t0)
        del keep
        return best
    with ThreadPoolExecutor(threads) as ex:
        for _ in range(repeats):
            ready, go = threading.Barrier(threads + 1), threading.Event()

            def run(part: list[tuple[Any, Any, Any]]) -> float:
                ready.wait()                     # every thread up before the clock starts
                go.wait()
                for bits, p, v in part:
                    kernels.scatter(bits, p, v)
                return time.perf_counter()

            futures = [ex.submit(run, part) for part in parts]
            ready.wait()
            t0 = time.perf_counter()
            go.set()
            best = min(best, max(f.result() for f in futures) - t0)
    return best


def _delta_step(pub: Any, swapper: Any, weights: dict, step: int, around: Any = None,
                live: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """One publish and hot-load; ``around`` (untimed) runs right before and right after the commit: the full
    copy of the model is measured there, paired with the pause under the same load. With ``live`` (the
    swapper's weights) the bare scatter of the same changes (:func:`_bare_scatter`) is measured after it."""
    changed = _diff_positions(live, weights) if live is not None else None
    t0 = time.perf_counter()
    res = pub.publish(weights, step)
    t1 = time.perf_counter()
    prepared = swapper.prepare(res.version)
    tp = time.perf_counter()
    threads = prepared.batch.threads if getattr(prepared, "batch", None) is not None else 1
    before = around() if around is not None else None
    tc = time.perf_counter()
    rep = swapper.commit(prepared)
    t2 = time.perf_counter()
    pair = {}
    if around is not None:
        after = around()
        pair = {"copy_before_s": before, "copy_after_s": after, "pause_over_copy": 2 * rep.pause_s / (before + after)}
    t2 -= tc - tp   # the copy before the commit is not the hot-load's time
    if changed is not None:
        floor = _bare_scatter(live, changed, threads)
        pair.update(floor_s=floor, floor_over_copy=2 * floor / (before + after) if around is not None else None,
                    lines_share=_lines_share(live, changed))
    return {**pair, "version": res.version, "kind": res.kind, "stored_bytes": res.stored_bytes,
            "full_bytes": res.full_bytes, "copy_s": res.copy_s, "encode_s": res.encode_s,
            "upload_s": res.upload_s, "commit_s": res.commit_s, "publish_s": t1 - t0,
            "fetch_s": rep.fetch_s, "decode_s": rep.decode_s, "apply_s": rep.apply_s, "pause_s": rep.pause_s,
            "hotload_s": t2 - t1, "bytes_fetched": rep.bytes_fetched, "elements_changed": rep.elements_changed,
            "changed_bytes": rep.elements_changed * 2, "total_s": t2 - t0, "tensors_changed": rep.tensors_changed,
            "tensors_copied": rep.tensors_copied, "staging_bytes": rep.staging_bytes}


def _full_copy(live: dict[str, torch.Tensor]) -> float:
    """Seconds of a plain copy of the whole model into the live tensors from a staged copy of it (the same
    bits: the live weights stay the version they are). The staged copy is made, and first touched, untimed."""
    staged = {k: t.clone() for k, t in live.items()}
    _sync(live)
    t0 = time.perf_counter()
    with torch.no_grad():
        for k, t in staged.items():
            live[k].copy_(t)
    _sync(live)
    dt = time.perf_counter() - t0
    del staged
    return dt


def _paired(med: dict[str, Any]) -> dict[str, Any]:
    """Copy figures of a median step whose samples were measured with their full copies around the commit."""
    copies = [c for x in med["samples"] for c in (x["copy_before_s"], x["copy_after_s"])]
    med.update(model_copy_s=statistics.median(copies), model_copy_samples=copies, model_copy_min_s=min(copies),
               pause_over_fastest_copy=med["pause_s"] / min(copies))
    return med      # med["pause_over_copy"]: the median of each commit's pause over its own copies' mean


def _sweep(pub: Any, swapper: Any, new: dict[str, torch.Tensor], live: dict[str, torch.Tensor], version: int,
           repeats: int, fractions: tuple[float, ...], floor: bool = True) -> tuple[list[dict[str, Any]], int]:
    """The pause at each share of changed elements beside a full copy of the model right before and after it
    (with ``floor``, and the bare scatter of the same changes after it: host memory only)."""
    out = []
    for i, frac in enumerate(fractions):
        samples = []
        for _ in range(max(repeats, 1)):   # the same positions each time: on, off, on
            n = _sparse_step(new, frac, seed=100 + i)
            version += 1
            step = _delta_step(pub, swapper, new, version, around=lambda: _full_copy(live),
                               live=live if floor else None)
            step["elements_changed_expected"] = n
            step["bit_exact"] = _bits_equal(live, new)
            samples.append(step)
        med = _paired(median_sample(samples))
        med["fraction"] = frac
        out.append(med)
    return out, version


def _full_checkpoint(root: str, opts: dict | None, new: dict[str, torch.Tensor], live: dict[str, torch.Tensor],
                     scratch: str) -> dict[str, Any]:
    """What users do today: write the whole snapshot, read it back whole, copy it into the live tensors."""
    import fsspec
    from safetensors.torch import load_file, save_file

    remote = "://" in root
    fs, base = fsspec.core.url_to_fs(root, **(opts or {}))
    key = f"{base}/full/step-00000001.safetensors"
    fs.makedirs(f"{base}/full", exist_ok=True)
    local_out = os.path.join(scratch, "out.safetensors") if remote else key
    t0 = time.perf_counter()
    save_file(new, local_out)
    t1 = time.perf_counter()
    if remote:
        fs.put_file(local_out, key)
        os.unlink(local_out)
    t2 = time.perf_counter()
    local_in = os.path.join(scratch, "in.safetensors") if remote else key
    if remote:
        fs.get_file(key, local_in)
    t3 = time.perf_counter()
    loaded = load_file(local_in)
    t4 = time.perf_counter()
    with torch.no_grad():
        for k, t in loaded.items():
            live[k].copy_(t)
    _sync(live)
    t5 = time.perf_counter()
    nbytes = fs.size(key)
    del loaded
    if remote:
        os.unlink(local_in)
    return {"stored_bytes": nbytes, "save_s": t1 - t0, "upload_s": t2 - t1, "download_s": t3 - t2,
            "load_s": t4 - t3, "copy_s": t5 - t4, "pause_s": t5 - t4, "total_s": t5 - t0}


def warm_up(root: str, opts: dict | None, device: str = "cpu") -> None:
    """One small publish/hot-load cycle first, so that numba's compile-or-load, thread pools and first-use
    imports are not charged to the first size measured (a trainer pays them once per process); with the live
    weights on ``device``, as measured (a GPU's context and the kernels the hot-load runs there load then)."""
    from ckptdelta.loader import HotSwapper, SnapshotReader
    from ckptdelta.publisher import Publisher

    g = torch.Generator().manual_seed(0)
    w = {f"w{i}": torch.randn(256, 1024, generator=g).to(torch.bfloat16) for i in range(4)}
    live = {k: v.clone().to(device) for k, v in w.items()}
    with Publisher(f"{root}/warm-up", storage_options=opts, progress=False, codec=CODEC) as pub:
        v0 = pub.publish(w, 0).version
        swapper = HotSwapper(live, SnapshotReader(f"{root}/warm-up", storage_options=opts), version=v0)
        for step, frac in ((1, 0.01), (2, 0.5)):      # sparse, then dense (staged whole: the swap path)
            _sparse_step(w, frac, seed=step)
            swapper.hotload(pub.publish(w, step).version)
        _full_copy(live)


def measure(size_gb: float, kind: str, root: str, opts: dict | None, *, quick: bool,
            repeats: int = 3, sweep: tuple[float, ...] = (), device: str = "cpu") -> dict[str, Any]:
    """One size on one backend. With ``repeats`` > 1 the step is published forward, back and forward again
    (the same changed elements each time; one extra copy of the weights is held for the way back). The
    replica's live weights are on ``device``; on the CPU they are the trainer's first snapshot itself."""
    from benchmarks.workloads import scaled_pair
    from ckptdelta.loader import HotSwapper, SnapshotReader
    from ckptdelta.publisher import Publisher

    t = time.perf_counter()
    old, new = scaled_pair(int(size_gb * 1e9), lr=1e-6, size="tiny" if quick else "small")
    build_s = time.perf_counter() - t
    model_bytes = sum(x.numel() * x.element_size() for x in new.values())
    n_elements = sum(x.numel() for x in new.values())
    expected_changed = _changed_elements(old, new)
    run = f"{root}/run-{size_gb:g}gb"
    out: dict[str, Any] = {"backend": kind, "size_gb": size_gb, "model_bytes": model_bytes, "elements": n_elements,
                           "tensors": len(new), "build_s": build_s, "repeats": repeats, "device": device}
    host = _on_host(device)
    with tempfile.TemporaryDirectory(prefix="ckptdelta-latency-") as scratch:
        pub = Publisher(run, storage_options=opts, progress=False, anchor_every=1000, anchor_chain_fraction=100.0,
                        codec=CODEC)
        try:
            t = time.perf_counter()
            anchor = pub.publish(old, 0)
            out["anchor"] = {"stored_bytes": anchor.stored_bytes, "publish_s": time.perf_counter() - t}
            if host:
                back = {k: v.clone() for k, v in old.items()} if repeats > 1 else None  # the trainer's v0 bits
                live = old  # the replica's live weights are these very tensors: no extra copy
            else:
                back = old if repeats > 1 else None
                live = {k: v.to(device, copy=True) for k, v in old.items()}
                _sync(live)
            old = None
            swapper = HotSwapper(live, SnapshotReader(run, storage_options=opts), version=anchor.version)
            version, samples = 0, []
            for i in range(repeats):
                target = new if i % 2 == 0 else back
                version += 1
                step = _delta_step(pub, swapper, target, version, around=(lambda: _full_copy(live)) if sweep else None,
                                   live=live if sweep and host else None)
                step["elements_changed_expected"] = expected_changed
                step["bit_exact"] = _bits_equal(live, target)
                samples.append(step)
            if repeats % 2 == 0:  # end on ``new``: the sparse steps and the full checkpoint start from it
                version += 1
                _delta_step(pub, swapper, new, version)
            del back
            out["delta"] = median_sample(samples)
            samples = []
            for i in range(repeats):  # the same positions each time: on, off, on
                n_sparse = _sparse_step(new, expected_changed / max(1, n_elements) / SPARSE_FACTOR, seed=1)
                version += 1
                step = _delta_step(pub, swapper, new, version)
                step["elements_changed_expected"] = n_sparse
                step["bit_exact"] = _bits_equal(live, new)
                samples.append(step)
            out["sparse"] = median_sample(samples)
            if sweep:
                out["sweep"], version = _sweep(pub, swapper, new, live, version, repeats, sweep, floor=host)
                real = out["delta"]
                _paired(out["delta"])
        finally:
            pub.close()
        del pub
        gc.collect()
        out["full"] = _full_checkpoint(run, opts, new, live, scratch)
        out["full"]["bit_exact"] = _bits_equal(live, new)
    out["speedup"] = out["full"]["total_s"] / out["delta"]["total_s"]
    return out


# --- tables, report ------------------------------------------------------------------------------

def _device_note(meta: dict) -> str:
    device = meta.get("device", "cpu")
    if _on_host(device):
        return ""
    return (f" The replica's live weights are on `{device}` ({meta.get('device_name', device)}); the trainer's "
            "weights, the publisher and the replica's fetch and decode are on the host. The pause is the hot-load's "
            "torch writes on the device, synchronized; the full copy of the model is a device-to-device `copy_`, "
            "the full checkpoint's copy the host-to-device `copy_` of the loaded file. The bare scatter and the "
            "cache-line share are host-memory figures: not measured here (-).")


def _floor_cells(d: dict) -> str:
    """The bare scatter, its share of the copy and the cache lines changed; '-' where not measured (a device)."""
    if d.get("floor_s") is None:
        return "- | - | -"
    return f"{ms(d['floor_s'])} | {d['floor_over_copy']:.2f}x | {100 * d['lines_share']:.0f}%"


def markdown(results: list[dict], meta: dict) -> str:
    lines = [
        "# Weight-update latency: publish() -> live weights swapped",
        "",
        f"{meta['machine']}; bf16 snapshots from `scaled_pair(..., lr=1e-6)`; ckptdelta columns: median of "
        f"{meta['repeats']} publish+hot-load cycles, full checkpoint: one run; "
        f"times in ms unless marked. ckptdelta = publish a delta + hot-load it (HotSwapper, same process); "
        f"full = safetensors save_file + upload, download + load_file + copy_ into the live tensors."
        + _device_note(meta),
        "",
        "| backend | model | changed | delta stored | host copy | encode | upload | commit | fetch | decode | "
        "pause | **ckptdelta total** | full: save | upload | download | load | copy (pause) | **full total** | "
        "full / ckptdelta |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        d, f = r["delta"], r["full"]
        changed = d["elements_changed_expected"] * 2
        lines.append(
            f"| {r['backend']} | {r['model_bytes'] / 1e9:.2f} GB | {changed / 1e6:.1f} MB "
            f"({100 * changed / r['model_bytes']:.2f}%) | {d['stored_bytes'] / 1e6:.1f} MB | "
            + " | ".join(ms(d[k]) for k in DELTA_PARTS) + f" | **{d['total_s']:.2f} s** | "
            + " | ".join(ms(f[k]) for k in FULL_PARTS) + f" | **{f['total_s']:.2f} s** | "
            f"{r['speedup']:.1f}x |")
    lines += [
        "",
        "Pause vs changed bytes and model size (the pause scatters the changed elements; "
        f"'sparse' = a step with ~{SPARSE_FACTOR}x fewer changed elements at the same model size):",
        "",
        "| backend | model | step | bytes written into the live weights | pause (ms, median) | pause (ms, min-max) | "
        "full-checkpoint copy pause (ms) |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    for r in results:
        for name in ("delta", "sparse"):
            d = r[name]
            step = "lr 1e-6" if name == "delta" else "sparse"
            pauses = [x["pause_s"] for x in d["samples"]]
            lines.append(f"| {r['backend']} | {r['model_bytes'] / 1e9:.2f} GB | {step}"
                         f" | {d['changed_bytes'] / 1e6:.2f} MB | {ms(d['pause_s'])} | "
                         f"{ms(min(pauses))}-{ms(max(pauses))} | {ms(r['full']['copy_s'])} |")
    swept = [r for r in results if r.get("sweep")]
    if swept:
        lines += [
            "",
            "The pause beside a full copy of the model (`live[k].copy_(staged[k])` of every tensor), measured right "
            "before and right after each commit, under the same load; **pause / copy** is the median over the "
            "commits of each one's pause over the mean of its two copies, then the median pause over the "
            "fastest copy of the step. Steps of random one-ulp changes, each hot-loaded forward, back and forward "
            "(medians), plus the lr 1e-6 step above. The commit scatters each "
            "changed tensor or copies it whole from a staged copy, whichever its share of changed elements makes "
            "cheaper (`ckptdelta.loader.batch_commit.COPY_ABOVE`), and swaps a tensor staged densely (past ~20% changed in "
            "bf16) with its staged bits. **Bare scatter**, the floor under a scatter on this "
            "machine: right after each commit, the same changed elements written over themselves by a plain numba "
            "scatter on as many threads as the commit used (torch's OpenMP team where the commit ran on it), once, "
            "with no check of the old bits, "
            "no undo and no per-tensor work (its cost is the memory traffic alone: every cache line holding a "
            "change read and written back, positions and values streamed), over the same copies. **Lines "
            "changed**: the share of the model's 64-byte cache lines that hold a change, each of which any "
            "in-place write must read and write back, where the copy streams them all:",
            "",
            "| backend | model | step | changed | tensors written whole | pause (ms, median) | pause (ms, min-max) | "
            "full copy of the model (ms, median) | fastest copy (ms) | **pause / copy** | pause / fastest copy | "
            "bare scatter (ms) | bare scatter / copy | lines changed |",
            "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in swept:
            rows = [("lr 1e-6", r["delta"])] + [("random", x) for x in r["sweep"]]
            for step, d in rows:
                copy_s, copy_min = d["model_copy_s"], d["model_copy_min_s"]
                pauses = [x["pause_s"] for x in d["samples"]]
                share = d["elements_changed_expected"] / max(1, r["elements"])
                lines.append(f"| {r['backend']} | {r['model_bytes'] / 1e9:.2f} GB | {step} | {100 * share:.2f}% | "
                             f"{d['tensors_copied']:g} / {d['tensors_changed']:g} | {ms(d['pause_s'])} | "
                             f"{ms(min(pauses))}-{ms(max(pauses))} | {ms(copy_s)} | {ms(copy_min)} | "
                             f"**{d['pause_over_copy']:.2f}x** | {d['pause_over_fastest_copy']:.2f}x | "
                             f"{_floor_cells(d)} |")
    lines += ["", "Growth with size (largest / smallest size, per backend):", ""]
    lines += growth_lines(results)
    lines += ["", "Targets:", ""] + [f"- {t}" for t in targets(results)]
    exact = all(r[k]["bit_exact"] for r in results for k in ("delta", "sparse", "full")) and all(
        d["bit_exact"] for r in results for d in r.get("sweep", ()))
    lines += ["", f"Every swap bit-exact: {exact}."]
    return "\n".join(lines) + "\n"


def growth_lines(results: list[dict]) -> list[str]:
    out = []
    for kind in sorted({r["backend"] for r in results}):
        rs = sorted((r for r in results if r["backend"] == kind), key=lambda r: r["model_bytes"])
        if len(rs) < 2:
            continue
        a, b = rs[0], rs[-1]
        size_x = b["model_bytes"] / a["model_bytes"]
        parts = [f"{k[:-2]} x{b['delta'][k] / max(a['delta'][k], 1e-9):.1f}" for k in DELTA_PARTS]
        fparts = [f"{k[:-2]} x{b['full'][k] / max(a['full'][k], 1e-9):.1f}" for k in FULL_PARTS
                  if a["full"][k] > 1e-4]
        out.append(f"- {kind}: model x{size_x:.1f}; ckptdelta {', '.join(parts)}, total "
                   f"x{b['delta']['total_s'] / a['delta']['total_s']:.1f}; full {', '.join(fparts)}, total "
                   f"x{b['full']['total_s'] / a['full']['total_s']:.1f}")
    return out


def targets(results: list[dict]) -> list[str]:
    out = []
    for r in results:
        if abs(r["size_gb"] - 1.0) > 1e-9:
            continue
        frac = r["delta"]["total_s"] / r["full"]["total_s"]
        if r["backend"] == "s3":
            out.append(f"publish-to-swapped at 1 GB through S3 <= 1/5 of the full checkpoint: "
                       f"{r['delta']['total_s']:.2f} s vs {r['full']['total_s']:.2f} s = 1/{1 / frac:.1f} "
                       f"-> {'met' if frac <= 0.2 else 'NOT met'}")
        out.append(f"pause at 1 GB ({r['backend']}) < 50 ms: {ms(r['delta']['pause_s'])} ms "
                   f"-> {'met' if r['delta']['pause_s'] < 0.05 else 'NOT met'}")
    for r in results:
        if not r.get("sweep"):
            continue
        tag = f"{r['backend']} {r['model_bytes'] / 1e9:.2f} GB"
        x, xf = r["delta"]["pause_over_copy"], r["delta"]["pause_over_fastest_copy"]
        floor = r["delta"].get("floor_s") is not None     # host memory only (not on a device)
        if not _on_host(r.get("device", "cpu")):
            tag += f" on {r['device']}"
        out.append(f"pause at ~1% changed (the lr 1e-6 step, {tag}) <= 0.2x a full copy of the model: {x:.2f}x of "
                   f"the median copy, {xf:.2f}x of the fastest -> {'met' if x <= 0.2 else 'NOT met'}"
                   + (f"; a bare scatter of the same changes takes {r['delta']['floor_over_copy']:.2f}x, and "
                      f"{100 * r['delta']['lines_share']:.0f}% of the model's cache lines hold a change"
                      if floor else ""))
        worst = max(r["sweep"], key=lambda d: d["pause_over_copy"])
        worst_f = max(r["sweep"], key=lambda d: d["pause_over_fastest_copy"])
        share = worst["elements_changed_expected"] / max(1, r["elements"])
        lo, hi = (100 * f(d["elements_changed_expected"] for d in r["sweep"]) / max(1, r["elements"])
                  for f in (min, max))
        out.append(f"pause <= 1.0x a full copy at every share changed, {lo:.1f}-{hi:.0f}% ({tag}): worst "
                   f"{worst['pause_over_copy']:.2f}x "
                   f"of the median copy at {100 * share:.1f}% ({worst_f['pause_over_fastest_copy']:.2f}x of the fastest "
                   f"at worst) -> {'met' if worst['pause_over_copy'] <= 1.0 else 'NOT met'}"
                   + (f"; a bare scatter of the same changes takes {worst['floor_over_copy']:.2f}x there, at most "
                      f"{max(d['floor_over_copy'] for d in r['sweep']):.2f}x over the sweep" if floor else ""))
    by = {(r["backend"], r["size_gb"]): r for r in results}
    for kind in sorted({r["backend"] for r in results}):
        sizes = sorted(s for (k, s) in by if k == kind)
        if len(sizes) >= 2:
            small, big = by[(kind, sizes[0])], by[(kind, sizes[-1])]
            out.append(
                f"pause follows changed bytes, not model size ({kind}): {big['model_bytes'] / 1e9:.1f} GB model with "
                f"{big['sparse']['changed_bytes'] / 1e6:.2f} MB changed pauses {ms(big['sparse']['pause_s'])} ms; "
                f"{small['model_bytes'] / 1e9:.1f} GB model with {small['delta']['changed_bytes'] / 1e6:.2f} MB "
                f"changed pauses {ms(small['delta']['pause_s'])} ms")
    return out


def plot(results: list[dict], path: str) -> None:
    plt = harness.pyplot()
    swept = [r for r in results if r.get("sweep")]
    with harness.figure(path, 1, 4 if swept else 3, figsize=(25 if swept else 19, 5.5)) as (_, axes):
        ax = list(axes)
        delta_colors = plt.get_cmap("Blues")([0.35 + 0.6 * i / len(DELTA_PARTS) for i in range(len(DELTA_PARTS))])
        full_colors = plt.get_cmap("Oranges")([0.35 + 0.6 * i / len(FULL_PARTS) for i in range(len(FULL_PARTS))])
        labels = []
        for x, r in enumerate(results):
            labels.append(f"{r['backend']}\n{r['model_bytes'] / 1e9:.2f} GB")
            bars = (("delta", DELTA_PARTS, delta_colors, -0.2), ("full", FULL_PARTS, full_colors, 0.2))
            for name, parts, cols, off in bars:
                bottom = 0.0
                for k, c in zip(parts, cols):
                    ax[0].bar(x + off, r[name][k], 0.38, bottom=bottom, color=c,
                              label=f"{'ckptdelta' if name == 'delta' else 'full'}: {k[:-2]}" if x == 0 else None)
                    bottom += r[name][k]
                ax[0].annotate(f"{r[name]['total_s']:.2f}s", (x + off, r[name]["total_s"]), ha="center", va="bottom",
                               fontsize=8)
        ax[0].set_xticks(range(len(labels)), labels)
        ax[0].set(ylabel="seconds", title="publish() -> live weights swapped\nckptdelta (left, blues) vs full "
                                          "checkpoint (right, oranges)")
        ax[0].legend(fontsize=7, ncol=2)

        for r in results:
            tag = f"{r['backend']} {r['model_bytes'] / 1e9:.2f} GB"
            for name, marker in (("delta", "o"), ("sparse", "s")):
                d = r[name]
                ax[1].scatter(d["changed_bytes"] / 1e6, 1000 * d["pause_s"], marker=marker,
                              label=f"{tag}: {'lr 1e-6 step' if name == 'delta' else 'sparse step'}")
            ax[1].scatter(r["model_bytes"] / 1e6, 1000 * r["full"]["copy_s"], marker="x",
                          label=f"{tag}: full reload (every byte)")
        ax[1].set(xlabel="bytes written into the live weights (MB)", ylabel="pause (ms)", xscale="log", yscale="log",
                  title="the pause follows the changed bytes")
        ax[1].legend(fontsize=7)

        for kind, ls in (("local", "-"), ("s3", "--")):
            rs = sorted((r for r in results if r["backend"] == kind), key=lambda r: r["model_bytes"])
            if not rs:
                continue
            xs = [r["model_bytes"] / 1e9 for r in rs]
            for k, c in zip(DELTA_PARTS, plt.get_cmap("tab10").colors):
                ax[2].plot(xs, [max(r["delta"][k], 1e-5) for r in rs], ls, color=c, marker="o",
                           label=f"ckptdelta {k[:-2]}" if kind == "local" or not any(
                               r["backend"] == "local" for r in results) else None)
            ax[2].plot(xs, [r["delta"]["total_s"] for r in rs], ls, color="navy", lw=2,
                       label=f"ckptdelta total ({kind})")
            ax[2].plot(xs, [r["full"]["total_s"] for r in rs], ls, color="black", lw=2, label=f"full total ({kind})")
        ax[2].set(xlabel="model size (GB)", ylabel="seconds", xscale="log", yscale="log",
                  title="growth with model size (solid: local dir, dashed: S3)")
        ax[2].legend(fontsize=7, ncol=2)
        for r in swept:
            xs = [100 * d["elements_changed_expected"] / r["elements"] for d in r["sweep"]]
            line = ax[3].plot(xs, [d["pause_over_copy"] for d in r["sweep"]], marker="o",
                              label=f"{r['backend']} {r['model_bytes'] / 1e9:.2f} GB: random changes")[0]
            if r["sweep"][0].get("floor_s") is not None:        # host memory only
                ax[3].plot(xs, [d["floor_over_copy"] for d in r["sweep"]], ls=":", color=line.get_color(),
                           label=f"{r['backend']} {r['model_bytes'] / 1e9:.2f} GB: bare scatter (floor)")
            ax[3].scatter([100 * r["delta"]["elements_changed_expected"] / r["elements"]],
                          [r["delta"]["pause_over_copy"]], marker="*", s=120, zorder=3,
                          label=f"{r['backend']} {r['model_bytes'] / 1e9:.2f} GB: lr 1e-6 step")
        if swept:
            ax[3].axhline(1.0, color="black", lw=1, ls="--")
            ax[3].axhline(0.2, color="grey", lw=1, ls=":")
            ax[3].set(xlabel="elements changed (%)", ylabel="pause / full copy of the model", ylim=(0, None),
                      title="the pause against a plain copy of the model")
            ax[3].legend(fontsize=7)


def main(argv: list[str] | None = None) -> int:
    p = harness.parser("update_latency", __doc__, quick="0.02 GB, local directory only (a smoke test)", s3=True)
    p.add_argument("--sizes", default="0.1,1", help="snapshot sizes in GB, comma-separated (default 0.1,1)")
    p.add_argument("--backends", default="local,s3", help="local and/or s3 (default both)")
    p.add_argument("--repeats", type=int, default=3,
                   help="hot-loads per step kind, median reported (default 3; 1 above 2 GB to bound memory)")
    p.add_argument("--sweep", default=None, metavar="FRACTIONS",
                   help="shares of elements changed for the pause-vs-copy sweep on the local backend, "
                        f"comma-separated (default {','.join(map(str, SWEEP))}; 'none' for no sweep)")
    p.add_argument("--device", default="cpu",
                   help="torch device of the replica's live weights (cpu, cuda, cuda:1...; default cpu)")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from ckptdelta.loader.servable import check_device

    check_device(a.device)
    on_host = _on_host(a.device)
    sizes = [0.02] if a.quick else [float(s) for s in a.sizes.split(",") if s]
    kinds = ["local"] if a.quick else [k for k in a.backends.split(",") if k]
    if a.sweep is None:
        fractions = QUICK_SWEEP if a.quick else SWEEP
    else:
        fractions = () if a.sweep == "none" else tuple(float(x) for x in a.sweep.split(",") if x)
    meta = {"machine": harness.machine(), "sizes_gb": sizes, "backends": kinds, "quick": a.quick,
            "repeats": a.repeats, "device": a.device, "device_name": _device_name(a.device)}
    results = []
    for kind in kinds:
        with harness.backend(kind, a.s3_url, a.storage_options) as (root, opts):
            warm_up(root, opts, a.device)
            for size in sizes:
                sweep = () if kind != "local" or size > 2 else fractions
                r = measure(size, kind, root, opts, quick=a.quick, repeats=a.repeats if size <= 2 else 1,
                            sweep=sweep, device=a.device)
                results.append(r)
                d, f = r["delta"], r["full"]
                print(f"{kind:>5} {r['model_bytes'] / 1e9:5.2f} GB: ckptdelta {d['total_s']:6.2f} s "
                      f"(delta {d['stored_bytes'] / 1e6:.1f} MB, pause {ms(d['pause_s'])} ms), "
                      f"full checkpoint {f['total_s']:6.2f} s (pause {ms(f['copy_s'])} ms): "
                      f"{r['speedup']:.1f}x", flush=True)
                gc.collect()
    suffix = ("-quick" if a.quick else "") + ("" if on_host else f"-{torch.device(a.device).type}")
    harness.write(os.path.join(a.out_dir, "update_latency" + suffix), markdown(results, meta),
                  {"meta": meta, "results": results}, lambda path: plot(results, path))
    ok = all(r[k]["bit_exact"] for r in results for k in ("delta", "sparse", "full")) and all(
        d["bit_exact"] for r in results for d in r.get("sweep", ()))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
