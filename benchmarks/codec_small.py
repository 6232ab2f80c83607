"""The default codec's encode speed on a real small model's many small tensors, beside XOR + zstd-3, in one run.

The reference workloads (benchmarks.workloads) have 57 tensors of 0.26-2.1 M elements; a real small model
has many more, and many far smaller: Qwen2.5-0.5B's 290 tensors (tied embeddings) are 49 RMSNorm weights
of 896 elements, 72 q/k/v biases of 128-896, 48 k/v projections of 114,688, 48 q/o of 802,816, 72 MLP
matrices of 4.36 M and one embedding of 136 M. A codec's fixed cost per tensor (Python, headers, kernel
dispatch, hashing) is paid 290 times per step there, and the k/v projections sit where a per-chunk cost
shows. This benchmark builds a step of exactly those shapes (``--model``, ``--layers`` to cut it down) and
times every codec on it, one thread, codecs taking turns within each repeat, medians and ratios.

The step (:func:`qwen_step`): fp32 masters initialised as benchmarks.workloads does (Student-t matrices,
median |w| 0.016-0.022; norms 1 + N(0, 0.05); biases t-distributed, median |b| 0.05), moments from
``WARM_STEPS`` real ``torch.optim.AdamW`` steps at lr 0 on gradients with per-row and per-column scales
(log-normal) and a persistent part, then one AdamW step at ``--lr`` (default 1e-6; betas 0.9/0.999, weight
decay 0.01 on matrices); both sides cast to bf16. The embedding's gradient reaches only the rows of the
tokens a batch holds (``EMBED_ROWS_SEEN`` of them, Zipf-drawn), as in a real step, so its other rows keep
zero moments and do not change. The gradients are synthetic, the optimizer and the casts are real.

    python -m benchmarks.codec_small                       # Qwen2.5-0.5B shapes, 24 layers
    python -m benchmarks.codec_small --model qwen2.5-1.5b --layers 8
    python -m benchmarks.codec_small --quick               # 2 layers, no embedding, 3 repeats

Writes benchmarks/results/codec_small{,-quick}.{md,json,png}.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from ckptdelta import delta
from benchmarks import baselines, harness
from benchmarks.codec import CkptDelta, _bits_equal, _clone

#: Hugging Face configs of the models whose shapes are built (hidden, intermediate, layers, heads,
#: kv heads, vocab; both tie their embeddings, both have q/k/v biases).
MODELS = {
    "qwen2.5-0.5b": dict(hidden=896, inter=4864, layers=24, heads=14, kv_heads=2, vocab=151936),
    "qwen2.5-1.5b": dict(hidden=1536, inter=8960, layers=28, heads=12, kv_heads=2, vocab=151936),
}
WARM_STEPS = 4
EMBED_ROWS_SEEN = 4096
_MEDIAN_ABS = {"embed": 0.018, "q": 0.022, "k": 0.022, "v": 0.018, "o": 0.016,
               "gate": 0.022, "up": 0.020, "down": 0.016, "bias": 0.05}


def shapes(model: str, layers: int | None = None, embed: bool = True) -> dict[str, tuple[int, ...]]:
    """The model's tensors, in its state dict's order: name -> shape."""
    c = MODELS[model]
    h, head = c["hidden"], c["hidden"] // c["heads"]
    kv = c["kv_heads"] * head
    out: dict[str, tuple[int, ...]] = {}
    if embed:
        out["model.embed_tokens.weight"] = (c["vocab"], h)
    for i in range(c["layers"] if layers is None else layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (h,)
        for n, rows in (("q", h), ("k", kv), ("v", kv)):
            out[p + f"self_attn.{n}_proj.weight"] = (rows, h)
            out[p + f"self_attn.{n}_proj.bias"] = (rows,)
        out[p + "self_attn.o_proj.weight"] = (h, h)
        out[p + "post_attention_layernorm.weight"] = (h,)
        out[p + "mlp.gate_proj.weight"] = (c["inter"], h)
        out[p + "mlp.up_proj.weight"] = (c["inter"], h)
        out[p + "mlp.down_proj.weight"] = (h, c["inter"])
    out["model.norm.weight"] = (h,)
    return out


def _kind(name: str) -> str:
    if "embed_tokens" in name:
        return "embed"
    if "norm" in name:
        return "norm"
    if name.endswith(".bias"):
        return "bias"
    return name.rsplit(".", 2)[-2].split("_")[0]


def _init(kind: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    if kind == "norm":
        return 1.0 + 0.05 * torch.randn(shape, generator=gen)
    z = torch.randn(shape, generator=gen)
    chi2 = torch.zeros(shape)
    for _ in range(5):                               # one draw at a time: the embedding is 136 M elements
        chi2 += torch.randn(shape, generator=gen).pow(2)
    t = z / torch.sqrt(chi2 / 5.0)
    return t * (_MEDIAN_ABS[kind] / t.abs().median())


def _adamw_step_pair(kind: str, w: torch.Tensor, lr: float, gen: torch.Generator) -> torch.Tensor:
    """The master after WARM_STEPS AdamW steps at lr 0 (the moments fill, the weights stay) and one at ``lr``."""
    p = torch.nn.Parameter(w)
    opt = torch.optim.AdamW([p], lr=0.0, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=0.0 if kind in ("norm", "bias") else 0.01, foreach=False)
    rows = torch.exp(torch.randn(w.shape[0], generator=gen))
    scale = rows[:, None] * torch.exp(0.5 * torch.randn(w.shape[1], generator=gen))[None, :] if w.dim() == 2 else rows
    scale = scale * 1e-3
    mean = torch.randn(w.shape, generator=gen) * 0.5
    for step in range(WARM_STEPS + 1):
        if step == WARM_STEPS:
            for g in opt.param_groups:
                g["lr"] = lr
        p.grad = scale * (mean + torch.randn(w.shape, generator=gen))
        opt.step()
    return p.detach()


def qwen_step(model: str = "qwen2.5-0.5b", layers: int | None = None, lr: float = 1e-6, seed: int = 0,
              embed: bool = True, max_elems: int | None = None) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One bf16 step (old, new) of the model's shapes, only the tensors of at most ``max_elems`` elements
    when given; see the module's docstring for how it is made."""
    gen = torch.Generator().manual_seed(seed)
    old: dict[str, torch.Tensor] = {}
    new: dict[str, torch.Tensor] = {}
    for name, shape in shapes(model, layers, embed).items():
        if max_elems is not None and int(np.prod(shape)) > max_elems:
            continue
        kind = _kind(name)
        w = _init(kind, shape, gen)
        old[name] = w.to(torch.bfloat16)
        if kind == "embed":
            v = shape[0]
            zipf = 1.0 / torch.arange(1, v + 1, dtype=torch.float64)
            seen = torch.unique(torch.multinomial(zipf, EMBED_ROWS_SEEN, replacement=True, generator=gen))
            moved = _adamw_step_pair(kind, w[seen].clone(), lr, gen)
            m = w.clone()
            m[seen] = moved
            new[name] = m.to(torch.bfloat16)
        else:
            new[name] = _adamw_step_pair(kind, w.clone(), lr, gen).to(torch.bfloat16)
    return old, new


def size_table(sd: dict[str, torch.Tensor]) -> list[dict]:
    """Tensors grouped by kind: count, elements each (min-max), share of the model's bytes."""
    total = sum(t.numel() for t in sd.values())
    groups: dict[str, list[int]] = {}
    for n, t in sd.items():
        k = _kind(n)
        k = {"q": "q/o", "o": "q/o", "k": "k/v", "v": "k/v", "gate": "mlp", "up": "mlp", "down": "mlp"}.get(k, k)
        groups.setdefault(k, []).append(t.numel())
    return [{"kind": k, "count": len(v), "min_elems": min(v), "max_elems": max(v),
             "share": sum(v) / total} for k, v in groups.items()]


def run(old: dict, new: dict, codecs: list, repeats: int) -> list[dict]:
    """Each codec encodes, then decodes+applies, in turn, ``repeats`` times (one thread); medians."""
    mb = baselines.dense_nbytes(new) / 1e6
    for c in codecs:
        c.know_parent(old)
        c.decode(_clone(old), c.encode(old, new))          # warm: kernels compiled, caches made
    t = {id(c): {"enc": [], "dec": [], "enc_cpu": [], "dec_cpu": []} for c in codecs}
    blobs, outs = {}, {}
    for _ in range(repeats):
        for c in codecs:
            t0, c0 = time.perf_counter(), time.thread_time()
            blobs[id(c)] = c.encode(old, new)
            t[id(c)]["enc"].append(time.perf_counter() - t0)
            t[id(c)]["enc_cpu"].append(time.thread_time() - c0)
            live = _clone(old)
            t0, c0 = time.perf_counter(), time.thread_time()
            outs[id(c)] = c.decode(live, blobs[id(c)])
            t[id(c)]["dec"].append(time.perf_counter() - t0)
            t[id(c)]["dec_cpu"].append(time.thread_time() - c0)
    rows = []
    for c in codecs:
        s = t[id(c)]
        rows.append({"codec": c.name, "bytes": baselines.encoded_nbytes(blobs[id(c)]),
                     "encode_s": statistics.median(s["enc"]), "encode_cpu_s": statistics.median(s["enc_cpu"]),
                     "decode_s": statistics.median(s["dec"]), "decode_cpu_s": statistics.median(s["dec_cpu"]),
                     "encode_samples": s["enc"],
                     "encode_mbs": mb / statistics.median(s["enc"]), "decode_mbs": mb / statistics.median(s["dec"]),
                     "exact": _bits_equal(outs[id(c)], new)})
    return rows


def _only(data: dict) -> str:
    return f", only its tensors of <= {data['max_elems']:,} elements" if data.get("max_elems") else ""


def render(data: dict) -> str:
    xor = next(r for r in data["rows"] if r["codec"].startswith("xor"))
    lines = ["# The default codec on a small model's many small tensors", "",
             f"{harness.machine()}; `{data['command']}`; {data['model']}, {data['layers']} layers"
             f"{'' if data['embed'] else ', no embedding'}"
             f"{_only(data)}: {data['tensors']} tensors, {data['mb']:.1f} MB bf16, "
             f"lr {data['lr']:g}, {100 * data['changed']:.2f}% of elements changed; one thread, median of "
             f"{data['repeats']} repeats, codecs taking turns in each. Speeds are MB of model per second; "
             "x = XOR + zstd-3's time / the codec's, the same run, of wall time and [of the thread's CPU time, "
             "which a shared machine's waits for a core do not inflate].", "",
             "| tensors | count | elements each | share of bytes |", "|---|---:|---:|---:|"]
    for g in data["sizes"]:
        each = f"{g['min_elems']:,}" if g["min_elems"] == g["max_elems"] else f"{g['min_elems']:,}-{g['max_elems']:,}"
        lines.append(f"| {g['kind']} | {g['count']} | {each} | {100 * g['share']:.2f}% |")
    lines += ["", "| codec | bytes | fewer bytes than XOR + zstd-3 | encode | encode CPU | **encode x** [CPU] "
              "| decode+apply | decode+apply CPU | decode+apply x [CPU] | bit-exact |",
              "|---|---:|---:|---:|---:|---:|---:|---:|---:|:-:|"]
    for r in data["rows"]:
        dc = r.get("decode_cpu_s")            # not in runs from before it was recorded
        dcpu = "n/a" if dc is None else f"{1e3 * dc:.1f} ms"
        dx = "" if dc is None else f" [{xor['decode_cpu_s'] / dc:.2f}x]"
        lines.append(f"| {r['codec']} | {r['bytes']:,} | {xor['bytes'] / r['bytes']:.2f}x | "
                     f"{1e3 * r['encode_s']:.1f} ms ({r['encode_mbs']:,.0f} MB/s) | {1e3 * r['encode_cpu_s']:.1f} ms | "
                     f"**{xor['encode_s'] / r['encode_s']:.2f}x** [{xor['encode_cpu_s'] / r['encode_cpu_s']:.2f}x] | "
                     f"{1e3 * r['decode_s']:.1f} ms ({r['decode_mbs']:,.0f} MB/s) | {dcpu} | "
                     f"{xor['decode_s'] / r['decode_s']:.2f}x{dx} | {'yes' if r['exact'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def plot(data: dict, path: str) -> None:
    with harness.figure(path, figsize=(7, 3.5)) as (_, ax):
        names = [r["codec"] for r in data["rows"]]
        for i, r in enumerate(data["rows"]):
            ax.scatter([i] * len(r["encode_samples"]), [1e3 * s for s in r["encode_samples"]], s=12)
        ax.set_xticks(range(len(names)), names, fontsize=8)
        ax.set_ylabel("encode, ms (every repeat)")
        ax.set_title(f"{data['model']}, {data['tensors']} tensors, one thread")


def main(argv: list[str] | None = None) -> int:
    ap = harness.parser("codec_small", __doc__, full_doc=True, quick="2 layers, no embedding, 3 repeats",
                        out="--out")
    ap.add_argument("--model", default="qwen2.5-0.5b", choices=sorted(MODELS))
    ap.add_argument("--layers", type=int, default=None, help="first N layers (default: all)")
    ap.add_argument("--no-embed", action="store_true", help="leave the embedding out")
    ap.add_argument("--max-elems", type=int, default=None,
                    help="only the tensors of at most this many elements (1000000: norms, biases, q/k/v/o)")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--from-json", metavar="PATH", help="write the table and plot of an earlier run's JSON again")
    args = ap.parse_args(argv)
    if args.from_json:
        data = harness.read_json(args.from_json)
        harness.write(args.from_json[:-len(".json")], render(data), None, lambda p: plot(data, p))
        return 0
    layers = 2 if args.quick and args.layers is None else args.layers
    embed = not (args.no_embed or args.quick)
    repeats = args.repeats or (3 if args.quick else 7)
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    old, new = qwen_step(args.model, layers, args.lr, embed=embed, max_elems=args.max_elems)
    print(f"step built in {time.perf_counter() - t0:.1f} s", flush=True)
    codecs = [baselines.XorZstd(), CkptDelta(threads=1), CkptDelta(threads=1, context=False)]
    rows = run(old, new, codecs, repeats)
    changed = sum(int((delta.dtypes.host_bits(old[k]) != delta.dtypes.host_bits(new[k])).sum()) for k in new)
    numel = sum(t.numel() for t in new.values())
    data = {"command": harness.command("codec_small", argv if argv is not None else __import__("sys").argv[1:]),
            "model": args.model, "max_elems": args.max_elems, "layers": layers or MODELS[args.model]["layers"], "embed": embed, "lr": args.lr,
            "tensors": len(new), "mb": baselines.dense_nbytes(new) / 1e6, "changed": changed / numel,
            "repeats": repeats, "sizes": size_table(new), "rows": rows}
    stem = "codec_small" + ("-quick" if args.quick else "") + ("" if args.max_elems is None else f"-upto{args.max_elems}")
    harness.write(f"{args.out}/{stem}", render(data), data,
                  lambda p: plot(data, p))
    return 0 if all(r["exact"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
