"""``make demo``: an RL loop whose policy reaches its sampling replica as bit-exact deltas.

One process trains, one serves. The trainer pre-trains a tiny Llama on noisy
addition (benchmarks/rl_task.py), publishes it as the run's anchor and starts a
replica on it: ``ckptdelta serve --engine vllm`` (vLLM's own OpenAI server,
hot-loaded by ckptdelta; the default) or ``--engine reference`` (ckptdelta's
built-in torch engine). Then each step:

1. rollouts over HTTP: groups of ``--group-size`` completions per prompt, with
   ``min_policy_version`` = the version published last (the client retries the
   replica's 408 until it serves it) and the sampled tokens' logprobs. On vLLM
   these are vLLM's own ``logprobs`` of the sampled tokens from its completions
   API (``logprobs=0``: raw log-softmax of its logits, before temperature, so the
   same quantity the trainer computes); on the reference engine the replica
   rescores them with :func:`ckptdelta.loader.hf_model.score_logprobs`;
2. rewards, advantages normalised within each group (zero when a group's
   rewards are all equal), a PPO clipped importance-sampling loss with the
   replica's logprobs as the behaviour policy; the trainer scores the same tokens
   with :func:`ckptdelta.loader.hf_model.score_tokens` on its bf16 weights (the published
   bits). Sampler/trainer divergence k1/k2/k3 is exactly 0 on the reference
   engine; on vLLM it is not (its kernels are not the trainer's), and it must not
   grow over the run, since the weights are the same bits at every step;
3. AdamW on fp32 master weights (the bf16 forward's gradients are copied to the
   masters), the masters cast to bf16 and published with ``wait=False``, then a
   hot-load of that version on the replica. On vLLM the replica proves the swap
   itself: every worker reads the changed tensors back and they must equal the
   verified host copy (sampled inside the pause, in full right after it, before
   the hot-load is READY: ``VllmApplier``);
   the demo reads that result from ``/v1/status`` (``engine.last_swap``) and
   prints it ("exact"). At the end the demo also asks vLLM's workers for the
   digests of every live tensor and compares them with the trainer's own bf16
   policy.

One line per step, then a summary; ``.ckptdelta/report/`` gets the rows as JSON
and a PNG (reward, bytes per step, publish/hot-load/pause latency, k1/k2/k3).

    python -m benchmarks.demo [--engine vllm|reference] [--bucket DIR|s3://...|gs://...] [--steps N]
                              [--model-size tiny|small|base] [--group-size G] [--lr LR] [--port P]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import logging
import math
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from typing import Any

import torch

from benchmarks import harness
from benchmarks.harness import nbytes
from benchmarks.rl_task import (EOS, MODEL_SIZES, AdditionTask, build_model, build_tokenizer, encode, greedy_accuracy,
                                pretrain, save_model_dir)

log = logging.getLogger("ckptdelta.demo")

DEFAULT_BUCKET = os.path.join(".ckptdelta", "bucket")
DEFAULT_REPORT = os.path.join(".ckptdelta", "report")
SCORE_WITH = ("published", "master")
ENGINES = ("vllm", "reference")
#: vLLM options for the demo's model on a small CPU machine (after ``serve ... --``).
VLLM_ARGS = ("--enforce-eager", "--dtype", "bfloat16", "--max-model-len", "32", "--max-num-seqs", "64",
             "--disable-log-stats")


@dataclass
class DemoConfig:
    """Everything a demo run depends on; the defaults are ``make demo``."""

    bucket: str = DEFAULT_BUCKET
    engine: str = "vllm"                 # the replica: "vllm" or "reference"
    vllm_args: tuple[str, ...] = VLLM_ARGS
    run_name: str | None = None          # default: demo-<UTC time>
    storage_options: dict[str, Any] | None = None
    steps: int = 20
    model_size: str = "small"
    group_size: int = 8                  # completions per prompt (n)
    prompts_per_step: int = 16
    lr: float = 2e-4
    clip: float = 0.2                    # PPO clip range: ratio in [1 - clip, 1 + clip]
    temperature: float = 1.0
    pretrain_steps: int = 150
    anchor_every: int = 20
    port: int = 0                        # 0: a free port
    seed: int = 0
    threads: int = 1                     # torch threads, for the trainer and for the replica
    report_dir: str = DEFAULT_REPORT
    score_with: str = "published"        # "master": the trainer scores with fp32 masters (a lossy variant)
    quiet: bool = False
    task: AdditionTask = field(default_factory=AdditionTask)


# --- the replica ------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Replica:
    """``ckptdelta serve`` as a subprocess: output to a log file, stopped (only this process) on close."""

    def __init__(self, run_url: str, *, port: int, replica_id: str, log_path: str, threads: int,
                 storage_options: dict[str, Any] | None = None, engine: str = "reference",
                 vllm_args: tuple[str, ...] = VLLM_ARGS, timeout: float | None = None,
                 serve_args: tuple[str, ...] = ()):
        import httpx

        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.engine = engine
        argv = [sys.executable, "-m", "ckptdelta", "serve", "--engine", engine, "--bucket", run_url,
                "--snapshot", "latest", "--port", str(port), "--replica-id", replica_id]
        if storage_options:
            argv += ["--storage-options", json.dumps(storage_options)]
        argv += serve_args
        if engine == "vllm":  # vLLM's own log beside the replica's; its options after "--"
            self.vllm_log = os.path.splitext(log_path)[0] + "-vllm.log"
            open(self.vllm_log, "wb").close()  # the server appends: one run's log per file
            argv += ["--vllm-log", self.vllm_log, "--", *vllm_args]
        if timeout is None:
            timeout = 420.0 if engine == "vllm" else 180.0
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
               "TOKENIZERS_PARALLELISM": "false"}
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=env)
        t0 = time.perf_counter()
        deadline = t0 + timeout
        while True:
            if self.proc.poll() is not None:
                output = harness.tail(self.log_path)
                self.close()
                raise RuntimeError(f"the replica exited with {self.proc.returncode} while starting:\n{output}")
            try:
                r = httpx.get(self.url + "/v1/status", timeout=2.0)
                if r.status_code == 200:
                    self.status = r.json()
                    break
            except httpx.TransportError:
                pass
            if time.perf_counter() > deadline:
                output = harness.tail(self.log_path)
                self.close()
                raise RuntimeError(f"the replica did not answer on {self.url} within {timeout:.0f}s:\n{output}")
            time.sleep(0.2)
        self.startup_s = time.perf_counter() - t0

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()


# --- the trainer ---------------------------------------------------------------------------

@dataclass
class Sample:
    """One completion as the replica sampled it, with what the trainer adds."""

    prompt_ids: list[int]
    token_ids: list[int]
    logp_sample: list[float]   # the replica's logprobs of token_ids (behaviour policy)
    reward: float
    advantage: float = 0.0
    version: int | None = None


def group_advantages(rewards: list[float]) -> list[float]:
    """(r - mean) / std within one group; all zeros when the rewards are all equal (no signal, no update)."""
    m = sum(rewards) / len(rewards)
    sd = math.sqrt(sum((r - m) ** 2 for r in rewards) / len(rewards))
    if sd == 0.0:
        return [0.0] * len(rewards)
    return [(r - m) / sd for r in rewards]


def divergence(diff: torch.Tensor) -> dict[str, float]:
    """Sampler/trainer divergence estimators over ``diff = logp_sample - logp_train`` (Schulman's k1, k2, k3)."""
    d = diff.double()
    if d.numel() == 0:
        return {"k1": 0.0, "k2": 0.0, "k3": 0.0, "max_abs_diff": 0.0}
    return {"k1": float(d.mean()), "k2": float(0.5 * (d * d).mean()), "k3": float((torch.exp(-d) - 1 + d).mean()),
            "max_abs_diff": float(d.abs().max())}


class Trainer:
    """fp32 master weights under AdamW; a bf16 policy (the published bits) that runs every forward.

    ``policy`` must be built exactly as the replica builds its model (the demo
    loads it with :func:`ckptdelta.loader.hf_model.load_model` from the directory the anchor
    carries): bits that are not published count too, e.g. the rotary ``inv_freq``
    buffer is float32 after ``from_pretrained`` but bf16 after ``model.to(bf16)``,
    which alone moves logprobs by up to ~0.2 nats on this model.

    ``score_with="master"`` is the lossy variant the tests use: the trainer scores
    (and differentiates) the fp32 masters instead of the bf16 weights it publishes."""

    def __init__(self, master: torch.nn.Module, policy: torch.nn.Module, *, lr: float, clip: float,
                 score_with: str = "published"):
        if score_with not in SCORE_WITH:
            raise ValueError(f"score_with {score_with!r}: expected one of {SCORE_WITH}")
        self.master = master.float().eval()
        self.policy = policy.eval()
        names = [n for n, _ in master.named_parameters()]
        if names != [n for n, _ in policy.named_parameters()]:
            raise ValueError("the master and the policy must have the same parameters in the same order")
        self.clip, self.score_with = clip, score_with
        self.opt = torch.optim.AdamW(self.master.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.0)
        self._sync()

    @torch.no_grad()
    def _sync(self) -> None:
        for p, m in zip(self.policy.parameters(), self.master.parameters()):
            p.copy_(m)  # round to nearest even: the bits that get published

    def step(self, samples: list[Sample]) -> dict[str, float]:
        """One PPO step over ``samples``; returns divergence and loss statistics."""
        from ckptdelta.loader.hf_model import score_tokens

        scorer = self.master if self.score_with == "master" else self.policy
        n_tokens = sum(len(s.token_ids) for s in samples if s.advantage != 0.0)
        diffs, loss_sum, clipped = [], 0.0, 0
        for p in list(self.master.parameters()) + list(self.policy.parameters()):
            p.grad = None
        for s in samples:
            seq, plen = s.prompt_ids + s.token_ids, len(s.prompt_ids)
            old = torch.tensor(s.logp_sample, dtype=torch.float32)
            if s.advantage == 0.0:
                with torch.no_grad():
                    diffs.append(old - score_tokens(scorer, seq, plen))
                continue
            logp = score_tokens(scorer, seq, plen)
            diffs.append(old - logp.detach())
            ratio = torch.exp(logp - old)
            surr = torch.minimum(ratio * s.advantage, ratio.clamp(1 - self.clip, 1 + self.clip) * s.advantage)
            loss = -surr.sum() / n_tokens
            loss.backward()
            loss_sum += loss.item()
            clipped += int(((ratio - 1).abs() > self.clip).sum())
        if n_tokens:
            if scorer is self.policy:  # mixed precision: bf16 gradients flow to the fp32 masters
                for m, p in zip(self.master.parameters(), self.policy.parameters()):
                    m.grad = None if p.grad is None else p.grad.float()
            torch.nn.utils.clip_grad_norm_(self.master.parameters(), 1.0)
            self.opt.step()
            self._sync()
        div = divergence(torch.cat(diffs)) if diffs else divergence(torch.empty(0))
        return {**div, "loss": loss_sum, "tokens": sum(d.numel() for d in diffs), "trained_tokens": n_tokens,
                "clipped_tokens": clipped}


# --- the loop --------------------------------------------------------------------------------

def sample_kwargs(cfg: DemoConfig, task: AdditionTask, min_version: int, step: int, i: int) -> dict[str, Any]:
    """The sampling request for problem ``i`` of ``step``: a group of ``cfg.group_size`` completions on at least
    ``min_version``, each with its sampled tokens' logprobs."""
    # reference: the replica rescores the sampled tokens (score_logprobs) with the trainer's function;
    # vLLM: its own logprobs of the sampled tokens (logprobs=0) and the token ids it sampled
    extra = {"score_logprobs": True} if cfg.engine == "reference" else {"return_token_ids": True}
    return dict(n=cfg.group_size, max_tokens=task.max_tokens, temperature=cfg.temperature, logprobs=0,
                min_policy_version=min_version, seed=(cfg.seed * 1_000_003 + step * 1009 + i) % (1 << 62), **extra)


def _rollouts(client: Any, task: AdditionTask, tokenizer: Any, problems: list[tuple[str, str]], cfg: DemoConfig,
              min_version: int, step: int) -> tuple[list[list[Sample]], list[dict]]:
    def one(i: int) -> dict:
        return client.sample(problems[i][0], **sample_kwargs(cfg, task, min_version, step, i))

    with ThreadPoolExecutor(max_workers=4) as pool:
        bodies = list(pool.map(one, range(len(problems))))
    return groups_of(task, tokenizer, problems, bodies), [b["engine_data"] for b in bodies]


def groups_of(task: AdditionTask, tokenizer: Any, problems: list[tuple[str, str]],
              bodies: list[dict]) -> list[list[Sample]]:
    """The replica's answers (one per problem) as groups of rewarded samples with their group's advantages,
    refusing an answer whose tokens, logprobs or prompt do not agree with what the trainer would score."""
    groups = []
    for (prompt, answer), body in zip(problems, bodies):
        version = body["engine_data"]["policy_version"]
        group = []
        for ch in body["choices"]:
            # vLLM names the prompt's token ids in each choice, the reference engine once per response
            prompt_ids = list(ch.get("prompt_token_ids") or body["prompt_token_ids"])
            if prompt_ids != encode(tokenizer, prompt):
                raise RuntimeError(f"the replica tokenized {prompt!r} as {prompt_ids}, the trainer does not")
            lp = ch["logprobs"]
            if len(lp["token_logprobs"]) != len(ch["token_ids"]) or lp.get("token_ids", ch["token_ids"]) != \
                    ch["token_ids"]:
                raise RuntimeError("logprobs and completion disagree on the sampled tokens")
            if ch["finish_reason"] == "stop" and ch["token_ids"][-1:] != [EOS]:
                raise RuntimeError(f"a completion ended with 'stop' but not with EOS: {ch['token_ids']}")
            group.append(Sample(prompt_ids, list(ch["token_ids"]), [float(x) for x in lp["token_logprobs"]],
                                task.reward(ch["text"], ch["finish_reason"], answer), version=version))
        for s, a in zip(group, group_advantages([s.reward for s in group])):
            s.advantage = a
        groups.append(group)
    return groups


HEADER = (f"{'step':>4} {'reward':>6} {'served':>7} {'kind':>7} {'bytes':>9} {'ratio':>6} {'publish':>8} "
          f"{'hotload':>8} {'pause':>8} {'exact':>5} {'k1':>9} {'k2':>9} {'k3':>9}")
#: printed under the header: what "exact" is
EXACT_NOTE = {"vllm": "exact: the replica's own check (every vLLM worker's read-back of the changed tensors = "
                      "the verified host copy; sampled in the pause, whole after it), from /v1/status "
                      "engine.last_swap",
              "reference": "exact: '-' (the reference engine has no separate read-back; its proof is k1 = k2 = k3 "
                           "= 0: the replica's logprobs are the trainer's, bit for bit)"}


def _exact(r: dict[str, Any]) -> str:
    v = r.get("replica_verified")
    return "-" if v is None else ("yes" if v else "NO")


def format_row(r: dict[str, Any]) -> str:
    served = ",".join(f"v{v}" for v in r["served_versions"])
    kind = r["kind"] if r["kind"] != "delta" or not r.get("codec") else r["codec"]   # context / fast (auto's pick)
    return (f"{r['step']:>4} {r['reward']:>6.3f} {served:>7} {kind:>7} {nbytes(r['stored_bytes']):>9} "
            f"{100 * r['ratio']:>5.1f}% {r['publish_s']:>7.3f}s {r['hotload_s']:>7.3f}s {r['pause_ms']:>6.2f}ms "
            f"{_exact(r):>5} {r['k1']:>9.2e} {r['k2']:>9.2e} {r['k3']:>9.2e}")


def run_url_of(cfg: DemoConfig, prefix: str) -> str:
    """Where the run goes: ``cfg.run_name`` (default ``<prefix>-<UTC time>``) under the bucket."""
    run_name = cfg.run_name or f"{prefix}-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}"
    remote = "://" in cfg.bucket and not cfg.bucket.startswith("file://")
    return f"{cfg.bucket.rstrip('/')}/{run_name}" if remote else os.path.abspath(os.path.join(cfg.bucket, run_name))


def pretrained(cfg: DemoConfig, say: Any) -> tuple[Any, torch.nn.Module, dict[str, float]]:
    """(tokenizer, fp32 model, pre-train stats): the tiny Llama after the supervised pre-train on noisy addition."""
    tokenizer = build_tokenizer()
    master = build_model(len(tokenizer), cfg.model_size, seed=cfg.seed)
    n_params = sum(p.numel() for p in master.parameters())
    say(f"pre-training a {cfg.model_size} Llama ({n_params / 1e3:.0f}k parameters, bf16 {nbytes(2 * n_params)}) "
        f"on noisy addition for {cfg.pretrain_steps} steps ...")
    return tokenizer, master, pretrain(master, tokenizer, cfg.task, steps=cfg.pretrain_steps, seed=cfg.seed)


def run_demo(cfg: DemoConfig) -> dict[str, Any]:
    """Run the whole loop; returns (and writes under ``cfg.report_dir``) the rows and the summary."""
    from ckptdelta.loader.client import RolloutClient
    from ckptdelta.loader.hf_model import load_model
    from ckptdelta.publisher import Publisher

    t_start = time.perf_counter()
    say = (lambda *a: None) if cfg.quiet else (lambda *a: print(*a, flush=True))
    if cfg.model_size not in MODEL_SIZES:
        raise ValueError(f"--model-size {cfg.model_size!r}: expected one of {sorted(MODEL_SIZES)}")
    if cfg.engine not in ENGINES:
        raise ValueError(f"--engine {cfg.engine!r}: expected one of {ENGINES}")
    if cfg.group_size < 2:
        raise ValueError("--group-size must be at least 2 (advantages are relative to the group)")
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    task = cfg.task
    run_url = run_url_of(cfg, "demo")
    os.makedirs(cfg.report_dir, exist_ok=True)

    # 1. a policy with something left to learn
    tokenizer, master, pre = pretrained(cfg, say)

    rows: list[dict[str, Any]] = []
    replica = None
    final: dict[str, Any] | None = None
    with tempfile.TemporaryDirectory(prefix="ckptdelta-demo-") as tmp:
        # the HF directory the anchor carries; the trainer's bf16 policy is loaded from it like the replica's
        model_dir = os.path.join(tmp, "model")
        extra = save_model_dir(copy.deepcopy(master).to(torch.bfloat16), tokenizer, model_dir)
        policy, _ = load_model(model_dir)
        trainer = Trainer(master, policy, lr=cfg.lr, clip=cfg.clip, score_with=cfg.score_with)
        pre["greedy_accuracy"] = greedy_accuracy(trainer.policy, tokenizer, task, n=100)
        say(f"  loss {pre['loss']:.3f} in {pre['seconds']:.1f}s; greedy accuracy of the bf16 policy "
            f"{pre['greedy_accuracy']:.2f}")
        pub = Publisher(run_url, storage_options=cfg.storage_options, anchor_every=cfg.anchor_every,
                        extra_files=extra, progress=False)
        try:
            first = pub.publish(trainer.policy, 0)
            say(f"published v{first.version} ({first.kind}, {nbytes(first.stored_bytes)}) to {run_url}")
            say(f"starting replica demo-0: ckptdelta serve --engine {cfg.engine}"
                + (f" -- {' '.join(cfg.vllm_args)}" if cfg.engine == "vllm" else "") + " ...")
            replica = Replica(run_url, port=cfg.port or free_port(), replica_id="demo-0", threads=cfg.threads,
                              log_path=os.path.join(cfg.report_dir, "demo-replica.log"),
                              storage_options=cfg.storage_options, engine=cfg.engine, vllm_args=cfg.vllm_args)
            say(f"replica demo-0 ({cfg.engine}) serving v{replica.status['policy_version']} on {replica.url} "
                f"(started in {replica.startup_s:.1f}s)\n")
            say(HEADER)
            say(EXACT_NOTE[cfg.engine])
            rng = random.Random(cfg.seed + 1)
            version = first.version
            with RolloutClient([replica.url], ready_timeout=120.0) as client:
                for step in range(1, cfg.steps + 1):
                    row = _one_step(cfg, task, tokenizer, trainer, pub, client, rng, step, version)
                    version = row["published_version"]
                    rows.append(row)
                    say(format_row(row))
            if cfg.engine == "vllm":
                final = live_vs_trainer(replica.url, trainer.policy)
        finally:
            if replica is not None:
                replica.close()
            pub.close()
    summary = summarize(rows, pre, first, cfg, run_url, time.perf_counter() - t_start, replica.startup_s, final)
    report = {"config": {k: v for k, v in asdict(cfg).items() if k != "storage_options"}, "run_url": run_url,
              "replica_url": replica.url if replica is not None else None,
              "pretrain": pre, "anchor": {"version": first.version, "stored_bytes": first.stored_bytes,
                                          "full_bytes": first.full_bytes}, "rows": rows, "summary": summary}
    write_report(report, cfg.report_dir)
    say("\n" + format_summary(summary, cfg.report_dir))
    return report


def _one_step(cfg: DemoConfig, task: AdditionTask, tokenizer: Any, trainer: Trainer, pub: Any, client: Any,
              rng: random.Random, step: int, version: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    problems = [task.problem(rng) for _ in range(cfg.prompts_per_step)]
    groups, engine_data = _rollouts(client, task, tokenizer, problems, cfg, version, step)
    t1 = time.perf_counter()
    samples = [s for g in groups for s in g]
    stats = trainer.step(samples)
    t2 = time.perf_counter()
    fut = pub.publish(trainer.policy, step, wait=False)  # returns once the bits are copied to host memory
    res = fut.result()
    t3 = time.perf_counter()
    states = client.hotload(res.version, wait=True, poll_interval=0.01)
    t4 = time.perf_counter()
    job = next(iter(states.values()))
    proof = replica_proof(cfg, client, res.version, job.get("report") or {})
    return step_row(step, version, samples, engine_data, stats, res, job, proof, (t0, t1, t2, t3, t4))


def step_row(step: int, version: int, samples: list[Sample], engine_data: list[dict], stats: dict[str, float],
             res: Any, job: dict[str, Any], proof: dict[str, Any],
             times: tuple[float, float, float, float, float]) -> dict[str, Any]:
    """One step's row: rollouts on ``version`` (before), the publish ``res``, the hot-load ``job`` (after), the
    replica's ``proof``; ``times``: rollouts started, trained from, published from, hot-load from, swapped."""
    t0, t1, t2, t3, t4 = times
    rep = job.get("report") or {}
    served = sorted({v for ed in engine_data for v in ed["policy_versions"]})
    return {
        "step": step, "reward": sum(s.reward for s in samples) / len(samples), "samples": len(samples),
        "expected_version": version, "served_versions": served,
        "served_ok": served == [version] and all(s.version == version for s in samples),
        "published_version": res.version, "kind": res.kind, "codec": res.codec, "stored_bytes": res.stored_bytes,
        "full_bytes": res.full_bytes, "ratio": res.ratio, "changed_tensors": res.n_changed_tensors,
        "publish_s": res.total_s, "copy_s": res.copy_s, "encode_s": res.encode_s, "upload_s": res.upload_s,
        "commit_s": res.commit_s, "hotload_s": float(job.get("duration_s") or 0.0),
        "hotload_wall_s": t4 - t3, "fetch_s": float(rep.get("fetch_s") or 0.0),
        "decode_s": float(rep.get("decode_s") or 0.0), "apply_s": float(rep.get("apply_s") or 0.0),
        "pause_ms": 1000 * float(rep.get("pause_s") or 0.0), "bytes_fetched": int(rep.get("bytes_fetched") or 0),
        "elements_changed": int(rep.get("elements_changed") or 0), "update_s": t4 - t2,
        "rollout_s": t1 - t0, "train_s": t2 - t1, "step_s": t4 - t0, **proof,
        **{k: stats[k] for k in ("k1", "k2", "k3", "max_abs_diff", "loss", "tokens", "trained_tokens",
                                  "clipped_tokens")},
    }


def live_vs_trainer(replica_url: str, policy: torch.nn.Module) -> dict[str, Any]:
    """Every live tensor of the vLLM replica, read back by its workers, against the trainer's own bf16 policy.

    Digests from the worker method ``ckptdelta_digests`` (through vLLM's
    ``/collective_rpc``, at the internal URL ``/v1/status`` names) against the
    trainer's tensors, both under ``kernel_view`` where a worker read a tensor
    through a GEMM kernel (a kernel cannot show -0.0 or a flushed subnormal)."""
    import httpx

    from ckptdelta.loader.engines.vllm.control import VllmControl
    from ckptdelta.loader.engines.vllm.proof import digests, kernel_view

    truth = {n: t.detach() for n, t in policy.state_dict().items()}
    control = VllmControl(httpx.get(replica_url + "/v1/status", timeout=30).json()["engine"]["url"])
    try:
        answers = control.rpc("ckptdelta_digests", {"names": sorted(truth)})
    finally:
        control.close()
    differ: set[str] = set()
    kernel: set[str] = set()
    for a in answers:
        k = set(a.get("kernel_view") or ())
        kernel |= k
        want = digests({n: kernel_view(t) if n in k else t for n, t in truth.items()})
        got = a.get("digests") or {}
        differ |= {n for n in truth if got.get(n) != want[n]}
    return {"tensors": len(truth), "workers": len(answers), "differ": sorted(differ), "kernel_view": len(kernel)}


def replica_proof(cfg: DemoConfig, client: Any, version: int, report: dict[str, Any]) -> dict[str, Any]:
    """What the replica itself says about the weights it swapped in for ``version``.

    vLLM: ``/v1/status`` -> ``engine.last_swap``, written by ``VllmApplier.apply``
    inside the pause once every worker's read-back digests of the reloaded tensors
    equalled the host copy's (a mismatch fails the hot-load and rolls it back).
    A step that changed no bits reloads and reads back nothing (0 tensors).
    Reference: the engine's live tensors are the host copy the swapper verified
    against the manifest's digests; there is no separate read-back (``None``)."""
    if cfg.engine != "vllm":
        return {"replica_verified": None, "verified_tensors": 0, "verify_ms": 0.0}
    last = next(iter(client.status().values())).get("engine", {}).get("last_swap") or {}
    ok = last.get("version") == version and last.get("verified") is True and \
        last.get("verified_tensors", 0) >= int(report.get("tensors_changed") or 0)
    return {"replica_verified": bool(ok), "verified_tensors": int(last.get("verified_tensors") or 0),
            "verify_ms": 1000 * float(last.get("verify_s") or 0.0)}


# --- summary and report -----------------------------------------------------------------------

def drift(rows: list[dict], key: str) -> dict[str, float]:
    """Whether ``key`` grows over the run: the means of the first and last thirds of the steps, and the
    least-squares slope per step with its standard error."""
    ys = [float(r[key]) for r in rows]
    n = len(ys)
    if n < 3:
        return {"first_third": float("nan"), "last_third": float("nan"), "slope": float("nan"),
                "slope_se": float("nan"), "upward": False}
    t = max(1, n // 3)
    xs = [float(r["step"]) for r in rows]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    resid = [y - my - slope * (x - mx) for x, y in zip(xs, ys)]
    se = math.sqrt(sum(e * e for e in resid) / (n - 2) / sxx) if n > 2 else float("nan")
    first, last = statistics.fmean(ys[:t]), statistics.fmean(ys[-t:])
    # upward drift: the slope is positive by more than two standard errors and the last third is above the first
    upward = slope > 2 * se and last > first and (last > 0 or first > 0)
    return {"first_third": first, "last_third": last, "slope": slope, "slope_se": se, "upward": bool(upward)}


def summarize(rows: list[dict], pre: dict, first: Any, cfg: DemoConfig, run_url: str, wall_s: float,
              startup_s: float, final: dict[str, Any] | None = None) -> dict[str, Any]:
    k = max(1, min(3, len(rows) // 3))
    first_r = statistics.fmean(r["reward"] for r in rows[:k]) if rows else float("nan")
    last_r = statistics.fmean(r["reward"] for r in rows[-k:]) if rows else float("nan")
    stored = first.stored_bytes + sum(r["stored_bytes"] for r in rows)
    full = first.full_bytes + sum(r["full_bytes"] for r in rows)
    med = (lambda key: statistics.median(r[key] for r in rows)) if rows else (lambda key: float("nan"))
    return {
        "steps": len(rows), "window": k, "reward_first": first_r, "reward_last": last_r,
        "reward_rose": bool(rows) and last_r > first_r,
        "snapshots": len(rows) + 1, "anchors": 1 + sum(r["kind"] == "anchor" for r in rows),
        "stored_bytes": stored, "full_bytes": full, "stored_ratio": stored / max(1, full),
        "delta_ratio_median": statistics.median(r["ratio"] for r in rows if r["kind"] == "delta")
        if any(r["kind"] == "delta" for r in rows) else None,
        "publish_s_median": med("publish_s"), "hotload_s_median": med("hotload_s"), "pause_ms_median": med("pause_ms"),
        "update_s_median": med("update_s"),
        "k_max": max((max(abs(r["k1"]), abs(r["k2"]), abs(r["k3"])) for r in rows), default=0.0),
        "max_abs_diff": max((r["max_abs_diff"] for r in rows), default=0.0),
        "all_served_by_previous_version": all(r["served_ok"] for r in rows),
        "engine": cfg.engine,
        "k_drift": {k: drift(rows, k) for k in ("k1", "k2", "k3")},
        "k_mean": {k: statistics.fmean(r[k] for r in rows) if rows else float("nan") for k in ("k1", "k2", "k3")},
        "replica_verified_all": all(r.get("replica_verified") is True for r in rows) if cfg.engine == "vllm"
        else None,
        "replica_verified_tensors": sum(r.get("verified_tensors", 0) for r in rows),
        "verify_ms_median": med("verify_ms") if cfg.engine == "vllm" else None,
        "final_live_check": final,
        "wall_s": wall_s, "pretrain_s": pre["seconds"], "replica_startup_s": startup_s, "run_url": run_url,
    }


def format_summary(s: dict[str, Any], report_dir: str, name: str = "demo", exact: Any = None) -> str:
    """The summary's lines; the report files are ``<name>.json`` and ``<name>.png``; ``exact(s)``, the lines on
    the replica's proof, defaults to the full-model replica's."""
    lines = [
        f"reward: {s['reward_first']:.3f} (mean of the first {s['window']} steps) -> {s['reward_last']:.3f} "
        f"(last {s['window']})" + ("" if s["reward_rose"] else "  [did not rise]"),
        f"published: {s['snapshots']} snapshots ({s['anchors']} anchors), {nbytes(s['stored_bytes'])} in all vs "
        f"{nbytes(s['full_bytes'])} as full checkpoints ({100 * s['stored_ratio']:.1f}%)"
        + (f"; median delta {100 * s['delta_ratio_median']:.1f}% of full" if s["delta_ratio_median"] else ""),
        f"latency (median): publish {s['publish_s_median']:.3f}s, hot-load {s['hotload_s_median']:.3f}s, "
        f"pause {s['pause_ms_median']:.2f}ms; publish() to replica swapped {s['update_s_median']:.3f}s",
        *_divergence_lines(s),
        *(exact or _exact_lines)(s),
        "every step's rollouts were served by the version published before it: "
        + ("yes" if s["all_served_by_previous_version"] else "NO"),
        f"wall time {s['wall_s']:.1f}s (pre-train {s['pretrain_s']:.1f}s, replica start {s['replica_startup_s']:.1f}s)",
        f"report: {os.path.join(report_dir, name + '.json')}, {os.path.join(report_dir, name + '.png')}",
    ]
    return "\n".join(lines)


def _divergence_lines(s: dict[str, Any]) -> list[str]:
    head = (f"sampler/trainer divergence: max |k| {s['k_max']:.2e}, max |logp diff| {s['max_abs_diff']:.2e}"
            + (" (bit-exact)" if s["max_abs_diff"] == 0 else ""))
    if s.get("engine") != "vllm" or s["steps"] < 3:
        return [head]
    head += " (vLLM's sampled logprobs vs the trainer's score_tokens on the same tokens)"
    lines = [head]
    for k in ("k1", "k2", "k3"):
        d = s["k_drift"][k]
        lines.append(f"  {k}: mean {s['k_mean'][k]:.2e}; first third {d['first_third']:.2e} -> last third "
                     f"{d['last_third']:.2e}; slope {d['slope']:+.1e}/step (se {d['slope_se']:.1e})"
                     + ("  [DRIFTS UP]" if d["upward"] else ""))
    up = [k for k in ("k1", "k2", "k3") if s["k_drift"][k]["upward"]]
    lines.append("  drift upward over the run: " + (f"YES ({', '.join(up)})" if up else
                 "no (same bits every step; only vLLM's kernels differ from the trainer's)"))
    return lines


def _exact_lines(s: dict[str, Any]) -> list[str]:
    if s.get("engine") != "vllm":
        return []
    lines = ["weights bit-exact, checked by the replica itself on every hot-load: "
             + ("yes" if s["replica_verified_all"] else "NO")
             + f" ({s['replica_verified_tensors']} tensor read-backs in all; median in-pause check "
               f"{s['verify_ms_median']:.1f}ms)"]
    f = s.get("final_live_check")
    if f:
        lines.append(f"final live weights (all {f['tensors']} tensors read back by {f['workers']} vLLM worker(s)) = "
                     "the trainer's bf16 policy: " + ("yes" if not f["differ"] else
                                                       f"NO ({len(f['differ'])} differ: {', '.join(f['differ'][:4])})")
                     + (f"; {f['kernel_view']} read through GEMM kernels, compared as the kernel sees them"
                        if f["kernel_view"] else ""))
    return lines


def write_report(report: dict[str, Any], report_dir: str, name: str = "demo") -> None:
    harness.write(os.path.join(report_dir, name), data=report, plot=lambda path: plot(report["rows"], path))


def plot(rows: list[dict], path: str) -> None:
    from matplotlib.ticker import MaxNLocator

    steps = [r["step"] for r in rows]
    with harness.figure(path, 1, 4, figsize=(20, 4)) as (_, ax):
        for a in ax:
            a.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax[0].plot(steps, [r["reward"] for r in rows], marker="o")
        ax[0].set(title="mean reward per step", xlabel="step", ylabel="reward", ylim=(0, 1))
        ax[1].bar(steps, [r["full_bytes"] / 1e3 for r in rows], color="lightgray", label="full checkpoint")
        ax[1].bar(steps, [r["stored_bytes"] / 1e3 for r in rows],
                  color=["tab:orange" if r["kind"] == "anchor" else "tab:blue" for r in rows], label="published")
        ax[1].set(title="bytes per step (orange: anchor)", xlabel="step", ylabel="KB")
        ax[1].legend()
        pub = [r["publish_s"] * 1e3 for r in rows]
        hot = [r["hotload_s"] * 1e3 for r in rows]
        ax[2].bar(steps, pub, label="publish")
        ax[2].bar(steps, hot, bottom=pub, label="hot-load")
        ax[2].plot(steps, [r["pause_ms"] for r in rows], color="black", marker=".", label="pause (inside hot-load)")
        ax[2].set(title="weight-update latency", xlabel="step", ylabel="ms")
        ax[2].legend()
        ks = {"|k1|": [abs(r["k1"]) for r in rows], "k2": [r["k2"] for r in rows], "k3": [r["k3"] for r in rows]}
        for (label, ys), style in zip(ks.items(), ("o-", "x--", ".:")):
            ax[3].plot(steps, ys, style, label=label)  # k2 and k3 nearly coincide: dashed over dotted
        if any(y > 0 for ys in ks.values() for y in ys):
            ax[3].set_yscale("log")
            title = "sampler/trainer k1/k2/k3 (same bits)"
        else:
            title = "sampler/trainer k1/k2/k3: exactly 0"
        ax[3].set(title=title, xlabel="step", ylabel="estimate")
        ax[3].legend()


# --- command line ------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> DemoConfig:
    d = DemoConfig()
    return config_from(parser(d, "python -m benchmarks.demo", __doc__).parse_args(argv), d)


def parser(d: DemoConfig, prog: str, doc: str, *, score_with: bool = True) -> argparse.ArgumentParser:
    """The demo's options with ``d``'s defaults (the LoRA demo adds its own to the same parser, without
    ``--score-with``: its trainer has no fp32 masters)."""
    p = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", choices=ENGINES, default=d.engine,
                   help="the replica: 'vllm' (ckptdelta serve --engine vllm, the default) or 'reference'")
    p.add_argument("--bucket", default=d.bucket, help=f"where runs go: a local dir (default {d.bucket}), s3://, gs://")
    p.add_argument("--run-name", default=None,
                   help="the run's prefix under the bucket (default: the demo's name and the UTC time)")
    p.add_argument("--storage-options", type=json.loads, default=None, metavar="JSON",
                   help="fsspec storage options for the bucket (trainer and replica)")
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--model-size", choices=sorted(MODEL_SIZES), default=d.model_size)
    p.add_argument("--group-size", type=int, default=d.group_size, help="completions per prompt")
    p.add_argument("--prompts", type=int, default=d.prompts_per_step, help="prompts per step")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--pretrain-steps", type=int, default=d.pretrain_steps)
    p.add_argument("--anchor-every", type=int, default=d.anchor_every)
    p.add_argument("--port", type=int, default=d.port, help="the replica's port (default: a free one)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--threads", type=int, default=d.threads, help="torch threads for trainer and replica each")
    p.add_argument("--report-dir", default=d.report_dir)
    if score_with:
        p.add_argument("--score-with", choices=SCORE_WITH, default=d.score_with,
                       help="'master': score with the fp32 masters, not the published bf16 (shows nonzero "
                            "divergence)")
    p.add_argument("--quiet", action="store_true")
    return p


def config_from(a: argparse.Namespace, d: DemoConfig) -> DemoConfig:
    """``d`` (of any DemoConfig subclass) with the parsed options in place."""
    return dataclasses.replace(d, engine=a.engine, bucket=a.bucket, run_name=a.run_name,
                               storage_options=a.storage_options, steps=a.steps, model_size=a.model_size,
                               group_size=a.group_size, prompts_per_step=a.prompts, lr=a.lr,
                               pretrain_steps=a.pretrain_steps, anchor_every=a.anchor_every, port=a.port, seed=a.seed,
                               threads=a.threads, report_dir=a.report_dir,
                               score_with=getattr(a, "score_with", d.score_with), quiet=a.quiet)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # save/load bars of a 400 KB model would break up the table
    cfg = parse_args(argv)
    report = run_demo(cfg)
    s = report["summary"]
    return 0 if s["all_served_by_previous_version"] and s["replica_verified_all"] is not False else 1


if __name__ == "__main__":
    sys.exit(main())
