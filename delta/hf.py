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

import json
from typing import Iterable

from ckptdelta.delta.errors import PublishInputError

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


# --- config.json must describe the tensors published beside it ----------------------------------------------

#: config.json fields naming the weights' dtype: transformers 5 writes ``dtype``, 4 wrote ``torch_dtype``.
DTYPE_FIELDS = ("dtype", "torch_dtype")
TIE_FIELD = "tie_word_embeddings"
#: The output head's name in the causal LMs that tie it (Llama, Qwen2, Mistral, Gemma, ...).
HEAD = "lm_head.weight"
EMBEDDING_SUFFIX = "embed_tokens.weight"


def config_dtype(tensor_dtypes: Iterable[str]) -> str | None:
    """The dtype a config gives weights of these safetensors dtype names (``"BF16"`` -> ``"bfloat16"``): the
    one floating-point dtype among them, or None where there is none or several."""
    from ckptdelta.delta import dtypes    # torch: imported only where a config is checked

    floats = {n for n in tensor_dtypes if dtypes.by_name(n).torch_dtype.is_floating_point}
    if len(floats) != 1:
        return None
    return str(dtypes.by_name(floats.pop()).torch_dtype).removeprefix("torch.")


def reconcile_config(data: bytes, tensors: dict[str, str], *, where: str) -> tuple[bytes, list[str]]:
    """``config.json`` made to describe ``tensors`` (name -> safetensors dtype name), and what was changed.

    Replicas load a snapshot in the config's dtype (transformers' ``dtype="auto"``,
    vLLM's ``--dtype auto``) and tie or untie the head by it: a config that says
    otherwise than the bits makes a replica serve other weights than were
    published. The dtype is fixed (it is known from the tensors), each change
    returned as ``"field: old -> new"``; a contradiction on tying is refused
    (PublishInputError naming ``where``, the field and what to do), as only the
    caller knows whether the head or the config is wrong. Fields the file leaves
    out are left out (the model class's default applies)."""
    try:
        config = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PublishInputError(f"{where} is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise PublishInputError(f"{where} holds a {type(config).__name__}, not a JSON object")
    tie = config.get(TIE_FIELD)
    if tie is True and HEAD in tensors:
        raise PublishInputError(
            f"{where} says {TIE_FIELD}: true, but tensor {HEAD!r} is published: a tied model "
            f"computes its logits with the input embedding and ignores it. Publish the module itself (its tied "
            f"head is published once, as save_pretrained does), leave {HEAD!r} out, or set {TIE_FIELD} to false")
    if tie is False and HEAD not in tensors and any(n.endswith(EMBEDDING_SUFFIX) for n in tensors):
        raise PublishInputError(
            f"{where} says {TIE_FIELD}: false, but no {HEAD!r} is published: a replica would "
            f"start with an output head that is not the trained one. Set {TIE_FIELD} to true if the head is "
            f"the input embedding (a tied model), or publish {HEAD!r}")
    fixes = []
    want = config_dtype(tensors.values())
    for field in DTYPE_FIELDS:
        have = config.get(field)
        if want is not None and isinstance(have, str) and have.removeprefix("torch.") != want:
            fixes.append(f"{field}: {have} -> {want}")
            config[field] = want
    if not fixes:
        return data, []
    return (json.dumps(config, indent=2, sort_keys=True) + "\n").encode(), fixes


#: Fields whose difference between two configs of one model changes which tensors it has or how it loads them.
DESCRIBING_FIELDS = (*DTYPE_FIELDS, TIE_FIELD, "model_type", "vocab_size", "hidden_size", "num_hidden_layers")


def config_differences(given: bytes, own: bytes) -> list[str]:
    """``"field: given -> own"`` for each of DESCRIBING_FIELDS the two config.json files set differently
    (a file that is not a JSON object differs in ``"config.json"`` itself)."""
    try:
        a, b = json.loads(given), json.loads(own)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return ["config.json: not valid JSON"]
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return ["config.json: not a JSON object"]
    out = []
    for f in DESCRIBING_FIELDS:
        if f not in a:
            continue
        mine, theirs = a[f], b.get(f)
        if f in DTYPE_FIELDS:     # transformers 4 and 5 spell the field differently; the value is what counts
            theirs = next((b[g] for g in DTYPE_FIELDS if isinstance(b.get(g), str)), theirs)
            mine, theirs = (v.removeprefix("torch.") if isinstance(v, str) else v for v in (mine, theirs))
        if mine != theirs:
            out.append(f"{f}: {json.dumps(mine)} -> {json.dumps(theirs)}")
    return out
