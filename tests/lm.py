"""A tiny but real causal LM for tests: a Llama-architecture model and a byte-level BPE tokenizer.

Nothing can be downloaded here, so both are built locally: the tokenizer is
trained on a few lines of text, the model is randomly initialised from a fixed
seed and stored in bf16, like the policies a trainer publishes. The result is a
Hugging Face directory that ``AutoModelForCausalLM.from_pretrained`` and
``AutoTokenizer.from_pretrained`` load, so the serving code under test runs the
same transformers paths it runs on a real model.
"""

from __future__ import annotations

import os

import torch

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A policy is published as an anchor and then as small deltas.",
    "Replicas hot-load the new weights while they keep serving requests.",
    "hello world, hello replica, hello trainer",
    "1 2 3 4 5 6 7 8 9 10 11 12",
    "user: what is two plus two? assistant: four.",
]

#: A minimal chat template so the chat endpoint exercises apply_chat_template.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

SPECIAL_TOKENS = ["<|bos|>", "<|eos|>", "<|pad|>", "<|user|>", "<|assistant|>", "<|system|>"]


def build_tokenizer(vocab_size: int = 320, *, chat_template: bool = True):
    """A byte-level BPE tokenizer: every string round-trips, the vocabulary is tiny."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>",
                                   pad_token="<|pad|>")
    if chat_template:
        fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model(vocab_size: int, *, seed: int = 0, hidden: int = 64, layers: int = 2,
                dtype: torch.dtype = torch.bfloat16):
    """A randomly initialised Llama-style model; untied embeddings keep one tensor per name."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=1, pad_token_id=2, initializer_range=0.2,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(dtype).eval()
    return model


def save_tiny_lm(out_dir: str, *, seed: int = 0, chat_template: bool = True) -> str:
    """Write model + tokenizer as one HF directory and return it."""
    os.makedirs(out_dir, exist_ok=True)
    tokenizer = build_tokenizer(chat_template=chat_template)
    model = build_model(len(tokenizer), seed=seed)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def hf_extra_files(model_dir: str) -> dict[str, bytes]:
    """The non-weight files of an HF directory (config, tokenizer) that an anchor must carry."""
    out = {}
    for name in sorted(os.listdir(model_dir)):
        path = os.path.join(model_dir, name)
        if os.path.isfile(path) and not name.endswith(".safetensors") and not name.endswith(".index.json"):
            with open(path, "rb") as f:
                out[name] = f.read()
    return out


def rl_step(state: dict[str, torch.Tensor], *, seed: int, fraction: float = 0.02,
            scale: float = 0.05) -> dict[str, torch.Tensor]:
    """A new policy differing from ``state`` in about ``fraction`` of each tensor's elements.

    Like an RL optimizer step at a small learning rate: most bf16 weights keep
    their exact bits, a few move slightly."""
    g = torch.Generator().manual_seed(seed)
    new = {}
    for name, t in state.items():
        mask = torch.rand(t.shape, generator=g) < fraction
        noise = torch.randn(t.shape, generator=g) * scale
        new[name] = torch.where(mask, (t.float() + noise).to(t.dtype), t).contiguous()
    return new
