"""Hot-loading a real vLLM replica: ckptdelta beside vLLM's own full reload and a peer-style XOR delta.

One run, one vLLM server (its CPU build, eager), one bf16 Llama-shaped model made
here (default: hidden 1024, 16 layers, intermediate 2816, 8 heads / 4 KV heads,
vocabulary 32000, untied: ~0.5 GB), weights moved through a real S3 API (moto on
127.0.0.1; ``--backend local`` uses a directory). The trainer keeps an fp32
master copy and takes AdamW-like steps at lr 1e-6 (per element ``lr * clamp(N(0,1),
±3)``, the size of an Adam update); the bf16 snapshot it publishes is the cast of
the master, so ~1% of the elements change per step, scattered over every tensor,
as in :func:`benchmarks.workloads.scaled_pair`'s real AdamW steps.

1. **ckptdelta**: ``Publisher.publish()`` of the next step -> ``POST /v1/hotload``
   on the replica app (``ckptdelta.loader.server.create_app`` over ``build_engine("vllm")``)
   -> job READY. Twice: with the engine's default ``verify="sampled"`` (inside the
   pause plain tensors whole and 16 random input columns of each re-packed matrix,
   then every changed tensor read back right after resume) and with
   ``verify="full"`` (the whole read-back inside the pause). publish() -> serving
   ends at resume. Median of ``--repeats`` steps each.
2. **vLLM full reload from a directory** (what users do without ckptdelta): the
   trainer ``save_file``s the whole snapshot and uploads it; the replica downloads
   it to a local directory, then ``/pause?mode=keep`` -> every worker's
   ``reload_weights(weights_path=dir)`` -> prefix-cache reset -> ``/resume``.
3. **peer-style XOR delta**: ``benchmarks.baselines.XorZstd`` (old ^ new, zstd-3, one
   object per tensor) uploaded, downloaded, decoded to whole tensors against the
   replica's host copy (outside the pause, into the shared file), then in a pause
   every tensor is reloaded whole through ``ckptdelta_reload``.
4. **tokens/s** of a closed-loop sampler (``--clients`` concurrent requests of
   ``--max-tokens`` tokens, ignore_eos) through the replica app: idle, and while
   ckptdelta hot-loads prepare (``POST /v1/hotload`` -> vLLM paused: fetch, decode,
   and the changed modules built and re-packed beside the live ones).

Every swap is checked (untimed): the worker's read-back digests of every tensor
against the host copy the swapper verified against the manifest, or against the
trainer's tensors for the baselines.

    python -m benchmarks.vllm_hotload            # ~0.5 GB model through S3 (moto): ~10 min on 2 cores
    python -m benchmarks.vllm_hotload --quick    # tiny model, local directory, < 90 s

Writes benchmarks/results/vllm_hotload{,-quick}.{md,json,png}.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import shutil
import signal
import statistics
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

import httpx
import torch

from benchmarks import harness
from benchmarks.harness import median_sample

METHODS = ("ckptdelta", "ckptdelta_repack_in_pause", "ckptdelta_full_proof", "full_reload_dir", "xor_zstd")
LABELS = {"ckptdelta": "ckptdelta (default: re-packed while serving, swapped in; sampled proof, full after)",
          "ckptdelta_repack_in_pause": "ckptdelta (--apply reload: modules re-packed inside the pause)",
          "ckptdelta_full_proof": "ckptdelta (--verify full: whole proof in pause)",
          "full_reload_dir": "vLLM full reload from dir", "xor_zstd": "XOR+zstd3 peer delta"}
SHORT_LABELS = {"ckptdelta": "ckptdelta\n(default)", "ckptdelta_repack_in_pause": "ckptdelta\n(--apply reload)",
                "ckptdelta_full_proof": "ckptdelta\n(--verify full)",
                "full_reload_dir": "vLLM reload\nfrom dir", "xor_zstd": "XOR+zstd3\npeer delta"}
FULL = dict(hidden=1024, layers=16, intermediate=2816, heads=8, kv_heads=4, vocab=32000)
QUICK = dict(hidden=128, layers=2, intermediate=256, heads=4, kv_heads=2, vocab=512)
VLLM_ARGS = ["--enforce-eager", "--max-model-len", "512", "--dtype", "bfloat16", "--max-num-seqs", "16",
             "--disable-log-stats"]
PROMPT = "hello world, hello replica"
POLL_S = 0.01

log = logging.getLogger("ckptdelta.bench.vllm")


# --- the model and the trainer ------------------------------------------------------------------

def llama_names(c: dict) -> dict[str, tuple[int, ...]]:
    h, kv = c["hidden"], c["kv_heads"] * (c["hidden"] // c["heads"])
    shapes = {"model.embed_tokens.weight": (c["vocab"], h)}
    for i in range(c["layers"]):
        p = f"model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                       p + "mlp.gate_proj.weight": (c["intermediate"], h),
                       p + "mlp.up_proj.weight": (c["intermediate"], h),
                       p + "mlp.down_proj.weight": (h, c["intermediate"]),
                       p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)})
    shapes["model.norm.weight"] = (h,)
    shapes["lm_head.weight"] = (c["vocab"], h)
    return shapes


class Trainer:
    """An fp32 master copy and its bf16 snapshots; ``step()`` is an AdamW-like update at ``lr``."""

    def __init__(self, c: dict, *, lr: float = 1e-6, seed: int = 0):
        self.lr, self.seed, self.steps = lr, seed, 0
        g = torch.Generator().manual_seed(seed)
        self.master: dict[str, torch.Tensor] = {}
        for n, shape in llama_names(c).items():
            if n.endswith("norm.weight"):  # trained norms spread around 1
                self.master[n] = 1.0 + 0.1 * torch.randn(shape, generator=g)
            else:
                self.master[n] = 0.02 * torch.randn(shape, generator=g)
        self.current = {n: t.to(torch.bfloat16) for n, t in self.master.items()}
        self.previous: dict[str, torch.Tensor] | None = None

    def step(self) -> dict[str, torch.Tensor]:
        self.steps += 1
        g = torch.Generator().manual_seed(self.seed * 1000003 + self.steps)
        self.previous = self.current
        new = {}
        for n, m in self.master.items():
            upd = torch.randn(m.shape, generator=g).clamp_(-3, 3)
            m.add_(upd, alpha=-self.lr)  # AdamW's update is ~lr per element, whatever the gradient's scale
            new[n] = m.to(torch.bfloat16)
        self.current = new
        return new


def save_model_dir(out: str, c: dict, weights: dict[str, torch.Tensor]) -> str:
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    from tests.lm import build_tokenizer

    os.makedirs(out, exist_ok=True)
    tok = build_tokenizer()
    assert c["vocab"] >= len(tok)
    LlamaConfig(vocab_size=c["vocab"], hidden_size=c["hidden"], intermediate_size=c["intermediate"],
                num_hidden_layers=c["layers"], num_attention_heads=c["heads"], num_key_value_heads=c["kv_heads"],
                max_position_embeddings=2048, tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
                pad_token_id=2, torch_dtype="bfloat16").save_pretrained(out)
    tok.save_pretrained(out)
    save_file(weights, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    return out


def changed_fraction(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> float:
    n = sum(t.numel() for t in old.values())
    c = sum(int((old[k].view(torch.int16) != new[k].view(torch.int16)).sum()) for k in old)
    return c / n


# --- the replica ------------------------------------------------------------------------------

@dataclass
class Replica:
    engine: Any
    server: Any
    http: httpx.Client
    pauses: list[tuple[float, float]] = field(default_factory=list)  # (start, end) of every pause, perf_counter
    proofs: list[tuple[float, float]] = field(default_factory=list)  # (resume, proof done) after each swap

    @property
    def control(self) -> Any:
        return self.engine.applier.control

    def hotload(self, version: int, *, timeout: float = 300.0) -> dict[str, Any]:
        """POST /v1/hotload, poll until READY; when it was seen leaving PREPARING and when READY."""
        t0 = time.perf_counter()
        r = self.http.post("/v1/hotload", json={"snapshot": version})
        if r.status_code not in (200, 202):
            raise RuntimeError(f"hotload {version}: {r.status_code} {r.text[:300]}")
        job = r.json()
        swapping = None
        deadline = t0 + timeout
        while job["state"] not in ("READY", "FAILED"):
            if time.perf_counter() > deadline:
                raise RuntimeError(f"hotload {version} did not finish: {job}")
            time.sleep(POLL_S)
            job = self.http.get(f"/v1/hotload/{job['id']}").json()
            if swapping is None and job["state"] != "PREPARING":
                swapping = time.perf_counter()
        ready = time.perf_counter()
        if job["state"] != "READY":
            raise RuntimeError(f"hotload {version} failed: {job.get('reason')}")
        return {"job": job, "posted": t0, "swapping": swapping or ready, "ready": ready}

    def check(self) -> int:
        return self.engine.applier.check()

    def close(self) -> None:
        self.http.close()
        self.server.__exit__()
        self.engine.close()


def start_replica(url: str, opts: dict | None, cache_dir: str, vllm_log: str) -> Replica:
    from ckptdelta.loader.engines import build_engine
    from ckptdelta.loader.server import create_app
    from tests.replicas import LiveServer

    engine = build_engine("vllm", bucket=url, snapshot="latest", storage_options=opts, cache_dir=cache_dir,
                          cache_policy="recompute", vllm_args=VLLM_ARGS, vllm_log=vllm_log)
    server = LiveServer(create_app(engine, replica_id="vllm-bench")).__enter__()
    rep = Replica(engine, server, httpx.Client(base_url=server.url, timeout=300))
    applier = engine.applier
    orig = applier.paused

    @contextmanager
    def timed_pause() -> Iterator[Any]:  # when generation stopped and resumed, for the sampler's accounting
        t0 = time.perf_counter()
        p = None
        try:
            with orig() as p:
                yield p
        finally:
            # leaving orig() also runs the proof after resuming, beside vLLM's steps: not part of the pause
            start = p.started if p is not None and p.started else t0   # vLLM stops at the first push
            t1 = start + p.seconds if p is not None and p.seconds else time.perf_counter()
            rep.pauses.append((start, t1))
            rep.proofs.append((t1, time.perf_counter()))

    applier.paused = timed_pause
    return rep


@contextmanager
def vllm_pause(rep: Replica, label: str) -> Iterator[dict[str, float]]:
    """The pause the replica's own swap uses (keep mode, prefix-cache reset, version label, resume), timed."""
    out: dict[str, float] = {}
    t0 = time.perf_counter()
    rep.control.pause()
    try:
        yield out
    finally:
        try:
            rep.control.reset_prefix_cache(running=True)
            rep.control._post("/update_weight_version", json={"new_version": label})
        finally:
            rep.control.resume()
            t1 = time.perf_counter()
            rep.pauses.append((t0, t1))
            out["pause_s"] = t1 - t0


def check_against(rep: Replica, truth: dict[str, torch.Tensor]) -> bool:
    """The worker's read-back digests of every tensor against the trainer's tensors (kernel view where the
    worker read through a GEMM)."""
    from ckptdelta.loader.engines.vllm.applier import expected_digests

    names = list(truth)
    shim = type("T", (), {"tensors": truth})()
    for answer in rep.control.rpc("ckptdelta_digests", {"names": names}):
        expected = expected_digests(shim, names, set(answer.get("kernel_view") or ()))
        if any(answer["digests"].get(n) != expected[n] for n in names):
            return False
    return True


# --- 1. ckptdelta -----------------------------------------------------------------------------

def ckptdelta_step(rep: Replica, pub: Any, trainer: Trainer) -> dict[str, Any]:
    weights = trainer.step()
    frac = changed_fraction(trainer.previous, weights)
    t0 = time.perf_counter()
    res = pub.publish(weights, trainer.steps)
    t1 = time.perf_counter()
    h = rep.hotload(res.version)
    rp = h["job"]["report"]
    last = dict(rep.engine.applier.last)
    t = time.perf_counter()
    verified = rep.check() == len(weights) and rep.engine.version == res.version
    return {"version": res.version, "kind": res.kind, "changed_fraction": frac, "bytes": res.stored_bytes,
            "bytes_fetched": rp["bytes_fetched"], "publish_s": t1 - t0, "encode_s": res.encode_s,
            "upload_s": res.upload_s, "fetch_s": rp["fetch_s"], "decode_s": rp["decode_s"],
            "prepare_s": h["swapping"] - h["posted"], "pause_s": rp["pause_s"],
            "reload_s": last.get("reload_s", 0.0), "stop_s": last.get("stop_s", 0.0), "verify_in_pause_s": last.get("verify_s", 0.0),
            "apply": last.get("apply"), "shadow_s": (last.get("shadow") or {}).get("stage_s", 0.0),
            "shadow_build_s": (last.get("shadow") or {}).get("build_s", 0.0),
            "shadow_check_s": (last.get("shadow") or {}).get("check_s", 0.0),
            # serving the new version starts at resume; a proof that runs after it delays READY, not serving
            "publish_to_serving_s": h["ready"] - t0 - last.get("verify_after_s", 0.0),
            "verify_after_s": last.get("verify_after_s", 0.0), "check_s": time.perf_counter() - t,
            "verified": verified and bool(last.get("verified"))}


# --- 2. vLLM's full reload from a directory -----------------------------------------------------

def full_reload_step(rep: Replica, trainer: Trainer, root: str, opts: dict | None, scratch: str,
                     model_dir: str) -> dict[str, Any]:
    import fsspec
    from safetensors.torch import save_file

    weights = trainer.step()
    fs, base = fsspec.core.url_to_fs(root, **(opts or {}))
    remote = "://" in root
    key = f"{base}/full-checkpoints/model.safetensors"
    fs.makedirs(f"{base}/full-checkpoints", exist_ok=True)
    out_dir = os.path.join(scratch, "trainer-out")
    os.makedirs(out_dir, exist_ok=True)
    dl_dir = os.path.join(scratch, f"replica-step-{trainer.steps}")
    os.makedirs(dl_dir)
    for f in os.listdir(model_dir):  # the replica keeps config and tokenizer; only the weights move
        if not f.endswith(".safetensors"):
            shutil.copy(os.path.join(model_dir, f), dl_dir)
    t0 = time.perf_counter()
    local = os.path.join(out_dir, "model.safetensors")
    save_file(weights, local, metadata={"format": "pt"})
    t1 = time.perf_counter()
    fs.put_file(local, key) if remote else shutil.copyfile(local, key)
    t2 = time.perf_counter()
    target = os.path.join(dl_dir, "model.safetensors")
    fs.get_file(key, target) if remote else shutil.copyfile(key, target)
    t3 = time.perf_counter()
    with vllm_pause(rep, f"full-{trainer.steps}") as p:
        rep.control.rpc("ckptdelta_reload_dir", {"path": dl_dir})
    t4 = time.perf_counter()
    nbytes = os.path.getsize(target)
    verified = check_against(rep, weights)
    for n, t in weights.items():  # the host copy follows (untimed): the XOR peer decodes against it
        rep.engine.shared.tensors[n].copy_(t)
    os.unlink(local)
    shutil.rmtree(dl_dir, ignore_errors=True)
    return {"step": trainer.steps, "bytes": nbytes, "save_s": t1 - t0, "upload_s": t2 - t1, "download_s": t3 - t2,
            "pause_s": p["pause_s"], "publish_to_serving_s": t4 - t0, "verified": verified}


# --- 3. a peer-style XOR + zstd delta ----------------------------------------------------------

def xor_step(rep: Replica, trainer: Trainer, root: str, opts: dict | None) -> dict[str, Any]:
    import fsspec

    from benchmarks.baselines import XorZstd

    codec = XorZstd(3)
    weights = trainer.step()
    fs, base = fsspec.core.url_to_fs(root, **(opts or {}))
    prefix = f"{base}/xor/step-{trainer.steps:08d}"
    fs.makedirs(prefix, exist_ok=True)
    names = sorted(weights)
    keys = [f"{prefix}/{i:05d}.xz3" for i in range(len(names))]
    t0 = time.perf_counter()
    blobs = codec.encode(trainer.previous, weights)
    t1 = time.perf_counter()
    fs.pipe(dict(zip(keys, blobs)))
    t2 = time.perf_counter()
    got = fs.cat(keys)
    got = [got[k] for k in (keys if set(keys) <= set(got) else [fs._strip_protocol(k) for k in keys])]
    t3 = time.perf_counter()
    shared = rep.engine.shared.tensors
    new = codec.decode({n: shared[n] for n in names}, got)
    for n in names:
        shared[n].copy_(new[n])
    del new
    t4 = time.perf_counter()
    with vllm_pause(rep, f"xor-{trainer.steps}") as p:
        rep.control.rpc("ckptdelta_reload", {"path": rep.engine.shared.path, "names": names})
    t5 = time.perf_counter()
    host_ok = all(torch.equal(shared[n].view(torch.int16), weights[n].view(torch.int16)) for n in names)
    verified = host_ok and check_against(rep, weights)
    return {"step": trainer.steps, "bytes": sum(len(b) for b in blobs), "encode_s": t1 - t0, "upload_s": t2 - t1,
            "download_s": t3 - t2, "decode_s": t4 - t3, "pause_s": p["pause_s"], "publish_to_serving_s": t5 - t0,
            "verified": verified}


# --- 4. tokens/s while a hot-load prepares -----------------------------------------------------

class Sampler(harness.Clients):
    """``clients`` threads, each posting completions back to back; every finished request is logged."""

    def __init__(self, url: str, clients: int, max_tokens: int):
        super().__init__(clients)
        self.url, self.max_tokens = url, max_tokens
        self.done: list[tuple[float, float, int]] = []  # (start, end, completion tokens)
        self.errors = 0

    def _loop(self, i: int) -> None:
        with httpx.Client(base_url=self.url, timeout=600) as c:
            n = 0
            while not self._stop.is_set():
                n += 1
                t0 = time.perf_counter()
                r = c.post("/v1/completions", json={"prompt": f"{PROMPT} {i} {n}", "max_tokens": self.max_tokens,
                                                   "ignore_eos": True, "temperature": 1.0, "seed": 1000 * i + n})
                t1 = time.perf_counter()
                if r.status_code == 200:
                    self.done.append((t0, t1, int(r.json()["usage"]["completion_tokens"])))
                else:
                    self.errors += 1


def _overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    return max(0.0, min(a1, b1) - max(a0, b0))


def tokens_in(done: list[tuple[float, float, int]], windows: list[tuple[float, float]],
              pauses: list[tuple[float, float]]) -> float:
    """Tokens generated inside ``windows``: each request's tokens spread evenly over its unpaused time."""
    total = 0.0
    for s, e, n in done:
        busy = (e - s) - sum(_overlap(s, e, p0, p1) for p0, p1 in pauses)
        if busy <= 0:
            continue
        total += n / busy * sum(_overlap(s, e, w0, w1) for w0, w1 in windows)
    return total


def throughput(rep: Replica, pub: Any, trainer: Trainer, *, clients: int, max_tokens: int, idle_s: float,
               min_window_s: float, max_loads: int) -> dict[str, Any]:
    sampler = Sampler(rep.server.url, clients, max_tokens)
    sampler.start()
    try:
        time.sleep(max(2.0, idle_s / 4))  # warm: every client has requests in flight
        i0 = time.perf_counter()
        time.sleep(idle_s)
        idle = [(i0, time.perf_counter())]
        windows: list[tuple[float, float]] = []
        proofs: list[tuple[float, float]] = []   # resume -> READY: the full read-back, beside vLLM's steps
        loads = []
        idle_durations = [e - s for s, e, _ in sampler.done if s >= i0]
        settle = min(10.0, statistics.median(idle_durations)) if idle_durations else 2.0
        stalls: list[tuple[float, float]] = []  # the read-back checks stop generation too
        while len(loads) < max_loads and (sum(b - a for a, b in windows) < min_window_s or len(loads) < 2):
            weights = trainer.step()
            res = pub.publish(weights, trainer.steps)
            time.sleep(settle)  # the requests in flight at the POST started after the trainer's CPU work
            h = rep.hotload(res.version)
            pause0 = rep.pauses[-1][0]
            windows.append((h["posted"], pause0))   # fetch, decode and the shadow build, all while serving
            proofs.append(rep.proofs[-1])
            t = time.perf_counter()
            verified = rep.check() == len(weights)
            stalls.append((t, time.perf_counter()))
            loads.append({"version": res.version, "window_s": windows[-1][1] - windows[-1][0],
                          "pause_s": h["job"]["report"]["pause_s"], "verified": verified})
            time.sleep(0.5)
        time.sleep(1.0)
        i1 = time.perf_counter()
        time.sleep(idle_s)
        idle.append((i1, time.perf_counter()))
    finally:
        sampler.stop()
    pauses = list(rep.pauses) + stalls
    loads_idle: dict[str, float] = {}
    idle_t = sum(b - a for a, b in idle)
    prep_t = sum(b - a for a, b in windows)
    idle_rate = tokens_in(sampler.done, idle, pauses) / idle_t
    for w, x in zip(windows, loads):
        x["tokens_per_s"] = tokens_in(sampler.done, [w], pauses) / max(w[1] - w[0], 1e-9)
    for w, name in zip(idle, ("before", "after")):
        out_idle = tokens_in(sampler.done, [w], pauses) / max(w[1] - w[0], 1e-9)
        loads_idle[name] = out_idle
    prep_rate = tokens_in(sampler.done, windows, pauses) / prep_t
    proof_t = sum(b - a for a, b in proofs)
    proof_rate = tokens_in(sampler.done, proofs, pauses) / proof_t if proof_t > 0 else 0.0
    return {"clients": clients, "max_tokens": max_tokens, "idle_s": idle_t, "prepare_window_s": prep_t,
            "settle_s": settle, "idle_tokens_per_s_by_window": loads_idle,
            "hotloads": loads, "requests": len(sampler.done), "errors": sampler.errors,
            "idle_tokens_per_s": idle_rate, "prepare_tokens_per_s": prep_rate,
            "proof_window_s": proof_t, "proof_tokens_per_s": proof_rate,
            "ratio": prep_rate / idle_rate if idle_rate else 0.0,
            "verified": all(x["verified"] for x in loads) and sampler.errors == 0}


# --- the run -----------------------------------------------------------------------------------

def run(a: argparse.Namespace) -> dict[str, Any]:
    from ckptdelta.publisher import Publisher
    from tests.lm import hf_extra_files

    c = QUICK if a.quick else FULL
    kind = "local" if a.quick else a.backend
    meta = {"machine": harness.machine(), "quick": a.quick, "backend": kind, "model": c, "lr": a.lr,
            "repeats": a.repeats, "baseline_repeats": a.baseline_repeats, "vllm_args": VLLM_ARGS,
            "kv_cache_gib": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    out: dict[str, Any] = {"meta": meta}
    t_all = time.perf_counter()
    scratch = tempfile.mkdtemp(prefix="ckptdelta-vllm-bench-")
    rep = pub = None
    try:
        with harness.backend(kind, a.s3_url, a.storage_options) as (root, opts):
            trainer = Trainer(c, lr=a.lr)
            meta["model_bytes"] = sum(t.numel() * 2 for t in trainer.current.values())
            meta["tensors"] = len(trainer.current)
            model_dir = save_model_dir(os.path.join(scratch, "model"), c, trainer.current)
            url = f"{root}/run"
            pub = Publisher(url, storage_options=opts, progress=False, anchor_every=100000,   # one codec: the
                            anchor_chain_fraction=1000.0, extra_files=hf_extra_files(model_dir),  # runs compare
                            codec="context")
            t = time.perf_counter()
            pub.publish(trainer.current, 0)
            meta["anchor_publish_s"] = time.perf_counter() - t
            t = time.perf_counter()
            rep = start_replica(url, opts, os.path.join(scratch, "cache"), os.path.join(scratch, "vllm.log"))
            meta["replica_start_s"] = time.perf_counter() - t
            print(f"vLLM replica up in {meta['replica_start_s']:.0f} s "
                  f"({meta['model_bytes'] / 1e9:.2f} GB, {meta['tensors']} tensors)", flush=True)
            warm = ckptdelta_step(rep, pub, trainer)  # numba, thread pools, first-use paths: not measured
            meta["warm_up_verified"] = warm["verified"]
            methods: dict[str, Any] = {}
            for name, verify, shadows in (("ckptdelta", "sampled", True),
                                          ("ckptdelta_repack_in_pause", "sampled", False),
                                          ("ckptdelta_full_proof", "full", True)):
                rep.engine.applier.verify, rep.engine.applier.shadows = verify, shadows
                samples = []
                for _ in range(a.repeats):
                    samples.append(ckptdelta_step(rep, pub, trainer))
                    s = samples[-1]
                    print(f"{name}: v{s['version']} {s['bytes'] / 1e6:.1f} MB, pause {s['pause_s']:.3f} s, "
                          f"publish->serving {s['publish_to_serving_s']:.2f} s, verified {s['verified']}", flush=True)
                methods[name] = median_sample(samples)
            # the sampled hot-loads check the live weights right after resume (the check runs either way)
            rep.engine.applier.verify, rep.engine.applier.shadows = "sampled", True  # the defaults, for tokens/s
            out["tokens"] = throughput(rep, pub, trainer, clients=a.clients, max_tokens=a.max_tokens,
                                       idle_s=a.idle_s, min_window_s=a.min_window_s, max_loads=a.max_loads)
            tk = out["tokens"]
            print(f"tokens/s: idle {tk['idle_tokens_per_s']:.1f}, while preparing {tk['prepare_tokens_per_s']:.1f} "
                  f"({len(tk['hotloads'])} hot-loads, {tk['prepare_window_s']:.1f} s of prepare)", flush=True)
            pub.close()
            pub = None
            gc.collect()
            samples = []
            for _ in range(a.baseline_repeats):
                samples.append(full_reload_step(rep, trainer, root, opts, scratch, model_dir))
                s = samples[-1]
                print(f"full reload: pause {s['pause_s']:.3f} s, publish->serving {s['publish_to_serving_s']:.2f} s, "
                      f"verified {s['verified']}", flush=True)
            methods["full_reload_dir"] = median_sample(samples)
            samples = []
            for _ in range(a.baseline_repeats):
                samples.append(xor_step(rep, trainer, root, opts))
                s = samples[-1]
                print(f"xor+zstd3: {s['bytes'] / 1e6:.1f} MB, pause {s['pause_s']:.3f} s, publish->serving "
                      f"{s['publish_to_serving_s']:.2f} s, verified {s['verified']}", flush=True)
            methods["xor_zstd"] = median_sample(samples)
            out["methods"] = methods
    finally:
        if pub is not None:
            pub.close()
        if rep is not None:
            rep.close()
        shutil.rmtree(scratch, ignore_errors=True)
    m = out["methods"]
    full = m["full_reload_dir"]
    out["ratios"] = {k: {"pause_vs_full_reload": m[k]["pause_s"] / full["pause_s"],
                         "publish_to_serving_vs_full": m[k]["publish_to_serving_s"] / full["publish_to_serving_s"],
                         "bytes_vs_full": m[k]["bytes"] / full["bytes"]} for k in METHODS}
    out["targets"] = targets(out)
    out["verified"] = (meta["warm_up_verified"] and all(m[k]["verified"] for k in METHODS)
                       and out["tokens"]["verified"])
    meta["wall_s"] = time.perf_counter() - t_all
    return out


def targets(out: dict[str, Any]) -> list[dict[str, Any]]:
    r, tk = out["ratios"], out["tokens"]
    rows = []
    for k in ("ckptdelta", "ckptdelta_repack_in_pause", "ckptdelta_full_proof"):
        rows.append({"target": f"pause on vLLM <= 1/3 of vLLM's full reload from a directory ({LABELS[k]})",
                     "value": r[k]["pause_vs_full_reload"], "limit": 1 / 3,
                     "pass": r[k]["pause_vs_full_reload"] <= 1 / 3})
        rows.append({"target": f"publish() -> serving the new version <= 1/5 of the full-checkpoint path "
                               f"({LABELS[k]})", "value": r[k]["publish_to_serving_vs_full"], "limit": 0.2,
                     "pass": r[k]["publish_to_serving_vs_full"] <= 0.2})
    rows.append({"target": "tokens/s while a hot-load prepares >= 70% of idle", "value": tk["ratio"], "limit": 0.7,
                 "pass": tk["ratio"] >= 0.7})
    return rows


# --- report --------------------------------------------------------------------------------------

def markdown(out: dict[str, Any]) -> str:
    meta, m, r, tk = out["meta"], out["methods"], out["ratios"], out["tokens"]
    c = meta["model"]
    where = "S3 API (moto on 127.0.0.1)" if meta["backend"] == "s3" else "a local directory"
    lines = [
        "# Hot-loading a vLLM replica: ckptdelta vs vLLM's full reload from a directory vs an XOR delta",
        "",
        f"{meta['machine']}; vLLM CPU build, `{' '.join(VLLM_ARGS)}`, KV cache {meta['kv_cache_gib']} GiB; "
        f"bf16 Llama (hidden {c['hidden']}, {c['layers']} layers, intermediate {c['intermediate']}, "
        f"{c['heads']}/{c['kv_heads']} heads, vocab {c['vocab']}, untied): {meta['model_bytes'] / 1e9:.3f} GB, "
        f"{meta['tensors']} tensors; AdamW-like steps at lr {meta['lr']:g} on an fp32 master "
        f"({100 * m['ckptdelta']['changed_fraction']:.2f}% of the bf16 elements change per step); through {where}. "
        f"ckptdelta rows: median of {meta['repeats']} steps; baselines: median of {meta['baseline_repeats']}. "
        "Seconds.",
        "",
        "| method | bytes / step | prepare (fetch+decode) | pause | publish() -> serving | pause / full reload | "
        "publish->serving / full | verified |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for k in METHODS:
        d = m[k]
        prep = d.get("prepare_s", d.get("download_s", 0.0) + d.get("decode_s", 0.0))
        lines.append(f"| {LABELS[k]} | {d['bytes'] / 1e6:.2f} MB | {prep:.2f} | {d['pause_s']:.3f} | "
                     f"{d['publish_to_serving_s']:.2f} | {r[k]['pause_vs_full_reload']:.2f} | "
                     f"{r[k]['publish_to_serving_vs_full']:.2f} | {d['verified']} |")
    d0, d1, d2 = m["ckptdelta"], m["ckptdelta_full_proof"], m["ckptdelta_repack_in_pause"]
    f, x = m["full_reload_dir"], m["xor_zstd"]
    lines += [
        "",
        "Breakdown:",
        "",
        f"- ckptdelta (default): publish() {d0['publish_s']:.2f} (encode {d0['encode_s']:.2f}, upload "
        f"{d0['upload_s']:.2f}), fetch {d0['fetch_s']:.2f}, decode {d0['decode_s']:.2f}; while serving, the "
        f"changed modules built and re-packed beside the live ones {d0['shadow_s']:.2f} (vLLM's loaders "
        f"{d0['shadow_build_s']:.2f}, sampled read-back check {d0['shadow_check_s']:.2f}); pause {d0['pause_s']:.3f} "
        f"= /pause (the running step ends) {d0['stop_s']:.3f} + swap {d0['reload_s']:.3f} + in-place patches' "
        f"check {d0['verify_in_pause_s']:.3f} + reset/label/resume calls; then, serving, the full read-back {d0.get('verify_after_s', 0.0):.2f} before "
        f"the job reports READY; {d0['bytes_fetched'] / 1e6:.2f} MB fetched.",
        f"- ckptdelta --apply reload: pause {d2['pause_s']:.3f} = vLLM reload from the shared file "
        f"{d2['reload_s']:.3f} + sampled read-back check {d2['verify_in_pause_s']:.3f} + calls.",
        f"- ckptdelta --verify full: pause {d1['pause_s']:.3f} (swap {d1['reload_s']:.3f}, full read-back "
        f"{d1['verify_in_pause_s']:.3f}).",
        f"- full reload: save_file {f['save_s']:.2f}, upload {f['upload_s']:.2f}, download {f['download_s']:.2f}, "
        f"pause (reload_weights(weights_path=dir)) {f['pause_s']:.3f}.",
        f"- XOR+zstd3: encode {x['encode_s']:.2f}, upload {x['upload_s']:.2f}, download {x['download_s']:.2f}, "
        f"decode into the host copy {x['decode_s']:.2f}, pause (every tensor reloaded) {x['pause_s']:.3f}.",
        "",
        f"Tokens/s ({tk['clients']} closed-loop clients, max_tokens {tk['max_tokens']}, ignore_eos, through the "
        f"replica app): idle {tk['idle_tokens_per_s']:.1f} over {tk['idle_s']:.1f} s; while {len(tk['hotloads'])} "
        f"ckptdelta hot-loads prepared {tk['prepare_tokens_per_s']:.1f} over {tk['prepare_window_s']:.1f} s of "
        f"prepare windows (POST /v1/hotload -> vLLM paused: fetch, decode, shadow build); ratio {tk['ratio']:.2f}. Each request's "
        "completion tokens are spread evenly over its unpaused wall time and counted in proportion to its overlap "
        f"with a window; {tk['requests']} requests, {tk['errors']} errors. After each swap, while the full "
        f"read-back proof ran beside vLLM's steps (resume -> READY, {tk.get('proof_window_s', 0.0):.1f} s in all): "
        f"{tk.get('proof_tokens_per_s', 0.0):.1f} tokens/s.",
        "",
        "Targets:",
        "",
    ]
    for t in out["targets"]:
        lines.append(f"- {t['target']}: {t['value']:.3f} (limit {t['limit']:.3f}) -> "
                     f"{'PASS' if t['pass'] else 'FAIL'}")
    lines += ["", f"Every swap verified (worker read-back digests of every tensor): {out['verified']}.",
              f"Run: {meta['wall_s']:.0f} s wall, vLLM start {meta['replica_start_s']:.0f} s."]
    return "\n".join(lines) + "\n"


def plot(out: dict[str, Any], path: str) -> None:
    m = out["methods"]
    with harness.figure(path, 1, 2, figsize=(13, 5)) as (fig, ax):
        labels = [SHORT_LABELS[k] for k in METHODS]
        for i, (key, title) in enumerate((("pause_s", "pause (generation stopped)"),
                                          ("publish_to_serving_s", "publish() -> serving the new version"))):
            vals = [m[k][key] for k in METHODS]
            bars = ax[i].bar(range(len(METHODS)), vals,
                             color=["tab:blue", "tab:purple", "tab:cyan", "tab:orange", "tab:gray"])
            for b, v in zip(bars, vals):
                ax[i].annotate(f"{v:.2f}s", (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom", fontsize=8)
            ax[i].set_xticks(range(len(METHODS)), labels, fontsize=8)
            ax[i].set(ylabel="seconds", title=title)
        meta = out["meta"]
        fig.suptitle(f"vLLM replica hot-load, {meta['model_bytes'] / 1e9:.2f} GB bf16 Llama, {meta['backend']}; "
                     f"tokens/s while preparing / idle = {out['tokens']['ratio']:.2f}")


def main(argv: list[str] | None = None) -> int:
    p = harness.parser("vllm_hotload", __doc__, quick="tiny model, local directory (a smoke test, < 90 s)",
                       s3=True)
    p.add_argument("--backend", choices=["s3", "local"], default="s3")
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--repeats", type=int, default=3, help="ckptdelta steps per row (median)")
    p.add_argument("--baseline-repeats", type=int, default=None, help="steps per baseline (default 2; quick 1)")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--idle-s", type=float, default=None, help="idle sampling, before and after (default 8; quick 3)")
    p.add_argument("--min-window-s", type=float, default=None,
                   help="hot-load until this much prepare time was sampled (default 5; quick 0)")
    p.add_argument("--max-loads", type=int, default=None, help="at most this many hot-loads (default 4; quick 2)")
    a = p.parse_args(argv)
    q = a.quick
    a.baseline_repeats = a.baseline_repeats or (1 if q else 2)
    a.idle_s = a.idle_s if a.idle_s is not None else (3.0 if q else 8.0)
    a.min_window_s = a.min_window_s if a.min_window_s is not None else (0.0 if q else 5.0)
    a.max_loads = a.max_loads or (2 if q else 4)
    # a timeout's SIGTERM still runs the finally blocks: vLLM is stopped, the shared file removed
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(SystemExit(143)))
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    out = run(a)
    harness.write(os.path.join(a.out_dir, "vllm_hotload" + ("-quick" if q else "")), markdown(out), out,
                  lambda path: plot(out, path))
    return 0 if out["verified"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
