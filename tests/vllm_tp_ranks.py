"""Two real tensor-parallel ranks of vLLM's own layers, without a vLLM server: what each rank holds, read back.

Each rank is a process of a 2-rank gloo group set up with vLLM's own
``init_distributed_environment`` / ``initialize_model_parallel``; it builds
vLLM's layers (QKVParallelLinear with kv heads split and with kv heads
replicated, MergedColumnParallelLinear, RowParallelLinear with a bias,
VocabParallelEmbedding and ParallelLMHead with a padded vocabulary, a tied head
sharing an embedding, RMSNorm), loads the whole checkpoint tensors through the
layers' own ``weight_loader`` (vLLM's TP slicing), runs the CPU re-packing
(``process_weights_after_loading``), and then runs ckptdelta's worker-side code
on them: the read-back's digests and slices, the sampled check against the host
copy, and an in-place patch of the embedding. A start of vLLM's server with
``--tensor-parallel-size 2`` costs minutes on two cores; this costs two imports
of vLLM.
"""

from __future__ import annotations

import json
import os

import torch

HIDDEN = 64
VOCAB = 331          # padded to 384 by vLLM (a multiple of 64): rank 1 holds rows 192..330 and 53 padding rows
PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


def checkpoint(seed: int = 5) -> dict[str, torch.Tensor]:
    """The whole checkpoint tensors (bf16, every one drawn: no zeros, so the kernels read every bit back)."""
    g = torch.Generator().manual_seed(seed)

    def draw(*shape: int) -> torch.Tensor:
        x = torch.randn(shape, generator=g) * 0.2
        return torch.where(x == 0, torch.full_like(x, 0.5), x).to(torch.bfloat16)

    out = {}
    # layer 0: 4 heads of 16, 2 kv heads (one per rank); layer 1: 2 heads of 32, 1 kv head (on both ranks)
    for i, (heads, kv, hd) in enumerate(((4, 2, 16), (2, 1, 32))):
        p = f"model.layers.{i}."
        out[p + "self_attn.q_proj.weight"] = draw(heads * hd, HIDDEN)
        out[p + "self_attn.k_proj.weight"] = draw(kv * hd, HIDDEN)
        out[p + "self_attn.v_proj.weight"] = draw(kv * hd, HIDDEN)
        if i == 1:
            for m in ("q", "k", "v"):
                rows = out[p + f"self_attn.{m}_proj.weight"].shape[0]
                out[p + f"self_attn.{m}_proj.bias"] = draw(rows)
        out[p + "self_attn.o_proj.weight"] = draw(HIDDEN, heads * hd)
        out[p + "mlp.gate_proj.weight"] = draw(2 * HIDDEN, HIDDEN)
        out[p + "mlp.up_proj.weight"] = draw(2 * HIDDEN, HIDDEN)
        out[p + "mlp.down_proj.weight"] = draw(HIDDEN, 2 * HIDDEN)
        out[p + "mlp.down_proj.bias"] = draw(HIDDEN)
        out[p + "input_layernorm.weight"] = 1 + draw(HIDDEN)
    out["model.embed_tokens.weight"] = draw(VOCAB, HIDDEN)
    out["model.embed_tied.weight"] = draw(VOCAB, HIDDEN)
    out["lm_head.weight"] = draw(VOCAB, HIDDEN)
    out["model.norm.weight"] = 1 + draw(HIDDEN)
    return out


def _model(tensors: dict[str, torch.Tensor]) -> torch.nn.Module:
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    nn = torch.nn
    dt = torch.bfloat16
    root = nn.Module()
    root.packed_modules_mapping = PACKED
    root.model = nn.Module()
    root.model.layers = nn.ModuleList()
    for i, (heads, kv, hd) in enumerate(((4, 2, 16), (2, 1, 32))):
        layer = nn.Module()
        layer.self_attn = nn.Module()
        layer.self_attn.qkv_proj = QKVParallelLinear(HIDDEN, hd, heads, kv, bias=i == 1, params_dtype=dt)
        layer.self_attn.o_proj = RowParallelLinear(heads * hd, HIDDEN, bias=False, params_dtype=dt)
        layer.mlp = nn.Module()
        layer.mlp.gate_up_proj = MergedColumnParallelLinear(HIDDEN, [2 * HIDDEN] * 2, bias=False, params_dtype=dt)
        layer.mlp.down_proj = RowParallelLinear(2 * HIDDEN, HIDDEN, bias=True, params_dtype=dt)
        layer.input_layernorm = RMSNorm(HIDDEN, dtype=dt)
        root.model.layers.append(layer)
    root.model.embed_tokens = VocabParallelEmbedding(VOCAB, HIDDEN, params_dtype=dt)
    # a second embedding whose head shares its weight (tied: the head's logits kernel packs the embedding)
    root.model.embed_tied = VocabParallelEmbedding(VOCAB, HIDDEN, params_dtype=dt)
    root.tied_head = ParallelLMHead(VOCAB, HIDDEN, params_dtype=dt).tie_weights(root.model.embed_tied)
    root.lm_head = ParallelLMHead(VOCAB, HIDDEN, params_dtype=dt)
    root.model.norm = RMSNorm(HIDDEN, dtype=dt)
    params = dict(root.named_parameters(remove_duplicate=False))
    with torch.no_grad():
        for name, t in tensors.items():
            path, _, leaf = name.rpartition(".")
            module, _, member = path.rpartition(".")
            fused = {m: (f, i) for f, ms in PACKED.items() for i, m in enumerate(ms)}.get(member)
            if fused is not None:
                p = params[f"{module}.{fused[0]}.{leaf}"]
                shard = "qkv"[fused[1]] if fused[0] == "qkv_proj" else fused[1]
                p.weight_loader(p, t, shard)
            else:
                p = params[name]
                loader = getattr(p, "weight_loader", None)
                if loader is None:
                    p.data.copy_(t)
                else:
                    loader(p, t)
        for m in root.modules():
            method = getattr(m, "quant_method", None)
            if method is not None and hasattr(method, "process_weights_after_loading"):
                method.process_weights_after_loading(m)
    return root


def run_rank(rank: int, port: int, host_path: str, out_dir: str, corrupt: str | None) -> None:
    """One rank: build, load, re-pack; write its read-back answers to ``out_dir/rank{rank}.json``.

    ``corrupt``: a checkpoint name whose first element *this rank holds* gets one bit flipped in the rank's
    own tensor before re-packing (only on rank 1)."""
    os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):     # vLLM's defaults, as its own layer tests set them
        _run_rank(rank, port, host_path, out_dir, corrupt)


def _run_rank(rank: int, port: int, host_path: str, out_dir: str, corrupt: str | None) -> None:
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    init_distributed_environment(world_size=2, rank=rank, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                 local_rank=rank, backend="gloo")
    initialize_model_parallel(tensor_model_parallel_size=2)

    from ckptdelta.loader.engines.shared_weights import open_tensors
    from ckptdelta.loader.engines.vllm.worker.patch import patch, targets
    from ckptdelta.loader.engines.vllm.worker.readback import checkpoint_tensors
    from ckptdelta.loader.engines.vllm.tp import Slice
    from ckptdelta.loader.engines.vllm.worker.extension import _compare, _digests

    host = {k: v.clone() for k, v in open_tensors(host_path, None).items()}
    tensors = dict(host)
    if corrupt and rank == 1:
        t = tensors[corrupt].clone()
        # flip a bit in an element of the part rank 1 holds (its rows, or its input columns, of the checkpoint)
        at = (t.shape[0] - 1, t.shape[1] - 1) if t.dim() == 2 else (t.shape[0] - 1,)
        t.view(torch.int16)[at] ^= 0x0010
        tensors[corrupt] = t
    model = _model(tensors)
    answer = _digests(model, None)
    # the worker's in-pause check of every tensor against the host copy (all columns; and by 4 sampled ones)
    answer["compare"] = _compare(model, host_path, None, None)
    answer["compare_sampled"] = _compare(model, host_path, None, 4)
    # an in-place patch of the embedding: changed elements on both ranks and the last checkpoint row
    name = "model.embed_tokens.weight"
    answer["patchable"] = sorted(targets(model))
    new = host[name].clone()
    flat = new.view(-1).view(torch.int16)
    positions = torch.tensor([3, 191 * HIDDEN + 5, 192 * HIDDEN, 250 * HIDDEN + 7, VOCAB * HIDDEN - 1])
    flat[positions] ^= 0x0100
    patch(model, {name: new}, positions.to(torch.int32), [(name, 0, len(positions))])
    slices: dict[str, Slice] = {}
    live = checkpoint_tensors(model, [name], slices=slices)[name]
    want = slices[name].of(new) if name in slices else new
    answer["patched_ok"] = bool(torch.equal(live.view(torch.int16), want.contiguous().view(torch.int16)))
    # the padding rows after this rank's vocabulary stay zero (the lookup never reads them; nothing writes them)
    emb = model.model.embed_tokens
    answer["padding_zero"] = bool((emb.weight[int(emb.shard_indices.num_org_elements):] == 0).all())
    # linears vLLM re-packed for its CPU kernels (their weight parameter left empty): read through the kernel.
    # Which ones depends on the CPU (oneDNN's bf16 matmul needs AVX-512; on AVX2 vLLM falls back to torch's
    # linear and keeps the weight, read as it is)
    answer["packed"] = sorted(p for p, m in model.named_modules() if hasattr(m, "cpu_linear") and
                              getattr(m, "weight", None) is not None and m.weight.numel() == 0)
    answer["local_shapes"] = {n: list(t.shape) for n, t in checkpoint_tensors(model, strict=False).items()}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(answer, f)
