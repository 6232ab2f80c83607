"""The seam between the replica (HTTP API, hot-load jobs, metrics, client) and the engine that samples.

A replica engine owns two things: answering sampling requests, and the weights
those requests run on. Everything else (auth, ``min_policy_version``,
``engine_data``, hot-load jobs, metrics) is the replica's, shared by every
engine, so a new engine is one module that implements :class:`ReplicaEngine`.

A hot-load calls, in this order (loader/hotload_jobs.py)::

    prepared = engine.swapper.prepare(target)   # while serving: fetch, decode, verify against
                                                # the host copy of the current weights
    report = engine.swapper.commit(prepared)    # the pause: generation held, the update applied
                                                # and checked, the version set, generation resumed

``swapper`` is a :class:`ckptdelta.loader.hotswap.HotSwapper`. For the reference engine it
patches the torch model the decode loop runs. An engine that keeps its weights
in a layout of its own (vLLM) gives the swapper a host copy in checkpoint
coordinates and an :class:`EngineApplier`: the swapper patches the copy inside
the applier's ``paused()``, and the applier pushes the changed tensors into the
engine (getting them ready while the engine still serves, then stopping it only
to swap them in) and proves them against the manifest's digests; if that fails,
the copy is rolled back and pushed again, so the engine serves its previous
version.

Requests: ``await engine.complete(kind, body)`` with the OpenAI body minus the
replica's own fields; it returns an :class:`EngineResult` whose body the server
sends as is (with ``engine_data`` added when asked for). A body with ``stream:
true`` goes to ``await engine.stream(kind, body)`` instead, whose events the
server sends as they come (loader/streaming.py).
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Literal, Sequence

if TYPE_CHECKING:
    from ckptdelta.loader.hotswap import HotSwapper

RequestKind = Literal["completions", "chat"]


#: The error type of the 504 a replica answers when its engine gave no answer within the replica's
#: ``--request-timeout``: a generation that long, not an engine down, so clients do not send it again
#: (loader/client.py, SampleTries).
ENGINE_TIMEOUT = "engine_timeout"


class ReplicaAPIError(Exception):
    """An error a request is answered with, as ``{"error": {"type": ..., "message": ..., **extra}}``."""

    def __init__(self, status: int, type_: str, message: str, *, headers: dict[str, str] | None = None, **extra: Any):
        super().__init__(message)
        self.status, self.type, self.message, self.extra, self.headers = status, type_, message, extra, headers


@dataclass
class EngineResult:
    """One sampling request's answer, and what the replica knows of the weights behind it."""

    status: int
    body: dict[str, Any]
    policy_versions: list[int | None] = field(default_factory=list)  # in the order the request used them
    snapshot: str | None = None
    cache_policy: str = "recompute"
    recomputes: int = 0          # prefix re-runs after a swap
    stale_kv_steps: int = 0      # steps on KV built by older weights ("keep")
    duration_s: float = 0.0
    completion_tokens: int = 0
    #: with prompt logprobs asked for, the versions that may have computed them: the one version of the step
    #: that did where the engine runs the steps (reference), else the request's whole span (vLLM: its prefill is
    #: not seen from here); None when none were asked. engine_data's ``prompt_logprobs_version`` is read off it.
    prompt_logprobs_versions: list[int | None] | None = None

    @property
    def policy_version(self) -> int | None:
        return self.policy_versions[-1] if self.policy_versions else None

    @property
    def prompt_logprobs_version(self) -> int | None:
        """The version that computed the prompt's logprobs, where only one can have: None when none were asked,
        or when more than one version may have (a vLLM request that crossed a hot-load)."""
        vs = self.prompt_logprobs_versions
        return vs[0] if vs is not None and len(vs) == 1 else None


@dataclass
class EngineStream:
    """A streamed answer (``stream: true``): server-sent events, then what the replica knows of the weights.

    ``events`` yields whole events (``b"data: {...}\n\n"``), never the final ``data: [DONE]``: the
    replica adds its own last chunk (``engine_data``) before it. Once ``events`` is exhausted, ``result``
    holds the versions the request ran under and, in ``body``, the chunks' ``id``, ``object``, ``created``
    and ``model`` (``status`` is not 200 when the stream ended with an error event)."""

    events: AsyncIterator[bytes]
    result: EngineResult


class EngineApplier(abc.ABC):
    """Pushes changes of the host copy into an engine that keeps its own weights; called inside the pause.

    ``HotSwapper(..., applier=...)``: ``paused()`` wraps the whole commit (it is the
    swapper's gate), ``apply(names, to_version, positions)`` runs after the host copy holds
    the new bits and must leave the engine computing with exactly them (or
    raise); after a failed ``apply`` the swapper restores the host copy and calls
    ``apply(names, from_version, positions)`` again to put the engine back."""

    @abc.abstractmethod
    def paused(self) -> Any:
        """A context manager around one commit; yields a :class:`ckptdelta.loader.hotswap.Pause` it fills in.

        The engine generates nothing between the first ``apply`` and the end of the block. Since it
        computes with its own tensors, not the host copy, it may serve on while the swapper writes the host
        copy before that ``apply``: the pause it reports is the time it did not generate."""

    @abc.abstractmethod
    def apply(self, names: Sequence[str], version: int | None, positions: dict[str, Any] | None = None) -> None:
        """Make the engine compute with the host copy's current bits of ``names`` (checkpoint names).

        ``positions[name]``, when given and not None, are the flat positions that
        changed in that tensor (an engine may write only those)."""


class ReplicaEngine(abc.ABC):
    """What the replica server needs of an engine. See the module docstring for the order of calls."""

    #: the name ``ckptdelta serve --engine`` knows it by
    kind: str = "?"
    model_name: str = "ckptdelta"
    cache_policy: str = "recompute"
    swapper: "HotSwapper | None" = None  # None: fixed weights

    @property
    def version(self) -> int | None:
        return self.swapper.version if self.swapper is not None else None

    @property
    def snapshot(self) -> str | None:
        return self.swapper.snapshot if self.swapper is not None else None

    @abc.abstractmethod
    async def complete(self, kind: RequestKind, body: dict[str, Any]) -> EngineResult:
        """Answer one ``/v1/completions`` or ``/v1/chat/completions`` body (replica fields removed)."""

    async def stream(self, kind: RequestKind, body: dict[str, Any]) -> EngineStream | EngineResult:
        """Answer a body with ``stream: true`` (replica fields removed): an :class:`EngineStream`, or an
        :class:`EngineResult` for an answer given before anything streamed (the engine refused the body)."""
        raise ReplicaAPIError(400, "invalid_request_error",
                              f"stream: the {self.kind} engine does not stream; send stream=false")

    def status(self) -> dict[str, Any]:
        """Engine facts for ``/v1/status`` (merged under ``engine``)."""
        return {"kind": self.kind}

    def failure(self) -> str | None:
        """Why the engine cannot serve (its process died, its server stopped answering), or None while it can.

        The replica reports it: ``/health`` fails, ``/v1/status`` is not READY, hot-loads are refused, and
        ``ckptdelta serve`` exits non-zero so that a supervisor restarts it. An engine inside this process
        (the reference loop) lives and dies with it: never a failure of its own."""
        return None

    def close(self) -> None:
        """Release what the engine holds (processes, shared memory). Idempotent."""
