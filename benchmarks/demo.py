"""``make demo``: an RL loop whose policy reaches its sampling replica as bit-exact deltas.

One process trains, one serves. The trainer pre-trains a tiny Llama on noisy
addition (benchmarks/rl_task.py), publishes it as the run's anchor and starts a
replica (``ckptdelta serve``) on it. Then each step:

1. rollouts over HTTP: groups of ``--group-size`` completions per prompt, with
   ``min_policy_version`` = the version published last (the client retries the
   replica's 408 until it serves it) and the sampled tokens' logprobs, scored by
   the replica with :func:`loader.engine.score_logprobs`;
2. rewards, advantages normalised within each group (zero when a group's
   rewards are all equal), a PPO clipped importance-sampling loss with the
   replica's logprobs as the behaviour policy; the trainer scores the same tokens
   with :func:`loader.engine.score_tokens` on its bf16 weights (the published
   bits), so sampler/trainer divergence k1/k2/k3 is exactly 0 when the weights
   are exact;
3. AdamW on fp32 master weights (the bf16 forward's gradients are copied to the
   masters), the masters cast to bf16 and published with ``wait=False``, then a
   hot-load of that version on the replica.

One line per step, then a summary; ``.ckptdelta/report/`` gets the rows as JSON
and a PNG (reward, bytes per step, publish/hot-load/pause latency).

    python -m benchmarks.demo [--bucket DIR|s3://...|gs://...] [--steps N] [--model-size tiny|small|base]
                              [--group-size G] [--lr LR] [--port P]
"""

from __future__ import annotations

import argparse
import copy
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

from benchmarks.rl_task import (MODEL_SIZES, AdditionTask, build_model, build_tokenizer, encode, greedy_accuracy,
                                pretrain, save_model_dir)

log = logging.getLogger("ckptdelta.demo")

DEFAULT_BUCKET = os.path.join(".ckptdelta", "bucket")
DEFAULT_REPORT = os.path.join(".ckptdelta", "report")
SCORE_WITH = ("published", "master")


@dataclass
class DemoConfig:
    """Everything a demo run depends on; the defaults are ``make demo``."""

    bucket: str = DEFAULT_BUCKET
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
                 storage_options: dict[str, Any] | None = None, timeout: float = 180.0):
        import httpx

        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        argv = [sys.executable, "-m", "ckptdelta", "serve", "--bucket", run_url, "--snapshot", "latest",
                "--port", str(port), "--replica-id", replica_id]
        if storage_options:
            argv += ["--storage-options", json.dumps(storage_options)]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
               "TOKENIZERS_PARALLELISM": "false"}
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=env)
        t0 = time.perf_counter()
        deadline = t0 + timeout
        while True:
            if self.proc.poll() is not None:
                tail = self.log_tail()
                self.close()
                raise RuntimeError(f"the replica exited with {self.proc.returncode} while starting:\n{tail}")
            try:
                r = httpx.get(self.url + "/v1/status", timeout=2.0)
                if r.status_code == 200:
                    self.status = r.json()
                    break
            except httpx.TransportError:
                pass
            if time.perf_counter() > deadline:
                tail = self.log_tail()
                self.close()
                raise RuntimeError(f"the replica did not answer on {self.url} within {timeout:.0f}s:\n{tail}")
            time.sleep(0.2)
        self.startup_s = time.perf_counter() - t0

    def log_tail(self, n: int = 3000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read().decode(errors="replace")[-n:]
        except OSError:
            return ""

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
    loads it with :func:`loader.engine.load_model` from the directory the anchor
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
        from loader.engine import score_tokens

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

def _rollouts(client: Any, task: AdditionTask, tokenizer: Any, problems: list[tuple[str, str]], cfg: DemoConfig,
              min_version: int, step: int) -> tuple[list[list[Sample]], list[dict]]:
    def one(i: int) -> dict:
        prompt, _ = problems[i]
        return client.sample(prompt, n=cfg.group_size, max_tokens=task.max_tokens, temperature=cfg.temperature,
                             logprobs=0, score_logprobs=True, min_policy_version=min_version,
                             seed=(cfg.seed * 1_000_003 + step * 1009 + i) % (1 << 62))

    with ThreadPoolExecutor(max_workers=4) as pool:
        bodies = list(pool.map(one, range(len(problems))))
    groups = []
    for (prompt, answer), body in zip(problems, bodies):
        prompt_ids = list(body["prompt_token_ids"])
        if prompt_ids != encode(tokenizer, prompt):
            raise RuntimeError(f"the replica tokenized {prompt!r} as {prompt_ids}, the trainer does not")
        version = body["engine_data"]["policy_version"]
        group = []
        for ch in body["choices"]:
            lp = ch["logprobs"]
            if lp["token_ids"] != ch["token_ids"]:
                raise RuntimeError("logprobs and completion disagree on the sampled tokens")
            group.append(Sample(prompt_ids, list(ch["token_ids"]), list(lp["token_logprobs"]),
                                task.reward(ch["text"], ch["finish_reason"], answer), version=version))
        for s, a in zip(group, group_advantages([s.reward for s in group])):
            s.advantage = a
        groups.append(group)
    return groups, [b["engine_data"] for b in bodies]


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


HEADER = (f"{'step':>4} {'reward':>6} {'served':>7} {'kind':>6} {'bytes':>9} {'ratio':>6} {'publish':>8} "
          f"{'hotload':>8} {'pause':>8} {'k1':>9} {'k2':>9} {'k3':>9}")


def format_row(r: dict[str, Any]) -> str:
    served = ",".join(f"v{v}" for v in r["served_versions"])
    return (f"{r['step']:>4} {r['reward']:>6.3f} {served:>7} {r['kind']:>6} {_fmt_bytes(r['stored_bytes']):>9} "
            f"{100 * r['ratio']:>5.1f}% {r['publish_s']:>7.3f}s {r['hotload_s']:>7.3f}s {r['pause_ms']:>6.2f}ms "
            f"{r['k1']:>9.2e} {r['k2']:>9.2e} {r['k3']:>9.2e}")


def run_demo(cfg: DemoConfig) -> dict[str, Any]:
    """Run the whole loop; returns (and writes under ``cfg.report_dir``) the rows and the summary."""
    from loader.client import RolloutClient
    from loader.engine import load_model
    from publisher import Publisher

    t_start = time.perf_counter()
    say = (lambda *a: None) if cfg.quiet else (lambda *a: print(*a, flush=True))
    if cfg.model_size not in MODEL_SIZES:
        raise ValueError(f"--model-size {cfg.model_size!r}: expected one of {sorted(MODEL_SIZES)}")
    if cfg.group_size < 2:
        raise ValueError("--group-size must be at least 2 (advantages are relative to the group)")
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    task = cfg.task
    run_name = cfg.run_name or f"demo-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}"
    remote = "://" in cfg.bucket and not cfg.bucket.startswith("file://")
    run_url = f"{cfg.bucket.rstrip('/')}/{run_name}" if remote else os.path.abspath(os.path.join(cfg.bucket, run_name))
    os.makedirs(cfg.report_dir, exist_ok=True)

    # 1. a policy with something left to learn
    tokenizer = build_tokenizer()
    master = build_model(len(tokenizer), cfg.model_size, seed=cfg.seed)
    n_params = sum(p.numel() for p in master.parameters())
    say(f"pre-training a {cfg.model_size} Llama ({n_params / 1e3:.0f}k parameters, bf16 {_fmt_bytes(2 * n_params)}) "
        f"on noisy addition for {cfg.pretrain_steps} steps ...")
    pre = pretrain(master, tokenizer, task, steps=cfg.pretrain_steps, seed=cfg.seed)

    rows: list[dict[str, Any]] = []
    replica = None
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
            say(f"published v{first.version} ({first.kind}, {_fmt_bytes(first.stored_bytes)}) to {run_url}")
            replica = Replica(run_url, port=cfg.port or free_port(), replica_id="demo-0", threads=cfg.threads,
                              log_path=os.path.join(cfg.report_dir, "demo-replica.log"),
                              storage_options=cfg.storage_options)
            say(f"replica demo-0 serving v{replica.status['policy_version']} on {replica.url} "
                f"(started in {replica.startup_s:.1f}s)\n")
            say(HEADER)
            rng = random.Random(cfg.seed + 1)
            version = first.version
            with RolloutClient([replica.url], ready_timeout=120.0) as client:
                for step in range(1, cfg.steps + 1):
                    row = _one_step(cfg, task, tokenizer, trainer, pub, client, rng, step, version)
                    version = row["published_version"]
                    rows.append(row)
                    say(format_row(row))
        finally:
            if replica is not None:
                replica.close()
            pub.close()
    summary = summarize(rows, pre, first, cfg, run_url, time.perf_counter() - t_start, replica.startup_s)
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
    rep = job.get("report") or {}
    served = sorted({v for ed in engine_data for v in ed["policy_versions"]})
    return {
        "step": step, "reward": sum(s.reward for s in samples) / len(samples), "samples": len(samples),
        "expected_version": version, "served_versions": served,
        "served_ok": served == [version] and all(s.version == version for s in samples),
        "published_version": res.version, "kind": res.kind, "stored_bytes": res.stored_bytes,
        "full_bytes": res.full_bytes, "ratio": res.ratio, "changed_tensors": res.n_changed_tensors,
        "publish_s": res.total_s, "copy_s": res.copy_s, "encode_s": res.encode_s, "upload_s": res.upload_s,
        "commit_s": res.commit_s, "hotload_s": float(job.get("duration_s") or 0.0),
        "hotload_wall_s": t4 - t3, "fetch_s": float(rep.get("fetch_s") or 0.0),
        "decode_s": float(rep.get("decode_s") or 0.0), "apply_s": float(rep.get("apply_s") or 0.0),
        "pause_ms": 1000 * float(rep.get("pause_s") or 0.0), "bytes_fetched": int(rep.get("bytes_fetched") or 0),
        "elements_changed": int(rep.get("elements_changed") or 0), "update_s": t4 - t2,
        "rollout_s": t1 - t0, "train_s": t2 - t1, "step_s": t4 - t0,
        **{k: stats[k] for k in ("k1", "k2", "k3", "max_abs_diff", "loss", "tokens", "trained_tokens",
                                  "clipped_tokens")},
    }


# --- summary and report -----------------------------------------------------------------------

def summarize(rows: list[dict], pre: dict, first: Any, cfg: DemoConfig, run_url: str, wall_s: float,
              startup_s: float) -> dict[str, Any]:
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
        "wall_s": wall_s, "pretrain_s": pre["seconds"], "replica_startup_s": startup_s, "run_url": run_url,
    }


def format_summary(s: dict[str, Any], report_dir: str) -> str:
    lines = [
        f"reward: {s['reward_first']:.3f} (mean of the first {s['window']} steps) -> {s['reward_last']:.3f} "
        f"(last {s['window']})" + ("" if s["reward_rose"] else "  [did not rise]"),
        f"published: {s['snapshots']} snapshots ({s['anchors']} anchors), {_fmt_bytes(s['stored_bytes'])} in all vs "
        f"{_fmt_bytes(s['full_bytes'])} as full checkpoints ({100 * s['stored_ratio']:.1f}%)"
        + (f"; median delta {100 * s['delta_ratio_median']:.1f}% of full" if s["delta_ratio_median"] else ""),
        f"latency (median): publish {s['publish_s_median']:.3f}s, hot-load {s['hotload_s_median']:.3f}s, "
        f"pause {s['pause_ms_median']:.2f}ms; publish() to replica swapped {s['update_s_median']:.3f}s",
        f"sampler/trainer divergence: max |k| {s['k_max']:.2e}, max |logp diff| {s['max_abs_diff']:.2e}"
        + (" (bit-exact)" if s["max_abs_diff"] == 0 else ""),
        "every step's rollouts were served by the version published before it: "
        + ("yes" if s["all_served_by_previous_version"] else "NO"),
        f"wall time {s['wall_s']:.1f}s (pre-train {s['pretrain_s']:.1f}s, replica start {s['replica_startup_s']:.1f}s)",
        f"report: {os.path.join(report_dir, 'demo.json')}, {os.path.join(report_dir, 'demo.png')}",
    ]
    return "\n".join(lines)


def write_report(report: dict[str, Any], report_dir: str) -> None:
    with open(os.path.join(report_dir, "demo.json"), "w") as f:
        json.dump(report, f, indent=1)
    plot(report["rows"], os.path.join(report_dir, "demo.png"))


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from matplotlib.ticker import MaxNLocator

    steps = [r["step"] for r in rows]
    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
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
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# --- command line ------------------------------------------------------------------------------

def parse_args(argv: list[str] | None = None) -> DemoConfig:
    d = DemoConfig()
    p = argparse.ArgumentParser(prog="python -m benchmarks.demo", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bucket", default=d.bucket, help=f"where runs go: a local dir (default {d.bucket}), s3://, gs://")
    p.add_argument("--run-name", default=None, help="the run's prefix under the bucket (default demo-<UTC time>)")
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
    p.add_argument("--score-with", choices=SCORE_WITH, default=d.score_with,
                   help="'master': score with the fp32 masters, not the published bf16 (shows nonzero divergence)")
    p.add_argument("--quiet", action="store_true")
    a = p.parse_args(argv)
    return DemoConfig(bucket=a.bucket, run_name=a.run_name, storage_options=a.storage_options, steps=a.steps,
                      model_size=a.model_size, group_size=a.group_size, prompts_per_step=a.prompts, lr=a.lr,
                      pretrain_steps=a.pretrain_steps, anchor_every=a.anchor_every, port=a.port, seed=a.seed,
                      threads=a.threads, report_dir=a.report_dir, score_with=a.score_with, quiet=a.quiet)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # save/load bars of a 400 KB model would break up the table
    cfg = parse_args(argv)
    report = run_demo(cfg)
    s = report["summary"]
    return 0 if s["all_served_by_previous_version"] else 1


if __name__ == "__main__":
    sys.exit(main())
