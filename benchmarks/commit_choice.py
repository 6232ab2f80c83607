"""Where copying a whole tensor beats scattering its changed elements, in the hot-swap pause.

For each element width (1, 2, 4, 8 bytes) and share of changed elements (random
positions), one tensor of ``--mb`` MB in host memory is committed by
:class:`ckptdelta.loader.batch_commit.CommitBatch` both ways, forced: **scatter** (each changed
element written after its old bits are compared with prepare's) and **copy** (a staged
copy of the new tensor written block by block, each block's live bytes hashed and
compared with prepare's hash first), on every core, beside a plain ``torch`` copy of the
tensor (the same bytes, no check). Each time is the median of ``--repeats`` commits;
every commit is checked bit-exact. The crossover per width is what
``ckptdelta.loader.batch_commit.COPY_ABOVE`` should hold for this machine.

    python -m benchmarks.commit_choice               # 256 MB per tensor, ~2 minutes on two cores
    python -m benchmarks.commit_choice --mb 64 --repeats 3

Writes benchmarks/results/commit_choice.{md,json,png}.
"""

from __future__ import annotations

import os
import statistics
import time

import numpy as np
import torch

from benchmarks import harness

DENSITIES = (0.005, 0.01, 0.02, 0.035, 0.05, 0.1, 0.2, 0.4)
WIDTHS = (1, 2, 4, 8)


def _positions(rng: np.random.Generator, n: int, density: float) -> np.ndarray:
    """Sorted random positions, each element changed with probability ``density`` (geometric gaps)."""
    gaps = rng.geometric(density, size=int(n * density * 1.2) + 16)
    pos = np.cumsum(gaps) - 1
    return pos[pos < n].astype(np.int64)


def measure(width: int, density: float, mb: int, repeats: int, rng: np.random.Generator) -> dict:
    from ckptdelta.delta import kernels
    from ckptdelta.loader import batch_commit

    dt = np.dtype(f"<u{width}")
    n = mb * (1 << 20) // width
    old = rng.integers(0, np.iinfo(dt).max, n, dtype=dt)
    live = old.copy()
    pos = _positions(rng, n, density)
    exp = old[pos]
    val = exp ^ dt.type(1)
    new = old.copy()
    new[pos] = val
    src, dst = torch.from_numpy(new.view(f"<i{width}") if width > 1 else new), torch.from_numpy(
        live.view(f"<i{width}") if width > 1 else live)
    out = {"width": width, "density": density, "changed": int(pos.shape[0]), "elements": n, "bytes": live.nbytes,
           "lines_touched": int(kernels.count_lines(pos, int(np.log2(64 // width)))), "lines": -(-live.nbytes // 64)}
    times: dict[str, list[float]] = {"scatter": [], "copy": [], "torch_copy": []}
    batches = {}
    for mode in ("scatter", "copy"):
        t0 = time.perf_counter()
        choice = batch_commit.choose(live, pos, val, mode)
        it = batch_commit.Item("t", "t", live, pos, exp, val, choice)
        batches[mode] = batch_commit.CommitBatch([it])
        out[f"{mode}_prepare_s"] = time.perf_counter() - t0
    for _ in range(repeats):
        for mode, b in batches.items():
            t0 = time.perf_counter()
            b.run()
            times[mode].append(time.perf_counter() - t0)
            if not np.array_equal(live, new):
                raise AssertionError(f"{mode} commit of width {width} at {density} is not bit-exact")
            b.undo()
            if not np.array_equal(live, old):
                raise AssertionError(f"{mode} undo of width {width} at {density} is not bit-exact")
        t0 = time.perf_counter()
        dst.copy_(src)
        times["torch_copy"].append(time.perf_counter() - t0)
        live[:] = old
    for k, v in times.items():
        out[f"{k}_s"] = statistics.median(v)
        out[f"{k}_samples"] = v
    out["threads"] = batches["scatter"].threads
    return out


def crossover(rows: list[dict], width: int) -> float | None:
    """The lowest density from which copying is faster at every density measured above it."""
    rs = sorted((r for r in rows if r["width"] == width), key=lambda r: r["density"])
    for i, r in enumerate(rs):
        if all(x["copy_s"] < x["scatter_s"] for x in rs[i:]):
            return r["density"]
    return None


def markdown(rows: list[dict], meta: dict) -> str:
    from ckptdelta.loader import batch_commit

    lines = ["# Hot-swap commit: scatter the changed elements or copy the whole tensor", "",
             f"{meta['machine']}; one tensor of {meta['mb']} MB per row, random changed positions, "
             f"{meta['threads']} commit threads; ms, median of {meta['repeats']}. `scatter` and `copy` are the two ways "
             "`ckptdelta.loader.batch_commit` writes a tensor in the pause (both check the old bits: at each changed element, "
             "or by 64 KiB block hashes); `torch copy` is a plain copy of the same bytes, no check.", "",
             "| width (bytes) | changed | cache lines touched | scatter | copy | torch copy | scatter / torch copy | "
             "copy / torch copy | cheaper |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        tc = r["torch_copy_s"]
        lines.append(f"| {r['width']} | {100 * r['density']:.1f}% | {100 * r['lines_touched'] / r['lines']:.0f}% | "
                     f"{1e3 * r['scatter_s']:.1f} | {1e3 * r['copy_s']:.1f} | {1e3 * tc:.1f} | "
                     f"{r['scatter_s'] / tc:.2f}x | {r['copy_s'] / tc:.2f}x | "
                     f"{'copy' if r['copy_s'] < r['scatter_s'] else 'scatter'} |")
    lines += ["", "Crossover (copy cheaper from this share on) vs `ckptdelta.loader.batch_commit.COPY_ABOVE`:", ""]
    for w in WIDTHS:
        c = crossover(rows, w)
        lines.append(f"- {w} byte(s): measured {'none up to ' + str(100 * DENSITIES[-1]) + '%' if c is None else f'{100 * c:.1f}%'}"
                     f", COPY_ABOVE {100 * batch_commit.COPY_ABOVE[w]:.1f}%")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: str) -> None:
    widths = sorted({r["width"] for r in rows})
    with harness.figure(path, 1, len(widths), figsize=(4.5 * len(widths), 4), sharey=True, squeeze=False) as (_, axes):
        for ax, w in zip(axes[0], widths):
            rs = sorted((r for r in rows if r["width"] == w), key=lambda r: r["density"])
            xs = [100 * r["density"] for r in rs]
            for k, label in (("scatter_s", "scatter"), ("copy_s", "copy (block-hash checked)")):
                ax.plot(xs, [r[k] / r["torch_copy_s"] for r in rs], marker="o", label=label)
            ax.axhline(1.0, color="black", lw=1, ls="--", label="plain torch copy")
            ax.set(xscale="log", xlabel="elements changed (%)", title=f"{w}-byte elements")
        axes[0][0].set_ylabel("time / plain copy of the tensor")
        axes[0][0].legend(fontsize=8)


def main(argv: list[str] | None = None) -> int:
    p = harness.parser("commit_choice", __doc__)
    p.add_argument("--mb", type=int, default=256, help="tensor size in MB (default 256)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--widths", default=",".join(map(str, WIDTHS)))
    p.add_argument("--densities", default=",".join(map(str, DENSITIES)))
    a = p.parse_args(argv)
    rng = np.random.default_rng(0)
    rows = []
    for w in (int(x) for x in a.widths.split(",")):
        for d in (float(x) for x in a.densities.split(",")):
            r = measure(w, d, a.mb, a.repeats, rng)
            rows.append(r)
            print(f"width {w} changed {100 * d:5.1f}%: scatter {1e3 * r['scatter_s']:7.1f} ms, copy "
                  f"{1e3 * r['copy_s']:7.1f} ms, torch copy {1e3 * r['torch_copy_s']:7.1f} ms", flush=True)
    meta = {"machine": harness.machine(), "mb": a.mb, "repeats": a.repeats,
            "threads": rows[0]["threads"] if rows else 1}
    harness.write(os.path.join(a.out_dir, "commit_choice"), markdown(rows, meta), {"meta": meta, "rows": rows},
                  lambda path: plot(rows, path))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
