"""LoRA runs end to end: a real peft adapter on the tiny Llama, trained with AdamW on real gradients, published
to a real bucket (a local directory, and S3 through moto), served by the reference engine through peft and
hot-loaded in place (publisher/lora.py, loader/lora.py, loader/engines/reference/lora.py)."""

from __future__ import annotations

import json
import os
import httpx
import pytest
import torch

from ckptdelta.cli import main
from ckptdelta.delta.errors import HotLoadError, NotServableError, PublishInputError
from ckptdelta.loader import SnapshotReader
from ckptdelta.loader.engines import reference
from ckptdelta.loader.lora import LoraHotSwapper
from ckptdelta.publisher import AdapterSpec, BaseModel, Publisher
from tests.replicas import LiveServer, make_lm_dir

PROMPT = "hello world, hello replica"


@pytest.fixture(scope="module")
def lm_dir(tmp_path_factory):
    return make_lm_dir(str(tmp_path_factory.mktemp("lm")))


def peft_model(lm_dir: str, *, r: int = 4, alpha: int = 8, seed: int = 0, target_modules="all-linear",
               rank_pattern: dict[str, int] | None = None):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(lm_dir, dtype=torch.bfloat16)
    model = get_peft_model(base, LoraConfig(r=r, lora_alpha=alpha, target_modules=target_modules, lora_dropout=0.0,
                                            rank_pattern=rank_pattern or {}))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    return model, opt


def train_step(model, opt, seed: int) -> None:
    """One AdamW step on the next-token loss of a random batch: every lora_A and lora_B element moves."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, model.config.vocab_size, (2, 12), generator=g)
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    opt.zero_grad()


def adapter_bits(model) -> dict[str, torch.Tensor]:
    from peft import get_peft_model_state_dict

    return {k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()}


def bits_differ(live: dict[str, torch.Tensor], truth: dict[str, torch.Tensor]) -> list[str]:
    assert sorted(live) == sorted(truth)
    return [k for k in truth if live[k].dtype != truth[k].dtype
            or not torch.equal(live[k].detach().cpu().view(torch.uint8), truth[k].view(torch.uint8))]


def publish_steps(pub: Publisher, model, opt, steps: range, truth: dict[int, dict]) -> list:
    results = []
    for step in steps:
        train_step(model, opt, seed=step)
        r = pub.publish(model, step)
        truth[r.version] = adapter_bits(model)
        results.append(r)
    return results


@pytest.mark.parametrize("backend", ["local", "s3"])
def test_an_adapter_run_hot_loads_every_version_bit_exact_forward_across_an_anchor_and_back(
        backend, lm_dir, tmp_path, request):
    url, options = (str(tmp_path / "run"), {}) if backend == "local" else request.getfixturevalue("s3_root")
    model, opt = peft_model(lm_dir)
    truth: dict[int, dict] = {}
    with Publisher(url, storage_options=options, anchor_every=3) as pub:
        results = publish_steps(pub, model, opt, range(6), truth)
    # a LoRA run's deltas are dense (most of an anchor's bytes): its default anchor_chain_fraction (4, not a
    # full model's 0.5) keeps them chained
    assert [r.kind for r in results] == ["anchor", "delta", "delta", "anchor", "delta", "delta"]
    assert all(r.stored_bytes > 0.5 * results[0].stored_bytes for r in results[1:3])
    assert all(r.full_bytes == sum(t.numel() * 4 for t in truth[0].values()) for r in results)   # fp32 adapter

    replica = reference.build(bucket=url, snapshot=0, base_model=lm_dir, storage_options=options)
    swapper = replica.swapper
    assert isinstance(swapper, LoraHotSwapper) and replica.version == 0
    assert bits_differ(swapper.weights, truth[0]) == []
    for v in [1, 2, 3, 4, 5, 4, 2, 0, 5]:        # forward, across the anchor at v3, back, and a jump
        report = swapper.hotload(v)
        assert replica.version == v and report.to_version == v
        assert bits_differ(swapper.weights, truth[v]) == [], f"v{v}"
    # the live tensors are the peft model's own parameters: what the decode loop computes with
    lora = {n: p for n, p in replica.engine.model.named_parameters() if "lora_" in n}
    assert {p.data_ptr() for p in lora.values()} == {t.data_ptr() for t in swapper.weights.values()}


def test_a_materialized_anchor_and_delta_load_in_peft_with_the_trainers_bits_and_logits(lm_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model, opt = peft_model(lm_dir)
    truth: dict[int, dict] = {}
    url = str(tmp_path / "run")
    with Publisher(url, anchor_chain_fraction=10.0) as pub:
        publish_steps(pub, model, opt, range(2), truth)
    anchor_dir = os.path.join(url, "anchors", sorted(os.listdir(os.path.join(url, "anchors")))[0])
    assert sorted(os.listdir(anchor_dir)) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.load(open(os.path.join(anchor_dir, "adapter_config.json")))
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["inference_mode"] is True
    out = SnapshotReader(url).materialize(1, str(tmp_path / "v1"))      # the delta, as an adapter directory
    assert sorted(os.listdir(out)) == ["adapter_config.json", "adapter_model.safetensors"]
    for path, v in ((anchor_dir, 0), (out, 1)):
        loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(lm_dir, dtype=torch.bfloat16), path)
        assert bits_differ(adapter_bits(loaded), truth[v]) == []
    x = torch.randint(0, model.config.vocab_size, (1, 10))
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=x).logits, model(input_ids=x).logits)


def test_a_replica_refuses_an_adapter_for_another_base_in_one_line_naming_both(lm_dir, tmp_path, capsys):
    from tests.lm import save_tiny_lm

    other = save_tiny_lm(str(tmp_path / "other-lm"), seed=1)       # same architecture, other weights
    model, opt = peft_model(lm_dir)
    url = str(tmp_path / "run")
    with Publisher(url) as pub:
        publish_steps(pub, model, opt, range(1), {})
    record = SnapshotReader(url).manifest(0).adapter
    assert record.base_xxh3 == BaseModel.of(lm_dir).xxh3          # the trainer's base, hashed as a replica does
    with pytest.raises(NotServableError) as e:
        reference.build(bucket=url, base_model=other)
    msg = str(e.value)
    assert "\n" not in msg and record.base_xxh3 in msg and other in msg and BaseModel.of(other).xxh3 in msg

    # the command line: serve exits 1 with that line, before it listens
    assert main(["serve", "--bucket", url, "--base-model", other, "--port", "0"]) == 1
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "error" in ln]
    assert len(lines) == 1 and record.base_xxh3 in lines[0] and "xxh3" in lines[0], lines

    # a hot-load into an anchor published for another base is refused the same way, and the replica serves on
    replica = reference.build(bucket=url, base_model=lm_dir)
    other_model, other_opt = peft_model(other)
    with Publisher(url) as pub:
        r = publish_steps(pub, other_model, other_opt, range(1, 2), {})[0]
    assert r.kind == "anchor" and r.reason.startswith("the base model changed")
    with pytest.raises(HotLoadError, match="this replica serves base") as e:
        replica.swapper.hotload(1)
    assert "\n" not in str(e.value) and replica.version == 0


def test_a_rank_or_alpha_change_starts_an_anchor_and_a_replica_refuses_it_in_one_line(lm_dir, tmp_path):
    url = str(tmp_path / "run")
    with Publisher(url, anchor_chain_fraction=10.0) as pub:
        model, opt = peft_model(lm_dir, r=4, alpha=8)
        first = publish_steps(pub, model, opt, range(2), {})
        model, opt = peft_model(lm_dir, r=8, alpha=8)
        ranked = publish_steps(pub, model, opt, range(2, 4), {})
        model, opt = peft_model(lm_dir, r=8, alpha=32)       # same shapes, another scaling
        scaled = publish_steps(pub, model, opt, range(4, 5), {})
    assert [r.kind for r in first + ranked + scaled] == ["anchor", "delta", "anchor", "delta", "anchor"]
    assert "r 4 -> 8" in ranked[0].reason and "lora_alpha 8 -> 32" in scaled[0].reason

    replica = reference.build(bucket=url, snapshot=1, base_model=lm_dir)
    with pytest.raises(HotLoadError, match="another adapter config") as e:
        replica.swapper.hotload(2)
    assert "\n" not in str(e.value) and replica.version == 1
    # a publisher restarted on the run knows its config: the same adapter continues the chain
    with Publisher(url, anchor_chain_fraction=10.0) as pub:
        r = publish_steps(pub, model, opt, range(5, 6), {})[0]
    assert r.kind == "delta"


def test_bad_input_gets_one_clear_line(lm_dir, tmp_path, capsys):
    model, opt = peft_model(lm_dir)
    url = str(tmp_path / "run")
    with Publisher(url) as pub:
        publish_steps(pub, model, opt, range(1), {})
        with pytest.raises(PublishInputError, match="is a LoRA run") as e:   # a full model on a LoRA run
            pub.publish(model.get_base_model(), 1)
        assert "\n" not in str(e.value)

    def cli(*argv: str) -> tuple[int, str]:
        capsys.readouterr()
        rc = main(["publish", *argv])
        return rc, capsys.readouterr().err.strip()

    rc, err = cli(lm_dir, url, "--step", "1")                  # a model directory, not an adapter
    assert rc == 1 and len(err.splitlines()) == 1 and "is a LoRA run" in err, err
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    rc, err = cli(str(broken), url, "--step", "1")
    assert rc == 1 and len(err.splitlines()) == 1 and "no adapter_model.safetensors" in err, err
    with pytest.raises(PublishInputError, match="not a LoRA adapter"):
        Publisher(str(tmp_path / "run2"), adapter=AdapterSpec({"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                                                               "target_modules": ["q_proj"]},
                                                              BaseModel.of(lm_dir))).publish(
            {"model.embed_tokens.weight": torch.zeros(4)}, 0)
    # a saved adapter directory publishes through the command line, its base found from the run
    model.save_pretrained(str(tmp_path / "adapter"))
    rc, err = cli(str(tmp_path / "adapter"), url, "--step", "1")
    assert rc == 0, err
    assert SnapshotReader(url).manifest(1).adapter == SnapshotReader(url).manifest(0).adapter


def test_serving_a_lora_run_reports_versions_answers_408_and_its_logprobs_equal_the_trainers(lm_dir, tmp_path):
    from ckptdelta.loader.hf_model import score_tokens
    from ckptdelta.loader.server import create_app

    model, opt = peft_model(lm_dir)
    truth: dict[int, dict] = {}
    url = str(tmp_path / "run")
    pub = Publisher(url, anchor_chain_fraction=10.0)
    publish_steps(pub, model, opt, range(1), truth)
    assert SnapshotReader(url).manifest(0).adapter.base_model == lm_dir     # peft's base_model_name_or_path
    replica = reference.build(bucket=url)             # no --base-model: the directory the run records
    with LiveServer(create_app(replica, replica_id="lora-0")) as server, \
            httpx.Client(base_url=server.url, timeout=60) as http:
        body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 1.0, "seed": 3, "logprobs": 0,
                "score_logprobs": True, "return_engine_data": True}
        r = http.post("/v1/completions", json={**body, "min_policy_version": 1})
        assert r.status_code == 408 and r.json()["error"]["type"] == "policy_version_too_old"
        publish_steps(pub, model, opt, range(1, 2), truth)
        job = http.post("/v1/hotload", json={"snapshot": "latest"}).json()
        while job["state"] not in ("READY", "FAILED"):
            job = http.get(f"/v1/hotload/{job['id']}").json()
        assert job["state"] == "READY", job
        out = http.post("/v1/completions", json={**body, "min_policy_version": 1}).json()
    pub.close()
    assert out["engine_data"]["policy_version"] == 1
    choice = out["choices"][0]
    sampled = torch.tensor(choice["logprobs"]["token_logprobs"])
    prompt_ids = out["prompt_token_ids"]
    with torch.no_grad():          # the trainer's own peft model on the bits it published as v1
        trained = score_tokens(model, prompt_ids + choice["token_ids"], len(prompt_ids))
    d = sampled - trained
    k1, k2, k3 = float(d.mean()), float((d * d).mean() / 2), float((torch.exp(-d) - 1 + d).mean())
    assert torch.equal(sampled, trained) and k1 == k2 == k3 == 0.0


def test_an_adapter_that_trains_a_whole_module_too_is_served_on_its_base(lm_dir, tmp_path):
    """modules_to_save: peft keeps the base's lm_head as original_module beside the trained copy; the base's
    digest is still the base's own, and the trained copy travels with the adapter."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(lm_dir, dtype=torch.bfloat16)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            modules_to_save=["lm_head"]))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    truth: dict[int, dict] = {}
    url = str(tmp_path / "run")
    with Publisher(url, anchor_chain_fraction=10.0) as pub:
        publish_steps(pub, model, opt, range(2), truth)
    assert SnapshotReader(url).manifest(0).adapter.base_xxh3 == BaseModel.of(lm_dir).xxh3
    assert any("lm_head" in n for n in truth[1])
    replica = reference.build(bucket=url, snapshot=0, base_model=lm_dir)
    replica.swapper.hotload(1)
    assert bits_differ(replica.swapper.weights, truth[1]) == []


def test_an_adapter_published_in_bf16_is_served_in_bf16_not_in_the_fp32_peft_would_make_it(lm_dir, tmp_path):
    """Publisher(dtype=torch.bfloat16): the replica's live adapter is the published bf16 bits (peft's autocast
    would load them into fp32 parameters, another policy), hot-loaded bit-exact."""
    model, opt = peft_model(lm_dir)
    truth: dict[int, dict] = {}
    url = str(tmp_path / "run")
    with Publisher(url, dtype=torch.bfloat16, anchor_chain_fraction=10.0) as pub:
        for step in range(2):
            train_step(model, opt, seed=step)
            r = pub.publish(model, step)
            truth[r.version] = {k: v.to(torch.bfloat16) for k, v in adapter_bits(model).items()}
    replica = reference.build(bucket=url, snapshot=0, base_model=lm_dir)
    assert {t.dtype for t in replica.swapper.weights.values()} == {torch.bfloat16}
    assert bits_differ(replica.swapper.weights, truth[0]) == []
    replica.swapper.hotload(1)
    assert bits_differ(replica.swapper.weights, truth[1]) == []


def test_an_fp32_adapter_kept_exact_serves_its_bf16_cast_and_reads_back_as_the_trainer_held_it(lm_dir, tmp_path):
    """Publisher(dtype=torch.bfloat16, keep_exact=True) on an fp32 peft adapter: the replica hot-loads the bf16
    cast, the anchor is a bf16 PEFT directory, and read_exact gives every version's fp32 adapter bit for bit."""
    from safetensors.torch import load_file

    model, opt = peft_model(lm_dir)
    truth: dict[int, dict] = {}
    url = str(tmp_path / "run")
    with Publisher(url, dtype=torch.bfloat16, keep_exact=True) as pub:
        publish_steps(pub, model, opt, range(3), truth)
    assert {t.dtype for t in truth[0].values()} == {torch.float32}
    bf16 = {v: {k: t.to(torch.bfloat16) for k, t in ts.items()} for v, ts in truth.items()}
    reader = SnapshotReader(url)
    anchor = reader.manifest(0).objects[0].key
    assert anchor.endswith("adapter_model.safetensors")
    assert bits_differ(load_file(os.path.join(url, anchor)), bf16[0]) == []
    replica = reference.build(bucket=url, snapshot=0, base_model=lm_dir)
    for v in (1, 2):
        replica.swapper.hotload(v)
        assert bits_differ(replica.swapper.weights, bf16[v]) == []
    for v in (0, 1, 2):
        assert bits_differ(reader.read_exact(v), truth[v]) == []
    # the trainer's adapter directory to resume from: fp32, as peft saved it, beside the bf16 one replicas load
    out = reader.materialize(2, str(tmp_path / "resume"), exact=True)
    assert sorted(os.listdir(out)) == ["adapter_config.json", "adapter_model.safetensors"]
    assert bits_differ(load_file(os.path.join(out, "adapter_model.safetensors")), truth[2]) == []


def record_encodings(url: str, version: int) -> dict[str, int]:
    """Chunk encodings of every record a snapshot stored, counted (its checksums verified)."""
    from ckptdelta.delta.codec import EncodedTensor

    reader = SnapshotReader(url)
    m = reader.manifest(version)
    out: dict[str, int] = {}
    for e in m.tensors.values():
        if e.object is None or m.kind != "delta":
            continue
        data = reader.store.get(m.objects[e.object].key, (e.offset, e.offset + e.length))
        for k, n in EncodedTensor.from_bytes(data).encoding_counts().items():
            out[k] = out.get(k, 0) + n
    return out


@pytest.mark.parametrize("codec,against_grand", [("context", "pctx"), ("fast", "grouped_pstep")])
def test_deltas_after_the_first_are_coded_against_their_grandparent_and_every_reader_rebuilds_them(
        lm_dir, tmp_path, capsys, codec, against_grand):
    """A LoRA run's delta whose parent is a delta too is coded against the snapshot before (docs/FORMAT.md
    encoding 6 with the context coder, ~12% smaller where every element moves; 9 with the fast path, 5-6%
    smaller than its 8): the publisher keeps it, a replica keeps each tensor's
    bits before its last change, and every reader rebuilds each version bit-exact: the reader, verify, a replica
    hot-loading forward (without the anchor route), back and across an anchor, one started on a delta (forward
    too: materializing kept the bits), one that lost what it kept or holds other bits (it takes the anchor route),
    and a restarted publisher rebuilding its parent."""
    model, opt = peft_model(lm_dir)
    truth: dict[int, dict] = {}
    url = str(tmp_path / "run")
    with Publisher(url, codec=codec, anchor_every=4, dtype=torch.bfloat16) as pub:
        results = publish_steps(pub, model, opt, range(7), truth)
    truth = {v: {k: t.to(torch.bfloat16) for k, t in ts.items()} for v, ts in truth.items()}
    assert [r.kind for r in results] == ["anchor", "delta", "delta", "delta", "anchor", "delta", "delta"]
    for v in (1, 5):                       # a delta on an anchor: there is no step before
        assert against_grand not in record_encodings(url, v)
    for v in (2, 3, 6):
        assert against_grand in record_encodings(url, v), v

    reader = SnapshotReader(url)
    for v in range(7):
        assert bits_differ(reader.read_tensors(v), truth[v]) == [], f"v{v}"
    assert main(["verify", url]) == 0

    replica = reference.build(bucket=url, snapshot=0, base_model=lm_dir)
    swapper = replica.swapper
    for v in [1, 2, 3, 4, 5, 6, 5, 2, 3, 0, 6]:
        report = swapper.hotload(v)
        assert bits_differ(swapper.weights, truth[v]) == [], f"v{v}"
        if v in (2, 3, 6) and report.from_version == v - 1:
            assert not report.via_anchor, f"v{v} took the anchor route"
        if v in (1, 2, 3) and report.from_version == v - 1:
            # what the replica keeps of each tensor v changed is its bits before: v-1's (a densely staged
            # tensor's kept bits are the array the commit swapped them into, not a copy taken before)
            kept = {n: p.tensor for n, p in swapper._priors.items() if p.version == v}
            assert kept and report.tensors_copied > 0, f"v{v}: {len(kept)} kept, {report.tensors_copied} copied"
            assert [n for n, t in kept.items() if not torch.equal(t.view(torch.uint8),
                                                                   truth[v - 1][n].view(torch.uint8))] == [], f"v{v}"
    # a replica started on a delta keeps, from materializing it, the bits v6's records need
    started = reference.build(bucket=url, snapshot=5, base_model=lm_dir)
    assert not started.swapper.hotload(6).via_anchor
    assert bits_differ(started.swapper.weights, truth[6]) == []
    lost = reference.build(bucket=url, snapshot=0, base_model=lm_dir)
    lost.swapper.hotload(1)
    lost.swapper._priors.clear()                 # v2's records need v0's bits, which it no longer has
    assert lost.swapper.hotload(2).via_anchor
    assert bits_differ(lost.swapper.weights, truth[2]) == []
    for kept in lost.swapper._priors.values():                   # kept for v3's records, now not v1's bits
        kept.tensor.fill_(1.0)
    assert lost.swapper.hotload(3).via_anchor                     # refused as such, dropped, rebuilt
    assert bits_differ(lost.swapper.weights, truth[3]) == []

    with Publisher(url, codec=codec, dtype=torch.bfloat16) as pub:      # rebuilds its parent (v6) first
        more = publish_steps(pub, model, opt, range(7, 9), truth)
    truth = {v: {k: t.to(torch.bfloat16) for k, t in ts.items()} for v, ts in truth.items()}
    assert [r.kind for r in more] == ["delta", "delta"]
    assert against_grand not in record_encodings(url, 7) and against_grand in record_encodings(url, 8)
    for sw in (swapper, started.swapper):
        assert not sw.hotload(7).via_anchor and not sw.hotload(8).via_anchor
        assert bits_differ(sw.weights, truth[8]) == []


# --- what the reviews of issue 39 tried (docs/GUARANTEES.md, "What the reviews tried, and held") ---------------


def test_a_base_swapped_or_changed_under_one_publisher_is_recorded_as_itself_and_replicas_refuse_its_adapters(
        lm_dir, tmp_path, caplog):
    """The publisher hashes the peft model's base at its first publish and again whenever the base is not the one
    it hashed (publisher/lora.py, base_key): a base weight the trainer trains too (an in-place write torch
    counts), then a second peft model on another base, are recorded as the bases they are. Each starts an anchor
    naming both digests, and a replica on the first base refuses them in one line and serves on; an unchanged
    base is hashed once. (It recorded the first base for every adapter, the changed base's as a plain delta: a
    replica served them on a base they were not trained on.)"""
    import logging

    from tests.lm import save_tiny_lm

    other = save_tiny_lm(str(tmp_path / "other-lm"), seed=1)       # same architecture, other weights
    first = BaseModel.of(lm_dir).xxh3
    model, opt = peft_model(lm_dir)
    truth: dict[int, dict] = {}
    url = str(tmp_path / "run")
    caplog.set_level(logging.INFO, logger="ckptdelta.publisher")
    with Publisher(url, anchor_chain_fraction=10.0) as pub:
        results = publish_steps(pub, model, opt, range(2), truth)
        norm = model.get_base_model().model.norm.weight            # the trainer trains a base weight too
        norm.requires_grad_(True)
        opt.add_param_group({"params": [norm], "lr": 0.1})         # (at 1e-4 no bf16 bit of ~1.0 would move)
        results += publish_steps(pub, model, opt, range(2, 3), truth)
        changed = BaseModel.of(model).xxh3
        other_model, other_opt = peft_model(other)
        results += publish_steps(pub, other_model, other_opt, range(3, 4), truth)
    elsewhere = BaseModel.of(other).xxh3
    assert [r.kind for r in results] == ["anchor", "delta", "anchor", "anchor"]
    hashes = [r.getMessage() for r in caplog.records if r.getMessage().startswith("LoRA run: ")]
    assert len(hashes) == 3, hashes                                 # v0, v2 and v3: not v1's unchanged base
    reader = SnapshotReader(url)
    assert [reader.manifest(v).adapter.base_xxh3 for v in range(4)] == [first, first, changed, elsewhere]
    assert first != changed
    for r, (was, now) in zip(results[2:], [(first, changed), (changed, elsewhere)]):
        assert r.reason.startswith("the base model changed") and was in r.reason and now in r.reason, r.reason

    replica = reference.build(bucket=url, snapshot=1, base_model=lm_dir)
    for v, digest in ((2, changed), (3, elsewhere)):
        with pytest.raises(HotLoadError, match="this replica serves base") as e:
            replica.swapper.hotload(v)
        assert "\n" not in str(e.value) and digest in str(e.value) and first in str(e.value)
        assert replica.version == 1 and bits_differ(replica.swapper.weights, truth[1]) == []
    on_other = reference.build(bucket=url, snapshot=3, base_model=other)
    assert bits_differ(on_other.swapper.weights, truth[3]) == []


def test_an_adapter_whose_parameters_are_replaced_or_reassigned_between_publishes_is_published_as_it_is_then(
        lm_dir, tmp_path):
    """The publisher takes peft's state dict of a peft model once and reads the model's own tensors through it on
    later publishes (publisher/lora.py, adapter_key), taking it again wherever the model is not the one it was
    taken from: a LoRA weight replaced by a new Parameter, one whose ``.data`` is reassigned, a second adapter
    made the active one, and a second peft model are each published with their own bits, and a replica
    rebuilds every version to what peft's own state dict said then."""
    from peft import LoraConfig

    model, opt = peft_model(lm_dir)
    truth: dict[int, dict] = {}
    url = str(tmp_path / "run")
    lora_a = next(m for n, m in model.named_modules() if n.endswith("q_proj") and hasattr(m, "lora_A"))
    lora_b = next(m for n, m in model.named_modules() if n.endswith("v_proj") and hasattr(m, "lora_B"))
    g = torch.Generator().manual_seed(7)

    def publish(m, step: int) -> None:
        from peft import get_peft_model_state_dict

        r = pub.publish(m, step)
        truth[r.version] = {k: v.detach().clone()
                            for k, v in get_peft_model_state_dict(m, adapter_name=m.active_adapter).items()}

    with Publisher(url, anchor_chain_fraction=10.0) as pub:
        publish_steps(pub, model, opt, range(2), truth)
        old = lora_a.lora_A["default"].weight
        lora_a.lora_A["default"].weight = torch.nn.Parameter(torch.randn(old.shape, generator=g).to(old.dtype))
        publish(model, 2)
        w = lora_b.lora_B["default"].weight
        w.data = torch.randn(w.shape, generator=g).to(w.dtype)
        publish(model, 3)
        model.add_adapter("second", LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0))
        model.set_adapter("second")
        with torch.no_grad():
            for n, p in model.named_parameters():
                if ".second." in n:
                    p.add_(torch.randn(p.shape, generator=g).to(p.dtype))
        publish(model, 4)
        other, _ = peft_model(lm_dir, seed=1)
        publish(other, 5)
    reader = SnapshotReader(url)
    for v, want in truth.items():
        got = reader.materialize(v, str(tmp_path / f"v{v}"))
        from safetensors.torch import load_file

        assert bits_differ(load_file(os.path.join(got, "adapter_model.safetensors")), want) == [], v
    assert not any(torch.equal(truth[4][k], truth[3][k]) for k in truth[3])   # the second adapter's own bits


FSDP2_PEFT_SCRIPT = """
import os, sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from peft import get_peft_model_state_dict
from safetensors.torch import load_file
from ckptdelta.loader import SnapshotReader
from ckptdelta.publisher import AdapterSpec, BaseModel, Publisher
from tests.publisher.test_lora_publish import peft_model, train_step
lm_dir, url, out = sys.argv[1:4]
dist.init_process_group("gloo", rank=0, world_size=1)
model, _ = peft_model(lm_dir)
fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
truth = {}
# the base declared (AdapterSpec): the publisher does not hash an FSDP2 model's sharded base itself
with Publisher(url, adapter=AdapterSpec(model.peft_config["default"], BaseModel.of(lm_dir))) as pub:
    for step in range(3):
        train_step(model, opt, seed=step)
        r = pub.publish(model, step)
        truth[r.version] = {k: v.full_tensor().clone() for k, v in get_peft_model_state_dict(model).items()}
reader = SnapshotReader(url)
for v, want in truth.items():
    got = load_file(os.path.join(reader.materialize(v, os.path.join(out, str(v))), "adapter_model.safetensors"))
    assert sorted(got) == sorted(want), v
    assert all(torch.equal(got[k].view(torch.uint8), want[k].view(torch.uint8)) for k in want), v
assert len({tuple(t[next(iter(t))].flatten()[:4].tolist()) for t in truth.values()}) == 3
from ckptdelta.delta.errors import PublishInputError
try:                   # the base not declared: one line that says how, nothing written
    with Publisher(os.path.join(out, "undeclared")) as undeclared:
        undeclared.publish(model, 0)
    raise AssertionError("an FSDP2 model's base was hashed from its shards")
except PublishInputError as e:
    assert "DTensor" in str(e) and "AdapterSpec" in str(e) and "\\n" not in str(e), e
assert not os.path.exists(os.path.join(out, "undeclared", "manifests"))
dist.destroy_process_group()
print("ok")
"""


def test_a_peft_model_sharded_by_fsdp2_on_one_rank_publishes_each_steps_bits(lm_dir, tmp_path):
    """peft's state dict of an FSDP2 model holds DTensors, which share no storage address with their shards: the
    publisher takes it again on every publish instead of reading the next steps through it (publisher/lora.py,
    _views_of), and each version is the trainer's bits. (The first cut of that reuse raised on DTensors.) A base
    of DTensors the publisher cannot hash is refused in one line naming AdapterSpec (it crashed in numpy)."""
    import subprocess
    import sys

    from tests.servers import free_port

    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    r = subprocess.run([sys.executable, "-c", FSDP2_PEFT_SCRIPT, lm_dir, str(tmp_path / "run"), str(tmp_path / "out")],
                       capture_output=True, text=True, timeout=300, env=env, cwd=os.getcwd())
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_target_modules_or_rank_changing_anchor_serve_bit_exact_once_restarted_and_a_replica_refuses_naming_the_change(
        lm_dir, tmp_path):
    """An adapter whose target modules, then rank, change between versions: each change is an anchor whose reason
    names it; a replica holding the adapter before refuses it in one line naming what changed and serves on; one
    started on a delta after the change serves it bit-exact, rolls back to its anchor, and refuses the other
    configs both ways."""
    url = str(tmp_path / "run")
    truth: dict[int, dict] = {}
    with Publisher(url, anchor_chain_fraction=10.0) as pub:
        model, opt = peft_model(lm_dir)                                       # every linear layer, r 4
        results = publish_steps(pub, model, opt, range(2), truth)
        model, opt = peft_model(lm_dir, target_modules=["q_proj", "v_proj"])
        results += publish_steps(pub, model, opt, range(2, 4), truth)
        model, opt = peft_model(lm_dir, r=8, target_modules=["q_proj", "v_proj"])
        results += publish_steps(pub, model, opt, range(4, 6), truth)
    assert [r.kind for r in results] == ["anchor", "delta"] * 3
    assert "-> [q_proj,v_proj]" in results[2].reason and "r 4 -> 8" in results[4].reason

    def refused(replica, v: int, change: str) -> None:
        before = replica.version
        with pytest.raises(HotLoadError, match="another adapter config") as e:
            replica.swapper.hotload(v)
        msg = str(e.value)
        assert "\n" not in msg and change in msg and f"serve --snapshot v{v:08d}" in msg, msg
        assert replica.version == before and bits_differ(replica.swapper.weights, truth[before]) == []

    replica = reference.build(bucket=url, snapshot=1, base_model=lm_dir)
    refused(replica, 2, "-> [q_proj,v_proj]")
    restarted = reference.build(bucket=url, snapshot=3, base_model=lm_dir)     # a delta after the change
    assert bits_differ(restarted.swapper.weights, truth[3]) == []
    for v in (2, 3):
        restarted.swapper.hotload(v)
        assert bits_differ(restarted.swapper.weights, truth[v]) == [], f"v{v}"
    refused(restarted, 4, "r 4 -> 8")
    refused(restarted, 1, "[q_proj,v_proj] -> ")
    ranked = reference.build(bucket=url, snapshot=5, base_model=lm_dir)
    assert bits_differ(ranked.swapper.weights, truth[5]) == []
    ranked.swapper.hotload(4)
    assert bits_differ(ranked.swapper.weights, truth[4]) == []


def test_an_adapter_state_dict_its_config_does_not_describe_is_refused_before_anything_is_written(
        lm_dir, tmp_path, capsys):
    """Publisher(adapter=AdapterSpec(config, base)) with a state dict of another rank, or on modules the config's
    target_modules do not name, and an adapter directory whose weights are not its config's: one line naming the
    tensor, nothing committed. (It committed an anchor whose adapter_config.json lied about its tensors: peft
    refused to load it with a RuntimeError, an engine taking the rank from the tensors would serve another
    scaling.)"""
    from safetensors.torch import save_file

    r4, _ = peft_model(lm_dir)
    r8, _ = peft_model(lm_dir, r=8)
    qv, _ = peft_model(lm_dir, target_modules=["q_proj", "v_proj"])
    url = str(tmp_path / "run")
    with Publisher(url, adapter=AdapterSpec(r4.peft_config["default"], BaseModel.of(lm_dir))) as pub:
        pub.publish(adapter_bits(r4), 0)
        with pytest.raises(PublishInputError) as e:
            pub.publish(adapter_bits(r8), 1)
        msg = str(e.value)
        assert "\n" not in msg and "lora_A.weight' has rank 8" in msg and "says r 4" in msg, msg
    with Publisher(str(tmp_path / "run-qv"), adapter=AdapterSpec(qv.peft_config["default"],
                                                                 BaseModel.of(lm_dir))) as pub:
        with pytest.raises(PublishInputError, match=r"k_proj'?, which the adapter config's target_modules"):
            pub.publish(adapter_bits(r4), 0)
    assert SnapshotReader(url).versions() == [0]

    r4.save_pretrained(str(tmp_path / "adapter"))          # its weights replaced by a rank-8 adapter's
    save_file({k: v.contiguous() for k, v in adapter_bits(r8).items()},
              str(tmp_path / "adapter" / "adapter_model.safetensors"))
    capsys.readouterr()
    assert main(["publish", str(tmp_path / "adapter"), url, "--step", "1"]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "has rank 8" in err, err
    assert SnapshotReader(url).versions() == [0]


def _set_adapter(model, bits: dict[str, torch.Tensor]) -> None:
    """The peft model's adapter parameters set to ``bits`` (peft's saved names), as a trainer holding them would."""
    from peft import get_peft_model_state_dict

    params = {p.data_ptr(): p for p in model.parameters()}
    with torch.no_grad():
        for name, t in get_peft_model_state_dict(model).items():
            params[t.data_ptr()].copy_(bits[name])


def test_a_peft_replica_started_on_a_delta_rolls_back_and_forth_with_each_versions_bits_and_logprobs(
        lm_dir, tmp_path):
    """Over HTTP, a reference replica started on a delta coded against its grandparent is hot-loaded back across
    an anchor, forward again and back by one: after each, its live adapter is that version's bits, its status and
    answers report that version (a minimum above it is 408), and its logprobs equal, bit for bit, the trainer's
    peft model holding that version's bits."""
    from ckptdelta.loader.hf_model import score_tokens
    from ckptdelta.loader.server import create_app

    model, opt = peft_model(lm_dir)
    truth: dict[int, dict] = {}
    url = str(tmp_path / "run")
    with Publisher(url, codec="context", anchor_every=4) as pub:
        results = publish_steps(pub, model, opt, range(7), truth)
    assert [r.kind for r in results] == ["anchor", "delta", "delta", "delta", "anchor", "delta", "delta"]
    assert "pctx" in record_encodings(url, 3)
    replica = reference.build(bucket=url, snapshot=2, base_model=lm_dir)
    assert bits_differ(replica.swapper.weights, truth[2]) == []
    body = {"prompt": PROMPT, "max_tokens": 5, "temperature": 1.0, "seed": 5, "logprobs": 0,
            "score_logprobs": True, "return_engine_data": True}
    with LiveServer(create_app(replica, replica_id="lora-0")) as server, \
            httpx.Client(base_url=server.url, timeout=60) as http:
        for v in [2, 3, 1, 0, 5, 6, 4, 2, 3, 2]:
            job = http.post("/v1/hotload", json={"snapshot": v}).json()
            while job["state"] not in ("READY", "FAILED"):
                job = http.get(f"/v1/hotload/{job['id']}").json()
            assert job["state"] == "READY", job
            assert http.get("/v1/status").json()["policy_version"] == v
            assert bits_differ(replica.swapper.weights, truth[v]) == [], f"v{v}"
            out = http.post("/v1/completions", json=body).json()
            assert out["engine_data"]["policy_version"] == v
            choice, prompt_ids = out["choices"][0], out["prompt_token_ids"]
            _set_adapter(model, truth[v])
            with torch.no_grad():
                trained = score_tokens(model, prompt_ids + choice["token_ids"], len(prompt_ids))
            assert torch.equal(torch.tensor(choice["logprobs"]["token_logprobs"]), trained), f"v{v}"
        r = http.post("/v1/completions", json={**body, "min_policy_version": 3})
        assert r.status_code == 408 and r.json()["error"]["type"] == "policy_version_too_old"
