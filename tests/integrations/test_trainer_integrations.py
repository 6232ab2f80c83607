"""The trainer integrations (ckptdelta/integrations/) inside the real libraries' own loops: TRL's GRPOTrainer on
the tiny LM on the CPU with PublishCallback and FleetRollout against a real reference-engine replica over HTTP,
serving from a local-directory bucket; the HF Trainer with a publish that fails in the background."""

from __future__ import annotations

import logging
import os
import threading

import pytest
import torch

from ckptdelta.delta.errors import PublishError, RunMismatchError, StorageError
from ckptdelta.delta.pieces import tensor_digest
from ckptdelta.loader import SnapshotReader
from ckptdelta.publisher import Publisher
from ckptdelta.publisher.runs import committed_versions
from tests.lm import hf_extra_files
from tests.replicas import LiveServer, lm_dir, state_bits_equal  # noqa: F401

PROMPTS = ["hello world", "The quick brown fox", "1 2 3 4", "A policy is published"]


def _policy(lm_dir: str) -> torch.nn.Module:
    """The tiny LM in fp32, trained as it is published (the anchors carry its own config)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(lm_dir, dtype=torch.float32)


def _publisher(url: str, lm_dir: str) -> Publisher:
    tokenizer_files = {k: v for k, v in hf_extra_files(lm_dir).items() if k != "config.json"}
    return Publisher(url, extra_files=tokenizer_files, progress=False)


@pytest.mark.filterwarnings("ignore:TRL currently supports vLLM versions")     # vLLM's CPU lock is newer; unused
def test_grpo_trains_on_rollouts_sampled_from_a_replica_at_each_version_the_callback_just_published(
        lm_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from ckptdelta import FleetRollout, PublishCallback
    from ckptdelta.loader.engines import reference
    from ckptdelta.loader.server import create_app

    model, tokenizer = _policy(lm_dir), AutoTokenizer.from_pretrained(lm_dir)
    url = str(tmp_path / "run")
    publisher = _publisher(url, lm_dir)
    publisher.publish(model, 0)                 # the anchor the replica starts on (`ckptdelta serve` needs one)
    replica = reference.build(bucket=url, snapshot=0)
    seen: list[tuple[int, list[int]]] = []      # (the trainer's step, each completion's policy_version)

    def reward(completions, completion_ids, policy_version, trainer_state, **kwargs):
        seen.append((trainer_state.global_step, list(policy_version)))
        # the mean token id: four completions of a prompt tie on it only if they are the same, so every group's
        # advantages are nonzero and the policy moves (a count of distinct tokens tied at 8 in ~1 run in 8)
        return [sum(ids) / len(ids) for ids in completion_ids]

    with LiveServer(create_app(replica, replica_id="grpo-0")) as server:
        callback = PublishCallback(publisher)                          # every step, asynchronous
        rollout = FleetRollout(callback, server.url, ready_timeout=600, hotload_timeout=600)
        args = GRPOConfig(output_dir=str(tmp_path / "out"), max_steps=3, per_device_train_batch_size=8,
                          num_generations=4, max_completion_length=8, learning_rate=5e-3, report_to="none",
                          save_strategy="no", use_cpu=True, bf16=False, seed=0, logging_steps=1,
                          disable_tqdm=True, dataloader_num_workers=0)
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, processing_class=tokenizer,
                              train_dataset=Dataset.from_dict({"prompt": PROMPTS}), callbacks=[callback],
                              rollout_func=rollout)
        trainer.train()

        # one publish at train begin, one per optimizer step; the publisher is closed at train end
        published = [r.version for r in callback.results]
        assert published == [1, 2, 3, 4] and [r.step for r in callback.results] == [0, 1, 2, 3]
        # every rollout asked for the version published just before it, and every completion ran on it
        assert [(h.step, h.version, h.policy_versions, h.completions) for h in rollout.history] == [
            (0, 1, (1,), 8), (1, 2, (2,), 8), (2, 3, (3,), 8)]
        assert [(step, set(vs), len(vs)) for step, vs in seen] == [(0, {1}, 8), (1, {2}, 8), (2, {3}, 8)]

        # prompts become the token ids TRL's own generation makes of them (text, and chat through the template)
        from ckptdelta.integrations.trl import prompt_ids
        chats = [[{"role": "user", "content": p}] for p in PROMPTS]
        for prompts in (PROMPTS, chats):
            assert prompt_ids(prompts, trainer) == [list(ids) for ids in trainer._tokenize_prompts(prompts)[0]]

        # the replica serves the published bits: hot-loaded to the last version, its live weights are the
        # trainer's, and each has the digest the snapshot's manifest gives it; the snapshot's chain verifies
        from ckptdelta.loader.client import RolloutClient
        with RolloutClient([server.url]) as fleet:
            fleet.hotload(4, wait=True, timeout=600)
        trained = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
        assert state_bits_equal(replica.engine.model, trained) == []
        live = replica.engine.model.state_dict()
        reader = SnapshotReader(url)
        manifest = reader.manifest(4)
        assert {n: tensor_digest(e.pieces, live[n].detach()) for n, e in manifest.tensors.items()} == \
            {n: e.xxh3 for n, e in manifest.tensors.items()}
        reader.verify(4)
        assert state_bits_equal(replica.engine.model, reader.read_tensors(0)) != []      # it did train

        # a replica serving another run than the trainer's cannot serve its versions: refused, not hot-loaded
        other = PublishCallback(_publisher(str(tmp_path / "other"), lm_dir))
        other.on_train_begin(args, trainer.state, trainer.control, model=trainer.model)
        with pytest.raises(RunMismatchError, match=f"replica {server.url} serves run {publisher.run_id}"):
            FleetRollout(other, server.url)(PROMPTS, trainer)
        other.publisher.close()
        assert replica.version == 4

        # another process of the trainer (world size > 1) does not hot-load: its requests' floor waits for the
        # main process's hot-load as long as that may take (ready_timeout + hotload_timeout), not ready_timeout
        with RolloutClient([server.url]) as fleet:
            fleet.hotload(3, wait=True, timeout=600)      # the replica a version behind the trainer's
        monkeypatch.setattr(trainer, "is_world_process_zero", lambda: False)
        main_process = threading.Timer(2.0, lambda: RolloutClient([server.url]).hotload(4, wait=True, timeout=600))
        main_process.start()
        try:
            out = FleetRollout(callback, server.url, ready_timeout=0.5, hotload_timeout=60)(PROMPTS, trainer)
        finally:
            main_process.join()
        assert set(out["policy_version"]) == {4} and len(out["completion_ids"]) == len(PROMPTS)


def _hf_trainer(model: torch.nn.Module, out: str, callback, max_steps: int, save_steps: int | None = None):
    from transformers import Trainer, TrainingArguments

    ids = list(range(3, 19))
    data = [{"input_ids": ids, "labels": ids}] * 8
    saving = {"save_strategy": "no"} if save_steps is None else {"save_strategy": "steps", "save_steps": save_steps}
    args = TrainingArguments(output_dir=out, max_steps=max_steps, per_device_train_batch_size=2, learning_rate=1e-2,
                             report_to="none", use_cpu=True, disable_tqdm=True, dataloader_num_workers=0,
                             logging_strategy="no", seed=0, **saving)
    return Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])


@pytest.mark.parametrize("max_steps, raised_at", [(3, 2), (1, 1)], ids=["at-the-next-step", "at-train-end"])
def test_a_publish_that_fails_in_the_background_raises_into_the_training_loop_naming_its_step_and_version(
        lm_dir, tmp_path, max_steps, raised_at):
    from ckptdelta import PublishCallback

    url = str(tmp_path / "run")
    publisher = _publisher(url, lm_dir)
    real = publisher.store.put_file

    def outage(key, path):              # deltas cannot be written (the train-begin anchor can)
        if key.startswith("deltas/"):
            raise StorageError(f"simulated outage writing {key}")
        return real(key, path)

    publisher.store.put_file = outage
    trainer = _hf_trainer(_policy(lm_dir), str(tmp_path / "out"), PublishCallback(publisher), max_steps)
    with pytest.raises(PublishError, match=r"step 1 \(version 1\) of run .* was not published: StorageError: "
                                           r"simulated outage") as info:
        trainer.train()
    assert isinstance(info.value.__cause__, StorageError)
    assert trainer.state.global_step == raised_at          # the step after the failed one ended, or training did
    assert committed_versions(publisher.store) == [0]
    publisher.close()      # the failure was reported once, by the callback: the publisher does not raise it again



def test_a_peft_models_adapter_is_what_the_callback_publishes_as_a_lora_run(lm_dir, tmp_path):
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict

    from ckptdelta import PublishCallback

    url = str(tmp_path / "run")
    callback = PublishCallback(Publisher(url, progress=False), every=2)
    model = get_peft_model(_policy(lm_dir), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    trainer = _hf_trainer(model, str(tmp_path / "out"), callback, 3)
    trainer.train()
    # train begin, step 2, and train end (step 3, the final weights: not a multiple of every=2)
    assert [(r.version, r.step) for r in callback.results] == [(0, 0), (1, 2), (2, 3)]
    reader = SnapshotReader(url)
    assert reader.manifest(2).adapter is not None
    adapter = get_peft_model_state_dict(model)        # the trained adapter, bit for bit
    assert set(reader.manifest(2).tensors) == set(adapter)
    published = reader.read_tensors(2)
    assert all(torch.equal(published[k].view(torch.uint8), v.detach().contiguous().view(torch.uint8))
               for k, v in adapter.items())


def test_a_run_resumed_below_its_last_published_step_publishes_the_weights_it_resumed_with(lm_dir, tmp_path,
                                                                                          caplog):
    """A job died after publishing step 3; its newest checkpoint is step 2. The resumed Trainer starts at step 2,
    below the run's last step, which a run's step labels may not go back to; and its weights are the ones
    published at steps above 2 only if training is deterministic. So replicas must get the weights the trainer
    resumed with, not keep the abandoned step 3's: the callback publishes them labelled with the run's last step
    (the trainer's own step in the metadata, a warning naming both), then goes on at the trainer's steps."""
    from safetensors.torch import load_file

    from ckptdelta import PublishCallback
    from ckptdelta.integrations.hf import TRAINER_STEP_KEY

    url, out = str(tmp_path / "run"), str(tmp_path / "out")
    first = PublishCallback(_publisher(url, lm_dir))
    _hf_trainer(_policy(lm_dir), out, first, 3, save_steps=2).train()
    assert [(r.version, r.step) for r in first.results] == [(0, 0), (1, 1), (2, 2), (3, 3)]

    resumed = PublishCallback(_publisher(url, lm_dir))
    with caplog.at_level(logging.WARNING, logger="ckptdelta.integrations"):
        _hf_trainer(_policy(lm_dir), out, resumed, 5, save_steps=2).train(
            resume_from_checkpoint=os.path.join(out, "checkpoint-2"))
    assert [(r.version, r.step) for r in resumed.results] == [(4, 3), (5, 3), (6, 4), (7, 5)]
    assert any("resumed at step 2, below the run's last published step 3" in m for m in caplog.messages)
    reader = SnapshotReader(url)
    assert reader.manifest(4).metadata == {TRAINER_STEP_KEY: "2"} and reader.manifest(5).metadata == {}
    # version 4 is the checkpoint the trainer resumed from, bit for bit: the first session's step 2, not its step 3
    checkpoint = load_file(os.path.join(out, "checkpoint-2", "model.safetensors"))
    v4 = reader.read_tensors(4)
    assert set(v4) == set(checkpoint)
    assert all(torch.equal(v4[n].view(torch.uint8), checkpoint[n].view(torch.uint8)) for n in v4)
    assert state_bits_equal(_loaded(lm_dir, reader.read_tensors(2)), v4) == []
    assert state_bits_equal(_loaded(lm_dir, reader.read_tensors(3)), v4) != []


def _loaded(lm_dir: str, tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    model = _policy(lm_dir)
    model.load_state_dict(tensors, strict=False)
    return model


def test_a_publish_refused_in_the_call_raises_as_a_publish_error_naming_its_step_and_version(lm_dir, tmp_path):
    """A publish the Publisher refuses at once (here a persistent complex buffer, a dtype the format has no
    exact bytes for) must reach the user as the documented PublishError naming the step and version that were
    not published, its cause the Publisher's own error, like a failure in the background."""
    from ckptdelta import PublishCallback
    from ckptdelta.delta.errors import PublishInputError

    model = _policy(lm_dir)
    model.register_buffer("freqs_cis", torch.ones(4, dtype=torch.complex64))     # Meta Llama's rotary table
    publisher = _publisher(str(tmp_path / "run"), lm_dir)
    trainer = _hf_trainer(model, str(tmp_path / "out"), PublishCallback(publisher), 2)
    with pytest.raises(PublishError, match=r"^step 0 \(version 0\) of run .* was not published: PublishInputError: "
                                           r"tensor 'freqs_cis'") as info:
        trainer.train()
    assert isinstance(info.value.__cause__, PublishInputError)
    assert trainer.state.global_step == 0 and committed_versions(publisher.store) == []


class _Calculator:
    """An environment of TRL's environment_factory: its public methods are tools."""

    def reset(self, **kwargs):
        return None

    def add(self, a: int, b: int) -> int:
        """Add two numbers.

        Args:
            a: The first number.
            b: The second number.
        """
        return a + b


def _add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


@pytest.mark.filterwarnings("ignore:TRL currently supports vLLM versions")
@pytest.mark.parametrize("given", ["tools", "environment_factory"])
def test_fleet_rollout_refuses_a_trainer_with_tools_whose_post_tool_turns_trl_generates_locally(
        lm_dir, tmp_path, monkeypatch, given):
    """TRL runs tool calls after rollout_func returns and generates what follows each call with the trainer's own
    model (GRPOTrainer._tool_call_loop -> _generate_single_turn), not the replicas: those tokens would carry a
    policy_version and logprobs they did not come from. FleetRollout refuses such a trainer at its first rollout,
    before hot-loading or sampling anything."""
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen3_chat_template

    from ckptdelta import FleetRollout, PublishCallback

    tokenizer = AutoTokenizer.from_pretrained(lm_dir)
    tokenizer.chat_template = qwen3_chat_template       # a template TRL can render and parse tool calls with
    callback = PublishCallback(_publisher(str(tmp_path / "run"), lm_dir))
    rollout = FleetRollout(callback, "http://127.0.0.1:9")          # never reached
    args = GRPOConfig(output_dir=str(tmp_path / "out"), max_steps=1, per_device_train_batch_size=4,
                      num_generations=4, max_completion_length=4, report_to="none", save_strategy="no",
                      use_cpu=True, bf16=False, disable_tqdm=True, dataloader_num_workers=0)
    extra = {"tools": [_add]} if given == "tools" else {"environment_factory": _Calculator}
    trainer = GRPOTrainer(model=_policy(lm_dir), reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                          args=args, processing_class=tokenizer, callbacks=[callback], rollout_func=rollout,
                          train_dataset=Dataset.from_dict({"prompt": [[{"role": "user", "content": "1+1?"}]] * 4}),
                          **extra)
    with pytest.raises(ValueError, match=f"FleetRollout: the trainer was given .*{given.split('_')[0]}.*not come "
                                         "from the replicas"):
        trainer.train()
    assert rollout.history == []
