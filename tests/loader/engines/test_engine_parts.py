"""The pieces of the vLLM engine that need no vLLM: the shared host copy and the grouping into whole modules."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from ckptdelta.loader.engines.shared_weights import (ALIGN, SharedWeights, open_positions, open_tensors, remove_orphans,
                                                     write_positions)
from ckptdelta.loader.engines.vllm.applier import reload_groups

LLAMA_PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def test_the_shared_copy_holds_every_dtype_bit_for_bit_and_a_second_mapping_sees_writes(tmp_path):
    special = torch.tensor([0x7FC5, 0xFFC1, 0x8000, 0x0001, 0x7F80], dtype=torch.int32).to(torch.int16)
    tensors = {
        "bf16": special.view(torch.bfloat16).clone(),
        "f32": torch.tensor([float("nan"), -0.0, 1e-45, 3.5]),
        "f16": torch.tensor([-0.0, 6e-8, 1.0], dtype=torch.float16),
        "i64": torch.arange(7, dtype=torch.int64).reshape(7, 1),
        "u8": torch.tensor([1, 2, 3], dtype=torch.uint8),
        "empty": torch.zeros(0, 3),
        "fp8": torch.tensor([0.5, -2.0]).to(torch.float8_e4m3fn),
    }
    shared = SharedWeights.create(tensors, directory=str(tmp_path))
    try:
        for name, t in tensors.items():
            live = shared.tensors[name]
            assert live.dtype == t.dtype and live.shape == t.shape and torch.equal(_bits(live), _bits(t)), name
        index = json.load(open(shared.index_path))
        assert all(e["offset"] % ALIGN == 0 for e in index.values())
        worker = open_tensors(shared.path, ["bf16", "f32"])  # as an engine worker maps it
        shared.tensors["f32"][3] = 7.25
        assert worker["f32"][3].item() == 7.25  # the same pages, no copy
    finally:
        shared.close()
    assert not os.path.exists(shared.path) and not os.path.exists(shared.index_path)


def test_an_index_pointing_outside_the_file_is_refused(tmp_path):
    shared = SharedWeights.create({"a": torch.ones(4)}, directory=str(tmp_path))
    try:
        index = json.load(open(shared.index_path))
        index["a"]["offset"] = 1 << 20
        json.dump(index, open(shared.index_path, "w"))
        os.utime(shared.index_path, (1, 1))
        with pytest.raises(ValueError, match="outside the file"):
            open_tensors(shared.path)
    finally:
        shared.close()


def test_files_of_dead_replicas_are_removed_and_live_ones_kept(tmp_path):
    """Dead or alive is the owner's lock on the file (delta/scratch.py), not the pid in its name: an unlocked
    file named with this very process's pid is a dead replica's (another PID namespace's pid, reused here)."""
    live = SharedWeights.create({"a": torch.ones(4)}, directory=str(tmp_path))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid, me = int(dead.stdout), os.getpid()
    orphans = [f"ckptdelta-weights-{pid}-0000000a.bin", f"ckptdelta-weights-{pid}-0000000a.bin.json",
               f"ckptdelta-weights-{me}-0000000b.bin", f"ckptdelta-weights-{me}-0000000b.bin.pos"]
    for name in orphans + ["other.bin"]:
        (tmp_path / name).write_bytes(b"x")
    try:
        assert sorted(remove_orphans(str(tmp_path))) == sorted(orphans)
        assert sorted(os.listdir(tmp_path)) == sorted([os.path.basename(live.path), os.path.basename(live.index_path),
                                                       "other.bin"])
    finally:
        live.close()


def test_a_changed_tensor_brings_its_whole_vllm_module():
    names = [f"model.layers.0.self_attn.{m}.{p}" for m in ("q_proj", "k_proj", "v_proj", "o_proj")
             for p in ("weight", "bias")]
    names += [f"model.layers.0.mlp.{m}.weight" for m in ("gate_proj", "up_proj", "down_proj")]
    names += [f"model.layers.1.mlp.experts.{e}.{m}.weight" for e in range(3) for m in ("gate_proj", "down_proj")]
    names += ["model.layers.1.mlp.gate.weight", "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    qkv = {n for n in names if any(f".{m}." in n for m in ("q_proj", "k_proj", "v_proj"))}
    assert set(reload_groups(["model.layers.0.self_attn.k_proj.weight"], names, LLAMA_PACKED)) == qkv
    assert set(reload_groups(["model.layers.0.mlp.up_proj.weight"], names, LLAMA_PACKED)) == {
        "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight"}
    experts = {n for n in names if ".experts." in n}
    assert set(reload_groups(["model.layers.1.mlp.experts.2.down_proj.weight"], names, LLAMA_PACKED)) == experts
    assert reload_groups(["model.norm.weight"], names, LLAMA_PACKED) == ["model.norm.weight"]
    assert reload_groups(["model.layers.0.self_attn.o_proj.bias"], names, LLAMA_PACKED) == [
        "model.layers.0.self_attn.o_proj.weight", "model.layers.0.self_attn.o_proj.bias"]
    assert reload_groups([], names, LLAMA_PACKED) == []


def test_changed_positions_travel_to_a_worker_through_one_file(tmp_path):
    import numpy as np

    path = str(tmp_path / "pos")
    spans = write_positions(path, [("a", np.array([3, 1, 2**31 - 1], dtype=np.int64)), ("b", np.zeros(0)),
                                   ("c", np.array([7], dtype=np.int32))])
    assert spans == [("a", 0, 3), ("b", 3, 0), ("c", 3, 1)]
    assert open_positions(path).tolist() == [3, 1, 2**31 - 1, 7]
    assert write_positions(path, []) == [] and open_positions(path).numel() == 0


def test_a_sampled_kernel_view_matches_what_the_kernel_shows_and_nothing_else():
    from ckptdelta.loader.engines.vllm.worker.extension import _kernel_views, _same_bits

    host = torch.randn(4, 8).to(torch.bfloat16)
    host[1, 0] = -0.0
    host[2, 7] = float("nan")                      # outside the sampled columns: poisons row 2 all the same
    cols = torch.tensor([0, 3, 5])
    live = host[:, cols].clone()
    live[1, 0] = 0.0                               # the kernel cannot sign a zero
    live[2] = float("nan")                         # ... and shows a poisoned row as NaN
    want, got = _kernel_views(host, live, cols)
    assert _same_bits(want, got)
    live[3, 1] = live[3, 1] * 2                    # a real difference is one
    want, got = _kernel_views(host, live, cols)
    assert not _same_bits(want, got)
    live[3, 1] = host[3, 3]
    live[0] = float("nan")                         # a row poisoned live but finite in the host copy is one too
    want, got = _kernel_views(host, live, cols)
    assert not _same_bits(want, got)


def test_a_slots_preparation_owns_every_adapter_tensor_and_copies_only_those_vllm_does_not_cast_itself(tmp_path):
    """vLLM's transform casts LoRA A/B weights to its LoRA dtype (a new tensor) and then scales B in place: an
    fp32 adapter's A/B weights need no clone of their own, while every tensor the transform keeps as given (one
    already in vLLM's dtype, a module to save, an embedding's A/B) is cloned. However the worker then casts and
    scales, the host copy keeps the published bits."""
    from ckptdelta.loader.engines.vllm.worker.lora_slots import SlotError, _host_digest, verified_tensors

    g = torch.Generator().manual_seed(0)
    pre = "base_model.model.model.layers.0.self_attn.q_proj"
    tensors = {f"{pre}.lora_A.weight": torch.randn(8, 64, generator=g),
               f"{pre}.lora_B.weight": torch.randn(64, 8, generator=g),
               "base_model.model.model.layers.0.mlp.up_proj.lora_B.weight":
                   torch.randn(64, 8, generator=g).to(torch.bfloat16),
               "base_model.model.model.embed_tokens.lora_embedding_A": torch.randn(8, 32, generator=g),
               "base_model.model.lm_head.weight": torch.randn(32, 64, generator=g)}
    shared = SharedWeights.create(tensors, directory=str(tmp_path))
    try:
        digests = {n: _host_digest(t) for n, t in tensors.items()}
        host = open_tensors(shared.path, list(tensors))
        got = verified_tensors(shared.path, digests, torch.bfloat16)
        aliased = {n for n, t in got.items() if t.data_ptr() == host[n].data_ptr()}
        assert aliased == {f"{pre}.lora_A.weight", f"{pre}.lora_B.weight"}
        # without a dtype to cast to, every tensor is a clone; with fp32, only the bf16 B is cast
        for dt, cast in ((None, set()), (torch.float32, {"base_model.model.model.layers.0.mlp.up_proj.lora_B.weight"})):
            assert {n for n, t in verified_tensors(shared.path, digests, dt).items()
                    if t.data_ptr() == host[n].data_ptr()} == cast
        # what vLLM then does: cast A/B (new tensors), keep the rest as given, scale B in place
        for n, t in got.items():
            t = t.to(torch.bfloat16) if ".lora_" in n and ".lora_embedding" not in n else t
            t.mul_(2.0)
        assert {n: _host_digest(t) for n, t in host.items()} == digests
        shared.tensors[f"{pre}.lora_B.weight"][0, 0] += 1.0         # a host copy that is not the snapshot's
        with pytest.raises(SlotError, match="1 adapter tensors in the host copy differ"):
            verified_tensors(shared.path, digests, torch.bfloat16)
    finally:
        shared.close()
