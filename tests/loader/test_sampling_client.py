"""The Loops-shaped sampling client (loader/sampling.py) against real replicas: real HTTP on 127.0.0.1, the
reference engine over runs the real Publisher wrote, a peft LoRA trainer for the RL loop. On vLLM:
tests/loader/engines/vllm/test_vllm_replica.py."""

from __future__ import annotations

import asyncio
import math
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import pytest
import torch
from transformers import AutoTokenizer

from ckptdelta.delta.errors import CkptDeltaError, PolicyVersionTimeoutError, ReplicaError
from ckptdelta.loader.hf_model import score_tokens
from ckptdelta.loader.sampling import ModelInput, SamplingClient, SamplingParams, save_weights_and_get_sampling_client
from tests.replicas import (PROMPT, LiveServer, held_after_first_step, lm_dir, publish_run, run,  # noqa: F401
                            start_replica, state_bits_equal)
from tests.lm import rl_step
from tests import REPO

ROOT = REPO


def _prompt_ids(rep) -> list[int]:
    return rep.complete(max_tokens=1)["prompt_token_ids"]


def _count(rep, status: int) -> float:
    line = f'ckptdelta_requests_total{{endpoint="/v1/completions",status="{status}"}}'
    return next((float(x.split()[-1]) for x in rep.http.get("/metrics").text.splitlines() if x.startswith(line)), 0.0)


def _check_sequences(resp, n: int, max_tokens: int, eos: int) -> None:
    """Tokens and logprobs one per token, finite log-probabilities, and stop_reason as the tokens say."""
    assert len(resp.sequences) == n
    for seq in resp.sequences:
        assert 0 < len(seq.tokens) == len(seq.logprobs) <= max_tokens
        assert all(math.isfinite(lp) and lp <= 0.0 for lp in seq.logprobs)
        ended = seq.tokens[-1] == eos
        assert seq.stop_reason == ("stop" if ended else "length")
        assert ended or len(seq.tokens) == max_tokens
        assert eos not in seq.tokens[:-1]


def test_sample_returns_tokens_logprobs_stop_reasons_prompt_logprobs_and_the_version_it_ran_on(start_replica, run):
    rep = start_replica(run.latest)
    model, eos = rep.engine.model, rep.engine.eos_token_id
    prompt = ModelInput.from_ints(_prompt_ids(rep))
    with SamplingClient(rep.url, min_policy_version=run.latest) as client:
        resp = client.sample(prompt, num_samples=3, sampling_params=SamplingParams(max_tokens=5, seed=1),
                             include_prompt_logprobs=True, topk_prompt_logprobs=2)
        _check_sequences(resp, 3, 5, eos)
        assert resp.policy_version == run.latest and resp.policy_versions == [run.latest]
        assert resp.replica == rep.url and resp.replica_id == "r0"
        # the prompt's logprobs: one forward of the prompt, the trainer's own scoring of it, to the bit
        ids = prompt.to_ints()
        assert len(resp.prompt_logprobs) == len(ids) and resp.prompt_logprobs[0] is None
        with torch.no_grad():
            assert torch.equal(torch.tensor(resp.prompt_logprobs[1:]), score_tokens(model, ids, 1))
        for own, top in zip(resp.prompt_logprobs[1:], resp.topk_prompt_logprobs[1:]):
            assert len(top) == 2 and top[0][1] >= top[1][1]
            assert own in (lp for _, lp in top) or own <= top[1][1]

        # compute_logprobs of a sampled sequence: the trainer's score_tokens of it, exactly
        seq = resp.sequences[0]
        scored = client.compute_logprobs(ModelInput.from_ints(ids + seq.tokens))
        with torch.no_grad():
            assert torch.equal(torch.tensor(scored[len(ids):]), score_tokens(model, ids + seq.tokens, len(ids)))
        # a list, as a Tinker-style loop takes it, that says which weights computed it, as every answer does
        assert isinstance(scored, list) and scored == list(scored) and scored[0] is None
        assert scored.policy_version == run.latest and scored.policy_versions == [run.latest]
        assert scored.replica == rep.url
        again = asyncio.run(client.compute_logprobs_async(ModelInput.from_ints(ids + seq.tokens)))
        assert again == scored and again.policy_version == run.latest

        greedy = client.sample(prompt, sampling_params=SamplingParams(max_tokens=6, temperature=0.0)).sequences[0]
        top1 = client.sample(prompt, sampling_params=SamplingParams(max_tokens=6, top_k=1, seed=9)).sequences[0]
        assert top1.tokens == greedy.tokens          # top_k=1 at temperature 1 is the argmax
        stop = greedy.tokens[1]                      # a stop token id ends the sequence on it, kept in tokens
        stopped = client.sample(prompt, sampling_params=SamplingParams(max_tokens=6, temperature=0.0,
                                                                       stop=[stop])).sequences[0]
        assert stopped.tokens == greedy.tokens[:greedy.tokens.index(stop) + 1] and stopped.stop_reason == "stop"

        async def group() -> list:
            return await asyncio.gather(*(client.sample_async(prompt, sampling_params=SamplingParams(max_tokens=3),
                                                              affinity_key="group-0") for _ in range(4)))
        for r in asyncio.run(group()):
            _check_sequences(r, 1, 3, eos)
            assert r.policy_version == run.latest
        with pytest.raises(ValueError, match="token ids must be ints"):
            ModelInput.from_ints([1, -2])
        with pytest.raises(ReplicaError, match="400"):        # the replica's own refusal, named
            client.sample(prompt, sampling_params=SamplingParams(max_tokens=0))


def test_compute_logprobs_says_the_version_that_computed_them_when_a_hotload_lands_during_the_scoring(start_replica):
    """The prompt's forward and the token sampled after it must be one version's: a hot-load asked for while the
    prompt's forward runs lands after both (the request then reports the version of its values), never between
    them (values of v1 labelled v2, as a prompt forward in a step of its own let happen)."""
    rep = start_replica(1)
    ids = _prompt_ids(rep)
    with SamplingClient(rep.url) as client:
        at1 = client.compute_logprobs(ids)
        in_forward, release = threading.Event(), threading.Event()

        def hold_first_forward(module, args, output) -> None:   # times the hot-load; changes no number
            if not in_forward.is_set():
                in_forward.set()
                release.wait(30)

        handle = rep.engine.model.register_forward_hook(hold_first_forward)
        out: dict = {}
        t = threading.Thread(target=lambda: out.setdefault("lp", client.compute_logprobs(ids)))
        t.start()
        try:
            assert in_forward.wait(30)                   # the scoring request's first forward: its prompt's
            job = rep.hotload(2, wait=False)
            assert rep.wait(job["id"], ("SWAPPING", "READY", "FAILED"))["state"] == "SWAPPING"   # waits on the step
        finally:
            release.set()
            t.join(30)
            handle.remove()
        assert rep.wait(job["id"])["state"] == "READY"
        raced = out["lp"]
        at2 = client.compute_logprobs(ids)
        assert at2.policy_version == 2 and list(at2) != list(at1)
        assert list(raced) == list(at1)                  # v1's values ...
        assert raced.policy_version == 1 and raced.policy_versions == [1]    # ... said to be v1's


def test_prompt_logprobs_name_the_version_of_their_forward_when_later_tokens_run_on_a_newer_one(start_replica):
    """A request that asked for its prompt's logprobs and crossed a hot-load after its first token: the prompt's
    logprobs are v1's, its last token v2's. ``engine_data.prompt_logprobs_version`` and the client's
    ``SampleResponse.prompt_logprobs_version`` say v1, beside ``policy_version`` 2 and the span [1, 2]."""
    rep = start_replica(1)
    ids = _prompt_ids(rep)
    with SamplingClient(rep.url) as client:
        at1 = client.compute_logprobs(ids)
        first_step, handle = held_after_first_step(rep.engine)
        out: dict = {}
        t = threading.Thread(target=lambda: out.setdefault("resp", client.sample(
            ids, sampling_params=SamplingParams(max_tokens=3, temperature=0.0), include_prompt_logprobs=True)))
        t.start()
        try:
            assert first_step.wait(30)
            with rep.engine.hold():                      # between the request's first step and its second
                rep.hotload(2)
        finally:
            t.join(30)
            handle.remove()
        resp = out["resp"]
        if len(resp.sequences[0].tokens) == 3:           # it ran a step on v2 (greedy: no EOS at once)
            assert resp.policy_version == 2 and resp.policy_versions == [1, 2]
        assert resp.prompt_logprobs == list(at1) and resp.prompt_logprobs_version == 1
        raw = rep.complete(prompt=ids, max_tokens=1, prompt_logprobs=0, return_engine_data=True)
        assert raw["engine_data"]["prompt_logprobs_version"] == 2
        assert "prompt_logprobs_version" not in rep.complete(max_tokens=1, return_engine_data=True)["engine_data"]


def test_model_input_from_ints_takes_numpy_integers_and_still_refuses_bools_floats_and_junk(start_replica):
    """Token ids straight out of a tokenizer's numpy (or torch) arrays are ids; a bool, a float or a string in
    their place is a bug upstream, refused with the error that names it."""
    import numpy as np

    rep = start_replica(1)
    ids = _prompt_ids(rep)
    as_numpy = ModelInput.from_ints(np.array(ids))
    assert as_numpy == ModelInput.from_ints(ids) and all(type(t) is int for t in as_numpy.tokens)
    assert ModelInput.from_ints(list(np.array(ids, dtype=np.int32))).to_ints() == ids
    assert ModelInput.from_ints(torch.tensor(ids)).to_ints() == ids
    greedy = SamplingParams(max_tokens=3, temperature=0.0)
    with SamplingClient(rep.url) as client:
        assert (client.sample(as_numpy, sampling_params=greedy).sequences[0].tokens
                == client.sample(ids, sampling_params=greedy).sequences[0].tokens)
        assert list(client.compute_logprobs(np.array(ids))) == list(client.compute_logprobs(ids))
    for junk in ([5, True], [5, np.True_], [5, 2.0], [5, np.float32(2)], [5, "6"], [5, None], [5, -1],
                 [5, torch.tensor(True)], torch.tensor([[5], [6]]), [5, np.array([6])]):   # not one id each
        with pytest.raises(ValueError, match=r"ModelInput.from_ints: token ids must be ints >= 0, got \["):
            ModelInput.from_ints(junk)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts this process's open descriptors")
def test_one_asyncio_run_per_step_leaves_no_connections_open_behind_it(start_replica):
    """The Loops loop runs each step's group in its own ``asyncio.run``: the client of a loop that closed cannot be
    closed any more (aclose needs its loop), so it is let go at the next loop's first request with its sockets,
    not kept, one socket per connection per step, until the descriptors run out."""
    rep = start_replica(1)
    prompt = ModelInput.from_ints(_prompt_ids(rep))

    def step(client: SamplingClient) -> None:
        async def group() -> list:
            return await asyncio.gather(*(client.sample_async(prompt, sampling_params=SamplingParams(max_tokens=1))
                                          for _ in range(8)))
        assert len(asyncio.run(group())) == 8

    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    with SamplingClient(rep.url) as client:
        for _ in range(3):
            step(client)
        before = open_fds()
        for _ in range(12):
            step(client)
        assert len(client._async) == 1                    # this loop's client; the closed loops' let go
        assert open_fds() - before <= 8, "the closed loops' connections were kept open"


def test_a_minimum_policy_version_is_retried_on_408_until_the_hotload_lands_then_a_timeout_is_an_error(
        start_replica, run):
    rep = start_replica(1)
    prompt = ModelInput.from_ints(_prompt_ids(rep))
    out: dict = {}
    with SamplingClient([rep.url], min_policy_version=2, ready_timeout=60, backoff_base=0.02,
                        backoff_max=0.2) as client:
        t = threading.Thread(target=lambda: out.setdefault("resp", client.sample(
            prompt, sampling_params=SamplingParams(max_tokens=2))))
        t.start()
        deadline = time.monotonic() + 60
        while _count(rep, 408) < 2:                  # turned away, and back
            assert time.monotonic() < deadline and t.is_alive()
            time.sleep(0.01)
        assert rep.hotload(2)["state"] == "READY"
        t.join(60)
    assert out["resp"].policy_version == 2 and out["resp"].policy_versions == [2]

    with SamplingClient(rep.url, min_policy_version=99, ready_timeout=0.5, backoff_base=0.05) as client:
        with pytest.raises(PolicyVersionTimeoutError, match="ready_timeout of 0.5s") as info:
            client.sample(prompt)
        assert isinstance(info.value, CkptDeltaError) and "99" in str(info.value)

        async def one() -> None:
            await client.sample_async(prompt)
        with pytest.raises(PolicyVersionTimeoutError):
            asyncio.run(one())


def test_the_openai_client_retries_a_408_by_itself_max_retries_times(start_replica):
    """What docs/SERVING.md tells users of the openai client beside the 408 rule: it retries a 408 on its own
    (honouring Retry-After), max_retries times, before the error reaches their code; max_retries=0 sends one."""
    import openai

    rep = start_replica(1)
    name = rep.http.get("/v1/models").json()["data"][0]["id"]
    for retries in (0, 2):
        before = _count(rep, 408)
        with openai.OpenAI(base_url=rep.url + "/v1", api_key="unused", max_retries=retries, timeout=60) as c:
            with pytest.raises(openai.APIStatusError) as info:
                c.completions.create(model=name, prompt=PROMPT, max_tokens=1, extra_body={"min_policy_version": 9})
        assert info.value.status_code == 408 and info.value.body["type"] == "policy_version_too_old"
        assert _count(rep, 408) - before == 1 + retries


def test_save_weights_and_get_sampling_client_publishes_hot_loads_every_replica_and_pins_the_client(
        start_replica, lm_dir, tmp_path):
    own = publish_run(str(tmp_path / "bucket" / "run"), lm_dir, n_versions=2)
    try:
        reps = [start_replica(1, bucket=own.url, replica_id=f"r{i}") for i in range(2)]
        new = rl_step(own.truth[1], seed=77)
        client = save_weights_and_get_sampling_client(own.publisher, new, 2, [r.url for r in reps],
                                                      ready_timeout=30)
        with client:
            assert client.min_policy_version == 2 and client.replicas == [r.url for r in reps]
            for r in reps:
                assert r.status()["policy_version"] == 2 and state_bits_equal(r.engine.model, new) == []
            prompt = ModelInput.from_ints(_prompt_ids(reps[0]))
            assert {client.sample(prompt).replica for _ in range(2)} == {r.url for r in reps}
            assert all(client.sample(prompt).policy_versions == [2] for _ in range(2))
    finally:
        own.close()


def test_import_ckptdelta_is_cheap_and_its_sampling_client_and_rollout_function_never_import_the_server():
    code = ("import sys, ckptdelta\n"
            "assert 'torch' not in sys.modules and 'ckptdelta.loader' not in sys.modules, 'import ckptdelta loaded more'\n"
            "from ckptdelta import ModelInput, SamplingClient, SamplingParams, save_weights_and_get_sampling_client\n"
            "from ckptdelta import AsyncRolloutClient, Publisher, RolloutClient, SnapshotReader\n"
            "from ckptdelta import FleetRollout\n"
            "import ckptdelta.loader.sampling, ckptdelta.loader.client, ckptdelta.publisher\n"
            "assert SamplingClient is ckptdelta.loader.sampling.SamplingClient and Publisher is ckptdelta.publisher.Publisher\n"
            "print(sorted(m for m in ('fastapi', 'uvicorn', 'ckptdelta.loader.server', 'vllm', 'transformers', 'trl') "
            "if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]"


# --- the Loops RL loop, run against ckptdelta replicas --------------------------------------------------------
#
# The loop of the Loops guide ("Write an RL loop with the Loops SDK"): GRPO rollouts with asyncio.gather over
# sample_async, rewards normalised within the group, one datum per completion (the full sequence, the rollout's
# logprobs and the advantage per position), a trainer step, then save_weights_and_get_sampling_client for the
# next rollout. What changed: the imports, and the construction of the clients (a Publisher and replica URLs
# where Loops has its training client). The trainer step is a plain torch policy-gradient step (the importance
# sampling loss) on a peft model, where Loops runs forward_backward and optim_step on its trainer.

@dataclass
class TensorData:          # the guide's loss-function input type, local: ckptdelta has no trainer service
    data: list[float]
    dtype: str
    shape: list[int]


@dataclass
class Datum:
    model_input: ModelInput
    loss_fn_inputs: dict[str, TensorData] = field(default_factory=dict)


def _peft_model(lm_dir: str):
    """The trainer: a LoRA adapter (fp32, B = 0) on the tiny LM's bf16 base, and AdamW on the adapter."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(lm_dir, dtype=torch.bfloat16)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0))
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.0)


def _adapter_bits(model) -> dict[str, bytes]:
    from peft import get_peft_model_state_dict

    return {k: v.detach().contiguous().view(torch.uint8).numpy().tobytes()
            for k, v in get_peft_model_state_dict(model).items()}


def _importance_sampling_step(policy, opt, datums: list[Datum]) -> None:
    """forward_backward(loss_fn="importance_sampling") + optim_step: -sum(exp(new - old) * adv) over the active
    positions (advantage != 0), new logprobs from one forward of each sequence."""
    opt.zero_grad()
    for d in datums:
        ids = d.model_input.to_ints()
        old = torch.tensor(d.loss_fn_inputs["logprobs"].data[1:])
        adv = torch.tensor(d.loss_fn_inputs["advantages"].data[1:])
        new = score_tokens(policy, ids, 1)                    # token t's logprob given those before it, t >= 1
        active = max(1, int((adv != 0).sum()))
        (-(torch.exp(new - old) * adv).sum() / active / len(datums)).backward()
    opt.step()


def test_the_loops_rl_loop_runs_on_ckptdelta_replicas_with_only_its_imports_and_client_construction_changed(
        lm_dir, tmp_path):
    # --- changed: the imports ...
    from ckptdelta import ModelInput, Publisher, SamplingParams, save_weights_and_get_sampling_client
    from ckptdelta.loader.engines import reference
    from ckptdelta.loader.server import create_app

    model, optimizer = _peft_model(lm_dir)
    policy = model.get_base_model()                   # the peft-injected model the replica runs too
    tokenizer = AutoTokenizer.from_pretrained(lm_dir)
    url = str(tmp_path / "run")
    publisher = Publisher(url, progress=False)
    publisher.publish(model, 0)                       # the anchor the replica starts on
    replica = reference.build(bucket=url, snapshot=0)
    eos = replica.engine.eos_token_id
    with LiveServer(create_app(replica, replica_id="loops-0")) as server:
        # ... and the construction of the clients: a publisher and the replicas, for Loops' training client
        sampling_client = save_weights_and_get_sampling_client(publisher, model, 1, [server.url], ready_timeout=60)

        prompt_ids = tokenizer.encode("What is 17 times 24?", add_special_tokens=False)
        group_size = 4
        prompt = ModelInput.from_ints(prompt_ids)
        prompt_len = len(prompt_ids)

        def build_datum(sequence, advantage):
            tokens = prompt_ids + sequence.tokens
            L = len(tokens)
            return Datum(
                model_input=ModelInput.from_ints(tokens),
                loss_fn_inputs={
                    "logprobs": TensorData(
                        data=[0.0] * prompt_len + sequence.logprobs, dtype="float32", shape=[L]
                    ),
                    "advantages": TensorData(
                        data=[0.0] * prompt_len + [advantage] * len(sequence.tokens),
                        dtype="float32",
                        shape=[L],
                    ),
                },
            )

        trained = 0
        for step in range(2, 5):
            floor = sampling_client.min_policy_version

            async def rollout():
                return await asyncio.gather(
                    *[
                        sampling_client.sample_async(
                            prompt,
                            sampling_params=SamplingParams(temperature=1.0, top_p=0.95, seed=100 * step + i),
                            affinity_key=f"rollout-group-{step}",
                        )
                        for i in range(group_size)
                    ]
                )

            responses = asyncio.run(rollout())
            for r in responses:      # each on the version just published, or newer, and nothing older
                assert r.policy_version >= floor and all(v >= floor for v in r.policy_versions)
                _check_sequences(r, 1, 16, eos)      # 16: the replica's max_tokens when none is given

            sequences = [response.sequences[0] for response in responses]
            # the guide's reward checks for "408"; the tiny untrained model cannot multiply, so: an "a" anywhere
            scores = [1.0 if "a" in tokenizer.decode(seq.tokens) else 0.0 for seq in sequences]
            mean = sum(scores) / len(scores)
            std = (sum((score - mean) ** 2 for score in scores) / len(scores)) ** 0.5
            advantages = [(score - mean) / std if std else 0.0 for score in scores]

            datums = [
                build_datum(sequence, advantage)
                for sequence, advantage in zip(sequences, advantages)
            ]
            assert all(len(d.loss_fn_inputs["advantages"].data) == d.model_input.length for d in datums)

            before = _adapter_bits(model)
            _importance_sampling_step(policy, optimizer, datums)
            if any(advantages):      # a group that is not a no-op moved the adapter (the seeds make it so here)
                trained += 1
                assert _adapter_bits(model) != before
            sampling_client.close()
            sampling_client = save_weights_and_get_sampling_client(publisher, model, step, [server.url],
                                                                   ready_timeout=60)
            assert sampling_client.min_policy_version == floor + 1
            # the replica serves what the trainer holds: its scoring of a rollout is the trainer's, to the bit
            seq = sequences[0]
            served = sampling_client.compute_logprobs(ModelInput.from_ints(prompt_ids + seq.tokens))
            with torch.no_grad():
                ours = score_tokens(policy, prompt_ids + seq.tokens, prompt_len)
            assert torch.equal(torch.tensor(served[prompt_len:]), ours)
        sampling_client.close()
    publisher.close()
    assert replica.version == 4 and trained > 0
