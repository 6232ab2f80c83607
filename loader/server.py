"""The reference replica: an OpenAI-compatible sampling server that hot-loads policy snapshots.

``create_app(engine, reader=..., replica_id=...)`` builds the FastAPI app; the
``ckptdelta serve`` command (loader/cli.py) builds an engine from a bucket or an
HF directory and runs it under uvicorn. Endpoints, engine_data, the cache policy
on swap, auth and metrics are described in docs/SERVING.md.

Sampling endpoints are plain (sync) handlers: each request runs its decode loop
in a worker thread and interleaves with the others at step granularity (see
loader/engine.py), while a hot-load prepares in its own thread and pauses them
only for the swap.
"""

from __future__ import annotations

import hmac
import logging
import re
import time
import uuid
from typing import Any, Literal

from anyio import CapacityLimiter, to_thread
from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, field_validator, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from delta.errors import DeltaError, HotLoadConflictError, SnapshotNotFoundError, StorageError

from .engine import MAX_TOP_LOGPROBS, Engine, Generation, SamplingParams
from .hotload_jobs import HotLoadJob, HotLoadManager
from .metrics import CONTENT_TYPE, ServerMetrics

log = logging.getLogger("ckptdelta.server")

MAX_BODY_BYTES = 1 << 20
MAX_N = 64
MAX_STOP = 16
_SNAPSHOT_RE = re.compile(r"^[A-Za-z0-9_\-][A-Za-z0-9._\-]{0,63}$")
_KNOWN_ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/hotload", "/v1/status", "/v1/models",
                    "/metrics", "/health")


# --- request schemas -----------------------------------------------------------------

class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI clients send fields we do not use (user, ...)

    model: str | None = None
    max_tokens: StrictInt = Field(16, ge=1, le=1 << 16)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: StrictInt = Field(1, ge=1, le=MAX_N)
    seed: StrictInt | None = Field(None, ge=0, lt=1 << 63)
    stop: StrictStr | list[StrictStr] | None = None
    ignore_eos: StrictBool = False
    stream: StrictBool = False
    min_policy_version: StrictInt | None = Field(None, ge=0)
    return_engine_data: StrictBool = False
    score_logprobs: StrictBool = False  # logprobs from one full-sequence scoring pass (loader.engine.score_logprobs)

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOP or any(not s or len(s) > 256 for s in stops):
            raise ValueError(f"stop: at most {MAX_STOP} non-empty strings of up to 256 characters")
        return stops

    @field_validator("stream")
    @classmethod
    def _no_stream(cls, v: bool) -> bool:
        if v:
            raise ValueError("streaming is not supported by this replica; send stream=false")
        return v


class CompletionRequest(_Sampling):
    prompt: StrictStr | list[StrictInt] = Field(..., min_length=1)
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: StrictStr = Field(..., max_length=1 << 20)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(..., min_length=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    max_completion_tokens: StrictInt | None = Field(None, ge=1, le=1 << 16)

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        return self


class HotLoadRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    snapshot: StrictStr | StrictInt


# --- errors ----------------------------------------------------------------------------

class APIError(Exception):
    """An error answered as ``{"error": {...}}`` with an HTTP status."""

    def __init__(self, status: int, type_: str, message: str, **extra: Any):
        super().__init__(message)
        self.status, self.type, self.message, self.extra = status, type_, message, extra

    def response(self) -> JSONResponse:
        return _error(self.status, self.type, self.message, **self.extra)


def _error(status: int, type_: str, message: str, headers: dict[str, str] | None = None,
           **extra: Any) -> JSONResponse:
    return JSONResponse({"error": {"type": type_, "message": message, **extra}}, status_code=status,
                        headers=headers)


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for e in exc.errors()[:8]:
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body") or "body"
        parts.append(f"{loc}: {e.get('msg')}")
    return "; ".join(parts) or "invalid request"


# --- the ASGI gatekeeper: metrics, auth, body size -----------------------------------------

def _too_large(limit: int) -> JSONResponse:
    return _error(413, "request_too_large", f"request body exceeds {limit} bytes")


class Gatekeeper:
    """Outer middleware: counts every response, then checks the API key and the body size.

    Pure ASGI (not BaseHTTPMiddleware) so it can cut off a chunked body that
    grows past the limit without buffering it: the read fails with an
    HTTPException(413) that FastAPI passes through to the error handler."""

    def __init__(self, app: Any, *, metrics: ServerMetrics, api_key: str | None, max_body_bytes: int):
        self.app, self.metrics, self.max_body = app, metrics, max_body_bytes
        self._key = api_key.encode() if api_key else None

    def _authorized(self, header: bytes) -> bool:
        scheme, _, token = header.partition(b" ")
        # compare even on a wrong scheme, so the time taken says nothing about the key
        ok = hmac.compare_digest(token, self._key)
        return ok and scheme.lower() == b"bearer"

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = {"code": 500}  # an exception that escapes is answered 500 further out

        async def send_counted(message: dict) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            headers = dict(scope.get("headers") or [])
            if self._key is not None and not self._authorized(headers.get(b"authorization", b"")):
                await _error(401, "unauthorized", "missing or invalid API key (Authorization: Bearer <key>)",
                             headers={"WWW-Authenticate": "Bearer"})(scope, receive, send_counted)
                return
            length = headers.get(b"content-length")
            if length is not None and (not length.isdigit() or int(length) > self.max_body):
                await _too_large(self.max_body)(scope, receive, send_counted)
                return
            seen = 0

            async def receive_limited() -> dict:
                nonlocal seen
                message = await receive()
                if message["type"] == "http.request":
                    seen += len(message.get("body", b""))
                    if seen > self.max_body:
                        raise HTTPException(413, f"request body exceeds {self.max_body} bytes")
                return message

            await self.app(scope, receive_limited, send_counted)
        finally:
            self.metrics.requests.labels(endpoint=_endpoint_label(scope.get("path", "")),
                                         status=str(status["code"])).inc()


def _endpoint_label(path: str) -> str:
    if path.startswith("/v1/hotload/"):
        return "/v1/hotload/{id}"
    return path if path in _KNOWN_ENDPOINTS else "other"


# --- response shaping -------------------------------------------------------------------------

def _engine_data(gen: Generation, engine: Engine, replica_id: str, run_id: str | None) -> dict[str, Any]:
    return {
        "policy_version": gen.policy_version, "policy_versions": gen.policy_versions,
        "crossed_swap": len(gen.policy_versions) > 1, "snapshot": gen.snapshot, "replica_id": replica_id,
        "run_id": run_id, "cache_policy": gen.cache_policy, "prefix_recomputes": gen.recomputes,
        "stale_kv_steps": gen.stale_kv_steps, "duration_s": gen.duration_s,
    }


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


# --- the app -------------------------------------------------------------------------------------

def create_app(engine: Engine, *, reader: Any = None, replica_id: str, api_key: str | None = None,
               max_body_bytes: int = MAX_BODY_BYTES, max_concurrent_requests: int = 64) -> FastAPI:
    """The replica's HTTP app over ``engine`` (whose ``swapper`` hot-loads from ``reader``).

    Without a reader/swapper the replica serves fixed weights and answers hot-load
    requests with 409 ``hotload_unavailable``."""
    if reader is None and engine.swapper is not None:
        reader = getattr(engine.swapper, "reader", None)
    metrics = ServerMetrics()
    metrics.set_version(engine.version)
    started = time.time()

    def on_done(job: HotLoadJob, state: str) -> None:
        metrics.set_version(engine.version)
        if job.noop:
            metrics.hotloads.labels(result="noop").inc()
            return
        metrics.hotloads.labels(result="ready" if state == "READY" else "failed").inc()
        if job.finished is not None:
            metrics.hotload_duration.observe(job.finished - job.created)
        if job.report:
            metrics.hotload_pause.observe(float(job.report.get("pause_s") or 0.0))
            metrics.bytes_fetched.inc(int(job.report.get("bytes_fetched") or 0))

    manager = HotLoadManager(engine.swapper, reader, on_done=on_done) if (
        engine.swapper is not None and reader is not None) else None
    run_id = getattr(reader, "run_id", None)
    # Sampling requests block in their decode loops; they get threads of their own so
    # that status, metrics and hot-load requests are answered however busy the replica is.
    sampling_threads = CapacityLimiter(max_concurrent_requests)
    control_threads = CapacityLimiter(4)

    app = FastAPI(title="ckptdelta replica", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine, app.state.metrics, app.state.hotloads, app.state.replica_id = engine, metrics, manager, replica_id

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(400, "invalid_request_error", _validation_message(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(exc.status_code, "http_error")
        return _error(exc.status_code, kind, str(exc.detail))

    @app.exception_handler(APIError)
    async def _api(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    def check_version(min_version: int | None) -> None:
        v = engine.version
        if min_version is not None and (v is None or v < min_version):
            raise APIError(408, "policy_version_too_old",
                           f"replica {replica_id} serves policy version {v}, the request needs >= {min_version}; "
                           "retry after the hot-load lands", policy_version=v, min_policy_version=min_version)

    def run(prompt_ids: list[int], req: _Sampling, logprobs: int | None, max_tokens: int) -> Generation:
        check_version(req.min_policy_version)
        params = SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, n=req.n,
                                seed=req.seed, stop=tuple(req.stop or ()), logprobs=logprobs, ignore_eos=req.ignore_eos,
                                score_logprobs=req.score_logprobs)
        try:
            engine.check_prompt(prompt_ids, max_tokens)
        except ValueError as e:
            raise APIError(400, "invalid_request_error", str(e)) from None
        gen = engine.generate(prompt_ids, params)
        metrics.generated_tokens.inc(sum(len(c.token_ids) for c in gen.completions))
        if len(gen.policy_versions) > 1:
            metrics.request_crossed_swap.inc()
        return gen

    def envelope(kind: str, gen: Generation, req: _Sampling, choices: list[dict]) -> dict[str, Any]:
        body = {"id": f"{kind}-{uuid.uuid4().hex}", "object": "text_completion" if kind == "cmpl" else
                "chat.completion", "created": int(time.time()), "model": engine.model_name, "choices": choices,
                "usage": _usage(gen), "prompt_token_ids": gen.prompt_token_ids}
        if req.return_engine_data:
            body["engine_data"] = _engine_data(gen, engine, replica_id, run_id)
        return body

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest) -> dict[str, Any]:
        return await to_thread.run_sync(_completions, req, limiter=sampling_threads)

    def _completions(req: CompletionRequest) -> dict[str, Any]:
        prompt_ids = engine.encode(req.prompt) if isinstance(req.prompt, str) else list(req.prompt)
        gen = run(prompt_ids, req, req.logprobs, req.max_tokens)
        choices = [{"index": c.index, "text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                    "logprobs": _completion_logprobs(engine, c) if req.logprobs is not None else None}
                   for c in gen.completions]
        return envelope("cmpl", gen, req, choices)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest) -> dict[str, Any]:
        return await to_thread.run_sync(_chat, req, limiter=sampling_threads)

    def _chat(req: ChatCompletionRequest) -> dict[str, Any]:
        prompt_ids = engine.encode_chat([m.model_dump() for m in req.messages])
        k = (req.top_logprobs or 0) if req.logprobs else None
        gen = run(prompt_ids, req, k, req.max_completion_tokens or req.max_tokens)
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text}, "token_ids": c.token_ids,
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                    "logprobs": _chat_logprobs(engine, c) if req.logprobs else None}
                   for c in gen.completions]
        return envelope("chatcmpl", gen, req, choices)

    @app.post("/v1/hotload", status_code=202)
    async def hotload(req: HotLoadRequest) -> JSONResponse:
        return await to_thread.run_sync(_hotload, req, limiter=control_threads)

    def _hotload(req: HotLoadRequest) -> JSONResponse:
        if manager is None:
            raise APIError(409, "hotload_unavailable", f"replica {replica_id} was started without a bucket")
        ref = req.snapshot
        if isinstance(ref, int):
            if ref < 0:
                raise APIError(400, "invalid_snapshot", f"snapshot version {ref} is negative")
        elif not _SNAPSHOT_RE.match(ref) or ".." in ref:
            raise APIError(400, "invalid_snapshot",
                           f"snapshot {ref[:80]!r} is not 'latest', a snapshot name or a version "
                           "(one path segment of letters, digits, '.', '_', '-')")
        try:
            job, how = manager.submit(ref)
        except SnapshotNotFoundError as e:
            raise APIError(404, "snapshot_not_found", str(e), snapshot=ref) from None
        except HotLoadConflictError as e:
            running = manager.running
            raise APIError(409, "hotload_in_progress", str(e),
                           running=running.to_dict() if running is not None else None) from None
        except StorageError as e:
            raise APIError(503, "storage_error", str(e)) from None
        except DeltaError as e:  # the snapshot exists but its manifest cannot be trusted
            raise APIError(502, "snapshot_unreadable", str(e)) from None
        except ValueError as e:
            raise APIError(400, "invalid_snapshot", str(e)) from None
        body = {**job.to_dict(), "joined": how == "joined"}
        return JSONResponse(body, status_code=200 if how == "noop" else 202)

    @app.get("/v1/hotload/{job_id}")
    async def hotload_status(job_id: str) -> dict[str, Any]:
        job = manager.get(job_id) if manager is not None else None
        if job is None:
            raise APIError(404, "hotload_not_found", f"no hot-load with id {job_id[:80]!r} on replica {replica_id}")
        return job.to_dict()

    @app.get("/v1/status")
    async def status() -> dict[str, Any]:
        running = manager.running if manager is not None else None
        last = manager.last if manager is not None else None
        return {
            "replica_id": replica_id, "run_id": run_id, "policy_version": engine.version,
            "snapshot": engine.snapshot, "state": running.state if running is not None else "READY",
            "hotload": running.to_dict() if running is not None else None,
            "last_hotload": last.to_dict() if last is not None else None,
            "cache_policy": engine.cache_policy, "model": engine.model_name, "uptime_s": time.time() - started,
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": engine.model_name, "object": "model", "owned_by": "ckptdelta",
                                            "policy_version": engine.version}]}

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"ok": True, "policy_version": engine.version}

    @app.get("/metrics")
    async def prometheus() -> Response:
        metrics.set_version(engine.version)
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    app.add_middleware(Gatekeeper, metrics=metrics, api_key=api_key, max_body_bytes=max_body_bytes)
    return app
