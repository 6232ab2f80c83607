"""The fast path's zstd level, its dense/raw tries and its dense steps (in element order, and grouped by class), on
full-model steps and LoRA steps, beside XOR + zstd-3.

Each step is encoded by ``encode_many(..., threads=1)``: the fast path (``context=False``)
at zstd levels 3 and 1 with the dense/raw tries as they were (a try compressed wherever its
planes' order-0 estimate, read in full, was below the best payload), and as it is (level 1;
each try's planes weighed against sparse's own planes' estimate, both from a sample, or
against the payload at ``frames.SURELY_LARGER`` where the best is not sparse); its dense
steps in element order (encoding 7 for every dtype, as before encodings 8 and 9) and grouped by
class (now: 8, or 9 against the grandparent); the context coder at the default level; XOR +
zstd-3 per tensor (benchmarks/baselines.py) beside them.
Every record is decoded back and compared with the new bits, and staged as a replica's
hot-load prepares it (``codec.stage``), beside the chunk-by-chunk stage it replaced for
mostly changed records.

- **full-model steps**: benchmarks/workloads.py's reference workloads (a small Llama-style
  model trained by AdamW, bf16/fp8/fp32, 1 and 10 steps apart);
- **LoRA steps**: peft LoRA on every linear layer of a Llama-style base (benchmarks/lora_codec.py's
  trajectory), rank 16 and 64, lr 1e-4, fp32 as trained and cast to bf16; each step coded against the step
  before too (the grandparent), as a LoRA run's publisher codes every delta whose parent is a delta.

    python -m benchmarks.fast_path            # ~3-5 min on 2 cores
    python -m benchmarks.fast_path --quick    # tiny model, LoRA on 2 layers: ~1 min

Writes benchmarks/results/fast_path{,-quick}.{md,json,png}.
"""

from __future__ import annotations

import collections
import os
import statistics
import sys
import time
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from benchmarks import baselines, harness, lora_codec, workloads
from ckptdelta import delta
from ckptdelta.delta import chunks, codec, kernels
from ckptdelta.delta.encodings import frames
from ckptdelta.delta.encodings.grouped_step import WRITTEN as GROUPED

#: (label, context coder, zstd level, the tries as before, dense steps (where half a chunk changed; 40% for a dtype
#: grouped by class), grouped by class)
SETTINGS = (("fast, level 3, tries as before (before)", False, 3, True, False, False),
            ("fast, level 1, tries as before", False, 1, True, False, False),
            ("fast, level 1, sparse on dense chunks", False, 1, False, False, False),
            ("fast, level 1, dense steps in element order", False, 1, False, True, False),
            ("fast, level 1, dense steps grouped by class (now)", False, 1, False, True, True),
            ("context coder", True, chunks.DEFAULT_LEVEL, False, True, True))


def _may_beat_before(planes, plane_len: int, best: float, best_estimate: float | None = None) -> bool:
    """frames.may_beat as it was: the planes' estimate, read in full, below the best payload."""
    return kernels.planes_entropy_bytes(planes, plane_len, kernels.ENTROPY_BLOCK) < best


@contextmanager
def dense_steps(on: bool) -> Iterator[None]:
    """The fast path as it was before encoding 7 (sparse on every changed chunk), or as it is."""
    if on:
        yield
        return
    saved = chunks.DENSE_STEP_FRACTION, chunks.GROUPED_DENSE_FRACTION
    chunks.DENSE_STEP_FRACTION = chunks.GROUPED_DENSE_FRACTION = 2.0   # no chunk has more than all elements changed
    try:
        yield
    finally:
        chunks.DENSE_STEP_FRACTION, chunks.GROUPED_DENSE_FRACTION = saved


@contextmanager
def grouped_steps(on: bool) -> Iterator[None]:
    """The fast path's dense steps grouped by class (encodings 8 and 9, now), or in element order for every dtype
    (encoding 7, as before them): with no dtype written grouped, 8 and 9 take no chunk and 7 takes every one."""
    if on:
        yield
        return
    saved = set(GROUPED)
    GROUPED.clear()
    try:
        yield
    finally:
        GROUPED.update(saved)


@contextmanager
def chunkwise_stage() -> Iterator[None]:
    """A replica's stage of a mostly changed record as it was before the dense stage: every chunk's changes
    decoded into positions and values, then scattered over a copy of the parent (``codec._stage_chunkwise``)."""
    saved = codec._stage_dense
    codec._stage_dense = codec._stage_chunkwise
    try:
        yield
    finally:
        codec._stage_dense = saved


def stage_s(old: dict[str, torch.Tensor], encs: list, repeats: int, grand: dict[str, torch.Tensor] | None) -> float:
    """Median seconds to stage every record against its parent, as a replica's hot-load prepares it (one
    thread, the result's digest checked); every staged tensor is checked against the record's digest."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for e in encs:
            codec.stage(old[e.name], e, threads=1, grandparent=None if grand is None else grand[e.name])
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


@contextmanager
def tries_as_before(before: bool) -> Iterator[None]:
    """The dense/raw tries weighed as they were (see :func:`_may_beat_before`), or as they are."""
    if not before:
        yield
        return
    saved = frames.may_beat
    frames.may_beat = _may_beat_before
    try:
        yield
    finally:
        frames.may_beat = saved


def measure(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor], repeats: int,
            grand: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
    names = sorted(new)
    out: dict[str, Any] = {"elements": sum(t.numel() for t in new.values()),
                           "bytes_raw": sum(t.numel() * t.element_size() for t in new.values())}
    xor = baselines.XorZstd()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        enc = xor.encode(old, new)
        times.append(time.perf_counter() - t0)
    out["xor+zstd3"] = {"bytes": baselines.encoded_nbytes(enc), "encode_s": statistics.median(times)}
    g = grand or {}
    for label, context, level, before, dense, grouped in SETTINGS:
        times, decodes = [], []
        with tries_as_before(before), dense_steps(dense), grouped_steps(grouped):
            for _ in range(repeats):
                t0 = time.perf_counter()
                encs = list(delta.encode_many([(k, old[k], new[k], None, g.get(k)) for k in names], threads=1,
                                              context=context, level=level))
                times.append(time.perf_counter() - t0)
        for _ in range(repeats):            # every record decoded back (the replica's work), and compared
            t0 = time.perf_counter()
            got = {e.name: delta.decode(old[e.name], e, grandparent=g.get(e.name)) for e in encs}
            decodes.append(time.perf_counter() - t0)
        for e in encs:
            if not torch.equal(got[e.name].contiguous().view(torch.uint8), new[e.name].contiguous().view(torch.uint8)):
                raise AssertionError(f"{label}: {e.name} does not decode to the new bits")
        out[label] = {"bytes": sum(len(e.to_bytes()) for e in encs), "encode_s": statistics.median(times),
                      "decode_s": statistics.median(decodes), "stage_s": stage_s(old, encs, repeats, grand),
                      "encodings": dict(sum((collections.Counter(e.encoding_counts()) for e in encs),
                                            collections.Counter()))}
        with chunkwise_stage():
            out[label]["stage_chunkwise_s"] = stage_s(old, encs, repeats, grand)
    return out


def lora_steps(quick: bool) -> list[tuple[str, dict, dict, dict]]:
    """(name, parent, new, grandparent) of a LoRA step at each rank, fp32 and cast to bf16."""
    layers = 2 if quick else 16
    out = []
    for rank in ((16,) if quick else (16, 64)):
        grand, old, new = lora_codec.trajectory(1024 if not quick else 256, layers, rank, 1e-4, 4, 2)
        out.append((f"LoRA r{rank} fp32 ({layers} layers)", old, new, grand))
        out.append((f"LoRA r{rank} bf16 ({layers} layers)", *({k: v.to(torch.bfloat16) for k, v in s.items()}
                                                             for s in (old, new, grand))))
    return out


def _labels(out: dict[str, Any]) -> list[str]:
    """The columns of a run: XOR + zstd-3 and the settings it measured (a run from before a setting lacks it)."""
    return ["xor+zstd3", *(s[0] for s in SETTINGS if all(s[0] in r for _, r in out["rows"]))]


def markdown(out: dict[str, Any]) -> str:
    labels = _labels(out)
    lines = [f"# The fast path's zstd level, its dense/raw tries and its dense steps (`{out['command']}`)", "",
             f"{harness.machine()}. One thread, medians of {out['repeats']} encodes a step; bytes and encode time "
             "of each setting, in brackets its time over XOR + zstd-3's (per tensor, the same run), then the "
             "decode of every record (median of as many). *Tries as "
             "before*: a dense or raw try compressed wherever its planes' order-0 estimate (read in full) fell "
             "below the best payload; since: level 1, each try's planes weighed against the fast path's own "
             f"planes, both estimated from every {frames.SAMPLE_STRIDE}th block of {frames.SAMPLE_BLOCK} bytes "
             f"(where the best is not the fast path's: against {frames.SURELY_LARGER:g} of the payload, guessed "
             "first from that sample). *Sparse on dense chunks*: encoding 1 (gaps and steps, two frames) on "
             "every changed chunk, as before encoding 7; *dense steps in element order*: encoding 7 (every "
             f"element's step, one frame) on the chunks where at least {chunks.DENSE_STEP_FRACTION:g} of the "
             "elements changed, for every dtype, as before encodings 8 and 9; *grouped by class (now)*: a 16- or "
             f"8-bit float dtype's dense chunks (from {out.get('grouped_dense_fraction', 0.5):g} changed) as encoding 8 (the steps sorted by the parent's exponent), or 9 against the "
             "grandparent (the LoRA rows: each is coded against the step before too, as a LoRA run's publisher "
             "codes a delta whose parent is a delta). "
             "*Stage*: every record staged against its parent as a replica's hot-load prepares it (`codec.stage`, "
             "one thread, digests checked; median of as many); in brackets the same with a mostly changed record "
             "staged chunk by chunk, its changes as positions and values scattered over a copy, as before the "
             "dense stage (whose dense_step chunks decode every element straight into the copy).", "",
             "| step | " + " | ".join(labels) + " |", "|---|" + "---:|" * len(labels)]
    for name, r in out["rows"]:
        base = r["xor+zstd3"]["encode_s"]
        cells = [f"{r[k]['bytes'] / 1e6:.3f} MB, {1e3 * r[k]['encode_s']:.0f} ms"
                 + ("" if k == "xor+zstd3" else f" ({r[k]['encode_s'] / base:.2f}x)")
                 + (f", decode {1e3 * r[k]['decode_s']:.0f} ms" if "decode_s" in r[k] else "")
                 + (f", stage {1e3 * r[k]['stage_s']:.0f} ms (chunkwise {1e3 * r[k]['stage_chunkwise_s']:.0f})"
                    if "stage_s" in r[k] else "") for k in labels]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    now = SETTINGS[-2][0]
    if all("encodings" in r.get(now, {}) for _, r in out["rows"]):
        lines += ["", f"Chunk encodings of *{now}*:", ""]
        lines += [f"- {name}: " + ", ".join(f"{k} {v}" for k, v in sorted(r[now]["encodings"].items()))
                  for name, r in out["rows"]]
    return "\n".join(lines) + "\n"


def plot(out: dict[str, Any], path: str) -> None:
    labels = _labels(out)
    names = [n for n, _ in out["rows"]]
    with harness.figure(path, 1, 1, figsize=(14, 5)) as (fig, ax):
        w = 0.8 / len(labels)
        for i, k in enumerate(labels):
            ax.bar([x + (i - len(labels) / 2 + 0.5) * w for x in range(len(names))],
                   [r[k]["encode_s"] / r["xor+zstd3"]["encode_s"] for _, r in out["rows"]], w, label=k)
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=7)
        ax.set(ylabel="encode time / XOR + zstd-3's", title="fast path: encode time per step, one thread")
        ax.axhline(1.0, color="k", lw=0.5)
        ax.legend(fontsize=7)
        fig.tight_layout()


def main(argv: list[str] | None = None) -> int:
    p = harness.parser("fast_path", __doc__, quick="the tiny model's workloads and LoRA on 2 small layers",
                       from_json="only re-render the markdown and plot of a run")
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args(argv)
    stem = os.path.join(a.out_dir, "fast_path" + ("-quick" if a.quick else ""))
    if a.from_json:
        out = harness.read_json(a.from_json)
        for _, r in out["rows"]:        # a run from before encodings 8 and 9 named encoding 7's column so
            if "fast, level 1, dense steps (now)" in r:
                r[SETTINGS[3][0]] = r.pop("fast, level 1, dense steps (now)")
    else:
        rows = []
        for w in workloads.reference_workloads("small", quick=a.quick):
            rows.append((f"full model {w.name}", measure(w.old, w.new, a.repeats)))
            print(f"  {rows[-1][0]} done", flush=True)
        for name, old, new, grand in lora_steps(a.quick):
            rows.append((name, measure(old, new, a.repeats, grand)))
            print(f"  {name} done", flush=True)
        out = {"command": harness.command("fast_path", list(sys.argv[1:] if argv is None else argv)),
               "repeats": a.repeats, "grouped_dense_fraction": chunks.GROUPED_DENSE_FRACTION, "rows": rows}
    harness.write(stem, markdown(out), out, lambda path: plot(out, path))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
