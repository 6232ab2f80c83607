"""Server-sent events for ``stream: true``: the engine's chunks as they come, then the replica's own last chunk.

OpenAI's stream is ``data: {chunk}`` events ending with ``data: [DONE]``; the
usage of ``stream_options.include_usage`` travels in a last chunk whose
``choices`` is empty. The replica's ``engine_data`` travels the same way: with
``return_engine_data``, one more chunk with ``choices: []`` and ``engine_data``
(the versions the whole stream ran under, known only at its end) comes right
before ``[DONE]``. The official ``openai`` client reads it as one more chunk
(``chunk.engine_data``, or ``chunk.model_extra["engine_data"]``). A failure once
the stream has started cannot change the status any more: it is an error event
(``data: {"error": {...}}``, which the ``openai`` client raises), then ``[DONE]``.
"""

from __future__ import annotations

import json
import logging
from typing import Any, AsyncIterator, Callable

from fastapi.responses import StreamingResponse

from ckptdelta.loader.engines.base import EngineResult, EngineStream

log = logging.getLogger("ckptdelta.server")

DONE = b"data: [DONE]\n\n"
#: no caching, and no buffering by a proxy in front (nginx honours X-Accel-Buffering)
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def event(obj: Any) -> bytes:
    """One server-sent event carrying ``obj`` as JSON."""
    return b"data: " + json.dumps(obj, separators=(",", ":"), allow_nan=False).encode() + b"\n\n"


def last_chunk(res: EngineResult, engine_data: dict[str, Any]) -> dict[str, Any]:
    """The replica's chunk before ``[DONE]``: the stream's id, object, created and model, no choices."""
    head = {k: res.body.get(k) for k in ("id", "object", "created", "model")}
    return {**head, "choices": [], "engine_data": engine_data}


def response(stream: EngineStream, *, finish: Callable[[EngineResult], dict[str, Any] | None]) -> StreamingResponse:
    """The streamed HTTP answer. ``finish(result)`` runs once the engine's events are exhausted (metrics) and
    returns the chunk to send before ``[DONE]``, or None."""

    async def body() -> AsyncIterator[bytes]:
        async for ev in stream.events:
            yield ev
        try:
            last = finish(stream.result)
        except Exception:  # noqa: BLE001 - the answer itself is complete; the replica's extras must not break it
            log.exception("finishing a stream failed")
            last = None
        if last is not None:
            yield event(last)
        yield DONE

    return StreamingResponse(body(), media_type="text/event-stream", headers=HEADERS)
