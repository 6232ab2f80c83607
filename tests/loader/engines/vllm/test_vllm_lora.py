"""A LoRA run served by a real vLLM (its CPU build): adapters hot-loaded into vLLM's LoRA slots in place.

Two vLLMs for the module: the replica's (loader/engines/vllm/lora.py), and a fresh one
on the same base that loaded every version from its PEFT directory at start, the way
users serve adapters. The slot the replica wrote must hold, bit for bit, what vLLM's
own directory load put in the fresh one's slot (scaling folded into B, padding to
--max-lora-rank), and answer the same greedy tokens and logprobs. The replica starts
on a delta (v1), as one started mid-run does.
"""

from __future__ import annotations

import json
import os
import threading
import types

import pytest
import torch

from ckptdelta.delta.errors import HotLoadError, NotServableError
from ckptdelta.loader import SnapshotReader
from ckptdelta.publisher import Publisher
from tests.loader.engines.conformance import EngineContract
from tests.publisher.test_lora_publish import peft_model, train_step
from tests.vllm_models import save_tiny_llama
from tests.vllm_replicas import (VLLM_ARGS, VLLM_ARGS_WITH_STATS, VllmReplicaHandle, one_gpu_layout,  # noqa: F401
                                 vllm_generations)

PROMPTS = ["hello world, hello replica", "the quick brown fox", "one two three four"]
VERSIONS = 6          # v0 anchor, v1-v2 deltas, v3 anchor, v4-v5 deltas


pytestmark = pytest.mark.usefixtures("one_gpu_layout")   # (imported) every vLLM here: its worker in the engine core


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A rank-8 adapter on every linear layer of the tiny Llama (rank 4 on q_proj, so that its rows in vLLM's
    rank-8 buffers are padded and every comparison with vLLM's own load covers the padding too), trained with
    AdamW; each version also materialized as the PEFT directory users would load."""
    root = tmp_path_factory.mktemp("vllm-lora")
    base = save_tiny_llama(str(root / "base"))
    model, opt = peft_model(base, r=8, alpha=16, rank_pattern={"q_proj": 4})
    for group in opt.param_groups:       # steps large enough that versions answer different greedy tokens: at
        group["lr"] = 1e-2               # 3e-3, v3-v5 shared their first 8 tokens and vLLM's numerics decided the rest
    url = str(root / "run")
    pub = Publisher(url, anchor_every=3, codec="context")     # v2 and v5 coded against their grandparent too
    kinds = []
    for step in range(VERSIONS):
        train_step(model, opt, seed=step)
        kinds.append(pub.publish(model, step).kind)
    assert kinds == ["anchor", "delta", "delta", "anchor", "delta", "delta"]
    reader = SnapshotReader(url)
    dirs = {v: reader.materialize(v, str(root / f"dir-v{v}")) for v in range(VERSIONS)}
    yield {"base": base, "url": url, "dirs": dirs, "pub": pub, "model": model, "opt": opt, "root": root}
    pub.close()


@pytest.fixture(scope="module")
def rep(lora_run):
    from ckptdelta.loader.engines import build_engine

    engine = build_engine("vllm", bucket=lora_run["url"], snapshot=1, base_model=lora_run["base"], lora_slots=3,
                          vllm_args=VLLM_ARGS_WITH_STATS)      # started on a delta; the contract reads vLLM's counts
    r = VllmReplicaHandle(engine, replica_id="lora-0")
    yield r
    r.close()


@pytest.fixture(scope="module")
def fresh(lora_run):
    """A fresh vLLM on the base that loaded every version from its PEFT directory at start, the way users
    serve adapters (``--lora-modules v0=DIR ...``): adapter id v+1 holds version v."""
    from ckptdelta.loader.engines.vllm.control import VllmControl
    from ckptdelta.loader.engines.vllm.server import VllmServer

    server = VllmServer(lora_run["base"], served_name="base", args=[
        *VLLM_ARGS, "--enable-lora", "--max-loras", str(VERSIONS), "--max-cpu-loras", str(VERSIONS),
        "--max-lora-rank", "8", "--lora-modules", *[f"v{v}={d}" for v, d in lora_run["dirs"].items()]])
    try:
        server.wait_ready()
        control = VllmControl(server.url)
        assert control.rpc("ckptdelta_lora_slots", {})[0]["registered"] == list(range(1, VERSIONS + 1))
        yield control
        control.close()
    finally:
        server.stop()


def slot_digests(control, lora_id: int) -> dict[str, str]:
    return control.rpc("ckptdelta_lora_digests", {"id": lora_id})[0]["digests"]


def greedy(post, model: str | None, prompt: str, max_tokens: int = 8) -> tuple[list[int], list[float], dict]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "logprobs": 1,
            "return_token_ids": True}
    if model is not None:
        body["model"] = model
    r = post(body)
    assert r.status_code == 200, r.text
    out = r.json()
    choice = out["choices"][0]
    return choice["token_ids"], choice["logprobs"]["token_logprobs"], out


def on_fresh(fresh):
    return lambda body: fresh.http.post("/v1/completions", json=body)


def test_a_replica_started_on_a_delta_serves_its_exact_bits_and_hot_loads_the_next_delta_forward(rep, fresh):
    """Started on v1 (a delta): every slot holds, bit for bit, what vLLM's own load of v1's PEFT directory holds;
    the next delta, coded against v0 too, is hot-loaded forward (the bits materializing v1 kept, not the anchor
    route), written, proven and equal to vLLM's own load of v2's directory. Before it said it served, every slot
    answered a warm-up request (vLLM builds its LoRA path on the first one)."""
    engine = rep.engine
    assert engine.version == 1 and {s.version for s in engine.slots.slots} == {1}
    assert engine.status()["lora_warm_s"] > 0
    for s in engine.slots.slots:
        assert slot_digests(engine.applier.control, s.id) == slot_digests(fresh, 2)
    assert rep.complete(max_tokens=2, return_engine_data=True)["engine_data"]["policy_versions"] == [1]
    job = rep.hotload(2)
    assert job["state"] == "READY" and job["report"]["via_anchor"] is False, job
    last = engine.applier.last
    assert last["version"] == 2 and last["written"] and last["proven"] == "full"
    assert slot_digests(engine.applier.control, engine.slots.newest().id) == slot_digests(fresh, 3)


def test_every_version_is_written_into_a_slot_in_place_proven_and_equal_to_vllms_own_directory_load(rep, fresh):
    """Forward across the anchor at v3, back and a jump: each hot-load READY with the replica's own full proof
    of the slot, and the slot bit-identical to the one a fresh vLLM filled from that version's PEFT directory; a version
    still resident in a slot is proven where it sits, not written again."""
    engine = rep.engine
    written = []
    for v in [1, 2, 3, 4, 5, 4, 2, 0, 5]:
        job = rep.hotload(v)
        assert job["state"] == "READY", job
        last = engine.applier.last
        assert engine.version == v and last["version"] == v and last["proven"] == "full"
        written.append(last["written"])
        assert all(w["checked"] > 0 for w in last["workers"])
        # a written version was prepared in each worker's thread while vLLM generated, not inside the write
        assert all((w["staged"] is True) == last["written"] for w in last["workers"]), last["workers"]
        serving = engine.slots.newest()
        assert serving.version == v and serving.name == last["slot"]
        assert slot_digests(engine.applier.control, serving.id) == slot_digests(fresh, v + 1), f"v{v}"
        out = rep.complete(max_tokens=2, temperature=0.0, return_engine_data=True)
        assert out["engine_data"]["policy_versions"] == [v] and out["model"] == engine.model_name
    # 3 slots, v1 (the start) and v2 (the test before) resident: proven where they sat, nothing written; then
    # v3-v5 written, v4 still resident; v2, v0 and then v5 written again
    assert written == [False, False, True, True, True, False, True, True, True]
    status = rep.http.get("/v1/status").json()["engine"]
    assert [s["version"] for s in status["lora_slots"] if s["serving"]] == [5]


def test_an_fp32_adapter_cast_on_the_trainer_fills_the_slot_vllm_fills_from_the_fp32_directory(rep, fresh,
                                                                                                  lora_run, tmp_path):
    """The run publishes fp32 adapters and vLLM holds LoRA weights in bf16: the replica says so, naming
    Publisher(dtype=torch.bfloat16), and that publisher's cast (publisher/host_copy.py's Cast) fills the very slot
    vLLM's own load of the fp32 directory filled, bit for bit: the fresh vLLM's slot of each version is proven
    against the bf16 tensors, and fails where one bit of them differs. The module's scalings (alpha / r: 2, 4) are
    powers of two, which commute with the cast; so each version is also loaded in place with lora_alpha 12
    (scalings 1.5 and 3), where scaling before the cast would give other bits, then loaded back as it was."""
    import shutil

    from safetensors.torch import load_file

    from ckptdelta.delta.lora_record import ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME
    from ckptdelta.loader.engines.shared_weights import SharedWeights
    from ckptdelta.loader.engines.vllm.control import VllmError
    from ckptdelta.loader.engines.vllm.worker.lora_slots import _host_digest
    from ckptdelta.publisher.host_copy import Cast

    def prove(lora_id: int, tensors: dict, config: dict) -> None:
        shared = SharedWeights.create(tensors)
        try:
            req = {"id": lora_id, "path": shared.path, "config": config,
                   "digests": {n: _host_digest(t) for n, t in tensors.items()}}
            assert all(a["checked"] > 0 for a in fresh.rpc("ckptdelta_lora_prove", req))
        finally:
            shared.close()

    status = rep.http.get("/v1/status").json()["engine"]
    assert status["lora_dtype"] == "bfloat16"
    assert "Publisher(dtype=torch.bfloat16)" in status["lora_dtype_note"], status
    for v in (0, 4):
        d = lora_run["dirs"][v]
        fp32 = load_file(os.path.join(d, ADAPTER_WEIGHTS_NAME))
        assert {t.dtype for t in fp32.values()} == {torch.float32}
        cast = Cast(fp32, torch.bfloat16)
        bf16 = {n: cast[n] for n in cast}
        with open(os.path.join(d, ADAPTER_CONFIG_NAME)) as f:
            config = json.load(f)
        before = slot_digests(fresh, v + 1)
        prove(v + 1, bf16, config)
        odd = str(tmp_path / f"alpha12-v{v}")
        shutil.copytree(d, odd)
        with open(os.path.join(odd, ADAPTER_CONFIG_NAME), "w") as f:
            json.dump({**config, "lora_alpha": 12}, f)
        fresh.rpc("ckptdelta_lora_load_dir", {"name": f"v{v}", "id": v + 1, "path": odd})
        try:
            assert slot_digests(fresh, v + 1) != before
            prove(v + 1, bf16, {**config, "lora_alpha": 12})
            name = sorted(bf16)[0]
            flipped = {**bf16, name: bf16[name].clone()}
            flipped[name].view(torch.int16).view(-1)[0] ^= 1        # one bit of one element: the proof must see it
            with pytest.raises(VllmError, match="differs from vLLM's own load"):
                prove(v + 1, flipped, {**config, "lora_alpha": 12})
        finally:
            fresh.rpc("ckptdelta_lora_load_dir", {"name": f"v{v}", "id": v + 1, "path": d})
        assert slot_digests(fresh, v + 1) == before


def test_a_preparation_whose_host_copy_fails_its_digests_writes_nothing_and_the_write_refuses(rep):
    """The worker's preparation (run in its thread while vLLM generates) verifies the host copy first: with a
    digest that does not match, it fails naming the tensor, the write that follows refuses, and the slot keeps
    the bits it held."""
    from ckptdelta.loader.engines.vllm.control import VllmError

    a = rep.engine.applier
    serving = rep.engine.slots.newest()
    other = next(s for s in rep.engine.slots.slots if s is not serving and s.ready)
    before = slot_digests(a.control, other.id)
    digests = a.digests(serving.version)
    name = sorted(digests)[0]
    digests[name] = "0" * 16
    req = {"id": other.id, "path": a.shared.path, "digests": digests, "config": a.config, "token": "t-bad"}
    a.control.rpc("ckptdelta_lora_stage", req)
    answers = a.control.poll("ckptdelta_lora_staged", "t-bad", "preparing a bad host copy")
    assert all(x["state"] == "failed" and name in x["why"] for x in answers), answers
    with pytest.raises(VllmError) as e:
        a.control.rpc("ckptdelta_lora_write", req)
    assert name in str(e.value) and "digests" in str(e.value)
    assert slot_digests(a.control, other.id) == before
    assert rep.complete(max_tokens=1, return_engine_data=True)["engine_data"]["policy_versions"] == [serving.version]


def test_a_hotload_whose_workers_find_the_host_copy_wrong_fails_naming_the_tensor_and_serves_on(rep, monkeypatch):
    """The replica's own path (each worker prepares, writes between two steps and proves in its thread, and
    answers in a file): a host copy that fails its digests is written nowhere; the hot-load FAILs naming the
    tensor and the worker, the claimed slot stays out of service, the replica serves what it served, no answer
    file is left beside the host copy, and the next hot-load of that version is written and proven."""
    import glob

    engine, a = rep.engine, rep.engine.applier
    before = engine.version
    ready = sum(s.ready for s in engine.slots.slots)
    target = next(v for v in range(VERSIONS) if engine.slots.holding(v) is None)
    real = a.digests
    name = sorted(real(target))[0]
    monkeypatch.setattr(a, "digests", lambda v: {**real(v), name: "0" * 16})
    job = rep.hotload(target)
    assert job["state"] == "FAILED" and name in job["reason"] and "vLLM worker 0 failed" in job["reason"], job
    assert engine.version == before and engine.slots.holding(target) is None
    assert sum(s.ready for s in engine.slots.slots) == ready - 1           # the slot claimed for it
    assert rep.complete(max_tokens=1, return_engine_data=True)["engine_data"]["policy_versions"] == [before]
    assert glob.glob(a.shared.path + ".lora-*") == []
    monkeypatch.setattr(a, "digests", real)
    job = rep.hotload(target)
    assert job["state"] == "READY" and a.last["written"] and engine.version == target, job
    # the pause reported is what vLLM's steps waited for in the worker (the copy and the proof ran beside them)
    assert all(w["prove_s"] > 0 and w["write_s"] > 0 for w in a.last["workers"]), a.last["workers"]
    assert a.last["pause_s"] == max(w["held_s"] for w in a.last["workers"])
    # the preparation's parts (the host copy verified, vLLM's transform, the proof's reference) add up to it;
    # the linear layers' rows were copied from the reference (and proven, as every layer's)
    for w in a.last["workers"]:
        assert w["layers_copied"] > 0 and w["checked"] > 0, w
        parts = w["prepare_parts"]
        assert set(parts) == {"verify_s", "transform_s", "reference_s"} and min(parts.values()) > 0, w
        assert sum(parts.values()) <= w["prepare_s"], w


def test_a_slot_rewritten_behind_the_replicas_back_fails_its_proof_when_its_version_comes_back_and_is_retired(
        rep, lora_run):
    """A resident slot that no longer holds its version (here vLLM's own in-place load of another version's
    PEFT directory into it, as a stray ``load_lora_adapter`` would do) fails its proof when that version is
    hot-loaded again: the job FAILs naming the slot's buffers, the slot is out of service, the replica serves
    on; the next hot-load of that version writes it anew and proves it."""
    engine, a = rep.engine, rep.engine.applier
    serving = engine.slots.newest()
    other = next(s for s in engine.slots.slots if s is not serving and s.ready)
    held = other.version
    wrong = next(v for v in lora_run["dirs"] if v != held)
    a.control.rpc("ckptdelta_lora_load_dir", {"name": other.name, "id": other.id, "path": lora_run["dirs"][wrong]})
    job = rep.hotload(held)
    assert job["state"] == "FAILED" and "differs from vLLM's own load" in job["reason"], job
    assert not other.ready and engine.version == serving.version
    assert rep.complete(max_tokens=1, return_engine_data=True)["engine_data"]["policy_versions"] == [serving.version]
    job = rep.hotload(held)
    assert job["state"] == "READY" and engine.applier.last["written"] and engine.version == held, job


def test_the_replica_answers_the_greedy_tokens_and_logprobs_of_a_fresh_vllm_that_loaded_the_adapter_directory(
        rep, fresh):
    job = rep.hotload(2)
    assert job["state"] == "READY", job
    mine = [greedy(lambda b: rep.post("/v1/completions", b), None, p)[:2] for p in PROMPTS]
    assert mine == [greedy(on_fresh(fresh), "v2", p)[:2] for p in PROMPTS]
    # and the adapter matters: the base alone answers otherwise for at least one prompt
    assert mine != [greedy(on_fresh(fresh), "base", p)[:2] for p in PROMPTS]


def test_requests_in_flight_across_hot_loads_each_report_one_version_and_finish_on_it(rep, fresh):
    """Clients sample greedily all along while the replica hot-loads back and forth: every answer reports one
    version, and its tokens are that version's own (a fresh vLLM's directory load of it answers the same)."""
    want = {v: greedy(on_fresh(fresh), f"v{v}", PROMPTS[0], 16)[0] for v in (3, 4, 5)}
    assert len({tuple(t) for t in want.values()}) > 1        # the versions answer differently
    assert rep.hotload(3)["state"] == "READY"
    stop = threading.Event()
    answers: list[tuple[list, list[int]]] = []
    errors: list[str] = []

    def client() -> None:
        import httpx

        with httpx.Client(base_url=rep.url, timeout=120) as http:
            while not stop.is_set():
                r = http.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 16, "temperature": 0.0,
                                                       "return_token_ids": True, "return_engine_data": True})
                if r.status_code != 200:
                    errors.append(f"{r.status_code} {r.text[:200]}")
                    continue
                out = r.json()
                answers.append((out["engine_data"]["policy_versions"], out["choices"][0]["token_ids"]))

    threads = [threading.Thread(target=client, daemon=True) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        for v in (4, 5, 3, 4):
            while sum(1 for vs, _ in answers if vs == [rep.engine.version]) < 2:   # requests on the old one
                assert not errors, errors[:3]
                threading.Event().wait(0.05)
            assert rep.hotload(v)["state"] == "READY"
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    assert errors == []
    assert {tuple(vs) for vs, _ in answers} >= {(3,), (4,), (5,)}
    for versions, tokens in answers:
        assert len(versions) == 1 and tokens == want[versions[0]], versions


def test_an_adapter_vllm_has_no_layer_for_is_refused_in_one_line(rep, lora_run, tmp_path):
    """A PEFT directory with a tensor on a module the model lacks: vLLM refuses it when the replica registers
    its slots, and the replica says so in one line naming the snapshot (the replica's own vLLM, through the
    same registration)."""
    import shutil

    from safetensors.torch import load_file, save_file

    from ckptdelta.loader.engines.vllm.lora import Slot, SlotTable, register_slots

    bad = str(tmp_path / "bad")
    shutil.copytree(lora_run["dirs"][0], bad)
    tensors = load_file(f"{bad}/adapter_model.safetensors")
    some = next(n for n in tensors if n.endswith("q_proj.lora_A.weight"))
    tensors[some.replace("q_proj", "router_proj")] = tensors[some].clone()
    save_file(tensors, f"{bad}/adapter_model.safetensors")
    with pytest.raises(NotServableError) as e:
        register_slots(rep.engine.applier.control, SlotTable([Slot("bad", 99)]), bad, "v00000000 of run r")
    msg = str(e.value)
    assert msg.startswith("v00000000 of run r: vLLM refuses the adapter") and "router_proj" in msg and "\n" not in msg


def test_an_adapter_for_another_base_is_refused_naming_both_before_vllm_starts(lora_run, tmp_path):
    from ckptdelta.loader.engines import build_engine

    other = save_tiny_llama(str(tmp_path / "other"), seed=7)
    with pytest.raises(NotServableError) as e:
        build_engine("vllm", bucket=lora_run["url"], base_model=other)
    msg = str(e.value)
    assert lora_run["base"] in msg and other in msg and "weights xxh3" in msg


def test_a_rank_change_anchors_and_the_replica_refuses_to_hot_load_it_and_serves_on(rep, lora_run):
    """Last: it adds a version to the module's run."""
    from peft import get_peft_model_state_dict

    model, opt = peft_model(lora_run["base"], r=4, alpha=8, seed=1)
    train_step(model, opt, seed=99)
    r = lora_run["pub"].publish(model, 100)
    assert r.kind == "anchor"
    before = rep.engine.version
    job = rep.hotload(r.version)
    assert job["state"] == "FAILED" and "another adapter config" in job["reason"] and "r 8 -> 4" in job["reason"], job
    assert rep.engine.version == before
    assert rep.complete(max_tokens=2, return_engine_data=True)["engine_data"]["policy_versions"] == [before]
    assert get_peft_model_state_dict(model)             # the rank-4 adapter itself was a real one
    with pytest.raises(HotLoadError):
        rep.engine.swapper.hotload(r.version)


class TestVllmLoraEngine(EngineContract):
    """The engine contract (tests/loader/engines/conformance.py) on vLLM serving a LoRA run from its slots, on the
    module's replica: defined last, so that it runs after the module's other tests, and its last case stops it.
    A version's live bits are its slot's, compared with what vLLM's own load of its PEFT directory put in the
    fresh vLLM's."""

    kind = "vllm"

    @pytest.fixture
    def replica(self, rep):
        return rep

    @pytest.fixture
    def published(self, lora_run, fresh):
        return types.SimpleNamespace(run=lora_run, fresh=fresh)

    def hotload_path(self, published):
        return [0, 1, 2, 4, 1], {0, 3}                      # v0-v5: anchors v0 and v3 (VERSIONS)

    def generations(self, replica):
        return vllm_generations(replica.engine)

    def live_diff(self, replica, published, version, tmp_path):
        engine = replica.engine
        slot = engine.slots.holding(version)
        if slot is None:
            return [f"no proven slot holds v{version}"]
        live, fresh = slot_digests(engine.applier.control, slot.id), slot_digests(published.fresh, version + 1)
        return sorted(n for n in live.keys() | fresh.keys() if live.get(n) != fresh.get(n))

    def fail_next_apply(self, replica, monkeypatch):
        """The workers find the host copy wrong (one digest): written nowhere, the claimed slot out of service."""
        a = replica.engine.applier
        real = a.digests
        name = sorted(real(0))[0]
        monkeypatch.setattr(a, "digests", lambda v: {**real(v), name: "0" * 16})

    def failed_apply_target(self, replica, published):
        return next(v for v in range(VERSIONS) if replica.engine.slots.holding(v) is None)

    def after_stream(self, replica):
        """A stream runs on one slot, which it frees."""
        assert all(s["in_flight"] == 0 for s in replica.engine.status()["lora_slots"])

    def assert_released(self, replica):
        assert replica.engine.server.proc.poll() is not None            # vLLM's process group is gone
        assert not os.path.exists(replica.engine.shared.path)           # and the shared host copy
