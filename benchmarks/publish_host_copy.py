"""The trainer's host copy, per GB: fresh buffers, reused buffers, and the device-diff path.

``Publisher.publish`` copies the weights into host memory it owns before it returns
(the trainer then steps again at once). Measured on a bf16 snapshot of ``--gb`` GB
(:func:`benchmarks.workloads.scaled_pair`, AdamW at lr 1e-6: ~1% of elements change
per step; ``--fractions`` adds steps with that share of random elements changed):

- **fresh buffers**: ``copy_to_host`` into newly allocated memory every step (what
  the publisher did for CPU weights before it kept its buffers): the copy plus the
  first touch of every page. The freed snapshot's memory is handed back to the
  kernel first (glibc ``malloc_trim``), as it is for tensors above glibc's mmap
  threshold (32 MiB at most: most of an LLM's), so every step gets fresh pages;
- **reused buffers**: ``copy_to_host`` into the buffers of the snapshot before the
  parent (what it does now from the third publish on);
- **device diff**: ``Publisher(device_diff=True)``'s capture: the changed elements
  found against a copy of the last published bits on the weights' device, only
  their positions and values moved to the host, the new snapshot built in reused
  buffers. On a CPU-only machine "the device" is the CPU: the diff's torch ops run
  on the CPU too, so this row shows the host side's cost (two scatters of the
  changes) plus a CPU compare, not a GPU's;
- **publish() copy_s**: the same, through ``Publisher.publish`` on a local
  directory (median ``copy_s`` of the steps after the first two).

With CUDA (``--device cuda``, the default when one is there) the sources are on the
GPU and the copies go to pinned host buffers. Medians of ``--repeats`` steps.

    python -m benchmarks.publish_host_copy                  # 1 GB, ~1 minute
    python -m benchmarks.publish_host_copy --gb 0.25 --repeats 3

Writes benchmarks/results/publish_host_copy.{md,json,png}.
"""

from __future__ import annotations

import gc
import os
import statistics
import tempfile
import time

import torch

from benchmarks import harness


def _flip(base: dict[str, torch.Tensor], fraction: float, seed: int) -> dict[str, torch.Tensor]:
    """A copy of ``base`` with ~``fraction`` of each tensor's elements moved by one ulp at random positions."""
    from ckptdelta.delta import dtypes

    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, t in base.items():
        t = t.clone()
        n = max(1, int(t.numel() * fraction))
        bits = dtypes.torch_bits_view(t.view(-1))
        bits[torch.randint(t.numel(), (n,), generator=g)] ^= 1
        out[k] = t
    return out


def _gb(w: dict[str, torch.Tensor]) -> float:
    return sum(t.numel() * t.element_size() for t in w.values()) / 1e9


def _changed(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    from ckptdelta.delta import dtypes

    n = sum(t.numel() for t in a.values())
    c = sum(int((dtypes.torch_bits_view(a[k].view(-1)) != dtypes.torch_bits_view(b[k].view(-1))).sum()) for k in a)
    return c / n


def _trim() -> None:
    """Give freed heap memory back to the kernel (glibc), so that the next allocation is fresh pages."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _time(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(steps: list[dict[str, torch.Tensor]], repeats: int, device: str) -> dict:
    """Per-GB seconds of each way to take the host copy, alternating between the given step snapshots."""
    from ckptdelta.publisher.device_diff import DeviceDiff
    from ckptdelta.publisher.host_copy import copy_to_host, spares

    src = [{k: t.to(device) for k, t in s.items()} for s in steps]
    gb = _gb(steps[0])
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    out: dict = {"gb": gb, "device": device}

    fresh = []
    parent = copy_to_host(src[0], {})
    for i in range(repeats):      # the publisher's old way: a new snapshot beside the parent, then it replaces it
        sync()
        holder: dict = {}
        fresh.append(_time(lambda: holder.update(copy_to_host(src[(i + 1) % len(src)], {}))))
        parent = holder
        gc.collect()
        _trim()
    out["fresh_s"] = fresh
    del parent, holder

    parent = copy_to_host(src[0], {})
    spare = spares(copy_to_host(src[1 % len(src)], {}))
    reuse = []
    for i in range(repeats):
        sync()
        holder: dict = {}
        reuse.append(_time(lambda: holder.update(copy_to_host(src[i % len(src)], spare))))
        spare, parent = spares(parent), holder
    out["reuse_s"] = reuse
    del parent, spare, holder
    gc.collect()

    dd = DeviceDiff()
    parent = dd.capture(src[0], {}, None, {})
    dd.committed(0)
    spare: dict = {}
    diff, moved = [], []
    for i in range(repeats):
        sync()
        holder = {}
        diff.append(_time(lambda: holder.update(dd.capture(src[(i + 1) % len(src)], parent, i, spare))))
        dd.committed(i + 1)
        moved.append(dd.stats.bytes_moved)
        spare, parent = spares(parent), holder
    out["diff_s"] = diff[1:] if len(diff) > 1 else diff     # the first one copies the parent into a new buffer
    out["diff_bytes_moved"] = statistics.median(moved)
    del parent, spare, holder, dd
    gc.collect()
    for k in ("fresh_s", "reuse_s", "diff_s"):
        out[k.replace("_s", "_s_per_gb")] = statistics.median(out[k]) / gb
    return out


def publish_copy_s(steps: list[dict[str, torch.Tensor]], repeats: int, device: str, device_diff: bool) -> float:
    """Median ``PublishResult.copy_s`` per GB through a real Publisher on a local directory."""
    from ckptdelta.publisher import Publisher

    src = [{k: t.to(device) for k, t in s.items()} for s in steps]
    copies = []
    with tempfile.TemporaryDirectory(prefix="ckptdelta-hostcopy-") as d:
        with Publisher(os.path.join(d, "run"), device_diff=device_diff, progress=False, anchor_every=1000,
                       anchor_chain_fraction=100.0) as pub:
            for i in range(repeats + 2):
                r = pub.publish(src[i % len(src)], i)
                if i >= 2:
                    copies.append(r.copy_s)
    return statistics.median(copies) / _gb(steps[0])


def markdown(rows: list[dict], meta: dict) -> str:
    lines = ["# The trainer's host copy in publish(): seconds per GB", "",
             f"{meta['machine']}; bf16, {meta['gb']:.2f} GB snapshots from `scaled_pair(..., lr=1e-6)` (and random "
             f"one-ulp steps); median of {meta['repeats']} steps; sources on `{meta['device']}`.", "",
             "| step | changed | fresh buffers | reused buffers | device diff | bytes moved (diff) | "
             "publish() copy_s, reused | publish() copy_s, device_diff |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['step']} | {100 * r['changed']:.2f}% | {r['fresh_s_per_gb']:.3f} s | "
                     f"{r['reuse_s_per_gb']:.3f} s | {r['diff_s_per_gb']:.3f} s | "
                     f"{r['diff_bytes_moved'] / 1e6:.1f} MB ({100 * r['diff_bytes_moved'] / (r['gb'] * 1e9):.1f}%) | "
                     f"{harness.value(r.get('publish_reuse_s_per_gb'), 's')} | "
                     f"{harness.value(r.get('publish_diff_s_per_gb'), 's')} |")
    lines += ["", "Fresh buffers pay the kernel's first touch of every page on top of the copy (the freed "
              "snapshot's memory is given back to the kernel before each step, as glibc does for tensors above "
              "its mmap threshold); reused buffers pay the copy only. The device diff moves positions and values only (int32 positions: 4 + 2 "
              "bytes per changed bf16 element); " + ("on this CPU-only machine its compare runs on the CPU too, so it shows the host "
                              "side's cost, not what a GPU's compare would cost."
                              if meta["device"] == "cpu" else
                              f"here the sources are on `{meta['device']}`: the device diff column is the device-side "
                              "diff itself (the compare against the last published bits and the gather of the "
                              "changed elements run on the GPU, then positions and values cross to pinned host "
                              "memory and the host snapshot is built from them by two scatters), against copies of "
                              "the whole model into pinned buffers in the two columns before it.")]
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: str) -> None:
    with harness.figure(path, figsize=(9, 4.5)) as (_, ax):
        ways = (("fresh_s_per_gb", "fresh buffers"), ("reuse_s_per_gb", "reused buffers"),
                ("diff_s_per_gb", "device diff"))
        width = 0.8 / len(ways)
        for i, (k, label) in enumerate(ways):
            ax.bar([x + i * width for x in range(len(rows))], [r[k] for r in rows], width, label=label)
        ax.set_xticks([x + width for x in range(len(rows))],
                      [f"{r['step']}\n{100 * r['changed']:.2f}% changed" for r in rows])
        ax.set(ylabel="seconds per GB", title=f"publish()'s host copy ({rows[0]['device']} sources)")
        ax.legend()


def main(argv: list[str] | None = None) -> int:
    p = harness.parser("publish_host_copy", __doc__)
    p.add_argument("--gb", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--fractions", default="0.001,0.05", help="extra steps: shares of random elements changed")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args(argv)
    from benchmarks.workloads import scaled_pair

    old, new = scaled_pair(int(a.gb * 1e9), lr=1e-6, size="small")
    cases = [("AdamW lr 1e-6", [old, new])]
    for f in (float(x) for x in a.fractions.split(",") if x):
        cases.append((f"random {100 * f:g}%", [old, _flip(old, f, seed=1)]))
    rows = []
    for name, steps in cases:
        r = measure(steps, a.repeats, a.device)
        r["step"], r["changed"] = name, _changed(steps[0], steps[1])
        if name == cases[0][0]:
            r["publish_reuse_s_per_gb"] = publish_copy_s(steps, a.repeats, a.device, False)
            r["publish_diff_s_per_gb"] = publish_copy_s(steps, a.repeats, a.device, True)
        rows.append(r)
        print(f"{name}: fresh {r['fresh_s_per_gb']:.3f} s/GB, reused {r['reuse_s_per_gb']:.3f} s/GB, "
              f"device diff {r['diff_s_per_gb']:.3f} s/GB", flush=True)
        gc.collect()
    meta = {"machine": harness.machine(), "gb": rows[0]["gb"], "repeats": a.repeats, "device": a.device}
    harness.write(os.path.join(a.out_dir, "publish_host_copy"), markdown(rows, meta), {"meta": meta, "rows": rows},
                  lambda path: plot(rows, path))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
