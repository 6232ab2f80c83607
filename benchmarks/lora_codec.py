"""How compressible is a LoRA step? The codec on real adapter steps, beside XOR + zstd-3.

A Llama-style base (random bf16 weights, ``--hidden`` wide) gets a peft LoRA adapter
on every linear layer (rank 16 and 64; peft keeps adapters in fp32 over a bf16 base),
trained by AdamW on real gradients of next-token cross-entropy over random token
batches. After ``--warmup`` steps (so Adam's moments are populated and lora_B is no
longer zero) each consecutive pair of adapter snapshots is encoded by ckptdelta's
codec (what a delta of a LoRA run holds: one record per tensor) and by XOR + zstd-3
per tensor (benchmarks/baselines.py). Both lora_A and lora_B change in every element
at these learning rates: the dense regime, unlike a full model's step.

    python -m benchmarks.lora_codec [--hidden 512] [--steps 3]

Writes benchmarks/results/lora_codec.{md,json} (``--dtype bf16``: lora_codec_bf16.*, the adapter cast to
bf16 as ``Publisher(dtype=torch.bfloat16)`` publishes it).
"""

from __future__ import annotations

import collections
import os
import sys
import time

import numpy as np
import torch

from ckptdelta import delta
from benchmarks import baselines, harness
from ckptdelta.delta import record

ENCODINGS = record.ENCODING_NAMES


def trajectory(hidden: int, layers: int, rank: int, lr: float, warmup: int, steps: int, seed: int = 0):
    """``steps + 1`` consecutive adapter snapshots (peft's saved names -> fp32 tensors)."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=2000, hidden_size=hidden, intermediate_size=int(hidden * 2.6875) // 8 * 8,
                      num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                      num_key_value_heads=max(1, hidden // 128), max_position_embeddings=256,
                      tie_word_embeddings=False)
    base = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear",
                                            lora_dropout=0.0))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    g = torch.Generator().manual_seed(seed + 1)

    def step() -> None:
        x = torch.randint(0, cfg.vocab_size, (8, 64), generator=g)
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()

    for _ in range(warmup):
        step()
    snaps = []
    for i in range(steps + 1):
        snaps.append({k: v.detach().clone() for k, v in get_peft_model_state_dict(model).items()})
        if i < steps:
            step()
    return snaps


_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32}


def _keys(t: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """docs/FORMAT.md's keys of a float tensor (ordered like the floats, one ulp = 1) and each element's
    exponent field (its class in encodings 4 and 5), as int64."""
    w = t.element_size()
    b = t.detach().contiguous().view(torch.uint8).numpy().view(_UINT[w]).ravel().astype(np.int64)
    bits = 8 * w
    sign, mask = 1 << (bits - 1), (1 << bits) - 1
    mbits = {"torch.float32": 23, "torch.bfloat16": 7, "torch.float16": 10}[str(t.dtype)]
    key = np.where(b & sign, ~b & mask, b | sign)
    return key, (b & (sign - 1)) >> mbits


def _bucket(v: np.ndarray) -> np.ndarray:
    """Bit length of |v| (0 for 0)."""
    a = np.abs(v)
    out = np.zeros(a.shape, np.int64)
    nz = a > 0
    out[nz] = np.floor(np.log2(a[nz].astype(np.float64))).astype(np.int64) + 1
    return out


def _model_bits(step: np.ndarray, ctx: np.ndarray) -> float:
    """Bits to code ``step`` given ``ctx`` under a model of step *sizes*: the empirical entropy of the step's bit
    length within each context (its tables counted as free), then the bits below the leading one as they are
    and a sign per moved element. What a coder of that model family reaches at best on these steps."""
    size = _bucket(step)
    return float(np.maximum(size - 1, 0).sum() + (size > 0).sum()) + _entropy_bits(size, ctx)


def _entropy_bits(sym: np.ndarray, ctx: np.ndarray) -> float:
    """Bits of the empirical conditional entropy of ``sym`` given ``ctx`` (frequencies per context, free)."""
    order = np.lexsort((sym, ctx))
    pairs = np.stack([ctx[order], sym[order]])
    _, counts = np.unique(pairs, axis=1, return_counts=True)
    _, ctx_counts = np.unique(ctx, return_counts=True)
    return -(float((counts * np.log2(counts)).sum()) - float((ctx_counts * np.log2(ctx_counts)).sum()))


def _model_bits_signed(step: np.ndarray, ctx: np.ndarray) -> float:
    """As :func:`_model_bits`, with the step's direction coded in its context too (the symbol is the signed bit
    length): what a context that knows the previous step's direction can predict."""
    size = _bucket(step)
    return float(np.maximum(size - 1, 0).sum()) + _entropy_bits(np.sign(step) * size + 64, ctx)


def model_estimates(older: dict | None, old: dict, new: dict) -> dict:
    """Bytes per step that coders of two model families could reach at best (see :func:`_model_bits`):
    step sizes per parent exponent class (what encodings 4 and 5 model, with Golomb codes), and signed step
    sizes per class and signed size of the previous step (what encoding 6 models: a coder that keeps the
    grandparent); None without it."""
    by_class = by_prev = 0.0
    for k in new:
        k1, cls = _keys(old[k])
        step = _keys(new[k])[0] - k1
        by_class += _model_bits(step, cls)
        if older is not None:
            prev = k1 - _keys(older[k])[0]
            by_prev += _model_bits_signed(step, cls * 128 + np.sign(prev) * _bucket(prev) + 64)
    return {"model_class_bytes": by_class / 8, "model_prev_bytes": by_prev / 8 if older is not None else None}


def measure(old: dict, new: dict, older: dict | None = None) -> dict:
    """XOR + zstd-3 and ckptdelta on one step; with ``older`` (the snapshot before ``old``) ckptdelta's records
    are coded against it too, as a publisher does where the parent is a delta (encoding 6)."""
    raw = sum(t.numel() * t.element_size() for t in new.values())
    n = sum(t.numel() for t in new.values())
    changed = sum(int((baselines.to_bits(old[k]) != baselines.to_bits(new[k])).sum()) for k in new)
    xor = baselines.encoded_nbytes(baselines.XorZstd().encode(old, new))
    t0 = time.perf_counter()
    encs = list(delta.encode_many([(k, old[k], new[k], None, None if older is None else older[k])
                                   for k in sorted(new)], threads=1))
    encode_s = time.perf_counter() - t0
    ckd = sum(len(e.to_bytes()) for e in encs)
    t0 = time.perf_counter()
    for e in encs:
        delta.decode(old[e.name], e, grandparent=None if older is None else older[e.name])
    decode_s = time.perf_counter() - t0
    chunks = collections.Counter(ENCODINGS.get(c.encoding, str(c.encoding)) for e in encs for c in e.header.chunks)
    return {"raw_bytes": raw, "changed": changed / n, "xor_zstd3_bytes": xor, "ckptdelta_bytes": ckd,
            "ratio_xor": raw / xor, "ratio_ckptdelta": raw / ckd, "vs_xor": xor / ckd, "encode_s": encode_s,
            "decode_s": decode_s, "grandparent": older is not None,
            "chunks": dict(chunks)}


def markdown(rows: list[dict], args: dict, cmd: str) -> str:
    """The table of ``rows`` measured with ``args`` (the run's flags, as its JSON keeps them) by ``cmd``."""
    lines = [f"# LoRA steps: ckptdelta's codec beside XOR + zstd-3 (`{cmd}`)", "",
             f"Llama-style base, hidden {args['hidden']}, {args['layers']} layers, bf16; peft LoRA (fp32) on every "
             f"linear, published as {args['dtype']}, "
             f"AdamW (no weight decay) on real gradients, {args['warmup']} warm-up steps, medians of {args['steps']} "
             "consecutive steps (the first step has no step before it: the last column's median is over the "
             "others). Ratio = adapter bytes / delta bytes. ckptdelta codes each step against the snapshot before "
             "its parent too (docs/FORMAT.md encoding 6), as its publisher does where the parent is a delta; "
             "*without grandparent* is the same codec on one step (the second) with nothing before it (as the "
             "first delta after an anchor is: encodings 4/5). Encode and decode: seconds per step, one thread.",
             "",
             "The two *model* columns are not coders: they are the empirical entropy of each element's step (in "
             "ulps, docs/FORMAT.md's keys) under a model of step sizes, the bit length of the step coded with "
             "its exact frequencies per context and the bits below its leading one as they are. *Per class*: "
             "the context is the parent's exponent (what encodings 4 and 5 model); *+ previous step*: also the "
             "signed size of the step before, and the step's direction in the symbol (what encoding 6 models). "
             "They show how far any coder of "
             "those models could go on these steps, in bytes fewer than XOR + zstd-3.", "",
             "| rank | lr | adapter | changed | XOR + zstd-3 | ckptdelta | bytes vs XOR + zstd-3 | without "
             "grandparent | model: per class | model: + previous step | encode / decode | chunk encodings |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['rank']} | {r['lr']:g} | {r['raw_bytes'] / 1e6:.2f} MB | {100 * r['changed']:.1f}% | "
                     f"{r['ratio_xor']:.3f}x | {r['ratio_ckptdelta']:.3f}x | **{r['vs_xor']:.3f}x fewer** | "
                     f"{r['vs_xor_no_grandparent']:.3f}x fewer | "
                     f"{r['model_class_vs_xor']:.3f}x fewer | {r['model_prev_vs_xor']:.3f}x fewer | "
                     f"{r['encode_s'] * 1e3:.0f} / {r['decode_s'] * 1e3:.0f} ms | "
                     f"{', '.join(f'{k} {v}' for k, v in sorted(r['chunks'].items()))} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = harness.parser("lora_codec", __doc__, out=None)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--ranks", default="16,64")
    ap.add_argument("--lrs", default="1e-5,1e-4")
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32",
                    help="publish the adapter as trained (fp32) or cast to bf16 (Publisher(dtype=torch.bfloat16): "
                         "the dtype vLLM computes LoRA in on a bf16 base)")
    args = ap.parse_args(argv)
    rows = []
    for rank in map(int, args.ranks.split(",")):
        for lr in map(float, args.lrs.split(",")):
            snaps = trajectory(args.hidden, args.layers, rank, lr, args.warmup, args.steps)
            if args.dtype == "bf16":
                snaps = [{k: v.to(torch.bfloat16) for k, v in s.items()} for s in snaps]
            per = [{**measure(snaps[i], snaps[i + 1], snaps[i - 1] if i else None),
                    **model_estimates(snaps[i - 1] if i else None, snaps[i], snaps[i + 1])} for i in range(args.steps)]
            first = measure(snaps[1], snaps[2]) if args.steps > 1 else per[0]     # as after an anchor
            for p in per:
                p["model_class_vs_xor"] = p["xor_zstd3_bytes"] / p["model_class_bytes"]
                if p["model_prev_bytes"] is not None:
                    p["model_prev_vs_xor"] = p["xor_zstd3_bytes"] / p["model_prev_bytes"]
            row = {"rank": rank, "lr": lr, "steps": per,
                   **{k: float(np.median([p[k] for p in per if k in p])) for k in
                      ("raw_bytes", "changed", "ratio_xor", "model_class_vs_xor", "model_prev_vs_xor")},
                   # with the grandparent: every step but the first; without it: the second step, coded as the
                   # first delta after an anchor is
                   **{k: float(np.median([p[k] for p in per if p["grandparent"]] or [p[k] for p in per]))
                      for k in ("ratio_ckptdelta", "vs_xor", "encode_s", "decode_s")},
                   "vs_xor_no_grandparent": first["vs_xor"],
                   "chunks": per[-1]["chunks"]}
            rows.append(row)
            print(f"rank {rank:>3} lr {lr:g}: {row['raw_bytes'] / 1e6:.2f} MB adapter, {100 * row['changed']:.1f}% "
                  f"changed, XOR+zstd-3 {row['ratio_xor']:.3f}x, ckptdelta {row['ratio_ckptdelta']:.3f}x "
                  f"({row['vs_xor']:.3f}x fewer bytes than XOR+zstd-3; {row['vs_xor_no_grandparent']:.3f}x without "
                  f"the grandparent), chunks {row['chunks']}; models at best: "
                  f"{row['model_class_vs_xor']:.3f}x, {row['model_prev_vs_xor']:.3f}x", flush=True)
    stem = "lora_codec" if args.dtype == "fp32" else f"lora_codec_{args.dtype}"
    cmd = harness.command("lora_codec", argv if argv is not None else sys.argv[1:])
    harness.write(os.path.join(harness.RESULTS, stem), markdown(rows, vars(args), cmd),
                  {"args": vars(args), "rows": rows}, echo=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
