"""Codec benchmark: ckptdelta's delta codec beside what users run today, on the same data, in one run.

For every reference workload (benchmarks/workloads.py) it prints compression ratio
(model bytes / encoded bytes), encode MB/s and decode+apply MB/s of model bytes,
checks every codec round-trips bit-exactly, and prints the empirical entropy of
the change so each codec can be judged against the limit. Timings are medians
of repeats on one core (threads=1) unless the row says otherwise.

    python -m benchmarks.codec            # small model, every workload
    python -m benchmarks.codec --quick    # tiny model, five workloads, < 1 minute

Writes benchmarks/results/codec.{md,json,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from dataclasses import dataclass

import torch

import delta
from benchmarks import baselines, entropy, workloads

RESULTS = os.path.join(os.path.dirname(__file__), "results")


class CkptDelta(baselines.Baseline):
    """This project's codec as the benchmark sees it: one record per changed tensor;
    an unchanged tensor costs only its manifest entry (no record). Tensors go through
    encode_many/apply_many, so ``threads`` spreads them (not only their chunks) over cores."""

    def __init__(self, threads: int = 1, level: int = 3, context: bool = True):
        self.threads, self.level, self.context = threads, level, context
        self.name = "ckptdelta" + ("" if context else " fast (no ctx)") + ("" if threads == 1 else f" ({threads} threads)")

    def encode(self, old, new):
        items = []
        for k in sorted(new):
            o, n = old.get(k), new[k]
            parent = o if o is not None and o.shape == n.shape and o.dtype == n.dtype else None
            items.append((k, parent, n))
        out = []
        for enc in delta.encode_many(items, threads=self.threads, level=self.level, context=self.context):
            if enc.header.has_parent and all(c.encoding == 0 for c in enc.header.chunks):
                out.append(b"")          # unchanged: manifest entry only
            else:
                out.append(enc.to_bytes())
        return out

    def decode(self, old, blobs):
        """Apply in place on a copy of ``old`` (the copy is made by the caller, untimed)."""
        live = old
        delta.apply_many(((live[k], b) for k, b in zip(sorted(live), blobs) if b), threads=self.threads)
        return live


@dataclass
class Row:
    workload: str
    codec: str
    ratio: float | None
    encoded_bytes: int | None
    encode_mbs: float | None
    decode_mbs: float | None
    exact: bool | None
    note: str = ""


def _median_time(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def _bits_equal(a: dict, b: dict) -> bool:
    if set(a) != set(b):
        return False
    return all(a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
               and delta.digest(a[k]) == delta.digest(b[k]) for k in a)


def _clone(sd: dict) -> dict:
    return {k: v.clone() for k, v in sd.items()}


def run_codec(codec, w: workloads.Workload, repeats: int) -> Row:
    full = baselines.dense_nbytes(w.new)
    if not codec.supports(w.new):
        return Row(w.name, codec.name, None, None, None, None, None, "n/a (dtype unsupported)")
    enc_s, blobs = _median_time(lambda: codec.encode(w.old, w.new), repeats)
    size = baselines.encoded_nbytes(blobs)
    dec_times, out = [], None
    for _ in range(repeats):
        old = _clone(w.old)
        t0 = time.perf_counter()
        out = codec.decode(old, blobs)
        dec_times.append(time.perf_counter() - t0)
    dec_s = statistics.median(dec_times)
    mb = full / 1e6
    return Row(w.name, codec.name, full / max(1, size), size, mb / enc_s, mb / dec_s, _bits_equal(out, w.new))


def entropy_line(w: workloads.Workload) -> dict:
    e = baselines.change_entropy(w.old, w.new)
    out = {k: v for k, v in e.items() if not isinstance(v, dict)}
    ce = entropy.conditional_entropy(w.old, w.new)
    out.update(ctx_pos_bits=ce["pos_bits"], ctx_step_bits=ce["step_bits"], ctx_ratio_limit=ce["ratio_limit"])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny model, five workloads, one repeat")
    ap.add_argument("--size", default=None, help="workload model size (tiny, small)")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--only", default=None, help="substring filter on workload names")
    ap.add_argument("--out", default=RESULTS, help="directory for codec.md/json/png")
    ap.add_argument("--no-plot", action="store_true")
    args = ap.parse_args(argv)
    repeats = args.repeats or (1 if args.quick else 3)
    wl = workloads.reference_workloads(size=args.size or ("tiny" if args.quick else "small"), quick=args.quick)
    if args.only:
        wl = [w for w in wl if args.only in w.name]
    codecs = baselines.all_baselines() + [CkptDelta(threads=1), CkptDelta(threads=1, context=False)]
    if (os.cpu_count() or 1) > 1 and not args.quick:
        codecs.append(CkptDelta(threads=os.cpu_count()))
    # warm the numba kernels (encode and decode, every dtype) so compile time is not billed to a workload
    g = torch.Generator().manual_seed(0)
    for dt in (torch.bfloat16, torch.float8_e4m3fn, torch.float32):
        a = (torch.randn(4096, generator=g) * 0.02).to(dt)
        b = (a.float() + torch.randn(4096, generator=g) * 1e-3).to(dt)
        CkptDelta().decode({"w": a.clone()}, CkptDelta().encode({"w": a}, {"w": b}))

    rows: list[Row] = []
    entropies: dict[str, dict] = {}
    for w in wl:
        entropies[w.name] = entropy_line(w)
        for c in codecs:
            rows.append(run_codec(c, w, repeats))
    report = render(rows, entropies, wl)
    print(report)
    os.makedirs(args.out, exist_ok=True)
    tag = "codec-quick" if args.quick else "codec"
    with open(os.path.join(args.out, f"{tag}.md"), "w") as f:
        f.write(report)
    with open(os.path.join(args.out, f"{tag}.json"), "w") as f:
        json.dump({"machine": _machine(), "repeats": repeats, "rows": [r.__dict__ for r in rows],
                   "entropy": entropies}, f, indent=1)
    if not args.no_plot:
        plot(rows, os.path.join(args.out, f"{tag}.png"))
    bad = [r for r in rows if r.exact is False]
    if bad:
        print("NOT BIT-EXACT:", [(r.workload, r.codec) for r in bad])
        return 1
    return 0


def _machine() -> dict:
    return {"python": platform.python_version(), "torch": torch.__version__, "cpus": os.cpu_count(),
            "processor": platform.processor() or platform.machine()}


def render(rows: list[Row], entropies: dict, wl: list) -> str:
    lines = ["# Codec benchmark", "",
             "ratio = model bytes / encoded bytes; MB/s of model bytes, median of repeats, one core unless noted.", ""]
    for w in wl:
        e = entropies[w.name]
        lines += [f"## {w.name}  ({baselines.dense_nbytes(w.new) / 1e6:.1f} MB)", "",
                  f"changed: {100 * e['frac_changed']:.3f}% of elements; order-0 entropy per changed element: "
                  f"positions {e['pos_bits_gap']:.2f} bits (gaps) / {e['pos_bits_iid']:.2f} (iid), "
                  f"values {e['val_bits_step']:.2f} bits (ulp steps) / {e['val_bits_new']:.2f} (new value); "
                  f"limit ratio ~{e['ratio_limit']:.1f}x; given the parent's exponent (benchmarks/entropy.py): "
                  f"positions {e['ctx_pos_bits']:.2f} + steps {e['ctx_step_bits']:.2f} bits, "
                  f"limit ratio ~{e['ctx_ratio_limit']:.1f}x", "",
                  "| codec | ratio | encoded | encode MB/s | decode+apply MB/s | bit-exact |",
                  "|---|---:|---:|---:|---:|:-:|"]
        mine = [r for r in rows if r.workload == w.name]
        best_base = max((r.ratio or 0) for r in mine if r.codec.startswith(("xor+", "sparse-idx+"))) or None
        for r in mine:
            if r.ratio is None:
                lines.append(f"| {r.codec} | {r.note} | | | | |")
                continue
            rel = f" ({r.ratio / best_base:.2f}x best of XOR/indices)" if best_base and r.codec.startswith("ckptdelta") else ""
            lines.append(f"| {r.codec} | {r.ratio:.1f}{rel} | {r.encoded_bytes:,} | {r.encode_mbs:,.0f} | "
                         f"{r.decode_mbs:,.0f} | {'yes' if r.exact else 'NO'} |")
        lines.append("")
    return "\n".join(lines)


def plot(rows: list[Row], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r.workload for r in rows))
    codecs = list(dict.fromkeys(r.codec for r in rows))
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(names)), 4.5))
    width = 0.8 / len(codecs)
    for i, c in enumerate(codecs):
        ys = [next((r.ratio or 0 for r in rows if r.workload == n and r.codec == c), 0) for n in names]
        ax.bar([j + i * width for j in range(len(names))], ys, width, label=c)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(names))], names, rotation=20, ha="right", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("compression ratio (log)")
    ax.set_title("Lossless delta size: model bytes / encoded bytes")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
