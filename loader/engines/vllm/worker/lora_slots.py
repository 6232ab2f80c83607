"""vLLM's LoRA slots seen from inside a worker: how a new adapter version is written into one, and proven.

A replica serving a LoRA run (loader/engines/vllm/lora.py) registers K adapters
with vLLM once, at start, and from then on rewrites them in place: each is a
*slot* that holds one version at a time. A hot-load writes the next version into
a slot no request runs on. This module is the worker's half, started through
``/collective_rpc`` (loader/engines/vllm/worker/extension.py) and run in a thread of the
worker. No request runs on the slot until it is proven, so no request ever sees
a half-written slot.

- **The load transform is vLLM's own.** The adapter's tensors (from the replica's
  host copy, each checked against the manifest's digest first) go through
  ``LoRAModel.from_lora_tensors`` and the manager's ``add_adapter`` (which packs
  q/k/v and gate/up and folds the scaling into B), the very steps vLLM runs after
  reading ``adapter_model.safetensors`` in ``load_lora_adapter``; only the
  directory read is left out. The tensors are cloned first: vLLM scales B in
  place, and the host copy must keep the published bits.
- **Off the loop.** Reading and verifying the host copy, the transform, the
  packing and scaling, and the proof's reference (below) run in a worker thread
  (:func:`prepare`, started by one RPC that returns at once) while vLLM
  generates. The same thread then writes (:func:`write_locked`) the slot's rows,
  which no step reads (the slot keeps its index: every slot stays registered,
  active and pinned), beside vLLM's steps: a linear layer's are copied from the
  proof's reference below (what its own ``set_lora`` wrote into a one-slot copy),
  any other layer's are written by its own ``set_lora``;
  then, holding the registry lock that each step's adapter activation and
  vLLM's own LoRA registry calls hold (:func:`install_lora_lock`; not the kernel
  lock a step holds throughout, so the swap waits for no forward pass), the
  registry's entry for the slot is swapped for the prepared LoRAModel: that
  swap is all vLLM's steps wait for.
  The comparison of the slot with the reference runs after, beside vLLM's steps.
  (:func:`write` does it all inside one RPC, in the engine loop.)
- **Pinned.** Every slot adapter is pinned in vLLM's CPU and GPU LoRA caches:
  an adapter evicted and asked for again would be re-read from the directory it
  was first registered from (an old version).
- **The proof** reads the slot back: for every LoRA layer, each of its stacked
  buffers at the slot's index is compared, bit for bit, with what the layer's
  own ``set_lora`` writes for the transform of the verified tensors into a
  one-slot copy of those buffers (so tensor-parallel slicing, packed groups and
  zero padding up to ``--max-lora-rank`` are vLLM's). Layers the adapter does
  not touch must hold zeros there. The reference is written while preparing,
  from the very LoRAModel the write copies, and hashed at once: a second
  transform would run the same code on the same bits (the transform itself is
  held to vLLM's directory load by the tests), while a copy into the wrong rows
  or rows written meanwhile differ from those hashes (as does, for a layer its
  own ``set_lora`` writes, a LoRAModel changed after it was prepared). On the
  CPU the comparison is of the bits' xxh3, as every other proof of ckptdelta:
  hashing is much faster than comparing the bytes.

Nothing here raises through the RPC: loader/engines/vllm/worker/extension.py turns an
exception into ``{"error": ...}``.
"""

from __future__ import annotations

import copy
import threading
import time
from typing import Any, NamedTuple

import torch
import xxhash

from ckptdelta.loader.engines.vllm.worker.shadow import FairLock


class SlotError(RuntimeError):
    """A slot could not be written or does not hold what was written (raised inside the worker)."""


def managers(worker: Any) -> tuple[Any, Any]:
    """(the worker's LoRA manager, its adapter manager); a clear error when vLLM runs without LoRA."""
    wm = getattr(worker.model_runner, "lora_manager", None)
    if wm is None or getattr(wm, "_adapter_manager", None) is None:
        raise SlotError("this vLLM serves no LoRA adapters: start it with --enable-lora")
    return wm, wm._adapter_manager


def describe(worker: Any) -> dict[str, Any]:
    """The registered adapter ids, which slot index each active one holds, and the LoRA limits."""
    wm, mgr = managers(worker)
    cfg = wm.lora_config
    return {"registered": sorted(int(i) for i in mgr.list_adapters()),
            "index_to_id": [None if i is None else int(i) for i in mgr.lora_index_to_id],
            "max_loras": int(cfg.max_loras), "max_cpu_loras": int(cfg.max_cpu_loras or 0),
            "max_lora_rank": int(cfg.max_lora_rank), "lora_dtype": str(cfg.lora_dtype)}


def pin(worker: Any, ids: list[int]) -> dict[str, Any]:
    wm, mgr = managers(worker)
    install_lora_lock(worker.model_runner)
    for i in ids:
        if i not in mgr.list_adapters():
            raise SlotError(f"LoRA adapter id {i} is not registered in this worker")
        wm.pin_adapter(int(i))
    return {"pinned": sorted(ids)}


_LORA_METHODS = ("add_lora", "remove_lora", "pin_lora")
#: The LoRA manager's method each step calls (at its start, before any kernel) to make its requests' adapters
#: active: the only place a step reads or changes the manager's registry.
_STEP_LORA_METHODS = ("set_active_adapters",)


#: Held by every change or read of the LoRA manager's registry: the runner's own LoRA registry calls, each
#: step's ``set_active_adapters``, and a slot write's registry swap (:func:`write_locked`). A step holds it
#: for its adapter activation only, not for its forward pass, so a swap waits at most for that, never for the
#: step in progress (the kernel lock, which a step holds throughout, is taken only where kernels run). Always
#: taken inside the kernel lock where both are held, never around it.
REGISTRY_LOCK = FairLock()


def install_lora_lock(model_runner: Any) -> None:
    """Make the runner's own LoRA registry calls (``/v1/load_lora_adapter``, unloads, pins) hold the kernel
    lock, as its steps do (loader/engines/vllm/worker/shadow.py), and, inside it, :data:`REGISTRY_LOCK`, which
    each step's adapter activation holds too: a slot write from a worker thread (:func:`write_locked`) then
    never meets another change of the LoRA manager, and waits for no step's forward pass. Idempotent."""
    from ckptdelta.loader.engines.vllm.worker.shadow import hold_kernel_lock, hold_lock

    hold_lock(model_runner.lora_manager, _STEP_LORA_METHODS, "_ckptdelta_registry_lock", REGISTRY_LOCK)
    hold_lock(model_runner, _LORA_METHODS, "_ckptdelta_registry_lock", REGISTRY_LOCK)   # inside the kernel lock (next)
    hold_kernel_lock(model_runner, _LORA_METHODS, "_ckptdelta_lora_lock")


def _host_digest(t: torch.Tensor) -> str:
    from ckptdelta.delta import dtypes

    return f"{xxhash.xxh3_64_intdigest(dtypes.host_bits(t.detach().contiguous())):016x}"


def verified_tensors(path: str, digests: dict[str, str], lora_dtype: Any = None) -> dict[str, torch.Tensor]:
    """The named host-copy tensors, each checked against its digest (the manifest's), each the caller's own:
    a clone, except a LoRA A or B weight of another dtype than ``lora_dtype`` (vLLM's LoRA dtype), which
    vLLM's transform casts into a new tensor anyway (``LoRAModel.from_lora_tensors``). Nothing handed on
    may alias the host copy: vLLM scales B in place, and the next hot-load rewrites the host copy. Leaving
    out the clone that the cast makes needless saves a pass over an fp32 adapter (76 MB at rank 64 here)."""
    from ckptdelta.loader.engines.shared_weights import open_tensors

    shared = open_tensors(path, list(digests))
    bad = [n for n, t in shared.items() if _host_digest(t) != digests[n]]
    if bad:
        raise SlotError(f"{len(bad)} adapter tensors in the host copy differ from the snapshot's digests "
                        f"({', '.join(sorted(bad)[:4])})")
    return {n: t if _cast_by_vllm(n, t, lora_dtype) else t.clone() for n, t in shared.items()}


def _cast_by_vllm(name: str, t: torch.Tensor, lora_dtype: Any) -> bool:
    """Whether vLLM's transform makes its own copy of ``t``: a LoRA A or B weight (``.lora_A.`` / ``.lora_B.``
    in PEFT's names; not an embedding's ``lora_embedding_A/B``, nor a module to save, which vLLM keeps as
    given) whose dtype it casts to ``lora_dtype``."""
    return isinstance(lora_dtype, torch.dtype) and t.dtype != lora_dtype and \
        (".lora_A." in name or ".lora_B." in name)


def _lora_dtype(worker: Any) -> Any:
    """The dtype vLLM's transform casts LoRA weights to (what :func:`transform` passes it)."""
    wm, _ = managers(worker)
    return wm.lora_config.lora_dtype


def transform(worker: Any, lora_id: int, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> Any:
    """A LoRAModel exactly as vLLM's ``_load_adapter`` builds it from a directory holding ``tensors`` and
    ``config`` (its checks included: rank within --max-lora-rank, no bias, only modules the model knows),
    not yet packed (the manager's ``add_adapter`` packs and scales)."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.utils import is_base_embedding_weights, parse_fine_tuned_lora_name

    wm, mgr = managers(worker)
    helper = PEFTHelper.from_dict({**config, "vllm_max_position_embeddings": wm.max_position_embeddings})
    helper.validate_legal(wm.lora_config)
    expected: set[str] = set()
    for module in mgr.supported_lora_modules:
        expected.update(mgr.packed_modules_mapping.get(module, [module]))
    model = mgr.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if mapper is not None:
        mapper = mapper.get_rename_mapper()
    skip = getattr(model, "lora_skip_prefixes", None)
    unknown = []
    for name in tensors:
        if is_base_embedding_weights(name) or "base_layer" in name:
            continue
        module_name, _ = parse_fine_tuned_lora_name(name, mapper)
        if skip and LoRAModel._should_skip_module(name, skip):
            continue
        if module_name.rsplit(".", 1)[-1] not in expected and \
                module_name.rsplit(".", 1)[-1] not in (helper.modules_to_save or ()):
            unknown.append(name)
    if unknown:
        raise SlotError(f"vLLM's model has no LoRA layer for {len(unknown)} adapter tensors "
                        f"({', '.join(sorted(unknown)[:3])}); it takes LoRA on {sorted(expected)}")
    return LoRAModel.from_lora_tensors(lora_id, tensors, helper, device="cpu", dtype=_lora_dtype(worker),
                                       model_vocab_size=wm.vocab_size, weights_mapper=mapper, skip_prefixes=skip)


class Prepared(NamedTuple):
    """One adapter version made ready off vLLM's engine loop (:func:`prepare`), for one slot."""

    lora: Any                            # vLLM's LoRAModel, packed and scaled: what add_adapter registers
    path: str                            # the host copy it was read from, and its digests: read again only
    digests: dict[str, str]              # where the write lands at another index than planned
    index: int                           # the slot index activate_adapter will give it
    expected: dict[str, dict[str, list[Any]]]   # what each layer's set_lora writes there (see _expected)
    seconds: float
    parts: dict[str, float] = {}         # seconds of each part: the host copy read and verified, vLLM's transform
                                         # with packing and scaling, the proof's reference
    rows: dict[str, dict[str, list[torch.Tensor]]] = {}   # the reference's one-slot rows of each linear layer,
                                         # which the write copies (see _copy_into)


def next_index(mgr: Any, lora_id: int) -> int:
    """The slot index the write will take: the one ``lora_id`` holds (:func:`write_locked` writes it in
    place), else the first free one, as ``activate_adapter`` gives it."""
    if lora_id in mgr.lora_index_to_id:
        return mgr.lora_index_to_id.index(lora_id)
    if None not in mgr.lora_index_to_id:
        raise SlotError(f"no free LoRA slot index for adapter id {lora_id} ({list(mgr.lora_index_to_id)})")
    return mgr.lora_index_to_id.index(None)


def prepare(worker: Any, lora_id: int, path: str, digests: dict[str, str], config: dict[str, Any]) -> Prepared:
    """Everything a write needs that leaves the live slots alone: the host copy verified, vLLM's load transform
    with its packing and scaling (``_add_adapter`` less the registration), and the proof's reference for the
    slot index the write will take. Runs in a worker thread while vLLM generates (the RPC that starts it
    returns at once), so the engine loop is held only for the copy into the slot and the comparison."""
    t0 = time.perf_counter()
    _, mgr = managers(worker)
    if lora_id not in mgr.list_adapters():
        raise SlotError(f"LoRA adapter id {lora_id} is not registered in this worker (slots: "
                        f"{sorted(mgr.list_adapters())})")
    tensors = verified_tensors(path, digests, _lora_dtype(worker))
    t1 = time.perf_counter()
    lora = _merged(worker, lora_id, tensors, config)
    t2 = time.perf_counter()
    index = next_index(mgr, lora_id)
    rows = _spare_rows(worker)
    expected = expected_slot(worker, lora_id, None, config, index, lora=lora, rows=rows)
    t3 = time.perf_counter()
    return Prepared(lora, path, dict(digests), index, expected, t3 - t0,
                    {"verify_s": t1 - t0, "transform_s": t2 - t1, "reference_s": t3 - t2}, rows)


def _merged(worker: Any, lora_id: int, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> Any:
    """vLLM's load transform of ``tensors`` with the manager's packing and scaling (which scales B in place:
    ``tensors`` must be the caller's own copies)."""
    _, mgr = managers(worker)
    lora = transform(worker, lora_id, tensors, config)
    validate = getattr(mgr, "_validate_moe_lora_format", None)
    if validate is not None:
        validate(lora)
    mgr._create_merged_loras_inplace(lora)
    return lora


def write(worker: Any, lora_id: int, path: str, digests: dict[str, str], config: dict[str, Any],
          prepared: Prepared | None = None) -> dict[str, Any]:
    """Make registered adapter ``lora_id`` the adapter in the host copy at ``path``, in place, and prove it;
    ``prepared``: :func:`prepare`'s result made off the engine loop (else it is made here, inside it)."""
    t0 = time.perf_counter()
    staged = prepared is not None
    if prepared is None:
        prepared = prepare(worker, lora_id, path, digests, config)
    t1 = time.perf_counter()
    _swap_in(worker, lora_id, prepared)
    t2 = time.perf_counter()
    index, checked = _prove_written(worker, lora_id, config, prepared)
    t3 = time.perf_counter()
    return {"id": lora_id, "index": index, "checked": checked, "staged": staged, "prepare_s": prepared.seconds,
            "transform_s": t1 - t0, "write_s": t2 - t1, "prove_s": t3 - t2, "held_s": t3 - t0}


def write_locked(worker: Any, lora_id: int, config: dict[str, Any], prepared: Prepared) -> dict[str, Any]:
    """:func:`write` from a worker thread, not the engine loop, so that vLLM's steps do not wait for the copy.

    The slot keeps its index in vLLM's LoRA buffers (all K slots stay registered, active and pinned), and no
    request runs on it until the replica hears it proven: its rows are read by no step, so they are written
    beside vLLM's steps, copied from the proof's reference for a linear layer (``layers_copied``: what its own
    ``set_lora`` wrote for this LoRAModel into a one-slot copy), by the layer's own ``set_lora`` (or
    ``reset_lora`` for a layer the adapter leaves out) for any other (:func:`_copy_into`).
    Only the registry's entry for the slot (the LoRAModel vLLM would copy in again if it ever re-activated
    it) is swapped holding :data:`REGISTRY_LOCK`, which each step's adapter activation and vLLM's own LoRA
    registry calls hold too: that swap is all vLLM's steps wait for, and it waits for no step's forward pass
    (a step holds the lock only while it activates its adapters). A slot not active (a write that failed half
    way) takes :func:`_swap_in` under the kernel lock as well. The proof runs after, beside vLLM's steps.
    ``write_t`` is when the lock was taken (``time.perf_counter``, the host's monotonic clock), ``lock_wait_s``
    how long it waited for it, ``held_s`` how long vLLM's steps waited, ``write_s`` the copy."""
    from ckptdelta.loader.engines.vllm.worker.shadow import KERNEL_LOCK

    wm, mgr = managers(worker)
    index = _active_index(mgr, lora_id)
    t0 = time.perf_counter()
    if index is not None:
        _copy_into(mgr, index, prepared.lora, prepared.rows)
    t1 = time.perf_counter()
    with REGISTRY_LOCK:
        t2 = time.perf_counter()
        swapped = index is not None and mgr.lora_index_to_id[index] == lora_id
        if swapped:
            mgr._registered_adapters[lora_id] = prepared.lora
            wm.pin_adapter(lora_id)
        t3 = time.perf_counter()
    if not swapped:             # not active, or vLLM moved it meanwhile: vLLM's own path, under both locks
        with KERNEL_LOCK:
            t2 = time.perf_counter()
            with REGISTRY_LOCK:
                _swap_in(worker, lora_id, prepared)
            t3 = time.perf_counter()
    copied = 0 if index is None else len(prepared.rows)
    index, checked = _prove_written(worker, lora_id, config, prepared)
    t4 = time.perf_counter()
    _hand_back(worker, prepared.rows)
    return {"id": lora_id, "index": index, "checked": checked, "staged": True, "prepare_s": prepared.seconds,
            "prepare_parts": prepared.parts, "layers_copied": copied, "transform_s": 0.0,
            "write_s": (t1 - t0) + (t3 - t2), "lock_wait_s": t2 - t1, "held_s": t3 - t2, "prove_s": t4 - t3,
            "write_t": t2}


def _active_index(mgr: Any, lora_id: int) -> int | None:
    """The slot index adapter ``lora_id`` holds in vLLM's buffers, or None (not active, or a layer kind whose
    slot this module does not write in place)."""
    if lora_id not in mgr.lora_index_to_id:
        return None
    if any(hasattr(m, "set_module_to_save") for m in mgr.modules.values()):
        return None          # a classification head's slot: only vLLM's activate_adapter writes it
    return mgr.lora_index_to_id.index(lora_id)


def _copy_into(mgr: Any, index: int, lora: Any, rows: dict[str, dict[str, list[torch.Tensor]]] | None = None) -> None:
    """What vLLM's ``activate_adapter`` writes at ``index`` for ``lora``: each layer's ``set_lora``, or its
    ``reset_lora`` where the adapter has no weights for it. Run beside vLLM's steps: no step reads these rows,
    since every request a LoRA replica sends names a proven slot (a request on the base alone would not do:
    its tokens' index -1 is read as the last slot by vLLM's CPU torch kernels).

    ``rows``: what those very calls wrote for ``lora`` into a one-slot copy of a layer's buffers (the proof's
    reference, :func:`expected_slot`), for the layers whose ``set_lora`` writes nothing but their
    ``*_stacked`` rows: each of those rows is copied, not written again by vLLM's code (one copy per buffer,
    where ``set_lora`` zeroes the rows and then copies each packed slice). The proof compares the slot with the
    reference either way."""
    for name, module in mgr.modules.items():
        held = None if rows is None else rows.get(name)
        if held is not None:
            for k, srcs in held.items():
                for live, src in zip(_at(getattr(module, k), index), srcs, strict=True):
                    live.copy_(src)
            continue
        weights = mgr._get_lora_layer_weights(lora, name)
        if weights:
            module.set_lora(index, weights.lora_a, weights.lora_b)
        else:
            module.reset_lora(index)
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _swap_in(worker: Any, lora_id: int, prepared: Prepared) -> None:
    """The slot's old adapter out, the new one in at the first free index: vLLM's add_adapter less the merge
    (done in prepare()), then its activate_adapter (each layer's set_lora at that index) and the pin."""
    wm, mgr = managers(worker)
    mgr.remove_adapter(lora_id)
    mgr._registered_adapters[lora_id] = prepared.lora
    mgr.activate_adapter(lora_id)
    wm.pin_adapter(lora_id)
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _prove_written(worker: Any, lora_id: int, config: dict[str, Any], prepared: Prepared) -> tuple[int, int]:
    _, mgr = managers(worker)
    index = mgr.lora_index_to_id.index(lora_id)
    expected = prepared.expected if index == prepared.index else \
        expected_slot(worker, lora_id, verified_tensors(prepared.path, prepared.digests, _lora_dtype(worker)), config,
                      index)
    return index, compare(mgr, lora_id, index, expected)


def _stacked(module: Any) -> dict[str, Any]:
    """A LoRA layer's per-slot buffers: each ``*_stacked`` attribute (a tensor or a tuple of them)."""
    return {k: v for k, v in vars(module).items() if k.endswith("_stacked")
            and (isinstance(v, torch.Tensor) or (isinstance(v, tuple) and v and isinstance(v[0], torch.Tensor)))}


def _at(buf: Any, index: int) -> list[torch.Tensor]:
    return [buf[index:index + 1]] if isinstance(buf, torch.Tensor) else [t[index:index + 1] for t in buf]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def expected_slot(worker: Any, lora_id: int, tensors: dict[str, torch.Tensor] | None, config: dict[str, Any],
                  index: int, *, lora: Any = None,
                  rows: dict[str, dict[str, list[torch.Tensor]]] | None = None) -> dict[str, dict[str, list[Any]]]:
    """For every LoRA layer, what its own ``set_lora`` writes at a slot for a transform of ``tensors``
    (packed and scaled as the manager does, kept off its books; or ``lora``, one made so already), in a
    one-slot copy of its buffers at ``index``; layers the adapter leaves out are reset there. Reads the live
    buffers at ``index`` only. ``rows``: filled with those one-slot copies of every layer whose ``set_lora``
    and ``reset_lora`` write only its ``*_stacked`` rows (:func:`_rows_only`), for the write to copy."""
    _, mgr = managers(worker)
    fresh = lora if lora is not None else _merged(worker, lora_id, tensors, config)
    out: dict[str, dict[str, list[Any]]] = {}
    for name, module in mgr.modules.items():
        bufs = _stacked(module)
        if not bufs:
            continue
        one = copy.copy(module)                # a one-slot copy of the layer's buffers, written by its own code
        kept = rows is not None and _rows_only(module)
        spare = rows.get(name) if kept else None
        for k, buf in bufs.items():
            live = _at(buf, index)
            held = spare.get(k) if spare is not None else None
            if held is not None and _alike(held, live):
                # an earlier hot-load's reference rows, handed back (_hand_back): no new pages. Its A and B rows
                # are not refilled from the live rows first (a third of the reference's time at rank 64): a
                # linear layer's own set_lora (the only layers kept, _rows_only) starts with its reset_lora,
                # which zeroes every slice's A and B rows at the index, then copies each slice in, so nothing
                # they held is left. Any other buffer (a classification head's whole weight) set_lora may leave
                # as it is: refilled, as before
                if k not in _REWRITTEN_WHOLE:
                    for h, t in zip(held, live):
                        h.copy_(t)
            else:
                held = [t.clone() for t in live]
            object.__setattr__(one, k, held[0] if isinstance(buf, torch.Tensor) else tuple(held))
        weights = mgr._get_lora_layer_weights(fresh, name)
        if weights:
            one.set_lora(0, weights.lora_a, weights.lora_b)
        else:
            one.reset_lora(0)
        out[name] = {}
        for k in bufs:
            want = getattr(one, k)
            out[name][k] = [_expected(t) for t in ([want] if isinstance(want, torch.Tensor) else want)]
        if kept:
            rows[name] = {k: [getattr(one, k)] if isinstance(getattr(one, k), torch.Tensor) else list(getattr(one, k))
                          for k in bufs}
    return out


#: The stacked buffers a linear LoRA layer's set_lora rewrites whole at its index (reset_lora zeroes them first).
_REWRITTEN_WHOLE = frozenset({"lora_a_stacked", "lora_b_stacked"})


def _alike(held: list[torch.Tensor], live: list[torch.Tensor]) -> bool:
    return len(held) == len(live) and all(
        h.shape == t.shape and h.dtype == t.dtype and h.device == t.device for h, t in zip(held, live))


def _spare_rows(worker: Any) -> dict[str, dict[str, list[torch.Tensor]]]:
    """The reference rows an earlier hot-load's write is done with, to be written again (one slot of every
    linear layer: 10-40 MB for a rank 16-64 adapter of a 0.5 GB model), else an empty set. Reusing them spares
    the preparation a fresh allocation, whose first touch of every page costs more than the copy into it."""
    with _SPARE_LOCK:
        spare = getattr(worker, "_ckptdelta_spare_rows", None)
        worker._ckptdelta_spare_rows = None
    return spare if spare is not None else {}


def _hand_back(worker: Any, rows: dict[str, dict[str, list[torch.Tensor]]]) -> None:
    """``rows`` are no longer read (their write and its proof are done): the next preparation may reuse them.
    Host rows only: a GPU's caching allocator hands out blocks without new pages, and device memory is kept for
    the slots."""
    if any(t.device.type != "cpu" for held in rows.values() for ts in held.values() for t in ts):
        return
    with _SPARE_LOCK:
        worker._ckptdelta_spare_rows = rows


#: Guards a worker's spare reference rows: a preparation takes them, a finished write hands them back.
_SPARE_LOCK = threading.Lock()


def _rows_only(module: Any) -> bool:
    """Whether all that vLLM's ``set_lora`` and ``reset_lora`` change on ``module`` is its ``*_stacked`` rows at
    the index: its linear LoRA layers (``BaseLinearLayerWithLoRA``: zero the rows, copy each slice in). An
    embedding, logits or MoE layer keeps more (and an older vLLM without that class, anything): its own calls
    write it."""
    try:
        from vllm.lora.layers.base_linear import BaseLinearLayerWithLoRA
    except ImportError:
        return False
    return isinstance(module, BaseLinearLayerWithLoRA)


def _bits_digest(t: torch.Tensor) -> int:
    return xxhash.xxh3_64_intdigest(t.contiguous().view(torch.uint8).numpy())


def _expected(t: torch.Tensor) -> "torch.Tensor | int":
    """What a slot buffer is compared with: on the CPU the xxh3 of its bits (hashing runs much faster than
    torch.equal over the bytes, and the comparison runs inside vLLM's engine loop), else the tensor."""
    return _bits_digest(t) if t.device.type == "cpu" else t


def _matches(live: torch.Tensor, want: "torch.Tensor | int") -> bool:
    if isinstance(want, int):
        return live.device.type == "cpu" and _bits_digest(live) == want
    return _same_bits(live, want)


def compare(mgr: Any, lora_id: int, index: int, expected: dict[str, dict[str, list[Any]]]) -> int:
    """Every stacked buffer at slot ``index`` against ``expected``, bit for bit (by xxh3 on the CPU); the count
    compared."""
    checked, bad = 0, []
    for name, module in mgr.modules.items():
        bufs = _stacked(module)
        if not bufs:
            continue
        want = expected.get(name)
        if want is None or set(want) != set(bufs):
            bad.append(name)
            continue
        for k, buf in bufs.items():
            for i, (live, w) in enumerate(zip(_at(buf, index), want[k], strict=True)):
                checked += 1
                if not _matches(live, w):
                    bad.append(f"{name}.{k}[{i}]")
    if bad:
        raise SlotError(f"LoRA slot {index} (adapter id {lora_id}) differs from vLLM's own load of the adapter in "
                        f"{len(bad)} buffers ({', '.join(bad[:4])})")
    return checked


def prove(worker: Any, lora_id: int, path: str, digests: dict[str, str], config: dict[str, Any],
          tensors: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """Read slot ``lora_id`` back from every LoRA layer and compare it with what each layer's own ``set_lora``
    writes for a fresh transform of the verified host-copy tensors (see the module docstring)."""
    t0 = time.perf_counter()
    _, mgr = managers(worker)
    try:
        index = mgr.lora_index_to_id.index(lora_id)
    except ValueError:
        raise SlotError(f"LoRA adapter id {lora_id} is not in any slot") from None
    expected = expected_slot(worker, lora_id,
                             tensors if tensors is not None else verified_tensors(path, digests, _lora_dtype(worker)),
                             config, index)
    checked = compare(mgr, lora_id, index, expected)
    return {"index": index, "checked": checked, "prove_s": time.perf_counter() - t0,
            "held_s": time.perf_counter() - t0}


def slot_digests(worker: Any, lora_id: int) -> dict[str, str]:
    """xxh3 of every stacked buffer at ``lora_id``'s slot index (tests: compare two vLLMs' slots)."""
    _, mgr = managers(worker)
    index = mgr.lora_index_to_id.index(lora_id)
    out = {}
    for name, module in mgr.modules.items():
        for k, buf in _stacked(module).items():
            for i, t in enumerate(_at(buf, index)):
                out[f"{name}.{k}[{i}]"] = f"{_bits_digest(t.cpu()):016x}"
    return out


def listen(worker: Any, where: str) -> str:
    """Serve hot-load writes on a Unix socket at ``where`` (this worker's own path) from a thread of this worker,
    started once: the replica connects, sends one request (a line of JSON:
    ``id``, ``path``, ``digests``, ``config``) and reads one answer line. The thread prepares, writes and proves
    (:func:`prepare`, :func:`write_locked`) at once, without a ``/collective_rpc``, which vLLM
    runs only once the step in progress ends, and the replica hears the answer the moment it is written, without
    polling for it. The socket's directory is the replica's own (mode 0700). Returns the path bound."""
    import os
    import socket
    import threading

    held = getattr(worker, "_ckptdelta_lora_listener", None)
    if held is not None:
        if held != where:
            raise SlotError(f"this worker serves LoRA writes at {held} already, not {where}")
        return held
    if os.path.exists(where):
        os.unlink(where)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(where)
    os.chmod(where, 0o600)
    srv.listen(4)
    threading.Thread(target=_serve, args=(worker, srv), name="ckptdelta-lora-writes", daemon=True).start()
    worker._ckptdelta_lora_listener = where
    return where


def _serve(worker: Any, srv: Any) -> None:
    import json

    from ckptdelta.delta.omp import serial_here
    from ckptdelta.loader.engines.vllm.worker.readback import KERNEL_GUARD
    from ckptdelta.loader.engines.vllm.worker.shadow import KERNEL_LOCK

    KERNEL_GUARD.set(lambda: KERNEL_LOCK)         # as a BackgroundJob's: its kernel calls hold the kernel lock
    serial_here()                                 # this thread's torch ops on this thread alone (delta/omp.py)
    while True:
        conn, _ = srv.accept()
        with conn:
            try:
                with conn.makefile("rb") as f:
                    line = f.readline()
                if not line:
                    continue                      # the replica gave up before sending: nothing to do
                req = json.loads(line)
                lora_id, config = int(req["id"]), dict(req["config"])
                p = prepare(worker, lora_id, str(req["path"]), dict(req["digests"]), config)
                out = {"state": "ready", **write_locked(worker, lora_id, config, p)}
            except Exception as e:  # noqa: BLE001 - the replica reads why in the answer
                out = {"state": "failed", "why": f"{type(e).__name__}: {e}"}
            try:
                conn.sendall((json.dumps(out) + "\n").encode())
            except OSError:
                pass                              # the replica is gone; the next request is another connection
