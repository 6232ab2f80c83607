"""vLLM as a replica engine: its own OpenAI server samples, ckptdelta moves its weights.

``ckptdelta serve --engine vllm`` materializes the snapshot, starts vLLM's
OpenAI-compatible server on it (a child process on a Unix socket in a directory
only this user can enter, in dev mode,
with :class:`ckptdelta.loader.engines.vllm.worker.extension.CkptDeltaWorker` mixed into its workers)
and serves the replica API in front of it: sampling bodies go to vLLM as they
are (vLLM's own options — logprobs, prompt_logprobs, n, seed, token ids — work as
vLLM users know them), the replica adds auth, ``min_policy_version`` and
``engine_data``. A vLLM started another way attaches with ``--attach URL``
(``http://HOST:PORT``, or ``unix:PATH`` for one started with ``--uds PATH``;
docs/SERVING.md says which vLLM flags it needs).

The host copy. Deltas are defined on checkpoint tensors; vLLM keeps its own
layout (fused q/k/v and gate/up, re-packed CPU linears, padded vocabularies). So
the replica keeps the current weights once per host in checkpoint coordinates in
shared memory (:class:`ckptdelta.loader.engines.shared_weights.SharedWeights`), and a
:class:`ckptdelta.loader.hotswap.HotSwapper` prepares every update against it while vLLM
serves (fetch, decode, verify: nothing of it runs inside vLLM's engine loop).

The swap (:class:`VllmApplier`, inside the HotSwapper's commit):

1. the swapper patches the host copy in place (the changed elements only);
   vLLM computes with its own tensors, so it goes on serving;
2. still serving: every worker builds the changed modules (whole fused groups)
   beside the live ones from the host copy, in a thread of its own, through
   vLLM's own layerwise reload (its name mapping, fusing, TP slicing and CPU
   re-packing), and checks them by samples (loader/engines/vllm/worker/shadow.py);
3. ``POST /pause?mode=keep``: nothing is aborted, requests in flight freeze;
4. every worker swaps the shadow in (packed kernels moved over, plain tensors
   copied) or, without one, reloads the changed modules from the host copy
   through vLLM's ``reload_weights``; tensors a kernel reads as is get only
   their changed elements written; what the pause wrote and no shadow check
   covered is read back in checkpoint coordinates and compared with the host
   copy that was verified against the manifest;
5. ``POST /reset_prefix_cache`` (with ``reset_running_requests`` under the
   ``recompute`` cache policy: frozen requests recompute their KV on the new
   weights), ``POST /update_weight_version``, ``POST /resume``;
6. serving again: every changed tensor is read back in full and compared.

If 4 fails, the host copy is rolled back and pushed again, so vLLM serves
the previous version; generation resumes in every case.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import httpx
import torch

from ckptdelta.delta.errors import HotLoadError

from ckptdelta.loader import stopping
from ckptdelta.loader.spans import Span
from ckptdelta.loader.engines.base import ENGINE_TIMEOUT, EngineResult, ReplicaAPIError, ReplicaEngine, RequestKind
from ckptdelta.loader.engines.shared_weights import SharedWeights
from ckptdelta.loader.engines.vllm.applier import VllmApplier, snapshot_label, reload_groups
from ckptdelta.loader.engines.vllm.control import CONTROL_TIMEOUT_S, VllmControl, VllmError, http_client
from ckptdelta.loader.engines.vllm.server import VllmServer
from ckptdelta.loader.engines.vllm.prompt_versions import prompt_logprobs_versions

if TYPE_CHECKING:
    from ckptdelta.loader.hotswap import HotSwapper

log = logging.getLogger("ckptdelta.engine.vllm")
#: Seconds a forwarded sampling request may wait for vLLM's answer (``--request-timeout``): a vLLM that stops
#: answering (frozen, wedged) fails requests with 504 instead of holding them forever.
REQUEST_TIMEOUT_S = 600.0
_REPLICA_FIELDS = ("min_policy_version", "return_engine_data")


# --- the engine -----------------------------------------------------------------------------------

@dataclass
class Admission:
    """One request admitted to vLLM: ``body`` as it goes there and its span (loader/spans.py), open from now.
    ``release()`` once vLLM answered or the stream ended (or was dropped): the span ends there, and a LoRA
    replica frees the request's slot (``free``); ``versions()`` are the span's, from then on."""

    body: dict[str, Any]
    span: Span
    free: Any = lambda: None
    model: str | None = None       # the ``model`` answers give back, where vLLM knows it by another name

    def release(self) -> None:
        """Idempotent: a stream's end and its collection may both call it."""
        self.span.close()
        self.free()

    def versions(self) -> list[int | None]:
        """Every version served from the admission to the release (closed now if it was not yet)."""
        return self.span.close()


class VllmReplica(ReplicaEngine):
    """A vLLM server whose weights a HotSwapper over the host copy moves; requests are forwarded to it."""

    kind = "vllm"

    def __init__(self, *, url: str, served_name: str, swapper: "HotSwapper", applier: VllmApplier, shared: SharedWeights,
                 cache_policy: str, server: VllmServer | None = None, model_dir: str | None = None,
                 owned_dir: Any = None, request_timeout: float = REQUEST_TIMEOUT_S,
                 watch: Any = None):
        self.url, self.model_name, self.swapper, self.applier, self.shared = url, served_name, swapper, applier, shared
        self.cache_policy, self.server, self.model_dir, self._owned_dir = cache_policy, server, model_dir, owned_dir
        self.request_timeout = request_timeout
        self.watch = watch                                 # ckptdelta.loader.engines.vllm.watch.EngineWatch, or None
        self._clients: dict[int, httpx.AsyncClient] = {}  # one per event loop (an app may be served twice)
        self._closed = False
        self._close_lock = threading.Lock()

    def _http(self) -> httpx.AsyncClient:
        import asyncio

        key = id(asyncio.get_running_loop())
        client = self._clients.get(key)
        if client is None:
            client = self._clients[key] = http_client(
                self.url, asynchronous=True, timeout=httpx.Timeout(self.request_timeout, connect=10.0, pool=None),
                limits=httpx.Limits(max_connections=256, max_keepalive_connections=64))
        return client

    def admit(self, body: dict[str, Any]) -> "Admission":
        """A request starting now: its body as it goes to vLLM, and its span, open until it is released.

        vLLM's steps are not seen from here, so a request's span is every version served from before it goes to
        vLLM until its answer (or stream) ended: the version served now (the old one inside a pause: vLLM
        computes with it until its pause returns) and every version a swap set after it (set in the pause,
        before vLLM resumes). A request in flight across a swap runs on both (``recompute`` recomputes its KV on
        the new weights, ``keep`` goes on over the old KV), and may have sampled its last token just before a
        pause: the span is an upper bound, never short of a version that computed for it."""
        span = self.swapper.served.open()
        try:
            return Admission(self.forward_body(body, span.admitted), span)
        except BaseException:
            span.close()
            raise

    def forward_body(self, body: dict[str, Any], version: int | None) -> dict[str, Any]:
        """``body`` as it goes to vLLM, for a request that starts while ``version`` is served (503 when vLLM
        failed)."""
        failed = self.failure()
        if failed is not None:
            raise ReplicaAPIError(503, "engine_unavailable", f"the replica's vLLM failed: {failed}")
        body = dict(body)
        body["model"] = self.model_name  # the name vLLM serves under, whatever the client calls the replica
        # Prefix-cache entries never outlive the weights that computed them: a salt per version.
        salt = f"ckptdelta-v{version}"
        body["cache_salt"] = f"{body['cache_salt']}-{salt}" if isinstance(body.get("cache_salt"), str) else salt
        return body

    async def stream(self, kind: RequestKind, body: dict[str, Any]) -> Any:
        """vLLM's own event stream, forwarded (loader/engines/vllm/stream.py)."""
        from ckptdelta.loader.engines.vllm.stream import stream

        return await stream(self, kind, body)

    async def complete(self, kind: RequestKind, body: dict[str, Any]) -> EngineResult:
        t0 = time.perf_counter()
        admitted = self.admit(body)
        path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        try:
            r = await self._http().post(path, json=admitted.body)
        except httpx.TimeoutException as e:
            raise ReplicaAPIError(504, ENGINE_TIMEOUT, f"vLLM at {self.url} did not answer within the request "
                                  f"timeout ({self.request_timeout:g} s, --request-timeout): "
                                  f"{type(e).__name__}") from None
        except httpx.HTTPError as e:
            raise ReplicaAPIError(503, "engine_unavailable", f"vLLM at {self.url} did not answer: {e}") from None
        finally:
            admitted.release()
        try:
            out = r.json()
        except ValueError:
            out = {"error": {"type": "engine_error", "message": r.text[:2000]}}
        if r.status_code != 200:
            return EngineResult(r.status_code, out if isinstance(out, dict) else {"error": out})
        versions = admitted.versions()
        if admitted.model is not None and "model" in out:
            out["model"] = admitted.model        # the name the client knows, not vLLM's slot name
        usage = out.get("usage") or {}
        return EngineResult(200, out, policy_versions=versions, snapshot=snapshot_label(versions[-1]),
                            cache_policy=self.cache_policy,
                            recomputes=(len(versions) - 1) if self.cache_policy == "recompute" else 0,
                            stale_kv_steps=0, duration_s=time.perf_counter() - t0,
                            completion_tokens=int(usage.get("completion_tokens") or 0),
                            prompt_logprobs_versions=prompt_logprobs_versions(body, versions))

    def status(self) -> dict[str, Any]:
        return {"kind": self.kind, "url": self.url, "host_copy_bytes": self.shared.nbytes,
                "last_swap": self.applier.last, "model_dir": self.model_dir, "failure": self.failure()}

    def failure(self) -> str | None:
        if self.server is not None and self.server.proc.poll() is not None:
            return f"vLLM exited with code {self.server.proc.returncode}"
        return self.watch.failure() if self.watch is not None else None

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        if self.watch is not None:
            self.watch.stop()
        self.applier.control.close()
        if self.server is not None:
            self.server.stop()
        self.shared.close()
        if self._owned_dir is not None:
            self._owned_dir.release()      # the scratch model copy (ckptdelta.delta.scratch.Owned)


def _served_name(url: str, api_key: str | None) -> str:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with http_client(url, headers=headers, timeout=30.0) as c:
            r = c.get("/v1/models")
        return r.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
        raise VllmError(f"vLLM at {url}: GET /v1/models did not name the served model ({e})") from e


def _take_over(applier: VllmApplier, version: int, run_id: str, *, pushable: bool) -> None:
    """Before the replica claims ``version``: prove every live tensor of vLLM against the host copy (which holds
    that version, verified), and leave vLLM labelled, with no prefix of other weights cached, and generating.

    A vLLM found paused was left so by a replica killed in its pause: its bits may be half of one version and
    half of another, and its frozen requests hold KV of those. ``pushable`` (an attached vLLM): live weights
    that differ are replaced by the snapshot's, whole, inside a pause, then proven. A vLLM this replica just
    started on the snapshot's own files must match: a difference is a fault, reported."""
    control = applier.control
    t0 = time.perf_counter()
    paused = control.is_paused()
    if paused:
        log.warning("vLLM at %s is paused (a replica killed during its pause?): proving its weights before it "
                    "resumes", control.url)
    pushed = False
    try:
        n = applier.check() if applier.verify != "off" or paused else 0
    except HotLoadError as e:
        if not pushable:
            raise VllmError(f"vLLM at {control.url} does not serve {snapshot_label(version)} of run {run_id}: {e}; "
                            "start it on that snapshot's weights (ckptdelta materialize) or pick the snapshot it "
                            "serves") from None
        log.warning("vLLM at %s does not serve %s of run %s (%s): loading every tensor of it, in a pause",
                    control.url, snapshot_label(version), run_id, e)
        names = list(applier.shared.index)
        try:
            if not paused:
                control.pause()
                paused = True
            stopping.hold("takeover")
            control.rpc("ckptdelta_reload", {"path": applier.shared.path,
                                             "names": reload_groups(names, names, applier.packed)})
            n = applier.check(names)
        except (HotLoadError, VllmError) as e2:
            raise VllmError(f"vLLM at {control.url} does not serve {snapshot_label(version)} of run {run_id}, and "
                            f"loading it failed: {e2}") from None
        pushed = True
    if paused or pushed:
        if not control.reset_prefix_cache(running=True):
            raise VllmError(f"vLLM at {control.url} did not reset its prefix cache before serving "
                            f"{snapshot_label(version)}")
    control.set_version(version)
    if paused:
        applier._resume_engine()
    log.info("vLLM at %s serves %s of run %s: %d tensors match the snapshot's digests%s (%.2fs)", control.url,
             snapshot_label(version), run_id, n, " after loading it" if pushed else "", time.perf_counter() - t0)


def _load_dir(model_dir: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for f in sorted(os.listdir(model_dir)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(model_dir, f)))
    return out


def build(*, bucket: str | None = None, snapshot: str | int = "latest", storage_options: dict[str, Any] | None = None,
          cache_dir: str | None = None, cache_policy: str = "recompute", model_name: str | None = None,
          attach: str | None = None, vllm_args: Sequence[str] = (), verify: str = "sampled", apply_mode: str = "auto",
          vllm_api_key: str | None = None, vllm_log: str | None = None, request_timeout: float = REQUEST_TIMEOUT_S,
          control_timeout: float = CONTROL_TIMEOUT_S, on_failure: Any = None, **_: Any) -> VllmReplica:
    """``ckptdelta serve --engine vllm`` on a full-model run: vLLM on a snapshot, hot-loaded by ckptdelta.

    With ``attach``, vLLM already runs there (started with the worker extension and
    dev mode); before the replica serves, every live tensor is proven to be the
    snapshot's, or, where it is not (vLLM started on other weights, or left half
    swapped and paused by a replica killed in its pause), the snapshot is pushed
    in whole and proven. ``on_failure(why)`` is called once if vLLM dies or stops
    answering while serving (loader/engines/vllm/watch.py)."""
    from ckptdelta.loader.hotswap import HotSwapper
    from ckptdelta.loader.reader import SnapshotReader

    if bucket is None:
        raise ValueError("serve --engine vllm needs --bucket URL (the run whose snapshots it hot-loads)")
    if cache_policy not in ("recompute", "keep"):
        raise ValueError(f"cache_policy {cache_policy!r}: expected 'recompute' or 'keep'")
    reader = SnapshotReader(bucket, storage_options=storage_options, cache_dir=cache_dir)
    version = reader.resolve(snapshot)
    name = model_name or reader.run_id
    if cache_dir:
        os.makedirs(cache_dir, exist_ok=True)
    from ckptdelta.delta.scratch import make as make_scratch

    scratch = make_scratch("vllm", cache_dir)    # locked while we live; a dead replica's is swept by the next
    server = shared = control = None
    try:
        model_dir = reader.materialize(version, os.path.join(scratch.path, "model"))
        shared = SharedWeights.create(_load_dir(model_dir))
        if attach:
            url = attach.rstrip("/")
            name = _served_name(url, vllm_api_key)  # requests must name what vLLM serves
        else:
            from ckptdelta.loader.engines.vllm.dtype import dtype_args  # the snapshot's dtype, unless one given would cast it

            server = VllmServer(model_dir, served_name=name, args=dtype_args(vllm_args, reader.manifest(version)),
                                log_path=vllm_log)
            server.wait_ready()
            url = server.url
        control = VllmControl(url, api_key=vllm_api_key, timeout=control_timeout)
        layout = control.rpc("ckptdelta_layout", {})[0]
        applier = VllmApplier(control, shared, cache_policy=cache_policy, packed=layout.get("packed") or {},
                              verify=verify, patchable=layout.get("patchable") or (), apply_mode=apply_mode)
        # a stop signal inside would land anywhere, and a pause it began there (pushing into an attached vLLM)
        # would outlive the replica: it stops once the vLLM is proven and generating again
        with stopping.deferred(f"proving vLLM at {url}"):
            _take_over(applier, version, reader.run_id, pushable=bool(attach))
        swapper = HotSwapper(shared.tensors, reader, version=version, applier=applier)
        applier.current_version = lambda: swapper.version
        applier.on_unverified = lambda: setattr(swapper, "version", None)
        from ckptdelta.loader.engines.vllm.watch import EngineWatch

        watch = EngineWatch(url, applier=applier, proc=server.proc if server is not None else None,
                            api_key=vllm_api_key, on_failure=on_failure).start()
        return VllmReplica(url=url, served_name=name, swapper=swapper, applier=applier, shared=shared,
                           cache_policy=cache_policy, server=server, model_dir=model_dir, owned_dir=scratch,
                           request_timeout=request_timeout, watch=watch)
    except BaseException as e:
        if control is not None:
            control.close()
        if server is not None:
            server.stop(keep_log=isinstance(e, Exception))   # a failed start keeps vLLM's log; Ctrl-C, SIGTERM not
        if shared is not None:
            shared.close()
        scratch.release()
        raise
