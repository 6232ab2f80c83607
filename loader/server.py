"""The replica's HTTP API: OpenAI-compatible sampling plus hot-loads, over any replica engine.

``create_app(engine, reader=..., replica_id=...)`` builds the FastAPI app; the
``ckptdelta serve`` command (ckptdelta/cli/serve.py) builds an engine (the reference decode
loop, or vLLM: loader/engines/) and runs the app under uvicorn. Endpoints,
engine_data, the cache policy on swap, auth and metrics are described in
docs/SERVING.md. What is the replica's (auth, body limits, ``min_policy_version``,
``engine_data``, hot-load jobs, metrics) lives here, once; what is the engine's
(validating and answering a sampling body, applying a swap) lives behind
:class:`ckptdelta.loader.engines.base.ReplicaEngine`.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import time
from typing import TYPE_CHECKING, Any, Awaitable, TypeVar

from anyio import CapacityLimiter, to_thread
from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr
from starlette.exceptions import HTTPException as StarletteHTTPException

from ckptdelta.delta.errors import (CkptDeltaError, DeltaError, HotLoadCancelledError, HotLoadConflictError,
                                    HotLoadError, SnapshotNotFoundError, StorageError)

from ckptdelta.loader import streaming
from ckptdelta.loader.engines import replica_engine
from ckptdelta.loader.engines.base import EngineResult, EngineStream, ReplicaAPIError, ReplicaEngine, RequestKind
from ckptdelta.loader.engines.requests import parse, validation_message
from ckptdelta.loader.hotload_jobs import SUPERSEDED, HotLoadJob, HotLoadManager
from ckptdelta.loader.metrics import CONTENT_TYPE, ServerMetrics

if TYPE_CHECKING:
    from ckptdelta.loader.reader import SnapshotReader

log = logging.getLogger("ckptdelta.server")

MAX_BODY_BYTES = 1 << 20
STOPPING_MESSAGE = ("the replica is stopping (SIGTERM, SIGINT or SIGHUP) and this request did not finish within its "
                    "drain timeout (serve --drain-timeout); send it to another replica")
#: ``/v1/status`` states besides a hot-load's: the engine died or stopped answering; the live weights are not
#: proven to be any version (a failed swap or proof: the next hot-load pushes and proves every tensor).
ENGINE_FAILED, UNKNOWN_VERSION = "ENGINE_FAILED", "UNKNOWN_VERSION"
#: The longest ``await_commit_s`` a hot-load request may ask for.
MAX_AWAIT_COMMIT_S = 3600.0
#: Seconds between two looks for the run's id (RUN.json) of a replica up before the trainer's first publish.
RUN_LOOK_S = 5.0
#: The longest ``GET /v1/hotload/{id}?wait=`` the replica holds (it answers the moment the job ends).
HOTLOAD_WAIT_MAX_S = 30.0
#: Seconds a 408 (policy version too old) asks the client to wait: about one hot-load of a small delta.
RETRY_AFTER_S = 1
#: The status counted (``ckptdelta_requests_total``) for a sampling request whose client left before its answer
#: (nginx's "client closed request"); nothing is sent, there is nobody to send it to.
CLIENT_LEFT = 499
_SNAPSHOT_RE = re.compile(r"^[A-Za-z0-9_\-][A-Za-z0-9._\-]{0,63}$")
_KNOWN_ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/hotload", "/v1/status", "/v1/models",
                    "/metrics", "/health")


# --- request schemas -----------------------------------------------------------------

class ReplicaOptions(BaseModel):
    """The replica's own fields of a sampling request; the engine never sees them."""

    model_config = ConfigDict(extra="ignore")

    min_policy_version: StrictInt | None = Field(None, ge=0)
    return_engine_data: StrictBool = False


class HotLoadRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    snapshot: StrictStr | StrictInt
    #: while a hot-load to another version runs: wait for it instead of 409 (the newest request wins)
    queue: StrictBool = False
    #: a version newer than every committed one (the one being published): wait up to this many seconds for its
    #: commit instead of 404, fetching its objects as they land (loader/landing.py)
    await_commit_s: StrictFloat | StrictInt | None = None
    #: hold the answer until the job ends, at most this many seconds (as ``GET /v1/hotload/{id}?wait=``): one
    #: request from the hot-load's start to READY
    wait: StrictFloat | StrictInt | None = None


# --- errors ----------------------------------------------------------------------------

APIError = ReplicaAPIError


def _error(status: int, type_: str, message: str, headers: dict[str, str] | None = None,
           **extra: Any) -> JSONResponse:
    return JSONResponse({"error": {"type": type_, "message": message, **extra}}, status_code=status,
                        headers=headers)


# --- the ASGI gatekeeper: metrics, auth, body size -----------------------------------------

def _too_large(limit: int) -> JSONResponse:
    return _error(413, "request_too_large", f"request body exceeds {limit} bytes")


def stopping_error() -> dict[str, Any]:
    """What a request cut by a stop's drain timeout is told: the body of its 503, or a stream's last event."""
    return {"error": {"type": "replica_stopping", "message": STOPPING_MESSAGE}}


class Gatekeeper:
    """Outer middleware: counts every response, then checks the API key and the body size; answers what a
    stop's drain cuts.

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
        # an exception that escapes is answered 500 further out; what was sent tells how a cut one ends
        status = {"code": 500, "started": False, "events": False, "ended": False, "done": False}

        async def send_counted(message: dict) -> None:
            if message["type"] == "http.response.start":
                status["code"], status["started"] = message["status"], True
                ctype = dict(message.get("headers") or []).get(b"content-type", b"")
                status["events"] = ctype.startswith(b"text/event-stream")
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    status["done"] = bytes(message["body"]).endswith(streaming.DONE)
                status["ended"] = not message.get("more_body", False)
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

            try:
                await self.app(scope, receive_limited, send_counted)
            except asyncio.CancelledError:
                # uvicorn cancels what still runs when a stop's drain timeout ends (loader/stopping.py): say so,
                # not 500 with a traceback in the log. A stream already begun cannot change its status: it ends
                # as a stream that fails does (loader/streaming.py), with the same error as an event, then
                # [DONE]; cut off there, a client would see a broken connection (openai: APIConnectionError)
                if not status["started"]:
                    await _error(503, "replica_stopping", STOPPING_MESSAGE)(scope, receive, send_counted)
                elif status["events"] and not status["ended"]:
                    tail = b"" if status["done"] else streaming.event(stopping_error()) + streaming.DONE
                    await send_counted({"type": "http.response.body", "body": tail, "more_body": False})
        finally:
            self.metrics.requests.labels(endpoint=_endpoint_label(scope.get("path", "")),
                                         status=str(status["code"])).inc()


def _hotload_result(job: HotLoadJob, state: str) -> str:
    """The ``result`` label of an ended hot-load. A queued one replaced by a newer request, or dropped by a stop,
    ended FAILED as its waiters must see, but nothing went wrong: an alert on ``failed`` must not fire for them."""
    if state == "READY":
        return "ready"
    if job.error_type == SUPERSEDED:
        return "superseded"
    if job.error_type == HotLoadCancelledError.__name__:
        return "cancelled"
    return "failed"


T = TypeVar("T")


async def unless_client_leaves(request: Request, work: Awaitable[T]) -> T | None:
    """``work``'s result, or None once the request's client has gone (its connection closed: a client timeout,
    a cancelled task, a killed process), with ``work`` cancelled.

    A plain (not streamed) answer is sent only when the generation ends, and nothing else tells the server the
    client stopped waiting: the engine would go on generating for nobody, beside the client's next try. Cancelled,
    the vLLM engine closes its forwarded request, which vLLM aborts; the reference engine stops at its next
    token. (A stream needs none of this: Starlette stops iterating it when the client goes.)"""
    task = asyncio.ensure_future(work)

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass      # the body was read before: nothing else comes but the disconnect

    watch = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        task.cancel()     # this handler cancelled (a stop's drain timeout): so is its work
        raise
    finally:
        watch.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return None
    return task.result()


def _endpoint_label(path: str) -> str:
    if path.startswith("/v1/hotload/"):
        return "/v1/hotload/{id}"
    return path if path in _KNOWN_ENDPOINTS else "other"


# --- response shaping -------------------------------------------------------------------------

def _engine_data(res: EngineResult, replica_id: str, run_id: str | None) -> dict[str, Any]:
    data = {
        "policy_version": res.policy_version, "policy_versions": res.policy_versions,
        "crossed_swap": len(res.policy_versions) > 1, "snapshot": res.snapshot, "replica_id": replica_id,
        "run_id": run_id, "cache_policy": res.cache_policy, "prefix_recomputes": res.recomputes,
        "stale_kv_steps": res.stale_kv_steps, "duration_s": res.duration_s,
    }
    if res.prompt_logprobs_versions is not None:
        # the prompt's logprobs may come from another version than the last token (a hot-load in between)
        data["prompt_logprobs_version"] = res.prompt_logprobs_version
    return data


def _name(version: int | None) -> str:
    from ckptdelta.delta.manifest import snapshot_name

    return "unknown version" if version is None else snapshot_name(version)


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _verified(engine: ReplicaEngine) -> str:
    """What proved the new weights: the engine's own read-back (vLLM), or the manifest's digests."""
    last = (engine.status() or {}).get("last_swap") or {}
    if "verify" not in last:
        return "verified against the manifest's digests"
    if last.get("verify") == "off":
        return "not verified (--verify off)"
    if last.get("verified"):
        return f"verified: {last.get('verified_tensors', 0)} tensors read back from the engine"
    return f"NOT verified ({last.get('verify')} proof incomplete)"


# --- the app -------------------------------------------------------------------------------------

def create_app(engine: Any, *, reader: "SnapshotReader | None" = None, replica_id: str, api_key: str | None = None,
               max_body_bytes: int = MAX_BODY_BYTES, max_concurrent_requests: int = 64) -> FastAPI:
    """The replica's HTTP app over ``engine`` (a :class:`ReplicaEngine`, or the reference decode loop).

    The engine's ``swapper`` hot-loads from ``reader``; without them the replica
    serves fixed weights and answers hot-load requests with 409 ``hotload_unavailable``."""
    engine = replica_engine(engine, max_concurrent_requests=max_concurrent_requests)
    swapper = engine.swapper
    if reader is None and swapper is not None:
        reader = getattr(swapper, "reader", None)
    metrics = ServerMetrics()
    metrics.set_version(engine.version)
    started = time.time()

    def on_done(job: HotLoadJob, state: str) -> None:
        metrics.set_version(engine.version)
        if job.noop:
            metrics.hotloads.labels(result="noop").inc()
            return
        if state == "READY" and job.report:
            r = job.report
            log.info("hot-load %s: %s -> %s READY: %s fetched, prepare %.2f s, pause %.3f s, %s", job.id,
                     _name(job.from_version), _name(job.target_version), _bytes(int(r.get("bytes_fetched") or 0)),
                     job.prepare_s or 0.0, float(r.get("pause_s") or 0.0), _verified(engine))
        metrics.hotloads.labels(result=_hotload_result(job, state)).inc()
        if job.finished is not None:
            metrics.hotload_duration.observe(job.finished - job.created)
        if job.report:
            metrics.hotload_pause.observe(float(job.report.get("pause_s") or 0.0))
            metrics.bytes_fetched.inc(int(job.report.get("bytes_fetched") or 0))

    manager = HotLoadManager(swapper, reader, on_done=on_done) if (
        swapper is not None and reader is not None) else None
    known_run: list[str] = []
    looked = [float("-inf")]

    def run_id() -> str | None:
        """The bucket's run id, once it has one: a replica started from a model directory may be up before the
        trainer's first publish creates the run (RUN.json), and learns it at a look after that (one every
        ``RUN_LOOK_S`` at most, not one per request)."""
        if not known_run and reader is not None and time.monotonic() - looked[0] >= RUN_LOOK_S:
            looked[0] = time.monotonic()
            try:
                known_run.append(reader.run_id)
            except CkptDeltaError as e:
                log.debug("replica %s: the bucket has no run yet (%s)", replica_id, e)
        return known_run[0] if known_run else None

    run_id()
    control_threads = CapacityLimiter(4)

    app = FastAPI(title="ckptdelta replica", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine, app.state.metrics, app.state.hotloads, app.state.replica_id = engine, metrics, manager, replica_id

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(400, "invalid_request_error", validation_message(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(exc.status_code, "http_error")
        return _error(exc.status_code, kind, str(exc.detail))

    @app.exception_handler(ReplicaAPIError)
    async def _api(request: Request, exc: ReplicaAPIError) -> JSONResponse:
        return _error(exc.status, exc.type, exc.message, headers=exc.headers, **exc.extra)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # an OpenAI-shaped error a client can show, as a stream's error event is, not a bare text/plain 500
        log.error("replica %s: %s %s failed", replica_id, request.method, request.url.path, exc_info=exc)
        return _error(500, "engine_error", f"replica {replica_id} failed on this request: {type(exc).__name__}: "
                      f"{exc}"[:2000])

    def too_old(why: str, floor: int) -> APIError:
        """The 408 a request below ``floor`` gets, at its start or on the versions that served it."""
        return APIError(408, "policy_version_too_old", f"replica {replica_id} {why}; retry after the hot-load lands",
                        policy_version=engine.version, min_policy_version=floor,
                        headers={"Retry-After": str(RETRY_AFTER_S)})

    def check_version(min_version: int | None) -> None:
        v = engine.version
        if min_version is not None and (v is None or v < min_version):
            raise too_old(f"serves policy version {v}, the request needs >= {min_version}", min_version)

    async def sample(kind: RequestKind, request: Request) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise APIError(400, "invalid_request_error", f"the body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise APIError(400, "invalid_request_error", "the body must be a JSON object")
        opts = parse(ReplicaOptions, body)
        for k in ReplicaOptions.model_fields:
            body.pop(k, None)
        check_model(body.get("model"))
        check_version(opts.min_policy_version)       # before the first byte of a stream too

        def settle(res: EngineResult) -> dict[str, Any] | None:
            if res.status != 200:
                return None
            metrics.generated_tokens.inc(res.completion_tokens)
            if len(res.policy_versions) > 1:
                metrics.request_crossed_swap.inc()
            return _engine_data(res, replica_id, run_id()) if opts.return_engine_data else None

        def below_floor(res: EngineResult) -> APIError | None:
            """The floor checked again on the versions that served the request: one below it (a hot-load to an
            older version, a rollback, landed after the check at its start) makes it a 408 all the same."""
            floor = opts.min_policy_version
            if floor is None or res.status != 200 or all(v is not None and v >= floor for v in res.policy_versions):
                return None
            return too_old(f"served this request with policy versions {res.policy_versions}, below the {floor} it "
                           "needs (a hot-load to an older version landed while it ran)", floor)

        if body.get("stream") is True:
            answer = await engine.stream(kind, body)
            if isinstance(answer, EngineStream):
                def last(res: EngineResult) -> dict[str, Any] | None:
                    data = settle(res)
                    low = below_floor(res)
                    if low is not None:        # the status went out with the first byte: an error event instead
                        return {"error": {"type": low.type, "message": low.message, **low.extra}}
                    return None if data is None else streaming.last_chunk(res, data)

                return streaming.response(answer, finish=last)
            return JSONResponse(answer.body, status_code=answer.status)
        res = await unless_client_leaves(request, engine.complete(kind, body))
        if res is None:
            log.info("the client of a %s request left before its answer: its generation was stopped", kind)
            return Response(status_code=CLIENT_LEFT)
        data = settle(res)
        low = below_floor(res)
        if low is not None:
            raise low
        if data is not None:
            res.body["engine_data"] = data
        return JSONResponse(res.body, status_code=res.status)

    def served_names() -> list[str]:
        """The ``model`` names a request may give (``/v1/models`` lists them): the served name and the run id."""
        return list(dict.fromkeys(n for n in (engine.model_name, run_id()) if n))

    def check_model(name: Any) -> None:
        if name is None:
            return
        if not isinstance(name, str):
            raise APIError(400, "invalid_request_error", "model: expected a string")
        names = served_names()
        if name not in names:
            raise APIError(404, "model_not_found", f"the model {name[:200]!r} does not exist on replica {replica_id}; "
                           f"it serves {', '.join(map(repr, names))} (GET /v1/models)", code="model_not_found",
                           param="model")

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await sample("completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await sample("chat", request)

    @app.post("/v1/hotload", status_code=202)
    async def hotload(req: HotLoadRequest) -> JSONResponse:
        job, how = await to_thread.run_sync(_hotload, req, limiter=control_threads)
        if req.wait:
            await job.wait_done(float(req.wait))
        ended = how == "noop" or (bool(req.wait) and job.done)
        return JSONResponse({**job.to_dict(), "joined": how == "joined"}, status_code=200 if ended else 202)

    def _hotload(req: HotLoadRequest) -> tuple[HotLoadJob, str]:
        if manager is None:
            raise APIError(409, "hotload_unavailable", f"replica {replica_id} was started without a bucket")
        failed = engine.failure()
        if failed is not None:
            raise APIError(503, "engine_unavailable", f"replica {replica_id} cannot hot-load: its engine failed "
                           f"({failed}); restart the replica")
        ref = req.snapshot
        if isinstance(ref, int):
            if ref < 0:
                raise APIError(400, "invalid_snapshot", f"snapshot version {ref} is negative")
        elif not _SNAPSHOT_RE.match(ref) or ".." in ref:
            raise APIError(400, "invalid_snapshot",
                           f"snapshot {ref[:80]!r} is not 'latest', a snapshot name or a version "
                           "(one path segment of letters, digits, '.', '_', '-')")
        wait = req.await_commit_s
        if wait is not None and not 0 < wait <= MAX_AWAIT_COMMIT_S:
            raise APIError(400, "invalid_await_commit", f"await_commit_s must be in (0, {MAX_AWAIT_COMMIT_S:g}] "
                           f"seconds, got {wait!r}")
        if req.wait is not None and not 0 <= req.wait <= HOTLOAD_WAIT_MAX_S:
            raise APIError(400, "invalid_wait", f"wait={req.wait:g}: between 0 and {HOTLOAD_WAIT_MAX_S:g} seconds")
        try:
            job, how = manager.submit(ref, queue=req.queue, await_commit_s=wait)
        except HotLoadCancelledError as e:
            raise APIError(503, "replica_stopping", f"replica {replica_id}: {e}") from None
        except SnapshotNotFoundError as e:
            raise APIError(404, "snapshot_not_found", str(e), snapshot=ref) from None
        except HotLoadConflictError as e:
            running = manager.running
            raise APIError(409, "hotload_in_progress", str(e),
                           running=running.to_dict() if running is not None else None) from None
        except HotLoadError as e:           # it could not start (no thread to be had): the job says so too
            raise APIError(503, "hotload_not_started", str(e)) from None
        except StorageError as e:
            raise APIError(503, "storage_error", str(e)) from None
        except DeltaError as e:  # the snapshot exists but its manifest cannot be trusted
            raise APIError(502, "snapshot_unreadable", str(e)) from None
        except ValueError as e:
            raise APIError(400, "invalid_snapshot", str(e)) from None
        return job, how

    @app.get("/v1/hotload/{job_id}")
    async def hotload_status(job_id: str, wait: float = 0.0) -> dict[str, Any]:
        """The job's state; with ``wait`` (seconds, at most HOTLOAD_WAIT_MAX_S), answered as soon as the job ends
        within that time, so a client waiting for READY hears it then rather than at its next poll."""
        job = manager.get(job_id) if manager is not None else None
        if job is None:
            raise APIError(404, "hotload_not_found", f"no hot-load with id {job_id[:80]!r} on replica {replica_id}")
        if not 0.0 <= wait <= HOTLOAD_WAIT_MAX_S:
            raise APIError(400, "invalid_wait", f"wait={wait:g}: between 0 and {HOTLOAD_WAIT_MAX_S:g} seconds")
        await job.wait_done(wait)
        return job.to_dict()

    @app.get("/v1/status")
    async def status() -> dict[str, Any]:
        running = manager.running if manager is not None else None
        last = manager.last if manager is not None else None
        queued = manager.queued if manager is not None else None
        return {
            "replica_id": replica_id, "run_id": run_id(), "policy_version": engine.version,
            "snapshot": engine.snapshot, "state": replica_state(running),
            "hotload": running.to_dict() if running is not None else None,
            "queued_hotload": queued.to_dict() if queued is not None else None,
            "last_hotload": last.to_dict() if last is not None else None,
            "cache_policy": engine.cache_policy, "model": engine.model_name, "uptime_s": time.time() - started,
            "engine": engine.status(),
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        created = int(started)
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "ckptdelta",
                                            "root": engine.model_name, "policy_version": engine.version}
                                           for name in served_names()]}

    def replica_state(running: HotLoadJob | None) -> str:
        """READY only while the engine lives and the version is known (or the weights are fixed)."""
        if engine.failure() is not None:
            return ENGINE_FAILED
        if running is not None:
            return running.state
        return UNKNOWN_VERSION if engine.version is None and manager is not None else "READY"

    @app.get("/health")
    async def health() -> JSONResponse:
        failed = engine.failure()
        if failed is not None:
            return JSONResponse({"ok": False, "policy_version": engine.version, "state": ENGINE_FAILED,
                                 "reason": failed}, status_code=503)
        return JSONResponse({"ok": True, "policy_version": engine.version})

    @app.get("/metrics")
    async def prometheus() -> Response:
        metrics.set_version(engine.version)
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    app.add_middleware(Gatekeeper, metrics=metrics, api_key=api_key, max_body_bytes=max_body_bytes)
    return app
