"""LoRA runs on a vLLM replica: ckptdelta beside the full adapter every step and XOR + zstd-3 adapter deltas.

One run, the same adapters for every method (issue 30, item 6):

- **the base**: a Llama-shaped bf16 model made here with random weights (default:
  hidden 1024, 16 layers, intermediate 2816, 8 heads / 4 KV heads, vocabulary 32000,
  untied: 0.51 GB; nothing is downloaded);
- **the adapters**: peft LoRA on every linear layer, rank 16 and 64 (alpha 2r, fp32
  as peft trains them; ``--dtype bf16`` publishes them cast to bf16 for every method;
  with fp32, ckptdelta publishes the bf16 vLLM keeps and attaches the fp32 bits after
  each commit, ``Publisher(dtype=torch.bfloat16, keep_exact=True)``, while the baselines
  ship the fp32 adapter, unless ``--ckptdelta-fp32 as-is``), trained by
  AdamW on real gradients (next-token loss of a small random batch) in the trainer
  process, after ``--warmup`` steps; ``--steps`` steps at lr 1e-5, then as many at
  1e-4 (the same adapter, its optimizer's lr raised). The trainer computes in fp32
  over the bf16 base upcast exactly (CPU torch's bf16 matmuls are 5-80x slower
  here), on ``--trainer-threads`` threads; the run records the bf16 base;
- **the bucket and the links**: ``rclone serve s3`` over a directory
  (benchmarks/s3disk.py), the trainer and the replica each in their own network
  namespace with a 1 Gbit/s link (tc tbf; benchmarks/links.py), as
  benchmarks/at_scale.py does. Without namespaces (not root, no ``ip``/``tc``) the run
  says so and uses an unshaped local-directory bucket, labelled as such;
- **the replica**: one vLLM (CPU build here) per rank, started by ckptdelta's LoRA
  engine (``build_engine("vllm", ..., lora_slots=3)``, the replica app in front)
  with two more LoRA slots for the baselines' adapters, which load into the same
  vLLM by name; a sampling load of ``--clients`` streaming clients runs throughout,
  aimed at the adapter of the method being measured;
- **the methods** (benchmarks/lora_peers.py): (a) ckptdelta: ``Publisher.publish`` ->
  ``POST /v1/hotload``; (b) the whole adapter every step through the bucket, loaded
  with vLLM's ``/v1/load_lora_adapter`` (``load_inplace``); (c) XOR + zstd-3 adapter
  deltas, applied to the replica's copy, written as an adapter directory and loaded
  the same way. Each step the trainer takes one AdamW step, then every method
  publishes that adapter and the replica loads it.
- **when the replica hears of it** (``--notice``): ``after`` (the default) relays
  publish()'s answer to the replica; ``start`` tells the replica which version or
  step is coming as publish() starts, as an RL loop that asks its replicas for the
  next policy while the trainer publishes it: ckptdelta's hot-load carries
  ``await_commit_s`` (the replica fetches the delta's parts as they land,
  docs/SERVING.md), and the baselines wait for their objects to exist (a HEAD every
  10 ms) and then fetch them, so every method starts the moment it can. Here the
  trainer, the bucket's server, the replica and vLLM share 2 cores, so the
  replica's fetching beside the upload takes cores from the trainer's encode:
  docs/PERFORMANCE.md has both.

Columns: bytes per step (what the method's prefix of the bucket grew by on the
server's disk), trainer-side time (serialize / encode), publish() -> serving, and
the pause, the same measures for every method: how long the write held vLLM's
engine loop, timed inside the worker (ckptdelta: its slot write's registry swap; (b)/(c):
vLLM's own in-place directory load, run by the worker method
``ckptdelta_lora_load_dir`` right after the HTTP call: the issue's pause target
compares these), the write call's wall time (what the caller waits: it includes
waiting for the engine step in progress), and the longest interval without any
streamed token around the call (shown as meaningful only where ordinary
inter-token intervals are short enough to resolve the target); requests failed or
aborted, tokens/s while the replica prepares; and the CPU each process (trainer,
replica, vLLM, the S3 server) spent in each step (benchmarks/proc_cpu.py), which shows
whose cores a method's path waited for. The trainer runs ``--trainer-threads``
torch threads (default 1) so that vLLM keeps a core of a small machine.
Every step is checked (untimed): ckptdelta's own proof, the baselines' files
against the trainer's digests, and vLLM's LoRA buffers of each baseline adapter
against ckptdelta's serving slot, bit for bit.

    python -m benchmarks.lora                 # 0.51 GB base, ranks 16 and 64, fp32 adapters: ~6-8 min on 2 cores
    python -m benchmarks.lora --ckptdelta-fp32 as-is   # the same, ckptdelta publishing the fp32 adapter itself
    python -m benchmarks.lora --dtype bf16    # the same, adapters published in bf16 (vLLM's LoRA dtype)
    python -m benchmarks.lora --quick         # tiny base, rank 16, 1 step per lr: ~1 min (a smoke test)

Writes benchmarks/results/lora{,-asis,-bf16}{,-quick}.{md,json,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from typing import Any

import torch

from benchmarks import harness, links, lora_load, proc_cpu, s3disk
from benchmarks.harness import du, duration
from benchmarks.lora_peers import LABELS, METHODS

FULL = dict(hidden=1024, layers=16, intermediate=2816, heads=8, kv_heads=4, vocab=32000)
QUICK = dict(hidden=128, layers=2, intermediate=256, heads=4, kv_heads=2, vocab=512)
VLLM_ARGS = ["--enforce-eager", "--max-model-len", "512", "--dtype", "bfloat16", "--max-num-seqs", "16",
             "--disable-log-stats"]
SLOTS = 3
LINK = 1e9


# --- the base ---------------------------------------------------------------------------------------

def save_base(out: str, c: dict) -> tuple[str, int]:
    """A random bf16 Llama of shape ``c`` (+ tokenizer) written as a model directory; its weight bytes."""
    from benchmarks.vllm_hotload import llama_names, save_model_dir

    g = torch.Generator().manual_seed(0)
    w = {}
    for n, shape in llama_names(c).items():
        t = torch.randn(shape, generator=g)
        w[n] = ((1.0 + 0.1 * t) if n.endswith("norm.weight") else 0.02 * t).to(torch.bfloat16)
    nbytes = sum(t.numel() * 2 for t in w.values())
    save_model_dir(out, c, w)
    return out, nbytes


# --- a peer process -------------------------------------------------------------------------------------

def start_peer(role: str, lab: links.Lab | None, host: links.Host | None, url: str, opts: dict, scratch: str,
               env: dict[str, str] | None = None) -> harness.Peer:
    """benchmarks/lora_peers.py ROLE in a lab host (or a plain child without one), once it says it is up."""
    p = harness.Peer(role, [sys.executable, "-m", "benchmarks.lora_peers", role, url, json.dumps(opts),
                            os.path.join(scratch, role)], os.path.join(scratch, f"{role}.log"), lab=lab, host=host,
                     env=env, timeout=1800.0)
    p.recv(120)
    return p


#: The replica peer's descendants are its vLLM server (the engine runs in that one process): counted as vLLM's.
VLLM_BELOW = {"replica": "vLLM"}
#: The roles whose CPU a step's table shows, in order, and what each holds.
CPU_ROLES = (("trainer", "trainer"), ("replica", "replica (ckptdelta's replica app and hot-load; the baselines' "
                                                 "fetch and files; the sampling clients)"),
             ("vLLM", "vLLM (its generation for the sampling load included)"), ("S3 server", "S3 server"))


# --- one step of one method ------------------------------------------------------------------------------

def one_step(ctx: dict, method: str, rank: int, lr: float, want: dict[str, str], timed: bool) -> dict[str, Any]:
    trainer, rep, lab = ctx["trainer"], ctx["replica"], ctx["lab"]
    idle = rep.call("target", method=method, settle=ctx["settle"])["idle"]
    where = os.path.join(ctx["disk"], ctx["prefix"], method)
    d0, e0 = du(where), du(os.path.join(where, "exact"))
    c0 = lab.counters(ctx["srv"]) if lab else None
    u0 = proc_cpu.cpu_by_role(ctx["cpu_roles"], descendants_as=VLLM_BELOW)
    if ctx["notice"] == "start":
        # the replica is told what is coming as publish() starts, and waits for it (each method its own way)
        coming = {"version": ctx["version"] + 1} if method == "ckptdelta" else {"step": ctx["step"]}
        heard: dict[str, Any] = {}
        t = threading.Thread(target=lambda: heard.update(rep.call("hotload", method=method, info=coming, early=True)))
        t.start()
        try:
            p = trainer.call("publish", method=method)
        finally:
            t.join()
        h = heard
        if method == "ckptdelta" and p["version"] != coming["version"]:
            raise RuntimeError(f"published version {p['version']}, the replica was told {coming['version']}")
    else:
        p = trainer.call("publish", method=method)
        h = rep.call("hotload", method=method, info=p)
    cpu = proc_cpu.spent(u0, proc_cpu.cpu_by_role(ctx["cpu_roles"], descendants_as=VLLM_BELOW))
    if method == "ckptdelta":
        ctx["version"] = p["version"]
        settled = trainer.call("settle", version=p["version"])     # untimed: the attachment, then its check
    c1 = lab.counters(ctx["srv"]) if lab else None
    s = {"method": method, "rank": rank, "lr": lr, "timed": timed, "bytes": du(where) - d0,
         "exact_bytes": du(os.path.join(where, "exact")) - e0,
         "trainer_s": p["trainer_s"], "upload_s": p["upload_s"], "publish_s": p["publish_s"],
         "publish_to_serving_s": h["t_serving"] - p["t0"], "pause_rpc_s": h["pause_rpc_s"], "hold_s": h["hold_s"],
         "t0": p["t0"], "t_serving": h["t_serving"], "rpc": h["rpc"], "prepare": h["prepare"], "idle": idle,
         "wire_up": (c1["rx_bytes"] - c0["rx_bytes"]) if lab else None,
         "wire_down": (c1["tx_bytes"] - c0["tx_bytes"]) if lab else None, "cpu": cpu}
    if method == "ckptdelta":
        s.update(kind=p["kind"], codec=p["codec"], threads=p.get("threads"), version=p["version"],
                 landed=h.get("bytes_landed"),
                 exact=h["serving_version"] == p["version"] and h["proven"] == "full" and settled["exact"] is not False,
                 fp32_attached=settled["exact"], settle_s=settled["settle_s"],
                 workers=h["workers"], prove_s=h["prove_s"], report=h.get("report"))
    else:
        s["exact"] = h["digests"] == want
        s["workers"] = h["workers"]
    print(f"  r{rank} lr {lr:g} {method:>9}{'' if timed else ' (untimed)'}: {s['bytes'] / 1e6:7.3f} MB, trainer "
          f"{s['trainer_s']:.3f} s, publish->serving {s['publish_to_serving_s']:.3f} s, engine loop "
          f"held {s['hold_s'] * 1e3:.0f} ms, write call {s['pause_rpc_s'] * 1e3:.0f} ms"
          f"{'' if s['exact'] else '  NOT EXACT'}", flush=True)
    return s


def run_rank(ctx: dict, a: argparse.Namespace, rank: int) -> tuple[list[dict], dict[str, Any]]:
    trainer, rep = ctx["trainer"], ctx["replica"]
    ctx["prefix"] = prefix = f"r{rank}"
    t0 = time.perf_counter()
    init = trainer.call("init", base_dir=ctx["base"], rank=rank, prefix=prefix, warmup=a.warmup, lr=a.lrs[0],
                        dtype=a.dtype, batch=a.batch, threads=a.trainer_threads,
                        codec=None if a.codec == "auto" else a.codec, keep_exact=keep_exact(a))
    ctx["version"], ctx["step"] = init["version"], init["step"]
    print(f"rank {rank}: adapter {init['adapter_params'] / 1e6:.2f} M params ({init['adapter_bytes'] / 1e6:.1f} MB, "
          f"{init['tensors']} tensors), {a.warmup} warm-up steps in {time.perf_counter() - t0:.0f} s", flush=True)
    max_rank = next(r for r in (8, 16, 32, 64, 128, 256) if r >= rank)
    args = [*VLLM_ARGS, "--max-loras", str(SLOTS + 2), "--max-cpu-loras", str(SLOTS + 2), "--max-lora-rank",
            str(max_rank)]
    t0 = time.perf_counter()
    st = rep.call("start", prefix=prefix, step=init["step"], base_dir=ctx["base"], vllm_args=args, slots=SLOTS, clients=a.clients,
                  max_tokens=a.max_tokens, vllm_log=os.path.join(ctx["scratch"], f"vllm-{prefix}.log"))
    print(f"rank {rank}: vLLM replica up in {time.perf_counter() - t0:.0f} s (LoRA adapters {st['ids']})", flush=True)
    samples, checks = [], []
    plan = [(a.lrs[0], False)] * a.untimed + [(lr, True) for lr in a.lrs for _ in range(a.steps)]
    train_s = []
    for lr, timed in plan:
        tr = trainer.call("train", lr=lr)
        ctx["step"] = tr["step"]
        train_s.append(tr["train_s"])
        for m in a.methods:
            samples.append(one_step(ctx, m, rank, lr, tr["digests"], timed))
        if "full" in a.methods or "xor" in a.methods:
            checks.append(rep.call("check", methods=[m for m in a.methods if m != "ckptdelta"])["same_as_ckptdelta_slot"])
    logs = rep.call("stop")
    trainer.call("close")
    info = {"rank": rank, "adapter_params": init["adapter_params"], "adapter_bytes": init["adapter_bytes"],
            "tensors": init["tensors"], "vllm_start_s": st["vllm_start_s"], "checks": checks,
            "warmup_train_s": init["warmup_train_s"], "train_s": train_s,
            # the sampling load as it was seen, to check the token-gap columns against
            "load_log": {"chunks": [round(t, 4) for t in sorted(logs["chunks"])], "requests": logs["requests"],
                         "steps": [{k: s[k] for k in ("method", "lr", "t0", "t_serving", "rpc", "prepare", "idle")}
                                   for s in samples]}}
    return samples, {**info, **analyse(samples, logs)}


# --- what the sampling load saw -----------------------------------------------------------------------------

def analyse(samples: list[dict], logs: dict[str, Any]) -> dict[str, Any]:
    """Per step: the longest token-free interval around the write call, tokens/s while preparing and idle, the
    requests of its method that failed or ended otherwise while it ran; the typical inter-token gap."""
    chunks = sorted(logs["chunks"])
    tokens = logs["tokens"]
    reqs = logs["requests"]
    for s in samples:
        s["stall_s"] = lora_load.stall(chunks, *s["rpc"])
        s["prepare_tok_s"] = lora_load.rate(tokens, *s["prepare"])
        s["idle_tok_s"] = lora_load.rate(tokens, *s["idle"])
        span = (s["t0"], s["t_serving"] + 1.0)
        mine = [r for r in reqs if r["label"] == s["method"] and r["t1"] > span[0] and r["t0"] < span[1]]
        s["requests"] = len(mine)
        s["failed"] = sum(1 for r in mine if r["error"])
        s["errors"] = sorted({r["error"] for r in mine if r["error"]})[:3]
        s["mixed_versions"] = sum(1 for r in mine if r["versions"] is not None and len(r["versions"]) != 1)
    idle_gaps = lora_load.gaps(chunks, [tuple(s["idle"]) for s in samples])
    by_label: dict[str, dict[str, int]] = {}
    for r in reqs:
        b = by_label.setdefault(r["label"], {"requests": 0, "failed": 0, "mixed_versions": 0, "tokens": 0,
                                             "seconds": []})
        b["requests"] += 1
        b["seconds"].append(r["t1"] - r["t0"])
        b["failed"] += bool(r["error"])
        b["tokens"] += r["tokens"]
        b["mixed_versions"] += r["versions"] is not None and len(r["versions"]) != 1
    for b in by_label.values():
        b["request_s_median"] = statistics.median(b.pop("seconds"))
    return {"idle_gap_median_s": statistics.median(idle_gaps) if idle_gaps else None,
            "idle_gap_p99_s": sorted(idle_gaps)[int(0.99 * (len(idle_gaps) - 1))] if idle_gaps else None,
            "load": by_label, "errors": sorted({r["error"] for r in reqs if r["error"]})[:5]}


FIELDS = ("bytes", "trainer_s", "upload_s", "publish_s", "publish_to_serving_s", "hold_s", "pause_rpc_s", "stall_s",
          "prepare_tok_s", "idle_tok_s")


def rows_of(samples: list[dict]) -> list[dict[str, Any]]:
    rows = []
    keys = sorted({(s["rank"], s["lr"], s["method"]) for s in samples if s["timed"]},
                  key=lambda k: (k[0], k[1], METHODS.index(k[2])))
    for rank, lr, m in keys:
        ss = [s for s in samples if s["timed"] and (s["rank"], s["lr"], s["method"]) == (rank, lr, m)]
        row = {"rank": rank, "lr": lr, "method": m, "n": len(ss), **harness.medians(ss, FIELDS)}
        for k in ("failed", "requests", "mixed_versions"):
            row[k] = sum(s[k] for s in ss)
        row["exact"] = all(s["exact"] for s in ss)
        if all(s.get("cpu") for s in ss):
            row["cpu"] = {k: statistics.median(s["cpu"].get(k, 0.0) for s in ss) for k in ss[0]["cpu"]}
            row["cpu_own"] = statistics.median(sum(v for k, v in s["cpu"].items() if k != "vLLM") for s in ss)
        if m == "ckptdelta":
            row["kinds"] = sorted({s["kind"] for s in ss})
            row["exact_bytes"] = statistics.median(s.get("exact_bytes", 0) for s in ss)
            row["prove_s"] = statistics.median(s["prove_s"] for s in ss)
            # the copy into the slot, beside vLLM's steps (workers' write_s less what they held the lock for)
            row["copy_s"] = statistics.median(max((w.get("write_s") or 0.0) - (w.get("held_s") or 0.0)
                                                  for w in s["workers"]) for s in ss)
        rows.append(row)
    return rows


# --- the run ----------------------------------------------------------------------------------------------

def run(a: argparse.Namespace) -> dict[str, Any]:
    c = QUICK if a.quick else FULL
    why = links.available()
    meta: dict[str, Any] = {
        "machine": harness.machine(), "quick": a.quick,
        "model": c, "ranks": a.ranks, "lrs": a.lrs, "steps": a.steps, "untimed": a.untimed, "warmup": a.warmup,
        "batch": a.batch, "dtype": a.dtype, "keep_exact": keep_exact(a), "codec": a.codec, "clients": a.clients, "max_tokens": a.max_tokens, "settle_s": a.settle,
        "load_timing": "every streamed chunk", "trainer_threads": a.trainer_threads, "notice": a.notice, "argv": a.argv, "slots": SLOTS, "vllm_args": VLLM_ARGS,
        "links": None if why else f"{LINK / 1e9:g} Gbit/s", "links_unavailable": why}
    if why:
        print(f"NOTE: shaped links are not available here ({why}): the bucket is an UNSHAPED local directory",
              flush=True)
    t_all = time.perf_counter()
    scratch = tempfile.mkdtemp(prefix="ckptdelta-lora-bench-")
    lab = None
    peers: list[harness.Peer] = []
    samples: list[dict] = []
    ranks: list[dict] = []
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    try:
        base, nbytes = save_base(os.path.join(scratch, "base"), c)
        meta["base_bytes"] = nbytes
        print(f"base: {nbytes / 1e9:.3f} GB bf16 ({c})", flush=True)
        ctx: dict[str, Any] = {"base": base, "scratch": scratch, "settle": a.settle, "lab": None, "srv": None,
                               "notice": a.notice}
        if not why:
            s3disk.rclone_binary()
            lab = links.Lab().__enter__()
            srv = lab.add_host("srv")
            th = lab.add_host("trainer", rate_bit=LINK)
            rh = lab.add_host("replica", rate_bit=LINK)
            server = s3disk.start(lab, srv, os.path.join(scratch, "bucket"))
            url, opts = server.url, server.options
            ctx.update(lab=lab, srv=srv, disk=os.path.join(scratch, "bucket", s3disk.BUCKET))
            meta["bucket"] = f"rclone serve s3 ({s3disk.RCLONE_PIN}) over a directory, server link unshaped"
        else:
            th = rh = None
            url, opts = os.path.join(scratch, "bucket"), {}
            os.makedirs(url)
            ctx["disk"] = url
            meta["bucket"] = "a local directory (unshaped: no network namespaces here)"
        ctx["trainer"] = start_peer("trainer", lab, th, url, opts, scratch, env)
        ctx["replica"] = start_peer("replica", lab, rh, url, opts, scratch, env)
        ctx["cpu_roles"] = {"trainer": ctx["trainer"].proc.pid, "replica": ctx["replica"].proc.pid,
                            "S3 server": server.proc.pid if lab else None}
        peers = [ctx["trainer"], ctx["replica"]]
        for rank in a.ranks:
            s, info = run_rank(ctx, a, rank)
            samples += s
            ranks.append(info)
    except BaseException:
        for p in peers:
            print(f"--- {p.name} log tail ---\n{harness.tail(p.log_path, 4000)}", file=sys.stderr)
        raise
    finally:
        for p in peers:
            p.close(120)
        if lab is not None:
            lab.close()
        shutil.rmtree(scratch, ignore_errors=True)
    meta["wall_s"] = time.perf_counter() - t_all
    out = {"meta": meta, "ranks": ranks, "rows": rows_of(samples), "samples": samples}
    out["targets"] = targets(out)
    out["exact"] = all(s["exact"] for s in samples) and all(
        v is True for info in ranks for chk in info["checks"] for v in chk.values())
    return out


# --- report --------------------------------------------------------------------------------------------------

def gap_resolves(rank_info: dict[str, Any], b_hold: float) -> str | None:
    """None when the token-gap measurement can resolve the 1/5 pause target at this rank; else why not.

    The longest token-free interval around a call is the time vLLM did not generate plus up to one ordinary
    inter-token interval, so it can show a pause of 1/5 of (b)'s only when ordinary intervals (p99, while
    idle) are shorter than 1/5 of (b)'s engine-loop hold."""
    p99 = rank_info.get("idle_gap_p99_s")
    if p99 is None:
        return "no two streamed chunks timed inside any idle window"
    if p99 >= b_hold / 5:
        return (f"ordinary inter-token intervals (p99 {duration(p99)} while idle) are not under 1/5 of (b)'s "
                f"engine-loop hold ({duration(b_hold)} / 5)")
    return None


def targets(out: dict[str, Any]) -> list[dict[str, Any]]:
    by = {(r["rank"], r["lr"], r["method"]): r for r in out["rows"]}
    info = {i["rank"]: i for i in out.get("ranks", ())}
    res = []
    for rank in sorted({r["rank"] for r in out["rows"]}):
        for lr in sorted({r["lr"] for r in out["rows"]}):
            a, b, c = (by.get((rank, lr, m)) for m in METHODS)
            if not a:
                continue
            if c:
                x = c["bytes"] / a["bytes"]
                res.append({"what": f"rank {rank}, lr {lr:g}: bytes per step >= 1.5x fewer than (c) XOR+zstd-3",
                            "value": f"{x:.2f}x fewer ({a['bytes'] / 1e6:.2f} vs {c['bytes'] / 1e6:.2f} MB)",
                            "met": x >= 1.5})
            peers = [r for r in (b, c) if r]
            if peers:       # issue 42: no later than the simplest peer, whichever served sooner in this row
                best = min(peers, key=lambda r: r["publish_to_serving_s"])
                x = a["publish_to_serving_s"] / best["publish_to_serving_s"]
                res.append({"what": f"rank {rank}, lr {lr:g}: publish() -> serving <= the faster baseline's",
                            "value": f"{x:.2f}x of ({'b' if best is b else 'c'}) ({a['publish_to_serving_s']:.3f} "
                                     f"vs {best['publish_to_serving_s']:.3f} s)", "met": x <= 1.0})
            if b and rank >= 64:
                x = a["publish_to_serving_s"] / b["publish_to_serving_s"]
                res.append({"what": f"rank {rank}, lr {lr:g}: publish() -> serving <= 0.5x of (b) the full adapter's",
                            "value": f"{x:.2f}x of (b) ({a['publish_to_serving_s']:.3f} vs "
                                     f"{b['publish_to_serving_s']:.3f} s)", "met": x <= 0.5})
            if b:
                x = a["hold_s"] / b["hold_s"]
                res.append({"what": f"rank {rank}, lr {lr:g}: pause <= 1/5 of (b)'s load (engine loop held, "
                                    f"timed in the worker)",
                            "value": f"{x:.2f}x of (b) ({duration(a['hold_s'])} vs {duration(b['hold_s'])}; "
                                     f"ckptdelta's copy and proof ran beside it, {duration(a.get('copy_s', 0.0))} and "
                                     f"{duration(a.get('prove_s', 0.0))})", "met": x <= 1 / 5})
                x = a["pause_rpc_s"] / b["pause_rpc_s"]
                res.append({"what": f"rank {rank}, lr {lr:g}: for reference, not the target: the write call's "
                                    f"wall time (what the caller waits)",
                            "value": f"{x:.2f}x of (b) ({duration(a['pause_rpc_s'])} vs {duration(b['pause_rpc_s'])})",
                            "met": "info"})
                what = f"rank {rank}, lr {lr:g}: pause <= 1/5 of (b)'s load (longest token gap around the call)"
                why = gap_resolves(info.get(rank, {}), b["hold_s"])
                if why:
                    res.append({"what": what, "value": f"not meaningful here: {why}", "met": None})
                else:
                    x = a["stall_s"] / b["stall_s"] if b["stall_s"] else float("inf")
                    res.append({"what": what, "value": f"{x:.2f}x of (b) ({duration(a['stall_s'])} vs "
                                f"{duration(b['stall_s'])})", "met": x <= 1 / 5})
    failed = sum(r["failed"] for r in out["rows"])
    mixed = sum(r["mixed_versions"] for r in out["rows"] if r["method"] == "ckptdelta")
    res.append({"what": "0 requests failed or aborted (all methods' timed steps, under the sampling load)",
                "value": "; ".join(f"{m}: {sum(r['failed'] for r in out['rows'] if r['method'] == m)} of "
                                   f"{sum(r['requests'] for r in out['rows'] if r['method'] == m)}" for m in METHODS),
                "met": failed == 0})
    res.append({"what": "ckptdelta: every request on exactly one version",
                "value": f"{mixed} requests with more or fewer than one", "met": mixed == 0})
    return res


def command(meta: dict[str, Any]) -> str:
    if meta.get("argv") is not None:          # as run
        return harness.command("lora", meta["argv"])
    return "python -m benchmarks.lora" + (" --quick" if meta["quick"] else "")


def markdown(out: dict[str, Any]) -> str:
    meta, rows = out["meta"], out["rows"]
    codec = meta.get("codec", "auto")
    link = meta["links"] or f"UNSHAPED (shaped links unavailable: {meta['links_unavailable']})"
    lines = [f"# LoRA runs on a vLLM replica: ckptdelta beside full adapters and XOR + zstd-3 deltas"
             f" ({meta['dtype']} adapters{'; ckptdelta: bf16, fp32 kept exact' if meta.get('keep_exact') else ''}"
             f"{', quick' if meta['quick'] else ''})", "",
             f"`{command(meta)}`. {meta['machine']}; wall time "
             f"{meta['wall_s'] / 60:.1f} min. Base: Llama-shaped, random bf16 weights, {meta['base_bytes'] / 1e9:.2f} GB "
             f"({meta['model']}). Adapters: peft LoRA on every linear layer (alpha 2r), published as "
             + ("fp32 by the baselines and by ckptdelta as bf16 + its fp32 attachment" if meta.get("keep_exact")
                else meta["dtype"]) + f", AdamW (no weight decay) on real gradients of a {meta['batch'][0]}x{meta['batch'][1]} "
             f"token batch in the trainer process (fp32 compute over the bf16 base upcast exactly, "
             f"{meta.get('trainer_threads', 'all')} torch thread(s)), "
             f"{meta['warmup']} warm-up steps, then per learning rate {meta['steps']} timed steps "
             f"(medians; {meta['untimed']} untimed step first at each rank). Bucket: {meta['bucket']}; trainer and "
             f"replica links: {link}. Replica: one vLLM (CPU build, eager) per rank started by ckptdelta's LoRA "
             f"engine with {meta['slots']} slots, the baselines' two adapters loaded into the same vLLM by name; "
             f"{meta['clients']} streaming clients ({meta['max_tokens']} tokens each, back to back) on the adapter of "
             "the method being measured, throughout. " + (KEEP_EXACT if meta.get("keep_exact") else
             "Every method ships the same adapter bits each step. ") + NOTICE[meta.get("notice", "after")], "",
             "| rank | lr | method | bytes / step (MB) | vs (c) | trainer-side | upload | **publish() -> serving** | "
             "**engine loop held (worker)** | call wall time | longest token gap around the call | "
             "failed / aborted | tok/s preparing (idle) |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    by = {(r["rank"], r["lr"], r["method"]): r for r in rows}
    info = {i["rank"]: i for i in out["ranks"]}
    for r in rows:
        c = by.get((r["rank"], r["lr"], "xor"))
        b = by.get((r["rank"], r["lr"], "full"))
        vs = f"{c['bytes'] / r['bytes']:.2f}x fewer" if c and r["method"] != "xor" else ""
        kinds = f" ({', '.join(r['kinds'])})" if r.get("kinds") and r["kinds"] != ["delta"] else ""
        hold = duration(r["hold_s"]) + (f" (copy {duration(r['copy_s'])} and proof {duration(r['prove_s'])} beside it)"
                                   if "copy_s" in r else "")
        gap = duration(r["stall_s"])
        if b is None or gap_resolves(info.get(r["rank"], {}), b["hold_s"]):
            gap += " (not meaningful)"
        label = LABELS[r["method"]] + (f", codec={codec}" if r["method"] == "ckptdelta" and codec != "auto" else "")
        lines.append(f"| {r['rank']} | {r['lr']:g} | {label}{kinds} | {r['bytes'] / 1e6:.3f} | {vs} | "
                     f"{duration(r['trainer_s'])} | {duration(r['upload_s'])} | "
                     f"**{duration(r['publish_to_serving_s'])}** | **{hold}** | {duration(r['pause_rpc_s'])} | {gap} | "
                     f"{r['failed']} of {r['requests']} | "
                     f"{r['prepare_tok_s']:.1f} ({r['idle_tok_s']:.1f}) |")
    gaps = [(i["rank"], i["idle_gap_median_s"], i["idle_gap_p99_s"]) for i in out["ranks"]]
    lines += ["", "Bytes per step: what the method's prefix of the bucket grew by (ckptdelta: its data objects and "
              "manifest; (b): adapter_model.safetensors + adapter_config.json; (c): one object of per-tensor zstd "
              "frames and its index). Trainer-side: serialize (b) or XOR + compress (c) or ckptdelta's host copy + "
              "encode, in the trainer's process; upload: to the bucket (ckptdelta: data objects + commit). "
              "publish() -> serving: the trainer's publish call to the replica serving the new adapter (ckptdelta: "
              "its hot-load job READY, proven; (b)/(c): load_lora_adapter answered), one monotonic clock across the "
              "two processes." + ("" if not meta.get("keep_exact") else
              " ckptdelta's fp32 attachment per step (part of its bytes; written after the commit, while the "
              "replica fetched and served the bf16 snapshot): " + "; ".join(
                  f"rank {r['rank']} lr {r['lr']:g}: {r['exact_bytes'] / 1e6:.2f} MB"
                  for r in rows if r["method"] == "ckptdelta" and "exact_bytes" in r) + "."),
              "",
              "The pause, the same measures for every method. **Engine loop held (worker)**: how long the write "
              "held vLLM's engine loop, timed inside the vLLM worker (the loop runs it between two steps and "
              "generates nothing meanwhile): ckptdelta: the swap of vLLM's registry entry for the slot, which each "
              "worker's thread runs holding the lock vLLM's steps hold while they activate adapters "
              "(`lora_slots.write_locked`); the copy "
              "into the slot's rows, which no step reads, and the proof, which the baselines do not do, run beside "
              "vLLM's steps (in brackets); (b)/(c): vLLM's "
              "own in-place directory load, the LRU manager's `add_adapter(LoRARequest(..., load_inplace=True))` "
              "that the engine core runs for `load_lora_adapter`, run once more on the same directory right after "
              "the HTTP call by `ckptdelta_lora_load_dir` (loader/engines/vllm/worker/extension.py) and timed there. This is "
              "the column the issue's pause target compares. **Call wall time**: what the caller waits for the "
              "write (ckptdelta: the worker's wait for the lock, then the swap; (b)/(c): the HTTP "
              "`/v1/load_lora_adapter` call with "
              "`load_inplace`); it includes waiting for the engine step in progress to end, which is not time "
              "vLLM stops generating. **Longest token gap around the call**: the longest interval in which no "
              "streaming client received a token that overlaps the call: the time vLLM did not generate plus up "
              "to one ordinary inter-token interval, so it is reported as meaningful only where ordinary intervals "
              "(p99 while idle) are under 1/5 of (b)'s engine-loop hold. Ordinary intervals between streamed "
              "tokens when idle: " + ("; ".join(
                  f"rank {k}: median {duration(m)}, p99 {duration(p)}" for k, m, p in gaps if m is not None) or
                  "none measured (no two chunks inside any idle window)") + "." + (
                  "" if meta.get("load_timing") else " This run timed only streamed chunks that carried text, and "
                  "the random base's tokens mostly decode to none, so almost no chunk was timed: its token-gap "
                  "and tok/s columns say nothing (the sampling load times every chunk since)."),
              "",
              "Failed / aborted: requests of the method's adapter running between publish() and 1 s after serving "
              "that got an HTTP error, an error event, or a finish other than length/stop. tok/s preparing: tokens "
              "streamed while the replica fetched and prepared the new adapter (before the write call); idle: in "
              f"the {meta['settle_s']:g} s before the trainer's publish."]
    lines += ["", *stages(out["samples"])]
    lines += cpu_table(rows)
    verdict = {True: "met", False: "NOT met", None: "not measured", "info": "not a target"}
    lines += ["", "## Targets", ""] + [f"- {t['what']}: {t['value']} -> **{verdict[t['met']]}**"
                                       for t in out["targets"]]
    lines += ["", f"Every step checked: ckptdelta's own full proof of the slot, the baselines' files against the "
              f"trainer's digests, vLLM's LoRA buffers of each baseline adapter against ckptdelta's serving slot "
              f"(bit for bit): {'all exact' if out['exact'] else 'NOT ALL EXACT'}."]
    for i in out["ranks"]:
        load = "; ".join(f"{k}: {v['requests']} requests (median {v.get('request_s_median', 0):.1f} s), "
                         f"{v['failed']} failed, {v['tokens']} tokens"
                         for k, v in i["load"].items())
        train = i.get("train_s")
        lines.append(f"Rank {i['rank']}: adapter {i['adapter_params'] / 1e6:.2f} M params "
                     f"({i['adapter_bytes'] / 1e6:.1f} MB, {i['tensors']} tensors); vLLM replica start "
                     f"{i['vllm_start_s']:.0f} s; "
                     + (f"a trainer step {statistics.median(train):.1f} s (median); " if train else "")
                     + f"the whole sampling load: {load}"
                     f"{'; errors: ' + '; '.join(i['errors']) if i['errors'] else ''}.")
    return "\n".join(lines) + "\n"


KEEP_EXACT = ("The baselines ship the fp32 adapter each step; ckptdelta publishes the bf16 vLLM keeps of it "
              "(`Publisher(dtype=torch.bfloat16, keep_exact=True)`) and attaches the fp32 bits after each commit, "
              "while the replica fetches and serves the bf16 snapshot. Its bytes count both (the attachment's "
              "share below the table), and each step checks that the attachment rebuilds the trainer's fp32 adapter "
              "bit for bit. Every method's replica holds the same bits: vLLM casts the baselines' fp32 adapters to "
              "its bf16 as it loads them (the slots compared each step). ")
#: How the replica heard of each step (``--notice``), as the results say it.
NOTICE = {
    "start": "The replica is told which step is coming as publish() starts (`--notice start`): ckptdelta's hot-load "
             "asks with `await_commit_s` and fetches the delta's parts as they land, verified against the manifest "
             "once it is committed; (b) and (c) wait for their objects to exist (a HEAD every 10 ms), then fetch and "
             "load them.",
    "after": "The replica is told of a step once publish() has returned (`--notice after`).",
}


#: ckptdelta's publish() -> serving cut into its stages (seconds, from each timed step's own timings): the
#: trainer's, the replica's hot-load job (its report), each worker's write (the slowest worker's), and what is left.
STAGES = (
    ("trainer: host copy + encode", lambda s: s["trainer_s"]),
    ("rest of publish(): upload not overlapped with the encode, commit", lambda s: s["publish_s"] - s["trainer_s"]),
    ("replica: resolve, manifest, plan", lambda s: s["report"]["total_s"] - s["report"]["fetch_s"]
     - s["report"]["decode_s"] - s["report"]["apply_s"]),
    ("fetch", lambda s: s["report"]["fetch_s"]),
    ("decode + verify", lambda s: s["report"]["decode_s"]),
    ("host apply, write request, answer", lambda s: s["report"]["apply_s"] - sum(
        _worker(s, k) for k in ("prepare_s", "lock_wait_s", "write_s", "prove_s"))),
    ("workers' prepare: the host copy read and verified", lambda s: _prepared(s, "verify_s")),
    ("vLLM's transform (packing, scaling)", lambda s: _prepared(s, "transform_s")),
    ("the proof's reference", lambda s: _worker(s, "prepare_s") - _prepared(s, "verify_s")
     - _prepared(s, "transform_s")),
    ("lock wait", lambda s: _worker(s, "lock_wait_s")),
    ("copy + swap", lambda s: _worker(s, "write_s")),
    ("proof", lambda s: _worker(s, "prove_s")),
    ("the rest: the commit heard by the replica (--notice start: its next look at the store; after: publish()'s "
     "answer relayed, POST /v1/hotload, the job's start), READY heard",
     lambda s: s["t_serving"] - s["t0"] - s["publish_s"] - s["report"]["total_s"]),
)


def _worker(s: dict[str, Any], key: str) -> float:
    return max((w.get(key) or 0.0) for w in s["workers"])


def _prepared(s: dict[str, Any], part: str) -> float:
    """A part of the slowest worker's preparation (``prepare_parts``; 0 in runs from before it was reported,
    whose whole preparation then shows as the reference's column)."""
    slowest = max(s["workers"], key=lambda w: w.get("prepare_s") or 0.0)
    return (slowest.get("prepare_parts") or {}).get(part) or 0.0


def stages(samples: list[dict]) -> list[str]:
    """Where ckptdelta's publish() -> serving goes, stage by stage: means over the timed steps (so that the
    stages add up to the total; the table above has medians)."""
    ss = [s for s in samples if s["timed"] and s["method"] == "ckptdelta" and s.get("report")]
    cells = sorted({(s["rank"], s["lr"]) for s in ss})
    if not cells:
        return []
    threads = any(s.get("threads") for s in ss)
    out = ["Where ckptdelta's publish() -> serving goes (ms, means over the timed steps, so that the stages add up "
           "to the total; the codec the publisher chose per step in the last column"
           + (", and the threads each step's encode ran on" if threads else "") + "):", "",
           "| rank | lr | **total** | " + " | ".join(name for name, _ in STAGES) + " | codecs |",
           "|---:|---:|---:|" + "---:|" * len(STAGES) + "---|"]
    for rank, lr in cells:
        mine = [s for s in ss if (s["rank"], s["lr"]) == (rank, lr)]
        mean = [statistics.mean(f(s) for s in mine) for _, f in STAGES]
        total = statistics.mean(s["publish_to_serving_s"] for s in mine)
        codecs = ", ".join(f"{c} {n}" for c, n in sorted(
            {c: sum(1 for s in mine if (s.get("codec") or s.get("kind")) == c) for c in
             {s.get("codec") or s.get("kind") for s in mine}}.items()))
        if threads:
            codecs += "; threads " + " ".join(str(s.get("threads") or "-") for s in mine)
        out.append(f"| {rank} | {lr:g} | **{1e3 * total:.0f}** | " + " | ".join(f"{1e3 * v:.0f}" for v in mean)
                   + f" | {codecs} |")
    return out + ["", *trainer_steps(samples)]


def cpu_table(rows: list[dict]) -> list[str]:
    """The CPU each process spent in each method's step (rows of runs from before it was read have none)."""
    rows = [r for r in rows if r.get("cpu")]
    if not rows:
        return []
    roles = [(k, what) for k, what in CPU_ROLES if any(k in r["cpu"] for r in rows)]
    out = ["", "The CPU each process spent in a step, from the trainer's publish call to the replica's answer that "
           "it serves the step (ms, medians over the timed steps; /proc's user + system time, 10 ms ticks): on "
           "this machine's cores, what a method's path spends beside vLLM's generation is what stretches it.", "",
           "| rank | lr | method | " + " | ".join(what for _k, what in roles)
           + f" | **{' + '.join(k for k, _w in roles if k != 'vLLM')}** | publish() -> serving |",
           "|---:|---:|---|" + "---:|" * (len(roles) + 2)]
    for r in rows:
        out.append(f"| {r['rank']} | {r['lr']:g} | {LABELS[r['method']]} | "
                   + " | ".join(f"{1e3 * r['cpu'].get(k, 0.0):.0f}" for k, _w in roles)
                   + f" | **{1e3 * r['cpu_own']:.0f}** | {duration(r['publish_to_serving_s'])} |")
    return out


def trainer_steps(samples: list[dict]) -> list[str]:
    """Each timed step's trainer side, every method, in order: a mean of 5 hides that under the sampling load
    the same encode takes one time or two to three times it, from step to step."""
    ss = [s for s in samples if s["timed"]]
    cells = sorted({(s["rank"], s["lr"]) for s in ss})
    if not cells:
        return []
    out = ["The trainer side of each timed step (ms, in order; (a) ckptdelta's host copy + encode, an anchor's "
           "marked *; (b) serialize; (c) XOR + compress):", ""]
    for rank, lr in cells:
        parts = []
        for m in METHODS:
            mine = [s for s in ss if (s["rank"], s["lr"], s["method"]) == (rank, lr, m)]
            if mine:
                parts.append(f"{LABELS[m].split()[0]} " + " ".join(
                    f"{1e3 * s['trainer_s']:.0f}{'*' if s.get('kind') == 'anchor' else ''}" for s in mine))
        out.append(f"- rank {rank}, lr {lr:g}: " + "; ".join(parts))
    return out


def plot(out: dict[str, Any], path: str) -> None:
    rows = out["rows"]
    cells = sorted({(r["rank"], r["lr"]) for r in rows})
    by = {(r["rank"], r["lr"], r["method"]): r for r in rows}
    with harness.figure(path, 1, 4, figsize=(24, 5)) as (fig, ax):
        w = 0.8 / len(METHODS)
        for i, m in enumerate(METHODS):
            for panel, key, scale in ((0, "bytes", 1e6), (1, "publish_to_serving_s", 1), (2, "hold_s", 1e-3),
                                      (3, "pause_rpc_s", 1e-3)):
                xs = [x + (i - len(METHODS) / 2 + 0.5) * w for x, c in enumerate(cells) if (*c, m) in by]
                ys = [by[(*c, m)][key] / scale for c in cells if (*c, m) in by]
                ax[panel].bar(xs, ys, w, label=LABELS[m].split(" load_lora")[0])
        for panel, title, ylab in ((0, "bytes per step", "MB"), (1, "publish() -> serving", "seconds"),
                                   (2, "engine loop held (worker): the pause", "ms"),
                                   (3, "write call's wall time", "ms")):
            ax[panel].set_xticks(range(len(cells)), [f"rank {r}\nlr {lr:g}" for r, lr in cells])
            ax[panel].set(title=title, ylabel=ylab)
            ax[panel].legend(fontsize=7)
        fig.suptitle(f"LoRA on vLLM, {out['meta']['dtype']} adapters")


def stem_of(meta: dict[str, Any]) -> str:
    """lora{-asis|-bf16}{-context}{-start}{-quick}: one set of files per adapter dtype (fp32, peft's own, is the
    plain name; -asis: ckptdelta publishing it as fp32, as runs did before keep_exact), ckptdelta codec (the publisher's default, "auto", is the plain name) and notice (``--notice start``)."""
    codec = meta.get("codec", "auto")
    kind = "-bf16" if meta["dtype"] == "bf16" else "" if meta.get("keep_exact") else "-asis"
    return "lora" + kind + ("" if codec == "auto" else f"-{codec}") + \
        ("-start" if meta.get("notice", "after") == "start" else "") + ("-quick" if meta["quick"] else "")


def keep_exact(a: argparse.Namespace) -> bool:
    return a.dtype == "fp32" and a.ckptdelta_fp32 == "keep-exact"


def write(out: dict[str, Any], out_dir: str) -> None:
    harness.write(os.path.join(out_dir, stem_of(out["meta"])), markdown(out), out, lambda path: plot(out, path))


def main(argv: list[str] | None = None) -> int:
    p = harness.parser("lora", __doc__, quick="tiny base, rank 16, one step per lr: a smoke test",
                       from_json="only re-render the markdown and plot of a run")
    p.add_argument("--ranks", default="16,64")
    p.add_argument("--lrs", default="1e-5,1e-4")
    p.add_argument("--steps", type=int, default=3, help="timed steps per learning rate (default 3)")
    p.add_argument("--untimed", type=int, default=1, help="untimed steps first at each rank (default 1)")
    p.add_argument("--warmup", type=int, default=10, help="AdamW steps before the first publish (default 10)")
    p.add_argument("--batch", default="2,64", help="sequences,tokens of each training batch (default 2,64)")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                   help="the adapter as peft trains it (fp32, default) or cast to bf16 (Publisher(dtype=bf16))")
    p.add_argument("--ckptdelta-fp32", choices=("keep-exact", "as-is"), default="keep-exact",
                   help="with --dtype fp32, what ckptdelta publishes: keep-exact (default): the bf16 vLLM keeps, "
                        "the fp32 bits attached after each commit (Publisher(dtype=torch.bfloat16, "
                        "keep_exact=True)); as-is: the fp32 adapter itself, every bit to the replica")
    p.add_argument("--trainer-threads", type=int, default=1,
                   help="torch threads of the trainer process (default 1: vLLM keeps a core of a small machine)")
    p.add_argument("--clients", type=int, default=3, help="streaming clients of the sampling load (default 3)")
    p.add_argument("--max-tokens", type=int, default=16,
                   help="tokens per request (default 16: on 2 CPU cores a request then lasts a few seconds, and "
                        "ckptdelta's older slots are free again by its next step)")
    p.add_argument("--settle", type=float, default=2.0, help="seconds of load before each publish (default 2)")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--notice", choices=("start", "after"), default="after",
                   help="when the replica hears of a step: as publish() starts (each method then waits for its "
                        "objects; ckptdelta fetches its parts as they land), or after publish() returns")
    p.add_argument("--codec", choices=("auto", "context", "fast"), default="auto",
                   help="ckptdelta's Publisher(codec=...): auto (default) picks per delta whichever serves sooner; "
                        "context always takes the context coder (the smallest deltas)")
    a = p.parse_args(argv)
    a.argv = harness.measured_argv(sys.argv[1:] if argv is None else argv)
    if a.from_json:
        out = harness.read_json(a.from_json)
        out["targets"] = targets(out)
        write(out, a.out_dir)
        return 0
    a.ranks = [int(x) for x in a.ranks.split(",")]
    a.lrs = [float(x) for x in a.lrs.split(",")]
    a.batch = [int(x) for x in a.batch.split(",")]
    a.methods = [m for m in METHODS if m in a.methods.split(",")]
    if "ckptdelta" not in a.methods:
        p.error("--methods must include ckptdelta (its replica is the vLLM the baselines load into)")
    if a.quick:
        a.ranks, a.steps, a.untimed, a.warmup, a.batch = [16], 1, 0, 2, [2, 16]
        a.clients, a.max_tokens, a.settle = 2, 16, 0.5
    out = run(a)
    write(out, a.out_dir)
    return 0 if out["exact"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
