"""A typical Hugging Face policy, published as a module, served by every engine (issue 31 items 1-3).

The trainer keeps fp32 master weights of a model whose output head is its input
embedding (tied Llama, tied Qwen2: transformers' own classes, tiny random
configs), steps them with AdamW, and publishes the module itself with
``Publisher(dtype=torch.bfloat16, extra_files=MODEL_DIR)``. Beside each publish
the test writes what a user without ckptdelta would load: ``save_pretrained`` of
the same weights cast to bf16. What must hold:

* every snapshot is that directory: the same tensor names (the tied head once),
  the same bits, the same config (dtype bfloat16, tie_word_embeddings true);
* the reference engine hot-loads it bit-exact, its head still the embedding,
  and samples the greedy tokens and logprobs of an engine on the saved directory;
* vLLM (one server per model, real CPU build): started on the run by the
  replica (which passes the run's dtype), or started by a user on the saved
  directory and attached; hot-loaded through an anchor and deltas; every live
  weight read back bit-exact, and the greedy tokens and logprobs those of the
  vLLM that loaded the saved directory.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass, field

import pytest
import torch

from tests.lm import CORPUS, build_tokenizer
from tests.vllm_models import build_qwen_tied, randomize_
from tests.vllm_replicas import VLLM_ARGS, VllmReplicaHandle, bit_diff, one_gpu_layout

PROMPTS = [CORPUS[3], CORPUS[0], CORPUS[5]]
#: The tests' vLLM options without --dtype: the replica passes the run's own.
ARGS_WITHOUT_DTYPE = [a for i, a in enumerate(VLLM_ARGS) if a != "--dtype" and VLLM_ARGS[i - 1] != "--dtype"]


pytestmark = pytest.mark.usefixtures("one_gpu_layout")   # (imported) every vLLM here: its worker in the engine core


def build_tied_llama(vocab_size: int, *, seed: int = 3) -> torch.nn.Module:
    """A fp32 Llama with tied embeddings, head size 32 (what vLLM's CPU attention serves)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         tie_word_embeddings=True, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).float()
    randomize_(model, seed=seed)
    return model


@dataclass
class Policy:
    kind: str
    url: str
    model_dir: str                                   # the user's model directory: extra_files
    saved: dict[int, str] = field(default_factory=dict)              # version -> save_pretrained of its bf16
    truth: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)   # that directory's tensors


def train_and_publish(kind: str, root: str, *, steps: int = 3, dtype: torch.dtype | None = torch.bfloat16) -> Policy:
    """fp32 masters, AdamW, ``publish(model, step)`` in ``dtype`` (None: fp32 as they are); each version also
    saved as a user would, in that dtype."""
    from safetensors.torch import load_file

    from ckptdelta.publisher import Publisher

    tokenizer = build_tokenizer()
    model = build_tied_llama(len(tokenizer)) if kind == "llama" else \
        build_qwen_tied(len(tokenizer), dtype=torch.float32).train()
    assert model.dtype == torch.float32 and model.lm_head.weight is model.model.embed_tokens.weight
    policy = Policy(kind, os.path.join(root, "bucket", kind), os.path.join(root, "model"))
    served = dtype or torch.float32
    copy.deepcopy(model).to(served).save_pretrained(policy.model_dir)
    tokenizer.save_pretrained(policy.model_dir)
    g = torch.Generator().manual_seed(0)
    batch = torch.randint(3, len(tokenizer), (4, 24), generator=g)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    with Publisher(policy.url, dtype=dtype, extra_files=policy.model_dir, progress=False) as pub:
        for step in range(steps):
            if step:
                model(batch, labels=batch).loss.backward()
                opt.step()
                opt.zero_grad()
            version = pub.publish(model, step).version
            out = os.path.join(root, f"saved-v{version}")
            copy.deepcopy(model).to(served).save_pretrained(out)
            tokenizer.save_pretrained(out)
            policy.saved[version] = out
            policy.truth[version] = load_file(os.path.join(out, "model.safetensors"))
    assert model.dtype == torch.float32          # the masters stayed fp32
    return policy


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def policy(request, tmp_path_factory) -> Policy:
    return train_and_publish(request.param, str(tmp_path_factory.mktemp(f"policy-{request.param}")))


def _config(path: str) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def test_a_module_from_fp32_masters_publishes_what_save_pretrained_writes_of_its_bf16_weights(policy, tmp_path):
    from safetensors.torch import load_file

    from ckptdelta.loader.reader import SnapshotReader

    reader = SnapshotReader(policy.url)
    assert [reader.manifest(v).kind for v in sorted(policy.saved)] == ["anchor", "delta", "delta"]
    for v, saved in policy.saved.items():
        got = reader.materialize(v, str(tmp_path / f"v{v}"))
        tensors = {}
        for f in sorted(os.listdir(got)):
            if f.endswith(".safetensors"):
                tensors.update(load_file(os.path.join(got, f)))
        assert "lm_head.weight" not in tensors and sorted(tensors) == sorted(policy.truth[v])
        assert bit_diff(tensors, policy.truth[v]) == [], v
        assert {e.dtype for e in reader.manifest(v).tensors.values()} == {"BF16"}
        mine, theirs = _config(got), _config(saved)
        assert mine["dtype"] == "bfloat16" and mine["tie_word_embeddings"] is True
        assert mine == theirs
    assert any(bit_diff(policy.truth[v], policy.truth[v - 1]) for v in (1, 2))   # the steps moved bf16 bits


def _greedy(engine, prompts: list[str]) -> list[tuple[list[int], list[float], list]]:
    from ckptdelta.loader.engines.reference.model import SamplingParams

    out = []
    for p in prompts:
        c = engine.generate(engine.encode(p), SamplingParams(max_tokens=6, temperature=0.0, logprobs=2,
                                                             ignore_eos=True)).completions[0]
        out.append((c.token_ids, c.logprobs, c.top_logprobs))
    return out


def test_the_reference_engine_hot_loads_the_tied_bf16_policy_bit_exact_and_samples_as_save_pretrained(policy):
    from ckptdelta.loader.engines.reference.model import Engine, load_engine
    from ckptdelta.loader.hf_model import load_model

    engine, _ = load_engine(bucket=policy.url, snapshot=0)
    model = engine.model
    for v in (1, 2, 0, 2):
        assert engine.swapper.hotload(v).to_version == v
        live = {n: t for n, t in model.state_dict().items() if n != "lm_head.weight"}
        assert bit_diff(live, policy.truth[v]) == [], v
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()   # still tied
    theirs, tokenizer = load_model(policy.saved[2])
    assert _greedy(engine, PROMPTS) == _greedy(Engine(theirs, tokenizer), PROMPTS)


def _sample(post, prompts: list[str], **extra) -> list[dict]:
    """Greedy completions with top-2 logprobs, as (text, token ids, logprobs) per prompt."""
    out = []
    for p in prompts:
        r = post("/v1/completions", {"prompt": p, "max_tokens": 6, "temperature": 0, "logprobs": 2,
                                     "ignore_eos": True, "return_token_ids": True, **extra})
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        out.append({"text": c["text"], "token_ids": c["token_ids"], "logprobs": c["logprobs"]})
    return out


@pytest.mark.parametrize("policy", ["llama"], indirect=True)
def test_vllm_serves_and_hot_loads_the_tied_bf16_policy_as_a_vllm_that_loaded_save_pretrained(policy, tmp_path):
    """Llama: the replica starts vLLM on the run (no --dtype given: it passes the run's); the snapshot is the
    saved directory's files (test above). Qwen2 (make stress, below): a user's vLLM started on the saved
    directory itself, its answers taken before the replica attaches. Both then hot-load through the anchor and
    the deltas."""
    _serves_and_hot_loads_as_save_pretrained(policy, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["qwen2"], indirect=True)
def test_vllm_attached_to_save_pretrained_hot_loads_the_tied_bf16_qwen2_and_answers_as_before(policy, tmp_path):
    """In make stress only: a second vLLM start (the suite is near its CI limit)."""
    _serves_and_hot_loads_as_save_pretrained(policy, tmp_path)


def _serves_and_hot_loads_as_save_pretrained(policy, tmp_path) -> None:
    from ckptdelta.loader.engines import build_engine
    from ckptdelta.loader.engines.vllm.server import VllmServer
    from ckptdelta.loader.engines.vllm.control import http_client
    from tests.servers import free_port

    theirs = None
    try:
        if policy.kind == "llama":
            engine = build_engine("vllm", bucket=policy.url, snapshot=2, cache_dir=str(tmp_path / "cache"),
                                  vllm_args=ARGS_WITHOUT_DTYPE)
            cmd = engine.server.proc.args
            assert cmd[cmd.index("--dtype") + 1] == "bfloat16"
            rep = VllmReplicaHandle(engine)
            expected = _sample(rep.post, PROMPTS)          # vLLM as it loaded v2 from the snapshot's files
        else:
            theirs = VllmServer(policy.saved[2], served_name="theirs", args=VLLM_ARGS, port=free_port())
            theirs.wait_ready()
            with http_client(theirs.url, timeout=120) as c:
                expected = _sample(lambda path, body: c.post(path, json=body), PROMPTS, model="theirs")
            rep = VllmReplicaHandle(build_engine("vllm", bucket=policy.url, snapshot=2, attach=theirs.url))
        try:
            assert bit_diff(rep.live_weights(str(tmp_path)), policy.truth[2]) == []
            for v in (0, 1, 2):
                job = rep.hotload(v)
                assert job["state"] == "READY", job
                assert bit_diff(rep.live_weights(str(tmp_path)), policy.truth[v]) == [], v
                assert rep.complete(max_tokens=2, return_engine_data=True)["engine_data"]["policy_version"] == v
                # the tied head is re-packed in the shadow with its embedding, before the pause
                assert rep.http.get("/v1/status").json()["engine"]["last_swap"]["apply"] == "shadow"
            assert _sample(rep.post, PROMPTS) == expected
        finally:
            rep.close()
    finally:
        if theirs is not None:
            theirs.stop()


@pytest.mark.slow
def test_vllm_serves_an_fp32_run_in_fp32_and_hot_loads_it_bit_exact(tmp_path):
    """publish() without dtype: fp32 snapshots. vLLM's own default would downcast them to bf16 (and the
    replica's start check would fail); the replica passes --dtype float32, and every weight reads back as
    the published fp32 bits."""
    from ckptdelta.loader.engines import build_engine
    from ckptdelta.loader.reader import SnapshotReader

    policy = train_and_publish("llama", str(tmp_path / "policy"), steps=2, dtype=None)
    assert {e.dtype for e in SnapshotReader(policy.url).manifest(0).tensors.values()} == {"F32"}
    engine = build_engine("vllm", bucket=policy.url, snapshot=0, cache_dir=str(tmp_path / "cache"),
                          vllm_args=ARGS_WITHOUT_DTYPE)
    cmd = engine.server.proc.args
    assert cmd[cmd.index("--dtype") + 1] == "float32"
    rep = VllmReplicaHandle(engine)
    try:
        assert bit_diff(rep.live_weights(str(tmp_path)), policy.truth[0]) == []
        for v in (1, 0):
            assert rep.hotload(v)["state"] == "READY"
            assert bit_diff(rep.live_weights(str(tmp_path)), policy.truth[v]) == [], v
        assert rep.complete(max_tokens=3, return_engine_data=True)["engine_data"]["policy_version"] == 0
    finally:
        rep.close()
