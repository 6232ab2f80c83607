"""Streaming for the reference engine: each token of its decode loop sent as an OpenAI chunk when it is sampled.

The decode loop runs in a worker thread, as for a plain request; its ``on_token``
hook (loader/engines/reference/model.py) builds each chunk in that thread, which owns the
completions, and hands it to the event loop. Chunks are OpenAI's
(``text_completion`` with ``text``; ``chat.completion.chunk`` with ``delta``),
each choice's also carry ``token_ids`` (the tokens sampled since the last chunk;
``prompt_token_ids`` rides on the first chunk), and the concatenated texts equal
the text a plain request returns: text that may still become part of a stop
string, or an incomplete UTF-8 character, is held back until it cannot. Each
choice ends with a chunk holding its ``finish_reason`` and ``stop_reason``;
``stream_options.include_usage`` adds the usage chunk (``choices: []``) after them.

A client that goes away ends the decode loop at its next token (a plain request
runs to its end).
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any, AsyncIterator

from anyio import to_thread

from ckptdelta.loader.streaming import event
from ckptdelta.loader.engines.base import EngineResult, EngineStream, ReplicaAPIError, RequestKind
from ckptdelta.loader.engines.reference.model import ClientGone

if TYPE_CHECKING:
    from ckptdelta.loader.engines.reference.model import Completion, Generation
    from ckptdelta.loader.engines.reference.replica import ReferenceReplica
    from ckptdelta.loader.engines.requests import SamplingFields


class _Choice:
    """What one choice has sent so far."""

    def __init__(self) -> None:
        self.text = ""          # text sent
        self.tokens = 0         # token ids sent
        self.offset = 0         # text_offset of the next token (completions logprobs)
        self.started = False    # the chat role delta was sent


class _Chunks:
    """Builds one request's chunks (in the decode loop's thread; nothing here is shared across threads)."""

    def __init__(self, replica: "ReferenceReplica", kind: RequestKind, req: "SamplingFields", prompt_ids: list[int]):
        self.eng = replica.engine
        self.chat = kind == "chat"
        self.req = req
        self.head = {"id": f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}",
                     "object": "chat.completion.chunk" if self.chat else "text_completion",
                     "created": int(time.time()), "model": self.eng.model_name}
        self.usage = bool(req.stream_options and req.stream_options.include_usage)
        self.prompt_ids = prompt_ids
        self.first = True
        self.hold = max((len(s) for s in req.stop or ()), default=1) - 1
        self.logprobs = req.logprobs if not self.chat else ((req.top_logprobs or 0) if req.logprobs else None)
        self.choices = [_Choice() for _ in range(req.n)]

    def chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        out = {**self.head, "choices": [choice]}
        if self.first:
            out["prompt_token_ids"], self.first = self.prompt_ids, False
        if self.usage:
            out["usage"] = None
        return out

    def _text(self, c: "Completion", final: bool) -> str:
        """Text of ``c`` not sent yet that can no longer change (``final``: ``c.text`` is its whole text)."""
        st = self.choices[c.index]
        if final:
            ready = c.text
        else:
            ready = self.eng.decode(c.token_ids)
            if self.hold:
                ready = ready[:max(0, len(ready) - self.hold)]
            ready = ready.rstrip("\ufffd")      # a character whose bytes have not all been sampled yet
        if not ready.startswith(st.text):       # a tokenizer that rewrote earlier text: nothing can be taken back
            return ""
        delta, st.text = ready[len(st.text):], ready
        return delta

    def _logprobs(self, c: "Completion", start: int) -> Any:
        ids = c.token_ids[start:]
        if self.logprobs is None or not ids:
            return None
        strs = self.eng.token_strings(ids)
        lps, tops = c.logprobs[start:], c.top_logprobs[start:]
        alt_strs = [self.eng.token_strings([j for j, _ in alts]) for alts in tops]
        if self.chat:
            def entry(tok_id: int, text: str, lp: float) -> dict[str, Any]:
                return {"token": text, "token_id": tok_id, "logprob": lp, "bytes": list(text.encode("utf-8"))}

            return {"content": [{**entry(i, s, lp), "top_logprobs": [entry(j, a, v) for (j, v), a in zip(alts, al)]}
                                for i, s, lp, alts, al in zip(ids, strs, lps, tops, alt_strs)]}
        st = self.choices[c.index]
        offsets = []
        for s in strs:
            offsets.append(st.offset)
            st.offset += len(s)
        return {"tokens": strs, "token_logprobs": lps, "text_offset": offsets,
                "top_logprobs": [{a: v for a, (_, v) in zip(al, alts)} for al, alts in zip(alt_strs, tops)],
                "token_ids": ids, "top_token_ids": [[j for j, _ in alts] for alts in tops],
                "top_token_logprobs": [[v for _, v in alts] for alts in tops]}

    def _choice(self, c: "Completion", text: str, start: int, finish: str | None) -> dict[str, Any]:
        st = self.choices[c.index]
        ids = c.token_ids[start:]
        st.tokens = len(c.token_ids)
        out: dict[str, Any] = {"index": c.index}
        if self.chat:
            delta: dict[str, Any] = {}
            if not st.started:
                delta["role"], st.started = "assistant", True
            if text or not finish:
                delta["content"] = text
            out["delta"] = delta
        else:
            out["text"] = text
        out.update(logprobs=self._logprobs(c, start), finish_reason=finish, token_ids=ids)
        if finish is not None:
            out["stop_reason"] = c.stop_reason
        return out

    def token(self, c: "Completion", finished: bool) -> dict[str, Any]:
        """The chunk for the tokens ``c`` got since the last one (a stop string's text is cut before it)."""
        start = self.choices[c.index].tokens
        return self.chunk(self._choice(c, self._text(c, final=finished and c.stop_reason is not None), start, None))

    def end(self, gen: "Generation") -> list[dict[str, Any]]:
        """Each choice's last chunk (the text held back, the finish reason), then the usage chunk if asked for."""
        out = []
        for c in gen.completions:
            start = self.choices[c.index].tokens
            out.append(self.chunk(self._choice(c, self._text(c, final=True), start, c.finish_reason)))
        if self.usage:
            completion = sum(len(c.token_ids) for c in gen.completions)
            prompt = len(gen.prompt_token_ids)
            out.append({**self.head, "choices": [], "usage": {
                "prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}})
        return out


async def stream(replica: "ReferenceReplica", kind: RequestKind, body: dict[str, Any]) -> EngineStream:
    """Validate ``body`` (errors are answered before anything streams), then stream its decode loop."""
    req, prompt_ids, params = await to_thread.run_sync(replica.prepare, kind, body)
    if params.score_logprobs:
        raise ReplicaAPIError(400, "invalid_request_error",
                              "score_logprobs: the logprobs are re-scored after the last token, so they cannot "
                              "stream; send stream=false")
    chunks = _Chunks(replica, kind, req, prompt_ids)
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue = asyncio.Queue()
    gone = threading.Event()
    result = EngineResult(200, dict(chunks.head), cache_policy=replica.cache_policy)

    def put(item: Any) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:      # the event loop is gone (the server stopped): nobody reads on
            gone.set()

    def on_token(c: "Completion", version: int | None, finished: bool) -> None:
        if gone.is_set():
            raise ClientGone()
        put(("chunk", chunks.token(c, finished)))

    def run() -> None:
        try:
            gen = replica.engine.generate(prompt_ids, params, on_token=on_token)
            for ch in chunks.end(gen):
                put(("chunk", ch))
            put(("done", gen))
        except ClientGone:
            put(("gone", None))
        except Exception as e:  # noqa: BLE001 - said to the client in the stream, as an error event
            put(("error", e))

    async def worker() -> None:
        await to_thread.run_sync(run, limiter=replica.threads)

    task = asyncio.ensure_future(worker())

    async def events() -> AsyncIterator[bytes]:
        try:
            while True:
                what, item = await queue.get()
                if what == "chunk":
                    yield event(item)
                    continue
                if what == "done":
                    _fill(result, item)
                elif what == "error":
                    result.status = 500
                    yield event({"error": {"type": "engine_error", "message": f"{type(item).__name__}: {item}"}})
                return
        finally:
            gone.set()      # the decode loop stops at its next token if it still runs
            if task.done() and not task.cancelled():
                task.exception()

    return EngineStream(events(), result)


def _fill(result: EngineResult, gen: "Generation") -> None:
    result.policy_versions = list(gen.policy_versions)
    result.snapshot, result.cache_policy = gen.snapshot, gen.cache_policy
    result.recomputes, result.stale_kv_steps, result.duration_s = gen.recomputes, gen.stale_kv_steps, gen.duration_s
    result.completion_tokens = sum(len(c.token_ids) for c in gen.completions)
