"""Tensor-parallel vLLM: every rank proves the slice it holds, in checkpoint coordinates, against the host copy.

Two real ranks (a gloo group set up by vLLM's own ``init_distributed_environment``)
build vLLM's layers, load whole checkpoint tensors through vLLM's own weight loaders
and CPU re-packing, and run the worker's read-back; the replica's side
(:func:`ckptdelta.loader.engines.vllm.replica.expected_digests` with the workers' slices,
:func:`ckptdelta.loader.engines.vllm.tp.uncovered`) proves each slice and that the slices
cover every tensor.

Then a real replica over vLLM's CPU build started with ``--tensor-parallel-size 2``
(one start, about 30 s here): hot-loads forward, across an anchor and back, each
proven on both ranks and read back bit-exact; a wrong bit in one rank's slice caught
and repaired; a failed hot-load pushing the old version back on both ranks.

Marked slow (``make stress``): greedy tokens and logprobs equal to a fresh TP-2 vLLM
on the same snapshot (a second start).

Last, the replica's stop: none of the shared memory its vLLM's workers created in ``/dev/shm`` is left.
"""

from __future__ import annotations

import json
import multiprocessing
import os

import pytest
import torch

from ckptdelta.loader.engines.vllm import shm as vllm_shm
from tests.servers import free_port
from tests.vllm_tp_ranks import VOCAB, checkpoint, run_rank

CORRUPT = "model.layers.0.self_attn.o_proj.weight"   # row-parallel: rank 1 holds its input columns 32..63


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Both ranks' answers (rank 1 with one bit flipped in its own part of CORRUPT), and the host copy."""
    from ckptdelta.loader.engines.shared_weights import SharedWeights

    out = tmp_path_factory.mktemp("tp-ranks")
    host = SharedWeights.create(checkpoint())
    ctx = multiprocessing.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=run_rank, args=(r, port, host.path, str(out), CORRUPT)) for r in (0, 1)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(600)
        assert [p.exitcode for p in procs] == [0, 0]
        answers = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
        yield answers, host
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        host.close()


def _proof(host, answers, names):
    """What VllmApplier.check concludes from the workers' answers: (uncovered names, per worker the names whose
    digest differs from the host copy's same slice)."""
    from ckptdelta.loader.engines.vllm.applier import expected_digests
    from ckptdelta.loader.engines.vllm.tp import uncovered

    parts = [a.get("slices") or {} for a in answers]
    gaps = uncovered({n: tuple(host.tensors[n].shape) for n in names}, parts)
    bad = []
    for a, part in zip(answers, parts):
        want = expected_digests(host, names, set(a["kernel_view"]), part)
        bad.append(sorted(n for n in names if a["digests"].get(n) != want[n]))
    return gaps, bad


def test_each_rank_proves_the_slice_it_holds_of_every_layer_kind_and_together_they_cover_every_tensor(ranks):
    answers, host = ranks
    names = sorted(host.tensors)
    s0, s1 = (a["slices"] for a in answers)
    # column-parallel rows, q by head and k/v by kv head (split: 2 kv heads; replicated: 1 kv head on both ranks)
    assert s0["model.layers.0.self_attn.q_proj.weight"] == [0, 0, 32] and \
        s1["model.layers.0.self_attn.q_proj.weight"] == [0, 32, 32]
    assert s0["model.layers.0.self_attn.k_proj.weight"] == [0, 0, 16] and \
        s1["model.layers.0.self_attn.k_proj.weight"] == [0, 16, 16]
    assert s0["model.layers.1.self_attn.v_proj.weight"] == s1["model.layers.1.self_attn.v_proj.weight"] == [0, 0, 32]
    assert s1["model.layers.1.self_attn.k_proj.bias"] == [0, 0, 32] and \
        s1["model.layers.1.self_attn.q_proj.bias"] == [0, 32, 32]
    assert s1["model.layers.0.mlp.up_proj.weight"] == [0, 64, 64]
    # row-parallel: input columns; its bias whole on every rank
    assert s1["model.layers.1.mlp.down_proj.weight"] == [1, 64, 64] and "model.layers.1.mlp.down_proj.bias" not in s1
    # vocabulary rows without the padding (331 padded to 384: 192 per rank, rank 1's last 53 rows are padding)
    assert s0["model.embed_tokens.weight"] == [0, 0, 192] and s1["model.embed_tokens.weight"] == [0, 192, VOCAB - 192]
    assert s1["lm_head.weight"] == [0, 192, VOCAB - 192]
    assert answers[1]["local_shapes"]["lm_head.weight"] == [VOCAB - 192, 64] and all(a["padding_zero"] for a in answers)
    assert "model.norm.weight" not in s0 and "model.layers.0.input_layernorm.weight" not in s1   # replicated
    # the tied head emits nothing of its own: its logits kernel was checked against the embedding it shares
    assert "tied_head.weight" not in answers[0]["digests"]
    # read through the GEMM kernels where vLLM re-packed them (on AVX-512 CPUs; on AVX2 it keeps the weight) and
    # the LM head's logits kernel always; plain parameters as they are
    for a in answers:
        assert "lm_head.weight" in a["kernel_view"] and "model.embed_tokens.weight" not in a["kernel_view"]
        packed = "model.layers.0.self_attn.o_proj" in a["packed"]
        assert ("model.layers.0.self_attn.o_proj.weight" in a["kernel_view"]) == packed
    gaps, bad = _proof(host, answers, names)
    assert gaps == [] and bad[0] == [] and bad[1] == [CORRUPT]
    assert answers[0]["compare"]["mismatch"] == [] and answers[0]["compare"]["checked"] == len(names)


def test_a_wrong_bit_in_one_ranks_slice_is_caught_on_that_rank_only(ranks):
    answers, host = ranks
    _, bad = _proof(host, answers, [CORRUPT])
    assert bad == [[], [CORRUPT]]
    assert answers[0]["compare"]["mismatch"] == [] and answers[1]["compare"]["mismatch"] == [CORRUPT]
    # the in-pause check by 4 sampled columns: 4 random of the rank's 32 columns may miss the one flipped, never
    # flags another tensor
    assert set(answers[1]["compare_sampled"]["mismatch"]) <= {CORRUPT} and answers[0]["compare_sampled"]["mismatch"] == []
    # the whole-tensor digest would not tell which rank; the slice's does, and the replica hashes the same slice
    from ckptdelta.loader.engines.vllm.applier import expected_digests

    whole = expected_digests(host, [CORRUPT])[CORRUPT]
    assert whole not in (answers[0]["digests"][CORRUPT], answers[1]["digests"][CORRUPT])


def test_an_in_place_patch_writes_each_rank_only_its_own_vocabulary_rows(ranks):
    answers, _ = ranks
    for a in answers:
        assert "model.embed_tokens.weight" in a["patchable"] and a["patched_ok"] and a["padding_zero"]


def test_slices_that_leave_part_of_a_tensor_unproven_are_refused():
    from ckptdelta.loader.engines.vllm.tp import Slice, sliced, uncovered

    shapes = {"w": (6, 4)}
    assert uncovered(shapes, [{"w": [0, 0, 3]}, {"w": [0, 3, 3]}]) == []
    assert uncovered(shapes, [{"w": [0, 0, 6]}, {"w": [0, 0, 6]}]) == []         # replicated, claimed as slices
    assert uncovered(shapes, [{}, {"w": [0, 0, 2]}]) == []                       # one rank holds it whole
    assert uncovered(shapes, [{"w": [0, 0, 3]}, {"w": [0, 4, 2]}]) == ["w"]      # row 3 held by nobody
    assert uncovered(shapes, [{"w": [0, 0, 3]}, {"w": [1, 0, 4]}]) == ["w"]      # mixed dimensions
    assert uncovered(shapes, [{"w": [0, 0, 3]}, {"w": [0, 3, 4]}]) == ["w"]      # past the end
    assert uncovered(shapes, [{"w": [0, 0, 3]}, {"w": "rows 3-5"}]) == ["w"]     # not a slice
    assert uncovered(shapes, [{"w": [1, 0, 2]}, {"w": [1, 2, 2]}]) == []
    t = torch.arange(24).reshape(6, 4)
    assert torch.equal(sliced({"w": t}, ["w"], {"w": [1, 2, 2]})["w"], t[:, 2:4])
    with pytest.raises(ValueError, match="does not fit"):
        Slice(0, 5, 2).of(t)


# --- a real replica over vLLM's CPU build with --tensor-parallel-size 2 ------------------------------------------

TP_ARGS = ["--tensor-parallel-size", "2", "--distributed-executor-backend", "mp"]


@pytest.fixture(scope="module")
def tp_env():
    """VllmServer binds each rank's threads to its share of the cores (ckptdelta.loader.engines.vllm.replica.cpu_thread_binding):
    vLLM's own default binds one rank per NUMA node and refuses 2 ranks on this one-node host."""
    from tests.vllm_replicas import use_one_gpu_layout

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("2 tensor-parallel ranks need 2 cores")
    with pytest.MonkeyPatch.context() as mp:
        use_one_gpu_layout(mp)       # the engine core in the API server's process; the mp executor adds 2 workers
        mp.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
        yield


def _save_tp_llama(out_dir: str) -> str:
    """The tests' Llama (4 heads, 2 kv heads: one per rank) with a vocabulary vLLM pads (331 -> 384, 192 rows a
    rank: rank 1 holds 139 rows and 53 of padding), every parameter drawn."""
    from tests.lm import build_model, build_tokenizer
    from tests.vllm_models import randomize_

    tokenizer = build_tokenizer()
    model = build_model(VOCAB, seed=3, hidden=128)
    randomize_(model, seed=3)
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def tp_run(tmp_path_factory, tp_env):
    from tests.vllm_replicas import publish_vllm_run

    root = tmp_path_factory.mktemp("vllm-tp2")
    run = publish_vllm_run(str(root / "bucket" / "run"), _save_tp_llama(str(root / "model")), deltas=2)
    yield run
    run.publisher.close()


@pytest.fixture(scope="module")
def tp_rep(tp_run, tmp_path_factory, tp_env):
    from ckptdelta.loader.engines import build_engine
    from tests.vllm_replicas import VLLM_ARGS, VllmReplicaHandle

    before = vllm_shm.segments()
    engine = build_engine("vllm", bucket=tp_run.url, snapshot=0, cache_dir=str(tmp_path_factory.mktemp("tp-cache")),
                          vllm_args=VLLM_ARGS + TP_ARGS)
    rep = VllmReplicaHandle(engine, replica_id="vllm-tp2")
    # the CPU all-reduce segments its workers created, named for its rendezvous file (in vLLM's private TMPDIR)
    ident = tuple(f"{i}-" for i in vllm_shm.idents(engine.server._tmp))
    rep.vllm_shm = {n for n in vllm_shm.segments() - before if n.startswith(ident)}
    yield rep
    rep.close()


def live_weights(engine, tmp_dir: str, shapes: dict[str, torch.Size]) -> tuple[dict[str, torch.Tensor], set[str]]:
    """Every rank's live weights read back in its own slices, assembled into whole checkpoint tensors; every
    element must be held by some rank, and ranks holding the same element (replicated tensors) must agree.
    Also the names read through a GEMM kernel (compare those under kernel_view)."""
    from safetensors.torch import load_file

    from tests.vllm_replicas import bits

    answers = engine.applier.control.rpc("ckptdelta_read", {"path": os.path.join(tmp_dir, "live-{rank}.safetensors"),
                                                            "strict": False})
    assert sorted(a["rank"] for a in answers) == [0, 1]
    whole: dict[str, torch.Tensor] = {}
    held: dict[str, torch.Tensor] = {}
    kernel: set[str] = set()
    for a in answers:
        path = os.path.join(tmp_dir, f"live-{a['rank']}.safetensors")
        part = load_file(path)
        os.unlink(path)
        kernel |= set(a["kernel_view"])
        for n, t in part.items():
            if n not in whole:
                whole[n] = torch.empty(shapes[n], dtype=t.dtype)
                held[n] = torch.zeros(shapes[n], dtype=torch.bool)
            s = a["slices"].get(n)
            dst, mask = (whole[n], held[n]) if s is None else (whole[n].narrow(*s), held[n].narrow(*s))
            assert dst.shape == t.shape, (n, a["rank"], s)
            if bool(mask.any()):      # another rank holds these elements too: the same bits
                assert torch.equal(bits(dst)[mask], bits(t)[mask]), (n, a["rank"])
            dst.copy_(t)
            mask.fill_(True)
    assert all(bool(m.all()) for m in held.values()), [n for n, m in held.items() if not bool(m.all())]
    return whole, kernel


def _live_diff(rep, truth: dict[str, torch.Tensor], tmp_dir: str) -> list[str]:
    from ckptdelta.loader.engines.vllm.proof import kernel_view
    from tests.vllm_replicas import bit_diff

    live, kernel = live_weights(rep.engine, tmp_dir, {n: t.shape for n, t in truth.items()})
    view = {n: kernel_view(t) if n in kernel else t for n, t in truth.items()}
    return bit_diff({n: kernel_view(t) if n in kernel else t for n, t in live.items()}, view)


def _special_values(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A step with a NaN payload, -0.0 and a subnormal in rank 1's part of plain tensors (the embedding rows
    past 192, of a token the tokenizer never makes) and -0.0 in rank 1's rows of q_proj (re-packed)."""
    new = {k: v.clone() for k, v in weights.items()}
    emb = new["model.embed_tokens.weight"].view(torch.int16)
    emb[325, 0] = 0x7FC5                                  # a quiet NaN with payload 0x45
    emb[325, 1] = -0x8000                                 # -0.0
    emb[325, 2] = 0x0003                                  # a subnormal
    new["model.norm.weight"].view(torch.int16)[100] = -0x8000
    q = new["model.layers.1.self_attn.q_proj.weight"].view(torch.int16)
    q[70, 3] = -0x8000                                    # q rows 64..127 are rank 1's
    return new


def test_tp2_hotloads_forward_across_an_anchor_and_back_are_proven_and_bit_exact_on_every_rank(tp_rep, tp_run,
                                                                                               tmp_path):
    st = tp_rep.http.get("/v1/status").json()
    assert st["policy_version"] == 0 and st["state"] == "READY"     # the start-up proof passed on both ranks
    if 3 not in tp_run.truth:
        tp_run.publish(tp_run.truth[2], anchor=True)
    if 4 not in tp_run.truth:
        tp_run.publish(_special_values(tp_run.truth[3]))
    for target, verify in ((1, "full"), (2, "sampled"), (4, "full"), (0, "sampled"), (2, "full")):
        tp_rep.engine.applier.verify = verify
        job = tp_rep.hotload(target, timeout=600)
        assert job["state"] == "READY", job
        assert tp_rep.engine.version == target and job["report"]["via_anchor"] == (target in (4, 0))
        last = tp_rep.http.get("/v1/status").json()["engine"]["last_swap"]
        assert last["verified"] and last["version"] == target and last["apply"] == "shadow", last
        assert last["verified_tensors"] > 0, last      # every changed tensor, in full (inside the pause or after)
        if target == 1:   # norms and each rank's vocabulary rows of the embedding, written in place
            assert last["patched_tensors"] >= 6 and last["patched_elements"] > 0, last
        assert _live_diff(tp_rep, tp_run.truth[target], str(tmp_path)) == [], target
    tp_rep.engine.applier.verify = "sampled"
    assert tp_rep.complete(max_tokens=3, return_engine_data=True)["engine_data"]["policy_version"] == 2


def test_tp2_a_wrong_bit_in_one_ranks_slice_is_caught_and_a_reload_repairs_it(tp_rep, tp_run, tmp_path):
    from ckptdelta.delta.errors import HotLoadError

    applier = tp_rep.engine.applier
    name = "model.layers.1.self_attn.o_proj.weight"        # row-parallel: rank 1 holds input columns 64..127
    assert applier.check() == len(tp_run.truth[0])
    host = applier.shared.tensors[name].view(torch.int16)
    good = host.clone()
    try:
        host[5, 100] ^= 0x0004                     # wrong in the host copy only while vLLM reloads it
        applier.control.rpc("ckptdelta_reload", {"path": applier.shared.path, "names": [name]})
    finally:
        host.copy_(good)
    with pytest.raises(HotLoadError, match=r"vLLM worker 1: .*1 tensors \(model\.layers\.1\.self_attn\.o_proj"):
        applier.check()
    live, _ = live_weights(tp_rep.engine, str(tmp_path), {n: t.shape for n, t in applier.shared.tensors.items()})
    wrong = (live[name].view(torch.int16) != good).nonzero().tolist()
    assert wrong == [[5, 100]]
    applier.control.rpc("ckptdelta_reload", {"path": applier.shared.path, "names": [name]})
    assert applier.check() == len(tp_run.truth[0])


def test_tp2_a_hotload_failed_on_one_worker_pushes_the_previous_version_back_on_every_rank(tp_rep, tp_run, tmp_path,
                                                                                         monkeypatch):
    from ckptdelta.loader.engines.vllm import applier as vllm_engine

    assert tp_rep.hotload(2, timeout=600)["state"] == "READY"
    before = tp_rep.complete(max_tokens=6, temperature=0)["choices"][0]["text"]
    real = vllm_engine.expected_digests
    calls = []

    def wrong_on_rank_1(shared, names, kernel=frozenset(), slices=None):
        out = real(shared, names, kernel, slices)
        if (slices or {}).get("model.embed_tokens.weight", [0, 0])[1] > 0 and not calls:   # rank 1's answer
            calls.append(1)
            out[sorted(out)[0]] = "0" * 16
        return out

    monkeypatch.setattr(vllm_engine, "expected_digests", wrong_on_rank_1)
    monkeypatch.setattr(tp_rep.engine.applier, "verify", "full")
    job = tp_rep.hotload(1, timeout=600)
    assert job["state"] == "FAILED" and "vLLM worker 1" in job["reason"], job
    assert tp_rep.engine.version == 2 and calls
    assert _live_diff(tp_rep, tp_run.truth[2], str(tmp_path)) == []
    assert tp_rep.complete(max_tokens=6, temperature=0)["choices"][0]["text"] == before
    job = tp_rep.hotload(1, timeout=600)
    assert job["state"] == "READY" and tp_rep.engine.version == 1, job
    assert _live_diff(tp_rep, tp_run.truth[1], str(tmp_path)) == []


@pytest.mark.slow
def test_tp2_greedy_tokens_and_logprobs_equal_a_fresh_tp2_vllm_on_the_same_snapshot(tp_rep, tp_run, tmp_path):
    """Last in the module: it stops the replica's vLLM before starting the fresh one (memory)."""
    from ckptdelta.loader.engines.vllm.server import VllmServer
    from ckptdelta.loader.engines.vllm.control import http_client
    from ckptdelta.loader.reader import SnapshotReader
    from tests.vllm_replicas import PROMPT, VLLM_ARGS

    assert tp_rep.hotload(1, timeout=600)["state"] == "READY"
    assert tp_rep.hotload(2, timeout=600)["state"] == "READY"
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "logprobs": 3, "ignore_eos": True}
    hot = tp_rep.complete(**body)["choices"][0]
    name = tp_rep.engine.model_name
    tp_rep.close()
    model_dir = SnapshotReader(tp_run.url).materialize(2, str(tmp_path / "v2"))
    fresh = VllmServer(model_dir, served_name=name, args=VLLM_ARGS + TP_ARGS)
    try:
        fresh.wait_ready()
        with http_client(fresh.url, timeout=120) as c:
            r = c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        cold = r.json()["choices"][0]
    finally:
        fresh.stop()
    assert hot["text"] == cold["text"] and hot["logprobs"]["tokens"] == cold["logprobs"]["tokens"]
    assert hot["logprobs"]["token_logprobs"] == cold["logprobs"]["token_logprobs"]
    assert hot["logprobs"]["top_logprobs"] == cold["logprobs"]["top_logprobs"]


def test_tp2_stopping_the_replica_removes_the_cpu_all_reduce_shared_memory_its_vllm_created(tp_rep):
    """Last in the module (the slow test before it may have stopped the replica already). vLLM's CPU workers
    create a 4 MB segment each in /dev/shm for their all-reduce and never unlink it: every TP-2 start left a
    pair there for good until VllmServer.stop removed them (loader/engines/vllm/shm.py)."""
    created = tp_rep.vllm_shm
    assert sorted(n.rsplit("-", 1)[1] for n in created) == ["cpushm_0", "cpushm_1"], created
    tp_rep.close()
    assert vllm_shm.live_members(tp_rep.engine.server.proc.pid) == []
    assert not created & vllm_shm.segments()


# --- LoRA on two tensor-parallel ranks (slow: a TP-2 vLLM of its own, with LoRA) ---------------------------------


@pytest.mark.slow
def test_tp2_lora_hotloads_forward_across_an_anchor_and_back_are_proven_on_both_ranks_and_equal_vllms_own_load(
        tp_env, tmp_path_factory):
    """After the module's replica is stopped: a LoRA run served on --tensor-parallel-size 2, started on a delta.
    Every hot-load forward, across an anchor, back and by a jump ends READY with the slot proven in both workers,
    and each rank's slot holds, bit for bit, what vLLM's own in-place load of that version's PEFT directory puts in
    another slot of the same rank (each rank its own slice: the two ranks' buffers differ)."""
    from ckptdelta.loader.engines import build_engine
    from ckptdelta.loader.reader import SnapshotReader
    from ckptdelta.publisher import Publisher
    from tests.publisher.test_lora_publish import peft_model, train_step
    from tests.vllm_replicas import VLLM_ARGS, VllmReplicaHandle

    root = tmp_path_factory.mktemp("vllm-tp2-lora")
    base = _save_tp_llama(str(root / "base"))
    model, opt = peft_model(base, r=8, alpha=16)
    for group in opt.param_groups:
        group["lr"] = 1e-2
    url = str(root / "run")
    with Publisher(url, anchor_every=3, codec="context") as pub:
        kinds = []
        for step in range(6):
            train_step(model, opt, seed=step)
            kinds.append(pub.publish(model, step).kind)
    assert kinds == ["anchor", "delta", "delta", "anchor", "delta", "delta"]
    reader = SnapshotReader(url)
    dirs = {v: reader.materialize(v, str(root / f"dir-v{v}")) for v in range(6)}
    engine = build_engine("vllm", bucket=url, snapshot=1, base_model=base, lora_slots=3,
                          vllm_args=VLLM_ARGS + TP_ARGS)
    rep = VllmReplicaHandle(engine, replica_id="vllm-tp2-lora")
    try:
        control = engine.applier.control

        def directory_load(version: int) -> list[dict[str, str]]:
            """vLLM's own load of the version's directory into a slot no request holds (retired: the replica
            rewrites it before it serves), read back on each rank."""
            spare = next(s for s in engine.slots.slots if s is not engine.slots.newest() and s.refs == 0)
            engine.slots.retire(spare)
            control.rpc("ckptdelta_lora_load_dir", {"name": spare.name, "id": spare.id, "path": dirs[version]})
            return [a["digests"] for a in control.rpc("ckptdelta_lora_digests", {"id": spare.id})]

        def serving() -> list[dict[str, str]]:
            return [a["digests"] for a in control.rpc("ckptdelta_lora_digests", {"id": engine.slots.newest().id})]

        assert engine.version == 1
        held = serving()
        assert len(held) == 2 and held[0] != held[1] and held == directory_load(1)
        for v in [2, 3, 4, 5, 4, 1, 0, 5]:
            job = rep.hotload(v, timeout=600)
            assert job["state"] == "READY", job
            last = engine.applier.last
            assert engine.version == v and last["version"] == v and last["proven"] == "full"
            assert len(last["workers"]) == 2 and all(w["checked"] > 0 for w in last["workers"]), last["workers"]
            assert serving() == directory_load(v), f"v{v}"
            out = rep.complete(max_tokens=2, temperature=0.0, return_engine_data=True)
            assert out["engine_data"]["policy_versions"] == [v]
    finally:
        rep.close()
