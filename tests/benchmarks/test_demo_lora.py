"""``make demo-lora`` (benchmarks/demo_lora.py): the demo's RL loop training a LoRA adapter on a frozen base.

In ``make test``: the demo's own pieces, in process and in a few seconds -- the
trainer moves the adapter and nothing else, the base it trains on hashes as the
directory the replica serves, what it publishes is its adapter bit for bit, the
reference replica's logprobs after a hot-load are the trainer's own scores (k = 0
exactly), and the proof the demo reads from vLLM's ``/v1/status`` is "yes" only
for the version just published, proven in full in every worker. End to end (a real
replica subprocess, real HTTP, the asyncio client, a real bucket) on the
reference engine and on vLLM: ``make stress`` (each ~1-3 minutes on 2 cores).
"""

from __future__ import annotations

import json
import math
import random

import httpx
import pytest
import torch

from benchmarks.demo import Sample
from benchmarks.demo_lora import (LoraDemoConfig, LoraTrainer, lora_model, lora_proof, published_as_trained,
                                  run_lora_demo)
from benchmarks.rl_task import EOS, AdditionTask, build_model, build_tokenizer, encode, save_model_dir
from ckptdelta.loader.engines.reference.model import SamplingParams
from ckptdelta.loader.hf_model import score_tokens
from ckptdelta.loader.engines.reference import lora as reference_lora
from ckptdelta.loader.reader import SnapshotReader
from ckptdelta.publisher import BaseModel, Publisher

FAST = dict(steps=3, prompts_per_step=6, group_size=4, pretrain_steps=60, quiet=True, engine="reference")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.uint8).clone()


def _samples(trainer: LoraTrainer, tokenizer, n: int = 4) -> list[Sample]:
    """A group per problem: the right answer (advantage +1) and a wrong one (-1), scored by the trainer itself
    as the behaviour policy, as a replica serving the trainer's bits would score them."""
    rng, task, out = random.Random(0), AdditionTask(), []
    for _ in range(n):
        prompt, answer = task.problem(rng)
        p = encode(tokenizer, prompt)
        for text, adv in ((answer, 1.0), (answer + "7", -1.0)):
            ids = encode(tokenizer, text) + [EOS]
            with torch.no_grad():
                old = score_tokens(trainer.policy, p + ids, len(p)).tolist()
            out.append(Sample(p, ids, old, reward=max(adv, 0.0), advantage=adv))
    return out


@pytest.fixture
def one_thread():
    """The demo's trainer runs on one torch thread (--threads 1); tiny forwards on two threads of a busy
    machine take ~5x longer."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_the_lora_trainer_moves_only_the_adapter_and_the_replica_scores_its_published_bits_as_it_does(
        tmp_path, one_thread):
    torch.manual_seed(0)
    tokenizer = build_tokenizer()
    base_dir = str(tmp_path / "base")
    save_model_dir(build_model(len(tokenizer), "tiny", seed=0).to(torch.bfloat16), tokenizer, base_dir)
    cfg = LoraDemoConfig(model_size="tiny", rank=8, alpha=16)
    trainer = LoraTrainer(lora_model(base_dir, cfg), lr=5e-3, clip=0.2)
    base_before = {n: _bits(p) for n, p in trainer.policy.named_parameters() if "lora_" not in n}
    assert base_before and all(p.dtype == torch.bfloat16 for n, p in trainer.policy.named_parameters()
                                if "lora_" not in n)
    assert trainer.params and all(p.dtype == torch.float32 for p in trainer.params)  # peft's fp32 adapter

    url = str(tmp_path / "run")
    with Publisher(url, progress=False) as pub:
        v0 = pub.publish(trainer.model, 0).version
        stats = trainer.step(_samples(trainer, tokenizer))
        v1 = pub.publish(trainer.model, 1).version
    # the behaviour policy was the trainer's own scores: no divergence, and an update that moved the adapter
    assert stats["k1"] == stats["k2"] == stats["k3"] == stats["max_abs_diff"] == 0.0 and stats["trained_tokens"] > 0
    assert {n: _bits(p) for n, p in trainer.policy.named_parameters() if "lora_" not in n}.keys() == base_before.keys()
    assert all(torch.equal(_bits(p), base_before[n]) for n, p in trainer.policy.named_parameters() if n in base_before)

    reader = SnapshotReader(url)
    try:
        m = reader.manifest(v1)
        # the base recorded is the directory the replica serves, hashed as the replica hashes it
        assert m.adapter.base_xxh3 == BaseModel.of(base_dir).xxh3
        assert published_as_trained(reader, v1, trainer)
        assert not published_as_trained(reader, v0, trainer)     # the step changed the bits: the check sees it
    finally:
        reader.store.close()

    replica = reference_lora.build(bucket=url, snapshot=v0, base_model=base_dir)
    replica.swapper.hotload(v1)
    prompt = encode(tokenizer, "12+7=")
    gen = replica.engine.generate(prompt, SamplingParams(max_tokens=4, n=4, seed=5, logprobs=0, score_logprobs=True))
    for c in gen.completions:
        with torch.no_grad():
            ours = score_tokens(trainer.policy, prompt + c.token_ids, len(prompt))
        assert torch.equal(torch.tensor(c.logprobs, dtype=torch.float32), ours)      # k1 = k2 = k3 = 0, exactly


def _status(version, proven="full", checked=(32,)):
    return {"engine": {"last_swap": {"slot": "run@slot1", "version": version, "pause_s": 0.01, "proven": proven,
                                     "workers": [{"index": 0, "checked": c, "prove_s": 0.002} for c in checked]}}}


def test_the_replica_proof_is_yes_only_for_the_version_just_published_proven_in_full_by_every_worker():
    vllm = LoraDemoConfig(engine="vllm")
    ok = lora_proof(vllm, _status(4, checked=(32, 32)), 4)
    assert ok == {"replica_verified": True, "verified_tensors": 64, "verify_ms": 2.0, "slot": "run@slot1"}
    assert lora_proof(vllm, _status(3), 4)["replica_verified"] is False              # an older swap
    assert lora_proof(vllm, _status(4, proven="sampled"), 4)["replica_verified"] is False
    assert lora_proof(vllm, _status(4, checked=(32, 0)), 4)["replica_verified"] is False  # a worker checked nothing
    assert lora_proof(vllm, _status(4, checked=()), 4)["replica_verified"] is False
    assert lora_proof(vllm, {"engine": {}}, 4)["replica_verified"] is False
    assert lora_proof(LoraDemoConfig(engine="reference"), {}, 4)["replica_verified"] is None


# --- end to end: make stress ---------------------------------------------------------------------

def _demo(tmp_path, name: str, **overrides) -> dict:
    cfg = LoraDemoConfig(bucket=str(tmp_path / "bucket"), report_dir=str(tmp_path / name), run_name=name,
                         **{**FAST, **overrides})
    return run_lora_demo(cfg)


def _check_rows(report: dict, out) -> None:
    rows = report["rows"]
    assert json.loads((out / "demo-lora.json").read_text())["rows"] == rows
    assert (out / "demo-lora.png").stat().st_size > 0
    assert report["anchor"]["version"] == 0 and len(rows) == 3
    expected = 0
    for r in rows:
        # rollouts on the version published before the step, one version per request, and no other
        assert r["expected_version"] == expected and r["served_versions"] == [expected] and r["served_ok"]
        assert r["published_version"] == expected + 1 and r["published_as_trained"]
        expected = r["published_version"]
        assert r["tokens"] >= 6 * 4
        if r["trained_tokens"]:  # an adapter step: a delta of the adapter alone, fetched by the replica
            assert 0 < r["stored_bytes"] and r["bytes_fetched"] > 0 and r["elements_changed"] > 0
    assert any(r["trained_tokens"] for r in rows)
    s = report["summary"]
    assert s["all_served_by_previous_version"] and s["published_as_trained_all"]
    assert SnapshotReader(report["run_url"]).resolve("latest") == 3
    with pytest.raises(httpx.TransportError):  # the replica was stopped
        httpx.get(report["replica_url"] + "/v1/status", timeout=2)


@pytest.mark.slow
def test_demo_lora_on_the_reference_engine_serves_each_step_the_adapter_published_before_it_with_zero_divergence(
        tmp_path):
    report = _demo(tmp_path, "reference")
    _check_rows(report, tmp_path / "reference")
    for r in report["rows"]:
        assert r["k1"] == r["k2"] == r["k3"] == r["max_abs_diff"] == 0.0   # same bits, same peft modules: zero
        assert r["replica_verified"] is None
    assert report["summary"]["k_max"] == 0.0


@pytest.mark.slow
def test_demo_lora_on_vllm_every_version_is_written_into_a_slot_and_proven_there_by_the_replica(tmp_path):
    report = _demo(tmp_path, "vllm", engine="vllm")
    _check_rows(report, tmp_path / "vllm")
    slots = set()
    for r in report["rows"]:
        # the replica's own proof from /v1/status engine.last_swap: this version, proven in full, every buffer
        assert r["replica_verified"] is True and r["verified_tensors"] > 0 and r["pause_ms"] > 0
        slots.add(r["slot"])
        assert all(math.isfinite(r[k]) for k in ("k1", "k2", "k3", "max_abs_diff"))
        assert r["k2"] >= 0 and r["k3"] >= 0
    assert len(slots) >= 2           # each version goes into a slot no request holds, not the one serving
    s = report["summary"]
    # vLLM's LoRA kernels are not the trainer's: small, and honestly not zero
    assert 0 < s["max_abs_diff"] < 1 and s["k_max"] < 0.05
    assert s["replica_verified_all"] is True
