"""Publishing from a sharded trainer: each rank encodes its own DTensor shards, beside gather-then-publish.

An FSDP2 trainer holds every parameter as a DTensor split across its ranks (``Shard(0)``). The same bf16
model (:func:`benchmarks.workloads.scaled_pair`: real AdamW steps at lr 1e-6, ~1% of elements change per
step) is published as consecutive steps, forward then back, by:

- **1 rank, DTensor**: a 1-rank mesh: the rank holds every tensor whole (what a 1-GPU trainer does);
- **2 ranks, DTensor**: ``Publisher.publish(state_dict)`` on each rank of a 2-rank gloo job with the
  parameters distributed ``Shard(0)``: each rank encodes its own rows against its own parent rows, rank 0
  commits one manifest (publisher/sharded.py);
- **2 ranks, gather then publish**: what a sharded trainer had to do before: every parameter all-gathered
  (``DTensor.full_tensor()``), then rank 0 publishes the whole model alone.

Every rank process is pinned to a core of its own (``sched_setaffinity``), so 1 rank has 1 core and 2 ranks
have 2, as each rank of a real job brings its own cores. Per step and rank: **trainer-side** = the ranks' wall
time from ``publish()`` called to committed (for the baseline, plus the gather before it), **bytes gathered** =
what the rank received from other ranks (the publishers' pickled metadata and tensor bytes, counted by
``publisher.distributed.Comm``; the baseline's all-gather of the parameters), **bytes written** = the delta
objects the rank uploaded. Medians of ``--steps`` timed deltas after 2 untimed ones. The first publish is an
anchor: its gathered bytes and the writer's memory (the RSS above the rank's level before it, sampled every
2 ms, against the bound: its own shards' host copy plus one gathered tensor) are reported apart.

It also times rank 0's share of a publish at the projection's scales (no I/O; ``--no-metadata`` skips it):
planning the pieces of every rank (``plan_union``), merging the ranks' entries and the manifest's JSON round
trip, for synthetic layouts of 70B (723 tensors on 64 ranks) and 1T (1,830 tensors on 256 ranks).

    python -m benchmarks.sharded                   # 1 GB, 7 timed deltas: ~3 minutes on two cores
    python -m benchmarks.sharded --gb 0.05 --steps 2 --quick
    python -m benchmarks.sharded --render benchmarks/results/sharded.json    # the table and plot again

Writes benchmarks/results/sharded.{md,json,png}.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import statistics
import tempfile
import threading
import time
from datetime import timedelta

RESULTS = os.path.join(os.path.dirname(__file__), "results")
WARM = 2


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class _PeakRss:
    """The highest RSS seen while the block runs (sampled every 2 ms), above the RSS when it started."""

    def __enter__(self) -> "_PeakRss":
        self.start = self.peak = _rss()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, _rss())

    @property
    def extra(self) -> int:
        return self.peak - self.start


def _rank(method: str, world: int, rank: int, init: str, url: str, gb: float, steps: int, codec: str,
          out: str) -> None:
    os.sched_setaffinity(0, {rank % os.cpu_count()})
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from benchmarks.workloads import scaled_pair
    from delta.manifest import delta_prefix
    from publisher import Publisher

    mesh = init_device_mesh("cpu", (world,))
    old, new = scaled_pair(int(gb * 1e9))
    full_bytes = sum(t.numel() * t.element_size() for t in old.values())
    largest = max(t.numel() * t.element_size() for t in old.values())
    snaps = [{n: distribute_tensor(t, mesh, [Shard(0)]) for n, t in sd.items()} for sd in (old, new)]
    del old, new
    import gc
    gc.collect()
    own_bytes = sum(t.to_local().numel() * t.element_size() for t in snaps[0].values())
    rows = []
    baseline = method == "gather"
    pub = Publisher(url, codec=codec, anchor_every=1000, anchor_chain_fraction=1e9, progress=False,
                    distributed=False if baseline else None) if (not baseline or rank == 0) else None
    try:
        for step in range(WARM + steps + 2):     # an anchor, deltas, then an anchor measured warm
            sd = snaps[step % 2]
            dist.barrier()
            before = dict(pub._comm.stats) if pub is not None else {}
            with _PeakRss() as mem:
                c0 = time.process_time()          # every thread of the rank: its CPU, whatever else runs
                t0 = time.perf_counter()
                gathered = 0
                if baseline:
                    full = {n: t.full_tensor() for n, t in sd.items()}
                    gathered = sum(t.numel() * t.element_size() for t in full.values()) - own_bytes
                t_gather = time.perf_counter() - t0
                r = pub.publish(full if baseline else sd, step, anchor=step == WARM + steps + 1) \
                    if pub is not None else None
                if baseline:
                    del full
                t1 = time.perf_counter()
                cpu = time.process_time() - c0
            dist.barrier()           # a sharded trainer's next step waits for the slowest rank
            t_all = time.perf_counter() - t0
            stats = pub._comm.stats if pub is not None else {}
            rows.append({
                "step": step, "kind": r.kind if r is not None else None, "trainer_s": t_all, "own_s": t1 - t0,
                "cpu_s": cpu,
                "gather_s": t_gather, "copy_s": r.copy_s if r else 0.0, "encode_s": r.encode_s if r else 0.0,
                "upload_s": r.upload_s if r else 0.0, "commit_s": r.commit_s if r else 0.0,
                "version": r.version if r else None, "stored_bytes": r.stored_bytes if r else 0,
                "gathered_tensor_bytes": gathered + stats.get("tensor_bytes", 0) - before.get("tensor_bytes", 0),
                "gathered_object_bytes": stats.get("object_bytes", 0) - before.get("object_bytes", 0),
                "rss_extra": mem.extra, "largest_gather": stats.get("largest_gather", 0)})
        written = {}
        if rank == 0:
            from loader.reader import SnapshotReader
            reader = SnapshotReader(url)
            for row in rows:
                m = reader.manifest(row["step"])
                per = [0] * world
                for o in m.objects:
                    name = o.key.rsplit("/", 1)[1]
                    if name.startswith("rank-"):
                        per[int(name[5:10])] += o.size
                written[row["step"]] = per
    finally:
        if pub is not None:
            pub.close()
    with open(os.path.join(out, f"{method}-{world}-{rank}.json"), "w") as f:
        json.dump({"rows": rows, "written": written, "own_bytes": own_bytes, "full_bytes": full_bytes,
                   "largest_tensor": largest}, f)
    dist.barrier()
    dist.destroy_process_group()


def run(method: str, world: int, gb: float, steps: int, codec: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="ckptdelta-sharded-") as d:
        ctx = multiprocessing.get_context("spawn")
        args = (method, world)
        procs = [ctx.Process(target=_rank, args=(*args, r, os.path.join(d, "init"), os.path.join(d, "run"), gb,
                                                  steps, codec, d)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode != 0 for p in procs):
            raise RuntimeError(f"{method} on {world} ranks: exit codes {[p.exitcode for p in procs]}")
        ranks = [json.load(open(os.path.join(d, f"{method}-{world}-{r}.json"))) for r in range(world)]
        hot = replica(os.path.join(d, "run"), list(range(WARM + 1, WARM + 1 + steps))) if method == "dtensor" else {}
    timed = range(WARM + 1, WARM + 1 + steps)
    med = lambda k, r=0: statistics.median(ranks[r]["rows"][i][k] for i in timed)  # noqa: E731
    written = ranks[0]["written"]
    out = {
        "method": method, "ranks": world, "full_bytes": ranks[0]["full_bytes"],
        "largest_tensor": ranks[0]["largest_tensor"],
        "trainer_s": statistics.median(max(rk["rows"][i]["trainer_s"] for rk in ranks) for i in timed),
        "cpu_s": statistics.median(max(rk["rows"][i]["cpu_s"] for rk in ranks) for i in timed),
        "gather_s": med("gather_s"), "copy_s": med("copy_s"), "encode_s": med("encode_s"),
        "upload_s": med("upload_s"), "commit_s": med("commit_s"), "stored_bytes": med("stored_bytes"),
        "per_rank": [{
            "rank": r, "own_bytes": rk["own_bytes"],
            "gathered_tensor_bytes": statistics.median(rk["rows"][i]["gathered_tensor_bytes"] for i in timed),
            "gathered_object_bytes": statistics.median(rk["rows"][i]["gathered_object_bytes"] for i in timed),
            "written_bytes": statistics.median(written[str(i)][r] if str(i) in written else written[i][r]
                                               for i in timed),
            "anchor_tensor_bytes": rk["rows"][-1]["gathered_tensor_bytes"],
            "anchor_object_bytes": rk["rows"][-1]["gathered_object_bytes"],
            "anchor_rss_extra": rk["rows"][-1]["rss_extra"], "largest_gather": rk["rows"][-1]["largest_gather"],
        } for r, rk in enumerate(ranks)],
        "anchor_s": max(rk["rows"][-1]["trainer_s"] for rk in ranks),
        "first_anchor_s": max(rk["rows"][0]["trainer_s"] for rk in ranks),
        "samples": [[rk["rows"][i]["trainer_s"] for i in timed] for rk in ranks],
        "replica": hot,
    }
    return out


def replica(url: str, versions: list[int]) -> dict:
    """A replica's hot-load of each timed delta (HotSwapper over host tensors, one core): prepare (fetch,
    decode, verify, stage) and the pause. Pieced deltas are applied box by box to a copy of each changed
    tensor, which is then proven whole and staged: what that costs beside a plain delta's records."""
    from loader.hotswap import HotSwapper
    from loader.reader import SnapshotReader

    affinity = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {0})
    try:
        reader = SnapshotReader(url)
        start = versions[0] - 1
        live = {n: t.clone() for n, t in reader.read_tensors(start).items()}
        swapper = HotSwapper(live, reader, version=start, stage_threads=1, progress=False)
        prep, pause = [], []
        for v in versions:
            t0 = time.perf_counter()
            p = swapper.prepare(v)
            prep.append(time.perf_counter() - t0)
            pause.append(swapper.commit(p).pause_s)
        return {"prepare_s": statistics.median(prep), "pause_s": statistics.median(pause)}
    finally:
        os.sched_setaffinity(0, affinity)


# --- rank 0's metadata at the projection's scales --------------------------------------------------------

def metadata_cost(n_tensors: int, world: int, repeats: int = 1) -> dict:
    """Rank 0's CPU for one publish's metadata, no I/O: the union of every rank's boxes, the merge of their
    written entries into pieced entries, and the manifest to JSON and parsed back (what _commit does)."""
    from delta.manifest import Manifest, ObjectRef, TensorEntry
    from publisher.sharded import LocalBox, plan_union
    from publisher.writer import Written, merge

    shapes = [((8192 + (i % 7) * 1024, 8192)) for i in range(n_tensors)]
    schemas, written = [], []
    for r in range(world):
        sch, boxes, w = {}, {}, Written()
        w.objects.append(ObjectRef(f"deltas/000000000001-w-1/rank-{r:05d}.ckd", 1 << 30, "0" * 16))
        for i, (rows, cols) in enumerate(shapes):
            size = -(-rows // world)
            start = min(r * size, rows)
            n = min(size, rows - start)
            name = f"model.layers.{i // 9}.mlp.proj_{i % 9}.weight"
            sch[name] = ("BF16", (n, cols))
            boxes[name] = LocalBox((rows, cols), (start, 0))
            w.entries[name] = TensorEntry("BF16", (n, cols), f"{(r * 7919 + i):016x}", 0, 8 + i * 100, 100)
            w.boxes[name] = ((rows, cols), (start, 0))
        schemas.append((sch, boxes))
        written.append(w)
    t0 = time.perf_counter()
    for _ in range(repeats):
        plan_union(schemas, 5 << 30)
    t1 = time.perf_counter()
    for _ in range(repeats):
        objects, entries, _wm, _x = merge(written)
        m = Manifest("r", 1, "delta", 0, 0, "now", 1, "w", tuple(objects), entries)
        data = m.to_json()
        Manifest.from_json(data)
    t2 = time.perf_counter()
    import pickle
    per_rank = len(pickle.dumps(schemas[1])) + len(pickle.dumps(written[1]))
    return {"tensors": n_tensors, "ranks": world, "pieces": n_tensors * world, "plan_s": (t1 - t0) / repeats,
            "commit_s": (t2 - t1) / repeats, "manifest_bytes": len(data), "rank_metadata_bytes": per_rank,
            "rank0_received_bytes": per_rank * (world - 1)}


# --- report --------------------------------------------------------------------------------------------------

def _mb(b: float) -> str:
    return f"{b / 1e6:.2f}"


def table(res: list[dict]) -> list[str]:
    one = next(r for r in res if r["ranks"] == 1)
    lines = ["| method | ranks | trainer-side (s) | vs 1 rank | busiest rank's CPU (s) | vs 1 rank | gather (s) | "
             "encode (s) | per rank: gathered tensor bytes | gathered metadata bytes | written bytes |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|---|---|"]
    for r in res:
        label = {"dtensor": "DTensor publish (each rank its shards)", "gather": "gather, then rank 0 publishes"}[
            r["method"]]
        pr = r["per_rank"]
        lines.append(f"| {label} | {r['ranks']} | {r['trainer_s']:.3f} | {r['trainer_s'] / one['trainer_s']:.2f}x | "
                     f"{r['cpu_s']:.3f} | {r['cpu_s'] / one['cpu_s']:.2f}x | {r['gather_s']:.3f} | "
                     f"{r['encode_s']:.3f} | "
                     + " / ".join(f"{p['gathered_tensor_bytes']:,}" for p in pr) + " | "
                     + " / ".join(f"{p['gathered_object_bytes']:,}" for p in pr) + " | "
                     + " / ".join(f"{p['written_bytes']:,}" for p in pr) + " |")
    return lines


def report(res: list[dict], meta: list[dict], args, elapsed: float) -> str:
    one = next(r for r in res if r["ranks"] == 1 and r["method"] == "dtensor")
    two = next(r for r in res if r["ranks"] == 2 and r["method"] == "dtensor")
    base = next((r for r in res if r["method"] == "gather"), None)
    ratio = two["trainer_s"] / one["trainer_s"]
    lines = [f"# Sharded publish: per-rank encoding of DTensor shards (`python -m benchmarks.sharded`)", "",
             f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores (each rank pinned to one), "
             f"model {one['full_bytes'] / 1e9:.2f} GB bf16 (benchmarks.workloads.scaled_pair, lr 1e-6), "
             f"codec={args.codec}, medians of {args.steps} deltas after {WARM} untimed, local-directory bucket. "
             f"Run took {elapsed:.0f} s.", "", *table(res), "",
             "Per-rank columns are rank 0 / rank 1. Trainer-side: publish() called -> committed on every rank (for "
             "the gather baseline: the all-gather of the parameters, then rank 0's publish; rank 1 waits). CPU: "
             "the CPU time of the busiest rank's process (all its threads) over the same span: the work each rank "
             "does, whatever else shares its core.", "",
             f"- **At 2 ranks the DTensor publish takes {ratio:.2f}x the trainer-side time of 1 rank** (target <= "
             f"0.6x: {'met' if ratio <= 0.6 else 'NOT met'}; per step: "
             f"{', '.join(f'{x:.2f}' for x in two['samples'][0])} s against "
             f"{', '.join(f'{x:.2f}' for x in one['samples'][0])} s), and its busiest rank's CPU "
             f"{two['cpu_s'] / one['cpu_s']:.2f}x of 1 rank's."]
    gathered = [p["gathered_tensor_bytes"] for p in two["per_rank"]]
    lines.append(f"- Bytes gathered for a delta: tensor bytes {gathered} (target: none, metadata only: "
                 f"{'met' if not any(gathered) else 'NOT met'}); metadata "
                 f"{[p['gathered_object_bytes'] for p in two['per_rank']]} bytes per rank (pickled schemas, "
                 "boxes, entries and the plan).")
    if one.get("replica") and two.get("replica"):
        lines.append(f"- A replica's hot-load of these deltas (one core): prepare {one['replica']['prepare_s']:.3f} s, "
                     f"pause {one['replica']['pause_s']:.3f} s for the 1-rank run's plain records; prepare "
                     f"{two['replica']['prepare_s']:.3f} s, pause {two['replica']['pause_s']:.3f} s for the 2-rank "
                     "run's pieces (row boxes staged one by one against the live tensor, each proving its bits).")
    if base is not None:
        lines.append(f"- Gather then publish on 2 ranks: {base['trainer_s']:.3f} s ({base['gather_s']:.3f} s "
                     f"gathering {base['per_rank'][0]['gathered_tensor_bytes']:,} bytes into each rank), "
                     f"{base['trainer_s'] / two['trainer_s']:.2f}x the DTensor publish.")
    a = two["per_rank"]
    lines += ["", "## An anchor on 2 ranks (anchor=True after the timed deltas)", "",
              "| rank | own shards (bytes) | tensor bytes gathered in | largest gather buffer | extra RSS during the "
              "anchor | bound: the largest piece of another rank, or its tensor's other pieces for a column cut |", "|---:|---:|---:|---:|---:|---:|"]
    for p in a:
        lines.append(f"| {p['rank']} | {p['own_bytes']:,} | {p['anchor_tensor_bytes']:,} | {p['largest_gather']:,}"
                     f" | {p['anchor_rss_extra']:,} | {two['largest_tensor'] // 2:,} (rows) |")
    lines += ["", f"Anchor trainer-side: {two['anchor_s']:.2f} s on 2 ranks, {one['anchor_s']:.2f} s on 1 (the "
              f"first publish, also an anchor, with every first-use cost: {two['first_anchor_s']:.2f} s and "
              f"{one['first_anchor_s']:.2f} s). With the default 5 GiB shards this model's pieced tensors make one "
              "shard, so rank 0 writes it and receives rank 1's rows, one tensor at a time, point to point. Its "
              "memory beyond the publisher's usual host copies (the parent and the staging copy of its own shards, "
              "reused from step to step) is one received piece at a time for row pieces (the 'largest gather "
              "buffer'; bound: the largest tensor's other half), or a tensor's other pieces plus a block of at most "
              "64 MiB for a tensor cut along another dimension than 0; a rank that only sends allocates nothing. The "
              "extra RSS is what the process's resident size rose by during the anchor (2 ms samples; file pages "
              "are not counted)."]
    if meta:
        lines += ["", "## Rank 0's metadata per publish at scale (measured here, no I/O)", "",
                  "| tensors | ranks | pieces | plan (s) | merge + manifest JSON round trip (s) | manifest | metadata "
                  "per rank | received by rank 0 |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for m in meta:
            lines.append(f"| {m['tensors']} | {m['ranks']} | {m['pieces']:,} | {m['plan_s']:.2f} | "
                         f"{m['commit_s']:.2f} | {_mb(m['manifest_bytes'])} MB | {_mb(m['rank_metadata_bytes'])} MB"
                         f" | {_mb(m['rank0_received_bytes'])} MB |")
    return "\n".join(lines) + "\n"


def plot(res: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4))
    labels = [f"{r['method']}\n{r['ranks']} rank{'s' if r['ranks'] > 1 else ''}" for r in res]
    ax.bar(labels, [r["trainer_s"] for r in res], color=["#4c72b0", "#55a868", "#c44e52"][:len(res)])
    ax.set_ylabel("trainer-side seconds per delta (median)")
    ax.set_title("publish() -> committed")
    bx.bar(labels, [max(1, max(p["gathered_tensor_bytes"] + p["gathered_object_bytes"] for p in r["per_rank"]))
                    for r in res], color=["#4c72b0", "#55a868", "#c44e52"][:len(res)])
    bx.set_yscale("log")
    bx.set_ylabel("bytes received from other ranks per delta (max rank)")
    bx.set_title("bytes gathered")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sharded", description=__doc__.split("\n\n")[0])
    p.add_argument("--gb", type=float, default=1.0, help="model size in GB (default 1)")
    p.add_argument("--steps", type=int, default=7, help="timed deltas per configuration (default 7)")
    p.add_argument("--codec", default="fast", choices=("fast", "context"))
    p.add_argument("--no-baseline", action="store_true", help="skip gather-then-publish")
    p.add_argument("--quick", action="store_true", help="small metadata scales (tests)")
    p.add_argument("--no-metadata", action="store_true")
    p.add_argument("--out", default=RESULTS)
    p.add_argument("--render", metavar="JSON", help="write the table and plot again from a run's JSON; no run")
    args = p.parse_args(argv)
    if args.render:
        saved = json.load(open(args.render))
        run_args = argparse.Namespace(**saved["args"])
        text = report(saved["results"], saved["metadata"], run_args, saved.get("elapsed_s", 0.0))
        with open(os.path.join(args.out, "sharded.md"), "w") as f:
            f.write(text)
        plot(saved["results"], os.path.join(args.out, "sharded.png"))
        print(text)
        return 0
    t0 = time.perf_counter()
    res = [run("dtensor", 1, args.gb, args.steps, args.codec), run("dtensor", 2, args.gb, args.steps, args.codec)]
    if not args.no_baseline:
        res.append(run("gather", 2, args.gb, args.steps, args.codec))
    meta = [] if args.no_metadata else \
        [metadata_cost(72, 8), metadata_cost(180, 16)] if args.quick else \
        [metadata_cost(723, 64), metadata_cost(1830, 256)]
    elapsed = time.perf_counter() - t0
    text = report(res, meta, args, elapsed)
    print(text)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "sharded.md"), "w") as f:
        f.write(text)
    with open(os.path.join(args.out, "sharded.json"), "w") as f:
        json.dump({"args": vars(args), "results": res, "metadata": meta, "elapsed_s": elapsed}, f, indent=1)
    plot(res, os.path.join(args.out, "sharded.png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
