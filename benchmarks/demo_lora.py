"""``make demo-lora``: the RL loop of ``make demo`` training a LoRA adapter, shipped to vLLM's LoRA slots as deltas.

The loop most RL users copy (Loops / Tinker style) trains an adapter on a frozen
base, not the whole model. This is that loop on ckptdelta, end to end, with the
pieces of benchmarks/demo.py (task, pre-train, replica process, PPO step, rows,
summary, plot):

1. the demo's tiny Llama is pre-trained on noisy addition and saved in bf16 as an
   HF directory: the *frozen base*, the very directory the replica serves
   (``ckptdelta serve --engine vllm --base-model DIR``: vLLM on the base with
   ``--enable-lora`` and K adapter slots; ``--engine reference``: peft on the
   built-in decode loop). The trainer loads it the way the replica does and puts a
   peft LoRA adapter (rank ``--rank`` on every linear layer, fp32, B = 0) on it;
   the adapter is published as the run's anchor, a PEFT directory whose manifest
   records the base (its name and the digest of its weights);
2. each step samples GRPO groups with the asyncio client
   (:class:`ckptdelta.loader.async_client.AsyncRolloutClient`: one ``sample_async`` per
   prompt, ``n`` = the group size, fanned out with ``asyncio.gather``) at
   ``min_policy_version`` = the version published last, scores the rewards,
   normalises advantages within each group and takes one PPO step on the adapter
   alone (the base stays frozen); the trainer's peft model scores the sampled
   tokens against the replica's logprobs: k1/k2/k3, exactly 0 on the reference
   engine (same bits, same peft modules, same scoring function), small and not 0
   on vLLM (its LoRA kernels are not the trainer's);
3. the adapter is published (a delta of the adapter; it is all that moves) and
   hot-loaded: on vLLM it is written into a free LoRA slot through vLLM's own load
   transform, every worker reads the slot back against a fresh transform of the
   verified tensors, and only then do new requests go there. The demo reads that
   proof from ``/v1/status`` (``engine.last_swap``: ``proven: "full"``, each
   worker's checked buffers, and ``pause_s``, how long vLLM's engine loop was held
   by the write) and checks that the trainer's adapter is, bit for bit, the
   version the replica proved (its xxh3 digests against the manifest's).

One line per step, then a summary; ``.ckptdelta/report/`` gets ``demo-lora.json``
and ``demo-lora.png`` (reward, bytes per step, publish/hot-load/pause, k1/k2/k3).

    python -m benchmarks.demo_lora [--engine vllm|reference] [--bucket DIR|s3://...|gs://...] [--steps N]
                                   [--rank R] [--alpha A] [--lora-slots K] [--lr LR] [--group-size G] ...
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from benchmarks.demo import (EXACT_NOTE, HEADER, DemoConfig, Replica, Trainer, config_from, format_row,
                             format_summary, free_port, groups_of, parser, pretrained, run_url_of, sample_kwargs,
                             step_row, summarize, write_report)
from benchmarks.harness import nbytes
from benchmarks.rl_task import greedy_accuracy, save_model_dir

log = logging.getLogger("ckptdelta.demo")

NAME = "demo-lora"     # the report's files, the replica's log and the run's default prefix


@dataclass
class LoraDemoConfig(DemoConfig):
    """A LoRA demo run; the defaults are ``make demo-lora``."""

    steps: int = 16
    lr: float = 2e-3                     # LoRA's B starts at zero: an adapter needs ~10x a full model's rate
    rank: int = 8                        # vLLM's --max-lora-rank takes 1, 8, 16, 32, 64, ...
    alpha: int = 16
    lora_slots: int = 3                  # vLLM's adapter slots (ckptdelta serve --lora-slots)


class LoraTrainer(Trainer):
    """PPO on the adapter alone: its fp32 LoRA parameters are what AdamW updates, what scores the tokens and
    what is published; the bf16 base under them is frozen.

    There are no separate masters: ``master`` and ``policy`` are the same peft-injected transformers model (the
    one the reference replica runs), so :meth:`Trainer.step`'s copy of gradients to the masters is the identity
    and its sync has nothing to round."""

    def __init__(self, model: Any, *, lr: float, clip: float):
        self.model = model.eval()                       # the PeftModel: what is published
        self.master = self.policy = model.get_base_model()
        self.clip, self.score_with = clip, "published"
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(self.params, lr=lr, betas=(0.9, 0.99), weight_decay=0.0)

    def _sync(self) -> None:
        pass

    def adapter(self) -> dict[str, torch.Tensor]:
        """The adapter as peft saves it (and the Publisher publishes it): saved name -> tensor."""
        from peft import get_peft_model_state_dict

        return {k: v.detach() for k, v in get_peft_model_state_dict(self.model).items()}


def lora_model(base_dir: str, cfg: LoraDemoConfig) -> Any:
    """The trainer's peft model on the base loaded as the replica loads it (:func:`ckptdelta.loader.hf_model.load_model`:
    a base of other bits, e.g. a bf16 rotary buffer, would score tokens differently and hash differently)."""
    from peft import LoraConfig, get_peft_model

    from ckptdelta.loader.hf_model import load_model

    base, _ = load_model(base_dir)
    torch.manual_seed(cfg.seed)
    return get_peft_model(base, LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, target_modules="all-linear",
                                           lora_dropout=0.0))


def adapter_digests(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """xxh3 of each tensor's bits, as a manifest records them."""
    import xxhash

    from ckptdelta.delta import dtypes

    return {n: f"{xxhash.xxh3_64_intdigest(dtypes.host_bits(t.cpu().contiguous())):016x}" for n, t in tensors.items()}


def published_as_trained(reader: Any, version: int, trainer: LoraTrainer) -> bool:
    """Whether snapshot ``version`` holds exactly the trainer's adapter (names, and each tensor's xxh3)."""
    m = reader.manifest(version)
    return adapter_digests(trainer.adapter()) == {n: t.xxh3 for n, t in m.tensors.items()}


def lora_proof(cfg: DemoConfig, status: dict[str, Any], version: int) -> dict[str, Any]:
    """What the replica itself says about the slot it wrote ``version`` into.

    vLLM: ``/v1/status`` -> ``engine.last_swap``, written by ``LoraSlotApplier.apply``
    once every worker read the slot back and found, buffer by buffer, what vLLM's
    own ``set_lora`` writes for the verified tensors (``proven: "full"``; a mismatch
    fails the hot-load and keeps the slot out of service). Reference: the live
    adapter is the host copy the swapper verified against the manifest's digests;
    there is no separate read-back (``None``)."""
    if cfg.engine != "vllm":
        return {"replica_verified": None, "verified_tensors": 0, "verify_ms": 0.0, "slot": None}
    last = status.get("engine", {}).get("last_swap") or {}
    workers = last.get("workers") or []
    checked = [int(w.get("checked") or 0) for w in workers]
    ok = last.get("version") == version and last.get("proven") == "full" and bool(checked) and min(checked) > 0
    return {"replica_verified": bool(ok), "verified_tensors": sum(checked),
            "verify_ms": 1000 * max((float(w.get("prove_s") or 0.0) for w in workers), default=0.0),
            "slot": last.get("slot")}


async def _one_step(cfg: LoraDemoConfig, tokenizer: Any, trainer: LoraTrainer, pub: Any, reader: Any, client: Any,
                    rng: random.Random, step: int, version: int) -> dict[str, Any]:
    task = cfg.task
    t0 = time.perf_counter()
    problems = [task.problem(rng) for _ in range(cfg.prompts_per_step)]
    bodies = await asyncio.gather(*(client.sample_async(prompt, **sample_kwargs(cfg, task, version, step, i))
                                    for i, (prompt, _) in enumerate(problems)))
    groups = groups_of(task, tokenizer, problems, bodies)
    t1 = time.perf_counter()
    samples = [s for g in groups for s in g]
    stats = trainer.step(samples)
    t2 = time.perf_counter()
    res = pub.publish(trainer.model, step, wait=False).result()   # the adapter alone, copied, then encoded
    t3 = time.perf_counter()
    states = await client.hotload(res.version, wait=True, poll_interval=0.01)
    t4 = time.perf_counter()
    status = next(iter((await client.status()).values()))
    row = step_row(step, version, samples, [b["engine_data"] for b in bodies], stats, res,
                   next(iter(states.values())), lora_proof(cfg, status, res.version), (t0, t1, t2, t3, t4))
    row["published_as_trained"] = published_as_trained(reader, res.version, trainer)
    return row


async def _loop(cfg: LoraDemoConfig, tokenizer: Any, trainer: LoraTrainer, pub: Any, reader: Any, url: str,
                version: int, say: Any) -> list[dict[str, Any]]:
    from ckptdelta.loader.async_client import AsyncRolloutClient

    rows: list[dict[str, Any]] = []
    rng = random.Random(cfg.seed + 1)
    async with AsyncRolloutClient([url], ready_timeout=120.0) as client:
        for step in range(1, cfg.steps + 1):
            row = await _one_step(cfg, tokenizer, trainer, pub, reader, client, rng, step, version)
            version = row["published_version"]
            rows.append(row)
            say(format_row(row))
    return rows


def run_lora_demo(cfg: LoraDemoConfig) -> dict[str, Any]:
    """Run the whole loop; returns (and writes under ``cfg.report_dir``) the rows and the summary."""
    from ckptdelta.loader.reader import SnapshotReader
    from ckptdelta.publisher import Publisher

    t_start = time.perf_counter()
    say = (lambda *a: None) if cfg.quiet else (lambda *a: print(*a, flush=True))
    if cfg.score_with != "published":
        raise ValueError("a LoRA run has no fp32 masters to score with: score_with must be 'published'")
    if cfg.group_size < 2:
        raise ValueError("--group-size must be at least 2 (advantages are relative to the group)")
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    run_url = run_url_of(cfg, NAME)
    os.makedirs(cfg.report_dir, exist_ok=True)
    tokenizer, master, pre = pretrained(cfg, say)

    rows: list[dict[str, Any]] = []
    replica = None
    with tempfile.TemporaryDirectory(prefix="ckptdelta-demo-lora-") as tmp:
        # the frozen base: the bf16 HF directory the replica serves and the trainer loads its base from
        base_dir = os.path.join(tmp, "base")
        save_model_dir(master.to(torch.bfloat16), tokenizer, base_dir)
        base_bytes = sum(p.numel() * p.element_size() for p in master.parameters())
        del master
        trainer = LoraTrainer(lora_model(base_dir, cfg), lr=cfg.lr, clip=cfg.clip)
        pre["greedy_accuracy"] = greedy_accuracy(trainer.policy, tokenizer, cfg.task, n=100)
        n_lora = sum(p.numel() for p in trainer.params)
        say(f"  loss {pre['loss']:.3f} in {pre['seconds']:.1f}s; greedy accuracy of the bf16 base "
            f"{pre['greedy_accuracy']:.2f}; LoRA rank {cfg.rank} (alpha {cfg.alpha}) on every linear layer: "
            f"{n_lora / 1e3:.1f}k fp32 parameters ({nbytes(4 * n_lora)}), the base frozen")
        pub = Publisher(run_url, storage_options=cfg.storage_options, anchor_every=cfg.anchor_every, progress=False)
        reader = SnapshotReader(run_url, storage_options=cfg.storage_options)
        try:
            first = pub.publish(trainer.model, 0)
            say(f"published v{first.version} (the adapter's anchor, a PEFT directory, "
                f"{nbytes(first.stored_bytes)}) to {run_url}")
            serve = ("--base-model", base_dir, "--lora-slots", str(cfg.lora_slots))
            say(f"starting replica {NAME}-0: ckptdelta serve --engine {cfg.engine} --base-model BASE"
                + (f" --lora-slots {cfg.lora_slots} -- {' '.join(cfg.vllm_args)}" if cfg.engine == "vllm" else "")
                + " ...")
            replica = Replica(run_url, port=cfg.port or free_port(), replica_id=f"{NAME}-0", threads=cfg.threads,
                              log_path=os.path.join(cfg.report_dir, f"{NAME}-replica.log"),
                              storage_options=cfg.storage_options, engine=cfg.engine, vllm_args=cfg.vllm_args,
                              serve_args=serve if cfg.engine == "vllm" else serve[:2])
            say(f"replica {NAME}-0 ({cfg.engine}) serving adapter v{replica.status['policy_version']} on "
                f"{replica.url} (started in {replica.startup_s:.1f}s)\n")
            say(HEADER)
            say(f"bytes, ratio: the adapter's delta, against the whole fp32 adapter ({nbytes(first.full_bytes)}); "
                f"the bf16 base ({nbytes(base_bytes)}) never moves")
            say(EXACT_NOTE_LORA[cfg.engine])
            rows = asyncio.run(_loop(cfg, tokenizer, trainer, pub, reader, replica.url, first.version, say))
        finally:
            if replica is not None:
                replica.close()
            pub.close()
            reader.store.close()
    summary = summarize(rows, pre, first, cfg, run_url, time.perf_counter() - t_start, replica.startup_s)
    summary["published_as_trained_all"] = all(r["published_as_trained"] for r in rows)
    report = {"config": {k: v for k, v in asdict(cfg).items() if k != "storage_options"}, "run_url": run_url,
              "replica_url": replica.url, "pretrain": pre,
              "anchor": {"version": first.version, "stored_bytes": first.stored_bytes, "full_bytes": first.full_bytes},
              "rows": rows, "summary": summary}
    write_report(report, cfg.report_dir, NAME)
    say("\n" + format_summary(summary, cfg.report_dir, NAME, exact=_exact_lines))
    return report


#: printed under the header: what "exact" is
EXACT_NOTE_LORA = {
    "vllm": "exact: the replica's own check (every vLLM worker's read-back of the LoRA slot it wrote = what vLLM's "
            "own load of the verified adapter writes there, every buffer), from /v1/status engine.last_swap; "
            "pause: how long the write held vLLM's engine loop",
    "reference": EXACT_NOTE["reference"]}


def _exact_lines(s: dict[str, Any]) -> list[str]:
    lines = ["trainer's adapter = the published version, bit for bit (xxh3 of every tensor), every step: "
             + ("yes" if s["published_as_trained_all"] else "NO")]
    if s.get("engine") == "vllm":
        lines.append("each version written into a LoRA slot and proven there by the replica itself (every worker's "
                     "read-back = vLLM's own load of the verified adapter), every step: "
                     + ("yes" if s["replica_verified_all"] else "NO")
                     + f" ({s['replica_verified_tensors']} slot buffers compared in all; median proof "
                       f"{s['verify_ms_median']:.1f}ms)")
    return lines


def parse_args(argv: list[str] | None = None) -> LoraDemoConfig:
    d = LoraDemoConfig()
    p = parser(d, "python -m benchmarks.demo_lora", __doc__, score_with=False)
    p.add_argument("--rank", type=int, default=d.rank, help="LoRA rank (vLLM serves 1, 8, 16, 32, 64, ...)")
    p.add_argument("--alpha", type=int, default=d.alpha, help="LoRA alpha")
    p.add_argument("--lora-slots", type=int, default=d.lora_slots, help="vLLM's adapter slots (at least 2)")
    a = p.parse_args(argv)
    return dataclasses.replace(config_from(a, d), rank=a.rank, alpha=a.alpha, lora_slots=a.lora_slots)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    s = run_lora_demo(parse_args(argv))["summary"]
    ok = s["all_served_by_previous_version"] and s["published_as_trained_all"] and s["replica_verified_all"] is not False
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
