"""The reference engine: the project's own decode loop (loader/engines/reference/model.py) behind the replica interface.

It serves tests and CPU-only demos with exactly the trainer's numerics (transformers
forward, the same bf16 weights), so sampler/trainer divergence is zero. Requests
are validated here, strictly, against what this decode loop supports; each runs
its decode loop in a worker thread and interleaves with the others at step
granularity, while a hot-load prepares in its own thread and pauses them only for
the swap (the gate in loader/hotswap.py).
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

from anyio import CapacityLimiter, to_thread

from ckptdelta.loader.engines.reference.model import ClientGone, Engine, Generation, SamplingParams
from ckptdelta.loader.engines.base import EngineResult, EngineStream, ReplicaAPIError, ReplicaEngine, RequestKind
from ckptdelta.loader.engines.requests import ChatCompletionRequest, CompletionRequest, SamplingFields, parse


# --- response shaping -------------------------------------------------------------------------

def _completion_logprobs(engine: Engine, c: Any) -> dict[str, Any]:
    tokens = engine.token_strings(c.token_ids)
    offsets, pos = [], 0
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    top_ids = [[j for j, _ in alts] for alts in c.top_logprobs]
    top_strs = [engine.token_strings(ids) for ids in top_ids]
    return {
        "tokens": tokens, "token_logprobs": c.logprobs, "text_offset": offsets,
        "top_logprobs": [{s: lp for s, (_, lp) in zip(strs, alts)} for strs, alts in zip(top_strs, c.top_logprobs)],
        # Token strings can collide (two ids, one text): the id-keyed forms are the exact ones.
        "token_ids": c.token_ids, "top_token_ids": top_ids,
        "top_token_logprobs": [[lp for _, lp in alts] for alts in c.top_logprobs],
    }


def _prompt_logprobs(engine: Engine, gen: Generation) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's shape: per prompt position, None for the first, else token id (a string key) ->
    ``{logprob, rank, decoded_token}``, the prompt's own token first."""
    if gen.prompt_logprobs is None:
        return None
    out: list[dict[str, dict[str, Any]] | None] = []
    for row in gen.prompt_logprobs:
        if row is None:
            out.append(None)
            continue
        texts = engine.token_strings([t for t, _, _ in row])
        out.append({str(t): {"logprob": lp, "rank": r, "decoded_token": s} for (t, lp, r), s in zip(row, texts)})
    return out


def _chat_logprobs(engine: Engine, c: Any) -> dict[str, Any]:
    def entry(tok_id: int, text: str, lp: float) -> dict[str, Any]:
        return {"token": text, "token_id": tok_id, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    tokens = engine.token_strings(c.token_ids)
    content = []
    for tok_id, text, lp, alts in zip(c.token_ids, tokens, c.logprobs, c.top_logprobs):
        alt_strs = engine.token_strings([j for j, _ in alts])
        content.append({**entry(tok_id, text, lp),
                        "top_logprobs": [entry(j, s, v) for (j, v), s in zip(alts, alt_strs)]})
    return {"content": content}


def _usage(gen: Generation) -> dict[str, int]:
    completion = sum(len(c.token_ids) for c in gen.completions)
    prompt = len(gen.prompt_token_ids)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


# --- the engine -----------------------------------------------------------------------------------

class ReferenceReplica(ReplicaEngine):
    """:class:`ckptdelta.loader.engines.reference.model.Engine` (decode loop + HotSwapper over its torch model) as a replica engine."""

    kind = "reference"

    def __init__(self, engine: Engine, *, max_concurrent_requests: int = 64):
        self.engine = engine
        self.swapper = engine.swapper
        self.model_name = engine.model_name
        self.cache_policy = engine.cache_policy
        # Sampling requests block in their decode loops; they get threads of their own so
        # that status, metrics and hot-load requests are answered however busy the replica is.
        self.threads = CapacityLimiter(max_concurrent_requests)

    @property
    def version(self) -> int | None:
        return self.engine.version

    @property
    def snapshot(self) -> str | None:
        return self.engine.snapshot

    async def complete(self, kind: RequestKind, body: dict[str, Any]) -> EngineResult:
        gone = threading.Event()
        try:
            # cancelled (its client left, loader/server.py), the call returns at once; the decode loop stops
            # at its next token
            return await to_thread.run_sync(self._complete, kind, body, gone, limiter=self.threads,
                                            abandon_on_cancel=True)
        finally:
            gone.set()

    async def stream(self, kind: RequestKind, body: dict[str, Any]) -> EngineStream:
        from ckptdelta.loader.engines.reference.stream import stream

        return await stream(self, kind, body)

    def status(self) -> dict[str, Any]:
        eng = self.engine
        return {"kind": self.kind, "generating": eng.generating, "finished": eng.finished,
                "stopped_early": eng.stopped_early}

    def prepare(self, kind: RequestKind, body: dict[str, Any]) -> tuple[SamplingFields, list[int], SamplingParams]:
        """The validated request, its prompt's token ids and its sampling parameters (400 for a bad body)."""
        eng = self.engine
        if kind == "chat":
            req: Any = parse(ChatCompletionRequest, body)
            try:
                prompt_ids = eng.encode_chat([m.model_dump() for m in req.messages])
            except Exception as e:  # noqa: BLE001 - a template's own refusal (jinja2's raise_exception) of the messages
                if type(e).__module__.split(".")[0] != "jinja2":
                    raise
                raise ReplicaAPIError(400, "invalid_request_error",
                                      f"messages: the model's chat template refused them: {e}") from None
            logprobs = (req.top_logprobs or 0) if req.logprobs else None
            max_tokens = req.max_completion_tokens or req.max_tokens
        else:
            req = parse(CompletionRequest, body)
            prompt_ids = eng.encode(req.prompt) if isinstance(req.prompt, str) else list(req.prompt)
            logprobs, max_tokens = req.logprobs, req.max_tokens
        params = SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, n=req.n,
                                seed=req.seed, stop=tuple(req.stop or ()), logprobs=logprobs, ignore_eos=req.ignore_eos,
                                score_logprobs=req.score_logprobs, top_k=req.top_k,
                                stop_token_ids=tuple(req.stop_token_ids),
                                prompt_logprobs=getattr(req, "prompt_logprobs", None))
        try:
            eng.check_prompt(prompt_ids, max_tokens)
        except ValueError as e:
            raise ReplicaAPIError(400, "invalid_request_error", str(e)) from None
        return req, prompt_ids, params

    def _complete(self, kind: RequestKind, body: dict[str, Any], gone: threading.Event) -> EngineResult:
        req, prompt_ids, params = self.prepare(kind, body)

        def on_token(*_: Any) -> None:
            if gone.is_set():
                raise ClientGone()

        try:
            gen = self.engine.generate(prompt_ids, params, on_token=on_token)
        except ClientGone:
            return EngineResult(499, {})      # nobody reads it: the server answered its client's leaving
        return self._chat(req, gen) if kind == "chat" else self._completions(req, gen)

    def _result(self, kind: str, gen: Generation, choices: list[dict]) -> EngineResult:
        body = {"id": f"{kind}-{uuid.uuid4().hex}", "object": "text_completion" if kind == "cmpl" else "chat.completion",
                "created": int(time.time()), "model": self.engine.model_name, "choices": choices, "usage": _usage(gen),
                "prompt_token_ids": gen.prompt_token_ids}
        return EngineResult(200, body, policy_versions=list(gen.policy_versions), snapshot=gen.snapshot,
                            cache_policy=gen.cache_policy, recomputes=gen.recomputes,
                            stale_kv_steps=gen.stale_kv_steps, duration_s=gen.duration_s,
                            completion_tokens=sum(len(c.token_ids) for c in gen.completions),
                            prompt_logprobs_versions=None if gen.prompt_logprobs is None
                            else [gen.prompt_logprobs_version])

    def _completions(self, req: CompletionRequest, gen: Generation) -> EngineResult:
        eng = self.engine
        prompt_lps = _prompt_logprobs(eng, gen)
        choices = [{"index": c.index, "text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                    "logprobs": _completion_logprobs(eng, c) if req.logprobs is not None else None,
                    **({"prompt_logprobs": prompt_lps} if prompt_lps is not None else {})}
                   for c in gen.completions]
        return self._result("cmpl", gen, choices)

    def _chat(self, req: ChatCompletionRequest, gen: Generation) -> EngineResult:
        eng = self.engine
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text}, "token_ids": c.token_ids,
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                    "logprobs": _chat_logprobs(eng, c) if req.logprobs else None}
                   for c in gen.completions]
        return self._result("chatcmpl", gen, choices)


def build(*, bucket: str | None = None, snapshot: str | int = "latest", model_dir: str | None = None,
          storage_options: dict[str, Any] | None = None, cache_dir: str | None = None, device: str = "cpu",
          cache_policy: str = "recompute", model_name: str | None = None, base_model: str | None = None,
          **_: Any) -> ReferenceReplica:
    """``ckptdelta serve --engine reference`` on full weights: a bucket's snapshot, or an HF directory."""
    from ckptdelta.loader.engines.reference.model import load_engine

    if base_model is not None:
        from ckptdelta.delta.errors import NotServableError

        raise NotServableError(f"--base-model is for LoRA runs; {bucket or model_dir} holds full models")
    engine, _reader = load_engine(bucket=bucket, snapshot=snapshot, model_dir=model_dir,
                                   storage_options=storage_options, cache_dir=cache_dir, device=device,
                                   cache_policy=cache_policy, model_name=model_name)
    return ReferenceReplica(engine)
