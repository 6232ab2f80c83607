"""TRL's ``rollout_func``: GRPO's groups sampled from ckptdelta replicas at the version just published.

With ``GRPOTrainer(..., rollout_func=FleetRollout(callback, replicas))`` the trainer
generates nothing itself: each rollout waits for the newest publish of the
:class:`ckptdelta.integrations.hf.PublishCallback` (raising its failure, if it
failed), hot-loads the fleet to that version, and samples every prompt from the
replicas with ``min_policy_version`` pinned to it, so no completion comes from an
older policy. Each completion reports the version it ran on (``policy_version``,
passed to reward functions as a keyword, as TRL passes a rollout's extra fields),
and :attr:`FleetRollout.history` keeps one record per rollout.

TRL's contract (trl 1.16, ``GRPOTrainer._generate``): the function gets this process's
prompts, each already repeated ``num_generations`` times in a row (TRL's sampler
repeats them) as text or as chat messages, and the trainer; it returns one
completion per prompt it got: ``prompt_ids``, ``completion_ids`` and ``logprobs``
(one per completion token), lists in the prompts' order; other keys go to the
reward functions. Each run of equal prompts is one request for that many samples,
so a GRPO group is sampled by one replica, at one version, in one batch.

Nothing of TRL is imported here (the trainer is handed in), nor of the replica
server: the clients need httpx alone.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from ckptdelta.delta.errors import RunMismatchError
from ckptdelta.loader.client import SAMPLE_TIMEOUT_S, RolloutClient
from ckptdelta.loader.sampling import ModelInput, SampleResponse, SamplingClient, SamplingParams

if TYPE_CHECKING:
    from ckptdelta.integrations.hf import PublishCallback

log = logging.getLogger("ckptdelta.integrations")


@dataclass(frozen=True)
class RolloutRecord:
    """One rollout: the trainer's step, the version it asked for (``min_policy_version``) and every version its
    completions ran on (each request's span; equal to ``version`` unless a newer one was hot-loaded meanwhile)."""

    step: int
    version: int
    policy_versions: tuple[int, ...]
    completions: int


class FleetRollout:
    """A TRL ``rollout_func`` over ckptdelta replicas (one URL or a fleet), fed by a :class:`PublishCallback`.

    The sampling follows the trainer's GRPOConfig: ``max_completion_length``, ``temperature``, ``top_p`` and
    ``top_k`` (a ``min_p``, a ``repetition_penalty`` other than 1 or ``generation_kwargs`` are refused: the
    replicas would sample another distribution than the one asked for). ``logprobs`` are the policy's own
    log-probabilities of the sampled tokens (before temperature, top-k and top-p), as TRL's trainer computes them
    at ``temperature=1.0``.

    The hot-load is :meth:`ckptdelta.loader.client.RolloutClient.hotload` (every replica READY at the version, or
    the project's error for what went wrong: HotLoadError, SnapshotNotFoundError, ReplicaError, ...), each given
    ``hotload_timeout``, after a look at every replica's status: one serving another run than the publisher's is
    a RunMismatchError; sampling waits up to ``ready_timeout`` for a replica at the version, then raises
    PolicyVersionTimeoutError; a completion gets ``sample_timeout`` to come back (SampleTimeoutError, not sent
    again). At world size > 1 only the main process hot-loads; the others sample with the same
    floor, which holds their requests (retried on 408) until the hot-load lands, for up to ``ready_timeout`` +
    ``hotload_timeout``: as long as the main process may take to hot-load (its wait for a starting replica, then
    the hot-load itself).

    A trainer given TRL ``tools`` or an ``environment_factory`` is refused (ValueError, :func:`check_trainer`):
    TRL generates what follows a tool call with its own model, not through this function."""

    def __init__(self, callback: "PublishCallback", replicas: str | Sequence[str], *, ready_timeout: float = 300.0,
                 hotload_timeout: float = 600.0, api_key: str | None = None, timeout: float = 60.0,
                 max_connections: int = 256, sample_timeout: float | None = SAMPLE_TIMEOUT_S) -> None:
        self.callback = callback
        self.replicas = [replicas] if isinstance(replicas, str) else list(replicas)
        if not self.replicas:
            raise ValueError("FleetRollout needs at least one replica URL")
        self.ready_timeout, self.hotload_timeout = ready_timeout, hotload_timeout
        self._client_options = dict(api_key=api_key, timeout=timeout, ready_timeout=ready_timeout,
                                    sample_timeout=sample_timeout)
        self._max_connections = max_connections
        self._loaded: int | None = None      # the version this process last hot-loaded the fleet to
        #: one record per rollout, in order
        self.history: list[RolloutRecord] = []

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list]:
        check_trainer(trainer)
        version = self.callback.published_version()
        main = getattr(trainer, "is_world_process_zero", lambda: True)()
        if main and version != self._loaded:
            with RolloutClient(self.replicas, **self._client_options) as fleet:
                self._check_run(fleet)
                fleet.hotload(version, wait=True, timeout=self.hotload_timeout)
            self._loaded = version
        params = sampling_params(trainer.args)
        ids = prompt_ids(prompts, trainer)
        groups = _runs(ids)
        # the other processes' floor waits for the main one's hot-load, as long as that may take
        wait = self.ready_timeout if main else self.ready_timeout + self.hotload_timeout
        responses = _run(self._sample(version, groups, params, wait))

        out: dict[str, list] = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "policy_version": []}
        spans: set[int] = set()
        for (group, n), resp in zip(groups, responses):
            for seq in resp.sequences:
                out["prompt_ids"].append(list(group))
                out["completion_ids"].append(list(seq.tokens))
                out["logprobs"].append(list(seq.logprobs))
                out["policy_version"].append(resp.policy_version)
            spans.update(v for v in resp.policy_versions if v is not None)
        step = int(getattr(getattr(trainer, "state", None), "global_step", 0) or 0)
        record = RolloutRecord(step, version, tuple(sorted(spans)), len(out["completion_ids"]))
        self.history.append(record)
        log.info("rollout at step %d: %d completions at policy version %s (asked for %d)", step,
                 record.completions, ", ".join(map(str, record.policy_versions)), version)
        return out

    def _check_run(self, fleet: RolloutClient) -> None:
        """Replicas hot-load versions by number from their own bucket: one serving another run would load that
        run's version and answer as if it were ours. A replica that answers with another run is refused here (one
        not up yet is left to the hot-load, which waits for it)."""
        run = getattr(self.callback.publisher, "run_id", None)
        other = {url: row.get("run_id") for url, row in fleet.status().items()
                 if run is not None and row.get("run_id") not in (None, run)}
        if other:
            raise RunMismatchError(f"the trainer publishes run {run} at {self.callback.publisher.url}, but "
                                   + ", ".join(f"replica {u} serves run {r}" for u, r in sorted(other.items()))
                                   + ": start the replicas on the trainer's bucket (ckptdelta serve --bucket URL)")

    async def _sample(self, version: int, groups: list[tuple[tuple[int, ...], int]], params: SamplingParams,
                      ready_timeout: float) -> list[SampleResponse]:
        client = SamplingClient(self.replicas, min_policy_version=version, max_connections=self._max_connections,
                                **{**self._client_options, "ready_timeout": ready_timeout})
        try:
            return list(await asyncio.gather(*(client.sample_async(ModelInput.from_ints(group), num_samples=n,
                                                                   sampling_params=params)
                                               for group, n in groups)))
        finally:
            await client.aclose()


def check_trainer(trainer: Any) -> None:
    """Refuse a trainer whose completions would not all come from the replicas (ValueError saying why).

    TRL's tool calling (``GRPOTrainer(tools=...)``, and ``environment_factory``, whose environments' methods are
    tools) runs after ``rollout_func`` returns: ``GRPOTrainer._generate`` hands the completions that call a tool
    to ``_tool_call_loop``, which runs the tools and generates the rest of each completion with
    ``_generate_single_turn``, the trainer's own model (or its vLLM), never the rollout_func (trl 1.16). Those
    segments would not come from the published version, and the ``logprobs`` and ``policy_version`` returned
    for them would be wrong, so they are refused before anything is sampled."""
    refused = []
    if getattr(trainer, "tools", None):
        names = ", ".join(getattr(t, "__name__", type(t).__name__) for t in trainer.tools)
        refused.append(f"tools ({names})")
    for attr in ("environment_factories", "environment_factory"):
        if getattr(trainer, attr, None) is not None:
            refused.append("environment_factory")
            break
    if refused:
        raise ValueError(f"FleetRollout: the trainer was given {' and '.join(refused)}; TRL continues a completion "
                         "after a tool call with its own generation (GRPOTrainer._tool_call_loop: the trainer's "
                         "local model or its vLLM), not with rollout_func, so what follows each tool call would "
                         "not come from the replicas, and its logprobs and policy_version would be wrong. Leave "
                         "tools and environment_factory unset with FleetRollout (docs/INTEGRATIONS.md, 'Tools')")


def sampling_params(args: Any) -> SamplingParams:
    """The replicas' sampling parameters for a GRPOConfig; ValueError for a setting the replicas cannot honour."""
    refused = []
    if getattr(args, "min_p", None):
        refused.append(f"min_p={args.min_p!r}")
    if getattr(args, "repetition_penalty", 1.0) not in (None, 1.0):
        refused.append(f"repetition_penalty={args.repetition_penalty!r}")
    if getattr(args, "generation_kwargs", None):
        refused.append(f"generation_kwargs={args.generation_kwargs!r}")
    if refused:
        raise ValueError(f"FleetRollout: the replicas sample with max_completion_length, temperature, top_p and "
                         f"top_k; {', '.join(refused)} would be ignored there (leave them at their defaults)")
    top_k = getattr(args, "top_k", None)
    return SamplingParams(max_tokens=getattr(args, "max_completion_length", None),
                          temperature=float(getattr(args, "temperature", 1.0)),
                          top_p=float(getattr(args, "top_p", 1.0)), top_k=int(top_k) if top_k else -1)


def prompt_ids(prompts: list[Any], trainer: Any) -> list[list[int]]:
    """Token ids of TRL's prompts, as TRL's own generation makes them: text through the trainer's processing
    class, chat messages through its chat template (with the trainer's tools and chat template arguments)."""
    tok = trainer.processing_class
    if all(isinstance(p, str) for p in prompts):
        return [list(ids) for ids in tok(text=prompts)["input_ids"]]
    if not all(isinstance(p, list) and all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in p)
               for p in prompts):
        raise ValueError("FleetRollout samples text prompts or chat messages with text content (no images)")
    out = tok.apply_chat_template(conversation=prompts, tools=getattr(trainer, "tools", None) or None,
                                  chat_template=getattr(trainer, "chat_template", None), add_generation_prompt=True,
                                  tokenize=True, return_dict=True, **(getattr(trainer, "chat_template_kwargs", None)
                                                                      or {}))
    return [list(ids) for ids in out["input_ids"]]


def _runs(ids: list[list[int]]) -> list[tuple[tuple[int, ...], int]]:
    """Runs of equal prompts in a row, as (prompt, how many): TRL's groups, or the part of one this process got."""
    out: list[tuple[tuple[int, ...], int]] = []
    for p in map(tuple, ids):
        if out and out[-1][0] == p:
            out[-1] = (p, out[-1][1] + 1)
        else:
            out.append((p, 1))
    return out


def _run(coro: Any) -> Any:
    """Run a coroutine to its end from synchronous code, also where this thread already runs an event loop (a
    notebook): there, in a thread of its own."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with ThreadPoolExecutor(1, thread_name_prefix="ckptdelta-rollout") as pool:
        return pool.submit(asyncio.run, coro).result()


__all__ = ["FleetRollout", "RolloutRecord", "check_trainer", "prompt_ids", "sampling_params"]
