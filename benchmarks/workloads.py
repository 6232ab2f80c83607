"""The reference workload: consecutive policy snapshots from real optimizer dynamics.

Every benchmark reuses this module, so what it produces is meant to look like what an
RL trainer publishes, not like random noise:

* A small decoder-only transformer in plain torch, Llama-style names and layout
  (``model.embed_tokens.weight``, ``model.layers.{i}.self_attn.{q,k,v,o}_proj.weight``,
  ``model.layers.{i}.mlp.{gate,up,down}_proj.weight``, RMSNorm weights
  ``input_layernorm`` / ``post_attention_layernorm`` / ``model.norm``, untied
  ``lm_head.weight``). Sizes: ``"tiny"`` (3.7M parameters, tests) and ``"small"``
  (23.2M parameters, benchmarks).
* Initialised to look trained rather than pristine: matrices are heavy-tailed
  (Student-t, 5 dof) and rescaled so that median |w| is 0.016-0.022 depending on the
  projection (about 0.02 overall, as in 1-10B LLMs); norm weights are 1 + N(0, 0.05).
  A short warm-up (``WARMUP_STEPS`` AdamW steps at lr 3e-5) follows, so the weights
  are not the init and, more importantly, the Adam moments are populated, as in a
  run that has been going for a while (a fresh Adam takes sign-like steps of exactly
  ``lr`` on every element, which would overstate the change fraction).
* fp32 master weights persist across steps (never re-rounded from bf16), AdamW with
  betas (0.9, 0.999), eps 1e-8, weight decay 0.01 on matrices and 0 on norm weights,
  on gradients of next-token cross-entropy over a synthetic but structured
  language (arithmetic strings, copy/induction segments, a sparse Markov chain over the
  whole vocabulary with Zipfian starts). After each step the cast of the master weights
  is the published snapshot. Snapshot 0 is the warm-up endpoint, shared by all
  learning rates; step ``t`` sees the same batch at every learning rate.

Published dtypes (``dtype=``):

* ``"bf16"``: every tensor is ``master.to(torch.bfloat16)`` (round to nearest even).
* ``"fp32"``: the master weights themselves.
* ``"fp8"``: laid out like a DeepSeek-V3 style fp8 checkpoint: every 2-D projection
  inside the layers is ``float8_e4m3fn`` of ``master * 2**k`` with a fixed per-tensor
  power-of-two ``k`` (chosen once from snapshot 0 so the tensor's amax lands in
  [224, 448]; a power of two keeps the scaling exact, and fixing it keeps snapshots
  comparable), with its inverse scale as a 1-element fp32 tensor
  ``<name minus .weight>.weight_scale_inv``; embeddings, ``lm_head`` and norm weights
  stay bf16. So an "fp8" snapshot is mixed-dtype (fp8 + bf16 + fp32 scalars), as real
  fp8 checkpoints are. A plain unscaled cast would put most weights (|w| < 2**-6) in
  e4m3's subnormal range, which no real checkpoint does.

Measured change statistics (fraction of elements whose bits differ; seed 0; "1 step" is
snapshot 0 vs 1, with the mean over the 12 consecutive pairs in brackets; "10 steps"
is snapshot 0 vs 10; fp8 counts the fp8 tensors only; ``python -m
benchmarks.workloads tiny|small`` prints this table):

    size   dtype  lr      1 step            10 steps
    tiny   bf16   1e-7    0.146% (0.141%)    1.01%
    tiny   bf16   1e-6    1.12%  (1.06%)     6.73%
    tiny   bf16   3e-6    2.81%  (2.67%)    15.5%
    tiny   bf16   1e-5    7.43%  (7.05%)    34.5%
    tiny   fp8    1e-6    0.076% (0.073%)    0.65%
    tiny   fp32   1e-6   98.4%  (98.8%)     99.2%
    small  bf16   1e-7    0.134% (0.127%)    0.90%
    small  bf16   1e-6    1.01%  (0.96%)     6.08%
    small  bf16   3e-6    2.55%  (2.42%)    14.0%
    small  bf16   1e-5    6.77%  (6.38%)    31.4%
    small  fp8    1e-6    0.065% (0.060%)    0.55%
    small  fp32   1e-6   95.0%  (95.7%)     96.4%

lr 1e-6 one step sits in the field's 98-99.5% unchanged (../shared/reference/ANCHORS.md).
Ten steps change ~6x, not 10x, the elements of one step: the same elements (small
weights, whose ulp is small) change step after step, and few flip back (tiny, lr 1e-6:
the union of the ten 1-step change sets is 6.9% of elements, the net 0->10 change
6.7%). The field reports ~10% for 10-step windows at lr 1e-6, so these windows are
somewhat easier than theirs. 95% of the fp32 elements that do not change are in
embedding rows of tokens the warm-up and the run never saw (zero Adam moments), as in
a real run. The change fraction
decays slowly along the run (the first pair is the largest) as Adam's second moment
grows.

Caching: everything is cached under ``benchmarks/.cache/workloads/`` (git-ignored) as
safetensors (never pickle): the warm-up state (master + Adam moments) per
(size, seed) and the fp32 master of every step per (size, seed, lr, steps); the bf16
and fp8 snapshots are derived by a deterministic cast at load time. Keys include
``GEN_VERSION``; bump it whenever a change here alters the bits produced. Writes are
atomic (temp file + rename) and guarded by a lock file, so concurrent users of the
tree share one cache. Generation is deterministic for a given machine and torch build
(fixed seeds, deterministic algorithms, single-process data generation); different
CPUs/BLAS builds may round matmuls differently, which is why the cache, not
regeneration, is the reference. ``CKPTDELTA_BENCH_CACHE`` or ``cache_dir=`` moves it.

Costs (2 shared cores, one generation thread): a tiny step takes ~0.2-0.5 s, a small
one ~1-2 s. ``reference_workloads(quick=True)`` builds in ~15-25 s cold and ~1-3 s
cached; the full small list in ~4 min cold and ~1.5 s cached. Disk: the fp32 masters
of one trajectory take ~0.18 GB (tiny) / ~1.2 GB (small), plus the warm-up state
(0.04 / 0.27 GB); the full small list holds ~5 GB under ``benchmarks/.cache/``.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import math
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

__all__ = [
    "Workload",
    "SIZES",
    "LRS",
    "WINDOWS",
    "GEN_VERSION",
    "snapshots",
    "pair",
    "workload_name",
    "reference_workloads",
    "scaled_pair",
    "scale_state_dict",
    "change_fraction",
    "cast_snapshot",
]

GEN_VERSION = 1
LRS = (1e-7, 1e-6, 3e-6, 1e-5)
WINDOWS = (1, 10)
WARMUP_STEPS = 16
WARMUP_LR = 3e-5
BETAS = (0.9, 0.999)
EPS = 1e-8
WEIGHT_DECAY = 0.01
DTYPES = ("bf16", "fp8", "fp32")

# name: (vocab, d_model, n_layers, n_heads, d_ff, batch, seq_len)
SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(vocab=1024, d_model=256, n_layers=4, n_heads=4, d_ff=688, batch=8, seq_len=64),
    "small": dict(vocab=4096, d_model=512, n_layers=6, n_heads=8, d_ff=1376, batch=8, seq_len=64),
}

# median |w| per kind of matrix, roughly what 1-10B LLMs show
_MEDIAN_ABS = {
    "embed": 0.018, "q": 0.022, "k": 0.022, "v": 0.018, "o": 0.016,
    "gate": 0.022, "up": 0.020, "down": 0.016, "head": 0.020,
}

_DEFAULT_CACHE = Path(__file__).resolve().parent / ".cache" / "workloads"


@dataclass(frozen=True, eq=False)  # eq=False: compare/hash by identity (the dicts hold tensors)
class Workload:
    """One pair of snapshots: ``old`` published, then ``new`` ``window`` steps later."""

    name: str                      # e.g. "bf16-lr1e-06-1step", "fp8-lr1e-06-1step"
    old: dict[str, torch.Tensor]   # CPU tensors, contiguous
    new: dict[str, torch.Tensor]
    lr: float
    window: int
    dtype: str

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.new.values())

    def __repr__(self) -> str:  # the dicts are large; keep reprs short
        return (f"Workload({self.name!r}, {len(self.new)} tensors, {self.nbytes / 2**20:.1f} MiB, "
                f"lr={self.lr:g}, window={self.window}, dtype={self.dtype!r})")


def workload_name(dtype: str, lr: float, window: int) -> str:
    short = f"{lr:.0e}"
    return f"{dtype}-lr{short if float(short) == lr else f'{lr:.3e}'}-{window}step"


def _lr_key(lr: float) -> str:
    return f"{lr:.6e}".replace(".", "p")  # exact enough, and no dot (lock names use with_suffix)


# --------------------------------------------------------------------------- model

class _RMSNorm(torch.nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class _Block(torch.nn.Module):
    def __init__(self, d: int, h: int, ff: int):
        super().__init__()
        self.n_heads = h
        self.input_layernorm = _RMSNorm(d)
        self.post_attention_layernorm = _RMSNorm(d)
        self.self_attn = torch.nn.Module()
        for p in ("q_proj", "k_proj", "v_proj", "o_proj"):
            setattr(self.self_attn, p, torch.nn.Linear(d, d, bias=False))
        self.mlp = torch.nn.Module()
        self.mlp.gate_proj = torch.nn.Linear(d, ff, bias=False)
        self.mlp.up_proj = torch.nn.Linear(d, ff, bias=False)
        self.mlp.down_proj = torch.nn.Linear(ff, d, bias=False)

    def forward(self, x, cos, sin):
        b, s, d = x.shape
        h = self.input_layernorm(x)
        a = self.self_attn
        q, k, v = (p(h).view(b, s, self.n_heads, -1).transpose(1, 2) for p in (a.q_proj, a.k_proj, a.v_proj))
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + a.o_proj(o.transpose(1, 2).reshape(b, s, d))
        h = self.post_attention_layernorm(x)
        m = self.mlp
        return x + m.down_proj(F.silu(m.gate_proj(h)) * m.up_proj(h))


def _rope(x, cos, sin):
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class _Decoder(torch.nn.Module):
    def __init__(self, vocab, d_model, n_layers, n_heads, d_ff, **_):
        super().__init__()
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding(vocab, d_model)
        self.model.layers = torch.nn.ModuleList(_Block(d_model, n_heads, d_ff) for _ in range(n_layers))
        self.model.norm = _RMSNorm(d_model)
        self.lm_head = torch.nn.Linear(d_model, vocab, bias=False)
        self.head_dim = d_model // n_heads

    def forward(self, tokens):
        s = tokens.shape[1]
        inv = 1.0 / (10000 ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim))
        ang = torch.outer(torch.arange(s, dtype=torch.float32), inv)
        cos, sin = ang.cos(), ang.sin()
        x = self.model.embed_tokens(tokens)
        for blk in self.model.layers:
            x = blk(x, cos, sin)
        return self.lm_head(self.model.norm(x))


def _kind(name: str) -> str:
    if "embed_tokens" in name:
        return "embed"
    if name.startswith("lm_head"):
        return "head"
    if name.endswith("norm.weight") or "layernorm" in name:
        return "norm"
    return name.rsplit(".", 2)[-2].split("_")[0]  # q/k/v/o/gate/up/down


def _init_trained_like(model: torch.nn.Module, gen: torch.Generator) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            kind = _kind(name)
            if kind == "norm":
                p.copy_(1.0 + 0.05 * torch.randn(p.shape, generator=gen))
                continue
            # Student-t with 5 dof: normal / sqrt(chi2_5 / 5), heavier tails than a Gaussian
            z = torch.randn(p.shape, generator=gen)
            chi2 = torch.randn((5,) + tuple(p.shape), generator=gen).pow(2).sum(0)
            t = z / torch.sqrt(chi2 / 5.0)
            p.copy_(t * (_MEDIAN_ABS[kind] / t.abs().median()))


# --------------------------------------------------------------------------- data

def _batch(cfg: dict, seed: int, step: int) -> torch.Tensor:
    """A deterministic batch of token sequences (batch, seq_len + 1) for ``step``.

    Three kinds of sequence, mixed per row: arithmetic strings ``a+b=c;`` (digits are
    tokens 2-11, '+' 12, '=' 13, ';' 14), copy/induction (a Zipfian random segment
    repeated), and a sparse Markov chain over the whole vocabulary (each token has 4
    successors with probabilities .6/.2/.1/.1, fixed per seed), started from a Zipfian
    token. The Markov chain makes every vocabulary row see gradient sometimes.
    """
    V, B, S = cfg["vocab"], cfg["batch"], cfg["seq_len"] + 1
    lang = np.random.default_rng([seed, 7919])
    succ = lang.integers(16, V, size=(V, 4))
    rng = np.random.default_rng([seed, 104729, int(step < 0), abs(step)])  # warm-up uses step < 0
    ranks = np.arange(1, V - 16 + 1, dtype=np.float64)
    zipf = (1.0 / ranks) / (1.0 / ranks).sum()
    out = np.empty((B, S), dtype=np.int64)
    for r in range(B):
        kind = rng.integers(0, 3)
        if kind == 0:
            toks: list[int] = []
            while len(toks) < S:
                a, b = rng.integers(0, 1000, size=2)
                for ch in f"{a}+{b}={a + b};":
                    toks.append(2 + int(ch) if ch.isdigit() else {"+": 12, "=": 13, ";": 14}[ch])
            out[r] = toks[:S]
        elif kind == 1:
            seg = 16 + rng.choice(V - 16, size=int(rng.integers(6, 20)), p=zipf)
            out[r] = np.tile(seg, S // len(seg) + 1)[:S]
        else:
            t = 16 + int(rng.choice(V - 16, p=zipf))
            choice = rng.choice(4, size=S, p=[0.6, 0.2, 0.1, 0.1])
            for i in range(S):
                out[r, i] = t
                t = int(succ[t, choice[i]])
    out[:, 0] = 0  # BOS
    return torch.from_numpy(out)


# --------------------------------------------------------------------------- training

def _make(size: str, seed: int):
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; known: {sorted(SIZES)}")
    cfg = SIZES[size]
    gen = torch.Generator().manual_seed(seed)
    model = _Decoder(**cfg)
    _init_trained_like(model, gen)
    decay = [p for n, p in model.named_parameters() if _kind(n) != "norm"]
    no_decay = [p for n, p in model.named_parameters() if _kind(n) == "norm"]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}],
        lr=WARMUP_LR, betas=BETAS, eps=EPS, foreach=False, fused=False,
    )
    return cfg, model, opt


def _train_step(model, opt, cfg, seed, step, lr):
    for g in opt.param_groups:
        g["lr"] = lr
    tokens = _batch(cfg, seed, step)
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return float(loss.detach())


def _opt_state_tensors(model, opt) -> dict[str, torch.Tensor]:
    out = {}
    for n, p in model.named_parameters():
        st = opt.state[p]
        out[f"exp_avg/{n}"] = st["exp_avg"]
        out[f"exp_avg_sq/{n}"] = st["exp_avg_sq"]
        out[f"step/{n}"] = st["step"].reshape(1).to(torch.float32)
    return out


def _load_opt_state(model, opt, tensors):
    for n, p in model.named_parameters():
        opt.state[p] = {
            "step": tensors[f"step/{n}"].reshape(()).clone(),
            "exp_avg": tensors[f"exp_avg/{n}"].clone(),
            "exp_avg_sq": tensors[f"exp_avg_sq/{n}"].clone(),
        }


@contextlib.contextmanager
def _deterministic():
    """Deterministic algorithms and a fixed intra-op thread count while generating.

    One thread by default (``CKPTDELTA_BENCH_THREADS`` overrides): on a shared 2-core
    machine two spinning threads run 3-4x slower than one, and 1- and 2-thread runs were
    checked to give identical bits.
    """
    prev = torch.are_deterministic_algorithms_enabled()
    prev_threads = torch.get_num_threads()
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.set_num_threads(int(os.environ.get("CKPTDELTA_BENCH_THREADS", "1")))
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(prev)
        torch.set_num_threads(prev_threads)


# --------------------------------------------------------------------------- cache

def _cache_root(cache_dir) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("CKPTDELTA_BENCH_CACHE")
    return Path(env) if env else _DEFAULT_CACHE


@contextlib.contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _save_atomic(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    os.close(fd)
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, tmp, metadata=metadata)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def _warmup_path(root: Path, size: str, seed: int) -> Path:
    return root / f"warmup-{size}-seed{seed}-w{WARMUP_STEPS}-lr{_lr_key(WARMUP_LR)}-v{GEN_VERSION}.safetensors"


def _traj_dir(root: Path, size: str, seed: int, lr: float, steps: int) -> Path:
    return root / f"traj-{size}-seed{seed}-lr{_lr_key(lr)}-steps{steps}-v{GEN_VERSION}"


def _warmup_state(root: Path, size: str, seed: int):
    """(cfg, model, opt) after the warm-up, from cache or computed and cached."""
    cfg, model, opt = _make(size, seed)
    path = _warmup_path(root, size, seed)
    with _locked(path):
        if path.exists():
            t = load_file(path)
            with torch.no_grad():
                for n, p in model.named_parameters():
                    p.copy_(t[f"master/{n}"])
            _load_opt_state(model, opt, t)
        else:
            with _deterministic():
                for s in range(WARMUP_STEPS):
                    _train_step(model, opt, cfg, seed, -1 - s, WARMUP_LR)
            t = {f"master/{n}": p.detach() for n, p in model.named_parameters()}
            t.update(_opt_state_tensors(model, opt))
            _save_atomic(t, path, {"generator": f"ckptdelta.benchmarks.workloads v{GEN_VERSION}"})
    return cfg, model, opt


def _master_paths(root: Path, size: str, lr: float, steps: int, seed: int) -> list[Path]:
    """Paths of the fp32 master snapshots 0..steps, generating them if absent."""
    d = _traj_dir(root, size, seed, lr, steps)
    paths = [d / f"master-{i:04d}.safetensors" for i in range(steps + 1)]
    done = d / "COMPLETE"
    if done.exists():
        return paths
    with _locked(d):
        if done.exists():
            return paths
        cfg, model, opt = _warmup_state(root, size, seed)
        meta = {"generator": f"ckptdelta.benchmarks.workloads v{GEN_VERSION}", "size": size,
                "seed": str(seed), "lr": repr(lr)}
        _save_atomic({n: p.detach() for n, p in model.named_parameters()}, paths[0], {**meta, "step": "0"})
        with _deterministic():
            for s in range(steps):
                _train_step(model, opt, cfg, seed, s, lr)
                _save_atomic({n: p.detach() for n, p in model.named_parameters()}, paths[s + 1],
                             {**meta, "step": str(s + 1)})
        done.write_text("ok\n")
    return paths


# --------------------------------------------------------------------------- casts

def _fp8_exponent(master0: torch.Tensor) -> int:
    """k such that amax * 2**k is in [224, 448]: e4m3fn's top binade, exact scaling."""
    amax = float(master0.abs().max())
    if amax == 0.0:
        return 0
    return int(math.floor(math.log2(448.0 / amax)))


def _is_fp8_target(name: str, t: torch.Tensor) -> bool:
    return t.dim() == 2 and _kind(name) in ("q", "k", "v", "o", "gate", "up", "down")


def cast_snapshot(master: dict[str, torch.Tensor], dtype: str,
                  fp8_exponents: dict[str, int] | None = None) -> dict[str, torch.Tensor]:
    """The published snapshot of fp32 ``master`` weights in ``dtype`` ("bf16", "fp8", "fp32").

    For "fp8", ``fp8_exponents`` (name -> k, from :func:`fp8_exponents`) must be fixed
    across the snapshots being compared; by default it is derived from ``master``.
    """
    if dtype == "fp32":
        return {n: t.to(torch.float32).contiguous() for n, t in master.items()}
    if dtype == "bf16":
        return {n: t.to(torch.bfloat16).contiguous() for n, t in master.items()}
    if dtype == "fp8":
        exps = fp8_exponents if fp8_exponents is not None else fp8_exponents_of(master)
        out = {}
        for n, t in master.items():
            if n in exps:
                k = exps[n]
                out[n] = (t.to(torch.float32) * (2.0 ** k)).to(torch.float8_e4m3fn).contiguous()
                out[n[: -len(".weight")] + ".weight_scale_inv"] = torch.tensor([2.0 ** -k], dtype=torch.float32)
            else:
                out[n] = t.to(torch.bfloat16).contiguous()
        return out
    raise ValueError(f"unknown dtype {dtype!r}; known: {DTYPES}")


def fp8_exponents_of(master: dict[str, torch.Tensor]) -> dict[str, int]:
    return {n: _fp8_exponent(t) for n, t in master.items() if _is_fp8_target(n, t)}


# --------------------------------------------------------------------------- public API

def _load_casts(paths: list[Path], indices: list[int], dtype: str) -> dict[int, dict[str, torch.Tensor]]:
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {DTYPES}")
    exps = fp8_exponents_of(load_file(paths[0])) if dtype == "fp8" else None
    return {i: cast_snapshot(load_file(paths[i]), dtype, exps) for i in sorted(set(indices))}


def snapshots(size: str = "small", lr: float = 1e-6, steps: int = 12, seed: int = 0,
              dtype: str = "bf16", *, cache_dir: str | os.PathLike | None = None) -> list[dict[str, torch.Tensor]]:
    """The ``steps + 1`` consecutive published snapshots of one run at learning rate ``lr``.

    Snapshot 0 is the warm-up endpoint (shared by all ``lr``); snapshot ``i`` follows
    ``i`` AdamW steps. Cached on disk (see the module docstring); a cache hit gives
    identical bits.
    """
    paths = _master_paths(_cache_root(cache_dir), size, float(lr), int(steps), int(seed))
    loaded = _load_casts(paths, list(range(steps + 1)), dtype)
    return [loaded[i] for i in range(steps + 1)]


def pair(size: str = "small", lr: float = 1e-6, window: int = 1, dtype: str = "bf16", seed: int = 0,
         steps: int = 12, start: int = 0, *, cache_dir=None) -> Workload:
    """One :class:`Workload`: snapshot ``start`` vs ``start + window`` of the run."""
    if start + window > steps:
        raise ValueError(f"window {window} from step {start} does not fit in {steps} steps")
    paths = _master_paths(_cache_root(cache_dir), size, float(lr), int(steps), int(seed))
    loaded = _load_casts(paths, [start, start + window], dtype)
    return Workload(workload_name(dtype, lr, window), loaded[start], loaded[start + window],
                    float(lr), int(window), dtype)


def reference_workloads(size: str = "small", quick: bool = False, seed: int = 0, *,
                        cache_dir=None) -> list[Workload]:
    """The standard list of workloads every benchmark reports.

    Full: bf16 at every lr in :data:`LRS` x windows 1 and 10, plus fp8 and fp32 at
    lr 1e-6 (1 and 10 steps). ``quick=True`` uses size "tiny" and the subset
    bf16-lr1e-06-1step, bf16-lr1e-05-1step, bf16-lr1e-06-10step, fp8-lr1e-06-1step,
    fp32-lr1e-06-1step.
    """
    if quick:
        size = "tiny"
        spec = [("bf16", 1e-6, 1), ("bf16", 1e-5, 1), ("bf16", 1e-6, 10), ("fp8", 1e-6, 1), ("fp32", 1e-6, 1)]
    else:
        spec = [("bf16", lr, w) for lr in LRS for w in WINDOWS]
        spec += [(dt, 1e-6, w) for dt in ("fp8", "fp32") for w in WINDOWS]
    out = []
    for dt, lr, w in spec:
        out.append(pair(size, lr, w, dt, seed, cache_dir=cache_dir))
    return out


# --------------------------------------------------------------------------- scaling

def scale_state_dict(sd: dict[str, torch.Tensor], target_bytes: int, *, seed: int = 0,
                     layout: str = "concat") -> dict[str, torch.Tensor]:
    """``sd`` grown to about ``target_bytes`` by replication; see :func:`scaled_pair`.

    Copy ``c`` of each tensor has its rows (dim 0; elements for 1-D tensors) permuted by a
    permutation that depends only on (seed, name, shape, c), so applying this to ``old``
    and to ``new`` with the same arguments keeps the pairing element for element.
    ``layout="concat"`` stacks the copies along dim 0 (same tensor count, bigger
    tensors, like a bigger model); ``layout="copies"`` names them ``copy{c}.<name>``
    (more tensors). Copy 0 is the original order. Tensors with fewer than 2 elements
    (fp8 scales) are not replicated.
    """
    if layout not in ("concat", "copies"):
        raise ValueError(f"layout must be 'concat' or 'copies', not {layout!r}")
    base = sum(t.numel() * t.element_size() for t in sd.values())
    reps = max(1, int(round(target_bytes / max(base, 1))))
    out: dict[str, torch.Tensor] = {}
    for name, t in sd.items():
        if t.numel() < 2:
            out[name] = t.clone()
            continue
        copies = []
        for c in range(reps):
            if c == 0:
                copies.append(t)
                continue
            h = hashlib.blake2b(f"{seed}/{name}/{tuple(t.shape)}/{c}".encode(), digest_size=8).digest()
            g = torch.Generator().manual_seed(int.from_bytes(h, "little") & ((1 << 63) - 1))
            perm = torch.randperm(t.shape[0], generator=g)
            copies.append(t.index_select(0, perm))
        if layout == "concat":
            out[name] = torch.cat(copies, 0).contiguous()
        else:
            for c, x in enumerate(copies):
                out[name if c == 0 else f"copy{c}.{name}"] = x.contiguous()
    return out


def scaled_pair(target_bytes: int, lr: float = 1e-6, seed: int = 0, *, dtype: str = "bf16",
                window: int = 1, size: str = "small", layout: str = "concat",
                cache_dir=None) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(old, new) of about ``target_bytes`` each (e.g. 0.1/1/4 GB) for latency benchmarks.

    Built from the ``size`` pair at ``lr``/``window`` by :func:`scale_state_dict`: the
    same per-element change pattern repeated, each copy row-permuted so that byte
    streams of different copies are not identical (copies are also further apart than
    zstd's window at low levels). The change fraction and the distribution of values
    and steps are exactly those of the base pair; only the spatial arrangement is
    reshuffled at row granularity. Memory: about 2 x target_bytes.
    """
    w = pair(size, lr, window, dtype, seed, cache_dir=cache_dir)
    return (scale_state_dict(w.old, target_bytes, seed=seed, layout=layout),
            scale_state_dict(w.new, target_bytes, seed=seed, layout=layout))


# --------------------------------------------------------------------------- stats

def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous().reshape(-1)
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def change_fraction(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor],
                    dtypes: tuple[torch.dtype, ...] | None = None) -> float:
    """Fraction of elements whose bits differ (optionally only tensors of ``dtypes``)."""
    n = c = 0
    for k, a in old.items():
        if dtypes is not None and a.dtype not in dtypes:
            continue
        n += a.numel()
        c += int((_bits(a) != _bits(new[k])).sum())
    return c / max(n, 1)


def _main() -> None:  # python -m benchmarks.workloads [size]: print the change table
    import sys

    size = sys.argv[1] if len(sys.argv) > 1 else "tiny"
    t0 = time.perf_counter()
    for lr in LRS:
        for dt in DTYPES if lr == 1e-6 else ("bf16",):
            snaps = snapshots(size, lr, 12, 0, dt)
            only = (torch.float8_e4m3fn,) if dt == "fp8" else None
            one = [change_fraction(snaps[i], snaps[i + 1], only) for i in range(12)]
            ten = [change_fraction(snaps[i], snaps[i + 10], only) for i in range(3)]
            print(f"{size:6s} {dt:5s} lr {lr:.0e}: 1-step {100 * one[0]:6.3f}% "
                  f"(mean {100 * np.mean(one):6.3f}%, min {100 * min(one):6.3f}%, max {100 * max(one):6.3f}%)"
                  f"  10-step {100 * ten[0]:6.2f}% (mean {100 * np.mean(ten):6.2f}%)", flush=True)
    n = sum(t.numel() for t in snaps[0].values())
    print(f"{size}: {n / 1e6:.2f}M elements; {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    _main()
