"""The model a replica serves: tokenization, a step-by-step decode loop, and the swap points.

A hot-load must never abort or stall a whole request, and a token must never be
sampled from weights that are half old and half new. So every forward step runs
inside ``gate.serving()``: a swap (``gate.paused()``) waits only for the step
that is running, then requests carry on with the new weights at their next step.
Steps of concurrent requests are serialized by a FIFO lock (one forward at a
time, which is what a CPU wants anyway), so requests interleave at step
granularity and none can starve another.

What a swap means for a request in flight is the *cache policy* (docs/SERVING.md):

- ``"recompute"`` (default): when the weights changed since a request's KV cache
  was built, the request first re-runs its whole prefix (prompt + tokens sampled
  so far) through the new weights, so each token is sampled from one version's
  weights over one version's KV.
- ``"keep"``: the request continues on its stale KV cache (cheaper; the attention
  over the prefix still reflects the old weights); engine_data says so.

Each request reports its span (loader/spans.py): the version served when it was
admitted and every version served after it, up to its last step, so a request
that crossed a swap reports every version that may have computed for it.
"""

from __future__ import annotations

import collections
import inspect
import logging
import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator, Literal, Sequence

import torch

from ckptdelta.loader.engines.requests import MAX_TOP_LOGPROBS
from ckptdelta.loader.hf_model import load_model, score_logprobs
from ckptdelta.loader.spans import Span, VersionLog

if TYPE_CHECKING:
    from ckptdelta.loader.gate import ServingGate
    from ckptdelta.loader.hotswap import HotSwapper

log = logging.getLogger("ckptdelta.engine")

CachePolicy = Literal["recompute", "keep"]
CACHE_POLICIES: tuple[str, ...] = ("recompute", "keep")


class ClientGone(Exception):
    """Raised by a generation's ``on_token`` once its request's client went away (a stream's reader, or the
    client of a plain request): the decode loop stops there, not at ``max_tokens``."""


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling settings (validated by the server before they get here)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    n: int = 1
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: int | None = None  # None: none; k >= 0: sampled token's logprob + k alternatives
    ignore_eos: bool = False
    score_logprobs: bool = False  # report logprobs from one scoring pass per completion (see score_logprobs)
    top_k: int = -1  # sample among the k most likely tokens; -1 or 0: all
    stop_token_ids: tuple[int, ...] = ()  # tokens that end a completion as EOS does (kept in its token_ids)
    prompt_logprobs: int | None = None  # None: none; k >= 0: each prompt token's logprob (+ k alternatives)


@dataclass
class Completion:
    """One of the ``n`` sequences sampled for a prompt."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str = "length"  # "stop" (EOS or a stop string) | "length"
    stop_reason: str | int | None = None  # the stop string (or stop token id) that ended it, if any
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)


@dataclass
class Generation:
    """The outcome of one request, with what the replica knows about the weights behind it."""

    prompt_token_ids: list[int]
    completions: list[Completion]
    policy_versions: list[int | None]  # served from its admission to its last step, in order (loader/spans.py)
    snapshot: str | None
    cache_policy: str
    recomputes: int = 0  # prefix re-runs after a swap ("recompute")
    stale_kv_steps: int = 0  # steps that ran on KV built by older weights ("keep")
    duration_s: float = 0.0
    #: with ``prompt_logprobs``: per prompt position, None for the first, else [(token id, logprob, rank)]: the
    #: prompt's own token first, then the top alternatives (see :meth:`Engine._prompt_logprobs`)
    prompt_logprobs: list[list[tuple[int, float, int]] | None] | None = None
    #: with ``prompt_logprobs``: the version whose weights computed them (that of the request's first step)
    prompt_logprobs_version: int | None = None

    @property
    def policy_version(self) -> int | None:
        """The version that sampled the last token."""
        return self.policy_versions[-1] if self.policy_versions else None


class FairLock:
    """A FIFO mutex: each waiter gets the lock in arrival order.

    ``threading.Lock`` lets a thread that releases and re-acquires at once win
    again and again; with one lock per decode step that starves other requests."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._waiters: collections.deque[threading.Event] = collections.deque()
        self._held = False

    def acquire(self) -> None:
        with self._mutex:
            if not self._held and not self._waiters:
                self._held = True
                return
            ev = threading.Event()
            self._waiters.append(ev)
        ev.wait()  # ownership is handed over by release()

    def release(self) -> None:
        with self._mutex:
            if self._waiters:
                self._waiters.popleft().set()
            else:
                self._held = False

    @property
    def n_waiting(self) -> int:
        """Threads queued for the lock (not counting the holder)."""
        with self._mutex:
            return len(self._waiters)

    def __enter__(self) -> "FairLock":
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _forward_kwargs(model: torch.nn.Module) -> tuple[str, dict[str, int]]:
    """Keyword names this transformers version uses: the KV cache (``cache`` in 5.x, before that
    ``past_key_values``) and computing logits for the last position only (when supported)."""
    params = inspect.signature(model.forward).parameters
    cache = "cache" if "cache" in params else "past_key_values"
    for name in ("logits_to_keep", "num_logits_to_keep"):
        if name in params:
            return cache, {name: 1}
    return cache, {}


def _new_cache(model: torch.nn.Module) -> Any:
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:  # older transformers
        return DynamicCache()


class Engine:
    """A causal LM behind a serving gate; :class:`ckptdelta.loader.hotswap.HotSwapper` changes its weights.

    ``swapper`` is the HotSwapper that owns ``model``'s weights (its gate is the one
    steps run under, its ``version`` the policy version reported); without one the
    engine serves fixed weights with version None."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, *, swapper: "HotSwapper | None" = None,
                 gate: "ServingGate | None" = None,
                 cache_policy: str = "recompute", model_name: str = "ckptdelta", max_model_len: int | None = None):
        if cache_policy not in CACHE_POLICIES:
            raise ValueError(f"cache_policy {cache_policy!r}: expected one of {CACHE_POLICIES}")
        if gate is None:
            if swapper is not None:
                gate = swapper.gate
            else:
                from ckptdelta.loader.gate import ServingGate
                gate = ServingGate()
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.swapper = swapper
        self.gate = gate
        # what requests' spans are read from: the swapper's log, or one version (None) for fixed weights
        self.served = swapper.served if swapper is not None else VersionLog(None)
        #: generations running now, those that ran to their end, and those stopped because their client left
        #: (ClientGone): the engine's part of /v1/status
        self.generating = self.finished = self.stopped_early = 0
        self._counts = threading.Lock()
        self.cache_policy = cache_policy
        self.model_name = model_name
        self.device = next(model.parameters()).device
        cfg_len = getattr(model.config, "max_position_embeddings", None)
        self.max_model_len = int(max_model_len or cfg_len or 2048)
        self._step_lock = FairLock()
        self._tok_lock = threading.Lock()  # HF fast tokenizers are not safe to call concurrently
        self._cache_kwarg, self._last_only = _forward_kwargs(model)
        self.eos_token_id: int | None = tokenizer.eos_token_id
        self.pad_token_id: int = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (self.eos_token_id or 0)
        self.vocab_size = int(model.config.vocab_size)

    # --- what the replica serves ----------------------------------------------------

    @property
    def version(self) -> int | None:
        return self.swapper.version if self.swapper is not None else None

    @property
    def snapshot(self) -> str | None:
        return self.swapper.snapshot if self.swapper is not None else None

    # --- tokenization --------------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        with self._tok_lock:
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """The tokenizer's chat template when it has one, else a plain role-tagged fallback."""
        msgs = [{"role": m["role"], "content": m["content"]} for m in messages]
        if getattr(self.tokenizer, "chat_template", None):
            with self._tok_lock:
                text = self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        else:
            text = "".join(f"{m['role']}: {m['content']}\n" for m in msgs) + "assistant:"
        return self.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        with self._tok_lock:
            return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        """Each token's own text (special tokens included, unlike :meth:`decode`)."""
        with self._tok_lock:
            return [self.tokenizer.decode([i]) for i in ids]

    def check_prompt(self, prompt_ids: Sequence[int], max_tokens: int) -> None:
        """Raise ValueError (the server's 400) for a prompt the model cannot take."""
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        bad = [i for i in prompt_ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
        if len(prompt_ids) + max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds the "
                             f"model's context of {self.max_model_len} tokens")

    # --- forward ---------------------------------------------------------------------

    @contextmanager
    def step(self) -> Iterator[int | None]:
        """One forward step's critical section; yields the version of the weights inside it.

        The FIFO lock comes first, the gate second: a swap then waits for the one
        step that runs, not for every request queued behind it."""
        with self._step_lock, self.gate.serving():
            yield self.version

    @contextmanager
    def hold(self) -> Iterator[None]:
        """Keep every request between two steps (no forward starts) until exit.

        The gate is not taken, so a swap can run inside: what a request sees is
        then exactly "steps before the swap, steps after it"."""
        with self._step_lock:
            yield

    @property
    def steps_waiting(self) -> int:
        """Decode steps queued behind the one running (or behind :meth:`hold`)."""
        return self._step_lock.n_waiting

    def _forward(self, input_ids: torch.Tensor, cache: Any) -> torch.Tensor:
        with torch.inference_mode():
            out = self.model(input_ids=input_ids.to(self.device), use_cache=True, **self._last_only,
                             **{self._cache_kwarg: cache})
        return out.logits[:, -1, :].float().cpu()

    def logits(self, token_ids: Sequence[int]) -> tuple[torch.Tensor, int | None]:
        """Next-token logits (float32) for one sequence, and the version that computed them."""
        ids = torch.tensor([list(token_ids)], dtype=torch.long)
        with self.step() as version:
            return self._forward(ids, _new_cache(self.model))[0], version

    # --- the decode loop --------------------------------------------------------------

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams,
                 on_token: Callable[[Completion, int | None, bool], None] | None = None) -> Generation:
        """Sample ``params.n`` continuations of one prompt, batched row-wise, one step at a time.

        ``on_token(completion, version, finished)`` is called after each token a completion gets (a stream
        sends it on; loader/engines/reference/stream.py); whatever it raises ends the generation."""
        t0 = time.perf_counter()
        prompt = list(prompt_ids)
        self.check_prompt(prompt, params.max_tokens)
        span = self.served.open()
        with self._counts:
            self.generating += 1
        try:
            out = self._generate(prompt, params, on_token, span, t0)
            with self._counts:
                self.finished += 1
            return out
        except ClientGone:
            with self._counts:
                self.stopped_early += 1
            raise
        finally:
            span.close()
            with self._counts:
                self.generating -= 1

    def _generate(self, prompt: list[int], params: SamplingParams,
                  on_token: Callable[[Completion, int | None, bool], None] | None, span: Span,
                  t0: float) -> Generation:
        n = params.n
        gen = torch.Generator()
        gen.manual_seed(params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1)
        rows: list[list[int]] = [list(prompt) for _ in range(n)]  # aligned: finished rows get pad fillers
        comps = [Completion(index=i) for i in range(n)]
        done = [False] * n
        cache: Any = None
        kv_version: Any = _NO_VERSION
        recomputes = stale_steps = 0
        k_top = params.logprobs or 0
        prompt_lp: torch.Tensor | None = None
        prompt_version: int | None = None
        prompt_scored = params.prompt_logprobs is None      # nothing to score, or scored already

        for _ in range(params.max_tokens):
            with self.step() as version:
                span.ran()
                if not prompt_scored:
                    # in the step that samples the first token, not one of its own: a hot-load between the two
                    # would leave the prompt's logprobs one version's and every token another's, as vLLM's prefill
                    # (one forward for both) never does
                    prompt_lp, prompt_version, prompt_scored = self._score_prompt(prompt), version, True
                if cache is None or (version != kv_version and self.cache_policy == "recompute"):
                    if cache is not None:
                        recomputes += 1
                    cache = _new_cache(self.model)
                    inp = torch.tensor(rows, dtype=torch.long)
                    kv_version = version
                else:
                    inp = torch.tensor([[r[-1]] for r in rows], dtype=torch.long)
                    if version != kv_version:
                        stale_steps += 1
                logits = self._forward(inp, cache)
            tokens, logprobs = _sample(logits, params.temperature, params.top_p, gen, params.top_k)
            top = torch.topk(logprobs, k_top, dim=-1) if k_top else None
            for i in range(n):
                tok = int(tokens[i]) if not done[i] else self.pad_token_id
                rows[i].append(tok)
                if done[i]:
                    continue
                c = comps[i]
                c.token_ids.append(tok)
                if params.logprobs is not None:
                    c.logprobs.append(float(logprobs[i, tok]))
                    c.top_logprobs.append(
                        [(int(j), float(v)) for v, j in zip(top.values[i], top.indices[i])] if top is not None else [])
                if tok == self.eos_token_id and not params.ignore_eos:
                    c.finish_reason, done[i] = "stop", True
                elif tok in params.stop_token_ids:
                    c.finish_reason, c.stop_reason, done[i] = "stop", tok, True
                elif params.stop:
                    text = self.decode(c.token_ids)
                    hit = _find_stop(text, params.stop)
                    if hit is not None:
                        c.text, c.stop_reason = text[:hit[0]], hit[1]
                        c.finish_reason, done[i] = "stop", True
                if on_token is not None:
                    on_token(c, version, done[i])
            if all(done):
                break
        if params.logprobs is not None and params.score_logprobs:
            self._rescore(prompt, comps, k_top, span)
        prompt_lps = None
        if params.prompt_logprobs is not None:
            if not prompt_scored:           # no step ran (max_tokens 0): a step of its own
                with self.step() as prompt_version:
                    span.ran()
                    prompt_lp = self._score_prompt(prompt)
            prompt_lps = self._prompt_logprobs(prompt, params.prompt_logprobs, prompt_lp)
        versions = span.close()     # up to the last step: a swap after it computed nothing of this request
        for c in comps:
            if c.stop_reason is None:
                c.text = self.decode(c.token_ids)
        return Generation(prompt_token_ids=prompt, completions=comps, policy_versions=versions,
                          snapshot=_snapshot(versions[-1]), cache_policy=self.cache_policy, recomputes=recomputes,
                          stale_kv_steps=stale_steps, duration_s=time.perf_counter() - t0, prompt_logprobs=prompt_lps,
                          prompt_logprobs_version=prompt_version if prompt_lps is not None else None)

    def _score_prompt(self, prompt: list[int]) -> torch.Tensor | None:
        """The prompt's logprobs at each position after the first (None for a one-token prompt: nothing to
        score); called inside the caller's step, whose version is then theirs.

        One forward of the whole prompt at batch 1, no cache: :func:`score_logprobs`, so a trainer scoring the
        same tokens with it (or :func:`score_tokens`) on the same bits gets these numbers exactly, which the
        decode step's batched, cached forward would not give."""
        if len(prompt) < 2:
            return None
        with torch.inference_mode():
            return score_logprobs(self.model, prompt, 1).cpu()

    def _prompt_logprobs(self, prompt: list[int], k: int,
                         lp: torch.Tensor | None) -> list[list[tuple[int, float, int]] | None]:
        """Each prompt token's logprob given the tokens before it (None for the first: nothing before it), with
        its rank and the ``k`` most likely tokens at that position, out of :meth:`_score_prompt`'s ``lp``."""
        out: list[list[tuple[int, float, int]] | None] = [None]
        if lp is None:
            return out
        target = torch.tensor(prompt[1:], dtype=torch.long)
        own = lp.gather(-1, target[:, None]).squeeze(-1)
        ranks = (lp > own[:, None]).sum(-1) + 1
        top = torch.topk(lp, k, dim=-1) if k else None
        for i, tok in enumerate(prompt[1:]):
            row = [(tok, float(own[i]), int(ranks[i]))]
            if top is not None:
                row += [(int(j), float(v), r + 1) for r, (v, j) in enumerate(zip(top.values[i], top.indices[i]))
                        if int(j) != tok]
            out.append(row)
        return out


    def _rescore(self, prompt: list[int], comps: list[Completion], k_top: int, span: Span) -> None:
        """Replace each completion's logprobs by :func:`score_logprobs` of prompt + completion.

        All completions are scored inside one step, so by one version (the span's last):
        the version a trainer must hold to reproduce these numbers bit for bit."""
        with self.step(), torch.inference_mode():
            span.ran()
            for c in comps:
                lp = score_logprobs(self.model, prompt + c.token_ids, len(prompt)).cpu()
                rows = torch.arange(len(c.token_ids))
                c.logprobs = lp[rows, torch.tensor(c.token_ids)].tolist()
                top = torch.topk(lp, k_top, dim=-1) if k_top else None
                c.top_logprobs = ([[(int(j), float(v)) for v, j in zip(top.values[i], top.indices[i])]
                                   for i in range(len(c.token_ids))] if top is not None else [[] for _ in rows])


_NO_VERSION = object()


def _snapshot(version: int | None) -> str | None:
    from ckptdelta.delta.manifest import snapshot_name

    return None if version is None else snapshot_name(version)


def _find_stop(text: str, stops: Sequence[str]) -> tuple[int, str] | None:
    """The earliest stop string in ``text`` as (position, string)."""
    best = None
    for s in stops:
        pos = text.find(s)
        if pos >= 0 and (best is None or pos < best[0]):
            best = (pos, s)
    return best


def _sample(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator,
            top_k: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens for each row and the model's log-probabilities (raw: before temperature, top-k and top-p).

    Reported logprobs are the policy's own, log_softmax of the logits, so a trainer
    can compare them with its logprobs of the same tokens whatever the sampling
    settings; temperature 0 is greedy (the first maximal logit). ``top_k`` > 0 keeps
    the k largest logits (ties at the k-th kept too), then top-p applies to those."""
    logprobs = torch.log_softmax(logits, dim=-1)
    if temperature == 0:
        return torch.argmax(logits, dim=-1), logprobs
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        cum = torch.cumsum(sorted_p, dim=-1)
        keep = (cum - sorted_p) < top_p  # the smallest prefix whose mass reaches top_p
        keep[..., 0] = True
        sorted_p = torch.where(keep, sorted_p, torch.zeros_like(sorted_p))
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    tokens = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
    return tokens, logprobs


def load_engine(*, bucket: str | None = None, snapshot: str | int = "latest", model_dir: str | None = None,
                 storage_options: dict[str, Any] | None = None, cache_dir: str | None = None, device: str = "cpu",
                 cache_policy: str = "recompute", model_name: str | None = None) -> tuple[Engine, Any]:
    """A replica's engine and reader: weights from a bucket's snapshot, or from an HF directory.

    From a bucket, the snapshot's anchor and delta chain are materialized into a
    scratch directory (under ``cache_dir`` when given), loaded as stored (bf16
    stays bf16) and the scratch directory is removed: the swapper then knows the
    exact version it serves. From ``model_dir`` the version is unknown (None);
    with a bucket too, the first hot-load goes through an anchor
    (HotSwapper.load_initial). Returns (engine, reader or None).

    What serving needs is checked first (loader/servable.py): the device, and
    config.json and a tokenizer in the directory or the snapshot's anchor."""
    from ckptdelta.loader.hotswap import HotSwapper
    from ckptdelta.loader.reader import SnapshotReader
    from ckptdelta.delta.scratch import make as make_scratch
    from ckptdelta.loader.servable import check_device, check_model_dir, check_snapshot

    if bucket is None and model_dir is None:
        raise ValueError("serve needs --bucket URL, --model DIR, or both")
    check_device(device)
    if model_dir is not None:
        check_model_dir(model_dir)
    reader = SnapshotReader(bucket, storage_options=storage_options, cache_dir=cache_dir) if bucket else None
    version = None
    if model_dir is not None:
        model, tokenizer = load_model(model_dir, device=device)
        name = model_name or os.path.basename(os.path.normpath(model_dir))
    else:
        version = reader.resolve(snapshot)
        check_snapshot(reader, version)
        if cache_dir:
            os.makedirs(cache_dir, exist_ok=True)
        scratch = make_scratch("serve", cache_dir)   # locked while we load; a killed replica's is swept
        try:
            path = reader.materialize(version, os.path.join(scratch.path, "model"))
            model, tokenizer = load_model(path, device=device)
        finally:
            scratch.release()
        name = model_name or f"{reader.run_id}"
        log.info("serving %s of run %s from %s", version, reader.run_id, bucket)
    swapper = HotSwapper(model, reader, version=version) if reader is not None else None
    engine = Engine(model, tokenizer, swapper=swapper, cache_policy=cache_policy, model_name=name)
    return engine, reader
