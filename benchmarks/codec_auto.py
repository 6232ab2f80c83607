"""``Publisher(codec="auto")`` at two link speeds, beside always-context and always-fast in the same run.

The reference workload (:func:`benchmarks.workloads.snapshots`: the "small" 23M-parameter
model, bf16, AdamW at each of ``--lrs``: ~1% of elements change per step at lr 1e-6, ~7%
at 1e-5; its 12 cached consecutive steps, walked forward, back and forward again for more
deltas: a step back changes the same elements) is published snapshot after snapshot by
three publishers, each to a local directory of its own: ``codec="auto"``, ``codec="context"``
and ``codec="fast"``. Per step they take turns (the order rotates), so load on the
machine falls on all three alike. After the anchor (step 0, unshaped), each publisher's
uploads of delta objects pass an artificial link: ``put_file`` sleeps ``latency + bytes /
rate`` after the local write (one upload at a time, as a delta's parts go; the manifest
commit is not shaped). That is what the publisher measures as ``upload_s``, and what
``auto`` learns the bandwidth from; nothing tells it the rate.

Each variant has a replica (a ``HotSwapper`` in this process, on a copy of the first
snapshot) that hot-loads every delta right after it commits, its reads of delta objects
through the same link (``get`` sleeps ``latency + bytes / rate``, one read at a time).
That is what auto minimises: publish() -> swapped.

Per link and codec the table shows which codec each delta used, the medians of
``encode_s``, stored bytes, ``upload_s``, their sum and ``total_s`` (publish() ->
committed: also the host copy, the plan and the commit), the replica's hot-load, the
mean publish() -> swapped (what auto's first delta and its wrong predictions cost show up in),
and auto's mean over the better fixed codec's. The break-even rate is where the fixed
codecs' medians meet: ``2 x (bytes fast - bytes context) / (encode + decode context -
encode + decode fast)`` (each byte crosses the link twice).

    python -m benchmarks.codec_auto                      # 10 Mbit/s and 1 Gbit/s, lr 1e-6 and 1e-5: ~6 minutes
    python -m benchmarks.codec_auto --rates 5,20,100,1000 --lrs 1e-6 --steps 12

Writes benchmarks/results/codec_auto.{md,json,png}.
"""

from __future__ import annotations

import logging
import os
import statistics
import tempfile
import threading
import time
from collections import Counter

import torch

from benchmarks import harness
from benchmarks.harness import bitrate

VARIANTS = ("auto", "context", "fast")


def shape_uploads(pub, rate_bit: float, latency_s: float, enabled: list[bool]) -> None:
    """Uploads of delta objects through ``pub``'s store take ``latency + bytes / rate`` once ``enabled[0]``."""
    put_file = pub.store.put_file

    def shaped(key: str, path: str) -> None:
        size = os.path.getsize(path)
        put_file(key, path)
        if enabled[0] and "/deltas/" in f"/{key}":
            time.sleep(latency_s + 8 * size / rate_bit)

    pub.store.put_file = shaped


def shape_reads(reader, rate_bit: float, latency_s: float) -> None:
    """Reads of delta objects through ``reader``'s store take ``latency + bytes / rate`` more, one at a time
    (parallel range reads share the link)."""
    store, get, link = reader.store, reader.store.get, threading.Lock()

    def shaped(key: str, byte_range=None, **kw):
        data = get(key, byte_range, **kw)
        if "/deltas/" in f"/{key}":
            with link:
                time.sleep(latency_s + 8 * len(data) / rate_bit)
        return data

    store.get = shaped


def run_link(snaps: list[dict[str, torch.Tensor]], rate_bit: float, latency_s: float, root: str) -> dict:
    """Every snapshot published by each variant over one shaped link and hot-loaded by its replica; a row per
    variant and delta."""
    from ckptdelta.loader import HotSwapper, SnapshotReader
    from ckptdelta.publisher import Publisher

    pubs, switches, swappers = {}, [], {}
    for v in VARIANTS:
        pubs[v] = Publisher(os.path.join(root, v), codec=v, progress=False, anchor_every=10**6,
                            anchor_chain_fraction=1e9)
        switches.append([False])
        shape_uploads(pubs[v], rate_bit, latency_s, switches[-1])
    rows: list[dict] = []
    try:
        for s, snap in enumerate(snaps):
            order = VARIANTS[s % 3:] + VARIANTS[:s % 3]
            for v in order:
                r = pubs[v].publish(snap, s)
                if s == 0:
                    reader = SnapshotReader(os.path.join(root, v))
                    shape_reads(reader, rate_bit, latency_s)
                    live = {k: t.clone() for k, t in snap.items()}
                    swappers[v] = HotSwapper(live, reader, version=r.version, progress=False)
                if r.kind == "delta":
                    t0 = time.perf_counter()
                    rep = swappers[v].hotload(r.version)
                    hot = time.perf_counter() - t0
                    rows.append({"variant": v, "step": s, "codec": r.codec, "encode_s": r.encode_s,
                                 "upload_s": r.upload_s, "coded_s": r.encode_s + r.upload_s,
                                 "stored_bytes": r.stored_bytes, "total_s": r.total_s, "copy_s": r.copy_s,
                                 "commit_s": r.commit_s, "hotload_s": hot, "decode_s": rep.decode_s,
                                 "fetch_s": rep.fetch_s, "swapped_s": r.total_s + hot, "reason": r.codec_reason})
            for sw in switches:
                sw[0] = True               # the anchor went unshaped; every delta goes through the link
    finally:
        for p in pubs.values():
            p.close()
    return {"rate_bit": rate_bit, "latency_s": latency_s, "rows": rows, "summary": summarize(rows)}


def summarize(rows: list[dict]) -> dict:
    out = {}
    for v in VARIANTS:
        mine = [r for r in rows if r["variant"] == v]
        out[v] = harness.medians(mine, ("encode_s", "stored_bytes", "upload_s", "coded_s", "total_s", "hotload_s",
                                        "decode_s", "swapped_s"))
        out[v]["mean_coded_s"] = statistics.fmean(r["coded_s"] for r in mine)
        out[v]["mean_total_s"] = statistics.fmean(r["total_s"] for r in mine)
        out[v]["mean_swapped_s"] = statistics.fmean(r["swapped_s"] for r in mine)
        out[v]["codecs"] = dict(Counter(r["codec"] for r in mine))
        out[v]["deltas"] = len(mine)
    c, f = out["context"], out["fast"]
    gap = c["encode_s"] + c["decode_s"] - f["encode_s"] - f["decode_s"]
    out["break_even_bit"] = 2 * 8 * (f["stored_bytes"] - c["stored_bytes"]) / gap if gap > 0 else None
    best = min(("context", "fast"), key=lambda k: out[k]["mean_swapped_s"])
    out["best_fixed"] = best
    out["auto_vs_best"] = out["auto"]["mean_swapped_s"] / out[best]["mean_swapped_s"]
    return out


def _codecs(counts: dict) -> str:
    return ", ".join(f"{k} {n}" for k, n in sorted(counts.items(), key=lambda kv: -kv[1]))


def markdown(cases: list[dict], meta: dict) -> str:
    lines = ["# Publisher(codec=\"auto\"): the codec per delta at two link speeds", "",
             f"{meta['machine']}; reference workload `snapshots(\"{meta['size']}\", lr)` "
             f"({meta['elements'] / 1e6:.1f}M bf16 elements, {meta['mb']:.0f} MB), {meta['deltas']} deltas after an "
             "anchor per case, each variant to a local directory of its own, taking turns per step. Delta uploads "
             "pass an artificial link (`put_file` sleeps latency + bytes / rate after the local write: latency "
             f"{1e3 * meta['latency_s']:g} ms). torch intra-op threads: {meta['torch_threads']} (they only take the "
             "host copy here). Each variant's replica hot-loads every delta once it commits, reading delta objects "
             "through the same link. Seconds are medians over the deltas unless marked mean; `vs best fixed` "
             "compares means of publish() -> swapped.", "",
             "| workload | link | codec | codecs used | encode s | bytes | upload s | publish -> committed s | "
             "replica hot-load s (decode) | mean publish -> committed s | mean publish -> swapped s | vs best fixed |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for case in cases:
        sm = case["summary"]
        best = sm[sm["best_fixed"]]["mean_swapped_s"]
        for v in VARIANTS:
            s = sm[v]
            name = f"**{v}**" if v == "auto" else v
            rel = (f"**{sm['auto_vs_best']:.2f}x** {sm['best_fixed']}" if v == "auto" else
                   "best" if v == sm["best_fixed"] else f"{s['mean_swapped_s'] / best:.2f}x")
            lines.append(f"| lr {case['lr']:g} ({100 * case['changed']:.1f}% changed) | {bitrate(case['rate_bit'])} | "
                         f"{name} | {_codecs(s['codecs'])} | {s['encode_s']:.3f} | {s['stored_bytes'] / 1e3:.0f} kB | "
                         f"{s['upload_s']:.3f} | {s['total_s']:.3f} | {s['hotload_s']:.3f} ({s['decode_s']:.3f}) | "
                         f"{s['mean_total_s']:.3f} | {s['mean_swapped_s']:.3f} | {rel} |")
    even = "; ".join(f"lr {c['lr']:g} at {bitrate(c['rate_bit'])}: {c['summary']['break_even_bit'] / 1e6:.3g} Mbit/s"
                     for c in cases if c["summary"]["break_even_bit"])
    lines += ["", f"Break-even link rate from the fixed codecs' medians, publish() -> swapped (the fast path is faster "
              f"above it): {even}.",
              "", "`auto` publishes every delta with the codec it predicts to win: its first with the fast path "
              "(nothing measured yet), then the smaller prediction. It measures the other codec on a sample of a "
              "delta (both codecs side by side, on a thread of its own after publish() returned, nothing uploaded) "
              "beside its first deltas until it has 3 pairs, and then once per 10 deltas times the other's predicted "
              "loss (other / best, up to 4x). A minority count in `codecs used` is a change of prediction; with noise "
              "(and the measurements' CPU beside the next publish) it is what separates auto's mean from the best "
              "fixed codec's. Per publish the noise on this machine is tens of ms (shared: load average "
              f"{meta['load'][0]:.1f} at the start, {meta['load'][1]:.1f} at the end, on {meta['cpus']} CPUs). "
              "Auto's reason for every delta is in the JSON (`cases[].rows[].reason`)."]
    return "\n".join(lines) + "\n"


def plot(cases: list[dict], path: str) -> None:
    """publish() -> swapped per delta: a panel per workload (rows) and link (columns)."""
    lrs = sorted({c["lr"] for c in cases})
    rates = sorted({c["rate_bit"] for c in cases})
    with harness.figure(path, len(lrs), len(rates), figsize=(5.5 * len(rates), 3.6 * len(lrs)), squeeze=False,
                        sharex=True) as (_, axes):
        colors = {"context": "tab:blue", "fast": "tab:orange"}
        for case in cases:
            ax = axes[lrs.index(case["lr"])][rates.index(case["rate_bit"])]
            for v in ("context", "fast"):
                rows = [r for r in case["rows"] if r["variant"] == v]
                ax.plot([r["step"] for r in rows], [1e3 * r["swapped_s"] for r in rows], color=colors[v], alpha=0.6,
                        label=f"always {v}")
            rows = [r for r in case["rows"] if r["variant"] == "auto"]
            ax.plot([r["step"] for r in rows], [1e3 * r["swapped_s"] for r in rows], "k--", lw=1, label="auto")
            for c in ("context", "fast"):
                pts = [r for r in rows if r["codec"] == c]
                ax.scatter([r["step"] for r in pts], [1e3 * r["swapped_s"] for r in pts], color=colors[c],
                           edgecolor="k", zorder=3, s=30, label=f"auto chose {c}")
            ax.set(title=f"lr {case['lr']:g} ({100 * case['changed']:.1f}% changed), link {bitrate(case['rate_bit'])}",
                   ylabel="publish() -> swapped (ms)")
            ax.set_ylim(bottom=0)
        for ax in axes[-1]:
            ax.set_xlabel("delta (step)")
        axes[0][0].legend(fontsize=8)


def _changed_share(snaps: list[dict[str, torch.Tensor]]) -> float:
    from benchmarks.workloads import change_fraction

    return statistics.median(change_fraction(a, b) for a, b in zip(snaps, snaps[1:]))


def main(argv: list[str] | None = None) -> int:
    p = harness.parser("codec_auto", __doc__, from_json="only render the table and plot of an earlier run's JSON")
    p.add_argument("--rates", default="10,1000", help="link rates in Mbit/s, comma-separated (default 10,1000)")
    p.add_argument("--latency-ms", type=float, default=0.0, help="added to every delta upload (default 0)")
    p.add_argument("--lrs", default="1e-6,1e-5", help="workload learning rates, comma-separated (default 1e-6,1e-5)")
    p.add_argument("--steps", type=int, default=24, help="deltas per case (default 24)")
    p.add_argument("--size", default="small", help="workload size: small (23M) or tiny (3.7M, a smoke test)")
    p.add_argument("--torch-threads", type=int, default=1,
                   help="torch intra-op threads (default 1: they only take publish()'s host copy here, and on a "
                        "loaded machine their OpenMP regions wait for a core: copy_s 0.1-0.8 s instead of 1 ms "
                        "for 7 MB with 2 threads, noise common to every codec)")
    p.add_argument("--name", default="codec_auto")
    a = p.parse_args(argv)
    if a.from_json:
        data = harness.read_json(a.from_json)
        _write(data["cases"], data["meta"], a.out_dir, a.name)
        return 0
    try:
        rates = [float(x) * 1e6 for x in a.rates.split(",") if x]
        lrs = [float(x) for x in a.lrs.split(",") if x]
    except ValueError as e:
        p.error(str(e))
    if not rates or not lrs or any(r <= 0 for r in rates) or a.steps < 1:
        p.error("--rates and --lrs need positive numbers, --steps at least 1")
    from benchmarks.workloads import snapshots
    from ckptdelta.publisher.codec_choice import warm_up

    logging.getLogger("ckptdelta").setLevel(logging.WARNING)
    if a.torch_threads > 0:
        torch.set_num_threads(a.torch_threads)
    load0 = os.getloadavg()[0]
    warm_up()          # every variant's first delta finds the kernels loaded
    cases, meta = [], {}
    for lr in lrs:
        cached = snapshots(a.size, lr, steps=12)
        snaps = [cached[abs((i + 12) % 24 - 12)] for i in range(a.steps + 1)]     # 0..12, 11..0, 1..12, ...
        changed = _changed_share(snaps)
        meta = {"elements": sum(t.numel() for t in snaps[0].values()),
                "mb": sum(t.numel() * t.element_size() for t in snaps[0].values()) / 1e6}
        for rate in rates:
            with tempfile.TemporaryDirectory(prefix="ckptdelta-codec-auto-") as root:
                case = {"lr": lr, "changed": changed, **run_link(snaps, rate, a.latency_ms / 1e3, root)}
            cases.append(case)
            sm = case["summary"]
            print(f"lr {lr:g}, {bitrate(rate)}: " + "; ".join(
                f"{v} ({_codecs(sm[v]['codecs'])}) mean publish->swapped {sm[v]['mean_swapped_s']:.3f} s"
                for v in VARIANTS), flush=True)
        del cached, snaps
    meta.update({"machine": harness.machine(), "size": a.size, "deltas": a.steps,
                 "torch_threads": torch.get_num_threads(), "latency_s": a.latency_ms / 1e3, "cpus": os.cpu_count(),
                 "load": [load0, os.getloadavg()[0]]})
    _write(cases, meta, a.out_dir, a.name)
    return 0


def _write(cases: list[dict], meta: dict, out_dir: str, name: str) -> None:
    harness.write(os.path.join(out_dir, name), markdown(cases, meta), {"meta": meta, "cases": cases},
                  lambda path: plot(cases, path))


if __name__ == "__main__":
    raise SystemExit(main())
