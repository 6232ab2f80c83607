"""What ckptdelta adds to each vLLM worker (``--worker-extension-cls ckptdelta.loader.engines.vllm.worker.extension.CkptDeltaWorker``).

The replica process holds the one host copy of the current weights, in checkpoint
coordinates, in a shared-memory file (loader/engines/shared_weights.py). During a
swap the replica calls these methods on every worker through vLLM's
``/collective_rpc``: they map the shared file (no copy per worker), hand the named
tensors to vLLM's own ``reload_weights`` (so names, fused qkv / gate_up groups,
tied embeddings and tensor-parallel slicing follow vLLM's loaders, and CPU
layers are re-packed), and read the live weights back in checkpoint coordinates
to prove they are the published bits. One exception: the routed experts of a
CPU MoE layer never go through ``reload_weights`` (vLLM 0.32 skips the CPU
prepack on a reload and copies unpacked weights into the packed storage);
loader/engines/vllm/worker/moe.py writes them with the layer's own loader, padding and
prepack op instead. Arguments travel as one JSON string:
vLLM's HTTP RPC passes strings only.

No method raises: an exception escaping a collective RPC takes vLLM's engine
core down with it, so errors come back as ``{"error": ...}`` and the replica
raises them on its side. Method names carry a ``ckptdelta_`` prefix so they can
never clash with the worker's own.
"""

from __future__ import annotations

import functools
import json
import os
import threading
import time
import traceback
from typing import Any, Callable

import torch


def _answer(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapped(self: Any, spec: str = "") -> Any:
        try:
            return fn(self, json.loads(spec) if spec else {})
        except Exception as e:  # noqa: BLE001 - see the module docstring
            return {"error": f"{type(e).__name__}: {e}", "where": fn.__name__,
                    "traceback": traceback.format_exc(limit=6)[-2000:]}
    return wrapped


class CkptDeltaWorker:
    """Mixed into vLLM's worker class; ``self`` is the worker (``self.model_runner`` is vLLM's)."""

    def _ckptdelta_model(self) -> torch.nn.Module:
        return self.model_runner.get_model()  # type: ignore[attr-defined]

    @_answer
    def ckptdelta_layout(self, req: dict) -> dict[str, Any]:
        """What the replica needs to group tensors into whole vLLM modules (fused q/k/v, gate/up, experts).
        Called once when the replica attaches: from then on vLLM's steps take turns with background jobs."""
        model = self._ckptdelta_model()
        from ckptdelta.loader.engines.vllm.worker.patch import targets
        from ckptdelta.loader.engines.vllm.worker.shadow import install_step_lock

        install_step_lock(self.model_runner)  # type: ignore[attr-defined]

        packed = getattr(model, "packed_modules_mapping", None) or {}
        return {"packed": {k: list(v) for k, v in dict(packed).items()}, "patchable": sorted(targets(model))}

    @_answer
    def ckptdelta_patch(self, req: dict) -> dict[str, Any]:
        """Write only the changed elements (positions file + shared weights) into parameters kernels read."""
        return self._ckptdelta_patch(req)

    def _ckptdelta_patch(self, req: dict) -> dict[str, Any]:
        from ckptdelta.loader.engines.shared_weights import open_positions, open_tensors
        from ckptdelta.loader.engines.vllm.worker.patch import patch

        t0 = time.perf_counter()
        spans = [tuple(x) for x in req["spans"]]
        shared = open_tensors(req["path"], [name for name, _, _ in spans])
        written = patch(self._ckptdelta_model(), shared, open_positions(req["positions"]), spans,
                        check=bool(req.get("check", True)))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return {"patched": len(written), "patch_s": time.perf_counter() - t0}

    @_answer
    def ckptdelta_reload(self, req: dict) -> dict[str, Any]:
        """Reload the named tensors from the shared weights file through vLLM's own loader."""
        from ckptdelta.loader.engines.shared_weights import open_tensors
        from ckptdelta.loader.engines.vllm.worker.moe import reload_cpu_experts, split_expert_tensors

        t0 = time.perf_counter()
        tensors = open_tensors(req["path"], req.get("names"))
        t1 = time.perf_counter()
        model = self._ckptdelta_model()
        rest, experts = split_expert_tensors(model, tensors)
        if rest:
            self.model_runner.reload_weights(  # type: ignore[attr-defined]
                weights_iterator=iter(rest.items()), is_checkpoint_format=True)
        direct = sum(reload_cpu_experts(model, path, named) for path, named in experts)
        _refresh_tied_head(model, tensors)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return {"tensors": len(tensors), "experts_direct": direct, "map_s": t1 - t0,
                "reload_s": time.perf_counter() - t1}

    @_answer
    def ckptdelta_reload_dir(self, req: dict) -> dict[str, Any]:
        """vLLM's own full reload from a checkpoint directory (``reload_weights(weights_path=dir)``): what a user
        without ckptdelta does after downloading a new checkpoint; benchmarks/vllm_hotload.py times it."""
        t0 = time.perf_counter()
        reload = getattr(self, "reload_weights", None) or self.model_runner.reload_weights  # type: ignore[attr-defined]
        reload(weights_path=req["path"], is_checkpoint_format=True)
        model = self._ckptdelta_model()
        _refresh_tied_head(model, {"model.embed_tokens.weight": None})  # every tensor was reloaded
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return {"reload_s": time.perf_counter() - t0}

    @_answer
    def ckptdelta_digests(self, req: dict) -> dict[str, Any]:
        """xxh3 digests of the live weights in checkpoint coordinates (all of them, or ``names``)."""
        return _digests(self._ckptdelta_model(), req.get("names"))

    @_answer
    def ckptdelta_check(self, req: dict) -> dict[str, Any]:
        """Compare the live weights with the host copy here, in the worker; ``columns``: k random input columns
        per kernel-read matrix instead of all (the cheap check inside a pause). Returns the names that differ."""
        return _compare(self._ckptdelta_model(), req["path"], req.get("names"), req.get("columns"))

    @_answer
    def ckptdelta_stage(self, req: dict) -> dict[str, Any]:
        """Start building the next version of the named tensors' modules beside the live ones
        (loader/engines/vllm/worker/shadow.py), from the host copy (which holds it already), in a thread of this
        worker: the RPC returns at once and the engine keeps generating. Poll with ``ckptdelta_staged``; its
        ``deferred`` names the tensors left to a reload inside the pause (CPU MoE experts)."""
        from ckptdelta.loader.engines.shared_weights import open_tensors
        from ckptdelta.loader.engines.vllm.worker.moe import split_expert_tensors
        from ckptdelta.loader.engines.vllm.worker.shadow import ShadowBuild, ShadowError, build_shadow

        old = getattr(self, "_ckptdelta_shadow", None)
        if old is not None and old.state == "running":
            return {"error": f"shadow {old.token} is still being built", "where": "ckptdelta_stage"}
        if old is not None:
            old.release()
        self._ckptdelta_shadow = None
        model = self._ckptdelta_model()
        path, names, modules, columns = req["path"], list(req["names"]), list(req["modules"]), req.get("columns")
        config = self.model_runner.vllm_config.model_config  # type: ignore[attr-defined]

        def work() -> Any:
            # routed experts of CPU MoE layers bypass vLLM's reload (vllm_moe.py): they stay for the pause
            tensors, experts = split_expert_tensors(model, open_tensors(path, names))
            if not tensors:
                raise ShadowError("only routed experts of CPU MoE layers changed; they are reloaded in the pause")
            # the replica names every experts set "<layer>.experts" (vllm.module_key): those left to the pause
            mine = [m for m in modules if not m.endswith(".experts") or any(n.startswith(m + ".") for n in tensors)]
            tree = build_shadow(model, config, tensors, mine, extra=_tied_head(model, tensors),
                                after_load=lambda root: _refresh_tied_head(root, tensors))
            tree.deferred = sorted(n for _, named in experts for n in named)
            return tree

        def check(tree: Any) -> dict[str, Any]:
            answer = _compare(tree.root, path, [n for n in names if n not in set(tree.deferred)], columns)
            if answer["mismatch"]:
                raise ShadowError(f"the shadow differs from the host copy for {answer['mismatch'][:4]}")
            return {"checked": answer["checked"], "sampled": answer["sampled"], "deferred": tree.deferred}

        self._ckptdelta_shadow = ShadowBuild(str(req["token"]), work, check)
        return {"token": self._ckptdelta_shadow.token, "state": "running"}

    @_answer
    def ckptdelta_digests_start(self, req: dict) -> dict[str, Any]:
        """:meth:`ckptdelta_digests` in a background thread (the proof after resuming, while vLLM serves):
        its kernel calls take turns with vLLM's steps. Poll with ``ckptdelta_job``."""
        from ckptdelta.loader.engines.vllm.worker.shadow import BackgroundJob

        jobs = self.__dict__.setdefault("_ckptdelta_jobs", {})
        for token in [t for t, j in jobs.items() if j.state != "running"]:
            del jobs[token]
        model, names = self._ckptdelta_model(), req.get("names")
        jobs[str(req["token"])] = BackgroundJob(str(req["token"]), lambda: _digests(model, names))
        return {"token": str(req["token"]), "state": "running"}

    @_answer
    def ckptdelta_job(self, req: dict) -> dict[str, Any]:
        """Where background job ``token`` stands (its result once ready). Never waits."""
        job = self.__dict__.get("_ckptdelta_jobs", {}).get(str(req.get("token")))
        if job is None:
            return {"token": req.get("token"), "state": "missing"}
        return job.answer()

    @_answer
    def ckptdelta_staged(self, req: dict) -> dict[str, Any]:
        """Where the shadow ``token`` stands: building, ready or failed (with why). Never waits."""
        shadow = getattr(self, "_ckptdelta_shadow", None)
        if shadow is None or shadow.token != str(req.get("token")):
            return {"token": req.get("token"), "state": "missing"}
        return shadow.answer()

    @_answer
    def ckptdelta_swap(self, req: dict) -> dict[str, Any]:
        """Inside the pause: the live modules take the ready shadow's tensors and packed kernels; then
        ``patch``, when given, as :meth:`ckptdelta_patch` (one RPC for the whole pause)."""
        from ckptdelta.loader.engines.vllm.worker.shadow import swap_in

        shadow = getattr(self, "_ckptdelta_shadow", None)
        if shadow is None or shadow.token != str(req.get("token")) or shadow.state != "ready":
            state = "missing" if shadow is None or shadow.token != str(req.get("token")) else shadow.state
            return {"error": f"shadow {req.get('token')} is {state}, not ready", "where": "ckptdelta_swap"}
        t0 = time.perf_counter()
        self._ckptdelta_shadow = None
        displaced: list[Any] = []
        try:
            n = swap_in(shadow.tree, displaced)
        finally:
            # the old version's packed weights are freed after the RPC returns, not inside the pause
            threading.Thread(target=_release, args=(shadow, displaced), name="ckptdelta-release",
                             daemon=True).start()
        out: dict[str, Any] = {"swapped_modules": n, "swap_s": time.perf_counter() - t0}
        if req.get("patch"):
            out.update(self._ckptdelta_patch(req["patch"]))
        elif torch.cuda.is_available():
            torch.cuda.synchronize()
        return out

    @_answer
    def ckptdelta_memory(self, req: dict) -> dict[str, Any]:
        """What this worker holds beyond the model: its RSS, vLLM reload records of modules that are not the
        live model's (shadows not released), shared files still mapped through the cache."""
        from ckptdelta.loader.engines.shared_weights import _opened
        from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

        live = {id(m) for m in self._ckptdelta_model().modules()}
        stray = sum(1 for m in list(LAYERWISE_INFO.keys()) if id(m) not in live)
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        return {"rss": rss, "stray_modules": stray, "mapped_files": len(_opened),
                "shadow": getattr(getattr(self, "_ckptdelta_shadow", None), "state", None)}

    @_answer
    def ckptdelta_unstage(self, req: dict) -> dict[str, Any]:
        """Drop a shadow that will not be swapped in (a failed or abandoned hot-load)."""
        shadow = getattr(self, "_ckptdelta_shadow", None)
        if shadow is not None and shadow.state != "running":
            self._ckptdelta_shadow = None
            shadow.release()
        return {"dropped": shadow is not None and shadow.state != "running"}

    @_answer
    def ckptdelta_lora_slots(self, req: dict) -> dict[str, Any]:
        """The LoRA adapters this worker holds and their slot indices (loader/engines/vllm/worker/lora_slots.py);
        ``pin``: ids to pin in vLLM's LoRA caches first."""
        from ckptdelta.loader.engines.vllm.worker import lora_slots as slots

        if req.get("pin"):
            slots.pin(self, [int(i) for i in req["pin"]])
        return slots.describe(self)

    @_answer
    def ckptdelta_lora_listen(self, req: dict) -> dict[str, Any]:
        """Serve hot-load writes on a Unix socket at ``path`` (``{rank}`` replaced) from a thread of this worker
        (``vllm_lora_slots.listen``): the replica's write path, with no RPC waiting for vLLM's step in progress."""
        from ckptdelta.loader.engines.vllm.worker import lora_slots as slots

        return {"path": slots.listen(self, str(req["path"]).replace("{rank}", str(_tp_rank()[0])))}

    @_answer
    def ckptdelta_lora_stage(self, req: dict) -> dict[str, Any]:
        """Start preparing the adapter in the host copy at ``path`` for registered adapter ``id`` in a thread
        (``vllm_lora_slots.prepare``: verify, transform, pack, the proof's reference) and return at once; poll
        with ``ckptdelta_lora_staged``, then ``ckptdelta_lora_write`` with the same ``token``.

        With ``answer`` (a file path with ``{rank}`` in it), the thread also writes the slot itself between two
        steps and proves it (``vllm_lora_slots.write_locked``), then leaves its answer, or ``{"state": "failed",
        "why": ...}``, in that file (its tensor-parallel rank put in): the replica reads it there, without
        another RPC waiting for vLLM's step in progress."""
        from ckptdelta.delta.omp import serial_here
        from ckptdelta.loader.engines.vllm.worker import lora_slots as slots
        from ckptdelta.loader.engines.vllm.worker.shadow import BackgroundJob

        lora_id, path, digests, config = int(req["id"]), req["path"], dict(req["digests"]), dict(req["config"])
        answer = req.get("answer")
        if answer is not None and "{rank}" not in str(answer):
            raise ValueError(f"answer path {answer!r} has no {{rank}}: every worker would write one file")
        holder: dict[str, Any] = {}

        def run() -> dict[str, Any]:
            try:
                serial_here()                     # this thread's torch ops on this thread alone (delta/omp.py)
                holder["prepared"] = p = slots.prepare(self, lora_id, path, digests, config)
                out = {"prepare_s": p.seconds, "index": p.index}
                if answer is not None:
                    out = slots.write_locked(self, lora_id, config, p)
                    _leave(str(answer), {"state": "ready", **out})
                return out
            except Exception as e:
                if answer is not None:
                    _leave(str(answer), {"state": "failed", "why": f"{type(e).__name__}: {e}"})
                raise

        job = BackgroundJob(str(req["token"]), run)
        job.prepared = holder                     # type: ignore[attr-defined]
        self._ckptdelta_lora_job = job
        return {"token": job.token, "state": "running"}

    @_answer
    def ckptdelta_lora_staged(self, req: dict) -> dict[str, Any]:
        """Where the LoRA preparation ``token`` stands: running, ready or failed (with why). Never waits."""
        job = getattr(self, "_ckptdelta_lora_job", None)
        if job is None or job.token != str(req.get("token")):
            return {"token": req.get("token"), "state": "missing"}
        return job.answer()

    @_answer
    def ckptdelta_lora_write(self, req: dict) -> dict[str, Any]:
        """Write the adapter in the host copy at ``path`` into registered adapter ``id`` in place, through vLLM's
        own load transform, and prove the slot (``digests``: the manifest's, name -> xxh3). With the ``token``
        of a ready ``ckptdelta_lora_stage``, only the copy into the slot and the comparison run here; without
        one (or if that preparation is gone or still running) everything runs inside this call. The replica
        writes through ``ckptdelta_lora_stage`` with ``answer`` instead; this call is the in-loop path."""
        from ckptdelta.loader.engines.vllm.worker import lora_slots as slots

        job = getattr(self, "_ckptdelta_lora_job", None)
        prepared = None
        if job is not None and "token" in req and job.token == str(req["token"]):
            self._ckptdelta_lora_job = None
            if job.state == "failed":
                raise slots.SlotError(job.error)
            if job.state == "ready":
                prepared = job.prepared.get("prepared")
        return slots.write(self, int(req["id"]), req["path"], dict(req["digests"]), dict(req["config"]),
                           prepared=prepared)

    @_answer
    def ckptdelta_lora_prove(self, req: dict) -> dict[str, Any]:
        """Prove registered adapter ``id`` holds the adapter in the host copy at ``path``, without writing."""
        from ckptdelta.loader.engines.vllm.worker import lora_slots as slots

        return slots.prove(self, int(req["id"]), req["path"], dict(req["digests"]), dict(req["config"]))

    @_answer
    def ckptdelta_lora_digests(self, req: dict) -> dict[str, Any]:
        """xxh3 of each LoRA buffer at adapter ``id``'s slot: what two vLLMs hold, compared (tests)."""
        from ckptdelta.loader.engines.vllm.worker import lora_slots as slots

        return {"digests": slots.slot_digests(self, int(req["id"]))}

    @_answer
    def ckptdelta_lora_load_dir(self, req: dict) -> dict[str, Any]:
        """vLLM's own in-place load of the PEFT directory ``path`` as adapter ``name`` / ``id``: the worker half
        of ``/v1/load_lora_adapter`` with ``load_inplace`` (what the engine core runs for ``add_lora``: the LRU
        manager's ``add_adapter``). benchmarks/lora.py times it here, in the worker, to compare how long it
        holds vLLM's engine loop with ckptdelta's slot write (whose times the workers report)."""
        from vllm.lora.request import LoRARequest

        from ckptdelta.loader.engines.vllm.worker import lora_slots as slots
        from ckptdelta.loader.engines.vllm.worker.shadow import KERNEL_LOCK

        t0 = time.perf_counter()
        with KERNEL_LOCK, slots.REGISTRY_LOCK:     # as the runner's own add_lora (lora_slots.install_lora_lock)
            self.model_runner.lora_manager.add_adapter(  # type: ignore[attr-defined]
                LoRARequest(lora_name=str(req["name"]), lora_int_id=int(req["id"]), lora_path=str(req["path"]),
                            load_inplace=True))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return {"id": int(req["id"]), "load_s": time.perf_counter() - t0}

    @_answer
    def ckptdelta_read(self, req: dict) -> dict[str, Any]:
        """The live weights in checkpoint coordinates, written to ``path`` as safetensors (tests, verify).

        Under tensor parallelism each rank writes what it holds to ``path`` with ``{rank}`` replaced by its
        tensor-parallel rank (a path without it is refused there) and says which slice of each tensor that is."""
        from safetensors.torch import save_file

        from ckptdelta.loader.engines.vllm.worker.readback import checkpoint_tensors

        rank, size = _tp_rank()
        path = str(req["path"])
        if size > 1 and "{rank}" not in path:
            raise ValueError(f"{size} tensor-parallel ranks would write one file: put {{rank}} in the path")
        kernel: set[str] = set()
        slices: dict[str, Any] = {}
        tensors = checkpoint_tensors(self._ckptdelta_model(), req.get("names"), strict=req.get("strict", True),
                                     kernel_read=kernel, slices=slices)
        save_file({k: v.contiguous() for k, v in tensors.items()}, path.replace("{rank}", str(rank)))
        return {"tensors": len(tensors), "kernel_view": sorted(kernel), "rank": rank,
                "slices": {n: s.to_json() for n, s in slices.items()}}


def _leave(path: str, answer: dict[str, Any]) -> None:
    """A background job's answer in a file for the replica (``{rank}`` replaced), whole or not at all."""
    path = path.replace("{rank}", str(_tp_rank()[0]))
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(answer, f)
    os.replace(tmp, path)


def _tp_rank() -> tuple[int, int]:
    """This worker's tensor-parallel rank and the group's size."""
    from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size

    return int(get_tensor_model_parallel_rank()), int(get_tensor_model_parallel_world_size())


def _release(shadow: Any, displaced: list[Any]) -> None:
    time.sleep(0.05)      # let the RPC that swapped answer first
    shadow.release()
    displaced.clear()


def _digests(model: torch.nn.Module, names: list[str] | None) -> dict[str, Any]:
    from ckptdelta.loader.engines.vllm.worker.readback import checkpoint_tensors
    from ckptdelta.loader.engines.vllm.proof import digests, kernel_view

    # Tensors read through a GEMM kernel are compared as the kernel sees them (proof.kernel_view).
    # Under tensor parallelism each digest is of the slice this rank holds, and ``slices`` says which: the
    # replica hashes the same slice of the host copy (loader/engines/vllm/tp.py).
    kernel: set[str] = set()
    slices: dict[str, Any] = {}
    tensors = checkpoint_tensors(model, names, strict=False, kernel_read=kernel, slices=slices)
    for n in kernel:
        tensors[n] = kernel_view(tensors[n])
    return {"digests": digests(tensors), "kernel_view": sorted(kernel),
            "slices": {n: s.to_json() for n, s in slices.items()}}


def _compare(model: torch.nn.Module, path: str, names: list[str] | None, columns: int | None) -> dict[str, Any]:
    """Read ``names`` back from ``model`` (the live model or a shadow of it) and compare their bits with the
    shared file at ``path``; ``columns``: that many random input columns per kernel-read matrix."""
    from ckptdelta.loader.engines.shared_weights import open_tensors
    from ckptdelta.loader.engines.vllm.worker.readback import checkpoint_tensors

    kernel: set[str] = set()
    cols: dict[str, torch.Tensor] = {}
    slices: dict[str, Any] = {}
    live = checkpoint_tensors(model, names, strict=False, kernel_read=kernel, sample_columns=columns, columns=cols,
                              slices=slices)
    host = open_tensors(path, list(live))
    bad = []
    for n, got in live.items():
        want = host[n] if n not in slices else slices[n].of(host[n])   # the part this tensor-parallel rank holds
        if n in kernel:
            want, got = _kernel_views(want, got, cols.get(n))
        if want.dtype != got.dtype or want.shape != got.shape or not _same_bits(want, got):
            bad.append(n)
    return {"checked": len(live), "sampled": len(cols), "mismatch": sorted(bad)}


def _tied_head(model: torch.nn.Module, tensors: dict[str, Any]) -> list[str]:
    """``["lm_head"]`` when the head's logits kernel packs the embedding being loaded (see _refresh_tied_head)."""
    config = getattr(model, "config", None)
    head = getattr(model, "lm_head", None)
    if head is None or not getattr(config, "tie_word_embeddings", False):
        return []
    return ["lm_head"] if any(n.endswith("embed_tokens.weight") for n in tensors) else []


def _kernel_views(host: torch.Tensor, live: torch.Tensor, cols: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``kernel_view`` of the host tensor (its sampled columns) and of the live read-back, at the cost of the
    sample: a row is poisoned by a NaN/Inf in any column, so only rows the live side shows poisoned but the
    sample of the host does not are looked at whole."""
    from ckptdelta.loader.engines.vllm.proof import kernel_view

    if cols is None or host.dim() != 2:
        return kernel_view(host), kernel_view(live)
    want, got = kernel_view(host[:, cols]), kernel_view(live)
    if got.numel() and want.shape == got.shape:
        suspect = (~torch.isfinite(got).all(dim=1)) & torch.isfinite(want).all(dim=1)
        if bool(suspect.any()):
            rows = suspect.nonzero().flatten()
            poisoned = rows[~torch.isfinite(host[rows].float()).all(dim=1)]
            want[poisoned] = float("nan")
    return want, got


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))


def _refresh_tied_head(model: torch.nn.Module, reloaded: dict[str, torch.Tensor]) -> None:
    """Re-pack a tied LM head after its embedding was reloaded.

    On CPU the head's logits kernel holds its own packed copy of the embedding,
    made when the model loaded; ``reload_weights`` re-processes the embedding
    module only (the checkpoint has no ``lm_head.weight`` to send), so without
    this the logits keep the old version's embedding (seen on vLLM 0.32's CPU
    build)."""
    config = getattr(model, "config", None)
    head = getattr(model, "lm_head", None)
    if head is None or not getattr(config, "tie_word_embeddings", False):
        return
    if not any(n.endswith("embed_tokens.weight") for n in reloaded):
        return
    method = getattr(head, "quant_method", None)
    if method is not None and hasattr(method, "process_weights_after_loading"):
        method.process_weights_after_loading(head)
