"""Streaming through the vLLM engine: vLLM's own server-sent events, forwarded as they come.

The body goes to vLLM as a plain request does (the served name, a per-version
``cache_salt``), with ``stream_options.include_usage`` turned on so that the
replica counts the tokens exactly; vLLM's usage chunk is passed on only when the
client asked for it. Every other event is forwarded byte for byte (vLLM's
``token_ids``, ``prompt_token_ids``, logprobs: what vLLM users know), up to
vLLM's ``[DONE]``, which the replica sends itself after its own last chunk
(loader/streaming.py). A stream's span is a plain request's (loader/spans.py): every
version served from its admission until its last event came from vLLM.

A client that goes away closes the connection to vLLM, which aborts the request.
"""

from __future__ import annotations

import json
import time
import weakref
from typing import TYPE_CHECKING, Any, AsyncIterator

import anyio
import httpx

from ckptdelta.loader.streaming import event
from ckptdelta.loader.engines.base import ENGINE_TIMEOUT, EngineResult, EngineStream, ReplicaAPIError, RequestKind
from ckptdelta.loader.engines.vllm.prompt_versions import prompt_logprobs_versions

if TYPE_CHECKING:
    from ckptdelta.loader.engines.vllm.replica import VllmReplica


async def stream(replica: "VllmReplica", kind: RequestKind, body: dict[str, Any]) -> EngineStream | EngineResult:
    t0 = time.perf_counter()
    admitted = replica.admit(body)
    try:
        return await _stream(replica, kind, admitted, t0)
    except BaseException:
        admitted.release()
        raise


async def _stream(replica: "VllmReplica", kind: RequestKind, admitted: Any, t0: float) -> EngineStream | EngineResult:
    body = admitted.body
    opts = body.get("stream_options")
    wants_usage = isinstance(opts, dict) and opts.get("include_usage") is True
    if opts is None or isinstance(opts, dict):
        body["stream_options"] = {**(opts or {}), "include_usage": True}
    path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
    client = replica._http()
    try:
        r = await client.send(client.build_request("POST", path, json=body), stream=True)
    except httpx.TimeoutException as e:
        raise ReplicaAPIError(504, ENGINE_TIMEOUT, f"vLLM at {replica.url} did not answer within the request "
                              f"timeout ({replica.request_timeout:g} s, --request-timeout): "
                              f"{type(e).__name__}") from None
    except httpx.HTTPError as e:
        raise ReplicaAPIError(503, "engine_unavailable", f"vLLM at {replica.url} did not answer: {e}") from None
    if r.status_code != 200 or not r.headers.get("content-type", "").startswith("text/event-stream"):
        try:
            raw = await r.aread()
        finally:
            await r.aclose()
            admitted.release()
        try:
            out = json.loads(raw)
        except ValueError:
            out = {"error": {"type": "engine_error", "message": raw[:2000].decode("utf-8", "replace")}}
        return EngineResult(r.status_code if r.status_code != 200 else 502,
                            out if isinstance(out, dict) else {"error": out})
    result = EngineResult(200, {}, cache_policy=replica.cache_policy)

    async def events() -> AsyncIterator[bytes]:
        tokens = 0
        try:
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue                     # blank separators, comments
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                try:
                    chunk = json.loads(data)
                except ValueError:
                    chunk = None
                if isinstance(chunk, dict):
                    if admitted.model is not None and chunk.get("model") not in (None, admitted.model):
                        chunk["model"] = admitted.model
                        data = json.dumps(chunk, separators=(",", ":"))
                    if not result.body and "id" in chunk:
                        result.body = {k: chunk.get(k) for k in ("id", "object", "created", "model")}
                    if "error" in chunk:
                        result.status = 500
                    usage = chunk.get("usage")
                    if isinstance(usage, dict):
                        tokens = int(usage.get("completion_tokens") or 0)
                        if not wants_usage and not chunk.get("choices"):
                            continue             # the usage chunk the replica asked for itself
                yield f"data: {data}\n\n".encode()
        except httpx.HTTPError as e:
            result.status = 503
            yield event({"error": {"type": "engine_unavailable",
                                   "message": f"vLLM at {replica.url} broke off the stream: {type(e).__name__}: {e}"}})
        finally:
            with anyio.CancelScope(shield=True):    # a client gone cancels us: the connection to vLLM still
                await r.aclose()                    # closes properly, which aborts the request there
            admitted.release()
            versions = admitted.versions()
            result.policy_versions = versions
            result.prompt_logprobs_versions = prompt_logprobs_versions(body, versions)
            result.snapshot = None if versions[-1] is None else snapshot_label(versions[-1])
            result.recomputes = (len(versions) - 1) if replica.cache_policy == "recompute" else 0
            result.duration_s = time.perf_counter() - t0
            result.completion_tokens = tokens

    gen = events()
    # a stream never iterated (its client went away before the first byte) never runs its finally: its
    # admission is released when the generator is collected (release is idempotent)
    weakref.finalize(gen, admitted.release)
    return EngineStream(gen, result)


def snapshot_label(version: int) -> str:
    from ckptdelta.delta.manifest import snapshot_name

    return snapshot_name(version)
