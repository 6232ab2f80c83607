"""A sampling client in the shape of Baseten Loops' and Tinker's, over ckptdelta replicas.

RL users coming from Loops or Tinker write their loops against a few types: token
ids in (:class:`ModelInput`), :class:`SamplingParams`, and a response whose
``sequences`` each carry the sampled ``tokens``, their ``logprobs`` and a
``stop_reason``, from a client pinned to a minimum policy version. With these, such
a loop runs against ckptdelta replicas with its imports and its client construction
changed, instead of an adapter over raw OpenAI answers that each user writes again.

:class:`SamplingClient` is :class:`ckptdelta.loader.client.RolloutClient` (sync) and
:class:`ckptdelta.loader.async_client.AsyncRolloutClient` (asyncio) underneath, with their
rules: replicas in turn or pinned by ``affinity_key``; a replica below
``min_policy_version`` answers 408 and is tried again, with backoff, until
``ready_timeout``, then :class:`ckptdelta.delta.errors.PolicyVersionTimeoutError`; a replica
that is starting is waited for as long. What a replica answers is checked before it
is trusted: token ids and one logprob per token must be there (every engine sends
them: the reference engine always, vLLM asked with ``return_token_ids`` and
``logprobs: 0``), the prompt it ran must be the one sent, and every version the
request ran on (its span, ``engine_data.policy_versions``) must be at or above the
floor (a replica rolled back meanwhile is tried again, as for a 408).

:func:`save_weights_and_get_sampling_client` is the trainer's one call per step, as
Loops' method of that name: publish, hot-load the fleet to that version, and return
a client pinned to it. Only httpx is needed here (``pip install ckptdelta[client]``);
nothing of the replica server is imported.
"""

from __future__ import annotations

import asyncio
import math
import operator
import threading
from dataclasses import dataclass, field
from typing import Any, Iterable, Literal, Sequence

from ckptdelta.delta.errors import ReplicaError

from ckptdelta.loader.async_client import AsyncRolloutClient
from ckptdelta.loader.client import SAMPLE_TIMEOUT_S, RolloutClient, SampleTries

_PATH = "/v1/completions"
StopReason = Literal["length", "stop"]


# --- the types ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelInput:
    """A prompt as token ids (the replica does not tokenize it: what is sampled after is exactly these ids)."""

    tokens: tuple[int, ...]

    @classmethod
    def from_ints(cls, tokens: Iterable[int]) -> "ModelInput":
        """The prompt of these token ids: any integers (Python's, numpy's, a tokenizer's tensor's elements:
        whatever ``operator.index`` takes), kept as Python ints so that the request body is plain JSON.

        Bools, floats and anything else are refused with a ValueError naming them: ``True`` or ``2.0`` as a
        token id is a bug upstream (a mask, a logprob) that would otherwise sample from the wrong prompt."""
        ids: list[int] = []
        bad: list[Any] = []
        for t in tokens:
            i = _token_id(t)
            if i is None:
                bad.append(t)
            else:
                ids.append(i)
        if bad:
            raise ValueError(f"ModelInput.from_ints: token ids must be ints >= 0, got {bad[:5]!r}")
        return cls(tuple(ids))

    def to_ints(self) -> list[int]:
        return list(self.tokens)

    @property
    def length(self) -> int:
        return len(self.tokens)

    def __len__(self) -> int:
        return len(self.tokens)


def _token_id(t: Any) -> int | None:
    """``t`` as a token id (a Python int >= 0), or None when it is not one: an integer of any kind
    (``operator.index``), but never a bool (Python's, numpy's, or a bool tensor's element)."""
    if isinstance(t, bool) or str(getattr(t, "dtype", "")) in ("bool", "torch.bool") or getattr(t, "ndim", 0):
        return None     # a bool, or an array of one element (torch takes operator.index of any such tensor)
    try:
        i = operator.index(t)
    except TypeError:
        return None
    return i if i >= 0 else None


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. ``max_tokens`` None: the replica's default (16 on both engines). ``top_k`` -1 or 0: off.
    ``stop``: a string, strings (the completion ends where one appears), or token ids (it ends on one, kept in
    ``tokens``, as EOS is)."""

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: str | Sequence[str] | Sequence[int] | None = None
    seed: int | None = None

    def body(self) -> dict[str, Any]:
        """The request fields these are, as both engines (and vLLM's own server) take them."""
        out: dict[str, Any] = {"temperature": self.temperature, "top_p": self.top_p}
        if self.max_tokens is not None:
            out["max_tokens"] = self.max_tokens
        if self.top_k > 0:
            out["top_k"] = self.top_k
        if self.seed is not None:
            out["seed"] = self.seed
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or ())
        if stop and all(isinstance(s, str) for s in stop):
            out["stop"] = stop
        elif stop and all(type(s) is int for s in stop):
            out["stop_token_ids"] = stop
        elif stop:
            raise ValueError(f"SamplingParams.stop: strings or token ids, not both: {stop!r}")
        return out


@dataclass(frozen=True)
class SampledSequence:
    """One completion: its token ids, the policy's logprob of each (before temperature, top-k and top-p), and
    why it ended: ``stop`` (EOS, a stop string or a stop token) or ``length`` (``max_tokens``)."""

    tokens: list[int]
    logprobs: list[float]
    stop_reason: StopReason


@dataclass(frozen=True)
class SampleResponse:
    """The ``num_samples`` completions of one prompt, and the weights behind them.

    ``prompt_logprobs`` (asked for): per prompt token, its logprob given those before it (None for the first);
    ``topk_prompt_logprobs``: per prompt token, the k most likely (token id, logprob) there. ``policy_version``
    is the version that computed the last token, ``policy_versions`` every version the request ran on (its
    span: more than one when it crossed a hot-load); ``replica`` the URL that answered.

    ``prompt_logprobs_version`` (with prompt logprobs) is the version that computed ``prompt_logprobs``, which
    need not be ``policy_version``: a hot-load may land between the prompt's forward and the last token. The
    replica says it (``engine_data.prompt_logprobs_version``); from one too old to say it, it is the span's
    one version when the request ran on one. None when unknown: the replica serves an unknown version, or the
    request crossed a hot-load on an engine that cannot tell which version ran the prompt (vLLM)."""

    sequences: list[SampledSequence]
    prompt_logprobs: list[float | None] | None = None
    topk_prompt_logprobs: list[list[tuple[int, float]] | None] | None = None
    policy_version: int | None = None
    policy_versions: list[int | None] = field(default_factory=list)
    replica: str = ""
    replica_id: str | None = None
    prompt_logprobs_version: int | None = None


class PromptLogprobs(list):
    """:meth:`SamplingClient.compute_logprobs`' answer: the list of per-token logprobs a Tinker-style loop expects
    (None for the first token), which also says which weights computed them, as every answer does:
    ``policy_version`` (a prompt's logprobs come from one forward: the version of that forward, the response's
    ``prompt_logprobs_version``, not the version of the token sampled after it), ``policy_versions`` (the
    request's span) and ``replica`` (the URL that answered). A trainer comparing them with its own scores needs
    to know whose they are."""

    def __init__(self, values: Iterable[float | None], response: SampleResponse) -> None:
        super().__init__(values)
        self.policy_version = response.prompt_logprobs_version
        self.policy_versions = list(response.policy_versions)
        self.replica = response.replica


# --- reading a replica's answer ---------------------------------------------------------------------

def _number(x: Any) -> bool:
    return type(x) in (int, float) and not math.isnan(x)


class _Request:
    """One sampling request: its body, and what its answer must hold to be trusted."""

    def __init__(self, prompt: "ModelInput | Sequence[int]", num_samples: int, params: SamplingParams | None,
                 prompt_logprobs: int | None, min_policy_version: int | None) -> None:
        self.prompt = prompt.to_ints() if isinstance(prompt, ModelInput) else ModelInput.from_ints(prompt).to_ints()
        if not self.prompt:
            raise ValueError("the prompt is empty: give at least one token id")
        if type(num_samples) is not int or num_samples < 1:
            raise ValueError(f"num_samples must be an int >= 1, got {num_samples!r}")
        self.n, self.k, self.floor = num_samples, prompt_logprobs, min_policy_version
        self.body: dict[str, Any] = {"prompt": self.prompt, "n": num_samples, **(params or SamplingParams()).body(),
                                     "logprobs": 0, "return_token_ids": True, "return_engine_data": True}
        if prompt_logprobs is not None:
            self.body["prompt_logprobs"] = prompt_logprobs
        if min_policy_version is not None:
            self.body["min_policy_version"] = min_policy_version

    def _bad(self, url: str, what: str) -> ReplicaError:
        return ReplicaError(f"replica {url} answered POST {_PATH} with {what}: not a ckptdelta replica's sampling "
                            "answer (token ids come with return_token_ids, logprobs with logprobs=0)")

    def accept(self, tries: SampleTries, url: str, answer: dict[str, Any]) -> SampleResponse | None:
        """The response, once checked; None (try again) when it ran on a version below the floor; ReplicaError
        for an answer that is not what was asked for."""
        data = answer.get("engine_data")
        if not isinstance(data, dict) or not isinstance(data.get("policy_versions"), list):
            raise self._bad(url, "no engine_data.policy_versions")
        span = data["policy_versions"]
        if self.floor is not None and any(type(v) is not int or v < self.floor for v in span):
            return tries.again(f"{url} answered on policy versions {span}, needs >= {self.floor}")
        choices = answer.get("choices")
        if not isinstance(choices, list) or len(choices) != self.n or not all(isinstance(c, dict) for c in choices):
            raise self._bad(url, f"not {self.n} choices")
        choices = sorted(choices, key=lambda c: c.get("index") if type(c.get("index")) is int else -1)
        sequences = [self._sequence(url, i, c) for i, c in enumerate(choices)]
        prompt_ids = choices[0].get("prompt_token_ids", answer.get("prompt_token_ids"))
        if prompt_ids is not None and prompt_ids != self.prompt:
            raise ReplicaError(f"replica {url} ran another prompt than the {len(self.prompt)} token ids sent "
                               f"(it reports {str(prompt_ids)[:200]}): its answer is not this prompt's")
        plps, topk = self._prompt_logprobs(url, choices[0].get("prompt_logprobs", answer.get("prompt_logprobs")))
        version = data.get("policy_version")
        return SampleResponse(sequences=sequences, prompt_logprobs=plps, topk_prompt_logprobs=topk,
                              policy_version=version if type(version) is int else None, policy_versions=list(span),
                              replica=url, replica_id=data.get("replica_id"),
                              prompt_logprobs_version=self._prompt_version(data, span) if plps is not None else None)

    @staticmethod
    def _prompt_version(data: dict[str, Any], span: list[Any]) -> int | None:
        """The version that computed the prompt's logprobs: the replica's word for it, else (a replica too old
        to give it) the span's one version, when the request ran on one: then nothing else can have."""
        if "prompt_logprobs_version" in data:
            v = data["prompt_logprobs_version"]
        else:
            v = span[0] if len(span) == 1 else None
        return v if type(v) is int else None

    def scored(self, tries: SampleTries, url: str, answer: dict[str, Any]) -> "PromptLogprobs | None":
        """:meth:`accept` for :meth:`SamplingClient.compute_logprobs`: the prompt's logprobs with the version that
        computed them. An answer that cannot name that version although it crossed a hot-load (vLLM, whose
        prefill the replica does not see, or an older replica) is asked again: logprobs of unknown weights are
        of no use to a trainer comparing them with its own."""
        resp = self.accept(tries, url, answer)
        if resp is None:
            return None
        if resp.prompt_logprobs_version is None and len(resp.policy_versions) > 1:
            return tries.again(f"{url} scored the prompt across a hot-load (versions {resp.policy_versions}) "
                               "without saying which version computed it")
        return PromptLogprobs(resp.prompt_logprobs or [], resp)

    def _sequence(self, url: str, i: int, c: dict[str, Any]) -> SampledSequence:
        tokens = c.get("token_ids")
        if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
            raise self._bad(url, f"choice {i} without token_ids")
        lps = (c.get("logprobs") or {}).get("token_logprobs") if isinstance(c.get("logprobs"), dict) else None
        if not isinstance(lps, list) or len(lps) != len(tokens) or not all(_number(x) for x in lps):
            raise self._bad(url, f"choice {i} without one logprob per token ({len(tokens)} tokens)")
        reason = c.get("finish_reason")
        if reason not in ("length", "stop"):
            raise ReplicaError(f"replica {url}: choice {i} ended with finish_reason {reason!r}, neither 'length' "
                               "nor 'stop' (aborted: the replica stopping, or its engine failing?)")
        return SampledSequence(tokens=tokens, logprobs=[float(x) for x in lps], stop_reason=reason)

    def _prompt_logprobs(self, url: str, raw: Any) -> tuple[Any, Any]:
        if self.k is None:
            return None, None
        if not isinstance(raw, list) or len(raw) != len(self.prompt):
            raise self._bad(url, f"no prompt_logprobs for the {len(self.prompt)} prompt tokens")
        own: list[float | None] = []
        topk: list[list[tuple[int, float]] | None] = []
        for pos, (tok, entry) in enumerate(zip(self.prompt, raw)):
            if entry is None:
                own.append(None)
                topk.append(None)
                continue
            mine = entry.get(str(tok)) if isinstance(entry, dict) else None
            if not isinstance(mine, dict) or not _number(mine.get("logprob")):
                raise self._bad(url, f"no logprob for prompt token {tok} at position {pos}")
            own.append(float(mine["logprob"]))
            ranked = sorted(((int(t), float(e["logprob"]), e.get("rank")) for t, e in entry.items()
                             if t.isdigit() and isinstance(e, dict) and _number(e.get("logprob"))),
                            key=lambda x: -x[1])
            topk.append([(t, lp) for t, lp, _ in ranked[:self.k]] if self.k else [])
        return own, (topk if self.k else None)


# --- the client ---------------------------------------------------------------------------------

class SamplingClient:
    """Samples from one replica (a URL) or a fleet (URLs), at ``min_policy_version`` or newer when given.

    ``sample()`` blocks; ``sample_async()`` is for asyncio (``asyncio.gather`` over a group), on a pooled
    connection per event loop (``max_connections`` requests in flight at once; more wait for a connection).
    Other options go to :class:`ckptdelta.loader.client.RolloutClient`: ``api_key``, ``timeout`` (one request),
    ``backoff_base``, ``backoff_max``."""

    def __init__(self, replicas: str | Sequence[str], *, min_policy_version: int | None = None,
                 ready_timeout: float = 300.0, api_key: str | None = None, timeout: float = 60.0,
                 backoff_base: float = 0.1, backoff_max: float = 5.0, max_connections: int = 256,
                 sample_timeout: float | None = SAMPLE_TIMEOUT_S) -> None:
        urls = [replicas] if isinstance(replicas, str) else list(replicas)
        if min_policy_version is not None and (type(min_policy_version) is not int or min_policy_version < 0):
            raise ValueError(f"min_policy_version must be a version (an int >= 0) or None, got {min_policy_version!r}")
        self.min_policy_version = min_policy_version
        self._options = dict(api_key=api_key, timeout=timeout, ready_timeout=ready_timeout,
                             backoff_base=backoff_base, backoff_max=backoff_max, sample_timeout=sample_timeout)
        self._max_connections = max_connections
        self._sync = RolloutClient(urls, **self._options)
        # one client per event loop, and what closes it as its loop shuts down (_for_loop)
        self._async: dict[asyncio.AbstractEventLoop, tuple[AsyncRolloutClient, AsyncIterator[None]]] = {}
        self._lock = threading.Lock()

    @property
    def replicas(self) -> list[str]:
        return list(self._sync.replicas)

    @property
    def ready_timeout(self) -> float:
        return self._sync.ready_timeout

    def _request(self, prompt: "ModelInput | Sequence[int]", num_samples: int, params: SamplingParams | None,
                 include_prompt_logprobs: bool, topk_prompt_logprobs: int) -> _Request:
        k = max(0, int(topk_prompt_logprobs)) if (include_prompt_logprobs or topk_prompt_logprobs) else None
        return _Request(prompt, num_samples, params, k, self.min_policy_version)

    def sample(self, prompt: "ModelInput | Sequence[int]", num_samples: int = 1,
               sampling_params: SamplingParams | None = None, include_prompt_logprobs: bool = False,
               topk_prompt_logprobs: int = 0, *, affinity_key: str | None = None) -> SampleResponse:
        """``num_samples`` completions of ``prompt`` from one replica (the one ``affinity_key`` pins, else the
        next in turn). Raises PolicyVersionTimeoutError when no replica reached ``min_policy_version`` within
        ``ready_timeout``, ReplicaError for anything else a replica refused or answered wrongly."""
        req = self._request(prompt, num_samples, sampling_params, include_prompt_logprobs, topk_prompt_logprobs)
        return self._sync._post_sample(_PATH, req.body, req.floor, affinity_key, req.accept)

    async def sample_async(self, prompt: "ModelInput | Sequence[int]", num_samples: int = 1,
                           sampling_params: SamplingParams | None = None, include_prompt_logprobs: bool = False,
                           topk_prompt_logprobs: int = 0, *, affinity_key: str | None = None) -> SampleResponse:
        """:meth:`sample` for asyncio."""
        req = self._request(prompt, num_samples, sampling_params, include_prompt_logprobs, topk_prompt_logprobs)
        client = await self._for_loop()
        return await client._post_sample(_PATH, req.body, req.floor, affinity_key, req.accept)

    def compute_logprobs(self, prompt: "ModelInput | Sequence[int]", *,
                         affinity_key: str | None = None) -> PromptLogprobs:
        """Each token's logprob given those before it (None for the first), from one replica at the floor: on
        the reference engine, one forward of the whole sequence, so a trainer's
        :func:`ckptdelta.loader.hf_model.score_tokens` on the same bits gives these numbers exactly. A list, with
        the version that computed it (:class:`PromptLogprobs`; an answer that crossed a hot-load without naming
        that version is asked again)."""
        req = self._scoring(prompt)
        return self._sync._post_sample(_PATH, req.body, req.floor, affinity_key, req.scored)

    async def compute_logprobs_async(self, prompt: "ModelInput | Sequence[int]", *,
                                     affinity_key: str | None = None) -> PromptLogprobs:
        """:meth:`compute_logprobs` for asyncio."""
        req = self._scoring(prompt)
        client = await self._for_loop()
        return await client._post_sample(_PATH, req.body, req.floor, affinity_key, req.scored)

    def _scoring(self, prompt: "ModelInput | Sequence[int]") -> _Request:
        """The request that scores ``prompt``: its logprobs, and one greedy token (a request samples one)."""
        return self._request(prompt, 1, SamplingParams(max_tokens=1, temperature=0.0), True, 0)

    async def _for_loop(self) -> AsyncRolloutClient:
        """The pooled async client of the running event loop: an httpx.AsyncClient cannot outlive its loop, and
        a loop per ``asyncio.run`` (one per RL step) is how such loops are written.

        Its connections are closed as that loop shuts down: a started async generator holds the client, and the
        loop closes its live async generators before it closes (``shutdown_asyncgens``, which ``asyncio.run``
        runs), running the generator's ``finally`` while the loop still can. Otherwise each ``asyncio.run`` would
        leave a socket per connection it used open, until the descriptors ran out. A loop closed without that
        (``loop.close()`` alone) has its client let go here, at the next loop's first request."""
        loop = asyncio.get_running_loop()
        with self._lock:
            for gone in [lp for lp in self._async if lp.is_closed()]:
                del self._async[gone]
            held = self._async.get(loop)
            if held is not None:
                return held[0]
            client = AsyncRolloutClient(self._sync.replicas, **self._options, max_connections=self._max_connections)
            closer = _close_with_the_loop(client)
            self._async[loop] = (client, closer)     # the loop keeps its async generators by weak reference
        await closer.__anext__()
        return client

    async def aclose(self) -> None:
        """Close this event loop's connections (and, as :meth:`close`, the blocking client's)."""
        with self._lock:
            held = self._async.pop(asyncio.get_running_loop(), None)
        if held is not None:
            await held[1].aclose()
        self._sync.close()

    def close(self) -> None:
        """Close the blocking client's connections, and let go of every event loop's (:meth:`aclose` closes the
        running loop's; a loop already closed has its own let go at the next loop's first request anyway)."""
        self._sync.close()
        with self._lock:
            self._async.clear()

    def __enter__(self) -> "SamplingClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> "SamplingClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


async def _close_with_the_loop(client: AsyncRolloutClient) -> AsyncIterator[None]:
    """Started once, then parked: closed by its event loop's ``shutdown_asyncgens`` (or by ``aclose``), it closes
    ``client`` on that loop."""
    try:
        yield
    finally:
        await client.aclose()


def save_weights_and_get_sampling_client(publisher: Any, weights: Any, step: int, replicas: str | Sequence[str], *,
                                         hotload_timeout: float = 600.0, **client_options: Any) -> SamplingClient:
    """Publish ``weights`` (a model, a peft model's adapter, or a state dict: what ``Publisher.publish`` takes) as
    trainer step ``step``, hot-load every replica to that version, and return a :class:`SamplingClient` over them
    pinned to it (``min_policy_version``). Loops' and Tinker's method of the same name, for a trainer that owns
    its :class:`ckptdelta.publisher.Publisher`.

    The publish is waited for (committed before any replica is asked); the hot-load is
    :meth:`ckptdelta.loader.client.RolloutClient.hotload`: every replica on its own and at once, each given
    ``hotload_timeout``, a replica still starting waited for until ``ready_timeout``; unless every one is READY
    at the version it raises the project's error for what went wrong (HotLoadError, ReplicaError, ...), with
    ``.states`` (replica -> its row). ``client_options`` go to :class:`SamplingClient` (``ready_timeout``,
    ``api_key``, ...)."""
    version = publisher.publish(weights, step).version
    urls = [replicas] if isinstance(replicas, str) else list(replicas)
    fleet_options = {k: client_options[k] for k in ("api_key", "timeout", "ready_timeout") if k in client_options}
    with RolloutClient(urls, **fleet_options) as fleet:
        fleet.hotload(version, wait=True, timeout=hotload_timeout)
    return SamplingClient(urls, min_policy_version=version, **client_options)


__all__ = ["ModelInput", "SampleResponse", "SampledSequence", "SamplingClient", "SamplingParams",
           "save_weights_and_get_sampling_client"]
