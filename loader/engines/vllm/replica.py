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

import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import httpx
import torch

from ckptdelta.delta.errors import CkptDeltaError, HotLoadError

from ckptdelta.loader import stopping
from ckptdelta.loader.engines.vllm import shm as vllm_shm
from ckptdelta.loader.spans import Span
from ckptdelta.loader.engines.base import EngineApplier, EngineResult, ReplicaAPIError, ReplicaEngine, RequestKind
from ckptdelta.loader.engines.shared_weights import SharedWeights, write_positions
from ckptdelta.loader.engines.vllm.tp import sliced, uncovered

log = logging.getLogger("ckptdelta.engine.vllm")

WORKER_EXTENSION = "ckptdelta.loader.engines.vllm.worker.extension.CkptDeltaWorker"
#: Environment vLLM's dev endpoints and its CPU build need (set only where the user has not).
VLLM_ENV_DEFAULTS = {"VLLM_SERVER_DEV_MODE": "1", "HF_HUB_OFFLINE": "1", "VLLM_HOST_IP": "127.0.0.1",
                     "VLLM_CPU_KVCACHE_SPACE": "1"}
START_TIMEOUT_S = 600.0
#: Seconds between the log lines that say the replica is still waiting for vLLM to start.
WAIT_LOG_EVERY_S = 10.0
#: Seconds vLLM gets to exit after SIGTERM before its process group is killed.
STOP_TIMEOUT_S = 15.0
#: Input columns of each kernel-read matrix the in-pause check reads under --verify sampled (random each swap).
SAMPLED_COLUMNS = 16
VERIFY_MODES = ("sampled", "full", "off")
CONTROL_TIMEOUT_S = 300.0
#: Seconds a forwarded sampling request may wait for vLLM's answer (``--request-timeout``): a vLLM that stops
#: answering (frozen, wedged) fails requests with 504 instead of holding them forever.
REQUEST_TIMEOUT_S = 600.0
_REPLICA_FIELDS = ("min_policy_version", "return_engine_data")


class VllmError(CkptDeltaError, RuntimeError):
    """vLLM refused or failed a control call (start, pause, reload, digests, resume)."""


# --- the vLLM server --------------------------------------------------------------------------

def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the replica process dies, however it dies (Linux), so a killed
    replica never leaves a vLLM server holding the port, the cores and the KV cache."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


UNIX_PREFIX = "unix:"


def http_client(url: str, *, asynchronous: bool = False, **kw: Any) -> "httpx.Client | httpx.AsyncClient":
    """An HTTP client for vLLM at ``url``: ``http(s)://HOST:PORT`` or ``unix:PATH`` (its ``--uds``)."""
    if url.startswith(UNIX_PREFIX):
        path = url[len(UNIX_PREFIX):]
        transport = (httpx.AsyncHTTPTransport if asynchronous else httpx.HTTPTransport)(uds=path)
        kw.update(transport=transport, base_url="http://vllm")
    else:
        kw.update(base_url=url)
    return (httpx.AsyncClient if asynchronous else httpx.Client)(**kw)


class VllmServer:
    """vLLM's OpenAI server as a child process (its own process group, stopped with us).

    By default it listens on a Unix socket in a fresh directory only this user can enter, not on a TCP port:
    its dev-mode endpoints (collective_rpc, reload_weights) answer anyone who can connect, and a port picked
    while vLLM starts (seconds to minutes) can be taken by another process meanwhile, or be the port another
    replica's vLLM answers on. ``port`` serves TCP on 127.0.0.1 instead (vLLM started the way a user may)."""

    def __init__(self, model_dir: str, *, served_name: str, args: Sequence[str] = (), port: int | None = None,
                 log_path: str | None = None, env: dict[str, str] | None = None):
        environ = {**os.environ, **(env or {})}
        for k, v in VLLM_ENV_DEFAULTS.items():
            environ.setdefault(k, v)
        ranks = _tensor_parallel_size(args)
        if ranks > 1 and "VLLM_CPU_OMP_THREADS_BIND" not in environ and not torch.cuda.is_available():
            environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_thread_binding(ranks)
        from ckptdelta.delta.scratch import make as make_scratch

        self._dir = make_scratch("vllm-sock")    # mode 0700, locked while we live (delta/scratch.py)
        self._tmp: str | None = None
        if "TMPDIR" not in (env or {}):
            # vLLM's own temp files (its ZeroMQ sockets, torch.distributed's rendezvous file) were left in the
            # temp dir on every stop: they go in here, and go with it
            environ["TMPDIR"] = self._tmp = os.path.join(self._dir.path, "tmp")
            os.mkdir(environ["TMPDIR"], 0o700)
        # vLLM's CPU all-reduce shared memory, removed on stop: what is there before it starts is not its
        self._shm_before: set[str] | None = vllm_shm.segments()
        self._shm_idents: set[str] = set()
        if port is None:
            where = ["--uds", os.path.join(self._dir.path, "vllm.sock")]
            self.url = UNIX_PREFIX + where[1]
        else:
            where = ["--host", "127.0.0.1", "--port", str(port)]
            self.url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
               "--served-model-name", served_name, *where, "--worker-extension-cls", WORKER_EXTENSION, *args]
        self._log = self._own_log = None
        try:
            # a log of our own is locked like the socket's directory: a dead replica's is kept for a while
            self._own_log = None if log_path else make_scratch("vllm-log")
            self.log_path = log_path or self._own_log.path
            self._log = open(self.log_path, "ab")
            log.info("starting vLLM on %s (its log: %s)", model_dir, self.log_path)
            log.debug("vLLM's command: %s", " ".join(cmd))
            self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=environ,
                                         start_new_session=True, preexec_fn=_die_with_parent)
        except BaseException:
            if self._log is not None:
                self._log.close()
            if self._own_log is not None:
                self._own_log.release()
            self._dir.release()
            raise

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        """Until vLLM answers /health; says every ``WAIT_LOG_EVERY_S`` that it is still waiting, with vLLM's last
        log line (a start takes from seconds to minutes, and vLLM's own output goes to its log)."""
        t0 = time.monotonic()
        deadline, said = t0 + timeout, t0
        with http_client(self.url, timeout=5.0) as c:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise VllmError(f"vLLM exited with code {self.proc.returncode} while starting; its log is "
                                    f"{self.log_path}, its last lines:\n{self.tail()}")
                try:
                    if c.get("/health").status_code == 200:
                        log.info("vLLM is ready (%.0f s after it started)", time.monotonic() - t0)
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() - said >= WAIT_LOG_EVERY_S:
                    said = time.monotonic()
                    last = re.sub(r"^(\(\w+ pid=\d+\)\s*)?([A-Z]+ \d\d-\d\d [\d:]+\s*)?", "", self.tail(1).strip())
                    log.info("waiting for vLLM to start: %.0f s so far (log: %s; last line: %s)", said - t0,
                             self.log_path, last[-160:] or "none yet")
                time.sleep(0.5)
        self.stop(keep_log=True)
        raise VllmError(f"vLLM did not answer /health within {timeout:.0f} s; its log is {self.log_path}, its "
                        f"last lines:\n{self.tail()}")

    def tail(self, n: int = 30) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return b"\n".join(f.read().splitlines()[-n:]).decode("utf-8", "replace")
        except OSError:
            return "(no log)"

    def stop(self, timeout: float = STOP_TIMEOUT_S, *, keep_log: bool | None = None) -> None:
        """SIGTERM vLLM's process group, SIGKILL after ``timeout``; remove the socket's directory, and the log
        unless the user named it or it may tell why something failed: ``keep_log``, by default when vLLM had
        exited before it was asked to (a dead replica's logs are kept too: delta/scratch.py keeps the last
        few). Then whatever of the group still runs (vLLM's workers) is ended too, and the shared memory of vLLM's
        CPU all-reduce removed (loader/engines/vllm/shm.py). Idempotent."""
        crashed = self.proc.poll() is not None
        self._shm_idents |= vllm_shm.idents(self._tmp)    # before SIGTERM: a clean exit may remove the file
        if not crashed:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait()
        vllm_shm.end_group(self.proc.pid, timeout, term=crashed)
        if self._shm_before is not None:
            ours = self._shm_idents | vllm_shm.idents(self._tmp)
            vllm_shm.remove_leftovers(self._shm_before, own=ours or None)
            self._shm_before = None
        self._log.close()
        self._dir.release()                              # the socket's directory (and vLLM's TMPDIR in it)
        own = self._own_log
        if own is not None and own.fd >= 0:
            if crashed if keep_log is None else keep_log:
                log.warning("vLLM's log is kept: %s", self.log_path)
                own.disown()
            else:
                own.release()


def _tensor_parallel_size(args: Sequence[str]) -> int:
    for i, a in enumerate(args):
        for flag in ("--tensor-parallel-size", "-tp"):
            if a == flag and i + 1 < len(args) and args[i + 1].isdigit():
                return int(args[i + 1])
            if a.startswith(flag + "=") and a.split("=", 1)[1].isdigit():
                return int(a.split("=", 1)[1])
    return 1


def cpu_thread_binding(ranks: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``ranks`` CPU workers: the cores this process may use, dealt out in turn.
    vLLM's CPU build binds one rank per NUMA node by default and refuses to start tensor parallelism on a host
    with fewer nodes than ranks ("Not enough allowed NUMA nodes"); ``serve`` sets this unless the user did."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < ranks:
        raise VllmError(f"--tensor-parallel-size {ranks} on vLLM's CPU build needs {ranks} cores; this process "
                        f"may use {len(cpus)}")
    return "|".join(",".join(str(c) for c in cpus[i::ranks]) for i in range(ranks))


# --- control calls ------------------------------------------------------------------------------

class VllmControl:
    """vLLM's RL and dev endpoints (pause, resume, collective_rpc, prefix cache, weight version)."""

    def __init__(self, url: str, *, api_key: str | None = None, timeout: float = CONTROL_TIMEOUT_S):
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.url = url.rstrip("/")
        self.http = http_client(self.url, timeout=timeout, headers=headers)

    def _post(self, path: str, **kw: Any) -> Any:
        try:
            r = self.http.post(path, **kw)
        except httpx.HTTPError as e:
            raise VllmError(f"vLLM at {self.url}: POST {path} failed: {e}") from e
        if r.status_code != 200:
            raise VllmError(f"vLLM at {self.url}: POST {path} answered {r.status_code}: {r.text[:500]}")
        return r.json() if r.content else None

    def pause(self) -> None:
        self._post("/pause", params={"mode": "keep"})

    def resume(self) -> None:
        self._post("/resume")

    def is_paused(self) -> bool:
        try:
            r = self.http.get("/is_paused")
            return bool(r.json().get("is_paused")) if r.status_code == 200 else False
        except (httpx.HTTPError, ValueError, AttributeError) as e:
            raise VllmError(f"vLLM at {self.url}: GET /is_paused failed: {e}") from e

    def reset_prefix_cache(self, *, running: bool) -> bool:
        out = self._post("/reset_prefix_cache", params={"reset_running_requests": str(running).lower()})
        return bool(out and out.get("success"))

    def set_version(self, version: int | None) -> None:
        self._post("/update_weight_version", json={"new_version": str(version)})

    def rpc(self, method: str, spec: dict[str, Any]) -> list[Any]:
        """Call a worker method on every worker; one result per worker."""
        out = self._post("/collective_rpc", json={"method": method, "args": [json.dumps(spec)]})
        results = (out or {}).get("results")
        if not isinstance(results, list) or not results:
            raise VllmError(f"vLLM at {self.url}: {method} returned {str(out)[:200]!r}, not one result per worker")
        for w, r in enumerate(results):
            if not isinstance(r, dict):
                raise VllmError(f"vLLM at {self.url}: worker {w} answered {method} with {str(r)[:200]!r}")
            if "error" in r:
                raise VllmError(f"vLLM at {self.url}: worker {w} failed {method}: {r['error']}")
        return results

    def poll(self, method: str, token: str, what: str, timeout: float = CONTROL_TIMEOUT_S) -> list[dict[str, Any]]:
        """Every worker's answer about background job ``token`` once none is running (each poll is a short
        RPC; the work itself runs in the workers' threads, beside vLLM's steps). Polls every 5 ms at first,
        backing off to 50 ms: short jobs are seen done soon, long ones cost few calls."""
        deadline, wait = time.monotonic() + timeout, 0.005
        while True:
            answers = self.rpc(method, {"token": token})
            if all(a.get("state") != "running" for a in answers):
                return answers
            if time.monotonic() > deadline:
                raise VllmError(f"{what} ({token}) took more than {timeout:.0f}s")
            time.sleep(wait)
            wait = min(0.05, wait * 1.5)

    def close(self) -> None:
        self.http.close()


# --- fused groups ---------------------------------------------------------------------------------

def module_key(name: str, member_of: dict[str, str]) -> str:
    """The vLLM module a checkpoint tensor loads into (``...q_proj.weight`` -> ``...qkv_proj``; every expert
    tensor of a layer -> its ``...experts``); ``member_of`` maps a fused member's leaf to the fused leaf."""
    module = name.rpartition(".")[0]
    parent, _, leaf = module.rpartition(".")
    if ".experts." in module + ".":
        return module.split(".experts.")[0] + ".experts"
    leaf = member_of.get(leaf, leaf)
    return f"{parent}.{leaf}" if parent else leaf


def members_of(packed: dict[str, list[str]]) -> dict[str, str]:
    return {m: fused for fused, members in packed.items() for m in members}


def reload_groups(names: Sequence[str], all_names: Sequence[str], packed: dict[str, list[str]]) -> list[str]:
    """``names`` grown to whole vLLM modules: every checkpoint tensor that loads into a module one of them
    loads into (q/k/v -> qkv_proj, gate/up -> gate_up_proj, weight with bias, all experts of a layer).

    vLLM re-processes a module once all of its parameters arrived; a module fed
    only part of its inputs is processed with uninitialised rows."""
    member_of = members_of(packed)
    wanted = {module_key(n, member_of) for n in names}
    return [n for n in all_names if module_key(n, member_of) in wanted]


# --- the swap -------------------------------------------------------------------------------------

@dataclass
class _Shadow:
    """The next version's modules, built in every worker while serving (loader/engines/vllm/worker/shadow.py)."""

    token: str
    reload: tuple[str, ...] = ()   # of its tensors, those the pause still reloads (CPU MoE experts)
    facts: dict[str, Any] = field(default_factory=dict)


class VllmApplier(EngineApplier):
    """Pauses vLLM around a commit and pushes the changed tensors of the host copy into its workers."""

    def __init__(self, control: VllmControl, shared: SharedWeights, *, cache_policy: str, packed: dict[str, list[str]],
                 verify: str = "sampled", patchable: Sequence[str] = (), apply_mode: str = "auto"):
        if verify not in VERIFY_MODES:
            raise ValueError(f"verify {verify!r}: expected one of {VERIFY_MODES}")
        self.control, self.shared, self.cache_policy, self.packed, self.verify = (
            control, shared, cache_policy, packed, verify)
        # tensors whose runtime parameter a kernel reads as is: their changed elements are written in place
        self.patchable = set(patchable) if apply_mode == "auto" else set()
        # modules re-packed beside the live ones while serving (before the pause), swapped in during it
        self.shadows = apply_mode == "auto"
        self.epoch = 0                       # pauses begun (loader/engines/vllm/watch.py reads it)
        self.swapping = False
        self.last: dict[str, Any] = {}
        self.current_version: Any = lambda: None  # the swapper's version (set by build); labels vLLM after a swap
        self.on_unverified: Any = lambda: None    # called when live weights stay unproven (build: version -> None)
        self._to_confirm: list[str] = []
        self._pause: Any = None              # the commit's, while paused() runs
        self._unreached = self._applied = False

    @contextmanager
    def paused(self) -> Iterator[Any]:
        """The swapper's commit. vLLM computes with its own tensors, not the host copy, so it serves on while
        the swapper writes the host copy; :meth:`apply` stops it (keep mode) just before it touches a worker,
        and leaving this resumes it: the pause is the engine-side work alone."""
        from ckptdelta.loader.hotswap import Pause

        self._pause, self._unreached, self._applied = Pause(), False, False
        self._to_confirm: list[str] = []
        try:
            yield self._pause
        finally:
            if self._pause.started:
                self._resume()
        if self._to_confirm:
            self._confirm(self._to_confirm)

    def _stop(self) -> None:
        """Pause vLLM (once per commit): running steps end, requests in flight freeze, nothing is aborted."""
        if self._pause is None:
            raise HotLoadError("VllmApplier.apply called outside paused()")
        if self._pause.started:
            return
        t0 = self._pause.started = time.perf_counter()
        self.swapping = True
        self.epoch += 1
        try:
            self.control.pause()
        except VllmError:
            self._unreached = True    # nothing reached the workers: the host copy's rollback is all to undo
            raise
        self._pause.waited_s = time.perf_counter() - t0

    def _resume(self) -> None:
        """End the pause: drop the prefix cache, label the version, resume. vLLM is resumed whatever failed
        before. A failure makes the version unknown and the hot-load fail: the new bits are in, but KV the old
        ones computed may stay in frozen requests, or vLLM's label is wrong, so no version can be claimed; the
        next hot-load pushes and proves every tensor (:meth:`apply`)."""
        t0 = self._pause.started
        failed: list[str] = []
        stopping.hold("resume")
        try:
            try:
                ok = self.control.reset_prefix_cache(running=self.cache_policy == "recompute")
                if not ok:
                    log.warning("vLLM did not reset its prefix cache (blocks held by frozen requests under the "
                                "'keep' policy); per-version cache salts keep new requests off the old prefixes")
            except VllmError as e:
                failed.append(f"resetting its prefix cache: {e}")
                self.on_unverified()
            try:
                self.control.set_version(self.current_version())
            except VllmError as e:
                failed.append(f"labelling its weight version: {e}")
                self.on_unverified()
        finally:
            try:
                self._resume_engine()
            except VllmError as e:
                failed.append(f"resuming: {e}")
                self.on_unverified()
            self.swapping = False
            self._pause.seconds = time.perf_counter() - t0
        if failed:
            self._to_confirm = []
            raise HotLoadError(f"vLLM at {self.control.url} failed while ending the pause ({'; '.join(failed)}); "
                               "the replica's version is now unknown: the next hot-load pushes and proves every "
                               "tensor")

    def _resume_engine(self, tries: int = 3) -> None:
        """``/resume``, tried again on failure: a vLLM left paused freezes every request."""
        for i in range(tries):
            try:
                self.control.resume()
                return
            except VllmError as e:
                log.error("vLLM at %s did not resume (try %d of %d): %s", self.control.url, i + 1, tries, e)
                if i + 1 == tries:
                    raise
                time.sleep(0.2 * (i + 1))

    def _plan(self, names: Sequence[str], positions: dict[str, Any]) -> tuple[list[str], list[str]]:
        """(tensors to push as whole vLLM modules, tensors to patch element-wise in place)."""
        sparse = {n for n in names if n in self.patchable and positions.get(n) is not None}
        groups = reload_groups([n for n in names if n not in sparse], list(self.shared.index), self.packed)
        return groups, sorted(sparse - set(groups))   # a tensor reloaded with its module needs no patch

    def _build(self, groups: list[str], version: int | None) -> _Shadow | None:
        """While vLLM serves, the host copy already holding ``version``: have every worker build the modules
        of ``groups`` beside the live ones, re-packed, and check them by samples against the host copy. None
        when that fails (logged, never raised: the pause then reloads them; a shadow only saves pause time)."""
        t0 = time.perf_counter()
        token = f"{version}-{uuid.uuid4().hex[:12]}"
        member_of = members_of(self.packed)
        try:
            self.control.rpc("ckptdelta_stage", {
                "path": self.shared.path, "names": groups, "token": token, "columns": SAMPLED_COLUMNS,
                "modules": sorted({module_key(n, member_of) for n in groups})})
            answers = self._staged(token)
            why = sorted({str(a.get("why") or a.get("state")) for a in answers if a.get("state") != "ready"})
        except (VllmError, OSError, RuntimeError, ValueError) as e:
            why = [str(e)]
        if why:
            log.warning("vLLM: could not build %s beside the live weights (%s); the pause reloads them instead",
                        _snapshot(version), "; ".join(why))
            self._drop(token)
            return None
        facts = {"stage_s": time.perf_counter() - t0, "build_s": max(a.get("build_s", 0.0) for a in answers),
                 "check_s": max(a.get("check_s", 0.0) for a in answers), "modules": answers[0].get("modules")}
        log.info("vLLM: %s built beside the live weights: %d tensors in %s modules, %.2fs",
                 _snapshot(version), len(groups), facts["modules"], facts["stage_s"])
        return _Shadow(token, tuple(answers[0].get("deferred") or ()), facts)

    def _staged(self, token: str) -> list[dict[str, Any]]:
        return self._poll("ckptdelta_staged", token, "building the shadow")

    def _poll(self, method: str, token: str, what: str, timeout: float = CONTROL_TIMEOUT_S) -> list[dict[str, Any]]:
        return self.control.poll(method, token, what, timeout)

    def _drop(self, token: str) -> None:
        try:
            self.control.rpc("ckptdelta_unstage", {"token": token})
        except VllmError as e:
            log.debug("vLLM: dropping shadow %s: %s", token, e)

    def apply(self, names: Sequence[str], version: int | None, positions: dict[str, Any] | None = None) -> None:
        """Push ``names`` into every worker from the host copy, then prove them: the changed elements of
        tensors with an in-place target (loader/engines/vllm/worker/patch.py); the rest as whole modules, built and
        re-packed beside the live ones while vLLM still serves, then swapped in; else reloaded in the pause."""
        positions = positions or {}
        # The version is unknown (a failed swap or proof left vLLM's bits unproven): what vLLM holds may differ
        # from the host copy anywhere, whatever the update changed in it. Everything is pushed and proven.
        recovering = self.current_version() is None
        if recovering:
            names, positions = list(self.shared.index), {}
        groups, patch = self._plan(names, positions)
        again, self._applied = self._applied, True
        if again and (self._unreached or not self._pause.started):
            return                    # putting the old version back, but nothing reached the workers
        self._to_confirm = []
        # not once paused: putting the old version back after a failed swap reloads it in that pause
        shadow = self._build(groups, version) if (groups and self.shadows and not self._pause.started
                                                  and not recovering) else None
        swapped = False
        try:    # a shadow not swapped in is dropped however this ends (positions unwritable, the pause refused...)
            patch_req = None
            if patch:
                spans = write_positions(self.shared.positions_path, ((n, positions[n]) for n in patch))
                # the worker reads the written positions back at once (the rest of each tensor was not touched)
                patch_req = {"path": self.shared.path, "positions": self.shared.positions_path, "spans": spans,
                             "check": self.verify != "off"}
            self._stop()
            stopping.hold("pause")
            t_stopped = time.perf_counter()
            if shadow is not None:
                # one round trip: the shadow swapped in, then the in-place patches
                self.control.rpc("ckptdelta_swap", {"token": shadow.token, "patch": patch_req})
                swapped, patch_req = True, None
                if shadow.reload:
                    self.control.rpc("ckptdelta_reload", {"path": self.shared.path, "names": list(shadow.reload)})
            elif groups:
                self.control.rpc("ckptdelta_reload", {"path": self.shared.path, "names": groups})
        finally:
            if shadow is not None and not swapped:
                self._drop(shadow.token)
        if patch_req is not None:
            self.control.rpc("ckptdelta_patch", patch_req)
        t1 = time.perf_counter()
        touched = sorted(set(groups) | set(patch) | set(names))   # what was sent, and every tensor that changed
        # sampled here: every changed tensor but the patched ones (read back as written) and a swapped-in
        # shadow's (sampled before the pause)
        shadowed = set(groups) - set(shadow.reload) if shadow is not None else set()
        in_pause = sorted(set(touched) - set(patch) - shadowed)
        verified = 0
        stopping.hold("proof")
        full = self.verify == "full" or (recovering and self.verify != "off")
        if full:
            verified = self.check(touched)            # raises unless every digest matched
        elif self.verify == "sampled" and in_pause:
            verified = self.check_sampled(in_pause)   # raises at the first difference it sees
        # /v1/status's engine.last_swap: the replica's own word on the weights it pushed for ``version``
        mode = ("shadow+reload" if shadow.reload else "shadow") if swapped else "reload" if groups else "patch"
        self.last = {"version": version, "apply": mode, "reloaded_tensors": len(groups),
                     "patched_tensors": len(patch), "patched_elements": int(sum(len(positions[n]) for n in patch)),
                     "stop_s": self._pause.waited_s, "reload_s": t1 - t_stopped,
                     "verify_s": time.perf_counter() - t1, "verify": self.verify, "recovered": recovering,
                     "verified": full, "verified_tensors": verified if full else 0}
        if swapped:
            self.last["shadow"] = shadow.facts
        if self.verify == "sampled" and not full:
            self._to_confirm = touched

    def check_sampled(self, names: Sequence[str]) -> int:
        """The cheap proof for inside the pause: plain tensors bit for bit, ``SAMPLED_COLUMNS`` random input
        columns of every matrix read through a GEMM kernel; compared with the host copy in each worker."""
        for w, answer in enumerate(self.control.rpc("ckptdelta_check", {"path": self.shared.path, "names": list(names),
                                                                        "columns": SAMPLED_COLUMNS})):
            bad = answer.get("mismatch") or []
            if bad:
                raise HotLoadError(f"vLLM worker {w}: live weights differ from the snapshot for {len(bad)} "
                                   f"tensors ({', '.join(bad[:4])}{', ...' if len(bad) > 4 else ''})")
        return len(names)

    def _confirm(self, names: list[str]) -> None:
        """After resuming: the full proof of what the pause checked by samples. A difference the samples missed
        is pushed again (whole modules) and checked again; if it stays, the version becomes unknown."""
        t0 = time.perf_counter()
        try:
            self.last["verified_tensors"] = self.check(names, background=True)
        except (HotLoadError, VllmError) as first:
            log.critical("vLLM's live weights differ from the host copy after resuming (%s); reloading them in "
                         "a pause of their own", first)
            try:
                self.last["verified_tensors"] = self._repair(names)
            except (HotLoadError, VllmError) as second:
                self.on_unverified()
                self._label_unknown()
                self.last.update(verified=False, verify_after_s=time.perf_counter() - t0)
                raise HotLoadError(f"vLLM's live weights could not be proven after the swap ({second}); the "
                                   "replica's version is now unknown: the next hot-load pushes and proves every "
                                   "tensor") from second
        self.last.update(verified=True, verify_after_s=time.perf_counter() - t0)

    def _repair(self, names: list[str]) -> int:
        """Push ``names`` again as whole modules inside a pause, prove them in full there, and drop every
        prefix (running requests' included): whatever ran since resuming computed its KV with wrong bits, and
        it must not stay cached under this version's salt."""
        self.swapping = True
        self.epoch += 1
        try:
            self.control.pause()
            try:
                self.control.rpc("ckptdelta_reload", {"path": self.shared.path,
                                                      "names": reload_groups(names, list(self.shared.index),
                                                                             self.packed)})
                n = self.check(names)
                if not self.control.reset_prefix_cache(running=True):
                    raise VllmError(f"vLLM at {self.control.url} did not reset its prefix cache after the repair")
                return n
            finally:
                self._resume_engine()
        finally:
            self.swapping = False

    def _label_unknown(self) -> None:
        try:
            self.control.set_version(None)
        except VllmError as e:
            log.warning("vLLM at %s: could not label its weights unknown: %s", self.control.url, e)

    def check(self, names: Sequence[str] | None = None, *, background: bool = False) -> int:
        """Compare the live weights (read back in checkpoint coordinates by every worker) with the host copy.

        ``background``: read them back in the workers' threads, taking turns with vLLM's steps, instead of
        inside one RPC that holds vLLM's engine loop (for the proof after resuming, while serving)."""
        names = list(self.shared.index) if names is None else list(names)
        if background:
            token = f"digests-{uuid.uuid4().hex[:12]}"
            self.control.rpc("ckptdelta_digests_start", {"names": names, "token": token})
            answers = self._poll("ckptdelta_job", token, "reading the live weights back")
            failed = [a.get("why") or a.get("state") for a in answers if a.get("state") != "ready"]
            if failed:
                raise VllmError(f"vLLM at {self.control.url}: reading the live weights back failed: {failed[0]}")
        else:
            answers = self.control.rpc("ckptdelta_digests", {"names": names})
        # tensor parallelism: each worker hashed the slices it holds (loader/engines/vllm/tp.py); together
        # they must cover every element, and each is compared with the same slice of the host copy
        parts = [answer.get("slices") or {} for answer in answers]
        gaps = uncovered({n: tuple(self.shared.tensors[n].shape) for n in names}, parts)
        if gaps:
            raise HotLoadError(f"vLLM's {len(answers)} workers read back slices that do not cover {len(gaps)} "
                               f"tensors whole ({', '.join(gaps[:4])}{', ...' if len(gaps) > 4 else ''}): "
                               "their tensor-parallel layout is not one loader/engines/vllm/tp.py knows")
        for w, answer in enumerate(answers):
            got = answer.get("digests") or {}
            expected = expected_digests(self.shared, names, set(answer.get("kernel_view") or ()), parts[w])
            bad = sorted(n for n in names if got.get(n) != expected[n])
            if bad:
                raise HotLoadError(f"vLLM worker {w}: live weights differ from the snapshot for {len(bad)} "
                                   f"tensors ({', '.join(bad[:4])}{', ...' if len(bad) > 4 else ''})")
        return len(names)


def expected_digests(shared: SharedWeights, names: Sequence[str], kernel: set[str] = frozenset(),
                     slices: dict[str, Any] | None = None) -> dict[str, str]:
    """xxh3 of each host-copy tensor as the worker's read-back reports it: its bits, or for a tensor the worker
    read through a GEMM kernel, its :func:`ckptdelta.loader.engines.vllm.worker.readback.kernel_view`; under tensor parallelism,
    of the slice the worker holds (``slices``: name -> [dim, start, length], loader/engines/vllm/tp.py)."""
    from ckptdelta.loader.engines.vllm.worker.readback import digests, kernel_view

    held = sliced(shared.tensors, names, slices)
    return digests({n: kernel_view(held[n]) if n in kernel else held[n] for n in names})


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

    def __init__(self, *, url: str, served_name: str, swapper: Any, applier: VllmApplier, shared: SharedWeights,
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
            raise ReplicaAPIError(504, "engine_timeout", f"vLLM at {self.url} did not answer within the request "
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
        return EngineResult(200, out, policy_versions=versions, snapshot=_snapshot(versions[-1]),
                            cache_policy=self.cache_policy,
                            recomputes=(len(versions) - 1) if self.cache_policy == "recompute" else 0,
                            stale_kv_steps=0, duration_s=time.perf_counter() - t0,
                            completion_tokens=int(usage.get("completion_tokens") or 0))

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


def _snapshot(version: int | None) -> str | None:
    from ckptdelta.delta.manifest import snapshot_name

    return None if version is None else snapshot_name(version)


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
            raise VllmError(f"vLLM at {control.url} does not serve {_snapshot(version)} of run {run_id}: {e}; "
                            "start it on that snapshot's weights (ckptdelta materialize) or pick the snapshot it "
                            "serves") from None
        log.warning("vLLM at %s does not serve %s of run %s (%s): loading every tensor of it, in a pause",
                    control.url, _snapshot(version), run_id, e)
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
            raise VllmError(f"vLLM at {control.url} does not serve {_snapshot(version)} of run {run_id}, and "
                            f"loading it failed: {e2}") from None
        pushed = True
    if paused or pushed:
        if not control.reset_prefix_cache(running=True):
            raise VllmError(f"vLLM at {control.url} did not reset its prefix cache before serving "
                            f"{_snapshot(version)}")
    control.set_version(version)
    if paused:
        applier._resume_engine()
    log.info("vLLM at %s serves %s of run %s: %d tensors match the snapshot's digests%s (%.2fs)", control.url,
             _snapshot(version), run_id, n, " after loading it" if pushed else "", time.perf_counter() - t0)


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
    """``ckptdelta serve --engine vllm``: vLLM on a snapshot of the run, hot-loaded by ckptdelta.

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
    if reader.manifest(version).adapter is not None:       # a LoRA run: the adapter into vLLM's LoRA slots
        from ckptdelta.loader.engines.vllm import lora as vllm_lora

        return vllm_lora.build(bucket=bucket, snapshot=version, storage_options=storage_options, cache_dir=cache_dir,
                               cache_policy=cache_policy, model_name=model_name, attach=attach, vllm_args=vllm_args,
                               vllm_api_key=vllm_api_key, vllm_log=vllm_log, request_timeout=request_timeout,
                               control_timeout=control_timeout, on_failure=on_failure, **_)
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
