"""What a Hugging Face model directory needs before a replica can serve it.

An anchor is such a directory (docs/FORMAT.md): its shards plus the extra files
the publisher gave it. ``AutoModelForCausalLM.from_pretrained`` needs
``config.json`` and ``AutoTokenizer.from_pretrained`` a tokenizer; without them
transformers fails deep inside with errors that name neither ("Unrecognized
model in /tmp/...", a tokenizer class lookup). The publisher warns about a gap
when it writes an anchor, and ``ckptdelta serve`` refuses a snapshot with one
before it materializes anything (loader/servable.py).
"""

from __future__ import annotations

from typing import Iterable

CONFIG_FILE = "config.json"
#: Any one of these is a tokenizer transformers can load (fast, sentencepiece, BPE/WordPiece vocabularies).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "vocab.json",
                   "vocab.txt", "tiktoken.model")
TOKENIZER_SUFFIXES = (".tiktoken",)


def has_tokenizer(names: Iterable[str]) -> bool:
    return any(n in TOKENIZER_FILES or n.endswith(TOKENIZER_SUFFIXES) for n in names)


def serving_gaps(names: Iterable[str]) -> list[str]:
    """What of config.json and a tokenizer the top-level file ``names`` lack, each said to follow "no " in a
    message ([] if nothing)."""
    names = {n for n in names if "/" not in n}
    gaps = []
    if CONFIG_FILE not in names:
        gaps.append(CONFIG_FILE)
    if not has_tokenizer(names):
        gaps.append(f"tokenizer files ({', '.join(TOKENIZER_FILES[:2])}, vocab.json ...)")
    return gaps
