"""One rank of a two-process HF Trainer run (DDP on gloo, on the CPU) with a PublishCallback, as
tests/integrations/test_several_processes.py starts it under torchrun:

    python -m torch.distributed.run --standalone --nproc_per_node 2 ddp_trainer.py CASE LM_DIR URL OUT_DIR

CASE is the set-up a user would write: ``replicated`` (a full model, ``Publisher(url)`` on every rank),
``partition`` (the same, the Publisher built with a partition of the names), ``lora`` (a peft model,
``Publisher(url, distributed=False)`` on rank 0 and ``PublishCallback(None)`` on the other rank) and
``lora-distributed`` (a peft model with ``Publisher(url)`` on every rank, which cannot publish an adapter).
Each rank writes OUT_DIR/rank<N>.json: the callback's results, the version ``published_version()`` gave it after
every step (what FleetRollout asks for on every rank), and the error training raised, if any; rank 0 also writes
the weights it trained (the adapter, for a peft model) to OUT_DIR/trained.safetensors."""

from __future__ import annotations

import json
import os
import sys
import zlib

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

from ckptdelta import Publisher, PublishCallback


class AskVersions(TrainerCallback):
    """After each step (and the callback's publish of it), the version a rollout on this rank would be pinned to."""

    def __init__(self, callback: PublishCallback) -> None:
        self.callback, self.seen = callback, []

    def on_step_end(self, args, state, control, **kwargs):
        self.seen.append(self.callback.published_version())


def main(case: str, lm_dir: str, url: str, out: str) -> None:
    args = TrainingArguments(output_dir=os.path.join(out, "trainer"), max_steps=2, per_device_train_batch_size=2,
                             learning_rate=1e-2, report_to="none", save_strategy="no", use_cpu=True,
                             disable_tqdm=True, ddp_backend="gloo", dataloader_num_workers=0, logging_strategy="no",
                             seed=0)
    rank, world = args.process_index, args.world_size      # brings torch.distributed up (gloo)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(lm_dir, dtype=torch.float32)
    if case.startswith("lora"):
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    if case == "replicated":
        publisher = Publisher(url, extra_files=lm_dir, progress=False, collective_timeout=60,
                              anchor_chain_fraction=100.0)      # deltas after the first anchor, whatever their size
    elif case == "partition":
        publisher = Publisher(url, extra_files=lm_dir, progress=False, collective_timeout=60,
                              anchor_chain_fraction=100.0,
                              partition=lambda name: zlib.crc32(name.encode()) % world == rank)
    elif case == "lora":
        publisher = Publisher(url, progress=False, distributed=False) if rank == 0 else None
    elif case == "lora-distributed":
        publisher = Publisher(url, progress=False, collective_timeout=60)
    else:
        raise SystemExit(f"unknown case {case!r}")
    callback = PublishCallback(publisher)
    asked = AskVersions(callback)
    ids = list(range(3, 19))
    trainer = Trainer(model=model, args=args, train_dataset=[{"input_ids": ids, "labels": ids}] * 8,
                      callbacks=[callback, asked])
    error = None
    try:
        trainer.train()
    except Exception as e:  # noqa: BLE001 - what the test checks
        error = [type(e).__name__, str(e)]
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"results": [[r.version, r.step, r.kind] for r in callback.results], "seen": asked.seen,
                   "error": error}, f)
    if rank == 0 and error is None:
        if case.startswith("lora"):
            from peft import get_peft_model_state_dict

            state = get_peft_model_state_dict(model)
        else:
            state = model.state_dict()
        save_file({k: v.detach().clone().contiguous() for k, v in state.items()},
                  os.path.join(out, "trained.safetensors"))


if __name__ == "__main__":
    try:
        main(*sys.argv[1:5])
    finally:            # as a training script ends: the process groups let go before the interpreter exits
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
