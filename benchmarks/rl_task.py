"""The demo's RL task: addition with a verifiable reward, a character tokenizer and a tiny Llama.

Nothing can be downloaded, so everything is built here: a character-level
tokenizer (one token per character of ``0123456789+=``, plus pad/bos/eos/unk),
a 2-layer Llama from a transformers config (head size 32, so vLLM's CPU build serves it), and a short supervised pre-train.

The pre-train data is deliberately noisy: after the correct sum, half the
targets carry one junk character before EOS ("12+7=19" -> "19" or "194").
The model learns the arithmetic but copies the noise, so a sampled answer is
exactly right (reward 1) only part of the time. That is a policy RL improves
quickly and reliably from a small batch (stop right after the answer; sharpen
the sums it is unsure of), which is what a demo of the weight-shipping loop
needs in a couple of minutes on two cores.

Initialisation is wider than transformers' default (``initializer_range=0.2``):
with weights of that scale a bf16 element moves by less than one ulp in most
optimizer steps at the demo's learning rate, so each step changes ~10-25% of
the bf16 bits instead of ~all of them (at RL learning rates on real models,
~1e-6, it is ~1%; see benchmarks/update_latency.py).
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass
from typing import Any

import torch

SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<unk>")
CHARS = "0123456789+="
PAD, BOS, EOS = 0, 1, 2

#: name -> (hidden size, intermediate size, attention heads); all sizes have 2 layers and a head size of 32,
#: the smallest vLLM's CPU attention serves (it refuses 16 and 24), so every size runs on either engine.
MODEL_SIZES: dict[str, tuple[int, int, int]] = {"tiny": (64, 128, 2), "small": (96, 192, 3), "base": (128, 256, 4)}


def build_tokenizer() -> Any:
    """A character-level tokenizer that ``AutoTokenizer.from_pretrained`` loads back (tokenizer.json)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(list(SPECIAL_TOKENS) + list(CHARS))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()  # characters join without spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>")
    assert (fast.pad_token_id, fast.bos_token_id, fast.eos_token_id) == (PAD, BOS, EOS)
    return fast


def build_model(vocab_size: int, size: str = "small", *, seed: int = 0, tied: bool = False) -> torch.nn.Module:
    """A randomly initialised fp32 Llama (the trainer's master copy); untied embeddings (one tensor per name)
    unless ``tied``: then its output head is its input embedding, as in most small policies."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if size not in MODEL_SIZES:
        raise ValueError(f"model size {size!r}: expected one of {sorted(MODEL_SIZES)}")
    hidden, inter, heads = MODEL_SIZES[size]
    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=2,
        num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=32, tie_word_embeddings=tied,
        pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS, initializer_range=0.2)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).float()


def save_model_dir(model: torch.nn.Module, tokenizer: Any, out_dir: str) -> dict[str, bytes]:
    """Write ``model`` (its dtype) and ``tokenizer`` as an HF directory; return the non-weight files.

    Those files (config, generation config, tokenizer) are what an anchor carries
    as extra files, so a replica can load a snapshot with ``from_pretrained``."""
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    extra = {}
    for name in sorted(os.listdir(out_dir)):
        path = os.path.join(out_dir, name)
        if os.path.isfile(path) and not name.endswith((".safetensors", ".index.json")):
            with open(path, "rb") as f:
                extra[name] = f.read()
    return extra


@dataclass(frozen=True)
class AdditionTask:
    """``"a+b="`` -> ``"<a+b>"`` then EOS, for ``0 <= a, b < max_operand``; reward 1 for exactly that."""

    max_operand: int = 20
    junk_rate: float = 0.5    # pre-train targets with a junk character after the answer
    max_tokens: int = 4       # enough for the longest answer, one junk character and EOS

    def problem(self, rng: random.Random) -> tuple[str, str]:
        a, b = rng.randrange(self.max_operand), rng.randrange(self.max_operand)
        return f"{a}+{b}=", str(a + b)

    def pretrain_target(self, rng: random.Random) -> tuple[str, str]:
        prompt, answer = self.problem(rng)
        if rng.random() < self.junk_rate:
            answer += rng.choice(CHARS)
        return prompt, answer

    @staticmethod
    def reward(text: str, finish_reason: str | None, answer: str) -> float:
        """1.0 when the completion is the answer and nothing else (it ended with EOS), else 0.0."""
        return 1.0 if finish_reason == "stop" and text == answer else 0.0


def encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def pretrain(model: torch.nn.Module, tokenizer: Any, task: AdditionTask, *, steps: int = 150, batch: int = 128,
             lr: float = 3e-3, seed: int = 0) -> dict[str, float]:
    """Teacher-forced training on noisy targets, in fp32; returns the last loss and the seconds taken."""
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    t0 = time.perf_counter()
    loss = torch.tensor(float("nan"))
    for _ in range(steps):
        pairs = [task.pretrain_target(rng) for _ in range(batch)]
        seqs = [(encode(tokenizer, p), encode(tokenizer, a) + [EOS]) for p, a in pairs]
        width = max(len(p) + len(a) for p, a in seqs)
        ids = torch.full((batch, width), PAD, dtype=torch.long)
        labels = torch.full((batch, width), -100, dtype=torch.long)
        for i, (p, a) in enumerate(seqs):
            ids[i, :len(p) + len(a)] = torch.tensor(p + a)
            labels[i, len(p):len(p) + len(a)] = torch.tensor(a)
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    model.eval()
    return {"loss": loss.item(), "seconds": time.perf_counter() - t0}


@torch.no_grad()
def greedy_accuracy(model: torch.nn.Module, tokenizer: Any, task: AdditionTask, *, n: int = 200,
                    seed: int = 12345) -> float:
    """Fraction of ``n`` problems answered exactly by greedy decoding (full forwards: tiny sequences)."""
    rng = random.Random(seed)
    ok = 0
    for _ in range(n):
        prompt, answer = task.problem(rng)
        ids = encode(tokenizer, prompt)
        out: list[int] = []
        for _ in range(task.max_tokens):
            nxt = int(model(input_ids=torch.tensor([ids + out])).logits[0, -1].argmax())
            out.append(nxt)
            if nxt == EOS:
                break
        text = tokenizer.decode(out, skip_special_tokens=True)
        ok += task.reward(text, "stop" if out[-1] == EOS else "length", answer) == 1.0
    return ok / n


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.rl_task DIR``: the demo's tiny Llama (random weights, bf16), with tied embeddings
    like most small policies, and its tokenizer, saved as a Hugging Face model directory, for trying ckptdelta
    without a model at hand (README.md)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m benchmarks.rl_task", description=main.__doc__)
    p.add_argument("out_dir", metavar="DIR")
    p.add_argument("--size", choices=sorted(MODEL_SIZES), default="small", help="default: small (188k parameters)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    tokenizer = build_tokenizer()
    model = build_model(len(tokenizer), args.size, seed=args.seed, tied=True).to(torch.bfloat16)
    save_model_dir(model, tokenizer, args.out_dir)
    n = sum(t.numel() for t in model.parameters())
    print(f"saved a {n // 1000}k-parameter Llama (tied embeddings) and its tokenizer to {args.out_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
