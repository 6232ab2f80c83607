"""Tiny local Hugging Face models of the shapes a vLLM replica must read back exactly.

Like :mod:`tests.lm`, nothing is downloaded: each builder writes a model
directory (bf16 safetensors, config, a byte-level BPE tokenizer from
:func:`tests.lm.build_tokenizer`) that vLLM and transformers both load. Three
shapes, each exercising a different part of vLLM's runtime weight layout:

(a) :func:`save_tiny_llama`: the Llama of :mod:`tests.lm` (untied embeddings,
    GQA, fused qkv_proj and gate_up_proj, no biases) at hidden 128, because
    vLLM's CPU attention refuses head_dim 16 (``save_tiny_lm``'s hidden 64 over
    4 heads: "Unsupported CPU attention configuration: head_dim=16"); its
    weights still load and read back.
All three use head_dim 32.

(b) :func:`save_tiny_qwen_tied`: Qwen2, tied embeddings (the checkpoint has no
    ``lm_head.weight``), q/k/v biases, and a vocabulary (331) that is not a
    multiple of vLLM's padding (64), so ``embed_tokens`` is padded at runtime.
(c) :func:`save_tiny_moe`: Qwen2-MoE, 2 layers, hidden 64, 4 experts, top-2, a
    shared expert with its sigmoid gate, untied embeddings; the checkpoint holds
    per-expert ``mlp.experts.{i}.{gate,up,down}_proj.weight`` tensors that vLLM
    fuses into FusedMoE ``w13``/``w2``.

Every parameter (biases and norm weights included) is drawn from a fixed seed
with a non-trivial spread, so no tensor is all zeros or all ones and a wrong
split, transpose or slice cannot go unnoticed.
"""

from __future__ import annotations

import os

import torch

from tests.lm import build_model, build_tokenizer, save_tiny_lm

__all__ = ["save_tiny_lm", "save_tiny_llama", "save_tiny_qwen_tied", "save_tiny_moe", "randomize_"]

#: A vocabulary that vLLM pads (to a multiple of 64): rows past the tokenizer are unused but real.
QWEN_VOCAB = 331


def randomize_(model: torch.nn.Module, *, seed: int, std: float = 0.2) -> None:
    """Overwrite every parameter from ``seed``: norm weights around 1, everything else N(0, std).

    transformers' own init leaves biases at zero and norms at one; readback tests
    need every tensor to carry distinct values."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32) * std
            if "norm" in name:
                noise = 1.0 + noise * 0.25
            p.copy_(noise.to(p.dtype))


def _save(model: torch.nn.Module, tokenizer, out_dir: str) -> str:
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def save_tiny_llama(out_dir: str, *, seed: int = 0, chat_template: bool = True) -> str:
    """:func:`tests.lm.save_tiny_lm`'s Llama at hidden 128 (head_dim 32, which vLLM's CPU attention serves)."""
    tokenizer = build_tokenizer(chat_template=chat_template)
    model = build_model(len(tokenizer), seed=seed, hidden=128)
    return _save(model, tokenizer, out_dir)


def build_qwen_tied(vocab_size: int = QWEN_VOCAB, *, seed: int = 1, hidden: int = 64, layers: int = 2,
                    dtype: torch.dtype = torch.bfloat16):
    """A randomly initialised Qwen2 with tied embeddings and q/k/v biases."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512, tie_word_embeddings=True,
        bos_token_id=0, eos_token_id=1, pad_token_id=2, initializer_range=0.2, use_sliding_window=False,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).to(dtype).eval()
    randomize_(model, seed=seed)
    return model


def save_tiny_qwen_tied(out_dir: str, *, seed: int = 1, chat_template: bool = True) -> str:
    """Write a tiny Qwen2 (tied embeddings, q/k/v biases, padded vocab) + tokenizer; return the directory."""
    tokenizer = build_tokenizer(chat_template=chat_template)
    model = build_qwen_tied(max(QWEN_VOCAB, len(tokenizer)), seed=seed)
    return _save(model, tokenizer, out_dir)


def build_moe(vocab_size: int, *, seed: int = 2, hidden: int = 64, layers: int = 2, experts: int = 4,
              top_k: int = 2, dtype: torch.dtype = torch.bfloat16):
    """A randomly initialised Qwen2-MoE: every layer sparse, with a gated shared expert.

    ``moe_intermediate_size`` 32 and hidden 64 are multiples of 32, which vLLM's
    CPU grouped-GEMM MoE kernel needs (it would otherwise pad or refuse)."""
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=32,
        shared_expert_intermediate_size=hidden, num_hidden_layers=layers, num_attention_heads=2,
        num_key_value_heads=1, num_experts=experts, num_experts_per_tok=top_k, decoder_sparse_step=1,
        norm_topk_prob=False, max_position_embeddings=512, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=1, pad_token_id=2, initializer_range=0.2, use_sliding_window=False,
    )
    torch.manual_seed(seed)
    model = Qwen2MoeForCausalLM(config).to(dtype).eval()
    randomize_(model, seed=seed)
    return model


def save_tiny_moe(out_dir: str, *, seed: int = 2, chat_template: bool = True) -> str:
    """Write a tiny Qwen2-MoE (4 experts, top-2, shared expert) + tokenizer; return the directory.

    transformers keeps experts fused in memory but saves them per expert
    (``model.layers.{l}.mlp.experts.{e}.gate_proj.weight``), the Hub layout."""
    tokenizer = build_tokenizer(chat_template=chat_template)
    model = build_moe(len(tokenizer), seed=seed)
    return _save(model, tokenizer, out_dir)
