"""The policy as transformers loads and scores it: what a replica serves, and what a trainer checks it against.

A trainer that scores completions on the published bits with :func:`score_tokens` gets exactly the numbers a
replica that served them reports (one full-sequence forward, no KV cache), so the divergence between sampler and
trainer measures the weights and nothing else."""

from __future__ import annotations

from typing import Any, Sequence

import torch


def load_model(model_dir: str, *, device: str = "cpu") -> tuple[torch.nn.Module, Any]:
    """Model and tokenizer from an HF directory, in the dtype the weights are stored in."""
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype_kw = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    model = AutoModelForCausalLM.from_pretrained(model_dir, **{dtype_kw: "auto"})
    model = model.to(device).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return model, tokenizer



def score_logprobs(model: torch.nn.Module, token_ids: Sequence[int], prompt_len: int) -> torch.Tensor:
    """Float32 log-probabilities, ``[len(token_ids) - prompt_len, vocab]``, of every position after the prompt.

    One forward of the whole sequence at batch 1, no KV cache, in the model's own
    dtype, then ``log_softmax`` in float32. Decoding token by token with a cache
    rounds differently from a trainer's full-sequence forward even on identical
    weights; a trainer that calls this (or :func:`score_tokens`) on the published
    bits gets exactly the replica's numbers, so sampler/trainer divergence measures
    the weights and nothing else. Autograd works through it (inference mode is the
    caller's choice and does not change the arithmetic)."""
    ids = list(token_ids)
    if not 1 <= prompt_len < len(ids):
        raise ValueError(f"prompt_len {prompt_len} must be in [1, {len(ids)}) for a sequence of {len(ids)} tokens")
    device = next(model.parameters()).device
    inp = torch.tensor([ids], dtype=torch.long, device=device)
    logits = model(input_ids=inp, use_cache=False).logits[0, prompt_len - 1:-1]
    return torch.log_softmax(logits.float(), dim=-1)


def score_tokens(model: torch.nn.Module, token_ids: Sequence[int], prompt_len: int) -> torch.Tensor:
    """Float32 logprob of each token after the prompt under ``model``: :func:`score_logprobs`, gathered."""
    lp = score_logprobs(model, token_ids, prompt_len)
    target = torch.tensor(list(token_ids)[prompt_len:], dtype=torch.long, device=lp.device)
    return lp.gather(-1, target[:, None]).squeeze(-1)
