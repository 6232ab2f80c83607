"""vLLM serving a LoRA run: the adapter hot-loaded into vLLM's LoRA slots in place, each request on one version.

``ckptdelta serve --engine vllm --bucket URL`` on a run of adapters (delta/lora_record.py)
lands here. vLLM starts on the base model (``--base-model DIR``, or the directory the
run records; its weights are hashed and checked against the run's record first,
loader/lora.py) with LoRA enabled and K adapter *slots* (``--lora-slots K``):
K adapters registered once, at start, from the snapshot's own PEFT directory
(``--lora-modules``), pinned in vLLM's LoRA caches, and from then on rewritten in
place, never re-read from a directory.

- **A hot-load** is prepared while vLLM serves, as for full runs: the adapter's
  host copy (shared memory, checkpoint names) is patched by the
  :class:`ckptdelta.loader.lora.LoraHotSwapper`. Then one request on a Unix socket
  to a thread every worker started at start-up (no ``/collective_rpc``, which
  vLLM runs only once its step in progress ends) has it prepare the new version
  through vLLM's own load transform, copy it into a slot no request runs on
  (rows no step reads), swap vLLM's registry entry for the slot (holding the
  lock each step holds while it activates its adapters, not during its forward
  pass), prove it, and answer on the socket
  (loader/engines/vllm/worker/lora_slots.py). That swap is the only time vLLM's
  steps wait, the *pause*; nothing is aborted or frozen, and vLLM is never
  paused. Only once the slot is proven do new requests go to it.
- **Every request runs on exactly one version.** At admission a request is
  pinned to the slot of the newest proven version (its ``model`` rewritten to
  the slot's name, a per-version ``cache_salt`` so no prefix cached by another
  version is reused); it keeps that slot until it is answered. A slot is
  rewritten only once no request holds it, so ``engine_data`` reports one version
  per request, never a span. With all K slots held by requests still running, a
  hot-load waits for one (``--request-timeout`` at most) and then fails, naming
  the slots.
- **Resident versions.** The K slots keep the last K versions; a hot-load to one of
  them (a step back, a rollback) writes nothing: the slot is proven again where it
  sits, then serves.
- **Warm at start.** vLLM builds its LoRA path on the first request that names an
  adapter (compiled, its graphs again: seconds, tens of seconds on a real model);
  one short request on every slot is answered before the replica says it serves
  (``lora_warm_s`` in /v1/status), so a user's first request does not pay it.
- **Trust.** A write or proof that fails leaves the slot out of service: the
  replica goes on serving the version it serves, and the hot-load fails.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import httpx

from ckptdelta.delta.lora_record import ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME, base_digest
from ckptdelta.delta.errors import HotLoadError, NotServableError

from ckptdelta.loader.spans import pinned
from ckptdelta.loader.engines.base import EngineApplier, ReplicaAPIError
from ckptdelta.loader.engines.shared_weights import SharedWeights
from ckptdelta.loader.engines.vllm.control import CONTROL_TIMEOUT_S, VllmControl, VllmError
from ckptdelta.loader.engines.vllm.dtype import lora_dtype_note
from ckptdelta.loader.engines.vllm.replica import REQUEST_TIMEOUT_S, Admission, VllmReplica
from ckptdelta.loader.engines.vllm.server import VllmServer
from ckptdelta.loader.engines.vllm.applier import snapshot_label

if TYPE_CHECKING:
    from ckptdelta.loader.reader import SnapshotReader

log = logging.getLogger("ckptdelta.engine.vllm")

#: The ranks vLLM's ``--max-lora-rank`` takes.
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
#: What each worker's answer to a write or proof says, kept in ``last`` (and /v1/status).
WORKER_FIELDS = ("index", "checked", "staged", "prepare_s", "prepare_parts", "layers_copied", "transform_s",
                 "lock_wait_s", "write_s", "prove_s", "held_s")
#: Slots by default: the serving version, the one being written, one for a request that outlives a step.
DEFAULT_SLOTS = 3
#: The longest path a Unix socket binds to on Linux (sun_path less its terminating NUL).
SOCKET_PATH_MAX = 107


@dataclass
class Slot:
    """One adapter vLLM holds: the name requests give it, vLLM's id for it, the version in it."""

    name: str
    id: int
    version: int | None = None
    ready: bool = False     # holds ``version``, proven
    refs: int = 0           # requests in flight on it
    seq: int = 0            # order in which slots became ready: the newest serves new requests


class SlotTable:
    """Which version each slot holds, which slot new requests go to, how many requests hold each."""

    def __init__(self, slots: Sequence[Slot]):
        self.slots = list(slots)
        self._cond = threading.Condition()
        self._seq = 0

    def newest(self) -> Slot | None:
        ready = [s for s in self.slots if s.ready]
        return max(ready, key=lambda s: s.seq) if ready else None

    def admit(self) -> Slot:
        """The slot of the newest proven version, held until :meth:`release`."""
        with self._cond:
            s = self.newest()
            if s is None:
                raise ReplicaAPIError(503, "engine_unavailable", "no LoRA slot of this replica holds a proven "
                                      "version")
            s.refs += 1
            return s

    def release(self, s: Slot) -> None:
        with self._cond:
            s.refs -= 1
            self._cond.notify_all()

    def claim(self, timeout: float) -> Slot:
        """A slot to write the next version into: not the newest, held by no request. Waits up to ``timeout``
        for requests on older versions to finish; the slot is out of service until :meth:`ready`."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                newest = self.newest()
                free = [s for s in self.slots if s is not newest and s.refs == 0]
                if free:
                    s = min(free, key=lambda s: (s.ready, s.seq))      # an empty slot first, else the oldest
                    s.ready, s.version = False, None
                    return s
                left = deadline - time.monotonic()
                if left <= 0:
                    held = ", ".join(f"{s.name} ({snapshot_label(s.version)}, {s.refs} requests)" for s in self.slots)
                    raise HotLoadError(f"every LoRA slot still runs requests ({held}) after {timeout:g} s: none "
                                       "can take the next version; give the replica more slots (--lora-slots)")
                self._cond.wait(left)

    def retire(self, s: Slot) -> None:
        """Out of service (its proof failed): rewritten before it serves again."""
        with self._cond:
            s.ready, s.version = False, None

    def holding(self, version: int) -> Slot | None:
        """A proven slot that holds ``version`` already (a version hot-loaded again while still resident)."""
        with self._cond:
            return next((s for s in self.slots if s.ready and s.version == version), None)

    def ready(self, s: Slot, version: int) -> None:
        with self._cond:
            self._seq += 1
            s.version, s.ready, s.seq = version, True, self._seq

    def view(self) -> list[dict[str, Any]]:
        with self._cond:
            newest = self.newest()
            return [{"name": s.name, "id": s.id, "version": s.version if s.ready else None, "serving": s is newest,
                     "in_flight": s.refs} for s in self.slots]


class LoraSlotApplier(EngineApplier):
    """Writes the host copy's adapter into a free slot of vLLM and proves it; the HotSwapper's applier."""

    def __init__(self, control: VllmControl, shared: SharedWeights, slots: SlotTable, *, reader: "SnapshotReader",
                 config: dict[str, Any], slot_timeout: float):
        self.control, self.shared, self.slots, self.reader = control, shared, slots, reader
        self.config, self.slot_timeout = config, slot_timeout
        self.epoch, self.swapping = 0, False       # what loader/engines/vllm/watch.py reads
        self.last: dict[str, Any] = {}
        self.sockets: list[str] | None = None      # each worker's write socket (listen()); None: RPC + answer files
        self._pause: Any = None

    @contextmanager
    def paused(self) -> Iterator[Any]:
        """No pause of vLLM at all: the slot write is one RPC vLLM runs between two steps (see the module
        docstring); the Pause yielded says how long that RPC held vLLM's engine loop."""
        from ckptdelta.loader.gate import Pause

        self._pause = Pause()
        self.swapping = True
        try:
            yield self._pause
        finally:
            self.swapping = False

    def digests(self, version: int) -> dict[str, str]:
        m = self.reader.manifest(version)
        return {n: m.tensors[n].xxh3 for n in self.shared.index}

    def apply(self, names: Sequence[str], version: int | None, positions: dict[str, Any] | None = None) -> None:
        newest = self.slots.newest()
        if version is None or (newest is not None and newest.version == version):
            return           # a rollback: the version the replica serves still sits, proven, in its own slot
        resident = self.slots.holding(version)
        slot = resident or self.slots.claim(self.slot_timeout)
        req = {"id": slot.id, "path": self.shared.path, "digests": self.digests(version), "config": self.config}
        try:
            if resident:
                # a version still resident is proven again where it sits (nothing written): one RPC, all of it
                # in vLLM's engine loop
                t0 = self._pause.started = time.perf_counter()
                answers = self.control.rpc("ckptdelta_lora_prove", req)
                self._pause.seconds = time.perf_counter() - t0
            else:
                self._pause.started, self._pause.seconds, answers = self._write(slot, version, req)
        except VllmError as e:
            if resident:
                self.slots.retire(slot)
            raise HotLoadError(f"{'proving' if resident else 'writing'} {snapshot_label(version)} in LoRA slot "
                               f"{slot.name}: {e}; the slot is out of service, the replica serves "
                               f"{snapshot_label(newest.version if newest else None)}") from None
        self.slots.ready(slot, version)
        self.epoch += 1
        self.last = {"slot": slot.name, "version": version, "pause_s": self._pause.seconds,
                     "written": resident is None,
                     "workers": [{k: a.get(k) for k in WORKER_FIELDS} for a in answers],
                     "proven": "full",
                     # what the replica's job log says proved it (loader/server.py): the slot's buffers read back
                     "verify": "full", "verified": True, "verified_tensors": sum(a.get("checked", 0) for a in answers)}
        log.info("LoRA slot %s holds %s (%s), proven in %d workers (%d buffers each); vLLM's loop held %.1f ms",
                 slot.name, snapshot_label(version), "resident" if resident else "written", len(answers),
                 answers[0].get("checked", 0), 1e3 * self._pause.seconds)

    def _write(self, slot: Slot, version: int, req: dict[str, Any]) -> tuple[float, float, list[dict[str, Any]]]:
        """Each worker prepares the version in a thread while vLLM generates, writes it into the slot (the copy
        beside vLLM's steps, the registry swap: vllm_lora_slots.write_locked), proves it, then answers: on its
        socket (:meth:`listen`), else in a file beside the host copy (``ckptdelta_lora_stage`` with ``answer``,
        one RPC, which returns at once; no second one waiting for vLLM's step in progress). Returns when the write began in the first worker, how long the
        longest held vLLM's steps, and every worker's answer."""
        if self.sockets is not None:
            answers = self._write_notified(req)
            failed = [f"vLLM worker {w} failed: {a.get('why')}" for w, a in enumerate(answers)
                      if a.get("state") != "ready"]
            if failed:
                raise VllmError("; ".join(failed))
            return min(a["write_t"] for a in answers), max(a["held_s"] for a in answers), answers
        token = f"lora-{slot.id}-{version}-{os.urandom(4).hex()}"
        answer = f"{self.shared.path}.{token}.{{rank}}.json"
        staged = self.control.rpc("ckptdelta_lora_stage", {**req, "token": token, "answer": answer})
        paths = [answer.replace("{rank}", str(rank)) for rank in range(len(staged))]
        try:
            answers = self._answers(paths, version)
        finally:
            for p in paths:
                for q in (p, p + ".tmp"):
                    try:
                        os.unlink(q)
                    except FileNotFoundError:
                        pass
        failed = [f"vLLM worker {w} failed: {a.get('why')}" for w, a in enumerate(answers)
                  if a.get("state") != "ready"]
        if failed:
            raise VllmError("; ".join(failed))
        return min(a["write_t"] for a in answers), max(a["held_s"] for a in answers), answers

    def listen(self, directory: str) -> bool:
        """Have every worker serve writes on a Unix socket in ``directory`` (the replica's own scratch, mode
        0700), from then on the write path: one request to each worker, which starts at once (a
        ``/collective_rpc`` is run by vLLM only once the step in progress ends), and each answer heard the moment
        it is written (no polling for a file). False, and the RPC path kept, where the path would be too long
        for a Unix socket."""
        path = os.path.join(directory, "lora-w{rank}.sock")
        if len(path) + 8 > SOCKET_PATH_MAX:
            log.info("LoRA writes through vLLM's RPC: the socket path %s would be too long", path)
            return False
        self.sockets = [a["path"] for a in self.control.rpc("ckptdelta_lora_listen", {"path": path})]
        return True

    def _write_notified(self, req: dict[str, Any]) -> list[dict[str, Any]]:
        """:meth:`_write` through the workers' sockets: the request sent to every worker, then each answer read.
        A worker that dies closes its socket, which ends the wait at once with an error naming it."""
        import socket

        body = (json.dumps(req) + "\n").encode()
        conns: list[socket.socket] = []
        try:
            for w, p in enumerate(self.sockets or ()):
                c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                conns.append(c)
                c.settimeout(CONTROL_TIMEOUT_S)
                try:
                    c.connect(p)
                    c.sendall(body)
                except OSError as e:
                    raise VllmError(f"vLLM worker {w}: its write socket {p} refused the request: {e}") from None
            out = []
            for w, c in enumerate(conns):
                try:
                    with c.makefile("rb") as f:
                        line = f.readline()
                except OSError as e:        # socket.timeout included
                    raise VllmError(f"vLLM worker {w}: no answer to the write ({e})") from None
                if not line:
                    raise VllmError(f"vLLM worker {w} closed its write socket without answering (vLLM at "
                                    f"{self.control.url} stopped?)")
                try:
                    a = json.loads(line)
                except ValueError as e:
                    raise VllmError(f"vLLM worker {w}: its answer is unreadable: {e}") from None
                if not isinstance(a, dict):
                    raise VllmError(f"vLLM worker {w}: its answer is not an object")
                out.append(a)
            return out
        finally:
            for c in conns:
                c.close()

    def _answers(self, paths: Sequence[str], version: int) -> list[dict[str, Any]]:
        """The workers' answer files, once all are there (polled every 2 ms; vLLM's health asked every second,
        so a vLLM that died is one clear error, not a wait of the control timeout)."""
        deadline = time.monotonic() + CONTROL_TIMEOUT_S
        health = time.monotonic() + 1.0
        while not all(os.path.exists(p) for p in paths):
            now = time.monotonic()
            if now > deadline:
                raise VllmError(f"writing {snapshot_label(version)} took more than {CONTROL_TIMEOUT_S:.0f}s")
            if now > health:
                health = now + 1.0
                try:
                    alive = self.control.http.get("/health").status_code == 200
                except httpx.HTTPError:
                    alive = False
                if not alive:
                    raise VllmError(f"vLLM at {self.control.url} stopped answering /health while writing "
                                    f"{snapshot_label(version)}")
            time.sleep(0.002)
        out = []
        for w, p in enumerate(paths):
            try:
                with open(p) as f:
                    a = json.load(f)
            except (OSError, ValueError) as e:
                raise VllmError(f"vLLM worker {w}: its answer {p} is unreadable: {e}") from None
            if not isinstance(a, dict):
                raise VllmError(f"vLLM worker {w}: its answer {p} is not an object")
            out.append(a)
        return out

    def _resume_engine(self) -> None:
        """A LoRA replica never pauses vLLM; one found paused (by someone else) is resumed by the watch."""
        self.control.resume()


class VllmLoraReplica(VllmReplica):
    """A :class:`VllmReplica` whose requests are pinned to LoRA slots (see the module docstring)."""

    def __init__(self, *, slots: SlotTable, lora_rank: int, warm_s: float | None = None, lora_dtype: str | None = None,
                 dtype_note: str | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        self.slots, self.lora_rank, self.warm_s = slots, lora_rank, warm_s
        self.lora_dtype = lora_dtype.removeprefix("torch.") if lora_dtype else None
        self.dtype_note = dtype_note

    def admit(self, body: dict[str, Any]) -> Admission:
        slot = self.slots.admit()
        version = slot.version
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.slots.release(slot)

        try:
            out = self.forward_body(body, version)
        except BaseException:
            release()
            raise
        out["model"] = slot.name            # the slot that holds the version this request runs on, to the end
        return Admission(out, pinned(version), release, model=self.model_name)

    def status(self) -> dict[str, Any]:
        return {**super().status(), "lora_rank": self.lora_rank, "lora_slots": self.slots.view(),
                "lora_warm_s": self.warm_s, "lora_dtype": self.lora_dtype, "lora_dtype_note": self.dtype_note}


def lora_args(slots: int, rank: int) -> list[str]:
    """vLLM's flags for K slots of adapters of rank ``rank``."""
    max_rank = next((r for r in LORA_RANKS if r >= rank), None)
    if max_rank is None:
        raise NotServableError(f"LoRA rank {rank} is above the largest vLLM serves ({LORA_RANKS[-1]})")
    return ["--enable-lora", "--max-loras", str(slots), "--max-cpu-loras", str(slots), "--max-lora-rank",
            str(max_rank)]


def register_slots(control: VllmControl, slots: SlotTable, adapter_dir: str, where: str) -> dict[str, Any]:
    """Each slot registered with vLLM from the snapshot's own PEFT directory (vLLM's ``load_lora_adapter``, the
    one directory read of the replica's life), then pinned in its LoRA caches; an adapter vLLM refuses (a layer
    its model has no LoRA for, a rank above its limit) is one line naming the snapshot. Returns the first
    worker's account of its LoRA manager (``lora_slots.describe``)."""
    for s in slots.slots:
        try:
            r = control.http.post("/v1/load_lora_adapter", json={"lora_name": s.name, "lora_path": adapter_dir})
        except httpx.HTTPError as e:
            raise VllmError(f"vLLM at {control.url}: POST /v1/load_lora_adapter failed: {e}") from e
        if r.status_code != 200:        # its answer is a JSON error; its success a line of text
            try:
                why = r.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                why = r.text[:500]
            raise NotServableError(f"{where}: vLLM refuses the adapter ({r.status_code}): {why}")
    ids = [s.id for s in slots.slots]
    answers = control.rpc("ckptdelta_lora_slots", {"pin": ids})
    for w, answer in enumerate(answers):
        if answer.get("registered") != ids:
            raise VllmError(f"vLLM worker {w} holds LoRA adapters {answer.get('registered')}, not the "
                            f"{len(ids)} slots registered at start ({ids})")
    return answers[0] if answers else {}


#: A warm-up request's prompt (token ids: no tokenizer needed) and its tokens: a prefill and a decode step.
WARM_PROMPT, WARM_TOKENS = [1, 2, 3, 4], 2


def warm_slots(control: VllmControl, slots: SlotTable) -> float:
    """One short request on every slot before the replica says it serves: vLLM builds its LoRA
    path on the first request that names an adapter (compiled, its graphs again with the LoRA inputs: seconds to
    tens of seconds, which a user's first request would otherwise wait for), so it is paid here, at start. The
    slots are proven already and no request is pinned yet; the answers are discarded. Returns the seconds."""
    from concurrent.futures import ThreadPoolExecutor

    def one(s: Slot) -> None:
        try:
            r = control.http.post("/v1/completions", json={"model": s.name, "prompt": WARM_PROMPT,
                                                            "max_tokens": WARM_TOKENS, "temperature": 0.0})
        except httpx.HTTPError as e:
            raise VllmError(f"vLLM at {control.url}: a warm-up request on LoRA slot {s.name} failed: {e}") from e
        if r.status_code != 200:
            raise VllmError(f"vLLM at {control.url}: a warm-up request on LoRA slot {s.name} answered "
                            f"{r.status_code}: {r.text[:300]}")

    t0 = time.perf_counter()
    one(slots.slots[0])                 # alone (a batch of one request), then the others together
    with ThreadPoolExecutor(len(slots.slots)) as pool:
        list(pool.map(one, slots.slots[1:]))
    seconds = time.perf_counter() - t0
    log.info("vLLM's LoRA path warmed with one request on each of %d slots in %.2fs", len(slots.slots), seconds)
    return seconds


def adapter_rank(config: dict[str, Any]) -> int:
    ranks = [config.get("r")] + list((config.get("rank_pattern") or {}).values())
    if not all(isinstance(r, int) and r > 0 for r in ranks):
        raise NotServableError(f"{ADAPTER_CONFIG_NAME}: rank {config.get('r')!r} is not a positive integer")
    return max(ranks)


def hash_base(base_dir: str) -> str:
    """base_digest() of the base as transformers loads it (the publisher hashed it so); the model is freed."""
    from ckptdelta.loader.hf_model import load_model

    base, _ = load_model(base_dir, device="cpu")
    try:
        return base_digest(base.state_dict().items())
    finally:
        del base


def build(*, bucket: str, snapshot: "str | int" = "latest", storage_options: dict[str, Any] | None = None,
          cache_dir: str | None = None, cache_policy: str = "recompute", model_name: str | None = None,
          attach: str | None = None, vllm_args: Sequence[str] = (), base_model: str | None = None,
          lora_slots: int = DEFAULT_SLOTS, vllm_api_key: str | None = None, vllm_log: str | None = None,
          request_timeout: float = REQUEST_TIMEOUT_S, control_timeout: float = CONTROL_TIMEOUT_S,
          on_failure: Any = None, **_: Any) -> VllmLoraReplica:
    """``ckptdelta serve --engine vllm`` on a LoRA run (the package's ``build`` sends it here)."""
    from safetensors.torch import load_file

    from ckptdelta.loader.lora import LoraHotSwapper, base_dir_for, check_base
    from ckptdelta.loader.reader import SnapshotReader
    from ckptdelta.delta.scratch import make as make_scratch
    from ckptdelta.loader.servable import check_model_dir

    if attach:
        raise NotServableError("--attach serves full-model runs; a LoRA replica starts its own vLLM on the base "
                               "(it registers its LoRA slots at start): drop --attach")
    if not isinstance(lora_slots, int) or lora_slots < 2:
        raise ValueError(f"--lora-slots {lora_slots!r}: at least 2 (one serving, one to write the next version)")
    reader = SnapshotReader(bucket, storage_options=storage_options, cache_dir=cache_dir)
    version = reader.resolve(snapshot)
    m = reader.manifest(version)
    where = f"{m.where()} at {bucket}"
    base_dir = base_dir_for(m.adapter, base_model, where)
    check_model_dir(base_dir)
    digest = hash_base(base_dir)
    check_base(m.adapter, digest, base_dir, where)
    name = model_name or reader.run_id
    if cache_dir:
        os.makedirs(cache_dir, exist_ok=True)
    scratch = make_scratch("vllm", cache_dir)
    server = shared = control = None
    try:
        priors: dict = {}     # each tensor's bits before its last change: the next deltas are coded against them
        adapter_dir = reader.materialize(version, os.path.join(scratch.path, "adapter"), priors=priors)
        with open(os.path.join(adapter_dir, ADAPTER_CONFIG_NAME)) as f:
            config = json.load(f)
        rank = adapter_rank(config)
        shared = SharedWeights.create(load_file(os.path.join(adapter_dir, ADAPTER_WEIGHTS_NAME)))
        slots = SlotTable([Slot(f"{name}@slot{j}", j + 1) for j in range(lora_slots)])
        server = VllmServer(base_dir, served_name=f"{name}@base", log_path=vllm_log,
                            args=[*lora_args(lora_slots, rank), *vllm_args],
                            env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
        server.wait_ready()
        control = VllmControl(server.url, api_key=vllm_api_key, timeout=control_timeout)
        control.rpc("ckptdelta_layout", {})
        lora_dtype = register_slots(control, slots, adapter_dir, where).get("lora_dtype")
        dtype_note = lora_dtype_note(m, lora_dtype)
        if dtype_note:
            log.warning("%s", dtype_note)
        applier = LoraSlotApplier(control, shared, slots, reader=reader, config=config, slot_timeout=request_timeout)
        applier.listen(scratch.path)
        t0 = time.perf_counter()
        for s in reversed(slots.slots):          # loaded by vLLM itself from the snapshot's directory: proven
            control.rpc("ckptdelta_lora_prove", {"id": s.id, "path": shared.path, "digests": applier.digests(version),
                                                 "config": config})
            slots.ready(s, version)              # slot 0 last: the newest, new requests go there
        log.info("vLLM serves LoRA run %s, %s, in %d slots on base %s (rank %d; proven in %.2fs)", reader.run_id,
                 snapshot_label(version), lora_slots, base_dir, rank, time.perf_counter() - t0)
        warm_s = warm_slots(control, slots)
        swapper = LoraHotSwapper(shared.tensors, reader, version=version, applier=applier, record=m.adapter,
                                 base_xxh3=digest, priors=priors)
        from ckptdelta.loader.engines.vllm.watch import EngineWatch

        watch = EngineWatch(server.url, applier=applier, proc=server.proc, api_key=vllm_api_key,
                            on_failure=on_failure).start()
        return VllmLoraReplica(slots=slots, lora_rank=rank, warm_s=warm_s, lora_dtype=lora_dtype,
                               dtype_note=dtype_note, url=server.url, served_name=name, swapper=swapper,
                               applier=applier, shared=shared, cache_policy=cache_policy, server=server,
                               model_dir=base_dir, owned_dir=scratch, request_timeout=request_timeout, watch=watch)
    except BaseException as e:
        if control is not None:
            control.close()
        if server is not None:
            server.stop(keep_log=isinstance(e, Exception))
        if shared is not None:
            shared.close()
        scratch.release()
        raise
