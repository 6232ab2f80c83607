"""Tensor-parallel vLLM: every rank proves the slice it holds, in checkpoint coordinates, against the host copy.

In ``make test``: two real ranks (a gloo group set up by vLLM's own
``init_distributed_environment``) build vLLM's layers, load whole checkpoint
tensors through vLLM's own weight loaders and CPU re-packing, and run the
worker's read-back; the replica's side (:func:`loader.engines.vllm.expected_digests`
with the workers' slices, :func:`loader.engines.vllm_tp.uncovered`) proves each
slice and that the slices cover every tensor. No vLLM server: a start of one
with ``--tensor-parallel-size 2`` costs minutes on two cores.

Marked slow (``make stress``): a real replica over vLLM's CPU build started with
``--tensor-parallel-size 2``: hot-loads forward, across an anchor and back, each
proven; a wrong bit in one rank's slice caught and repaired; a failed hot-load
pushing the old version back on both ranks; greedy tokens and logprobs equal
to a fresh TP-2 vLLM on the same snapshot.
"""

from __future__ import annotations

import json
import multiprocessing
import os

import pytest
import torch

from tests.servers import free_port
from tests.vllm_tp_ranks import VOCAB, checkpoint, run_rank

CORRUPT = "model.layers.0.self_attn.o_proj.weight"   # row-parallel: rank 1 holds its input columns 32..63


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Both ranks' answers (rank 1 with one bit flipped in its own part of CORRUPT), and the host copy."""
    from loader.engines.shared_weights import SharedWeights

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
    from loader.engines.vllm import expected_digests
    from loader.engines.vllm_tp import uncovered

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
    from loader.engines.vllm import expected_digests

    whole = expected_digests(host, [CORRUPT])[CORRUPT]
    assert whole not in (answers[0]["digests"][CORRUPT], answers[1]["digests"][CORRUPT])


def test_an_in_place_patch_writes_each_rank_only_its_own_vocabulary_rows(ranks):
    answers, _ = ranks
    for a in answers:
        assert "model.embed_tokens.weight" in a["patchable"] and a["patched_ok"] and a["padding_zero"]


def test_slices_that_leave_part_of_a_tensor_unproven_are_refused():
    from loader.engines.vllm_tp import Slice, sliced, uncovered

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
