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
``ckptdelta.publisher.distributed.Comm``; the baseline's all-gather of the parameters), **bytes written** = the delta
objects the rank uploaded. The first publish is an anchor: its gathered bytes and the writer's memory (the RSS
above the rank's level before it, sampled every 2 ms, against the bound: its own shards' host copy plus one
gathered tensor) are reported apart.

**Rounds.** On a shared machine the load drifts from minute to minute, so configurations run one after the
other compare the machine's moments as much as the code (two quiet runs that way gave 0.75x and 0.53x for 2
ranks / 1 rank). The configurations therefore run interleaved, ``--rounds`` times: each round is a fresh job of
every configuration (its own first anchor and 2 untimed deltas, then ``--steps`` timed deltas), in the order
1 rank, 2 ranks, baseline, and reversed in every other round (ABC, CBA, ABC, ...), so no configuration always
runs first or last. The table's medians are over every round's timed deltas pooled per configuration; the
2-ranks / 1-rank ratio is also given per round (each round's own medians) with its spread (min-max), which
shows how much the machine moved it. The anchor after the timed deltas and the replica's hot-load are measured
in the first round only (neither is part of the ratio, and each costs a job ~5-10 s at 1 GB). Every rank builds
the same model and copies its own rows out of it (``distribute_tensor(..., src_data_rank=None)``: the same
DTensors, without the scatter from rank 0, since a job's setup is now paid in every round). The default, 3
rounds of 3 timed deltas, pools 9 deltas per configuration and gives 3 ratios; most of its ~5 minutes at 1 GB
is each job's own start and first anchor (~15-25 s), so fewer deltas per round would not make it much shorter
(``--rounds 2``: ~3.5 minutes, 2 ratios).

It also times rank 0's share of a publish at the projection's scales (no I/O; ``--no-metadata`` skips it,
``--metadata-only`` runs only it): planning the pieces of every rank (``plan_union``), merging the ranks'
entries and the manifest's JSON round trip ("plan + commit"), and apart, unpickling what the ranks send and
pickling the plan ("wire"), for synthetic layouts of 70B (723 tensors on 64 ranks) and 1T (1,830 tensors on
256 ranks). Each of ``--metadata-rounds`` rounds measures every scale in a fresh interpreter; with
``--metadata-baseline REV`` a git revision's code (``git archive``) is measured beside this tree's in every
round, the order alternating, and the table gives both medians, their ratio and each one's growth from one
scale to the next against the pieces'. Wall time (what the benchmark always timed) and rank 0's CPU time are
both given: on a machine other work shares, the wall time is the CPU time plus waiting for a core.

    python -m benchmarks.sharded                   # 1 GB, 3 rounds x 3 timed deltas: ~5 minutes on two cores
    python -m benchmarks.sharded --gb 0.05 --steps 2 --rounds 2 --quick --out DIR     # a smoke run
    python -m benchmarks.sharded --render benchmarks/results/sharded.json    # the table and plot again
    python -m benchmarks.sharded --metadata-only --metadata-baseline 322ae57   # rank 0's metadata, ~5 minutes

Writes benchmarks/results/sharded.{md,json,png} (``--metadata-only``: sharded_metadata.{md,json,png}; or under
``--out``). A JSON from before rounds (no ``rounds`` per result) renders as one round.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from datetime import timedelta
from typing import Any

from benchmarks import harness
from benchmarks.harness import mb

WARM = 2
ROUNDS = 3           # default --rounds (2 with --quick)
STEPS = 3            # default --steps: timed deltas per configuration and round


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
          out: str, anchor: bool) -> None:
    os.sched_setaffinity(0, {rank % os.cpu_count()})
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=600))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from benchmarks.workloads import scaled_pair
    from ckptdelta.publisher import Publisher

    mesh = init_device_mesh("cpu", (world,))
    old, new = scaled_pair(int(gb * 1e9))
    full_bytes = sum(t.numel() * t.element_size() for t in old.values())
    largest = max(t.numel() * t.element_size() for t in old.values())
    # every rank built the same model: each takes (copies) its own rows, without the scatter from rank 0 that
    # distribute_tensor does by default (seconds per job, paid in every round)
    snaps = [{n: distribute_tensor(t, mesh, [Shard(0)], src_data_rank=None) for n, t in sd.items()}
             for sd in (old, new)]
    del old, new
    import gc
    gc.collect()
    own_bytes = sum(t.to_local().numel() * t.element_size() for t in snaps[0].values())
    rows = []
    baseline = method == "gather"
    pub = Publisher(url, codec=codec, anchor_every=1000, anchor_chain_fraction=1e9, progress=False,
                    distributed=False if baseline else None) if (not baseline or rank == 0) else None
    try:
        for step in range(WARM + steps + 1 + anchor):   # an anchor, deltas, then (anchor) one measured warm
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
            from ckptdelta.loader.reader import SnapshotReader
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


def job(method: str, world: int, gb: float, steps: int, codec: str, *, first: bool) -> dict:
    """One fresh gloo job of a configuration (a round's share): every rank's rows of every publish, and for a
    DTensor publish in the ``first`` round a replica's hot-load of its timed deltas. Only the first round
    publishes the warm anchor after the timed deltas."""
    with tempfile.TemporaryDirectory(prefix="ckptdelta-sharded-") as d:
        ctx = multiprocessing.get_context("spawn")
        procs = [ctx.Process(target=_rank, args=(method, world, r, os.path.join(d, "init"), os.path.join(d, "run"),
                                                  gb, steps, codec, d, first)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join()
        if any(p.exitcode != 0 for p in procs):
            raise RuntimeError(f"{method} on {world} ranks: exit codes {[p.exitcode for p in procs]}")
        ranks = [json.load(open(os.path.join(d, f"{method}-{world}-{r}.json"))) for r in range(world)]
        timed = list(range(WARM + 1, WARM + 1 + steps))
        hot = replica(os.path.join(d, "run"), timed) if method == "dtensor" and first else {}
    return {"ranks": ranks, "replica": hot, "anchor": first}


def pool(method: str, world: int, jobs: list[dict], steps: int) -> dict:
    """A configuration's figures over its rounds' jobs: medians of every round's timed deltas pooled, each
    round's own medians (``rounds``), and the anchor and replica from the round that measured them."""
    timed = range(WARM + 1, WARM + 1 + steps)

    def per_step(job: dict, key: str) -> list[float]:       # the slowest rank's, per timed step
        return [max(rk["rows"][i][key] for rk in job["ranks"]) for i in timed]

    def pooled(key: str, r: int = 0) -> float:
        return statistics.median(j["ranks"][r]["rows"][i][key] for j in jobs for i in timed)

    def pooled_count(key: str, r: int = 0) -> int:      # a count seen, not the mean of two
        return statistics.median_low(j["ranks"][r]["rows"][i][key] for j in jobs for i in timed)

    def written(job: dict, i: int, r: int) -> int:
        w = job["ranks"][0]["written"]
        return w[str(i)][r] if str(i) in w else w[i][r]

    first = jobs[0]["ranks"][0]
    anchored = next(j for j in jobs if j["anchor"])
    a_ranks = anchored["ranks"]
    return {
        "method": method, "ranks": world, "full_bytes": first["full_bytes"], "largest_tensor": first["largest_tensor"],
        "trainer_s": statistics.median(x for j in jobs for x in per_step(j, "trainer_s")),
        "cpu_s": statistics.median(x for j in jobs for x in per_step(j, "cpu_s")),
        "gather_s": pooled("gather_s"), "copy_s": pooled("copy_s"), "encode_s": pooled("encode_s"),
        "upload_s": pooled("upload_s"), "commit_s": pooled("commit_s"), "stored_bytes": pooled_count("stored_bytes"),
        "per_rank": [{
            "rank": r, "own_bytes": rk["own_bytes"],
            "gathered_tensor_bytes": pooled_count("gathered_tensor_bytes", r),
            "gathered_object_bytes": pooled_count("gathered_object_bytes", r),
            "written_bytes": statistics.median_low(written(j, i, r) for j in jobs for i in timed),
            "anchor_tensor_bytes": rk["rows"][-1]["gathered_tensor_bytes"],
            "anchor_object_bytes": rk["rows"][-1]["gathered_object_bytes"],
            "anchor_rss_extra": rk["rows"][-1]["rss_extra"], "largest_gather": rk["rows"][-1]["largest_gather"],
        } for r, rk in enumerate(a_ranks)],
        "anchor_s": max(rk["rows"][-1]["trainer_s"] for rk in a_ranks),
        "first_anchor_s": statistics.median(max(rk["rows"][0]["trainer_s"] for rk in j["ranks"]) for j in jobs),
        "samples": [[j["ranks"][r]["rows"][i]["trainer_s"] for j in jobs for i in timed] for r in range(world)],
        "rounds": [{"round": n + 1, "trainer_s": statistics.median(per_step(j, "trainer_s")),
                    "cpu_s": statistics.median(per_step(j, "cpu_s")), "steps_s": per_step(j, "trainer_s"),
                    "first_anchor_s": max(rk["rows"][0]["trainer_s"] for rk in j["ranks"])}
                   for n, j in enumerate(jobs)],
        "replica": anchored["replica"],
    }


def run(configs: list[tuple[str, int]], gb: float, steps: int, codec: str, rounds: int,
        log=print) -> tuple[list[dict], list[list[str]]]:
    """Every configuration ``rounds`` times, interleaved (the order reversed in every other round). Returns each
    configuration's pooled figures and the order each round ran in."""
    jobs: dict[tuple[str, int], list[dict]] = {c: [] for c in configs}
    order = []
    for n in range(rounds):
        seq = configs if n % 2 == 0 else configs[::-1]
        order.append([_key(*c) for c in seq])
        for c in seq:
            t0 = time.perf_counter()
            j = job(*c, gb, steps, codec, first=n == 0)
            jobs[c].append(j)
            med = statistics.median(max(rk["rows"][i]["trainer_s"] for rk in j["ranks"])
                                    for i in range(WARM + 1, WARM + 1 + steps))
            log(f"round {n + 1}/{rounds}: {_key(*c)}: trainer-side median {med:.3f} s "
                f"(job {time.perf_counter() - t0:.0f} s)")
    return [pool(*c, jobs[c], steps) for c in configs], order


def _key(method: str, world: int) -> str:
    return f"{method}-{world}"


def replica(url: str, versions: list[int]) -> dict:
    """A replica's hot-load of each timed delta (HotSwapper over host tensors, one core): prepare (fetch,
    decode, verify, stage) and the pause. Pieced deltas are applied box by box to a copy of each changed
    tensor, which is then proven whole and staged: what that costs beside a plain delta's records."""
    from ckptdelta.loader.hotswap import HotSwapper
    from ckptdelta.loader.reader import SnapshotReader

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

#: (tensors, ranks) of the synthetic layouts: 70B-like, 1T-like; with --quick, two small ones
SCALES = ((723, 64), (1830, 256))
QUICK_SCALES = ((72, 8), (180, 16))
METADATA_ROUNDS = 3

# What a fresh interpreter runs in a tree (this one, or a baseline's exported by git archive): its own
# metadata_cost, so each tree measures its own code with its own simulation of what ranks send.
# Its clock also notes the process's CPU time at each reading, so a tree whose metadata_cost gives no CPU time
# (from before it did) gives the CPU time between its first and last reading: its plan + commit.
_RUNNER = """
import json, sys, time
marks = []
class Clock:
    def __getattr__(self, name):
        return getattr(time, name)
    @staticmethod
    def perf_counter():
        marks.append(time.process_time())
        return time.perf_counter()
import benchmarks.sharded as b
b.time = Clock()
out = b.metadata_cost(int(sys.argv[1]), int(sys.argv[2]))
out.setdefault("cpu_s", marks[-1] - marks[0])
print(json.dumps(out))
"""


def synthetic_rank(n_tensors: int, world: int, r: int, rows: int | None = None) -> tuple[dict, dict, Any]:
    """Rank ``r``'s share of a delta of ``n_tensors`` bf16 tensors (8192-14336 rows of 8192, or ``rows`` of 64),
    each ``Shard(0)`` on ``world`` ranks, every piece written: its schema, its boxes and its entries
    (:class:`ckptdelta.publisher.writer.Written`, one delta object), as the rank has them before the commit round."""
    from ckptdelta.delta.manifest import ObjectRef, TensorEntry
    from ckptdelta.publisher.sharded import LocalBox
    from ckptdelta.publisher.writer import Written

    sch, boxes, w = {}, {}, Written()
    w.objects.append(ObjectRef(f"deltas/000000000001-w-1/rank-{r:05d}.ckd", 1 << 30, "0" * 16))
    for i in range(n_tensors):
        n_rows, cols = (8192 + (i % 7) * 1024, 8192) if rows is None else (rows, 64)
        name = f"model.layers.{i // 9}.mlp.proj_{i % 9}.weight"
        size = -(-n_rows // world)
        start = min(r * size, n_rows)
        n = min(size, n_rows - start)
        sch[name] = ("BF16", (n, cols))
        boxes[name] = LocalBox((n_rows, cols), (start, 0))
        w.entries[name] = TensorEntry("BF16", (n, cols), f"{(r * 7919 + i):016x}", 0, 8 + i * 100, 100)
    return sch, boxes, w


def metadata_cost(n_tensors: int, world: int, repeats: int = 1) -> dict:
    """Rank 0's share of one publish's metadata at a synthetic layout (no I/O): ``n_tensors`` tensors, each
    ``Shard(0)`` on ``world`` ranks and every piece written. Each rank's payloads of the two rounds are made
    and pickled as the rank sends them (untimed: the ranks' own work, in parallel); then on rank 0, timed
    (medians over ``repeats``): **plan** (``plan_union``: every rank's boxes checked and planned), **commit**
    (the merge of the ranks' entries into pieced entries, the manifest to JSON and parsed back: what _commit
    does before writing) and **wire** (unpickling the other ranks' payloads of both rounds, pickling the plan
    it broadcasts). ``plan_s + commit_s`` is what this function timed before ranks sent columns."""
    import gc
    import pickle

    from ckptdelta.delta.manifest import Manifest
    from ckptdelta.publisher.chain import Plan
    from ckptdelta.publisher.sharded import holdings, plan_union, with_boxes
    from ckptdelta.publisher.writer import merge

    proto = pickle.HIGHEST_PROTOCOL

    def rank(r: int) -> tuple:
        return synthetic_rank(n_tensors, world, r)

    first = [holdings(*rank(r)[:2]) for r in range(world)]
    round1 = [pickle.dumps(h, proto) for h in first]
    _union, layout = plan_union(first, 5 << 30)       # the plan each rank follows (timed below, on rank 0)
    del first
    round2 = []
    for r in range(world):
        _sch, boxes, w = rank(r)
        round2.append(pickle.dumps(with_boxes(w, boxes, layout).for_commit(), proto))
    own1, own2 = pickle.loads(round1[0]), pickle.loads(round2[0])      # rank 0's own: never pickled
    samples = []
    for _ in range(repeats):
        gc.collect()
        t, c = [time.perf_counter()], [time.process_time()]

        def mark() -> None:
            t.append(time.perf_counter())
            c.append(time.process_time())

        got = [own1] + [pickle.loads(b) for b in round1[1:]]
        mark()
        _union, layout = plan_union(got, 5 << 30)
        mark()
        plan_bytes = pickle.dumps(Plan(1, "delta", 0, 0, "delta", layout=layout), proto)
        parts = [own2] + [pickle.loads(b) for b in round2[1:]]
        mark()
        objects, entries, _wm, _x = merge(parts, layout)
        m = Manifest("r", 1, "delta", 0, 0, "now", 1, "w", tuple(objects), entries)
        data = m.to_json()
        Manifest.from_json(data)
        mark()
        samples.append({"plan_s": t[2] - t[1], "commit_s": t[4] - t[3], "wire_s": (t[1] - t[0]) + (t[3] - t[2]),
                        "cpu_s": (c[2] - c[1]) + (c[4] - c[3]), "wire_cpu_s": (c[1] - c[0]) + (c[3] - c[2])})
        del got, parts, objects, entries, m
    out = {k: statistics.median(x[k] for x in samples) for k in samples[0]}
    return {"tensors": n_tensors, "ranks": world, "pieces": n_tensors * world, **out,
            "manifest_bytes": len(data), "rank_metadata_bytes": len(round1[1]) + len(round2[1]),
            "rank0_received_bytes": sum(map(len, round1[1:])) + sum(map(len, round2[1:])),
            "plan_bytes": len(plan_bytes)}


def export_tree(rev: str, into: str) -> str:
    """The repository's files at ``rev`` (git archive), extracted under ``into``; returns the short hash."""
    import io
    import subprocess
    import tarfile

    short = subprocess.run(["git", "-C", harness.REPO, "rev-parse", "--short", rev], check=True,
                           capture_output=True, text=True).stdout.strip()
    tar = subprocess.run(["git", "-C", harness.REPO, "archive", "--format=tar", rev], check=True,
                         capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(tar)) as t:
        t.extractall(into, filter="data")
    return short


def _measure_in(tree: str, n_tensors: int, world: int) -> dict:
    import subprocess

    env = {**os.environ, "PYTHONPATH": tree}
    out = subprocess.run([sys.executable, "-c", _RUNNER, str(n_tensors), str(world)], cwd=tree, env=env,
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def metadata_run(scales: tuple[tuple[int, int], ...] = SCALES, rounds: int = METADATA_ROUNDS,
                 baseline: str | None = None, log=print) -> dict:
    """Rank 0's metadata per publish at each scale, ``rounds`` times, each a fresh interpreter: this tree's
    code and, with ``baseline`` (a git revision), that revision's beside it, in alternating order (baseline
    first in odd rounds), so the machine's drift falls on both alike. Medians per scale and tree; the commit
    measured, and whether the code measured (delta/, publisher/, benchmarks/) differs from it."""
    with tempfile.TemporaryDirectory(prefix="ckptdelta-metadata-") as d:
        trees = {"current": harness.REPO}
        rev = None
        if baseline is not None:
            rev = export_tree(baseline, d)
            trees = {"baseline": d, **trees}
        runs: dict[str, dict[tuple[int, int], list[dict]]] = {k: {s: [] for s in scales} for k in trees}
        for n in range(rounds):
            for scale in scales:
                for which in (list(trees) if n % 2 == 0 else list(trees)[::-1]):
                    t0 = time.perf_counter()
                    m = _measure_in(trees[which], *scale)
                    runs[which][scale].append(m)
                    log(f"metadata round {n + 1}/{rounds}: {which} {scale[0]} tensors x {scale[1]} ranks: plan + "
                        f"commit {m['plan_s'] + m['commit_s']:.2f} s (run {time.perf_counter() - t0:.0f} s)")
    import subprocess

    head = subprocess.run(["git", "-C", harness.REPO, "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip() or None
    code = ["delta", "publisher", "benchmarks/*.py"]
    dirty = bool(subprocess.run(["git", "-C", harness.REPO, "status", "--porcelain", "--untracked-files=no", "--",
                                 *code], capture_output=True, text=True).stdout.strip())
    out: dict = {"rounds": rounds, "baseline": baseline, "baseline_rev": rev, "current_rev": head,
                 "current_dirty": dirty, "scales": []}
    for scale in scales:
        row = {}
        for which, by in runs.items():
            ms_ = by[scale]
            med = {k: statistics.median(m[k] for m in ms_ if k in m)
                   for k in ("plan_s", "commit_s", "wire_s", "cpu_s", "wire_cpu_s") if any(k in m for m in ms_)}
            med["metadata_s"] = statistics.median(m["plan_s"] + m["commit_s"] for m in ms_)
            row[which] = {**ms_[0], **med, "samples": [m["plan_s"] + m["commit_s"] for m in ms_]}
        out["scales"].append({"tensors": scale[0], "ranks": scale[1], "pieces": scale[0] * scale[1], **row})
    return out


def metadata_table(meta: Any) -> list[str]:
    """The metadata section's table; ``meta`` a :func:`metadata_run` result, or a list of one-shot
    :func:`metadata_cost` results (a run from before rounds of it)."""
    if isinstance(meta, list):
        lines = ["| tensors | ranks | pieces | plan (s) | merge + manifest JSON round trip (s) | manifest | metadata "
                 "per rank | received by rank 0 |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for m in meta:
            lines.append(f"| {m['tensors']} | {m['ranks']} | {m['pieces']:,} | {m['plan_s']:.2f} | "
                         f"{m['commit_s']:.2f} | {mb(m['manifest_bytes'], 2)} MB | {mb(m['rank_metadata_bytes'], 2)} MB"
                         f" | {mb(m['rank0_received_bytes'], 2)} MB |")
        return lines
    base = meta.get("baseline_rev")
    head = ("| tensors | ranks | pieces | plan (s) | merge + manifest JSON round trip (s) | **plan + commit** (s) | "
            "its CPU (s) | growth vs the scale above (pieces) | wire (s) | manifest | received by rank 0 | "
            "plan broadcast |")
    rule = "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    if base:
        head += f" baseline {base}: plan + commit (s) | its CPU (s) | its growth | current / baseline |"
        rule += "---:|---:|---:|---:|"
    lines = [head, rule]
    prev = None
    for s in meta["scales"]:
        c = s["current"]
        grow = "" if prev is None else \
            f"{c['metadata_s'] / prev['current']['metadata_s']:.1f}x ({s['pieces'] / prev['pieces']:.1f}x)"
        line = (f"| {s['tensors']} | {s['ranks']} | {s['pieces']:,} | {c['plan_s']:.3f} | {c['commit_s']:.3f} | "
                f"**{c['metadata_s']:.3f}** | {c['cpu_s']:.3f} | {grow} | {c['wire_s']:.3f} | "
                f"{mb(c['manifest_bytes'], 2)} MB | {mb(c['rank0_received_bytes'], 2)} MB | "
                f"{mb(c['plan_bytes'], 2)} MB |")
        if base:
            b = s["baseline"]
            bgrow = "" if prev is None else f"{b['metadata_s'] / prev['baseline']['metadata_s']:.1f}x"
            line += f" {b['metadata_s']:.2f} | {b['cpu_s']:.2f} | {bgrow} | {c['metadata_s'] / b['metadata_s']:.3f}x |"
        lines.append(line)
        prev = s
    return lines


def metadata_report(meta: dict, argv: list[str], elapsed: float) -> str:
    base = meta.get("baseline_rev")
    last = meta["scales"][-1]
    cur = last["current"]["metadata_s"]
    lines = ["# Rank 0's metadata per publish at scale (`" + harness.command("sharded", argv) + "`)", "",
             f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, shared with other work. "
             f"Synthetic layouts (every tensor `Shard(0)` on every rank, every piece written), no I/O; each figure "
             f"the median of {meta['rounds']} rounds, each a fresh interpreter, this tree at "
             f"{meta.get('current_rev') or '?'}{' with changes not committed' if meta.get('current_dirty') else ''}"
             + (f" and the baseline {base} (git archive of `{meta['baseline']}`) alternating" if base
                else "") + f". Run took {elapsed:.0f} s.", "", *metadata_table(meta), "",
             "Plan: every rank's boxes checked and planned (`plan_union`). Commit: the ranks' entries merged into "
             "pieced entries, the manifest to JSON and parsed back (what rank 0 does before writing it). Plan + "
             "commit is what this benchmark timed before (and still times in the baseline's own code), wall "
             "time; its CPU: rank 0's process CPU time over the same span (on a machine other work shares, wall "
             "= CPU + waiting for a core). Wire: rank 0 unpickling what the other ranks send in both rounds and "
             "pickling the plan it broadcasts (wall).",
             "", f"- At {last['ranks']} ranks ({last['pieces']:,} pieces): plan + commit {cur:.3f} s wall, "
             f"{last['current']['cpu_s']:.3f} s CPU (target <= 1 s: {'met' if cur <= 1 else 'NOT met'} in wall "
             f"time, {'met' if last['current']['cpu_s'] <= 1 else 'NOT met'} in CPU time), "
             f"{cur + last['current']['wire_s']:.3f} s wall with the wire"
             + (f"; the baseline {last['baseline']['metadata_s']:.2f} s wall, {last['baseline']['cpu_s']:.2f} s CPU"
                if base else "") + "."]
    return "\n".join(lines) + "\n"


def metadata_plot(meta: dict, path: str) -> None:
    with harness.figure(path, 1, 1, figsize=(6, 4)) as (_, ax):
        pieces = [s["pieces"] for s in meta["scales"]]
        for which, style in (("baseline", "o--"), ("current", "o-")):
            if which in meta["scales"][0]:
                label = f"baseline {meta['baseline_rev']}" if which == "baseline" else "this tree"
                ax.plot(pieces, [s[which]["metadata_s"] for s in meta["scales"]], style, label=label)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.axhline(1.0, color="grey", lw=0.8, ls=":")
        ax.set_xlabel("pieces (tensors x ranks)")
        ax.set_ylabel("rank 0's plan + commit per publish (s)")
        ax.legend(fontsize=8)


# --- report --------------------------------------------------------------------------------------------------

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


def rounds_of(r: dict) -> list[dict]:
    """A configuration's per-round figures; a result from before rounds (no ``rounds``) is one round."""
    if "rounds" in r:
        return r["rounds"]
    return [{"round": 1, "trainer_s": r["trainer_s"], "cpu_s": r["cpu_s"],
             "steps_s": [max(x) for x in zip(*r["samples"])], "first_anchor_s": r["first_anchor_s"]}]


def round_ratios(one: dict, two: dict) -> list[float]:
    """2 ranks / 1 rank per round: each round's trainer-side medians."""
    return [b["trainer_s"] / a["trainer_s"] for a, b in zip(rounds_of(one), rounds_of(two))]


def round_table(res: list[dict], order: list[list[str]]) -> list[str]:
    one = next(r for r in res if r["ranks"] == 1 and r["method"] == "dtensor")
    two = next(r for r in res if r["ranks"] == 2 and r["method"] == "dtensor")
    base = next((r for r in res if r["method"] == "gather"), None)
    ratios = round_ratios(one, two)
    names = {"dtensor-1": "1 rank", "dtensor-2": "2 ranks", "gather-2": "gather"}
    steps = lambda rd: ", ".join(f"{x:.2f}" for x in rd["steps_s"])  # noqa: E731
    lines = ["| round | order | 1 rank: median (per step), s | 2 ranks: median (per step), s | 2 ranks / 1 rank |"
             + (" gather then publish: median, s |" if base else ""),
             "|---:|---|---|---|---:|" + ("---:|" if base else "")]
    for n, (a, b, q) in enumerate(zip(rounds_of(one), rounds_of(two), ratios)):
        seq = ", ".join(names.get(k, k) for k in order[n]) if n < len(order) else "?"
        lines.append(f"| {n + 1} | {seq} | {a['trainer_s']:.3f} ({steps(a)}) | {b['trainer_s']:.3f} ({steps(b)}) | "
                     f"{q:.2f}x |" + (f" {rounds_of(base)[n]['trainer_s']:.3f} |" if base else ""))
    return lines


def report(res: list[dict], meta: Any, args, elapsed: float, order: list[list[str]] | None = None) -> str:
    one = next(r for r in res if r["ranks"] == 1 and r["method"] == "dtensor")
    two = next(r for r in res if r["ranks"] == 2 and r["method"] == "dtensor")
    base = next((r for r in res if r["method"] == "gather"), None)
    order = order or [[_key(r["method"], r["ranks"]) for r in res]]     # a run from before rounds: in list order
    n_rounds = len(rounds_of(one))
    ratio = two["trainer_s"] / one["trainer_s"]
    ratios = round_ratios(one, two)
    spread = f"{min(ratios):.2f}-{max(ratios):.2f}x"
    method = (f"medians of {args.steps} deltas after {WARM} untimed" if n_rounds == 1 else
              f"{n_rounds} rounds, each a fresh job of every configuration ({WARM} untimed deltas, then "
              f"{args.steps} timed), the order reversed every other round; medians of the {n_rounds} x "
              f"{args.steps} timed deltas pooled")
    lines = [f"# Sharded publish: per-rank encoding of DTensor shards (`python -m benchmarks.sharded`)", "",
             f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores (each rank pinned to one), "
             f"model {one['full_bytes'] / 1e9:.2f} GB bf16 (benchmarks.workloads.scaled_pair, lr 1e-6), "
             f"codec={args.codec}, {method}, local-directory bucket. "
             f"Run took {elapsed:.0f} s.", "", *table(res), "",
             "Per-rank columns are rank 0 / rank 1. Trainer-side: publish() called -> committed on every rank (for "
             "the gather baseline: the all-gather of the parameters, then rank 0's publish; rank 1 waits). CPU: "
             "the CPU time of the busiest rank's process (all its threads) over the same span: the work each rank "
             "does, whatever else shares its core.", "",
             "## Per round", "", *round_table(res, order), "",
             (f"The 2-ranks / 1-rank ratio of each round's medians spans **{spread}** over {n_rounds} rounds "
              f"({', '.join(f'{q:.2f}x' for q in ratios)}); pooled, {ratio:.2f}x. Each round ran every "
              "configuration as a fresh job, in the order shown: the spread is what the machine's drift between "
              "jobs seconds to a minute apart does to the ratio." if n_rounds > 1 else
              "One round: each configuration ran once, one after the other, so this run cannot tell how much the "
              "machine's drift between them moved the ratio (`--rounds` interleaves them)."), "",
             f"- **At 2 ranks the DTensor publish takes {ratio:.2f}x the trainer-side time of 1 rank** ("
             + (f"pooled over {n_rounds} rounds; per round {spread}; " if n_rounds > 1 else "")
             + f"target <= 0.6x: {'met' if ratio <= 0.6 else 'NOT met'}"
             + (f", in {sum(q <= 0.6 for q in ratios)} of {n_rounds} rounds" if n_rounds > 1 else "")
             + f"), and its busiest rank's CPU {two['cpu_s'] / one['cpu_s']:.2f}x of 1 rank's."]
    gathered = [p["gathered_tensor_bytes"] for p in two["per_rank"]]
    lines.append(f"- Bytes gathered for a delta: tensor bytes {gathered} (target: none, metadata only: "
                 f"{'met' if not any(gathered) else 'NOT met'}); metadata "
                 f"{[p['gathered_object_bytes'] for p in two['per_rank']]} bytes per rank (pickled schemas, "
                 "boxes, entries and the plan).")
    if one.get("replica") and two.get("replica"):
        lines.append(f"- A replica's hot-load of these deltas (one core{', round 1' if n_rounds > 1 else ''}): "
                     f"prepare {one['replica']['prepare_s']:.3f} s, "
                     f"pause {one['replica']['pause_s']:.3f} s for the 1-rank run's plain records; prepare "
                     f"{two['replica']['prepare_s']:.3f} s, pause {two['replica']['pause_s']:.3f} s for the 2-rank "
                     "run's pieces (row boxes staged one by one against the live tensor, each proving its bits).")
    if base is not None:
        lines.append(f"- Gather then publish on 2 ranks: {base['trainer_s']:.3f} s ({base['gather_s']:.3f} s "
                     f"gathering {base['per_rank'][0]['gathered_tensor_bytes']:,} bytes into each rank), "
                     f"{base['trainer_s'] / two['trainer_s']:.2f}x the DTensor publish.")
    a = two["per_rank"]
    lines += ["", f"## An anchor on 2 ranks (anchor=True after the timed deltas{', round 1' if n_rounds > 1 else ''})",
              "",
              "| rank | own shards (bytes) | tensor bytes gathered in | largest gather buffer | extra RSS during the "
              "anchor | bound: the largest piece of another rank, or its tensor's other pieces for a column cut |", "|---:|---:|---:|---:|---:|---:|"]
    for p in a:
        lines.append(f"| {p['rank']} | {p['own_bytes']:,} | {p['anchor_tensor_bytes']:,} | {p['largest_gather']:,}"
                     f" | {p['anchor_rss_extra']:,} | {two['largest_tensor'] // 2:,} (rows) |")
    lines += ["", f"Anchor trainer-side: {two['anchor_s']:.2f} s on 2 ranks, {one['anchor_s']:.2f} s on 1 (the "
              f"first publish, also an anchor, with every first-use cost: {two['first_anchor_s']:.2f} s and "
              f"{one['first_anchor_s']:.2f} s{', medians of the rounds' if n_rounds > 1 else ''}). With the default "
              "5 GiB shards this model's pieced tensors make one shard, so rank 0 writes it and receives rank 1's "
              "rows, one tensor at a time, point to point. Its "
              "memory beyond the publisher's usual host copies (the parent and the staging copy of its own shards, "
              "reused from step to step) is one received piece at a time for row pieces (the 'largest gather "
              "buffer'; bound: the largest tensor's other half), or a tensor's other pieces plus a block of at most "
              "64 MiB for a tensor cut along another dimension than 0; a rank that only sends allocates nothing. The "
              "extra RSS is what the process's resident size rose by during the anchor (2 ms samples; file pages "
              "are not counted)."]
    if meta:
        lines += ["", "## Rank 0's metadata per publish at scale (measured here, no I/O)", "", *metadata_table(meta)]
    return "\n".join(lines) + "\n"


def plot(res: list[dict], path: str) -> None:
    with harness.figure(path, 1, 2, figsize=(11, 4)) as (_, (ax, bx)):
        labels = [f"{r['method']}\n{r['ranks']} rank{'s' if r['ranks'] > 1 else ''}" for r in res]
        ax.bar(labels, [r["trainer_s"] for r in res], color=["#4c72b0", "#55a868", "#c44e52"][:len(res)])
        for x, r in enumerate(res):        # each round's own median: how far the machine moved it
            ys = [rd["trainer_s"] for rd in rounds_of(r)]
            ax.plot([x] * len(ys), ys, "k.", label="a round's median" if x == 0 else None)
        ax.legend(loc="upper left", fontsize=8)
        ax.set_ylabel("trainer-side seconds per delta (median, pooled)")
        ax.set_title("publish() -> committed")
        bx.bar(labels, [max(1, max(p["gathered_tensor_bytes"] + p["gathered_object_bytes"] for p in r["per_rank"]))
                        for r in res], color=["#4c72b0", "#55a868", "#c44e52"][:len(res)])
        bx.set_yscale("log")
        bx.set_ylabel("bytes received from other ranks per delta (max rank)")
        bx.set_title("bytes gathered")


def main(argv: list[str] | None = None) -> int:
    p = harness.parser("sharded", __doc__, quick="small metadata scales and 2 rounds (tests)", out="--out",
                       from_json="write the table and plot again from a run's JSON; no run",
                       from_json_flag="--render", from_json_metavar="JSON")
    p.add_argument("--gb", type=float, default=1.0, help="model size in GB (default 1)")
    p.add_argument("--steps", type=int, default=STEPS,
                   help=f"timed deltas per configuration and round (default {STEPS})")
    p.add_argument("--rounds", type=int, default=None,
                   help=f"rounds, each a fresh job of every configuration, interleaved (default {ROUNDS}; "
                        "2 with --quick)")
    p.add_argument("--codec", default="fast", choices=("fast", "context"))
    p.add_argument("--no-baseline", action="store_true", help="skip gather-then-publish")
    p.add_argument("--no-metadata", action="store_true")
    p.add_argument("--metadata-only", action="store_true",
                   help="only rank 0's metadata at scale (no gloo jobs): writes sharded_metadata.{md,json,png}")
    p.add_argument("--metadata-rounds", type=int, default=None,
                   help=f"rounds of the metadata measurement, each a fresh interpreter (default {METADATA_ROUNDS}; "
                        "2 with --quick)")
    p.add_argument("--metadata-baseline", metavar="REV", default=None,
                   help="also measure the metadata in this git revision's code (git archive), beside, alternating")
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    if args.metadata_rounds is None:
        args.metadata_rounds = 2 if args.quick else METADATA_ROUNDS
    scales = QUICK_SCALES if args.quick else SCALES
    log = (lambda m: print(m, file=sys.stderr, flush=True))  # noqa: E731
    if args.rounds is None:
        args.rounds = 2 if args.quick else ROUNDS
    if args.rounds < 1 or args.steps < 1:
        p.error("--rounds and --steps must be at least 1")
    if args.metadata_only:
        if "--out" in argv:         # where the files went says nothing about what was measured
            i = argv.index("--out")
            argv = argv[:i] + argv[i + 2:]
        t0 = time.perf_counter()
        meta = metadata_run(scales, args.metadata_rounds, args.metadata_baseline, log=log)
        elapsed = time.perf_counter() - t0
        harness.write(os.path.join(args.out, "sharded_metadata"), metadata_report(meta, argv, elapsed),
                      {"argv": argv, "metadata": meta, "elapsed_s": elapsed}, lambda path: metadata_plot(meta, path))
        return 0
    stem = os.path.join(args.out, "sharded")
    if args.render:
        saved = harness.read_json(args.render)
        run_args = argparse.Namespace(**saved["args"])
        text = report(saved["results"], saved["metadata"], run_args, saved.get("elapsed_s", 0.0),
                      saved.get("order"))
        harness.write(stem, text, plot=lambda path: plot(saved["results"], path))
        return 0
    t0 = time.perf_counter()
    configs = [("dtensor", 1), ("dtensor", 2)] + ([] if args.no_baseline else [("gather", 2)])
    res, order = run(configs, args.gb, args.steps, args.codec, args.rounds, log=log)
    meta = None if args.no_metadata else metadata_run(scales, args.metadata_rounds, args.metadata_baseline, log=log)
    elapsed = time.perf_counter() - t0
    harness.write(stem, report(res, meta, args, elapsed, order),
                  {"args": {k: v for k, v in vars(args).items() if k != "out"},      # where, not what was measured
                   "results": res, "order": order, "metadata": meta, "elapsed_s": elapsed},
                  lambda path: plot(res, path))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
